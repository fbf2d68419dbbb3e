"""``vatspec ablate``: the paper's ablation on one drafter (baseline, each VAT part alone, all three),
same data and seed (``vatspec.demo.run_ablation``), printed and written as a table.

    vatspec ablate --drafter dflash [--quick] [--out reports/ablate]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vatspec.commands import demo, report
from vatspec.demo import DemoError, ablation_table, run_ablation
from vatspec.drafters import DRAFTERS


def configure(parser: argparse.ArgumentParser) -> None:
    demo.configure(parser)
    parser.set_defaults(out="reports/ablate")
    parser.add_argument("--drafter", default="dflash", choices=list(DRAFTERS))


def run(args: argparse.Namespace) -> int:
    try:
        results = run_ablation(Path(args.out), demo.size_of(args), args.drafter, threads=args.threads,
                               progress=not args.no_progress)
    except DemoError as e:
        return report("ablate", e)
    print(ablation_table(results))
    return 0
