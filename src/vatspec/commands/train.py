"""``vatspec train``: train an EAGLE-3 or DFlash drafter (``vatspec.train``) from a config.

    vatspec train data.train=prompts.jsonl drafter=eagle3 loss=vat train.steps=200
    vatspec train --config run.yaml --resume
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vatspec.checkpoint import CheckpointError
from vatspec.commands import report
from vatspec.config import ConfigError, load_config
from vatspec.data import DataError
from vatspec.features import FeatureCacheError
from vatspec.target import TargetError
from vatspec.train import MIN_SUPERVISED, TrainError, finished, train


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. loss.kind=vat)")
    parser.add_argument("--config", help="YAML file of overrides")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir (a finished run: "
                                                              "nothing to do)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="--resume from a checkpoint of an older vatspec, whose trainer state is pickled "
                             "(trainer.pt); only for a folder you trust")
    parser.add_argument("--init-from", help="start from an existing draft (checkpoint or exported folder)")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
        if args.resume and (step := finished(cfg, trust_pickle=args.trust_pickle)) is not None:
            print(f"{cfg.train.out_dir}: the run finished at step {step}; nothing to resume")
            return 0
        metrics = train(cfg, resume=args.resume, init_from=args.init_from, progress=not args.no_progress,
                        trust_pickle=args.trust_pickle)
    except (ConfigError, TrainError, CheckpointError, DataError, TargetError, FeatureCacheError) as e:
        return report("train", e)
    stats_file = Path(cfg.train.out_dir) / "data_stats.json"
    if stats_file.is_file():
        print(data_summary(json.loads(stats_file.read_text())) + f" ({stats_file})")
    if metrics:
        keys = ["tau_sim", "mean_first_reject", "post_reject_match", "loss"]
        print("held-out: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    return 0


def data_summary(stats: dict) -> str:
    """One line of ``data_stats.json``: records read and skipped, conversations kept and dropped."""
    parts = []
    for src in ("data.train", "data.heldout"):
        if src in stats:
            s = stats[src]
            parts.append(f"{src}: {s['records']} records, {s['bad']} bad skipped"
                         + (f", {s['partial_last_line']} partial last line dropped" if s.get("partial_last_line")
                            else ""))
    for split in ("train", "heldout"):
        s = stats.get(split)
        if s:
            parts.append(f"{split}: {s['kept']} of {s['conversations']} conversations kept ("
                         f"{s['dropped_over_length']} dropped over data.max_length, {s['dropped_too_short']} with "
                         f"under {MIN_SUPERVISED} supervised tokens, {s['kept_truncated']} cut at data.max_length)")
    return "data: " + "; ".join(parts)
