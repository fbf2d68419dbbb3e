"""``vatspec show-data``: a data file's training sequences with the supervised tokens marked."""

from __future__ import annotations

import json
import re

import pytest

from vatspec.cli import main

ANSWERS = {"a": "Paris is the capital.", "b": "Two plus two is four.", "c": "Blue."}
PROMPTS = {"a": "What is the capital of France?", "b": "What is 2+2?", "c": "Sky colour?"}


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps({"id": k, "conversations": [
        {"from": "human", "value": PROMPTS[k]}, {"from": "gpt", "value": ANSWERS[k]}]}) + "\n" for k in ANSWERS))
    return path


@pytest.fixture
def reference(data_file, default_target_path):
    """The examples as tokenize_conversation makes them, computed here (not by the command)."""
    from transformers import AutoTokenizer

    from vatspec.data import load_conversations, load_template, tokenize_conversation

    tok = AutoTokenizer.from_pretrained(default_target_path)
    template = load_template(tok)
    return tok, {c.id: tokenize_conversation(c, tok, 2048, template) for c in load_conversations(data_file)}


def show(capsys, *argv):
    rc = main(["show-data", *map(str, argv), "--target", "default"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_brackets_hold_the_answers_and_counts_match(data_file, reference, capsys):
    rc, out, _ = show(capsys, data_file, "--color", "never")
    assert rc == 0 and "\x1b[" not in out
    assert re.findall(r"\[\[(.*?)\]\]", out, re.S) == [ANSWERS[k] + "<|im_end|>" for k in ANSWERS]
    outside = re.sub(r"\[\[.*?\]\]", "", out, flags=re.S)
    assert all(PROMPTS[k] in outside for k in PROMPTS) and "<|im_start|>assistant↵" in outside
    tok, ref = reference
    for k, ex in ref.items():
        sup = sum(ex.loss_mask)
        assert f"{k}: {len(ex)} tokens, {sup} supervised, {len(ex) - sup} context, not cut at max_length 2048" in out
    sup, total = sum(sum(e.loss_mask) for e in ref.values()), sum(len(e) for e in ref.values())
    assert (f"summary: 3 records read, 0 bad skipped, 3 conversations, 3 sequences, {sup} supervised tokens, "
            f"{total - sup} context tokens, 0 cut at max_length 2048, 0 dropped") in out
    assert f"supervised share {sup / total:.1%}" in out


def test_tokens_mode_flags_are_the_loss_mask(data_file, reference, capsys):
    rc, out, _ = show(capsys, data_file, "--tokens", "--id", "b", "--color", "never")
    ex = reference[1]["b"]
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+ +\d+ ", line)]
    assert rc == 0 and [int(r[1]) for r in rows] == ex.input_ids
    assert [r[-1] == "S" for r in rows] == ex.loss_mask


def test_id_selects_and_unknown_id_is_an_error(data_file, capsys):
    rc, out, _ = show(capsys, data_file, "--id", "c", "--color", "never")
    assert rc == 0 and "--- c" in out and "--- a" not in out and "[[Blue.<|im_end|>]]" in out
    rc, _, err = show(capsys, data_file, "--id", "zz")
    assert rc == 2 and "vatspec show-data: error: --id zz: no conversation with this id" in err


def test_cut_and_dropped_at_max_length(data_file, reference, capsys):
    n = reference[1]["c"].loss_mask.index(True) + 1  # c keeps one supervised token: cut, and dropped by training
    rc, out, _ = show(capsys, data_file, "--max-length", n, "--id", "c", "--color", "never")
    assert rc == 0 and f"c: {n} tokens, 1 supervised, {n - 1} context, cut at max_length {n}; dropped" in out
    exs = reference[1].values()
    cut, dropped = sum(len(e) >= n for e in exs), sum(sum(e.loss_mask[:n]) < 2 for e in exs)
    assert f"{cut} cut at max_length {n}, {dropped} dropped" in out


def test_bad_record_names_file_and_line(data_file, capsys):
    with data_file.open("a") as f:
        f.write('{"id": "x", "conversations": [{"from": "alien", "value": "?"}]}\n')
    rc, _, err = show(capsys, data_file)
    assert rc == 2 and err.strip().splitlines()[-1].startswith(f"vatspec show-data: error: {data_file}:4:")
    rc, out, _ = show(capsys, data_file, "--skip-bad", "--color", "never")
    assert rc == 0 and "4 records read, 1 bad skipped, 3 conversations" in out


def test_color(data_file, capsys):
    rc, out, _ = show(capsys, data_file, "-n", 1, "--color", "always")
    assert rc == 0 and "\x1b[32m" + ANSWERS["a"] in out and "[[" not in out
