"""The three served formats' tables: names, files, config keys, layer-id conversion, and which
format a config.json is (see ``vatspec.export`` for the formats and the engines' layer-id conventions)."""

from __future__ import annotations

import json
from pathlib import Path

from vatspec.checkpoint import CheckpointError

FORMATS: dict[str, str] = {"eagle3-hf": "eagle3", "speculators": "eagle3", "dflash": "dflash"}  # -> drafter kind
DEFAULT_FORMAT = {"eagle3": "eagle3-hf", "dflash": "dflash"}
CONFIG, WEIGHTS, HEAD_DIR = "config.json", "model.safetensors", "accept_head"
MASK_FILE = "mask_embedding.pt"  # DFlash: a learned MASK row, {"mask_token_id": int, "embedding": [H]}
HEAD_FORMAT = "vatspec-accept-head"
HEAD_INPUT = "draft_hidden_post_norm"  # the drafter's last hidden state after its final norm (lm_head's input)
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# The fields each format's config.json holds: exactly these, no more (validate_export checks).
LLAMA_LAYER_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta",
    "rope_scaling", "attention_bias", "mlp_bias", "tie_word_embeddings",
})
CONFIG_KEYS: dict[str, frozenset[str]] = {
    "eagle3-hf": LLAMA_LAYER_KEYS | {
        "architectures", "torch_dtype", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
        "eagle_config", "eagle_aux_hidden_state_layer_ids",
    },
    "speculators": frozenset({
        "speculators_model_type", "architectures", "torch_dtype", "transformer_layer_config", "draft_vocab_size",
        "norm_before_residual", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "speculators_config",
    }),
    "dflash": (LLAMA_LAYER_KEYS - {"mlp_bias"}) | {
        "architectures", "torch_dtype", "is_causal", "block_size", "num_target_layers", "dflash_config",
        "eagle_aux_hidden_state_layer_ids",
    },
}


class ExportError(CheckpointError):
    """A draft cannot be exported, an export is invalid, or an imported draft does not fit the target."""


def to_vllm_ids(ids) -> list[int]:
    """Our ids (output of layer i) -> vLLM's ``eagle_aux_hidden_state_layer_ids`` (input of layer j)."""
    return [int(i) + 1 for i in ids]


def served_layer_ids(fmt: str, cfg: dict, num_layers: int) -> tuple[list[int], list[str]]:
    """The target layers (ours: output of layer i) the engines capture for a served ``config.json``, in
    the order it lists them, and the disagreements between its fields. EAGLE-3: SGLang's
    ``eagle_config`` ids, else vLLM's top-level ids - 1, else both engines' default; DFlash:
    ``dflash_config.target_layer_ids``, else the reference's default for its draft depth."""
    from vatspec.drafters.dflash import default_target_layer_ids
    from vatspec.drafters.eagle3 import default_layer_ids

    vllm = cfg.get("eagle_aux_hidden_state_layer_ids")
    if fmt == "dflash":
        dc = cfg.get("dflash_config") or {}
        ids = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            nt = dc.get("num_target_layers", cfg.get("num_target_layers", num_layers))
            ids = default_target_layer_ids(nt, cfg.get("num_hidden_layers", 1))
        ids = [int(i) for i in ids]
        if vllm is not None and [int(i) for i in vllm] != to_vllm_ids(ids):
            return ids, [f"eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of layer j) is not "
                         f"dflash_config.target_layer_ids {ids} + 1; using dflash_config (the engines would read "
                         "different layers)"]
        return ids, []
    sglang = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if fmt == "eagle3-hf" else None
    if sglang is not None:
        ids = [int(i) for i in sglang]
        if vllm is not None and to_vllm_ids(ids) != [int(i) for i in vllm]:
            return ids, [f"eagle_config.eagle_aux_hidden_state_layer_ids {ids} (SGLang, output of layer i) and "
                         f"eagle_aux_hidden_state_layer_ids {vllm} (vLLM, input of layer j) disagree; using SGLang's "
                         "(SGLang and vLLM would read different layers)"]
        return ids, []
    if vllm is not None:
        return [int(i) - 1 for i in vllm], []
    return list(default_layer_ids(num_layers)), []


def expected_weights(fmt: str, cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``fmt`` export and its shape, from the sizes in its config.json."""
    lc = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    H, I, nh = lc["hidden_size"], lc["intermediate_size"], lc["num_attention_heads"]
    nkv, hd = lc.get("num_key_value_heads") or nh, lc.get("head_dim") or H // nh
    Ht = cfg.get("target_hidden_size") or H
    attn_in = H if fmt == "dflash" else 2 * H  # EAGLE-3's q/k/v read cat(embedding, hidden)

    def layer(p: str) -> dict[str, tuple[int, ...]]:
        w = {f"{p}self_attn.q_proj.weight": (nh * hd, attn_in), f"{p}self_attn.k_proj.weight": (nkv * hd, attn_in),
             f"{p}self_attn.v_proj.weight": (nkv * hd, attn_in), f"{p}self_attn.o_proj.weight": (H, nh * hd),
             f"{p}mlp.gate_proj.weight": (I, H), f"{p}mlp.up_proj.weight": (I, H), f"{p}mlp.down_proj.weight": (H, I),
             f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)}
        if fmt == "dflash":
            w |= {f"{p}self_attn.q_norm.weight": (hd,), f"{p}self_attn.k_norm.weight": (hd,)}
        else:
            w[f"{p}hidden_norm.weight"] = (H,)
        return w

    if fmt == "dflash":
        n = len(cfg["dflash_config"]["target_layer_ids"])
        out = {"fc.weight": (H, n * Ht), "hidden_norm.weight": (H,), "norm.weight": (H,)}
        for i in range(cfg["num_hidden_layers"]):
            out |= layer(f"layers.{i}.")
        return out
    V, Vd = lc["vocab_size"], cfg["draft_vocab_size"]
    out = {"fc.weight": (H, 3 * Ht), **layer("midlayer." if fmt == "eagle3-hf" else "layers.0."),
           "norm.weight": (H,), "lm_head.weight": (Vd, H), "d2t": (Vd,), "t2d": (V,)}
    if fmt == "speculators":  # the target's embedding: the library does not load it from the verifier
        out["embed_tokens.weight"] = (V, H)
    return out


def served_name(fmt: str, name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if fmt == "speculators" and name.startswith("midlayer.") else name


def internal_name(fmt: str, name: str) -> str:
    return "midlayer." + name[len("layers.0."):] if fmt == "speculators" and name.startswith("layers.0.") else name


def detect_format(cfg: dict, source: str) -> str:
    """``eagle3-hf`` | ``speculators`` | ``dflash`` from a config.json's contents."""
    if cfg.get("speculators_model_type") is not None:
        if cfg["speculators_model_type"] != "eagle3":
            raise ExportError(f"{source}: speculators_model_type {cfg['speculators_model_type']!r} is not supported "
                              "(only 'eagle3')")
        return "speculators"
    archs = cfg.get("architectures") or []
    if any(a in EAGLE3_ARCHS for a in archs):
        return "eagle3-hf"
    if "DFlashDraftModel" in archs:
        return "dflash"
    raise ExportError(f"{source}: architectures {archs} is neither an EAGLE-3 draft (LlamaForCausalLMEagle3, "
                      "Eagle3Speculator) nor a DFlash draft (DFlashDraftModel)")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ExportError(f"{path} is missing")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path}: expected a JSON object")
    return data

