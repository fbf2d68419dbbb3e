"""``vatspec export``: a training checkpoint or run folder -> a validated served draft folder
(``vatspec.export``; docs/serving.md lists the formats and how the engines launch them).

    vatspec export RUN_OR_CHECKPOINT [--format eagle3-hf|speculators|dflash] --out DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vatspec.checkpoint import CheckpointError, resolve_checkpoint, saved_config
from vatspec.commands import add_dtype_arg, int_arg, report
from vatspec.drafters import DRAFTERS
from vatspec.drafts import open_draft
from vatspec.export import FORMATS, default_format, export_draft, to_vllm_ids
from vatspec.export.formats import HEAD_DIR
from vatspec.export.record import training_record
from vatspec.export.validate import validate_export
from vatspec.outputs import OutputError, check_apart, write_lock
from vatspec.target import TargetError, open_target


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run folder (-> its latest checkpoint)")
    parser.add_argument("--format", choices=list(FORMATS), help="default: " + ", ".join(
        f"{cls.formats[0].name} for {cls.title}" for cls in DRAFTERS.values() if cls.formats))
    parser.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    parser.add_argument("--target", help="target model folder; default: target.path of the checkpoint's config.yaml")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out made by an earlier export")
    add_dtype_arg(parser, "--weights-dtype", "the dtype of the written weights", note="unset: as trained")
    parser.add_argument("--exit-threshold", type=float, help="accept-head early-exit threshold stored beside the draft")
    parser.add_argument("--k", "--speculative-tokens", dest="k", type=int_arg(1),
                        help="speculators: tokens drafted per round, written as speculative_tokens (default: the "
                             "draft's k, its TTT steps)")
    parser.add_argument("--mask-token-id", type=int, help="DFlash with a learned MASK row: the target id it is served "
                        "for (mask_embedding.pt); an id the target never emits")
    parser.add_argument("--verifier", help="speculators: the target's name for `vllm serve DIR` (default: its path)")


def run(args: argparse.Namespace) -> int:
    try:
        out = Path(args.out)
        if not out.name:
            out = out.resolve()  # `--out .`: the folder by its name
        target_path = args.target or _saved_target_path(args.checkpoint)
        # never onto, into or around the draft or target being read; --force replaces only an export
        check_apart(out, {"checkpoint": args.checkpoint, "--target": target_path}, "--out")
        target = open_target(target_path, device="meta")  # config and tokenizer: no weight is read
        template = _run_template(args.checkpoint, target)
        drafter, head = open_draft(args.checkpoint, target, device="cpu")
        if args.force and out.is_dir() and any(out.iterdir()):
            _check_is_export(out)
        fmt = args.format or default_format(drafter)
        src = Path(args.checkpoint)
        from_run = (src / "drafter.safetensors").is_file() or (src / "latest").is_file()  # else a served draft
        training = training_record(resolve_checkpoint(src), drafter.k) if from_run else None
        with write_lock(out, "--out", "export"):
            out = export_draft(drafter, target, out, fmt=fmt, head=head, exit_threshold=args.exit_threshold,
                               dtype=args.weights_dtype, force=args.force, k=args.k,
                               verifier=args.verifier, training=training, mask_token_id=args.mask_token_id,
                               template=template)
    except (CheckpointError, TargetError, OutputError, ValueError) as e:  # DataError is a ValueError
        return report("export", e)
    ids = list(drafter.target_layer_ids)
    print(f"wrote a validated {fmt} draft to {out} (target {target_path})")
    print(f"  layer ids: ours/SGLang/DFlash (output of layer i) {ids}; vLLM (input of layer j) {to_vllm_ids(ids)}")
    if head is not None:
        print(f"  accept head: {out / HEAD_DIR} (threshold {args.exit_threshold}); not part of the served weights")
    print(f"  launch commands for vLLM and SGLang: {out / 'README.md'} (the model card)")
    return 0


def _run_template(path: str, target):
    """A training run's template settings (``data.chat_template*`` of its config), so that ``vatspec.json``
    records the template and arguments the draft was trained with; None for a served draft."""
    from vatspec.data.chat import attach_template, check_settings, pin_date
    from vatspec.export.record import recorded_template

    try:
        data = saved_config(path).data
    except CheckpointError:
        return None  # a served draft: nothing recorded of its training
    template = attach_template(target, data.chat_template, data.chat_template_kwargs, data.chat_template_date or None)
    # the day the run rendered, for a template that stamps one
    template = pin_date(template, target.tokenizer, recorded_template(path))
    # the template file read now must be the one trained with
    check_settings(recorded_template(path), template.settings(target.tokenizer), f"checkpoint {path}", "export")
    return template


def _saved_target_path(path: str) -> str:
    """target.path of the run config saved in the checkpoint (read as a config, aliases and all). A path that
    holds no draft is said so; ``--target`` is asked for only where a draft records no target."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist: expected a checkpoint, a run folder or an exported draft")
    if not (p / "latest").is_file() and not (p / "drafter.safetensors").is_file():
        if (p / "config.json").is_file():
            raise CheckpointError(f"{p} is an exported draft, not a training run: pass --target (the target model)")
        raise CheckpointError(f"{p} holds no draft: neither a checkpoint (drafter.safetensors), a run folder "
                              "(latest) nor an exported draft (config.json)")
    try:
        return saved_config(path).target.path
    except CheckpointError as e:
        raise CheckpointError(f"{e}; pass --target") from e


def _check_is_export(out: Path) -> None:
    """``--force`` replaces an earlier export (a folder that validates as one), nothing else: an export
    folder holds only the served files, so its content is the proof of what it is."""
    try:
        validate_export(out)
    except Exception as e:  # a probe: whatever fails to validate is not an export
        raise OutputError(f"--out {out} is not empty and is not an exported draft ({' '.join(str(e).split())[:160]}); "
                          "--force replaces only an earlier export: choose another --out") from None
