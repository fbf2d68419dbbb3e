"""The demo's feature cache with its target pass in float32 and under bf16 autocast, side by side, and the
demo's four arms trained from each.

    .venv/bin/python perf/bench_cache_precision.py --out runs/cache-precision [--seeds 0 1] [--threads 2]

Takes the demo's regenerated training set under $VATSPEC_HOME/demo (what ``vatspec demo`` made; regenerated
when missing) and writes its feature cache twice in one process, ``precision="fp32"`` and ``"bf16"`` (float32
storage, the demo's layers and length; ``--repeat`` rounds, the order alternating, ``timer.SideBySide``): the
seconds of each and their ratio, how often the target's argmax label (the lm_head on the cached final hidden
state, in float32) agrees between the two, and the relative change of each stored tensor. Then, per seed,
trains the demo's four arms from each cache (the ``demo`` recipe's, ``experiment.arm_configs`` and
``train_lockstep``: a seed here equals that seed's demo arms on the same CPU) and prints each arm's held-out
tau_sim and bf16 - fp32 per chain with its 95% paired-bootstrap interval. Writes OUT/fp32, OUT/bf16 (the
caches), OUT/seed<S>-<precision>/<arm>/ run folders and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from timer import SideBySide

PRECISIONS = ("fp32", "bf16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="training seeds (none: the caches only)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the two cache writes (each rewrites both)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vatspec import data as D
    from vatspec.eval.stats import paired_difference
    from vatspec.features import config_layer_ids, write_cache
    from vatspec.outputs import vatspec_home
    from vatspec.target import open_target
    from vatspec_recipes.experiment import FEATURE_DTYPE, arm_configs, prepare_training_data, train_lockstep
    from vatspec_recipes.recipe import load_recipe

    recipe = load_recipe("demo")
    size = dataclasses.replace(recipe.size, precision="bf16")
    target = open_target("default", device="cpu", dtype="float32")
    data_path, _ = prepare_training_data(target, size, vatspec_home(), progress=False)
    convs = D.load_conversations(data_path)
    probe = arm_configs(recipe.arms, size, data_path, args.out / "probe")
    layers = sorted({i for c in probe for i in config_layer_ids(c.drafter, target.num_layers)})
    summary: dict = {"data": str(data_path), "layers": layers}
    t = SideBySide(PRECISIONS, repeats=args.repeat, warmup=0)
    for _, order in t.rounds():
        for p in order:
            shutil.rmtree(args.out / p, ignore_errors=True)
            with t.time(p):
                write_cache(target, convs, args.out / p, layer_ids=layers, dtype=FEATURE_DTYPE, precision=p,
                            max_length=size.max_length, source=str(data_path), progress=False)
            print(f"cache, target pass in {p}: {t.seconds[p][-1]:.1f} s", flush=True)
    summary["cache_seconds"] = {p: t.median(p) for p in PRECISIONS}
    t.report(base="fp32")

    agree = tokens = 0
    change: dict[str, list[float]] = {}
    for shard in sorted((args.out / "fp32").glob("shard-*.safetensors")):
        a, b = load_file(shard), load_file(args.out / "bf16" / shard.name)
        la, lb = (_labels(target, t["hidden"]) for t in (a, b))
        agree, tokens = agree + int((la == lb).sum()), tokens + la.numel()
        for key in a:
            if a[key].is_floating_point():
                change.setdefault(key, []).append(float((b[key] - a[key]).norm() / a[key].norm()))
    summary["label_agreement"] = agree / tokens
    summary["relative_change"] = {k: max(v) for k, v in change.items()}
    print(f"argmax labels equal at {agree / tokens:.4f} of {tokens} tokens; largest relative change per tensor: "
          + ", ".join(f"{k} {v:.1e}" for k, v in summary["relative_change"].items()), flush=True)

    summary["seeds"] = {}
    for seed in args.seeds:
        runs = {}
        for p in PRECISIONS:
            t0 = time.perf_counter()
            train_lockstep(arm_configs(recipe.arms, size, data_path, args.out / f"seed{seed}-{p}",
                                       features=args.out / p, train_seed=seed), progress=False)
            print(f"seed {seed}, {p} cache: trained in {time.perf_counter() - t0:.0f} s", flush=True)
            runs[p] = {name: json.loads((args.out / f"seed{seed}-{p}" / name / "heldout_chains.json").read_text())
                       for name in _run_names(args.out / f"seed{seed}-{p}")}
        rows = {}
        for name in runs["fp32"]:
            a, b = runs["bf16"][name], runs["fp32"][name]
            d = paired_difference(a["chain_accepted"], b["chain_accepted"])
            rows[name] = {"fp32": b["tau_sim"], "bf16": a["tau_sim"], "diff": [d.estimate, d.low, d.high]}
            print(f"seed {seed} {name:>12}: held-out tau_sim fp32 {b['tau_sim']:.3f}, bf16 {a['tau_sim']:.3f}: "
                  f"{d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}] over {len(a['chain_accepted'])} chains",
                  flush=True)
        summary["seeds"][seed] = rows
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


@torch.no_grad()
def _labels(target, hidden: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """The target's argmax label at each row of ``hidden``, ``rows`` at a time (a shard's whole [N, V] logits
    would be ~8 GB for the demo's cache)."""
    return torch.cat([target.logits(h).argmax(-1) for h in hidden.split(rows)])


def _run_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / "heldout_chains.json").is_file())


if __name__ == "__main__":
    raise SystemExit(main())
