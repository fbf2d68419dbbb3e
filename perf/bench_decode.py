"""Is our decode loop an honest baseline? AR (``vatspec.eval.decode`` without a draft) vs HF
``generate()`` greedy on the default SmolLM2 target, interleaved per prompt; optionally drafters.

    .venv/bin/python perf/bench_decode.py                          # AR vs HF generate
    .venv/bin/python perf/bench_decode.py --draft eagle3=runs/x    # plus a trained drafter
    .venv/bin/python perf/bench_decode.py --repeat 3 --max-new-tokens 128 --threads 2
    .venv/bin/python perf/bench_decode.py --bench gsm8k --bench mt_bench --num-prompts 10 --draft ...

Prints tokens/s of each, the AR / HF ratio (>= 1 means our baseline is not slowed down), and
for drafters tau, speedup and where a round's time goes: drafting and verifying, each in units
of one AR step, so ``speedup / tau ~= 1 / (draft + verify)``. Writes the full report with ``--out``.

The timing is ``vatspec.eval.bench.evaluate``'s own, the code under test (what ``vatspec eval`` reports): every
prompt runs each method once, the order rotating from prompt to prompt (``bench.run_order``), as
``timer.SideBySide`` rotates the paths of a round.
"""

from __future__ import annotations

import argparse
import sys

import torch

from vatspec.drafts import open_draft
from vatspec.eval.bench import AR, HF, evaluate
from vatspec.eval.report import round_cost_table, write_report
from vatspec.target import open_target

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "A shop sells pencils at 3 for $1. How much do 12 pencils cost? Think step by step.",
    "List five tips for a good night's sleep.",
    "Translate into French: 'The weather is nice today, let's go for a walk.'",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="default")
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--bench", action="append", default=[], metavar="NAME",
                    help="bundled benchmark prompts instead of the five built-in ones (repeatable)")
    ap.add_argument("--num-prompts", type=int, default=5, help="first N prompts of each --bench")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write results.json / .md / plots here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = open_target(args.target, device=args.device, dtype="float32")
    methods = {}
    for spec in args.draft:
        name, _, path = spec.partition("=")
        methods[name] = open_draft(path, target)
    if args.bench:
        from vatspec.benchmarks import load_benchmark

        convs = [c for b in args.bench for c in load_benchmark(b)[: args.num_prompts]] * args.repeat
    else:
        convs = [[{"role": "user", "content": p}] for p in PROMPTS] * args.repeat
    res = evaluate(target, methods, {"bundled": convs}, max_new_tokens=args.max_new_tokens,
                   warmup=args.warmup, k=args.k)
    s = res["summary"]
    ar, hf = s[AR]["bundled"], s[HF]["bundled"]
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, {len(convs)} prompts, "
          f"max_new_tokens {args.max_new_tokens}, {ar['tokens']} tokens per method")
    print(f"{'method':<14} {'tok/s':>8} {'tau':>6} {'speedup':>8}")
    print(f"{'HF generate':<14} {hf['tokens_per_s']:8.1f} {'':>6} {hf['speedup']:7.2f}x")
    print(f"{'AR (ours)':<14} {ar['tokens_per_s']:8.1f} {1.0:6.2f} {1.0:7.2f}x")
    for name in methods:
        m = s[name]["bundled"]
        print(f"{name:<14} {m['tokens_per_s']:8.1f} {m['tau']:6.2f} {m['speedup']:7.2f}x")
    if methods:
        print("\n".join(round_cost_table(s, ["bundled"], list(methods))))
    print(f"AR / HF tokens/s ratio: {ar['tokens_per_s'] / hf['tokens_per_s']:.3f}  "
          f"(outputs identical on {hf['matches_ar']}/{hf['prompts']} prompts)")
    if args.out:
        write_report(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
