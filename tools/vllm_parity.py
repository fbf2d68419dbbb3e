"""Do exported drafts decode in vLLM (or SGLang) as they do in vatspec? Same prompts, same k, greedy, both engines.

For each draft (a run or checkpoint folder), `vatspec export` writes its served folder (``--weights-dtype``; EAGLE-3
as ``--eagle3-format``, `eagle3-hf` by default, DFlash as `dflash`); vatspec's decode loop opens that
folder (the weights the engine reads) and decodes the bundled benchmarks' prompts 2..(2 + --per-bench) at
temperature 0 with k drafted tokens per round; then `tools/vllm_generate.py` (``--engine vllm``) or
`tools/sglang_generate.py` (``--engine sglang``; DFlash at k = block size - 1), run by ``--engine-python`` (an
environment holding that engine), decodes the same prompts with the target alone and with each served draft.
Printed per draft:
- lossless: does the engine's speculative output equal its own target-only output, and vatspec's?
- acceptance: drafted tokens accepted per round (the engine's counters; vatspec's rounds), overall and per
  drafted position, and the difference engine - vatspec in accepted tokens per round with a 95% paired
  bootstrap over prompts. Where the two engines' greedy texts part (float rounding at a near-tie), the
  drafts are scored on different text from there on; the prompts whose texts agree are reported apart.

    VATSPEC_HOME=... .venv/bin/python tools/vllm_parity.py --engine-python /path/to/vllm-venv/bin/python \\
        --out runs/vllm-parity EAGLE3=reports/demo/runs/eagle3 DFLASH=reports/demo/runs/dflash
    .venv/bin/python tools/vllm_parity.py --engine sglang --engine-python ~/sglang-cpu/bin/python \\
        --out runs/sglang-parity --per-bench 1 --max-tokens 32 EAGLE3=reports/demo/runs/eagle3

Measured with it: docs/serving.md, "Served in vLLM" and "Served in SGLang".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from vatspec import benchmarks
from vatspec.config import load_config
from vatspec.drafts import open_draft
from vatspec.eval import bench
from vatspec.eval.decode import generate
from vatspec.eval.stats import paired_difference
from vatspec.target import open_target

HERE = Path(__file__).resolve().parent


def ours(target, drafter, prompts, k: int, max_tokens: int) -> dict:
    out = {"tokens": [], "drafts": [], "draft_tokens": [], "accepted": [], "accepted_per_pos": []}
    for ids in prompts:
        res = generate(target, ids, drafter, k=k, max_new_tokens=max_tokens)
        rounds = [r for r in res.rounds if r.drafted > 0]
        out["tokens"].append(res.tokens)
        out["drafts"].append(len(rounds))
        out["draft_tokens"].append(sum(r.drafted for r in rounds))
        out["accepted"].append(sum(r.accepted for r in rounds))
        out["accepted_per_pos"].append([sum(r.accepted > j for r in rounds) for j in range(k)])
    return out


def rate(r: dict, keep=None) -> str:
    idx = [i for i in range(len(r["drafts"])) if keep is None or i in keep]
    d = sum(r["drafts"][i] for i in idx)
    if d == 0:
        return "no rounds"
    per_pos = [sum(r["accepted_per_pos"][i][j] for i in idx) / d for j in range(len(r["accepted_per_pos"][0]))]
    return (f"{sum(r['accepted'][i] for i in idx) / d:.3f} accepted per round over {d} rounds "
            f"(per position {' '.join(f'{p:.3f}' for p in per_pos)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("drafts", nargs="+", help="NAME=RUN: a run or checkpoint folder")
    ap.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    ap.add_argument("--engine-python", "--vllm-python", dest="engine_python", required=True,
                    help="the Python of an environment holding the engine")
    ap.add_argument("--out", type=Path, required=True, help="a folder: served drafts, prompts, both engines' output")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--per-bench", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eagle3-format", choices=("eagle3-hf", "speculators"), default="eagle3-hf",
                    help="the export format of EAGLE-3 drafts (DFlash drafts: dflash)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the exported weights and the engine's model dtype (vatspec decodes in float32 either way)")
    ap.add_argument("--skip-engine", "--skip-vllm", dest="skip_engine", action="store_true",
                    help="reuse --out/ENGINE.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pairs = []
    for spec in args.drafts:
        name, sep, run = spec.partition("=")
        if not sep or not Path(run).exists():
            raise SystemExit(f"{spec!r}: expected NAME=RUN with RUN an existing run or checkpoint folder")
        drafter = load_config(Path(run) / "config.yaml").drafter  # a run folder and each checkpoint hold one
        kind = drafter.kind
        if args.engine == "sglang" and kind == "dflash" and args.k != drafter.block_size - 1:
            raise SystemExit(f"{spec!r}: SGLang drafts DFlash's whole block (--k {drafter.block_size - 1} for its "
                             f"block of {drafter.block_size}); vatspec's k = {args.k} would verify fewer tokens")
        pairs.append((name, Path(run), kind))
    args.out.mkdir(parents=True, exist_ok=True)
    target = open_target("default", device="cpu", dtype="float32")
    prompts = [bench.prompt_ids(target.tokenizer, c) for b in benchmarks.list_benchmarks()
               for c in benchmarks.load_benchmark(b)[2 : 2 + args.per_bench]]
    (args.out / "prompts.json").write_text(json.dumps(prompts))
    served = {}
    for name, run, kind in pairs:
        served[name] = args.out / "served" / name
        fmt = ["--format", args.eagle3_format] if kind == "eagle3" else []
        subprocess.run([sys.executable, "-m", "vatspec.cli", "export", str(run), "--out", str(served[name]),
                        "--weights-dtype", args.dtype, "--force", *fmt], check=True, stdout=subprocess.DEVNULL)
    mine = {"target": ours(target, None, prompts, args.k, args.max_tokens)}
    for name, path in served.items():
        drafter, _ = open_draft(path, target)
        mine[name] = ours(target, drafter, prompts, args.k, args.max_tokens)
    (args.out / "vatspec.json").write_text(json.dumps(mine))
    label = {"vllm": "vLLM", "sglang": "SGLang"}[args.engine]
    result = args.out / f"{args.engine}.json"
    if not args.skip_engine:
        cmd = [args.engine_python, str(HERE / f"{args.engine}_generate.py"), "--target", str(target.path),
               "--prompts", str(args.out / "prompts.json"), "--out", str(result),
               "--k", str(args.k), "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
        cmd += [f"--draft={n}={p}" for n, p in served.items()]
        subprocess.run(cmd, check=True)
    theirs = json.loads(result.read_text())
    ref_v, ref_o = theirs["target"]["tokens"], mine["target"]["tokens"]
    same_ar = sum(a == b for a, b in zip(ref_v, ref_o))
    print(f"{len(prompts)} prompts, k = {args.k}, {args.max_tokens} tokens; target alone: {label}'s greedy text "
          f"equals vatspec's on {same_ar}/{len(prompts)} prompts")
    for name in served:
        v, o = theirs[name], mine[name]
        lossless = sum(a == b for a, b in zip(v["tokens"], ref_v))
        agree = {i for i, (a, b) in enumerate(zip(v["tokens"], o["tokens"])) if a == b}
        print(f"== {name}: {label}'s speculative text equals its target-only text on {lossless}/{len(prompts)} "
              f"prompts, vatspec's speculative text on {len(agree)}/{len(prompts)}")
        print(f"   {label + ':':8} {rate(v)}\n   vatspec: {rate(o)}")
        if agree and len(agree) < len(prompts):
            print(f"   the {len(agree)} prompts whose texts agree: {label} {rate(v, agree)}; vatspec {rate(o, agree)}")
        diff = paired_difference(v["accepted"], o["accepted"], v["drafts"], o["drafts"])
        print(f"   accepted per round, {label} - vatspec: {diff.estimate:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}] "
              "(95%, prompts resampled)")
        if theirs.get("emulated"):
            continue  # SGLang's GPU code on a CPU, Triton interpreted: its wall time is not a speed
        # engines run one after another, not interleaved: read the speedup against both target-alone runs
        walls = [sum(theirs[t]["wall_s"]) for t in ("target", "target_again") if t in theirs]
        print(f"   {label} wall time {sum(v['wall_s']):.1f} s against the target alone's "
              + " / ".join(f"{w:.1f}" for w in walls) + " s: speedup "
              + " / ".join(f"{w / sum(v['wall_s']):.2f}x" for w in walls))


if __name__ == "__main__":
    main()
