"""``vatspec ablate``: the paper's ablation on one drafter (baseline, each VAT part alone, all three),
same data and seed (``vatspec.demo.run_ablation``), printed and written as a table; or, with ``--arms``,
draft objectives (loss kinds) side by side on identical batches, trained and decoded
(``vatspec.objectives.run_objectives``).

    vatspec ablate --drafter dflash [--quick] [--out reports/ablate]
    vatspec ablate --drafter eagle3 --arms vat,kl,tv,lk,dpace,specauf,dspark [--out reports/ablate-e3]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from vatspec.commands import demo, report
from vatspec.demo import DemoError, ablation_table, run_ablation
from vatspec.drafters import DRAFTERS
from vatspec.losses import KINDS


def configure(parser: argparse.ArgumentParser) -> None:
    demo.configure(parser)
    parser.set_defaults(out="reports/ablate")
    parser.add_argument("--drafter", default="dflash", choices=list(DRAFTERS))
    parser.add_argument("--arms", type=arms_arg, metavar="KIND,KIND,...",
                        help=f"train these loss kinds side by side and decode each ({', '.join(KINDS)}); the "
                        "drafter's baseline kind is always added. Default: the paper's VAT ablation")


def arms_arg(value: str) -> list[str]:
    """argparse ``type=`` for ``--arms``: comma-separated loss kinds (``objectives.parse_arms``)."""
    from vatspec.objectives import parse_arms

    try:
        return parse_arms(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    if (args.seeds or 1) > 1:
        return report("ablate", DemoError(f"--seeds {args.seeds}: the ablation trains one seed (its arms share it); "
                                          "several seeds are `vatspec demo --seeds N`"))
    size = dataclasses.replace(demo.size_of(args), seeds=1)  # --full: the long recipe's size, one seed
    try:
        if args.arms:
            from vatspec.objectives import objectives_table, run_objectives, verdicts

            demo.show_steps("ablate")
            summary = run_objectives(Path(args.out), size, args.drafter, args.arms,
                                     threads=args.threads, progress=not args.no_progress)
            print(objectives_table(summary))
            print("\n".join(verdicts(summary)))
            return 0
        results = run_ablation(Path(args.out), size, args.drafter, threads=args.threads,
                               progress=not args.no_progress)
    except DemoError as e:
        return report("ablate", e)
    print(ablation_table(results))
    return 0
