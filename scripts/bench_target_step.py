"""What one target pass costs for q = 1..8 new tokens on a cached context: the decoder layers and the
lm_head with plain ``F.linear``, always as ``weight @ x.T`` and with the kernel ``auto`` picks on this
machine (``vatspec.target.skinny_linear``, ``FEW_ROW_KERNEL``), measured side by side in one run.
Explains a decode round's verify cost in AR steps.

    .venv/bin/python scripts/bench_target_step.py [--context 300] [--reps 12] [--rows 1,2,4,8]
"""

import argparse
import statistics
import time

import torch

import vatspec.target as T
from vatspec.target import open_target, skinny_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--rows", default="1,2,4,8", help="new tokens per pass, comma-separated (the first is the base)")
    args = ap.parse_args()
    target = open_target("default", device="cpu", dtype="float32")
    w = target.lm_head.weight
    torch.manual_seed(0)
    prompt = torch.randint(100, target.vocab_size - 100, (1, args.context))

    def layers_ms(x, cache) -> float:
        t0 = time.perf_counter()
        target(x, past_key_values=cache, use_cache=True, logits=False)
        t1 = time.perf_counter()
        cache.crop(-x.shape[1])
        return t1 - t0

    kernels = ("linear", "matmul", "auto")
    rows = []
    with torch.inference_mode():
        cache = target(prompt, logits=False, use_cache=True).past_key_values
        for q in [int(r) for r in args.rows.split(",")]:
            x = torch.randint(100, target.vocab_size - 100, (1, q))
            h = target(x, past_key_values=cache, use_cache=True, logits=False).hidden[0]
            cache.crop(-q)
            for kernel in kernels:  # auto times its candidates here, before the timed loop
                T.FEW_ROW_KERNEL = kernel
                layers_ms(x, cache), skinny_linear(h, w, None)
            times = {k: ([], []) for k in kernels}
            for _ in range(args.reps):  # interleaved, so every kernel sees the same machine
                for kernel in kernels:
                    T.FEW_ROW_KERNEL = kernel
                    times[kernel][0].append(layers_ms(x, cache))
                    t0 = time.perf_counter()
                    skinny_linear(h, w, None)
                    times[kernel][1].append(time.perf_counter() - t0)
            rows.append((q, {k: tuple(1e3 * statistics.median(v) for v in times[k]) for k in kernels}))
    T.FEW_ROW_KERNEL = "auto"
    print(f"context {args.context}, torch threads {torch.get_num_threads()} (median ms: decoder layers + lm_head)")
    print(f"{'q':>2} " + " ".join(f"{k:>20}" for k in kernels) + "   pass / 1-token pass (" + ", ".join(kernels) + ")")
    base = {k: sum(rows[0][1][k]) for k in kernels}
    for q, t in rows:
        cells = " ".join(f"{t[k][0]:9.1f} + {t[k][1]:8.1f}" for k in kernels)
        print(f"{q:>2} {cells}   " + ", ".join(f"{sum(t[k]) / base[k]:.2f}" for k in kernels))
    print("auto's choice per weight shape ([out, in]: rows -> kernel):")
    for shape in sorted({k[:2] for k in T._FASTER}):
        picks = {k[2]: "matmul" if v else "linear" for k, v in T._FASTER.items() if k[:2] == shape}
        print(f"  {list(shape)}: " + ", ".join(f"{r} {picks[r]}" for r in sorted(picks)))


if __name__ == "__main__":
    main()
