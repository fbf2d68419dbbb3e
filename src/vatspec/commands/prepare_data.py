"""``vatspec prepare-data``: write a training prompt file from the bundled corpora (none of its
prompts is a bundled benchmark prompt).

    vatspec prepare-data --n 512 --out runs/prompts.jsonl
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, required=True, help="number of conversations to write")
    parser.add_argument("--out", required=True, help="output JSONL prompt file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sources", default="sharegpt,alpaca", help="comma-separated: sharegpt, alpaca")
    parser.add_argument("--max-turns", type=int, default=None, help="keep at most this many user turns")
    parser.add_argument("--max-chars", type=int, default=4096, help="skip prompts with more user text than this")


def run(args: argparse.Namespace) -> int:
    from collections import Counter

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import DataError

    try:
        convs = prepare_prompts(
            args.n,
            args.seed,
            args.out,
            sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
            max_turns=args.max_turns,
            max_chars=args.max_chars,
        )
    except DataError as e:
        print(f"vatspec prepare-data: {e}")
        return 1
    by_source = Counter(c.meta.get("source", "?") for c in convs)
    turns = sum(len(c.prompts()) for c in convs)
    print(f"wrote {len(convs)} prompt conversations ({turns} user turns) to {args.out}: {dict(by_source)}")
    print("none matches a bundled benchmark prompt (normalised text)")
    return 0
