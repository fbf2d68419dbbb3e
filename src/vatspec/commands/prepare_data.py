"""``vatspec prepare-data``: write a training prompt file from the bundled corpora (none of its
prompts is a bundled benchmark prompt).

    vatspec prepare-data --n 512 --out runs/prompts.jsonl
    vatspec prepare-data --n 2000 --answers --max-turns 1 --out runs/train.jsonl   # no regeneration needed
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vatspec.commands import int_arg, report


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int_arg(1), required=True, help="number of conversations to write")
    parser.add_argument("--out", required=True, help="output JSONL prompt file (an existing file is replaced only "
                                                     "if it is an earlier prepare-data output)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sources", default=None,
                        help="comma-separated: sharegpt, alpaca (default: both; sharegpt with --answers)")
    parser.add_argument("--answers", action="store_true",
                        help="keep the corpus's original assistant answers (ShareGPT only): a training file "
                             "that needs no regeneration, the labels come from the target's logits")
    parser.add_argument("--max-turns", type=int_arg(1), default=None, help="keep at most this many user turns")
    parser.add_argument("--max-chars", type=int_arg(1), default=4096,
                        help="skip prompts with more user text than this")


def run(args: argparse.Namespace) -> int:
    from collections import Counter

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import DataError
    from vatspec.outputs import OutputError, check_file, own_jsonl

    sources = args.sources or ("sharegpt" if args.answers else "sharegpt,alpaca")
    try:
        if Path(check_file(args.out)).exists():  # replaced only if it is an earlier prompt file of ours
            own_jsonl(args.out, _is_prepared, "--out")
        convs = prepare_prompts(
            args.n,
            args.seed,
            args.out,
            sources=tuple(s.strip() for s in sources.split(",") if s.strip()),
            max_turns=args.max_turns,
            max_chars=args.max_chars,
            answers=args.answers,
        )
    except (DataError, OutputError, ValueError) as e:
        return report("prepare-data", e)
    by_source = Counter(c.meta.get("source", "?") for c in convs)
    turns = sum(len(c.prompts()) for c in convs)
    what = "conversations with their original answers" if args.answers else "prompt conversations"
    print(f"wrote {len(convs)} {what} ({turns} user turns) to {args.out}: {dict(by_source)}")
    print("none matches a bundled benchmark prompt (normalised text)")
    return 0


def _is_prepared(rec) -> bool:
    """A record prepare-data writes: ``{"id", "messages", "meta": {"source": ...}}``."""
    return (isinstance(rec, dict) and isinstance(rec.get("messages"), list) and isinstance(rec.get("meta"), dict)
            and rec["meta"].get("source") in ("sharegpt", "alpaca"))
