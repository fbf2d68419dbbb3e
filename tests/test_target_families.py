"""Targets of the families teams train drafts for, built by transformers from its own config classes (tiny random
weights, nothing downloaded): ``Target.logits`` is the model's own, and the folders their checkpoints ship as
(Nemotron-H's ``backbone.*`` names, Qwen3.5's multimodal wrapper) open as targets, heads-only and on the meta device.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vatspec.target import Target, TargetError

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64  # tiny vocabulary (the SmolLM2 tokenizer saved beside a folder is only read, never applied)
LAYER = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# float32 rounding: Target.logits multiplies by 1 / logits_scaling where Granite divides
LOGITS_ATOL = 1e-6


# ----------------------------------------------------------------------------- logits
def family_config(name: str):
    import transformers as T

    mamba = dict(mamba_d_state=8, mamba_chunk_size=8)
    return {
        "llama": lambda: T.LlamaConfig(**LAYER),
        "falcon_h1": lambda: T.FalconH1Config(**LAYER, lm_head_multiplier=0.37, mamba_d_ssm=32, mamba_n_heads=4,
                                              mamba_d_head=8, mamba_n_groups=1, **mamba),
        "granite": lambda: T.GraniteConfig(**LAYER, logits_scaling=3.0),
        "granitemoehybrid": lambda: T.GraniteMoeHybridConfig(**LAYER, logits_scaling=3.0, mamba_n_heads=4,
                                                             layer_types=["mamba", "attention"], num_local_experts=2,
                                                             **mamba),
        "hyperclovax": lambda: T.HyperCLOVAXConfig(**LAYER, logits_scaling=3.0),  # multiplies by the same field
        "cohere": lambda: T.CohereConfig(**LAYER, logit_scale=0.25),
        "gemma3": lambda: T.Gemma3TextConfig(**LAYER, head_dim=8, final_logit_softcapping=0.5),
    }[name]()


@pytest.mark.parametrize("family", ["llama", "falcon_h1", "granite", "granitemoehybrid", "hyperclovax", "cohere",
                                    "gemma3"])
def test_logits_are_the_models_own(family):
    """What each family's forward does after its lm_head (a multiplier, a divisor, a soft cap) is in
    ``Target.logits``, so the teacher a draft learns and the verification it is judged by are the model's."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family)).eval()
    t = Target(model, tokenizer=None)
    assert (t.logit_scale, t.logit_softcap) != (1.0, None) or family == "llama"  # each case has its transform
    ids = torch.randint(0, V, (2, 7))
    out = t(ids)
    torch.testing.assert_close(t.logits(out.hidden), model(input_ids=ids).logits.float(), atol=LOGITS_ATOL, rtol=0)


# ----------------------------------------------------------------------------- Nemotron-H: backbone.* keys
def save_with_tokenizer(model, folder, tokenizer_dir) -> None:
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)


@pytest.fixture(scope="module")
def nemotron_h_dir(tmp_path_factory, default_target_path):
    from transformers import AutoModelForCausalLM, NemotronHConfig

    cfg = NemotronHConfig(
        vocab_size=V, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "moe"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=8, n_groups=1, chunk_size=8, n_routed_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, moe_shared_expert_intermediate_size=16)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("nemotron_h")
    save_with_tokenizer(AutoModelForCausalLM.from_config(cfg), folder, default_target_path)
    return folder


def test_nemotron_h_heads_and_embedding_are_found_under_the_checkpoints_names(nemotron_h_dir, monkeypatch, tmp_path):
    """A Nemotron-H checkpoint names its modules ``backbone.*`` (as save_pretrained writes them back), the model
    ``model.*``: cached training (heads only) and an export (meta device) read them through transformers' renaming,
    else by leaf name and shape; a folder without the embedding fails in one line."""
    with safe_open(str(nemotron_h_dir / "model.safetensors"), framework="pt") as f:
        assert "backbone.embeddings.weight" in f.keys()  # noqa: SIM118 (a safetensors handle, not a dict)
    full = Target.from_pretrained(nemotron_h_dir)
    emb, head = full.embed_tokens.weight, full.lm_head.weight
    assert full.model.get_input_embeddings() is full.model.model.embeddings

    def heads_only_and_meta():
        ho = Target.from_pretrained(nemotron_h_dir, heads_only=True)
        assert torch.equal(ho.embed_tokens.weight, emb) and torch.equal(ho.lm_head.weight, head)
        h = torch.randn(3, 32)
        assert torch.equal(ho.logits(h), full.logits(h))
        assert torch.equal(Target.from_pretrained(nemotron_h_dir, device="meta").input_embedding(), emb)

    heads_only_and_meta()
    monkeypatch.setattr("vatspec.target.families._renamed_by_transformers", lambda model, keys: {})
    heads_only_and_meta()  # without transformers' renaming: the one key ending in embeddings.weight of [V, H]
    monkeypatch.undo()

    broken = tmp_path / "broken"
    broken.mkdir()
    for p in nemotron_h_dir.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    w = load_file(broken / "model.safetensors")
    w["backbone.embeddings.other"] = w.pop("backbone.embeddings.weight")
    save_file(w, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetError, match=r"no safetensors file holds \['model.embeddings.weight'\]"):
        Target.from_pretrained(broken, heads_only=True)
    with pytest.raises(TargetError, match="no safetensors file holds the input embedding 'model.embeddings.weight'"):
        Target.from_pretrained(broken, device="meta").input_embedding()


# ----------------------------------------------------------------------------- Qwen3.5: a multimodal wrapper
@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, default_target_path):
    """A tiny Qwen3.5 as published: ``Qwen3_5ForConditionalGeneration`` (a vision tower beside the text model)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(LAYER, num_hidden_layers=4, head_dim=8, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=["linear_attention", "full_attention"] * 2)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).eval()
    folder = tmp_path_factory.mktemp("qwen3_5")
    save_with_tokenizer(model, folder, default_target_path)
    return model, folder


def test_a_qwen3_5_multimodal_folder_opens_as_its_text_model(qwen3_5, tmp_path):
    from vatspec.drafters.eagle3 import Eagle3Drafter
    from vatspec.export import export_draft, validate_export
    from vatspec.features.format import target_config

    wrapper, folder = qwen3_5
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    t = Target.from_pretrained(folder)
    assert t.config.model_type == "qwen3_5_text" and (t.num_layers, t.hidden_size, t.vocab_size) == (4, 32, V)
    assert len(t._layers) == 4
    ids = torch.randint(0, V, (1, 9))
    out = t(ids, layer_ids=[0, 2])
    ref = wrapper(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits.float())  # the wrapper's own logits
    torch.testing.assert_close(out.features, torch.cat([ref.hidden_states[1], ref.hidden_states[3]], -1))
    torch.testing.assert_close(t.logits(out.hidden), ref.logits.float())

    ho = Target.from_pretrained(folder, heads_only=True)  # model.language_model.* in the checkpoint
    assert torch.equal(ho.embed_tokens.weight, t.embed_tokens.weight) and torch.equal(ho.lm_head.weight,
                                                                                       t.lm_head.weight)
    # vatspec export opens the target on the meta device: the text config's sizes, the embedding from the file
    meta = Target.from_pretrained(folder, device="meta")
    assert meta.config.model_type == "qwen3_5_text" and target_config(meta) == target_config(t)
    draft = Eagle3Drafter.from_target(t, draft_vocab_size=V, ttt_steps=2)
    out_dir = export_draft(draft, meta, tmp_path / "served", fmt="speculators")
    assert validate_export(out_dir, meta) == "speculators"
    layer = json.loads((out_dir / "config.json").read_text())["transformer_layer_config"]
    assert (layer["hidden_size"], layer["vocab_size"]) == (32, V)


def test_a_wrapper_transformers_does_not_open_as_a_causal_lm_is_refused_in_one_line(tmp_path):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    llava = LlavaConfig(text_config=LlamaConfig(**LAYER), vision_config=CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=4))
    LlavaForConditionalGeneration(llava).save_pretrained(tmp_path)
    with pytest.raises(TargetError, match=r"^[^\n]*its text model \(llama\) is a causal LM, but transformers does "
                                          r"not open it from a llava folder[^\n]*$"):
        Target.from_pretrained(tmp_path)
