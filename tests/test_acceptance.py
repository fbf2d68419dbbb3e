"""``vatspec acceptance`` on a tiny target: per-prompt chains add up to the held-out evaluation of training, the
printed table and paired interval come from them, and a bad input is one line naming the flag or file."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import COUNT_CONVS, tiny_llama
from vatspec import data as D
from vatspec.cli import main
from vatspec.commands import acceptance
from vatspec.config import load_config
from vatspec.train import CHAINS_KEY, build_arm, evaluate_arms, tokenize_items, train


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_target_path):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("acceptance")
    tok = AutoTokenizer.from_pretrained(default_target_path)
    target = root / "target"
    tiny_llama(vocab_size=len(tok), hidden_size=32, layers=6).save_pretrained(target)
    tok.save_pretrained(target)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in COUNT_CONVS))
    # the answers file: benchmark-like ids (as regenerate writes them), never trained on
    answers = root / "answers.jsonl"
    answers.write_text("".join(json.dumps({"id": f"{b}/{i}", "messages": [
        {"role": "user", "content": f"Count from {i} to {i + 4}."},
        {"role": "assistant", "content": " ".join(str(j) for j in range(i, i + 5))}], "meta": {"finish": ["stop"]}})
        + "\n" for i, b in enumerate(["gsm8k", "HumanEval", "mt_bench", "alpaca"] * 2)))
    runs = {}
    for kind in ("eagle3", "dflash"):
        for loss in (kind, "vat"):
            run = root / f"{kind}-{loss}"
            train(load_config(None, [
                f"target.path={target}", f"data.train={data}", f"train.out_dir={run}", "data.batch_size=2",
                "data.max_length=64", "data.heldout_max=2", "drafter.draft_vocab_size=256", "drafter.ttt_steps=3",
                "drafter.block_size=4", "drafter.num_anchors=4", "train.steps=3", "optim.lr=1e-3",
                f"drafter.kind={kind}", f"loss.kind={loss}"]), progress=False)
            runs[f"{kind}-{loss}"] = run
    return target, answers, runs


def test_per_prompt_chains_add_up_to_the_training_evaluation(setup):
    from vatspec.target import open_target

    target_dir, answers, runs = setup
    target = open_target(str(target_dir), device="cpu", dtype="float32")
    convs = D.load_conversations(answers)
    run = runs["eagle3-eagle3"]
    r = acceptance.per_prompt(str(run), target, convs)
    assert len(r["accepted"]) == len(r["chains"]) == len(convs) and all(c > 0 for c in r["chains"])
    # the same draft through training's own held-out evaluation, all prompts in one batch
    cfg = load_config(run / "config.yaml", ["train.out_dir=unused", "loss.kind=eagle3"])
    arm = build_arm(cfg, target, None, 1, device=torch.device("cpu"), init_from=str(run))
    ex = tokenize_items(convs, target.tokenizer, cfg.data.max_length, "answers")
    chains = evaluate_arms([arm], target, ex, cfg, torch.device("cpu"))[0][CHAINS_KEY]
    assert sum(r["chains"]) == len(chains)
    assert acceptance.tau(r) == pytest.approx(1 + sum(chains) / len(chains), abs=1e-9)


def test_command_prints_each_benchmark_and_the_paired_interval(setup, capsys, tmp_path):
    target_dir, answers, runs = setup
    threads = torch.get_num_threads()
    try:
        assert main([
            "acceptance", "--target", str(target_dir), "--answers", str(answers), "--device", "cpu", "--threads", "1",
            "--json", str(tmp_path / "a.json"), "--pair", "vat=base", "--pair", "dvat=dbase",
            f"base={runs['eagle3-eagle3']}", f"vat={runs['eagle3-vat']}", f"dbase={runs['dflash-dflash']}",
            f"dvat={runs['dflash-vat']}"]) == 0
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "alpaca" in text and "humaneval" in text and "gsm8k" in text and "mt_bench" in text
    assert "vat - base" in text and "dvat - dbase" in text and "95% interval" in text
    out = json.loads((tmp_path / "a.json").read_text())
    assert set(out) == {"base", "vat", "dbase", "dvat"}
    for name, r in out.items():
        assert r["tau_sim"] == pytest.approx(acceptance.tau(r)) and 1.0 <= r["tau_sim"] <= 4.0 and len(r["acc"]) == 3
        assert name in text


def test_bad_inputs_are_one_line_naming_the_flag_or_file(setup, capsys, tmp_path):
    target_dir, answers, runs = setup
    base = f"base={runs['eagle3-eagle3']}"
    common = ["acceptance", "--target", str(target_dir), "--answers", str(answers), "--device", "cpu"]
    cases = [
        (["--pair", "base=nope", base], "--pair base=nope: no draft named 'nope'"),
        (["base"], "'base': expected NAME=RUN"),
        ([base, base], "the name 'base' is given twice"),
        ([f"x={tmp_path / 'missing'}"], "is not a folder"),
        ([f"x={tmp_path}"], "config.yaml does not exist"),
        (["--json", str(answers), base], "--json"),
    ]
    for extra, message in cases:
        assert main([*common, *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("vatspec acceptance: error: ") and "\n" not in err and message in err, (extra, err)
    with pytest.raises(SystemExit):
        main([*common, "--prompts", "5:2", base])
    assert "--prompts" in capsys.readouterr().err
