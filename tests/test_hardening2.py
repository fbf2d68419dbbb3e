"""Hardening, second pass: values nothing can use are refused before any work, in one line naming the flag,
field or file, and nothing present before is changed (the file checksums are compared)."""

from __future__ import annotations

import hashlib
import json

import pytest

from vatspec.cli import main

CONVS = [{"id": f"c{k}", "messages": [{"role": "user", "content": f"Question {k}: say {w}."},
                                      {"role": "assistant", "content": f"{w} {w}, as you asked."}]}
         for k, w in enumerate(["one", "two", "three", "four", "five", "six"])]


def checksums(root):
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def env(tmp_path, tiny_target_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({**c, "id": f"h{k}"}) + "\n" for k, c in enumerate(CONVS[:2])))
    base = [f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={tmp_path / 'run'}",
            "data.max_length=64", "drafter.draft_vocab_size=256", "train.steps=1"]
    return tmp_path, base, data, held


CASES = [
    # (name, extra train arguments (with {data}, {held}), message)
    ("held-out file equal to the training file", ["data.heldout={data}"], "shares 6 of 6 conversations with"),
    ("held-out prompts repeat training prompts", ["data.heldout={held}"], "shares 2 of 2 conversations with"),
    ("repeated target layers", ["drafter.target_layer_ids=[1,1,2]"], "drafter.target_layer_ids: [1, 1, 2] repeats"),
]


@pytest.mark.parametrize("name, extra, message", CASES, ids=[c[0] for c in CASES])
def test_train_refuses_before_any_work(env, capsys, name, extra, message):
    tmp_path, base, data, held = env
    before = checksums(tmp_path)
    rc = main(["train", *base, *[e.format(data=data, held=held) for e in extra]])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("vatspec train: error:")]
    assert len(lines) == 1
    assert checksums(tmp_path) == before and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "--k 0 drafts nothing"),
    (["--k", "9"], "--k 9: the DFlash draft 'd' fills at most 3 tokens a round (its block of 4)"),
    (["--relative-to", "nobody"], "--relative-to 'nobody': no such method (have d, ar, hf_generate)"),
])
def test_eval_refuses_before_decoding(tmp_path, tiny_target_dir, capsys, flags, message):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    run = tmp_path / "run"
    assert main(["train", f"target.path={tiny_target_dir}", f"data.train={data}", f"train.out_dir={run}",
                 "data.max_length=64", "drafter=dflash", "drafter.block_size=4", "drafter.num_anchors=4",
                 "train.steps=1", "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "eval"
    rc = main(["eval", "--target", str(tiny_target_dir), "--draft", f"d={run}", "--bench", "gsm8k", "--num-prompts",
               "1", "--max-new-tokens", "4", "--out", str(out), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not out.exists()  # nothing decoded, nothing written


def test_a_section_given_twice_in_yaml_is_refused(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 5\nloss:\n  kind: vat\ntrain:\n  seed: 3\n")
    assert main(["train", "--config", str(f), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"{f}: not valid YAML" in err and "'train' is given twice (line 5)" in err


def test_resume_and_init_from_together_are_refused(tmp_path, capsys):
    assert main(["train", "target.path=default", f"train.out_dir={tmp_path / 'r'}", "--resume", "--init-from",
                 str(tmp_path)]) == 2
    assert "--resume continues a run from its own checkpoint; --init-from starts a new run" in capsys.readouterr().err


def test_export_k_must_draft(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", str(tmp_path), "--out", str(tmp_path / "o"), "--format", "speculators", "--k", "0"])
    assert "argument --k/--speculative-tokens: must be >= 1, got 0" in capsys.readouterr().err
