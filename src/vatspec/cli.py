"""The ``vatspec`` command. This file only lists the subcommands; each is a module of
``vatspec.commands`` (``prepare-target`` -> ``commands/prepare_target.py``) exposing
``configure(parser)`` and ``run(args) -> int``. Other packages add commands the same way through the
``vatspec.commands`` entry point group: each entry is a dict ``name -> (module, one-line help)``
(``vatspec_recipes`` adds ``demo`` and ``ablate`` so; the library never imports it).

It is also the one place where an error meets the user: whatever a command lets through is printed
as one line, ``vatspec NAME: error: ...``, exit status 2 for an input the user can fix (the
project's own errors, a file that cannot be read or decoded) and 1 for anything else; never a
traceback, unless ``--debug`` (before or after the command name) asks for it."""

from __future__ import annotations

import argparse
import copy
import importlib
import sys
from functools import cache
from importlib.metadata import entry_points

from vatspec import commands

# name -> one-line help. A command's module is imported only when it runs.
COMMANDS: dict[str, str] = {
    "prepare-target": "convert the embedded SmolLM2 GGUF into a cached HF folder",
    "benchmarks": "list the bundled evaluation prompt sets",
    "prepare-data": "write a training prompt file from bundled corpora",
    "regenerate": "replace assistant turns by the target's own responses",
    "show-data": "print a data file's training sequences with the supervised (loss-mask) tokens marked",
    "cache-features": "run the target once and store its layer outputs for training (or --validate a cache)",
    "train": "train an EAGLE-3 or DFlash drafter (loss.kind=vat|eagle3|dflash|kl|tv|lk|dpace|specauf|dspark)",
    "eval": "speculative decoding: tau and wall-clock speedup on benchmarks",
    "export": "write a draft in SGLang / vLLM / speculators format",
    "check": "check a served draft folder the way the engines load it, and measure its acceptance",
    "acceptance": "teacher-forced acceptance of trained drafts on the target's answers to benchmark prompts",
    "serve-bench": "what exported drafts buy in a serving engine (vLLM, SGLang) at each concurrency",
}


@cache
def plugin_commands() -> dict[str, tuple[str, str]]:
    """The commands installed packages add: name -> (module, one-line help), from the ``vatspec.commands``
    entry points; a built-in name cannot be taken."""
    found: dict[str, tuple[str, str]] = {}
    for ep in entry_points(group="vatspec.commands"):
        found.update({k: v for k, v in ep.load().items() if k not in COMMANDS})
    return found


def all_commands() -> dict[str, str]:
    """Every command's one-line help: the built-ins, then the installed packages'."""
    return {**COMMANDS, **{name: help_ for name, (_, help_) in plugin_commands().items()}}


def command_module(name: str):
    """The module of subcommand ``name``."""
    if name in COMMANDS:
        return importlib.import_module(f"vatspec.commands.{name.replace('-', '_')}")
    return importlib.import_module(plugin_commands()[name][0])


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's default appended, ``(default: 2048)``, where it has one: not for an
    unset (None) or empty default, nor for a switch (``--no-progress``). A command writes no default by hand."""

    def _format_action(self, action: argparse.Action) -> str:
        shown = shown_default(action)
        if shown is not None:
            action = copy.copy(action)  # the parser's own action keeps its help
            action.help = f"{action.help or ''} (default: {shown.replace('%', '%%')})".strip()
        return super()._format_action(action)


def shown_default(action: argparse.Action) -> str | None:
    """The text of ``action``'s default in ``--help``, or None where it has none worth showing."""
    default = action.default
    if action.nargs == 0 or action.help == argparse.SUPPRESS or default in (None, argparse.SUPPRESS, "", (), []):
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(map(str, default))
    return str(default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vatspec",
        description="Verification-Aware Training (VAT) for EAGLE-3 and DFlash drafters: data, training, "
        "speculative decoding evaluation and export. `vatspec COMMAND --help` for each command.",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_ in all_commands().items():
        sub.add_parser(name, help=help_, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = argv[:1] == ["--debug"]  # `vatspec --debug CMD ...`; `vatspec CMD ... --debug` is the command's flag
    if debug:
        argv = argv[1:]
    parser = build_parser()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in all_commands():
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"vatspec: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name, rest = argv[0], argv[1:]
    command = command_module(name)
    sub = argparse.ArgumentParser(prog=f"vatspec {name}", description=all_commands()[name],
                                  formatter_class=DefaultsHelpFormatter)
    command.configure(sub)
    sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = sub.parse_intermixed_args(rest)  # overrides may follow flags: `train --resume train.steps=9`
    if debug or args.debug:
        commands.DEBUG = True
        try:
            return int(command.run(args) or 0)
        finally:
            commands.DEBUG = False
    try:
        return int(command.run(args) or 0)
    except KeyboardInterrupt:
        print(f"vatspec {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the boundary: one line for the user, --debug for the rest
        return report_error(name, e)


def report_error(name: str, error: Exception) -> int:
    """Print ``error`` in one line; 2 for an input the user can fix, 1 for anything else (a bug)."""
    module = type(error).__module__ or ""
    user = module.startswith("vatspec.") or module.startswith("safetensors") or isinstance(error, (OSError, ValueError))
    text = " ".join(str(error).split()) or type(error).__name__
    if user:
        print(f"vatspec {name}: error: {text}", file=sys.stderr)
        return 2
    print(f"vatspec {name}: error: internal error ({type(error).__name__}: {text}); run `vatspec --debug {name} "
          "...` for the traceback", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
