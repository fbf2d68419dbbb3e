"""The model card (README.md) an export writes: its front matter, what it says of the target, the drafter, the
training settings and the held-out acceptance, and the launch commands for the folder and its target."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from tests.test_export import BLOCK, make_drafter
from vatspec.export import export_draft, validate_export
from vatspec.export.card import model_card

pytestmark = pytest.mark.usefixtures("one_thread")

QWEN3 = "tests/fixtures/chat_templates/Qwen-Qwen3-8B.jinja"


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_an_eagle3_card_from_a_training_run(smol_tokenizer_target, tmp_path, capsys):
    from vatspec.cli import main
    from vatspec.config import load_config
    from vatspec.train import train

    t = smol_tokenizer_target
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Count from {i} to {i + 5}."},
        {"from": "gpt", "value": " ".join(str(j) for j in range(i, i + 6)) + "."}]}) + "\n" for i in range(8)))
    run = tmp_path / "run"
    train(load_config(None, [
        f"target.path={t.path}", f"data.train={data}", f"train.out_dir={run}", "loss.kind=vat",
        f"data.chat_template={QWEN3}", "data.chat_template_kwargs=enable_thinking=false", "data.batch_size=2",
        "data.max_length=48", "data.heldout_max=2", "train.steps=2", "drafter.draft_vocab_size=128",
        "drafter.ttt_steps=2"]), progress=False)
    out = tmp_path / "served" / "e3"
    assert main(["export", str(run), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    record = json.loads((out / "vatspec.json").read_text())

    meta = front_matter(card)
    assert meta["library_name"] == "vatspec" and {"speculative-decoding", "eagle3"} <= set(meta["tags"])
    assert "base_model" not in meta  # a local folder is no hub id: the card says to set it
    assert "set `base_model` in the front matter to its hub id" in card
    assert f"- target: `{t.path}`" in card
    assert "| kind | EAGLE-3 |" in card and "| tokens drafted a round (k) | 2 |" in card
    assert f"| draft vocabulary | 128 of the target's {t.vocab_size} |" in card
    assert f"| target layers read (output of layer i) | {sorted(record['target_layer_ids'])} |" in card
    # what the run trained on and with
    assert f"- data: `{data}`" in card and "- loss: `vat`" in card and f"- chat template: `{QWEN3}`" in card
    assert '(`chat_template_kwargs`): `{"enable_thinking": false}`' in card
    assert "- reasoning: off (`enable_thinking=false`)" in card
    held = record["training"]["heldout"]
    assert held is not None and f"**{held['tau_sim']:.3f}** at step {held['step']}" in card
    # the launch commands name this folder and the target, with the k trained
    spec = shlex.quote(json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 2}))
    assert f"vllm serve {t.path} --speculative-config {spec}" in card
    assert f"--model-path {t.path}" in card and f"--speculative-draft-model-path {out}" in card
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in card
    # the folder with its card is still a valid export that check passes
    assert validate_export(out, t) == "eagle3-hf"
    capsys.readouterr()
    assert main(["check", str(out), "--target", t.path, "--no-measure", "--chat-template", QWEN3,
                 "--chat-template-kwargs", "enable_thinking=false"]) == 0


def test_a_dflash_card_without_a_run(smol_tokenizer_target, tmp_path):
    from vatspec.cli import main

    t = smol_tokenizer_target
    out = export_draft(make_drafter("dflash", t), t, tmp_path / "df")
    card = (out / "README.md").read_text()
    assert {"speculative-decoding", "dflash"} <= set(front_matter(card)["tags"])
    assert "| kind | DFlash |" in card and f"| block size | {BLOCK} |" in card
    assert f"| tokens drafted a round (block size - 1) | {BLOCK - 1} |" in card
    assert "- data: not recorded" in card and "Not measured" in card  # nothing invented
    assert "- chat template arguments: not recorded" in card and "reasoning" not in card
    spec = shlex.quote(json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": BLOCK - 1}))
    assert f"vllm serve {t.path} --speculative-config {spec}" in card
    assert (f"--model-path {t.path} \\\n    --speculative-algorithm DFLASH --speculative-draft-model-path {out} \\\n"
            f"    --speculative-num-draft-tokens {BLOCK}") in card
    assert validate_export(out, t) == "dflash"
    assert main(["check", str(out), "--target", t.path, "--no-measure"]) == 0


def test_a_hub_target_is_the_base_model_and_speculators_serves_alone(smol_tokenizer_target, tmp_path):
    t = smol_tokenizer_target
    out = export_draft(make_drafter("eagle3", t), t, tmp_path / "spec", fmt="speculators", k=5,
                       verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    card = (out / "README.md").read_text()
    assert front_matter(card)["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the verifier vLLM loads
    assert "set `base_model`" not in card
    assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config" in card
    assert f"vllm serve {out}\n" in card and "SGLang does not load the `speculators` format" in card
    assert '"num_speculative_tokens": 5' in card and "| tokens drafted a round (k) | 5 |" in card
    cfg = json.loads((out / "config.json").read_text())
    assert model_card("speculators", cfg, None, target=None, folder="x", k=1) == model_card(
        "speculators", cfg, None, target=None, folder="x", k=1)  # a pure function of what the export holds
    assert "Not measured" in model_card("speculators", cfg, None, target=None, folder="x", k=1)
