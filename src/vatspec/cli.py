"""The ``vatspec`` command. This file only lists the subcommands; each is a module of
``vatspec.commands`` (``prepare-target`` -> ``commands/prepare_target.py``) exposing
``configure(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> one-line help. A command's module is imported only when it runs.
COMMANDS: dict[str, str] = {
    "prepare-target": "convert the embedded SmolLM2 GGUF into a cached HF folder",
    "benchmarks": "list the bundled evaluation prompt sets",
    "prepare-data": "write a training prompt file from bundled corpora",
    "regenerate": "replace assistant turns by the target's own responses",
    "cache-features": "run the target once and store its layer outputs for training (or --validate a cache)",
    "train": "train an EAGLE-3 or DFlash drafter (loss.kind=eagle3|dflash|vat)",
    "eval": "speculative decoding: tau and wall-clock speedup on benchmarks",
    "export": "write a draft in SGLang / vLLM / speculators format",
    "check": "check a served draft folder the way the engines load it, and measure its acceptance",
    "demo": "the main job: baselines vs VAT on the embedded default target",
    "ablate": "the paper's ablation on one drafter",
}


def command_module(name: str):
    """The module of subcommand ``name``."""
    return importlib.import_module(f"vatspec.commands.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vatspec",
        description="Verification-Aware Training (VAT) for EAGLE-3 and DFlash drafters: data, training, "
        "speculative decoding evaluation and export. `vatspec COMMAND --help` for each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"vatspec: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    command = command_module(name)
    sub = argparse.ArgumentParser(prog=f"vatspec {name}", description=COMMANDS[name])
    command.configure(sub)
    args = sub.parse_args(rest)
    return int(command.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
