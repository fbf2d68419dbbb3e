"""``vatspec export``: a training checkpoint or run folder -> a validated served draft folder.

    vatspec export RUN_OR_CHECKPOINT [--format eagle3-hf|speculators|dflash] --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from vatspec.checkpoint import CheckpointError, load_draft, resolve_checkpoint
from vatspec.export import DEFAULT_FORMAT, FORMATS, ExportError, export_draft, to_vllm_ids
from vatspec.export.formats import DTYPES, HEAD_DIR


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run folder (-> its latest checkpoint)")
    parser.add_argument("--format", choices=list(FORMATS), help="default: eagle3-hf for EAGLE-3, dflash for DFlash")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    parser.add_argument("--target", help="target model folder; default: target.path of the checkpoint's config.yaml")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--dtype", choices=list(DTYPES), help="weights dtype; default: as trained")
    parser.add_argument("--exit-threshold", type=float, help="accept-head early-exit threshold stored beside the draft")
    parser.add_argument("--speculative-tokens", type=int, help="speculators: tokens per round (default: TTT steps)")
    parser.add_argument("--verifier", help="speculators: the target's name for `vllm serve DIR` (default: its path)")


def run(args: argparse.Namespace) -> int:
    from vatspec.target import TargetError

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        target_path = args.target or _saved_target_path(ckpt)
        target = target_shell(target_path)
        drafter, head = load_draft(ckpt, target, device="cpu")
        fmt = args.format or DEFAULT_FORMAT[drafter.kind]
        out = export_draft(drafter, target, args.out, fmt=fmt, head=head, exit_threshold=args.exit_threshold,
                           dtype=args.dtype, force=args.force, speculative_tokens=args.speculative_tokens,
                           verifier=args.verifier)
    except (CheckpointError, TargetError, ValueError) as e:
        print(f"vatspec export: error: {e}", file=sys.stderr)
        return 2
    ids = list(drafter.target_layer_ids)
    print(f"wrote a validated {fmt} draft to {out} (target {target_path})")
    print(f"  layer ids: ours/SGLang/DFlash (output of layer i) {ids}; vLLM (input of layer j) {to_vllm_ids(ids)}")
    if head is not None:
        print(f"  accept head: {out / HEAD_DIR} (threshold {args.exit_threshold}); not part of the served weights")
    print("  launch commands: docs/serving.md")
    return 0


def target_shell(name_or_path: str | Path | None):
    """The target's config and tokenizer, its modules on the meta device: everything an export reads
    (sizes, layer count, model family, MASK token), without loading a single weight."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from vatspec.target import DEFAULT_NAME, Target, TargetError, prepare_default_target

    default = name_or_path in (None, "", "default", "smollm2", DEFAULT_NAME)
    path = prepare_default_target() if default else Path(name_or_path)
    if not (Path(path) / "config.json").is_file():
        raise TargetError(f"target path {path} has no config.json: not a Hugging Face model folder")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return Target(model, AutoTokenizer.from_pretrained(path), path)


def _saved_target_path(ckpt: Path) -> str:
    import yaml

    saved = ckpt / "config.yaml"
    path = None
    if saved.is_file():
        path = ((yaml.safe_load(saved.read_text()) or {}).get("target") or {}).get("path")
    if not path:
        raise ExportError(f"{saved} names no target.path; pass --target")
    return str(path)
