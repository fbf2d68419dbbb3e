"""``vatspec demo``: baselines vs VAT for both drafters on the embedded default target
(``vatspec.demo.run_demo``), written as a report folder.

    vatspec demo [--quick | --full] [--seeds N] [--original-answers N] [--out reports/demo]
    vatspec demo --redecode [--out reports/demo]     # steps 4-5 again on its trained drafts
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from vatspec.commands import int_arg, report
from vatspec.demo import SIZES, DemoError, DemoSize, redecode_demo, run_demo


def configure(parser: argparse.ArgumentParser) -> None:
    size, full = parser.add_mutually_exclusive_group(), SIZES["full"]
    size.add_argument("--quick", action="store_true", help="the ~3-minute smoke size (CI runs it)")
    size.add_argument("--full", action="store_true",
                      help=f"the long recipe: {full.prompts} conversations, {full.steps} steps of {full.batch_size} "
                           f"sequences, {full.seeds} seeds per arm (<= 2 h on 2 cores)")
    parser.add_argument("--out", default="reports/demo", help="report folder (default: reports/demo)")
    parser.add_argument("--steps", type=int_arg(1),
                        help="override the number of training steps (at a batch of 4; a drafter kind trained at "
                             "another batch sees the same sequences)")
    parser.add_argument("--prompts", type=int_arg(2), help="override the number of training conversations")
    parser.add_argument("--eval-prompts", type=int_arg(1), help="override prompts per benchmark")
    parser.add_argument("--seeds", type=int_arg(1), help="override the number of training seeds per arm")
    parser.add_argument("--original-answers", type=int_arg(0),
                        help="train also on N ShareGPT conversations with their original answers, after the "
                             "regenerated ones (default 0; the held-out split stays on the regenerated ones)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"],
                        help="training precision (default auto: bf16 autocast where the CPU multiplies bf16 in "
                             "hardware, AVX512-BF16 or AMX, else fp32)")
    parser.add_argument("--threads", type=int_arg(1), default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--redecode", action="store_true",
                        help="decode the drafts of the finished demo in --out again (k re-chosen, current decoding "
                             "code) and rewrite its report; nothing is retrained, its size is the recorded one")


def run(args: argparse.Namespace) -> int:
    show_steps("demo")
    try:
        if args.redecode:
            sized = [f"--{f.replace('_', '-')}" for f in ("quick", "full", "steps", "prompts", "eval_prompts", "seeds",
                                                          "original_answers", "precision")
                     if getattr(args, f) not in (None, False)]
            if sized:
                raise DemoError(f"--redecode decodes the demo in --out at its recorded size: drop {' '.join(sized)}")
            redecode_demo(Path(args.out), threads=args.threads, progress=not args.no_progress)
        else:
            run_demo(Path(args.out), size_of(args), threads=args.threads, progress=not args.no_progress)
    except DemoError as e:
        return report("demo", e)
    return 0


def size_of(args: argparse.Namespace) -> DemoSize:
    """``--quick`` / ``--full`` pick the size; ``--steps``, ``--prompts``, ``--eval-prompts``, ``--seeds``,
    ``--original-answers``, ``--precision`` override it."""
    size = SIZES["quick" if args.quick else "full" if args.full else "default"]
    changes = {k: v for k, v in (("steps", args.steps), ("prompts", args.prompts),
                                 ("eval_prompts", args.eval_prompts), ("seeds", args.seeds),
                                 ("original_answers", args.original_answers), ("precision", args.precision))
               if v is not None}
    return dataclasses.replace(size, **changes)


def show_steps(command: str) -> None:
    """Print the demo's step log (``vatspec.demo``) on stderr as ``[vatspec COMMAND HH:MM:SS] ...``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[vatspec {command} %(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("vatspec.demo")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
