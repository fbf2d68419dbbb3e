"""Regeneration throughput on the embedded default target: batched vs one at a time.

    .venv/bin/python scripts/bench_regenerate.py [--n 16] [--batch-size 8] [--max-new-tokens 64]

Runs ``vatspec.data.regenerate`` twice on the same prompts (MT-Bench first turns by default),
greedy, with batch size 1 and with ``--batch-size``, and prints tokens/s for both and the
ratio. Greedy decoding makes both runs produce the same text (checked and printed), so the
token counts match and the comparison is like for like.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16, help="number of prompts")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--benchmark", default="mt_bench")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vatspec.benchmarks import load_benchmark
    from vatspec.data import regenerate
    from vatspec.target import open_target

    target = open_target("default", device=args.device)  # bfloat16 on a GPU, float32 on a CPU
    convs = load_benchmark(args.benchmark)[: args.n]
    # warm-up: the first generate call pays one-off costs that would favour whichever runs second
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(convs[:1], target, Path(tmp) / "warm.jsonl", batch_size=1, max_new_tokens=4, progress=False)

    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for bs in (1, args.batch_size):
            out = Path(tmp) / f"bs{bs}.jsonl"
            t0 = time.perf_counter()
            st = regenerate(convs, target, out, batch_size=bs, max_new_tokens=args.max_new_tokens, progress=False)
            rows.append((bs, st.new_tokens, time.perf_counter() - t0, st.tokens_per_s, st.truncated_turns))
            texts[bs] = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    same = sum(texts[1][k] == texts[args.batch_size].get(k) for k in texts[1])

    print(f"\ntarget {target.path} on {target.device} ({target.dtype}), torch threads {torch.get_num_threads()}")
    print(f"{len(convs)} {args.benchmark} prompts, greedy, max_new_tokens={args.max_new_tokens}\n")
    print(f"{'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'hit max':>8}")
    for bs, n, s, tps, trunc in rows:
        print(f"{bs:>5} {n:>7} {s:>8.1f} {tps:>8.1f} {trunc:>8}")
    print(f"\nspeed-up of batch {args.batch_size} over batch 1: {rows[1][3] / rows[0][3]:.2f}x")
    print(f"identical responses: {same}/{len(convs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
