"""The target summary said when a target is opened (``vatspec.target.architecture``), and the refusal of a target whose
cache cannot be taken back, before any work."""

from __future__ import annotations

import pytest

from tests.test_rollback import _model
from vatspec.cli import main
from vatspec.target.architecture import describe, engine_support, layer_kinds, summary
from vatspec.target.rollback import RollbackError, plan

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_hybrid_is_summarised_by_its_layers_rollback_and_engines():
    target = _model("qwen3_next")
    s = summary(target)
    assert s["kinds"] == {"linear attention / SSM": 1, "attention": 1} and s["experts"] == 4 and not s["mla"]
    assert s["rollback"] == "LinearAttentionLayer x1: record, DynamicLayer x1: crop"
    assert s["engines"] == {"vllm 0.32.0": {"eagle3": True, "dflash": True},
                            "sglang 0.5.23": {"eagle3": True, "dflash": True}}
    lines = describe(target)
    assert lines[0] == "target Qwen3NextForCausalLM: 2 layers: linear attention / SSM x1, attention x1; 4 experts"
    assert "EAGLE-3 none by default (too shallow)" in lines[1]


def test_layer_kinds_windows_and_engines_from_the_config():
    from transformers import DeepseekV3Config, Gemma3TextConfig, Llama4TextConfig, MistralConfig

    g = Gemma3TextConfig(num_hidden_layers=6, sliding_window=16)
    assert layer_kinds(g) == {"sliding window": 5, "attention": 1}
    assert layer_kinds(Llama4TextConfig(num_hidden_layers=4)) == {"chunked attention": 3, "attention": 1}
    assert layer_kinds(MistralConfig(num_hidden_layers=3, sliding_window=8)) == {"sliding window": 3}
    assert layer_kinds(DeepseekV3Config(num_hidden_layers=2)) == {"attention": 2}
    from transformers import FalconH1Config, GraniteConfig

    from vatspec.target.architecture import _logits

    assert _logits(FalconH1Config(lm_head_multiplier=0.5)) == ["x 0.5"]
    assert _logits(GraniteConfig(logits_scaling=4.0)) == ["x 0.25"]
    assert _logits(Gemma3TextConfig(final_logit_softcapping=30.0)) == ["soft-cap 30"]
    table = engine_support()  # read from the engines' own sources (tools/engine_support.py)
    assert "Gemma3ForCausalLM" not in table["vllm"]["eagle3"] and "Gemma3ForCausalLM" in table["sglang"]["eagle3"]
    assert "Qwen3_5ForConditionalGeneration" in table["vllm"]["dflash"]


def test_a_target_that_returns_no_cache_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    target = _model("llama")
    forward = type(target).forward

    def no_cache(self, *a, **k):
        out = forward(self, *a, **k)
        out.past_key_values = None
        return out

    monkeypatch.setattr(type(target), "forward", no_cache)
    monkeypatch.setattr(type(target), "__call__", no_cache)
    with pytest.raises(RollbackError, match="^LlamaForCausalLM returns no cache: its drafts cannot be verified$"):
        plan(target)
    # through a command: opened, summarised, refused before any draft is read or prompt decoded
    import vatspec.commands.eval as cmd

    monkeypatch.setattr(cmd, "open_target", lambda *a, **k: target)
    code = main(["eval", "--draft", f"x={tmp_path / 'nothing'}", "--out", str(tmp_path / "out"), "--target", "x"])
    err = capsys.readouterr().err
    assert code != 0 and "returns no cache: its drafts cannot be verified" in err, err
    assert not (tmp_path / "out").exists()
