"""The chunked lm_head + CE two ways, side by side: ``chunked._ChunkedHeadCE`` (recomputes each chunk's
logits in a hand-written backward) vs ``torch.utils.checkpoint`` around each chunk of the unchunked
expression (``losses.token_ce`` on ``head_logits``), and the unchunked expression itself.

Forward + backward of soft and hard CE over N rows, each variant in a fresh subprocess: median time
and peak RSS above the RSS before the first call.

    .venv/bin/python scripts/bench_chunked_ce.py --rows 4096 --vocab 32000 --chunk 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def run(args) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint

    from vatspec.chunked import chunked_token_ce, head_logits
    from vatspec.losses import token_ce

    g = torch.Generator().manual_seed(0)
    N, H, V, C = args.rows, args.hidden, args.vocab, args.chunk
    hidden = torch.randn(N, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.1).requires_grad_()
    p = torch.softmax(torch.randn(N // 4, V, generator=g), -1)  # a compact teacher: 4 positions per row
    p_index = torch.randint(0, N // 4, (N,), generator=g)
    labels = torch.randint(0, V, (N,), generator=g)

    def plain(h, w, idx, lab):
        soft, hard = token_ce(head_logits(h, w), p[idx], lab)
        return soft.sum() + hard.sum()

    def once() -> float:
        t0 = time.perf_counter()
        if args.variant == "function":
            soft, hard, _, _ = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=C)
            loss = soft.sum() + hard.sum()
        elif args.variant == "checkpoint":
            loss = sum(checkpoint(plain, hidden[s : s + C], weight, p_index[s : s + C], labels[s : s + C],
                                  use_reentrant=False) for s in range(0, N, C))
        else:
            loss = plain(hidden, weight, p_index, labels)
        loss.backward()
        hidden.grad = weight.grad = None
        return time.perf_counter() - t0

    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    times = [once() for _ in range(args.repeat + 1)][1:]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": args.variant, "s": statistics.median(times), "peak_mib": peak - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run(args)))
        return
    print(f"N={args.rows} rows, H={args.hidden}, V={args.vocab}, chunk={args.chunk}: soft + hard CE, forward + "
          f"backward, median of {args.repeat}")
    for variant in ("unchunked", "function", "checkpoint"):
        cmd = [sys.executable, __file__, "--variant", variant] + [
            f"--{k}={getattr(args, k)}" for k in ("rows", "hidden", "vocab", "chunk", "repeat")]
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        print(f"  {variant:>10}: {r['s']:.3f}s  peak {r['peak_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
