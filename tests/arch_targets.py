"""Tiny random-weight targets of every architecture family the project claims, from transformers' own config
classes (nothing is downloaded), saved as Hugging Face folders with the SmolLM2 tokenizer (ChatML template,
vocabulary 49152) and a generation config whose eos is ``<|im_end|>``.

    path = build_target("qwen3_next", out_dir, smollm2_dir)
    ARCHS["gemma3"].config(vocab_size=49152, eos=2)     # the config alone

Each family keeps the features that make it different for a speculative decoder, at tiny sizes (hidden 64, four
layers, float32):
  * hybrids hold both their attention and their recurrent / linear layer kinds (the caches that cannot crop);
  * windowed models hold sliding (or chunked) and full layers, with a window of ``WINDOW`` tokens, so a chat
    prompt (~40 tokens) plus ~24 new tokens crosses it;
  * mixtures of experts keep a few experts and their routing; published multipliers and caps are kept.
Weights are drawn with ``initializer_range=INIT`` (random targets at the default 0.02 repeat one token under
greedy decoding; a verifier must roll back on varied tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.gptoss_target import gptoss_config

H, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 4, 2, 16
WINDOW = 12  # sliding window / attention chunk, in tokens: the chat prompt alone is ~40
INIT = 0.2  # initializer_range: greedy output of a random model then varies over 24 tokens
EXPERTS, TOP_K = 4, 2


def _common(vocab_size: int, eos: int, **kw) -> dict:
    """The sizes every family shares; ``kw`` overrides."""
    return dict(
        vocab_size=vocab_size, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        initializer_range=INIT, tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos, pad_token_id=eos,
    ) | kw


def _sliding_then_full(n: int = LAYERS, kind: str = "sliding_attention") -> list[str]:
    return [kind] * (n - 1) + ["full_attention"]


# --------------------------------------------------------------------------- one config per family
def llama(vocab_size: int, eos: int):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM))


def mistral(vocab_size: int, eos: int):
    """Mistral-7B-v0.1's shape: every layer slides (no full layer in this family)."""
    from transformers import MistralConfig

    return MistralConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM, sliding_window=WINDOW))


def qwen3(vocab_size: int, eos: int):
    from transformers import Qwen3Config

    return Qwen3Config(**_common(vocab_size, eos, head_dim=HEAD_DIM))


def qwen3_moe(vocab_size: int, eos: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM, num_experts=EXPERTS,
                                    num_experts_per_tok=TOP_K, moe_intermediate_size=H, decoder_sparse_step=1,
                                    norm_topk_prob=True))


def _linear_attention(**kw) -> dict:
    """Qwen3-Next / Qwen3.5's gated delta-net sizes, and its 3:1 pattern of linear and full layers."""
    return dict(head_dim=HEAD_DIM, layer_types=_sliding_then_full(kind="linear_attention"),
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_conv_kernel_dim=4) | kw


def qwen3_5(vocab_size: int, eos: int):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_common(vocab_size, eos, **_linear_attention()))


def qwen3_5_vl(vocab_size: int, eos: int):
    """The multimodal wrapper published Qwen3.5 checkpoints ship (``Qwen3_5ForConditionalGeneration``): the text
    model of ``qwen3_5`` under ``model.language_model``, a one-block vision tower beside it."""
    from transformers import Qwen3_5Config

    text = qwen3_5(vocab_size, eos).to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=8,
                  num_position_embeddings=16, initializer_range=INIT)
    # image/video ids: SmolLM2 has no such tokens; ids past the first 100 keep them out of the chat template's
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=vocab_size - 3,
                         video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 1,
                         vision_end_token_id=vocab_size - 4, tie_word_embeddings=False,
                         architectures=["Qwen3_5ForConditionalGeneration"])


def qwen3_next(vocab_size: int, eos: int):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_common(vocab_size, eos, **_linear_attention(
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=H,
        shared_expert_intermediate_size=H, decoder_sparse_step=1)))


def deepseek_v3(vocab_size: int, eos: int):
    """Multi-head latent attention (low-rank q and kv, a decoupled RoPE part) and routed + shared experts after
    one dense layer."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_common(
        vocab_size, eos, num_key_value_heads=HEADS, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
        moe_intermediate_size=H, first_k_dense_replace=1, n_group=1, topk_group=1))


def gpt_oss(vocab_size: int, eos: int):
    """``tests/gptoss_target.py``'s published shape (alternating sliding / full layers, attention sinks, YaRN,
    top-k experts) with a ``WINDOW``-token window."""
    cfg = gptoss_config(vocab_size, pad_token_id=eos, eos_token_id=eos)
    cfg.sliding_window, cfg.initializer_range = WINDOW, INIT
    return cfg


def glm4_moe(vocab_size: int, eos: int):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM, n_routed_experts=EXPERTS,
                                   num_experts_per_tok=TOP_K, n_shared_experts=1, moe_intermediate_size=H,
                                   first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
                                   attention_bias=True))


def gemma3(vocab_size: int, eos: int):
    """Gemma-3's text model: sliding and global layers (global every fourth here, every sixth published), GELU,
    a scaled embedding, query_pre_attn_scalar. Untied here (published: tied): a random tied model's x sqrt(H)
    input embedding outweighs its layers, and greedy decoding repeats the input token."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM, sliding_window=WINDOW,
                                      layer_types=_sliding_then_full(), query_pre_attn_scalar=HEAD_DIM))


def llama4(vocab_size: int, eos: int):
    """Llama-4's text model: chunked attention with RoPE on three layers of four, a NoPE global layer, experts
    (top-1 routed + a shared one) on every other layer."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**_common(vocab_size, eos, head_dim=HEAD_DIM, intermediate_size_mlp=2 * H,
                                      intermediate_size=H, attention_chunk_size=WINDOW, num_local_experts=EXPERTS,
                                      num_experts_per_tok=1, interleave_moe_layer_step=2))


def kimi_linear(vocab_size: int, eos: int):
    """Kimi Linear: KDA (delta-rule linear attention) layers 3:1 with MLA full-attention layers, experts after a
    dense first layer."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**_common(
        vocab_size, eos, num_key_value_heads=HEADS, layer_types=_sliding_then_full(kind="linear_attention"),
        mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), linear_head_dim=16, linear_num_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, moe_intermediate_size=H))


def nemotron_h(vocab_size: int, eos: int):
    """Nemotron-H: Mamba-2, MoE, attention and MLP blocks, one each."""
    from transformers import NemotronHConfig

    kw = _common(vocab_size, eos, head_dim=HEAD_DIM, layers_block_type=["linear_attention", "moe", "full_attention",
                                                                         "mlp"],
                 ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16,
                 n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1, moe_intermediate_size=H,
                 moe_shared_expert_intermediate_size=H, n_group=1, topk_group=1)
    del kw["num_hidden_layers"]  # derived from layers_block_type
    return NemotronHConfig(**kw)


def falcon_h1(vocab_size: int, eos: int):
    """Falcon-H1: attention and Mamba-2 side by side in every layer, with the published muP multipliers (on the
    embedding, the logits, keys, attention and SSM in/out)."""
    from transformers import FalconH1Config

    return FalconH1Config(**_common(vocab_size, eos, head_dim=HEAD_DIM, mamba_d_ssm=64, mamba_n_heads=4,
                                    mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
                                    lm_head_multiplier=0.5, embedding_multiplier=2.0, key_multiplier=0.8,
                                    attention_in_multiplier=1.2, attention_out_multiplier=0.9,
                                    ssm_in_multiplier=1.1, ssm_out_multiplier=0.7))


def lfm2(vocab_size: int, eos: int):
    """LFM2: short gated convolutions and full attention, alternating."""
    from transformers import Lfm2Config

    kw = _common(vocab_size, eos, layer_types=["conv", "full_attention"] * (LAYERS // 2), conv_L_cache=3,
                 block_auto_adjust_ff_dim=False)
    return Lfm2Config(**kw)


def granitemoehybrid(vocab_size: int, eos: int):
    """Granite-4.0 hybrid: Mamba-2 and attention layers, experts + a shared MLP, the published muP multipliers
    (``logits_scaling`` divides the logits)."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(**_common(
        vocab_size, eos, layer_types=["mamba", "attention"] * (LAYERS // 2), num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, shared_intermediate_size=H, mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_head=32, mamba_chunk_size=16, embedding_multiplier=2.0, logits_scaling=2.0, residual_multiplier=0.5,
        attention_multiplier=1 / HEAD_DIM, position_embedding_type="rope"))


def olmo3(vocab_size: int, eos: int):
    from transformers import Olmo3Config

    return Olmo3Config(**_common(vocab_size, eos, sliding_window=WINDOW, layer_types=_sliding_then_full()))


@dataclass(frozen=True)
class Arch:
    config: Callable  # (vocab_size, eos) -> a transformers config
    model: str  # the transformers class it is saved as (its config's architectures)


ARCHS: dict[str, Arch] = {
    "llama": Arch(llama, "LlamaForCausalLM"),
    "mistral": Arch(mistral, "MistralForCausalLM"),
    "qwen3": Arch(qwen3, "Qwen3ForCausalLM"),
    "qwen3_moe": Arch(qwen3_moe, "Qwen3MoeForCausalLM"),
    "qwen3_5": Arch(qwen3_5, "Qwen3_5ForCausalLM"),
    "qwen3_5_vl": Arch(qwen3_5_vl, "Qwen3_5ForConditionalGeneration"),
    "qwen3_next": Arch(qwen3_next, "Qwen3NextForCausalLM"),
    "deepseek_v3": Arch(deepseek_v3, "DeepseekV3ForCausalLM"),
    "gpt_oss": Arch(gpt_oss, "GptOssForCausalLM"),
    "glm4_moe": Arch(glm4_moe, "Glm4MoeForCausalLM"),
    "gemma3": Arch(gemma3, "Gemma3ForCausalLM"),
    "llama4": Arch(llama4, "Llama4ForCausalLM"),
    "kimi_linear": Arch(kimi_linear, "KimiLinearForCausalLM"),
    "nemotron_h": Arch(nemotron_h, "NemotronHForCausalLM"),
    "falcon_h1": Arch(falcon_h1, "FalconH1ForCausalLM"),
    "lfm2": Arch(lfm2, "Lfm2ForCausalLM"),
    "granitemoehybrid": Arch(granitemoehybrid, "GraniteMoeHybridForCausalLM"),
    "olmo3": Arch(olmo3, "Olmo3ForCausalLM"),
}


def model_class(name: str):
    import transformers

    return getattr(transformers, ARCHS[name].model)


def build_target(name: str, out_dir, tokenizer, *, seed: int = 0) -> Path:
    """Save the tiny ``name`` target (``ARCHS``) with ``tokenizer`` (the SmolLM2 one, or its folder) and a
    generation config whose eos is ``<|im_end|>`` to ``out_dir``; returns it."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = model_class(name)(ARCHS[name].config(len(tok), eos)).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
