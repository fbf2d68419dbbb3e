"""The demo's regeneration: Hugging Face ``generate`` in batches of 16 against ``regenerate``, side by side.

    .venv/bin/python scripts/bench_regen_batches.py [--n 256] [--threads 2] [--batch-size 64] [--batch-tokens 4096]

Takes the demo's training prompts (longest first) and answers them on the embedded target, greedy, at the
demo's budget and training length, twice in one process: as ``regenerate`` did before (batches of 16
through ``model.generate``, which runs every row of a batch until the last one is done, so a batch
generates until its shortest prompt holds the training length), and with ``regenerate`` itself (rows
leave the batch when done; ``--batch-size`` rows at most, ``--batch-tokens`` prompt tokens at most).
Prints the time and tokens of each, the ratio, and how many training sequences (``tokenize_conversation``
at the training length: ids and loss mask) are identical. Each way pays what it paid in the demo: the
``generate`` batches time the few-row kernel once for 16 rows (``vatspec.target.skinny_linear``),
``regenerate`` runs ``F.linear`` throughout.
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
    ap.add_argument("--n", type=int, default=None, help="prompts, longest first (default: all the demo's)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--batch-size", type=int, default=None, help="default: the demo's")
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: the demo's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vatspec.benchmarks import prepare_prompts
    from vatspec.data import regenerate, tokenize_conversation
    from vatspec.data.records import Conversation
    from vatspec.data.regen import CUT_MARGIN, left_pad, longest_first
    from vatspec.demo import REGEN_BATCH, SIZES
    from vatspec.target import open_target

    size = SIZES["default"]
    batch_size, batch_tokens = args.batch_size or REGEN_BATCH[0], args.batch_tokens or REGEN_BATCH[1]
    target = open_target("default", device="cpu")
    tok, eos = target.tokenizer, list(target.eos_token_ids)
    prompts = longest_first(prepare_prompts(size.prompts, seed=size.seed, max_turns=1, max_chars=600))[: args.n]

    def with_generate(convs):
        """What regenerate did before: batches of 16, left-padded, one ``generate`` call each."""
        out, n_new = [], 0
        for b in range(0, len(convs), 16):
            chunk = convs[b : b + 16]
            ps = [tok(tok.apply_chat_template(c.messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for c in chunk]
            ids, attn = left_pad(ps, tok.pad_token_id)
            T = ids.shape[1]
            budget = min(size.regen_tokens, max(1, size.max_length + CUT_MARGIN - min(map(len, ps))))
            with torch.no_grad():
                gen = target.model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=budget, do_sample=False,
                                            eos_token_id=eos, pad_token_id=tok.pad_token_id)
            for c, row in zip(chunk, gen[:, T:].tolist()):
                stop = next((k for k, t in enumerate(row) if t in eos), None)
                kept = row if stop is None else row[:stop]
                n_new += len(kept) + (stop is not None)
                out.append(Conversation(c.id, [*c.messages, {"role": "assistant", "content": tok.decode(kept)}]))
        return out, n_new

    def training_rows(convs):
        rows = {}
        for c in convs:
            ex = tokenize_conversation(c, tok, max_length=size.max_length)
            rows[c.id] = (list(ex.input_ids), list(ex.loss_mask))
        return rows

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ref, n_ref = with_generate(prompts)
        results.append(("generate, batches of 16", n_ref, time.perf_counter() - t0))
        out = Path(tmp) / "regen.jsonl"
        t0 = time.perf_counter()
        st = regenerate(prompts, target, out, batch_size=batch_size, batch_tokens=batch_tokens,
                        max_new_tokens=size.regen_tokens, max_length=size.max_length, progress=False)
        results.append((f"regenerate {batch_size} rows, {batch_tokens} tokens", st.new_tokens,
                        time.perf_counter() - t0))
        new = [Conversation(r["id"], r["messages"], r["meta"]) for r in map(json.loads, out.read_text().splitlines())]
    a, b = training_rows(ref), training_rows(new)
    same = sum(a[k] == b.get(k) for k in a)

    print(f"\n{len(prompts)} demo prompts, greedy, {size.regen_tokens} new tokens at most, training length "
          f"{size.max_length}, torch threads {torch.get_num_threads()}")
    print(f"{'regeneration':<36} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for name, n, s in results:
        print(f"{name:<36} {n:>7} {s:>8.1f} {n / s:>7.1f}")
    print(f"\ntime regenerate / generate: {results[1][2] / results[0][2]:.3f}")
    print(f"identical training sequences at length {size.max_length}: {same}/{len(a)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
