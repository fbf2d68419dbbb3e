"""The drafters' shared blocks: RoPE parameters from every config layout, frequencies and rotation
against transformers' own rotary embedding, and the gated MLP against its formula."""

from __future__ import annotations

import pytest
import torch

from vatspec.drafters.layers import MLP, apply_rope, rope_cos_sin, rope_init, rope_inv_freq, rope_parameters

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    "cfg, want",
    [
        ({}, (10000.0, None)),  # nothing given: Llama's default theta
        ({"rope_theta": 5e5, "rope_scaling": None}, (5e5, None)),  # transformers 4 layout
        ({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},  # legacy "type" key
         (5e5, {"rope_type": "linear", "factor": 2.0})),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, (1e6, None)),  # transformers 5
        ({"rope_parameters": {"rope_type": "llama3", **LLAMA3, "rope_theta": 5e5}},
         (5e5, {"rope_type": "llama3", **LLAMA3})),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},  # Gemma 3:
                              "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}},
         (1e6, {"rope_type": "linear", "factor": 8.0})),  # the global layers' parameters
    ],
)
def test_rope_parameters_reads_every_layout(cfg, want):
    assert rope_parameters(cfg) == want


def test_rope_parameters_of_a_config_object_and_its_json_agree():
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters={"rope_type": "llama3", **LLAMA3,
                                                                             "rope_theta": 5e5})
    assert rope_parameters(hf) == rope_parameters(hf.to_dict()) == (5e5, {"rope_type": "llama3", **LLAMA3})


@pytest.mark.parametrize(
    "scaling",
    [None, {"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", **LLAMA3},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}],
)
def test_rope_matches_transformers_rotary_embedding(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hd, theta = 16, 5e5
    hf = LlamaConfig(hidden_size=2 * hd, num_attention_heads=2, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta})
    ref = LlamaRotaryEmbedding(hf)
    inv, factor = rope_init(hd, theta, scaling, max_position_embeddings=256)
    # same numbers as transformers' initialisers: bit for bit
    assert torch.equal(inv, ref.inv_freq) and factor == ref.attention_scaling
    if scaling is None:
        assert torch.equal(rope_inv_freq(hd, theta), ref.inv_freq)
    pos = torch.arange(7) + 3
    cos, sin = rope_cos_sin(pos, inv)
    cos, sin = cos * factor, sin * factor
    ref_cos, ref_sin = ref(torch.zeros(1, 7, hd), pos[None])
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    q, k = torch.randn(2, 1, 2, 7, hd).unbind(0)  # [B, heads, T, hd]
    ref_q, ref_k = apply_rotary_pos_emb(q, k, ref_cos, ref_sin)
    assert torch.allclose(apply_rope(q, cos, sin), ref_q, atol=1e-6)
    assert torch.allclose(apply_rope(k, cos, sin), ref_k, atol=1e-6)


def test_rope_init_refuses_a_type_transformers_does_not_know():
    with pytest.raises(ValueError, match="unknown rope_type"):
        rope_init(16, 1e4, {"rope_type": "nope"})


def test_mlp_is_the_gated_formula_with_served_names():
    torch.manual_seed(0)
    m = MLP(8, 12)
    assert sorted(k for k, _ in m.state_dict().items()) == ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    x = torch.randn(3, 8)
    g, u, d = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
    want = ((x @ g.T) * torch.sigmoid(x @ g.T) * (x @ u.T)) @ d.T  # silu(a) = a * sigmoid(a)
    assert torch.allclose(m(x), want, atol=1e-6)
