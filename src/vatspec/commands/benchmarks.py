"""``vatspec benchmarks``: list the bundled evaluation prompt sets, or show the first prompts of one.

    vatspec benchmarks [--show gsm8k -n 3]
"""

from __future__ import annotations

import argparse

from vatspec.commands import int_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", metavar="NAME", help="print the first prompts of one benchmark")
    parser.add_argument("-n", type=int_arg(1), default=3, help="how many prompts --show prints")


def run(args: argparse.Namespace) -> int:
    from vatspec.benchmarks import BENCHMARKS, load_benchmark

    if args.show:
        for conv in load_benchmark(args.show, turns="all")[: args.n]:
            print(f"--- {conv.id}")
            for p in conv.prompts():
                print(p)
        return 0
    print(f"{'name':<10} {'prompts':>7} {'turns':>5}  description")
    for name, (_, desc) in BENCHMARKS.items():
        convs = load_benchmark(name, turns="all")
        turns = max(len(c.prompts()) for c in convs)
        print(f"{name:<10} {len(convs):>7} {turns:>5}  {desc}")
    return 0
