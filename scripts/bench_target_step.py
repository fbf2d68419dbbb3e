"""What one target pass costs for q = 1..8 new tokens on a cached context: the decoder layers with
their plain ``F.linear`` and with the few-row kernel the target uses (``vatspec.target.SkinnyLinear``),
and the lm_head both as ``F.linear`` and as ``weight @ x.T`` (``vatspec.target.skinny_linear``),
measured side by side in one run. Explains a decode round's verify cost in AR steps.

    .venv/bin/python scripts/bench_target_step.py [--context 300] [--reps 12]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from vatspec.target import SkinnyLinear, open_target, skinny_linear


def set_linear_class(model: nn.Module, old: type, new: type) -> None:
    for m in model.modules():
        if type(m) is old:
            m.__class__ = new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--reps", type=int, default=12)
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

    rows = []
    with torch.inference_mode():
        cache = target(prompt, logits=False, use_cache=True).past_key_values
        for q in (1, 2, 4, 8):
            x = torch.randint(100, target.vocab_size - 100, (1, q))
            h = target(x, past_key_values=cache, use_cache=True, logits=False).hidden[0]
            cache.crop(-q)
            plain_layers, layers, plain, skinny = [], [], [], []
            for _ in range(args.reps):  # interleaved, so both kernels see the same machine
                set_linear_class(target.model, SkinnyLinear, nn.Linear)
                plain_layers.append(layers_ms(x, cache))
                set_linear_class(target.model, nn.Linear, SkinnyLinear)
                layers.append(layers_ms(x, cache))
                t0 = time.perf_counter()
                F.linear(h, w)
                t1 = time.perf_counter()
                skinny_linear(h, w, None)
                t2 = time.perf_counter()
                plain.append(t1 - t0), skinny.append(t2 - t1)
            rows.append((q, *(1e3 * statistics.median(v) for v in (plain_layers, layers, plain, skinny))))
    print(f"context {args.context}, torch threads {torch.get_num_threads()} (median ms)")
    print(f"{'q':>2} {'layers F.linear':>16} {'layers skinny':>14} {'lm_head F.linear':>17} "
          f"{'lm_head w @ x.T':>16} {'pass / 1-token pass (plain, skinny)':>36}")
    plain_base, base = rows[0][1] + rows[0][3], rows[0][2] + rows[0][4]
    for q, pl, sl, p, s in rows:
        ratios = f"{(pl + p) / plain_base:.2f}, {(sl + s) / base:.2f}"
        print(f"{q:>2} {pl:16.1f} {sl:14.1f} {p:17.1f} {s:16.1f} {ratios:>36}")


if __name__ == "__main__":
    main()
