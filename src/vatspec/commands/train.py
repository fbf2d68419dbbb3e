"""``vatspec train``: train an EAGLE-3 or DFlash drafter (``vatspec.train``) from a config.

    vatspec train data.train=prompts.jsonl drafter=eagle3 loss=vat train.steps=200
    vatspec train --config run.yaml --resume
    vatspec train --config recipes/qwen3-8b-eagle3-vat.yaml train.epochs=1 --print-config
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vatspec.checkpoint import CheckpointError
from vatspec.commands import report
from vatspec.config import ConfigError, config_sources, load_config
from vatspec.data import DataError
from vatspec.features import FeatureCacheError
from vatspec.target import TargetError
from vatspec.train import MIN_SUPERVISED, REFERENCE, TrainError, finished, train


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. loss.kind=vat)")
    parser.add_argument("--config", help="YAML file of overrides")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir (a finished run: "
                                                              "nothing to do)")
    parser.add_argument("--resume-with-changes", action="store_true",
                        help="--resume with a config that computes otherwise than the checkpoint's (lr, data, steps, "
                             "...): the changes are recorded in RUN/config_history.jsonl")
    parser.add_argument("--init-from", help="start from an existing draft (checkpoint or exported folder)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--print-config", action="store_true",
                        help="print every field of the resolved config, its value and where it came from: default, "
                             "the --config file, an override, or resolved for the drafter; then exit; loads no "
                             "model or data and writes nothing")


def run(args: argparse.Namespace) -> int:
    try:
        if args.print_config:
            rows = config_sources(args.config, args.overrides)
            kind = next(v for k, v, _ in rows if k == "drafter.kind")
            print(format_sources([(k, v, src + _reference_note(k, v, kind)) for k, v, src in rows]))
            return 0
        cfg = load_config(args.config, args.overrides)
        args.resume = args.resume or args.resume_with_changes
        if args.resume and args.init_from:
            raise TrainError("--resume continues a run from its own checkpoint; --init-from starts a new run from "
                             "another draft: give one of them")
        if args.resume and (step := finished(cfg)) is not None:
            print(f"{cfg.train.out_dir}: the run finished at step {step}; nothing to resume")
            return 0
        metrics = train(cfg, resume=args.resume, init_from=args.init_from, progress=not args.no_progress,
                        with_changes=args.resume_with_changes)
    except (ConfigError, TrainError, CheckpointError, DataError, TargetError, FeatureCacheError) as e:
        return report("train", e)
    stats_file = Path(cfg.train.out_dir) / "data_stats.json"
    if stats_file.is_file():
        print(data_summary(json.loads(stats_file.read_text())) + f" ({stats_file})")
    if metrics:
        keys = ["tau_sim", "mean_first_reject", "post_reject_match", "loss"]
        print("held-out: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys if k in metrics))
    return 0


def format_sources(rows: list[tuple[str, object, str]]) -> str:
    """``config_sources`` rows as aligned lines: ``data.max_length  2048  recipes/x.yaml``."""
    values = [_show(v) for _, v, _ in rows]
    kw, vw = max(len(k) for k, _, _ in rows), max(map(len, values))
    return "\n".join(f"{k:<{kw}}  {v:<{vw}}  {src}" for (k, _, src), v in zip(rows, values))


def _reference_note(key: str, value, kind: str) -> str:
    """For an optim field left null: the drafter's reference value the trainer puts there when it starts."""
    section, _, name = key.partition(".")
    if section == "optim" and value is None and name in REFERENCE[kind]:
        return f" (null: {REFERENCE[kind][name]:g}, the {kind} reference, set when training starts)"
    return ""


def _show(v) -> str:
    """A value as it would be written in YAML: null, true, '' for an empty string, [a, b] for a tuple."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    return str(v) if v != "" else "''"


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
