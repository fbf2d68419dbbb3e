"""More training seeds of one drafter's baseline / VAT pair, on a demo recipe's own data and feature cache.

The demo trains every arm in one process and a seed costs all four arms; to narrow one pair's interval
this trains only that pair (in lockstep, as the demo does) for seeds FIRST..LAST-1, and prints each seed's
final held-out tau_sim per arm, VAT - baseline per chain with its 95% paired-bootstrap interval, and
the mean over the seeds with a 95% Student-t interval (``stats.across_seeds``, as the demo's
across-seeds section). Same configs as ``vatspec demo`` (``demo.arm_configs``), so a seed here equals
that seed's pair in the demo on the same CPU.

    .venv/bin/python scripts/more_seeds.py --size full --kind dflash --seeds 5:15 --out runs/more-seeds-dflash

VAT's parts: ``--arm NAME="OVERRIDES"`` (repeatable) adds an arm trained in lockstep with the pair: the VAT
arm's config with OVERRIDES on top (e.g. ``--arm no_head="loss.head=false"``); each is compared with the
baseline and with VAT, seed by seed (difference of held-out means) and across seeds. ``--pair-from DIR``
reads the pair's per-seed results from an earlier run's DIR/summary.json (same size and kind) instead of
training them again; its seeds that are missing there are trained.

    .venv/bin/python scripts/more_seeds.py --size full --kind eagle3 --seeds 5:10 --out runs/vat-parts-eagle3 \\
        --pair-from runs/more-seeds-eagle3 --arm no_head="loss.head=false" --arm no_hard="loss.hard=false"

Reads the recipe's regenerated data under $VATSPEC_HOME/demo (what ``vatspec demo [--full]`` made), and
regenerates it when missing (``demo.prepare_training_data``: the long recipe's 512 prompts took 8 min on 2
cores); the feature cache beside it is made if missing. Writes OUT/seed<S>/<arm>/ run folders and
OUT/summary.json (rewritten after every seed, so a stopped run keeps what it finished; a later run into
the same OUT with other seeds adds them, and the across-seeds figures cover all of them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
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


def parse_arm(text: str) -> tuple[str, list[str]]:
    name, eq, overrides = text.partition("=")
    if not eq or not name or not name.replace("_", "").isalnum():
        raise SystemExit(f"--arm {text!r}: want NAME=\"OVERRIDES\" with NAME of letters, digits and _")
    return name, shlex.split(overrides)


def read_summary(path: Path, size: str, kind: str, arms: dict[str, str] | None = None) -> dict:
    """An earlier run's summary.json, refused when it was written for another size or kind (or, given
    ``arms``, another set of extra arms)."""
    summary = json.loads(path.read_text())
    have, this = f"size {summary.get('size')!r}, kind {summary.get('kind')!r}", f"--size {size} --kind {kind}"
    differs = (summary.get("size"), summary.get("kind")) != (size, kind)
    if arms is not None:
        have, this = f"{have}, arms {summary.get('arms', {})}", f"{this}, arms {arms}: choose another --out"
        differs = differs or summary.get("arms", {}) != arms
    if differs:
        raise SystemExit(f"{path}: {have}; this run is {this}")
    return summary


def earlier_pair(path: Path, size: str, kind: str) -> dict[int, dict]:
    """seed -> that seed's row of an earlier run's summary.json (the pair's held-out results)."""
    return {row["seed"]: row for row in read_summary(path / "summary.json", size, kind)["seeds"]}


def kept_rows(path: Path, size: str, kind: str, arms: dict[str, str], seeds: range) -> list[dict]:
    """The seeds an earlier run into the same OUT finished, outside ``seeds`` (so a later range adds to
    them); refuses an OUT whose summary.json was written for another size, kind or set of arms."""
    if not path.exists():
        return []
    return [r for r in read_summary(path, size, kind, arms)["seeds"] if r["seed"] not in seeds]


def summarise(rows: list[dict], base: str, vat: str, extras: list[str]) -> dict:
    """Across the seeds (>= 2): VAT - baseline, and each extra arm - baseline and - VAT, as the mean of
    the per-seed differences with a 95% Student-t interval (``stats.across_seeds``)."""
    if len(rows) < 2:
        return {}
    return {"across_seeds": across_seeds([r["diff"]["estimate"] for r in rows],
                                         [r[base]["tau_sim"] for r in rows]).to_dict(),
            "arms_across_seeds": {n: {b: across_seeds([r[n]["vs"][b] for r in rows],
                                                      [r[b]["tau_sim"] for r in rows]).to_dict()
                                      for b in (base, vat)} for n in extras}}


def interval(d: dict) -> str:
    return f"{d['estimate']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]" + (
        " (contains 0)" if d["low"] <= 0 <= d["high"] else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=["default", "full"], default="full")
    ap.add_argument("--kind", choices=["eagle3", "dflash"], default="dflash")
    ap.add_argument("--seeds", default="5:15", help="FIRST:LAST, training seeds FIRST..LAST-1")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--arm", action="append", default=[], metavar='NAME="OVERRIDES"',
                    help="an extra arm: the VAT arm's config with these overrides (repeatable)")
    ap.add_argument("--pair-from", type=Path, help="an earlier run's folder: read the pair's seeds from it")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    first, last = (int(x) for x in args.seeds.split(":"))
    vat, base = next((v, b) for v, b in BASELINE_OF.items() if ARMS[b][0] == args.kind)
    parsed = [parse_arm(a) for a in args.arm]
    extras = dict(parsed)
    if len(extras) < len(parsed):
        raise SystemExit(f"--arm: two arms share a name: {[n for n, _ in parsed]}")
    arm_text = {n: " ".join(ov) for n, ov in extras.items()}
    known = earlier_pair(args.pair_from, args.size, args.kind) if args.pair_from else {}
    loss_overrides = {n: [f"drafter.kind={args.kind}", "loss.kind=vat", *ov] for n, ov in extras.items()}
    size = SIZES[args.size]
    target = open_target("default", device="cpu", dtype="float32")
    data, _ = prepare_training_data(target, size, vatspec_home(), progress=False)  # cached: resumes or reads it
    features, _ = prepare_features(target, data, arm_configs(list(ARMS), size, data, args.out), progress=False)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = kept_rows(args.out / "summary.json", args.size, args.kind, arm_text, range(first, last))
    for seed in range(first, last):
        t0 = time.perf_counter()
        names = [*([] if seed in known else [base, vat]), *extras]
        cfgs = arm_configs(names, dataclasses.replace(size, seed=seed), data, args.out / f"seed{seed}",
                           loss_overrides=loss_overrides, features=features)
        finals = dict(zip(names, train_lockstep(cfgs, progress=False)))
        chains = {n: f.pop(CHAINS_KEY) for n, f in finals.items()}
        row = {"seed": seed, "seconds": time.perf_counter() - t0,
               **{n: {"tau_sim": f["tau_sim"], "acc": f.get("acc")} for n, f in finals.items()}}
        if seed in known:
            row.update({n: known[seed][n] for n in (base, vat)}, diff=known[seed]["diff"],
                       pair_from=str(args.pair_from))
        else:
            row["diff"] = paired_tau_sim(chains, {vat: base})[vat]
        for n in extras:  # difference of held-out means: the same chains for every arm of a seed
            row[n]["vs"] = {b: row[n]["tau_sim"] - row[b]["tau_sim"] for b in (base, vat)}
        rows = sorted([*rows, row], key=lambda r: r["seed"])
        print(f"seed {seed}: " + "  ".join(f"{n} {row[n]['tau_sim']:.3f}" for n in (base, vat, *extras))
              + f"  VAT diff {interval(row['diff'])}  ({row['seconds'] / 60:.1f} min)", flush=True)
        summary = {"size": args.size, "kind": args.kind, "pair": [vat, base],
                   "arms": arm_text, "seeds": rows,
                   **summarise(rows, base, vat, list(extras))}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if len(rows) >= 2:
        print(f"held-out tau_sim per chain, mean over {len(rows)} seeds with a 95% interval:")
        print(f"  {vat} - {base}: {interval(summary['across_seeds'])}")
        for n, vs in summary["arms_across_seeds"].items():
            print(f"  {n} - {base}: {interval(vs[base])};  {n} - {vat}: {interval(vs[vat])}")


if __name__ == "__main__":
    main()
