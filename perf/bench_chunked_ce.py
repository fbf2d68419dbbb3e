"""The chunked lm_head + CE two ways, side by side: ``chunked._ChunkedHeadCE`` (recomputes each chunk's
logits in a hand-written backward) vs ``torch.utils.checkpoint`` around each chunk of the unchunked
expression (``losses.token_ce`` on ``head_logits``), and the unchunked expression itself.

Forward + backward of soft and hard CE over N rows. Memory: each variant in a fresh subprocess, peak RSS of
one call above the RSS before it. Time: one more subprocess runs the three variants in interleaved rounds
(``timer.SideBySide``, one warm-up round): median and min seconds, and each variant's ratio to the unchunked.

    .venv/bin/python perf/bench_chunked_ce.py --rows 4096 --vocab 32000 --chunk 256
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

VARIANTS = ("unchunked", "function", "checkpoint")


def variants(args) -> dict:
    """One forward + backward per variant, as ``{name: call}`` on the same inputs."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from vatspec.objective.chunked import chunked_token_ce, head_logits
    from vatspec.objective.losses import token_ce

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

    def once(variant: str) -> None:
        if variant == "function":
            soft, hard, _, _ = chunked_token_ce(hidden, weight, p, p_index, labels, chunk_size=C)
            loss = soft.sum() + hard.sum()
        elif variant == "checkpoint":
            loss = sum(checkpoint(plain, hidden[s : s + C], weight, p_index[s : s + C], labels[s : s + C],
                                  use_reentrant=False) for s in range(0, N, C))
        else:
            loss = plain(hidden, weight, p_index, labels)
        loss.backward()
        hidden.grad = weight.grad = None

    return {v: (lambda r, v=v: once(v)) for v in VARIANTS}


def measure_memory(args) -> dict:
    calls = variants(args)
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    calls[args.variant](0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": args.variant, "peak_mib": peak - base}


def measure_time(args) -> dict:
    from timer import SideBySide

    t = SideBySide(VARIANTS, repeats=args.repeat, warmup=1)
    t.run(variants(args))
    return {"lines": t.lines(base="unchunked"), "median_s": {v: t.median(v) for v in VARIANTS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds after one warm-up round")
    ap.add_argument("--mode", choices=["memory", "time"], help=argparse.SUPPRESS)  # one subprocess
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure_memory(args) if args.mode == "memory" else measure_time(args)))
        return
    common = [f"--{k}={getattr(args, k)}" for k in ("rows", "hidden", "vocab", "chunk", "repeat")]

    def sub(*extra: str) -> dict:
        cmd = [sys.executable, __file__, *extra, *common]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    print(f"N={args.rows} rows, H={args.hidden}, V={args.vocab}, chunk={args.chunk}: soft + hard CE, forward + "
          f"backward; peak RSS of one call in a fresh process, seconds over {args.repeat} interleaved rounds")
    for variant in VARIANTS:
        print(f"  {variant:>10}: peak {sub('--mode', 'memory', '--variant', variant)['peak_mib']:.0f} MiB", flush=True)
    print("\n".join("  " + line for line in sub("--mode", "time")["lines"]))


if __name__ == "__main__":
    main()
