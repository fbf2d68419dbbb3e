"""``vatspec benchmarks``, ``vatspec prepare-data``, ``vatspec regenerate``.

Each name below is a command object with ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace


# --------------------------------------------------------------------------- benchmarks
def _benchmarks_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--show", metavar="NAME", help="print the first prompts of one benchmark")
    parser.add_argument("-n", type=int, default=3, help="how many prompts --show prints (default 3)")


def _benchmarks_run(args: argparse.Namespace) -> int:
    from vatspec.benchmarks import BENCHMARKS
    from vatspec.data import load_benchmark

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


benchmarks = SimpleNamespace(configure=_benchmarks_configure, run=_benchmarks_run)


# --------------------------------------------------------------------------- prepare-data
def _prepare_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, required=True, help="number of conversations to write")
    parser.add_argument("--out", required=True, help="output JSONL prompt file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sources", default="sharegpt,alpaca", help="comma-separated: sharegpt, alpaca")
    parser.add_argument("--max-turns", type=int, default=None, help="keep at most this many user turns")
    parser.add_argument("--max-chars", type=int, default=4096, help="skip prompts with more user text than this")


def _prepare_run(args: argparse.Namespace) -> int:
    from collections import Counter

    from vatspec.data import DataError, prepare_prompts

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


prepare_data = SimpleNamespace(configure=_prepare_configure, run=_prepare_run)


# --------------------------------------------------------------------------- regenerate
def _regen_configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="conversations or prompts: .jsonl/.json/.parquet, a folder, a hub name, "
                                      "or bench:NAME for a bundled benchmark")
    parser.add_argument("--out", required=True, help="output JSONL; appended to, and resumed if it exists")
    parser.add_argument("--target", default="default", help="local HF model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-tokens", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=None, help="only the first N conversations")
    parser.add_argument("--skip-bad", action="store_true", help="skip (and count) bad input records")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads; 1 is much faster on a CPU shared with other jobs")


def _regen_run(args: argparse.Namespace) -> int:
    import torch

    from vatspec.data import DataError, load_benchmark, load_conversations, regenerate
    from vatspec.target import TargetError, open_target

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.input.startswith("bench:"):
            convs = load_benchmark(args.input[len("bench:"):], turns="all")
        else:
            convs = load_conversations(args.input, skip_bad=args.skip_bad, require_assistant=False)
    except (DataError, KeyError) as e:
        print(f"vatspec regenerate: {e}")
        return 1
    if args.limit is not None:
        convs = convs[: args.limit]
    try:
        target = open_target(args.target, device=args.device or "auto", dtype=args.dtype)
    except TargetError as e:
        print(f"vatspec regenerate: {e}")
        return 1
    stats = regenerate(
        convs,
        target,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    print(
        f"wrote {stats.conversations} conversations ({stats.turns} turns, {stats.new_tokens} tokens, "
        f"{stats.tokens_per_s:.1f} tok/s) to {args.out}; {stats.skipped_done} already done, "
        f"{stats.too_long} too long, {stats.truncated_turns} turns hit --max-new-tokens"
    )
    return 0


regenerate = SimpleNamespace(configure=_regen_configure, run=_regen_run)
