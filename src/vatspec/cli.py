"""The ``vatspec`` command. Each subcommand lives in the module that owns the idea; this file
only lists them. A subcommand module exposes ``configure(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-target": ("vatspec.commands.prepare_target", "convert the embedded SmolLM2 GGUF into a cached HF folder"),
    "benchmarks": ("vatspec.commands.data_cmds:benchmarks", "list the bundled evaluation prompt sets"),
    "prepare-data": ("vatspec.commands.data_cmds:prepare_data", "write a training prompt file from bundled corpora"),
    "regenerate": ("vatspec.commands.data_cmds:regenerate", "replace assistant turns by the target's own responses"),
    "train": ("vatspec.train", "train an EAGLE-3 or DFlash drafter (loss.kind=eagle3|dflash|vat)"),
    "eval": ("vatspec.bench", "speculative decoding: tau and wall-clock speedup on benchmarks"),
    "export": ("vatspec.commands.export", "write a draft in SGLang / vLLM / speculators format"),
    "demo": ("vatspec.demo", "the main job: baselines vs VAT on the embedded default target"),
    "ablate": ("vatspec.demo:ablate", "the paper's ablation on one drafter"),
}


def _load(spec: str):
    mod, _, attr = spec.partition(":")
    module = importlib.import_module(mod)
    return getattr(module, attr) if attr else module


def build_parser(available_only: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vatspec",
        description="Verification-Aware Training (VAT) for EAGLE-3 and DFlash drafters: data, training, "
        "speculative decoding evaluation and export. `vatspec COMMAND --help` for each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (spec, help_) in COMMANDS.items():
        mod = spec.partition(":")[0]
        if available_only and importlib.util.find_spec(mod) is None:
            continue
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
    command = _load(COMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"vatspec {name}", description=COMMANDS[name][1])
    command.configure(sub)
    args = sub.parse_args(rest)
    return int(command.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
