"""Regeneration throughput on the embedded default target: batched vs one at a time.

    .venv/bin/python perf/bench_regenerate.py [--n 16] [--batch-size 8] [--max-new-tokens 64] [--repeat 1]

Runs ``vatspec.data.regenerate`` twice on the same prompts (MT-Bench first turns by default),
greedy, with batch size 1 and with ``--batch-size`` (``--repeat`` rounds, the order alternating,
``timer.SideBySide``), and prints tokens/s for both and the ratio. Greedy decoding makes both runs
produce the same text (checked and printed), so the token counts match and the comparison is like for like.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from timer import SideBySide


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16, help="number of prompts")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--benchmark", default="mt_bench")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the two regenerations")
    args = ap.parse_args()
    if args.batch_size < 2:
        raise SystemExit("--batch-size: at least 2 (it is timed against batch size 1)")
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

    sizes = {f"batch {bs}": bs for bs in (1, args.batch_size)}
    sync = torch.cuda.synchronize if target.device.type == "cuda" else None
    t = SideBySide(list(sizes), repeats=args.repeat, warmup=0, sync=sync)
    stats, texts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for r, order in t.rounds():
            for name in order:
                bs = sizes[name]
                out = Path(tmp) / f"bs{bs}-{r}.jsonl"  # a new file: regenerate resumes an existing one
                with t.time(name):
                    stats[bs] = regenerate(convs, target, out, batch_size=bs, max_new_tokens=args.max_new_tokens,
                                           progress=False)
                texts[bs] = {rec["id"]: rec["messages"] for rec in map(json.loads, out.read_text().splitlines())}
    same = sum(texts[1][k] == texts[args.batch_size].get(k) for k in texts[1])

    print(f"\ntarget {target.path} on {target.device} ({target.dtype}), torch threads {torch.get_num_threads()}")
    print(f"{len(convs)} {args.benchmark} prompts, greedy, max_new_tokens={args.max_new_tokens}\n")
    print(f"{'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'hit max':>8}   (median of {args.repeat})")
    for name, bs in sizes.items():
        st, secs = stats[bs], t.median(name)
        print(f"{bs:>5} {st.new_tokens:>7} {secs:>8.1f} {st.new_tokens / secs:>8.1f} {st.truncated_turns:>8}")
    one, many = sizes
    print(f"\nspeed-up of batch {args.batch_size} over batch 1: {t.ratio(one, many):.2f}x (medians), "
          f"{t.ratio(one, many, 'min'):.2f}x (mins)")
    print(f"identical responses: {same}/{len(convs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
