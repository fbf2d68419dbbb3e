"""The ``vatspec`` subcommands, one module each (``prepare-target`` -> ``prepare_target.py``).

Every module exposes the same two functions, and ``vatspec.cli`` only lists them:

    configure(parser: argparse.ArgumentParser) -> None   # the command's flags
    run(args: argparse.Namespace) -> int                 # does the work; the exit status

The argument parsing and the printed output live here; the library modules they call hold neither
(progress bars aside). A mistake the user can fix (a config field, a path, a data file) is printed
as one line, ``vatspec NAME: error: ...``, with exit status 2 (``report``), not a traceback
(``vatspec --debug NAME ...`` shows it); whatever a command lets through, ``vatspec.cli`` prints the same way.
"""

from __future__ import annotations

import argparse
import math
import sys

DTYPE_NAMES = "bf16, fp16 or fp32 (or bfloat16, float16, float32)"  # what every dtype flag takes (dtype_arg)


DEBUG = False  # `vatspec --debug ...`: report() raises, so the traceback shows (set by vatspec.cli)


def report(command: str, error: BaseException) -> int:
    """Print ``error`` as the command's one-line error on stderr; return the exit status 2.
    Under ``--debug``, raise it instead."""
    if DEBUG:
        raise error
    text = " ".join(str(error).split())  # one line, whatever the message (a YAML error spans several)
    print(f"vatspec {command}: error: {text}", file=sys.stderr)
    return 2


def int_arg(minimum: int):
    """argparse ``type=`` for a count: an integer >= ``minimum`` (``--limit -3`` is an error, not a slice)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {n}")
        return n

    return parse


def float_arg(minimum: float = 0.0, maximum: float = float("inf"), *, above: bool = False):
    """argparse ``type=`` for a finite number in ``[minimum, maximum]`` (``(minimum, maximum]`` with ``above``)."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not math.isfinite(x):  # `--timeout inf` reached the socket as an OverflowError
            raise argparse.ArgumentTypeError(f"expected a finite number, got {value}")
        if not (x > minimum if above else x >= minimum) or not x <= maximum:
            lo = f"> {minimum:g}" if above else f">= {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {lo}" + (f" and <= {maximum:g}" if maximum < float("inf")
                                                                else "") + f", got {value}")
        return x

    return parse


def dtype_arg(value: str) -> str:
    """argparse ``type=`` for every dtype flag: float32 | bfloat16 | float16 or an alias (fp32, bf16, fp16, half)."""
    from vatspec.target import dtype_name

    try:
        return dtype_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_dtype_arg(parser: argparse.ArgumentParser, flag: str = "--dtype", what: str = "the target model's dtype",
                  note: str = "unset: bfloat16 on a GPU, float32 on a CPU", **kw) -> None:
    """A dtype flag taking every name ``dtype_arg`` reads. ``--dtype`` is the target model's dtype in every command
    that loads a target; another thing's dtype has a flag of its own (``--feature-dtype``, ``--weights-dtype``)."""
    text = f"{what}: {DTYPE_NAMES}" + (f"; {note}" if note else "")
    parser.add_argument(flag, type=dtype_arg, metavar="DTYPE", help=text, **kw)


def add_template_args(parser: argparse.ArgumentParser) -> None:
    """``--chat-template FILE`` and ``--chat-template-kwargs key=value,...``: how a command renders conversations
    (as the serving engine renders them); the same values as training's ``data.chat_template*``."""
    parser.add_argument("--chat-template", default="", metavar="FILE",
                        help="a Jinja chat template file (default: the target tokenizer's own)")
    parser.add_argument("--chat-template-kwargs", default="", metavar="KEY=VALUE,...",
                        help="template arguments, as the engine's chat_template_kwargs (e.g. enable_thinking=false)")
    parser.add_argument("--chat-template-date", default=None, metavar="YYYY-MM-DD",
                        help="the day a template that stamps today's date renders (gpt-oss, Llama-3.2, Granite, "
                             "SmolLM3, Mistral-Small); default: the one recorded with the data, cache or draft "
                             "read, and for regenerate, the output's (a new one: today)")


def use_template(target, args: argparse.Namespace):
    """The template settings of ``args`` (``attach_template``), checked against ``target``'s tokenizer, for the
    command to pass to whatever renders; a ``DataError`` names what is wrong."""
    from vatspec.data.chat import attach_template, format_kwargs

    template = attach_template(target, args.chat_template, args.chat_template_kwargs,
                               getattr(args, "chat_template_date", None))
    dtype = str(getattr(target, "dtype", "")).removeprefix("torch.")
    print(f"target {getattr(target, 'path', None)} on {getattr(target, 'device', '?')}, {dtype}; chat template "
          f"{args.chat_template or 'of the tokenizer'}, arguments {format_kwargs(template.kwargs)}"
          + (f", date {template.date}" if template.date else ""), file=sys.stderr)
    return template


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--dtype`` and ``--threads``, as the decoding commands take them."""
    parser.add_argument("--device", default="auto")
    add_dtype_arg(parser)
    parser.add_argument("--threads", type=int_arg(1), default=None, help="torch intra-op threads (CPU)")


def check_report_out(path, inputs: dict, ours, what: str) -> None:
    """``--json PATH`` may replace only an earlier report of this command (``ours(old)`` on its JSON) and sits
    apart from every input (an extra file in a served folder would make it an invalid export)."""
    import json

    from vatspec.outputs import OutputError, check_apart, check_file

    check_file(path, "--json")
    check_apart(path, inputs, "--json")
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        if not ours(old):
            raise OutputError(f"--json {path} exists and is not an earlier {what}; choose another file")


def add_report_to_arg(parser: argparse.ArgumentParser) -> None:
    """``--report-to TRACKER,...``: the experiment trackers that get a command's report (and, for the runners,
    its arms' training runs, as ``train.report_to``); one not installed is refused before any work."""
    from vatspec.config import TRACKERS

    parser.add_argument("--report-to", type=report_to_arg, default=(), metavar="TRACKER,...",
                        help=f"also log to these experiment trackers ({', '.join(TRACKERS)}; each an extra: pip "
                             "install 'vatspec[NAME]'); where each writes: vatspec/train/tracking.py")


def report_to_arg(value: str) -> tuple[str, ...]:
    """argparse ``type=`` for ``--report-to``: tracker names, each installed."""
    from vatspec.config import parse_report_to
    from vatspec.train.tracking import TrackingError, check_installed

    try:
        names = parse_report_to(value, "--report-to")
        check_installed(names, "--report-to")
    except (ValueError, TrackingError) as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--report-to: ")) from None  # argparse names the flag
    return names
