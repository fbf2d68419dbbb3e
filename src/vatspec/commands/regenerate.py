"""``vatspec regenerate``: replace the assistant turns of conversations by the target's own responses
(``vatspec.data.regenerate``); appends to ``--out`` and resumes where it stopped.

    vatspec regenerate runs/prompts.jsonl --out runs/regen.jsonl --batch-size 8 --max-new-tokens 512
"""

from __future__ import annotations

import argparse
import logging

from vatspec.commands import DTYPE_METAVAR, dtype_arg


def configure(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument("--dtype", default=None, type=dtype_arg, metavar=DTYPE_METAVAR,
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads; 1 is much faster on a CPU shared with other jobs")


def run(args: argparse.Namespace) -> int:
    import torch

    from vatspec.benchmarks import load_benchmark
    from vatspec.data import DataError, load_conversations, regenerate
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
