"""``vatspec train``: train an EAGLE-3 or DFlash drafter (``vatspec.train``) from a config.

    vatspec train data.train=prompts.jsonl drafter=eagle3 loss=vat train.steps=200
    vatspec train --config run.yaml --resume
    vatspec train --config qwen3-8b-eagle3-vat train.epochs=1 --print-config     # an installed config, by name
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vatspec.checkpoint import CheckpointError
from vatspec.commands import report
from vatspec.config import Config, ConfigError, DrafterConfig, config_sources, installed_configs, load_config
from vatspec.data import DataError
from vatspec.drafters import drafter_class
from vatspec.features import FeatureCacheError
from vatspec.target import TargetError
from vatspec.train import MIN_SUPERVISED, TrainError, finished, heldout_split, reference_optim, train


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. loss.kind=vat)")
    parser.add_argument("--config", metavar="FILE_OR_NAME",
                        help="YAML file of overrides, or the name of an installed config ("
                             + (", ".join(installed_configs()) or "none installed") + ")")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir (a finished run: "
                                                              "nothing to do)")
    parser.add_argument("--resume-with-changes", action="store_true",
                        help="--resume with a config that computes otherwise than the checkpoint's (lr, data, steps, "
                             "...): the changes are recorded in RUN/config_history.jsonl")
    parser.add_argument("--init-from", help="start from an existing draft (checkpoint or exported folder)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--print-config", action="store_true",
                        help="print every field of the resolved config that applies to its drafter kind, its value "
                             "and where it came from: default, the --config file, an override, or resolved for the "
                             "drafter; then the numbers the run is sized by (world size, global batch, steps, "
                             "warm-up, the feature cache's disk), then exit; loads no model, reads only data.train's "
                             "line count and the feature cache's manifest, writes nothing")


def run(args: argparse.Namespace) -> int:
    try:
        if args.print_config:
            rows = config_sources(args.config, args.overrides)
            kind = next(v for k, v, _ in rows if k == "drafter.kind")
            own = {f"drafter.{name}" for name in DrafterConfig.fields_for(kind)}
            rows = [(k, v, src + _reference_note(k, v, kind)) for k, v, src in rows
                    if not k.startswith("drafter.") or k in own]
            world = int(os.environ.get("WORLD_SIZE", "1"))
            print(format_sources(rows) + "\n\n" + format_sources(run_size(load_config(args.config, args.overrides),
                                                                            world)))
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
    """``config_sources`` rows as aligned lines, e.g. for ``--config qwen3-8b-eagle3-vat``:
    ``data.max_length  4096  .../vatspec_recipes/configs/qwen3-8b-eagle3-vat.yaml``."""
    values = [_show(v) for _, v, _ in rows]
    kw, vw = max(len(k) for k, _, _ in rows), max(map(len, values))
    return "\n".join(f"{k:<{kw}}  {v:<{vw}}  {src}" for (k, _, src), v in zip(rows, values))


def run_size(cfg: Config, world: int = 1) -> list[tuple[str, object, str]]:
    """The numbers a user sizes a run by, as ``(name, value, how it follows)`` rows: world size, global batch,
    conversations, steps per epoch, total steps, warm-up steps and, where the run reads a feature cache, its disk.
    The steps follow ``vatspec.train``'s own rule (held-out split, an equal share a rank, ``optim.grad_accum``
    batches a step); the conversations are counted without reading them (``_conversations``), so a value that
    tokenizing would change is marked ``~``."""
    d, optim, t = cfg.data, reference_optim(cfg), cfg.train
    rows = [("world size", world, "processes: WORLD_SIZE, as torchrun sets it (1 when unset)"),
            ("global batch", d.batch_size * optim.grad_accum * world,
             f"conversations an optimizer step: data.batch_size {d.batch_size} x optim.grad_accum {optim.grad_accum} "
             f"x world size {world}")]
    n, exact, where = _conversations(cfg)
    mark = "" if exact else "~"
    if n is None:
        per_epoch, how = None, where
    else:
        held = 0 if d.heldout else len(heldout_split(list(range(n)), d, t.seed)[1])
        share = (n - held) // world
        per_epoch = max(1, -(-share // d.batch_size) // optim.grad_accum)
        rows.append(("conversations", f"{mark}{n}", where + (f"; {held} held out" if held else "")))
        how = (f"{n - held} training conversations / world size {world} / data.batch_size {d.batch_size} / "
               f"optim.grad_accum {optim.grad_accum}")
    rows.append(("steps per epoch", "unknown" if per_epoch is None else f"{mark}{per_epoch}", how))
    if t.steps:
        total, how = t.steps, "train.steps"
    else:
        total, how = (None if per_epoch is None else per_epoch * t.epochs), f"train.epochs {t.epochs} x steps per epoch"
    rows.append(("total steps", "unknown" if total is None else f"{'' if t.steps else mark}{total}", how))
    warmup = None if total is None else int(round(optim.warmup_ratio * total))  # as vatspec.train.arms schedules it
    rows.append(("warm-up steps", "unknown" if warmup is None else f"{'' if t.steps else mark}{warmup}",
                 f"optim.warmup_ratio {optim.warmup_ratio:g} x total steps"))
    if d.features:
        rows.append(("feature cache", *_cache_disk(cfg, n)))
    return rows


def _conversations(cfg: Config) -> tuple[int | None, bool, str]:
    """``(count, exact, where it came from)`` of the training conversations, without reading them: the feature
    cache's rows (its manifest), else the lines of a JSONL ``data.train`` (turn splits and length drops change
    it), else unknown until training reads the data."""
    d = cfg.data
    manifest = _manifest(d.features)
    if manifest:
        return int(manifest["conversations"]), True, f"rows of the feature cache data.features={d.features}"
    train = Path(d.train)
    if d.train and train.is_file() and train.suffix == ".jsonl":
        with open(train, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        return lines, False, f"lines of data.train={d.train}; turn splits and data.max_length drops change it"
    why = f"data.train={d.train} is counted when training reads it" if d.train else "no data.train"
    return None, False, why + (f", data.features={d.features} is not written yet" if d.features else "")


def _manifest(folder: str) -> dict | None:
    """The manifest of the feature cache in ``folder``; None where there is none (not written yet)."""
    from vatspec.features.format import MANIFEST

    try:
        return json.loads((Path(folder) / MANIFEST).read_text()) if folder else None
    except (OSError, ValueError):
        return None


def _cache_disk(cfg: Config, conversations: int | None) -> tuple[str, str]:
    """The feature cache's disk: what its shards hold, or for one not written yet an upper bound from the target's
    ``config.json`` (every conversation ``data.max_length`` tokens, the drafter's layers and the final hidden)."""
    from vatspec.features import bytes_per_token, drafter_layer_ids

    manifest = _manifest(cfg.data.features)
    if manifest:
        size = sum(s.get("bytes", 0) for s in manifest["shards"])
        return _bytes(size), (f"the shards of data.features ({manifest['tokens']} tokens, layers "
                              f"{manifest['layer_ids']}, {manifest['dtype']})")
    shape = _target_shape(cfg.target.path)
    if shape is None or conversations is None:
        missing = "target.path has no config.json here" if shape is None else "the conversations are not counted"
        return "unknown", f"data.features={cfg.data.features} is not written yet and {missing}"
    layers, hidden = shape
    d = cfg.drafter
    ids = d.target_layer_ids or drafter_layer_ids(d.kind, layers, d.num_layers)
    per_token = bytes_per_token(len(ids), hidden, "bfloat16")
    return (f"<= {_bytes(conversations * cfg.data.max_length * per_token)}",
            f"not written yet: {conversations} conversations x data.max_length {cfg.data.max_length} tokens x "
            f"{per_token} B (layers {list(ids)} and the final hidden of {hidden}, bfloat16)")


def _target_shape(path: str) -> tuple[int, int] | None:
    """``(layers, hidden size)`` of the target folder's ``config.json`` (its text model's), read without the model;
    None where that file is not here (the embedded default: before its first use converts it)."""
    from vatspec.target.model import target_folder

    try:
        config = json.loads((target_folder(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    try:
        return int(text["num_hidden_layers"]), int(text["hidden_size"])
    except (KeyError, TypeError, ValueError):
        return None


def _bytes(n: float) -> str:
    """``n`` bytes in binary units: ``16.4 TiB``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    k = 0
    while n >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.1f} {units[k]}"


def _reference_note(key: str, value, kind: str) -> str:
    """For an optim field left null: the drafter's reference value the trainer puts there when it starts."""
    section, _, name = key.partition(".")
    reference = drafter_class(kind).reference_optim
    if section == "optim" and value is None and name in reference:
        return f" (null: {reference[name]:g}, the {kind} reference, set when training starts)"
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
