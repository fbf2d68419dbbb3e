"""``vatspec demo``: baselines vs VAT for both drafters on the embedded default target, written as a
report folder: the recipe ``demo`` (``--quick``: ``demo-quick``; ``--full``: ``demo-full``, the long
recipe) run by ``vatspec_recipes.experiment.run``; ``--recipe`` runs any other experiment recipe.

    vatspec demo [--quick | --full] [--seeds N] [--original-answers N] [--out reports/demo]
    vatspec demo --recipe more-seeds-dflash          # a recipe of vatspec_recipes/experiments/ by name
    vatspec demo --recipe my-arms.yaml --out reports/mine   # or a YAML file
    vatspec demo --redecode [--out reports/demo]     # steps 4-5 again on its trained drafts
    vatspec demo --report-to tensorboard,wandb       # the arms' training runs and the report to trackers too
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from vatspec.commands import add_report_to_arg, int_arg, report
from vatspec_recipes import experiment
from vatspec_recipes.recipe import ExperimentError, load_recipe

SIZE_FLAGS = ("steps", "prompts", "eval_prompts", "seeds", "original_answers", "precision")


def configure(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the ~2-minute smoke size (recipe demo-quick; CI runs it)")
    size.add_argument("--full", action="store_true",
                      help="the long recipe (demo-full): 512 conversations, 400 steps, 4 seeds per arm (<= 2 h on "
                           "2 cores)")
    parser.add_argument("--recipe", help="an experiment recipe: a YAML file, or the name of one in vatspec_recipes' "
                                         "experiments/ (e.g. demo-quick); "
                                         "unset: demo, demo-quick with --quick, demo-full with --full")
    parser.add_argument("--out", default="reports/demo", help="report folder")
    add_size_args(parser)
    parser.add_argument("--seeds", type=int_arg(1), help="override the number of training seeds per arm")
    parser.add_argument("--redecode", action="store_true",
                        help="decode the drafts of the finished demo in --out again (k re-chosen, current decoding "
                             "code) and rewrite its report; nothing is retrained, its size is the recorded one")
    add_run_args(parser)


def add_size_args(parser: argparse.ArgumentParser) -> None:
    """The flags that change a recipe's size (``size_changes``), the seeds aside: the demo's and the ablation's."""
    parser.add_argument("--steps", type=int_arg(1),
                        help="override the number of training steps (at a batch of 4; a drafter kind trained at "
                             "another batch sees the same sequences)")
    parser.add_argument("--prompts", type=int_arg(2), help="override the number of training conversations")
    parser.add_argument("--eval-prompts", type=int_arg(1), help="override prompts per benchmark")
    parser.add_argument("--original-answers", type=int_arg(0),
                        help="train also on N ShareGPT conversations with their original answers, after the "
                             "regenerated ones (the held-out split stays on the regenerated ones); unset: the "
                             "recipe's, 0 in the demo's")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"],
                        help="training precision; unset: the recipe's, auto in the demo's (bf16 autocast where the "
                             "CPU multiplies bf16 in hardware, AVX512-BF16 or AMX, else fp32)")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """How a recipe runs, not what it computes: threads, progress bars, trackers."""
    parser.add_argument("--threads", type=int_arg(1), default=None, help="torch CPU threads; unset: torch's")
    parser.add_argument("--no-progress", action="store_true")
    add_report_to_arg(parser)


def run(args: argparse.Namespace) -> int:
    show_steps("demo")
    try:
        if args.redecode:
            sized = [f"--{f.replace('_', '-')}" for f in ("quick", "full", "recipe", *SIZE_FLAGS)
                     if getattr(args, f) not in (None, False)]
            if sized:
                raise ExperimentError(f"--redecode decodes the demo in --out at its recorded size: drop "
                                      f"{' '.join(sized)}")
            summary = experiment.redecode(Path(args.out), threads=args.threads, progress=not args.no_progress)
        else:
            if args.recipe and (args.quick or args.full):
                raise ExperimentError(f"--recipe {args.recipe} brings its own size: drop --quick / --full (--steps, "
                                      "--prompts, --eval-prompts, --seeds, --original-answers, --precision change it)")
            recipe = with_trackers(load_recipe(args.recipe or size_name(args), size=size_changes(args)),
                                   args.report_to)
            summary = experiment.run(recipe, Path(args.out), threads=args.threads, progress=not args.no_progress)
    except ExperimentError as e:
        return report("demo", e)
    report_to_trackers(args, summary)
    return 0


def with_trackers(recipe, report_to: tuple[str, ...]):
    """``recipe`` with every arm's training run logging to the trackers ``report_to`` too (``train.report_to``)."""
    if not report_to:
        return recipe
    logged = f"train.report_to={','.join(report_to)}"
    return dataclasses.replace(recipe, arms={arm: (*o, logged) for arm, o in recipe.arms.items()})


def report_to_trackers(args: argparse.Namespace, summary: dict) -> None:
    """The report folder's tables and plots to ``--report-to``'s trackers (one run named after ``--out``)."""
    if args.report_to:
        from vatspec.train.tracking import log_report, report_files

        out = Path(args.out)
        log_report(args.report_to, out, report_files(out), {k: summary[k] for k in ("recipe", "size")})


def size_name(args: argparse.Namespace) -> str:
    """The recipe whose size ``--quick`` / ``--full`` pick."""
    return "demo-quick" if args.quick else "demo-full" if args.full else "demo"


def size_changes(args: argparse.Namespace) -> dict:
    """``--steps``, ``--prompts``, ``--eval-prompts``, ``--seeds``, ``--original-answers``, ``--precision``."""
    return {f: getattr(args, f) for f in SIZE_FLAGS if getattr(args, f, None) is not None}


def show_steps(command: str) -> None:
    """Print the runner's step log (``vatspec_recipes.experiment``) on stderr as ``[vatspec COMMAND HH:MM:SS] ...``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"[vatspec {command} %(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("vatspec_recipes.experiment")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
