"""Regeneration stopped at the training length against regeneration to ``max_new_tokens``, side by side.

    .venv/bin/python perf/bench_regen_cut.py [--n 48] [--threads 2] [--repeat 1]

Takes the demo's training prompts in the order ``regenerate`` batches them (longest first, 16 a batch),
keeps the first ``--n`` (the batches whose rows run past the training length), and regenerates them
twice on the embedded target, greedy: without ``max_length`` and with the demo's ``max_length`` (``--repeat``
rounds, the order alternating, ``timer.SideBySide``). Prints the time and the tokens of each, their ratio, and
how many training sequences (``tokenize_conversation`` at
``max_length``: ids and loss mask) are identical between the two.
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
    ap.add_argument("--n", type=int, default=48, help="prompts, longest first")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of the two regenerations")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import regenerate, tokenize_conversation
    from vatspec.data.records import Conversation
    from vatspec.data.regen import longest_first
    from vatspec.target import open_target
    from vatspec_recipes.recipe import load_recipe

    size = load_recipe("demo").size
    target = open_target("default", device="cpu")
    prompts = longest_first(prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600))[: args.n]

    ways = {"to max_new_tokens": None, f"max_length {size.max_length}": size.max_length}
    t = SideBySide(list(ways), repeats=args.repeat, warmup=0)
    seqs, tokens = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(prompts[:1], target, Path(tmp) / "warm.jsonl", max_new_tokens=4, progress=False)
        for r, order in t.rounds():
            for name in order:
                max_length = ways[name]
                out = Path(tmp) / f"{max_length}-{r}.jsonl"  # a new file: regenerate resumes an existing one
                with t.time(name):
                    st = regenerate(prompts, target, out, batch_size=16, max_new_tokens=size.regen_tokens,
                                    max_length=max_length, progress=False)
                tokens[name] = st.new_tokens
        for max_length in ways.values():
            out = Path(tmp) / f"{max_length}-0.jsonl"
            seqs[max_length] = {}
            for rec in map(json.loads, out.read_text().splitlines()):
                ex = tokenize_conversation(Conversation(rec["id"], rec["messages"], rec["meta"]), target.tokenizer,
                                           max_length=size.max_length)
                seqs[max_length][rec["id"]] = (list(ex.input_ids), list(ex.loss_mask))
    whole, cut = seqs[None], seqs[size.max_length]
    same = sum(whole[k] == cut.get(k) for k in whole)

    print(f"\n{len(prompts)} longest demo prompts, batches of 16, greedy, {size.regen_tokens} new tokens at most, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'regeneration':<20} {'tokens':>7} {'seconds':>8}   (median of {args.repeat})")
    for name in ways:
        print(f"{name:<20} {tokens[name]:>7} {t.median(name):>8.1f}")
    without, with_cut = ways
    print(f"\ntime with max_length / without: {t.ratio(with_cut, without):.3f} (medians), "
          f"{t.ratio(with_cut, without, 'min'):.3f} (mins)")
    print(f"identical training sequences at max_length {size.max_length}: {same}/{len(whole)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
