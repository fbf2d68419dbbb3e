"""The ``vatspec`` subcommands, one module each (``prepare-target`` -> ``prepare_target.py``).

Every module exposes the same two functions, and ``vatspec.cli`` only lists them:

    configure(parser: argparse.ArgumentParser) -> None   # the command's flags
    run(args: argparse.Namespace) -> int                 # does the work; the exit status

The argument parsing and the printed output live here; the library modules they call hold neither
(progress bars aside). A mistake the user can fix (a config field, a path, a data file) is printed
as one line, ``vatspec NAME: error: ...``, with exit status 2 (``report``), not a traceback.
"""

from __future__ import annotations

import argparse
import sys

DTYPE_METAVAR = "{float32,bfloat16,float16}"


def report(command: str, error: BaseException) -> int:
    """Print ``error`` as the command's one-line error on stderr; return the exit status 2."""
    print(f"vatspec {command}: error: {error}", file=sys.stderr)
    return 2


def dtype_arg(value: str) -> str:
    """argparse ``type=`` for ``--dtype``: float32 | bfloat16 | float16 or an alias (fp32, bf16, fp16, half)."""
    from vatspec.target import dtype_name

    try:
        return dtype_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
