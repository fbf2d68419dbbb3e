"""What one target pass costs for q = 1..8 new tokens on a cached context: the decoder layers and the
lm_head with each few-row kernel (``vatspec.eval.kernels.few_row_kernel``: ``linear`` = plain ``F.linear``,
``matmul`` = always ``weight @ x.T``, ``auto`` = the faster of the two, timed once per shape in this
process), side by side in interleaved rounds (``timer.SideBySide``). Explains a decode round's verify
cost in AR steps.

    .venv/bin/python perf/bench_target_step.py [--context 300] [--reps 12] [--rows 1,2,4,8]
"""

import argparse

import torch
from timer import SideBySide

import vatspec.eval.kernels as T
from vatspec.eval.kernels import few_row_kernel, skinny_linear
from vatspec.target import open_target

KERNELS = ("linear", "matmul", "auto")


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
    rows = []
    with torch.inference_mode():
        cache = target(prompt, logits=False, use_cache=True).past_key_values
        for q in [int(r) for r in args.rows.split(",")]:
            x = torch.randint(100, target.vocab_size - 100, (1, q))
            h = target(x, past_key_values=cache, use_cache=True, logits=False).hidden[0]
            cache.crop(-q)
            t = SideBySide(KERNELS, repeats=args.reps, warmup=1)  # the warm-up round: auto times its candidates
            for _, order in t.rounds():
                for kernel in order:
                    with few_row_kernel(target.model, kind=kernel):
                        with t.time(kernel):
                            target(x, past_key_values=cache, use_cache=True, logits=False)
                        cache.crop(-q)
                        with t.time(f"{kernel} lm_head"):
                            skinny_linear(h, w, None, kernel)
            rows.append((q, {k: (1e3 * t.median(k), 1e3 * t.median(f"{k} lm_head")) for k in KERNELS}))
    print(f"context {args.context}, torch threads {torch.get_num_threads()} (median ms of {args.reps} interleaved "
          "rounds: decoder layers + lm_head)")
    print(f"{'q':>2} " + " ".join(f"{k:>20}" for k in KERNELS) + "   pass / 1-token pass (" + ", ".join(KERNELS) + ")")
    base = {k: sum(rows[0][1][k]) for k in KERNELS}
    for q, t in rows:
        cells = " ".join(f"{t[k][0]:9.1f} + {t[k][1]:8.1f}" for k in KERNELS)
        print(f"{q:>2} {cells}   " + ", ".join(f"{sum(t[k]) / base[k]:.2f}" for k in KERNELS))
    print("auto's choice per weight shape ([out, in]: rows -> kernel):")
    for shape in sorted({k[:2] for k in T._FASTER}):
        picks = {k[2]: "matmul" if v else "linear" for k, v in T._FASTER.items() if k[:2] == shape}
        print(f"  {list(shape)}: " + ", ".join(f"{r} {picks[r]}" for r in sorted(picks)))


if __name__ == "__main__":
    main()
