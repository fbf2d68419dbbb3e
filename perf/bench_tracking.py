"""Step time of the demo's lockstep arms with no experiment tracker vs with trackers (``train.report_to``), side by
side in one process.

Each path trains its own copy of the recipe's arms from the demo's feature cache, on the same batches, one
optimizer step per round, the order rotated every round (``timer.SideBySide``), and logs every step as
``vatspec train`` does at the demo's ``train.log_every=1``: through each path's own ``Checkpointer`` (``log``),
``none`` to ``metrics.jsonl`` only, ``trackers`` to ``metrics.jsonl`` and every tracker of ``--trackers``. The
step is the loop's own (``loop.accumulate``, ``loop.apply_step``); held-out evaluations, the same for both paths,
are left out. Goal: trackers / none <= 1.02.

    .venv/bin/python perf/bench_tracking.py [--trackers tensorboard,wandb,trackio,mlflow] [--steps 16] [--threads 2]
    .venv/bin/python perf/bench_tracking.py --recipe demo-quick --steps 2     # a quick check at the small size

Needs the recipe's feature cache (``vatspec demo`` makes the demo's, ``vatspec demo --quick`` demo-quick's).
wandb runs offline and Trackio and MLflow write under a temporary folder unless the environment says
otherwise (WANDB_MODE, TRACKIO_DIR, MLFLOW_TRACKING_URI).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from timer import SideBySide

from vatspec.config import parse_report_to
from vatspec.outputs import vatspec_home
from vatspec.target import open_target
from vatspec.train import Checkpointer, build_arm, load_training_data, lockstep_key
from vatspec.train.loop import accumulate, apply_step, peak_memory_mib
from vatspec.train.tracking import check_installed
from vatspec_recipes.demo import with_trackers
from vatspec_recipes.experiment import arm_configs, train_precision
from vatspec_recipes.recipe import load_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="demo", help="the recipe whose arms and size are timed (default: demo)")
    ap.add_argument("--trackers", default="tensorboard,wandb,trackio,mlflow")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per path")
    args = ap.parse_args()
    trackers = parse_report_to(args.trackers, "--trackers")
    check_installed(trackers, "--trackers")
    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    size = dataclasses.replace(recipe.size, precision=train_precision(recipe.size))
    home = vatspec_home() / "demo"
    stem = f"regen-n{size.prompts}-t{size.regen_tokens}-s{size.seed}"
    data, cache_dir = home / f"{stem}.jsonl", home / f"{stem}.features-m{size.max_length}"
    if not cache_dir.is_dir():
        raise SystemExit(f"{cache_dir}: no feature cache; run `vatspec demo{' --quick' * (args.recipe != 'demo')}` "
                         "first")
    tmp = Path(tempfile.mkdtemp(prefix="bench_tracking-"))
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("TRACKIO_DIR", str(tmp / "trackio"))  # read when trackio is first imported
    target = open_target("default", device="cpu", dtype="float32")
    paths = {"none": (), "trackers": trackers}
    with ExitStack() as locks:  # the Checkpointers close their trackers with it
        runs = {path: [] for path in paths}  # path -> its lockstep groups (arms sharing batches), as train_lockstep
        for path, names in paths.items():
            groups: dict[str, list] = {}
            for c in arm_configs(with_trackers(recipe, names).arms, size, data, tmp / path, features=cache_dir):
                groups.setdefault(lockstep_key(c), []).append(c)
            for cfgs in groups.values():
                td = load_training_data(cfgs, target, device=target.device)
                arms = [build_arm(c, td.target, td.counts, td.total, device=target.device) for c in cfgs]
                run = Checkpointer(cfgs, locks, is_main=True, world=1)
                run.open({}, resume=False)
                run.start(arms, td.stats, 0)
                for arm in arms:
                    arm.model.train()
                runs[path].append((arms, td, run))
        t = SideBySide(list(paths), repeats=args.steps, warmup=1)
        for step, order in t.rounds():  # round 0 warms up; both paths take the same batches (same seed)
            for path in order:
                with t.time(path):
                    for arms, td, run in runs[path]:
                        _step(arms, td, run, step, target.device)
    print(f"{args.recipe}: {len(recipe.arms)} arms ({', '.join(recipe.arms)}) in {len(runs['none'])} lockstep "
          f"group(s), {size.batch_size} x "
          f"{size.max_length} tokens, {size.precision}, {args.threads} threads; seconds of one logged step over "
          f"{args.steps} steps; trackers: {', '.join(trackers)} (files under {tmp})")
    t.report(base="none")


def _step(arms, td, run: Checkpointer, step: int, device) -> None:
    """One optimizer step of a lockstep group, logged: ``loop._loop``'s step and record, held-out evaluation aside."""
    t0 = time.perf_counter()
    accs, parts, n_tokens = accumulate(arms, td, step, 0, device)
    norms = [apply_step(arm) for arm in arms]
    tokens_per_s = n_tokens / (time.perf_counter() - t0)
    for arm, acc, part, norm in zip(arms, accs, parts, norms):
        record = {"step": step + 1, "lr": arm.sched.get_last_lr()[0], "grad_norm": norm, "tokens_per_s": tokens_per_s,
                  **part, **{f"train/{k}": v for k, v in acc.summary().items()},
                  "peak_memory_mib": peak_memory_mib(device)}
        run.log(arm, record)


if __name__ == "__main__":
    main()
