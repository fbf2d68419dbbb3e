"""More training seeds of one drafter's baseline / VAT pair, on a demo recipe's own data and feature cache.

The demo trains every arm in one process and a seed costs all four arms; to narrow one pair's interval
this trains only that pair (in lockstep, as the demo does) for seeds FIRST..LAST-1, and prints each seed's
final held-out tau_sim per arm, VAT - baseline per chain with its 95% paired-bootstrap interval, and
the mean over the seeds with a 95% Student-t interval (``stats.across_seeds``, as the demo's
across-seeds section). Same configs as ``vatspec demo`` (``demo.arm_configs``), so a seed here equals
that seed's pair in the demo on the same CPU.

    .venv/bin/python scripts/more_seeds.py --size full --kind dflash --seeds 5:15 --out runs/more-seeds-dflash

Reads the recipe's regenerated data under $VATSPEC_HOME/demo (what ``vatspec demo [--full]`` made), and
regenerates it when missing (``demo.prepare_training_data``: the long recipe's 512 prompts took 8 min on 2
cores); the feature cache beside it is made if missing. Writes OUT/seed<S>/<arm>/ run folders and
OUT/summary.json (rewritten after every seed, so a stopped run keeps what it finished).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from vatspec.demo import (
    ARMS,
    BASELINE_OF,
    SIZES,
    arm_configs,
    paired_tau_sim,
    prepare_features,
    prepare_training_data,
    train_lockstep,
)
from vatspec.stats import across_seeds
from vatspec.target import open_target, vatspec_home
from vatspec.train import CHAINS_KEY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["default", "full"], default="full")
    ap.add_argument("--kind", choices=["eagle3", "dflash"], default="dflash")
    ap.add_argument("--seeds", default="5:15", help="FIRST:LAST, training seeds FIRST..LAST-1")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    first, last = (int(x) for x in args.seeds.split(":"))
    vat, base = next((v, b) for v, b in BASELINE_OF.items() if ARMS[b][0] == args.kind)
    size = SIZES[args.size]
    target = open_target("default", device="cpu", dtype="float32")
    data, _ = prepare_training_data(target, size, vatspec_home(), progress=False)  # cached: resumes or reads it
    features, _ = prepare_features(target, data, arm_configs(list(ARMS), size, data, args.out), progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in range(first, last):
        t0 = time.perf_counter()
        cfgs = arm_configs([base, vat], dataclasses.replace(size, seed=seed), data, args.out / f"seed{seed}",
                           features=features)
        finals = dict(zip((base, vat), train_lockstep(cfgs, progress=False)))
        chains = {n: f.pop(CHAINS_KEY) for n, f in finals.items()}
        diff = paired_tau_sim(chains, {vat: base})[vat]
        rows.append({"seed": seed, "seconds": time.perf_counter() - t0, **{
            n: {"tau_sim": f["tau_sim"], "acc": f.get("acc")} for n, f in finals.items()}, "diff": diff})
        print(f"seed {seed}: {base} {finals[base]['tau_sim']:.3f}  {vat} {finals[vat]['tau_sim']:.3f}  "
              f"diff {diff['estimate']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]  "
              f"({rows[-1]['seconds'] / 60:.1f} min)", flush=True)
        summary = {"size": args.size, "kind": args.kind, "pair": [vat, base], "seeds": rows}
        if len(rows) >= 2:
            summary["across_seeds"] = across_seeds([r["diff"]["estimate"] for r in rows],
                                                   [r[base]["tau_sim"] for r in rows]).to_dict()
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if len(rows) >= 2:
        a = summary["across_seeds"]
        print(f"{vat} - {base}, held-out tau_sim per chain, mean over {len(rows)} seeds: {a['estimate']:+.3f} "
              f"[{a['low']:+.3f}, {a['high']:+.3f}]" + (" (contains 0)" if a["low"] <= 0 <= a["high"] else ""))


if __name__ == "__main__":
    main()
