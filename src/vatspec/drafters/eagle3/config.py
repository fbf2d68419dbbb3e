"""The EAGLE-3 drafter's config: its geometry and RoPE from the target, the target layers it reads."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers.activations import ACT2FN

from vatspec.drafters.base import SavedConfig, distinct_layers
from vatspec.drafters.layers import draft_activation, rope_parameters

DEFAULT_TTT_STEPS = 7  # the reference unroll: k = 7 drafted positions per chain in training and per decode round

# RoPE scalings the draft carries from its target: those the engines' Llama layer (vLLM and SGLang ``get_rope``)
# computes for the draft's config.json as transformers does. Not ``dynamic`` (vLLM and SGLang rotate with one base
# for the whole context, transformers rescales it with the sequence length) nor ``longrope`` (a table switched by
# sequence length): with those the draft trains and is served with plain RoPE at the target's theta.
DRAFT_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# the keys of those types transformers' initialisers read (``modeling_rope_utils``); others are not carried
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def default_layer_ids(num_layers: int, *, distinct: bool = False) -> tuple[int, int, int]:
    """Reference low/mid/high layers: outputs of layers ``1, L//2 - 1, L - 4`` (our layer ids), the engines'
    default. ``distinct`` (what training builds): a layer the formula repeats on a target under 7 layers
    moves up to the next one (``distinct_layers``)."""
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"a {num_layers}-layer target is too shallow for the default EAGLE-3 layers {ids}; "
            "set drafter.target_layer_ids"
        )
    return tuple(distinct_layers(list(ids), num_layers, "EAGLE-3")) if distinct else ids


def rope_from_config(cfg) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling | None)`` of the draft for a HF target config (``rope_parameters``).

    Keeps the scaling types of ``DRAFT_ROPE_TYPES`` (linear, llama3, yarn: gpt-oss, DeepSeek-V3, Qwen3 long
    context) and their keys, so the draft rotates as its target in training, in its export and in ``check``;
    others are dropped with a warning, and the draft trains and is exported with plain RoPE (it is its own
    model: it only has to agree with its served config, not with the target's RoPE).
    """
    theta, scaling = rope_parameters(cfg)
    if scaling is None:
        return theta, None
    rope_type = scaling["rope_type"]
    if rope_type not in DRAFT_ROPE_TYPES:
        warnings.warn(
            f"target RoPE scaling {rope_type!r} is not one the engines serve an EAGLE-3 draft with as transformers "
            f"computes it ({', '.join(DRAFT_ROPE_TYPES[1:])}); the draft uses plain RoPE",
            stacklevel=2,
        )
        return theta, None
    return theta, {"rope_type": rope_type, **{key: scaling[key] for key in _ROPE_KEYS if key in scaling}}


@dataclass(frozen=True)
class Eagle3Config(SavedConfig):
    """Everything that shapes an EAGLE-3 draft; saved with every checkpoint (``to_dict``)."""

    hidden_size: int
    target_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd <= V
    target_layer_ids: tuple[int, ...]  # our convention: output of decoder layer i
    ttt_steps: int = DEFAULT_TTT_STEPS  # the reference trainers' name; everything downstream reads ``k``
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"  # ``from_target`` builds SiLU; another loads (an older checkpoint) but is not exported
    rope_scaling: dict | None = field(default=None, hash=False)  # {"rope_type": "linear"|"llama3"|"yarn", ...}

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        problems = []
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even for RoPE")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if self.ttt_steps < 1:
            problems.append(f"ttt_steps={self.ttt_steps} must be >= 1")
        if self.hidden_act not in ACT2FN:
            problems.append(f"hidden_act={self.hidden_act!r} is not a known activation")
        rt = (self.rope_scaling or {}).get("rope_type", "default")
        if rt not in DRAFT_ROPE_TYPES:
            problems.append(f"rope_scaling.rope_type={rt!r} is not one of {DRAFT_ROPE_TYPES}")
        if problems:
            raise ValueError("Eagle3Config: " + "; ".join(problems))

    @classmethod
    def from_target(
        cls,
        target,
        draft_vocab_size: int = 32000,
        ttt_steps: int = DEFAULT_TTT_STEPS,
        target_layer_ids: Sequence[int] | None = None,
    ) -> Eagle3Config:
        """Reference shapes for ``target``: draft width = target width, the target's attention
        geometry, MLP size, norm eps and RoPE (``rope_from_config``); draft vocabulary capped by the
        target's. The MLP runs SiLU whatever the target's does (``draft_activation``): the engines'
        EAGLE-3 layer runs nothing else."""
        cfg = target.config
        ids = (tuple(target_layer_ids) if target_layer_ids is not None
               else default_layer_ids(target.num_layers, distinct=True))
        target.check_layer_ids(ids)
        H = int(target.hidden_size)
        nh = int(cfg.num_attention_heads)
        nkv = int(getattr(cfg, "num_key_value_heads", None) or nh)
        theta, scaling = rope_from_config(cfg)
        return cls(
            hidden_size=H,
            target_hidden_size=H,
            num_heads=nh,
            num_kv_heads=nkv,
            head_dim=int(getattr(cfg, "head_dim", None) or H // nh),
            intermediate_size=int(cfg.intermediate_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-6),
            rope_theta=theta,
            vocab_size=int(target.vocab_size),
            draft_vocab_size=min(int(draft_vocab_size), int(target.vocab_size)),
            target_layer_ids=ids,
            ttt_steps=int(ttt_steps),
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", None) or 2048),
            hidden_act=draft_activation(cfg, "EAGLE-3"),
            rope_scaling=scaling,
        )

    @property
    def k(self) -> int:
        """Drafted positions per chain (training) and per decode round: the TTT steps."""
        return self.ttt_steps
