"""What one target pass costs for q = 1..8 new tokens on a cached context: the decoder layers and
the lm_head separately, the lm_head both as ``F.linear`` and as ``weight @ x.T``
(``vatspec.target.skinny_linear``). Explains a decode round's verify cost in AR steps.

    .venv/bin/python scripts/bench_target_step.py [--context 300] [--reps 12]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from vatspec.target import open_target, skinny_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    target = open_target("default", device="cpu", dtype="float32")
    w = target.lm_head.weight
    torch.manual_seed(0)
    prompt = torch.randint(100, target.vocab_size - 100, (1, args.context))
    rows = []
    with torch.inference_mode():
        cache = target(prompt, logits=False, use_cache=True).past_key_values
        for q in (1, 2, 4, 8):
            x = torch.randint(100, target.vocab_size - 100, (1, q))
            body, plain, skinny = [], [], []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                h = target(x, past_key_values=cache, use_cache=True, logits=False).hidden[0]
                t1 = time.perf_counter()
                F.linear(h, w)
                t2 = time.perf_counter()
                skinny_linear(h, w, None)
                t3 = time.perf_counter()
                cache.crop(-q)
                body.append(t1 - t0), plain.append(t2 - t1), skinny.append(t3 - t2)
            rows.append((q, *(1e3 * statistics.median(v) for v in (body, plain, skinny))))
    base = rows[0][1] + rows[0][3]
    print(f"context {args.context}, torch threads {torch.get_num_threads()} (median ms)")
    print(f"{'q':>2} {'layers':>8} {'lm_head F.linear':>17} {'lm_head w @ x.T':>16} {'pass / 1-token pass':>20}")
    for q, b, p, s in rows:
        print(f"{q:>2} {b:8.1f} {p:17.1f} {s:16.1f} {(b + s) / base:20.2f}")


if __name__ == "__main__":
    main()
