"""vatspec.data: readers, loss masks, batching, regeneration.

Nothing is downloaded: the SmolLM2 tokenizer comes from the converted default target in the
local cache, the regeneration model is a tiny random Llama built here.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vatspec.data.regen as regen_mod
from tests.test_templates import supervised_runs
from vatspec.data import (
    Batch,
    BatchIterator,
    Conversation,
    DataError,
    Example,
    collate,
    load_conversations,
    regenerate,
    split_heldout,
    token_counts,
    tokenize_conversation,
)

IM_START, IM_END = 1, 2  # SmolLM2 ChatML special ids


@pytest.fixture(scope="module")
def tok(default_target_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_target_path)


@pytest.fixture
def one_thread():
    # On a CPU shared with other jobs, torch's 2 threads spin against each other and run
    # generation 10x slower than 1 thread; restore the setting for other tests.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(*recs) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


SHAREGPT = {"id": "a", "conversations": [
    {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
    {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Bye!"}]}
OPENAI = {"id": "b", "messages": [
    {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}]},
    {"role": "assistant", "content": "ok"}]}


# --------------------------------------------------------------------------- readers
def test_sharegpt_jsonl(tmp_path):
    (c,) = load_conversations(write(tmp_path / "d.jsonl", jsonl(SHAREGPT)))
    assert c.id == "a"
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert c.messages[2] == {"role": "assistant", "content": "Hello"}


def test_openai_json_array_and_other_formats(tmp_path):
    recs = [OPENAI, {"instruction": "Add", "input": "1 2", "output": "3"}, {"prompt": "P", "response": "R"}]
    convs = load_conversations(write(tmp_path / "d.json", json.dumps(recs, indent=2)))
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "Two parts"}, {"role": "assistant", "content": "ok"}],
        [{"role": "user", "content": "Add\n\n1 2"}, {"role": "assistant", "content": "3"}],
        [{"role": "user", "content": "P"}, {"role": "assistant", "content": "R"}],
    ]
    # ids from the data, else <stem>-<line of the item in the file>
    assert convs[0].id == "b" and re.fullmatch(r"d-\d+", convs[1].id)


def test_single_object_json_and_folder(tmp_path):
    write(tmp_path / "one.json", json.dumps(OPENAI))
    write(tmp_path / "two.jsonl", jsonl(SHAREGPT))
    assert [c.id for c in load_conversations(tmp_path / "one.json")] == ["b"]
    assert sorted(c.id for c in load_conversations(tmp_path)) == ["a", "b"]


def test_duplicate_ids_made_unique_and_leading_assistant_dropped(tmp_path):
    lead = {"id": "a", "conversations": [{"from": "gpt", "value": "orphan"}, *SHAREGPT["conversations"][1:3]]}
    convs = load_conversations(write(tmp_path / "d.jsonl", jsonl(SHAREGPT, lead)))
    assert [c.id for c in convs] == ["a", "a#1"]
    assert [m["content"] for m in convs[1].messages] == ["Hi", "Hello"]


def test_prompt_only_needs_require_assistant_false(tmp_path):
    p = write(tmp_path / "p.jsonl", jsonl({"id": "q", "messages": [{"role": "user", "content": "?"}]}))
    with pytest.raises(DataError, match=r"p\.jsonl:1: conversation 'q' has no assistant turn"):
        load_conversations(p)
    assert not load_conversations(p, require_assistant=False)[0].has_assistant


BAD = [  # (file name, content, pattern the error must match: file and line, good records)
    ("bad.jsonl", jsonl(SHAREGPT) + "{not json\n" + jsonl(OPENAI), r"bad\.jsonl:2: malformed JSON", 2),
    ("noasst.jsonl", jsonl(SHAREGPT, OPENAI) + jsonl({"messages": [{"role": "user", "content": "x"}]}),
     r"noasst\.jsonl:3: conversation 'noasst-3' has no assistant turn", 2),
    ("role.jsonl", jsonl({"messages": [{"role": "robot", "content": "x"}]}, OPENAI),
     r"role\.jsonl:1: turn 0: unknown role 'robot'", 1),
    ("fmt.jsonl", jsonl(OPENAI, {"text": "x"}), r"fmt\.jsonl:2: unrecognised record", 1),
    ("arr.json", json.dumps([SHAREGPT, OPENAI], indent=1)[:-2] + ",\n  {oops}\n]", r"arr\.json:\d+: malformed JSON", 0),
]


@pytest.mark.parametrize("name,text,pattern,good", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_file_and_line(tmp_path, caplog, name, text, pattern, good):
    p = write(tmp_path / name, text)
    with pytest.raises(DataError, match=pattern):
        load_conversations(p)
    if name != "arr.json":  # a broken JSON array cannot be resynchronised: no skip
        with caplog.at_level(logging.WARNING, logger="vatspec.data"):
            convs = load_conversations(p, skip_bad=True)
        assert len(convs) == good
        assert "skipped 1 bad records" in caplog.text and name in caplog.text


def test_json_array_error_line_is_exact(tmp_path):
    text = '[\n {"prompt": "a"},\n {"prompt": "b"},\n {"prompt": "c",, }\n]\n'
    with pytest.raises(DataError, match=r"a\.json:4: malformed JSON"):
        load_conversations(write(tmp_path / "a.json", text), require_assistant=False)


@pytest.mark.parametrize("text", ["", "\n\n"])
def test_empty_file(tmp_path, text):
    with pytest.raises(DataError, match=r"empty\.jsonl: empty"):
        load_conversations(write(tmp_path / "empty.jsonl", text))


def test_partial_last_line_dropped_with_warning(tmp_path, caplog):
    p = write(tmp_path / "cut.jsonl", jsonl(SHAREGPT) + json.dumps(OPENAI)[:20])
    with caplog.at_level(logging.WARNING, logger="vatspec.data"):
        assert [c.id for c in load_conversations(p)] == ["a"]
    assert "cut.jsonl:2: dropped a partial last line" in caplog.text


def test_missing_path_without_datasets(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="no such file"):
        load_conversations(tmp_path / "missing.jsonl")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"pip install 'vatspec\[hub\]'"):
        load_conversations("some-org/some-dataset")


def test_parquet_and_load_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa

    # an explicit fingerprint skips datasets' pickling of the table (broken for some pyarrow/dill pairs)
    ds = datasets.Dataset(pa.Table.from_pylist([SHAREGPT, {**SHAREGPT, "id": "c"}]), fingerprint="t")
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for src in (tmp_path / "d.parquet", tmp_path / "saved"):
        convs = load_conversations(src)
        assert [c.id for c in convs] == ["a", "c"] and convs[0].messages[1]["content"] == "Hi"


# --------------------------------------------------------------------------- loss mask
MULTI = Conversation("m", [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one, please?"},
    {"role": "assistant", "content": "Green, or maybe red.\nEither."},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You're welcome!"},
])


def test_loss_mask_matches_chatml_by_hand(tok):
    """Reference built piece by piece from the ChatML layout, independent of the code's offsets."""
    ref_ids: list[int] = []
    ref_mask: list[bool] = []

    def add(text: str, on: bool):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ref_ids.extend(ids)
        ref_mask.extend([on] * len(ids))

    for m in MULTI.messages:
        add(f"<|im_start|>{m['role']}\n", False)  # role header: never a target
        if m["role"] == "assistant":
            add(m["content"], True)
            add("<|im_end|>", True)  # end of turn: a target
            add("\n", False)
        else:
            add(f"{m['content']}<|im_end|>\n", False)
    ref_ids.pop(), ref_mask.pop()  # the sequence ends at the last end-of-turn token, as the target produced it
    ex = tokenize_conversation(MULTI, tok)
    assert ex.input_ids == tok.apply_chat_template(MULTI.messages, tokenize=True)["input_ids"][:-1]
    assert ex.input_ids == ref_ids
    assert ex.loss_mask == ref_mask


def test_loss_mask_runs_are_assistant_turns(tok):
    # default system prompt inserted by the template, odd whitespace, an empty assistant turn
    conv = Conversation("w", [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4\n"},
        {"role": "user", "content": "and?"}, {"role": "assistant", "content": ""},
    ])
    ex = tokenize_conversation(conv, tok)
    runs = supervised_runs(ex)
    assert [tok.decode(r) for r in runs] == [" 4\n<|im_end|>", "<|im_end|>"]
    assert sum(t == IM_END for t in ex.input_ids) == 5 and sum(ex.loss_mask) == sum(map(len, runs))


def test_truncation_and_no_template(tok):
    ex = tokenize_conversation(MULTI, tok, max_length=10)
    assert len(ex.input_ids) == len(ex.loss_mask) == 10 and not any(ex.loss_mask)
    plain = SimpleNamespace(chat_template=None, name_or_path="plain")
    with pytest.raises(DataError, match="'plain' has no chat template"):
        tokenize_conversation(MULTI, plain)


# --------------------------------------------------------------------------- batching
def examples(lengths):
    return [Example(list(range(10 * i, 10 * i + n)), [j % 2 == 1 for j in range(n)], f"e{i}")
            for i, n in enumerate(lengths)]


def test_collate_right_pads():
    b = collate(examples([3, 1]), pad_id=0)
    assert isinstance(b, Batch) and b.shape == (2, 3)
    assert b.input_ids.tolist() == [[0, 1, 2], [10, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.loss_mask.tolist() == [[False, True, False], [False, False, False]]
    assert b.loss_mask.dtype == torch.bool and b.attention_mask.dtype == torch.long
    assert b.to("cpu").input_ids.device.type == "cpu"


def first_ids(batch: Batch) -> list[int]:
    return batch.input_ids[:, 0].tolist()


def test_batch_iterator_epochs_and_resume():
    exs = examples([2, 3, 4, 5, 6, 7, 8])
    it = BatchIterator(exs, batch_size=3, pad_id=0, seed=5)
    assert len(it) == 3
    epoch0 = [first_ids(b) for b in it]
    assert sorted(sum(epoch0, [])) == [10 * i for i in range(7)]  # each example once
    epoch1 = [first_ids(b) for b in it]
    assert epoch1 != epoch0 and it.state_dict()["epoch"] == 2
    # an uninterrupted stream of 8 batches vs 4 + save/restore into a fresh iterator + 4
    ref = BatchIterator(exs, 3, 0, seed=5)
    full = [first_ids(next(ref)) for _ in range(8)]
    a = BatchIterator(exs, 3, 0, seed=5)
    got = [first_ids(next(a)) for _ in range(4)]
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    assert state == {"epoch": 1, "index": 1, "seed": 5}
    b = BatchIterator(exs, 3, 0, seed=5)
    b.load_state_dict(state)
    got += [first_ids(next(b)) for _ in range(4)]
    assert got == full
    assert [first_ids(x) for x in BatchIterator(exs, 3, 0, seed=6)] != epoch0


def test_split_heldout():
    convs = [Conversation(str(i), []) for i in range(20)]
    train, held = split_heldout(convs, 0.25, seed=1)
    assert len(held) == 5 and len(train) == 15
    assert {c.id for c in train}.isdisjoint(c.id for c in held)
    assert [c.id for c in split_heldout(convs, 0.25, seed=1)[1]] == [c.id for c in held]
    assert len(split_heldout(convs, 3, seed=1)[1]) == 3
    with pytest.raises(ValueError):
        split_heldout(convs, 1.5)


def test_token_counts_against_counter():
    exs = examples([5, 7, 3])
    ref = Counter(t for e in exs for t, m in zip(e.input_ids, e.loss_mask) if m)
    counts = token_counts(exs, vocab_size=40)
    assert counts.dtype == torch.long and counts.shape == (40,)
    assert {i: int(c) for i, c in enumerate(counts) if c} == dict(ref)
    with pytest.raises(ValueError, match="out of range"):
        token_counts(exs, vocab_size=20)


# --------------------------------------------------------------------------- regeneration
@pytest.fixture
def tiny_smol_target(tok):
    from tests.conftest import tiny_llama
    from vatspec.target import Target

    return Target(tiny_llama(vocab_size=len(tok), hidden_size=16, layers=2), tok)


def read_jsonl(p: Path) -> list[dict]:
    return [json.loads(line) for line in p.read_text().splitlines()]


PROMPTS = [
    Conversation("c0", [{"role": "user", "content": "one"}]),
    Conversation("c1", [{"role": "system", "content": "sys"}, {"role": "user", "content": "two"},
                        {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "more"}]),
    Conversation("c2", [{"role": "user", "content": "three"}, {"role": "assistant", "content": "old"}]),
    Conversation("c3", [{"role": "user", "content": "four four"}]),
    Conversation("c4", [{"role": "user", "content": "five"}, {"role": "user", "content": "six"}]),
]


def test_regenerate_resumes_after_interruption(tmp_path, tiny_smol_target, caplog):
    full = tmp_path / "full.jsonl"
    st = regenerate(PROMPTS, tiny_smol_target, full, batch_size=2, max_new_tokens=3, progress=False)
    assert st.conversations == 5 and st.turns == 7 and st.skipped_done == 0
    recs = read_jsonl(full)
    for r in recs:  # user turns kept, one fresh response per user turn, old answers gone
        conv = next(c for c in PROMPTS if c.id == r["id"])
        kept = [m for m in r["messages"] if m["role"] != "assistant"]
        assert kept == [m for m in conv.messages if m["role"] != "assistant"]
        roles = [m["role"] for m in r["messages"] if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert "old" not in json.dumps(r["messages"])
    # interrupted run: two records, then half a line
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    write(part, lines[0] + lines[1] + lines[2][: len(lines[2]) // 2])
    with caplog.at_level(logging.WARNING, logger="vatspec.data"):
        st2 = regenerate(PROMPTS, tiny_smol_target, part, batch_size=2, max_new_tokens=3, progress=False)
    assert "cut off a partial last line" in caplog.text
    assert st2.skipped_done == 2 and st2.conversations == 3
    ids = [r["id"] for r in read_jsonl(part)]  # every line parses
    assert sorted(ids) == [c.id for c in PROMPTS]  # nothing missing, nothing twice
    st3 = regenerate(PROMPTS, tiny_smol_target, part, batch_size=2, max_new_tokens=3, progress=False)
    assert st3.conversations == 0 and st3.skipped_done == 5
    assert len(load_conversations(part)) == 5


class ScriptedRows:
    """Stands in for ``generate_rows``: a fixed reply per row, cut at the row's budget (budgets recorded)."""

    def __init__(self, replies: list[list[int]]):
        self.replies, self.budgets = replies, []

    def __call__(self, target, prompts, budgets, **kw):
        self.budgets.append(list(budgets))
        return [self.replies[i % len(self.replies)][:b] for i, b in enumerate(budgets)]


def test_regenerate_stops_at_eos_and_strips_it(tmp_path, tok, monkeypatch):
    hello = tok("Hello world", add_special_tokens=False)["input_ids"]
    # row 0 stops, row 1 runs out of budget
    monkeypatch.setattr(regen_mod, "generate_rows", ScriptedRows([hello + [IM_END], hello + hello]))
    target = SimpleNamespace(tokenizer=tok, eos_token_ids=[IM_END], device=torch.device("cpu"))
    convs = [Conversation("x", [{"role": "user", "content": "long prompt " * 3}]),
             Conversation("y", [{"role": "user", "content": "hi"}])]
    st = regenerate(convs, target, tmp_path / "o.jsonl", batch_size=2, max_new_tokens=2 * len(hello), progress=False)
    recs = {r["id"]: r for r in read_jsonl(tmp_path / "o.jsonl")}  # longest prompt first: x is row 0
    assert recs["x"]["messages"][-1]["content"] == "Hello world" and recs["x"]["meta"]["finish"] == ["stop"]
    assert recs["y"]["messages"][-1]["content"] == "Hello worldHello world"
    assert recs["y"]["meta"]["finish"] == ["length"]
    assert st.new_tokens == len(hello) + 1 + 2 * len(hello) and st.truncated_turns == 1


def test_regenerate_stops_at_the_training_length_with_the_same_training_tokens(tmp_path, tok, monkeypatch):
    from vatspec.data.regen import CUT_MARGIN

    words = tok(" one two three four five six seven eight nine ten" * 6, add_special_tokens=False)["input_ids"]
    convs = [Conversation("long", [{"role": "user", "content": "a much longer prompt than the other " * 3}]),
             Conversation("short", [{"role": "user", "content": "hi"}, {"role": "user", "content": "and more " * 9}])]
    lens = {c.id: len(tok(tok.apply_chat_template(c.messages[:1], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]) for c in convs}
    max_length = lens["long"] + 10  # the long prompt's row passes it, the short one's does not yet
    recs, models = {}, {}
    for cut in (None, max_length):
        model = models[cut] = ScriptedRows([words])
        monkeypatch.setattr(regen_mod, "generate_rows", model)
        target = SimpleNamespace(tokenizer=tok, eos_token_ids=[IM_END], device=torch.device("cpu"))
        out = tmp_path / f"{cut}.jsonl"
        regenerate(convs, target, out, batch_size=2, max_new_tokens=len(words), max_length=cut, progress=False)
        recs[cut] = {r["id"]: Conversation(r["id"], r["messages"], r["meta"]) for r in read_jsonl(out)}
    # each row generates until it holds max_length tokens and the margin (longest prompt first)
    assert models[max_length].budgets[0] == [max_length + CUT_MARGIN - lens["long"],
                                             max_length + CUT_MARGIN - lens["short"]]
    assert max(models[max_length].budgets[0]) < len(words)
    assert models[None].budgets == [[len(words)] * 2, [len(words)]]
    for cid in ("long", "short"):
        whole = tokenize_conversation(recs[None][cid], tok, max_length=max_length)
        cut = tokenize_conversation(recs[max_length][cid], tok, max_length=max_length)
        assert (cut.input_ids, cut.loss_mask) == (whole.input_ids, whole.loss_mask)
        assert len(recs[max_length][cid].messages[1]["content"]) < len(recs[None][cid].messages[1]["content"])
    # the short conversation's second prompt already fills the window: it ends after its first answer
    assert [m["role"] for m in recs[max_length]["short"].messages] == ["user", "assistant"]
    assert recs[max_length]["short"].meta["finish"] == ["length"]
    assert [m["role"] for m in recs[None]["short"].messages] == ["user", "assistant"] * 2


def _hf_greedy(model, prompt: list[int], budget: int, eos: int) -> list[int]:
    """One prompt alone through Hugging Face ``generate``, greedy: the reference for ``generate_rows``."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=budget, do_sample=False, eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


def test_generate_rows_equals_generate_row_by_row_as_rows_leave_the_batch():
    """Left-padded rows of different lengths and budgets, greedy: each row's tokens are those of HF
    ``generate`` on that prompt alone, up to its budget or its end token (kept), while finished rows
    leave the batch (nine rows: the first to finish is an eighth of them)."""
    from tests.conftest import tiny_llama
    from vatspec.data.regen import generate_rows
    from vatspec.target import Target

    target = Target(tiny_llama(vocab_size=96, hidden_size=32, layers=2), None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 10, 6, 8)]
    budgets = [2, 9, 4, 12, 1, 7, 12, 3, 10]
    free = [_hf_greedy(target.model, p, b, eos=-1) for p, b in zip(prompts, budgets)]  # no end token
    assert [len(f) for f in free] == budgets
    eos = free[6][4]  # an end token some rows reach before their budget
    want = [_hf_greedy(target.model, p, b, eos=eos) for p, b in zip(prompts, budgets)]
    assert any(len(w) < b for w, b in zip(want, budgets)), "no row stops at the end token"
    calls = []  # the rows of each forward pass
    target.model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]),
                                                 with_kwargs=True)
    got = generate_rows(target, prompts, budgets, eos=[eos], pad_id=0)
    assert got == want
    assert calls[0] == 9 and min(calls) < 9  # rows left the batch
    assert calls == sorted(calls, reverse=True)


def test_generate_rows_samples_reproducibly_and_top_p_keeps_the_nucleus():
    from tests.conftest import tiny_llama
    from vatspec.data.regen import generate_rows
    from vatspec.target import Target

    target = Target(tiny_llama(vocab_size=96, hidden_size=32, layers=2), None)
    prompts, budgets = [[5, 6, 7], [8, 9]], [6, 6]

    def sample(top_p, seed):
        return generate_rows(target, prompts, budgets, eos=[-1], pad_id=0, temperature=1.0, top_p=top_p,
                             generator=torch.Generator().manual_seed(seed))

    assert sample(1.0, 3) == sample(1.0, 3)
    assert sample(1.0, 3) != sample(1.0, 4)
    # a nucleus that holds only the most likely token samples the greedy tokens
    assert sample(1e-6, 3) == generate_rows(target, prompts, budgets, eos=[-1], pad_id=0)


def test_regenerate_batches_by_rows_and_prompt_tokens(tok):
    from vatspec.data.regen import _batches, _first_prompt_len, longest_first

    convs = longest_first([Conversation(f"c{i}", [{"role": "user", "content": "word " * n}])
                           for i, n in enumerate((40, 30, 20, 10, 10, 10, 5, 5))])
    lens = [_first_prompt_len(c, tok) for c in convs]
    assert lens == sorted(lens, reverse=True) and lens[0] > lens[3]
    assert [len(b) for b in _batches(convs, tok, 3, None)] == [3, 3, 2]
    budget = 2 * lens[0]  # two rows of the longest, more of the shorter
    sizes = [len(b) for b in _batches(convs, tok, 8, budget)]
    assert sum(sizes) == 8 and sizes[0] == 2 and max(sizes) > 2
    b0 = 0
    for n in sizes:  # every batch within the budget (rows x its longest prompt)
        assert n * lens[b0] <= budget or n == 1
        b0 += n
    assert [len(b) for b in _batches(convs[:1], tok, 8, 1)] == [1]  # one row over the budget still runs
    assert _first_prompt_len(Conversation("s", [{"role": "system", "content": "no user turn"}]), tok) == 0


@pytest.mark.slow
def test_regenerate_batched_equals_one_at_a_time_on_smollm2(tmp_path, default_target_path, one_thread):
    from vatspec.benchmarks import load_benchmark
    from vatspec.target import Target

    target = Target.from_pretrained(default_target_path)
    convs = load_benchmark("mt_bench")[:3]
    a = regenerate(convs, target, tmp_path / "a.jsonl", batch_size=3, max_new_tokens=12, progress=False)
    b = regenerate(convs, target, tmp_path / "b.jsonl", batch_size=1, max_new_tokens=12, progress=False)
    assert a.new_tokens == b.new_tokens > 0
    ra = {r["id"]: r["messages"] for r in read_jsonl(tmp_path / "a.jsonl")}
    rb = {r["id"]: r["messages"] for r in read_jsonl(tmp_path / "b.jsonl")}
    assert ra == rb  # left padding changes nothing under greedy decoding
