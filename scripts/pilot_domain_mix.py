"""Training prompts in the benchmarks' domains: does adding HumanEval-style code prompts and Alpaca instructions to
the demo's data raise acceptance on the benchmark answers more than the same number of extra ShareGPT prompts?

Writes two training files, each the demo's regenerated conversations (``--regen``, what ``vatspec demo`` made
under $VATSPEC_HOME/demo) followed by N more, every new prompt answered by the target as the demo answers
its own (greedy, 128 new tokens at most, 192 tokens in all):

- OUT/reference.jsonl: the next N prompts of the demo's own draw (``prepare_prompts``, ShareGPT and Alpaca);
- OUT/mix.jsonl: N/2 code prompts and N/2 Alpaca training instructions that the demo's data does not hold.

A code prompt is a public module-level function of this Python's standard library (tests, IDLE, tkinter,
lib2to3 and the other paths of ``SKIP`` left out) with a docstring of 60-700 characters and no decorator, cut
after its docstring and wrapped as the HumanEval benchmark wraps its prompts (``HUMANEVAL_INSTRUCTION``);
none equals or contains a benchmark prompt. The set depends on the Python version (docs/results.md used 3.11.7).

    .venv/bin/python scripts/pilot_domain_mix.py --regen $VATSPEC_HOME/demo/regen-n256-t128-s0.jsonl --out runs/domain

Then each file gets its feature cache and an EAGLE-3 pilot at the demo's recipe, and ``bench_acceptance.py``
compares them (docs/results.md, "Training prompts in the benchmarks' domains", has the commands). Keep
``data.heldout_pool`` at the demo's count so both files hold out the same demo conversations.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path

import torch

from vatspec import data as D
from vatspec.benchmarks import (
    HUMANEVAL_INSTRUCTION,
    alpaca_train_prompts,
    pick_prompts,
    prepare_prompts,
    prompt_key,
)
from vatspec.data import Conversation
from vatspec.features.format import atomic_write
from vatspec.target import open_target

SKIP = ("test", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "tkinter", "ensurepip",
        "encodings")


def stdlib_functions() -> list[tuple[str, str]]:
    """(id, source up to the end of its docstring) of every eligible function, in path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(s in rel for s in SKIP):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError):
            continue
        lines = src.splitlines()
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc and 60 <= len(doc) <= 700 and len(node.body) >= 2:
                out.append((f"{rel}:{node.name}", "\n".join(lines[node.lineno - 1: node.body[0].end_lineno]) + "\n"))
    return out


def code_prompts(n: int) -> list[Conversation]:
    """``n`` of them in the HumanEval wrapping, drawn as training prompts are (``pick_prompts``, seed 0: seeded
    order, repeats and benchmark overlaps skipped)."""
    corpus = [Conversation(f"stdlib/{i}", [{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=src)}],
                           {"source": "stdlib"}) for i, src in stdlib_functions()]
    return pick_prompts(corpus, n, seed=0, max_chars=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regen", type=Path, required=True, help="the demo's regenerated training conversations")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--n", type=int, default=128, help="prompts added to each file (the mix: half code, half Alpaca)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = D.load_conversations(args.regen)
    keys = {prompt_key(c) for c in base}
    more = prepare_prompts(len(base) + args.n, seed=0, max_turns=1, max_chars=600)[len(base):]
    if any(prompt_key(c) in keys for c in more):
        raise SystemExit(f"{args.regen}: not the demo's draw (prepare_prompts, seed 0): its next prompts repeat it")
    alpaca = [c for c in pick_prompts(alpaca_train_prompts(), args.n + len(base), seed=0, max_turns=1, max_chars=600)
              if prompt_key(c) not in keys][: args.n // 2]
    target = open_target("default", device="cpu", dtype="float32")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, prompts in [("reference", more), ("mix", code_prompts(args.n - args.n // 2) + alpaca)]:
        part = args.out / f"{name}-added.jsonl"
        stats = D.regenerate(prompts, target, part, batch_size=64, batch_tokens=4096, max_new_tokens=128,
                             max_length=192, progress=False)
        text = args.regen.read_text(encoding="utf-8") + part.read_text(encoding="utf-8")
        atomic_write(args.out / f"{name}.jsonl", text.encode("utf-8"))
        print(f"{args.out / f'{name}.jsonl'}: {len(base)} + {stats.conversations} conversations "
              f"({stats.new_tokens} new tokens in {stats.seconds:.0f} s)")


if __name__ == "__main__":
    main()
