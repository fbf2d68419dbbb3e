"""Building blocks both drafters use: RMSNorm, RoPE (config parsing, frequencies, rotation), the gated MLP.

Parameter names are the served ones (``weight``; ``gate_proj`` / ``up_proj`` / ``down_proj``), so a
drafter's state_dict keys are the same wherever a block is written. RMSNorm and rotate_half are
transformers' own (Llama's; Qwen3's are the same code), as z-lab's DFlash reference imports them.

RoPE, in three steps (``rope_parameters`` also reads a ``config.json`` dict, for importing drafts)::

    theta, scaling = rope_parameters(target.config)          # (1e4, None) or (5e5, {"rope_type": "llama3", ...})
    inv_freq, scale = rope_init(head_dim, theta, scaling)   # [hd/2] and cos/sin's factor, as transformers computes
    cos, sin = rope_cos_sin(positions, inv_freq)             # [..., hd] each, times scale; q = apply_rope(q, cos, sin)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, rotate_half

# Llama RMSNorm: statistics in float32, weight applied in the input dtype.
RMSNorm = LlamaRMSNorm

# ----------------------------------------------------------------------------- MLP
DRAFT_ACT = "silu"  # the only MLP activation of the engines' draft layers (EAGLE-3: a Llama layer; DFlash: Qwen3's)


def draft_activation(target_config: Any, drafter: str) -> str:
    """``DRAFT_ACT``, the activation every draft is built with, whatever the target's MLP runs: the draft is
    its own model, and the engines serve its layer with SiLU only. Warns once when the target's differs
    (Gemma's ``gelu_pytorch_tanh``, Nemotron-H's ``relu2``), naming it, as the build is where this is decided."""
    act = next((getattr(target_config, key) for key in ("hidden_act", "hidden_activation", "mlp_hidden_act")
                if isinstance(getattr(target_config, key, None), str)), DRAFT_ACT)
    if act not in (DRAFT_ACT, "swish"):  # transformers' two names for SiLU
        warnings.warn(f"the target's MLP runs {act!r}; the {drafter} draft is built with {DRAFT_ACT!r}, the only "
                      "activation the engines' draft layers run", stacklevel=3)
    return DRAFT_ACT


class MLP(nn.Module):
    """Gated MLP, ``down_proj(act(gate_proj(x)) * up_proj(x))`` without biases (SwiGLU for silu)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACT2FN[hidden_act]

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------- RoPE
def rope_parameters(cfg: Any) -> tuple[float, dict | None]:
    """``(rope_theta, scaling | None)`` of a HF config object or its ``config.json`` dict.

    Reads the transformers 5 layout (``rope_parameters``) or the 4 one (``rope_theta`` +
    ``rope_scaling``); per-layer-type parameters (Gemma 3) give the global layers' ones
    (``full_attention``). ``scaling`` is None for plain RoPE, else the parameters without
    ``rope_theta``, their type under ``rope_type`` (a legacy ``type`` key is renamed).

    Example: ``{"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}``
    -> ``(500000.0, {"rope_type": "linear", "factor": 4.0})``.
    """
    if isinstance(cfg, Mapping):
        get = cfg.get
    else:
        def get(key: str) -> Any:
            return getattr(cfg, key, None)

    params = get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("full_attention"), Mapping):
        params = params["full_attention"]
    if isinstance(params, Mapping) and params:
        theta = float(params.get("rope_theta", get("rope_theta") or 10000.0))
    else:
        theta = float(get("rope_theta") or 10000.0)
        params = get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    return theta, scaling if "rope_type" in scaling else {"rope_type": kind, **scaling}


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    """Plain RoPE's inverse frequencies [head_dim / 2] float32 (a scaled type: ``rope_init``)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_init(
    head_dim: int, theta: float, scaling: Mapping | None = None, max_position_embeddings: int = 2048
) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim / 2] float32 and the factor cos / sin are scaled by, for any
    RoPE type transformers knows: plain RoPE by ``rope_inv_freq`` (factor 1), scaled types (linear,
    llama3, yarn, longrope, ...) by transformers' own initialisers."""
    scaling = dict(scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return rope_inv_freq(head_dim, theta), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling: unknown rope_type {kind!r} (transformers knows {sorted(ROPE_INIT_FUNCTIONS)})")
    hf = Qwen3Config(
        head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_theta": theta, **scaling},
    )
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    return inv_freq.float(), float(factor)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """positions [...] long -> cos, sin [..., 2 * len(inv_freq)] float32 (halves repeated, as
    ``rotate_half`` pairs dimension i with i + hd/2)."""
    freqs = positions[..., None].float() * inv_freq.float()  # [..., hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [..., T, hd]`` by ``cos, sin`` broadcastable to it (e.g. ``[T, hd]``)."""
    return x * cos + rotate_half(x) * sin


__all__ = [
    "DRAFT_ACT",
    "MLP",
    "RMSNorm",
    "apply_rope",
    "draft_activation",
    "rope_cos_sin",
    "rope_init",
    "rope_inv_freq",
    "rope_parameters",
    "rotate_half",
]


def attention(
    q: Tensor,  # [B, nkv, g, Q, hd]
    k: Tensor,  # [B, nkv, S, hd]
    v: Tensor,  # [B, nkv, S, hd]
    visible: Tensor | None = None,  # bool, broadcastable to [B, nkv, g, Q, S]; True = may attend
    k_diag: Tensor | None = None,  # [B, nkv, Q, J, hd]: J extra keys per query (the TTT diagonal), always visible
    v_diag: Tensor | None = None,  # [B, nkv, Q, J, hd]
) -> Tensor:  # [B, nkv, g, Q, hd]
    """Softmax attention over shared keys plus per-query extra keys, softmax in float32.

    Every query must see at least one key (callers guarantee it), else its row is NaN."""
    scale = q.shape[-1] ** -0.5
    s = torch.matmul(q, k.unsqueeze(-3).transpose(-1, -2)) * scale  # [B, nkv, g, Q, S]
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    if k_diag is not None:
        sd = torch.einsum("bkgqd,bkqjd->bkgqj", q, k_diag) * scale  # [B, nkv, g, Q, J]
        s = torch.cat([s, sd], dim=-1)
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    S = k.shape[-2]
    out = torch.matmul(p[..., :S], v.unsqueeze(-3))  # [B, nkv, g, Q, hd]
    if k_diag is not None:
        out = out + torch.einsum("bkgqj,bkqjd->bkgqd", p[..., S:], v_diag)
    return out
