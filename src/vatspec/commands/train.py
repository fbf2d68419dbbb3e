"""``vatspec train``: train an EAGLE-3 or DFlash drafter (``vatspec.train``) from a config.

    vatspec train data.train=prompts.jsonl drafter=eagle3 loss=vat train.steps=200
    vatspec train --config run.yaml --resume
"""

from __future__ import annotations

import argparse

from vatspec.checkpoint import CheckpointError
from vatspec.commands import report
from vatspec.config import ConfigError, load_config
from vatspec.data import DataError
from vatspec.features import FeatureCacheError
from vatspec.target import TargetError
from vatspec.train import TrainError, train


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. loss.kind=vat)")
    parser.add_argument("--config", help="YAML file of overrides")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir")
    parser.add_argument("--init-from", help="start from an existing draft (checkpoint or exported folder)")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        metrics = train(cfg, resume=args.resume, init_from=args.init_from, progress=not args.no_progress)
    except (ConfigError, TrainError, CheckpointError, DataError, TargetError, FeatureCacheError) as e:
        return report("train", e)
    if metrics:
        keys = ["tau_sim", "mean_first_reject", "post_reject_match", "loss"]
        print("held-out: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    return 0
