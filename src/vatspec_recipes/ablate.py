"""``vatspec ablate``: the paper's ablation on one drafter (baseline, each VAT part alone, all three),
same data and seed (the recipe ``ablation``), printed and written as a table; or, with ``--arms``, draft
objectives (loss kinds) side by side on identical batches, trained and decoded (the recipe
``objectives``). Both run at the demo's size (``--quick``, ``--full``: the long recipe's, one seed).

    vatspec ablate --drafter dflash [--quick] [--out reports/ablate]
    vatspec ablate --drafter eagle3 --arms vat,kl,tv,lk,dpace,specauf,dspark [--out reports/ablate-e3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vatspec.commands import report
from vatspec.drafters import DRAFTERS, drafter_class
from vatspec.objective.losses import KINDS
from vatspec_recipes import demo, experiment
from vatspec_recipes import report as R
from vatspec_recipes.recipe import ExperimentError, load_recipe, recipe_size


def configure(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="at the demo's smoke size (recipe demo-quick's)")
    size.add_argument("--full", action="store_true", help="at the long recipe's size (demo-full's), one seed")
    parser.add_argument("--recipe", help="an experiment recipe: a YAML file, or the name of one in vatspec_recipes' "
                                         "experiments/ (e.g. ablation); "
                                         "unset: ablation, or objectives with --arms")
    parser.add_argument("--out", default="reports/ablate", help="report folder")
    parser.add_argument("--drafter", default="dflash", choices=list(DRAFTERS), help="the drafter trained in every arm")
    parser.add_argument("--arms", type=arms_arg, metavar="KIND,KIND,...",
                        help=f"train these loss kinds side by side and decode each ({', '.join(KINDS)}); the "
                        "drafter's baseline kind is always added; unset: the paper's VAT ablation")
    demo.add_size_args(parser)  # one seed: its arms share it
    demo.add_run_args(parser)


def parse_arms(text: str) -> list[str]:
    """``"vat,kl,tv"`` -> ``["vat", "kl", "tv"]``: loss kinds, each once. A name that is not a kind is a
    ValueError naming it and the choices."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"no arm named; choose from {', '.join(KINDS)}")
    for n in names:
        if n not in KINDS:
            raise ValueError(f"unknown arm {n!r}; choose from {', '.join(KINDS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"an arm is named twice in {text!r}")
    return names


def with_baseline(arms: list[str], drafter: str) -> list[str]:
    """The arms with the drafter's baseline kind first (added when missing): the differences are from it.
    eagle3 drafter, [vat, kl] -> [eagle3, vat, kl]."""
    base = drafter_class(drafter).baseline_loss
    return [base, *(a for a in arms if a != base)]


def arms_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--arms``."""
    try:
        return parse_arms(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    demo.show_steps("ablate")
    if args.recipe and (args.quick or args.full):
        return report("ablate", ExperimentError(f"--recipe {args.recipe} brings its own size: drop --quick / --full"))
    size = {**({} if args.recipe else recipe_size(demo.size_name(args))), **demo.size_changes(args), "seeds": 1}
    try:
        if args.arms:
            recipe = load_recipe(args.recipe or "objectives", drafter=args.drafter,
                                 arms=with_baseline(args.arms, args.drafter), size=size)
            summary = experiment.run(demo.with_trackers(recipe, args.report_to), Path(args.out),
                                     threads=args.threads, progress=not args.no_progress)
            print(R.objectives_table(summary))
            print("\n".join(R.verdicts(summary)))
            demo.report_to_trackers(args, summary)
            return 0
        recipe = load_recipe(args.recipe or "ablation", drafter=args.drafter, size=size)
        summary = experiment.run(demo.with_trackers(recipe, args.report_to), Path(args.out), threads=args.threads,
                                 progress=not args.no_progress)
    except ExperimentError as e:
        return report("ablate", e)
    print(R.ablation_table(R.ablation_rows(summary)))
    demo.report_to_trackers(args, summary)
    return 0
