"""The DFlash drafter's config: its geometry from the target, the target layers it reads, its MASK token."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vatspec.drafters.base import SavedConfig, distinct_layers
from vatspec.drafters.layers import draft_activation, rope_parameters
from vatspec.target import Target

MASK_TOKEN_STRING = "<|MASK|>"  # what the reference trainer adds to a tokenizer without a mask token
MASK_SOURCES = ("override", "tokenizer", "unused_row", "special", "learned")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int, *, distinct: bool = False) -> list[int]:
    """The reference's choice of target layers, one per draft layer (ids = layer outputs).

    ``[L // 2]`` for one draft layer, else ``round(1 + i * (L - 4) / (n - 1))`` for i < n: evenly
    spread from layer 1 to layer L - 3. Python's ``round`` (half to even), as the reference.
    ``distinct`` (what training builds): a layer repeated on a shallow target moves up to the next one.
    """
    L, n = num_target_layers, num_draft_layers
    if n < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {n}")
    if n == 1:
        return [L // 2]
    if L < 4:
        raise ValueError(f"spreading {n} target layers needs a target of >= 4 layers, got {L}")
    ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    return distinct_layers(ids, L, "DFlash") if distinct else ids


def pick_mask_token(
    tokenizer: Any, vocab_size: int, *, exclude: Sequence[int] = ()
) -> tuple[int, str, str | None]:
    """Choose the MASK id among the target's ids: ``(mask_token_id, mask_source, mask_token)``.

    In order: the tokenizer's own mask token ("tokenizer"); the first embedding row no token maps to,
    ``len(tokenizer)`` when the embedding is padded (what the reference gets by adding "<|MASK|>",
    e.g. 151669 for Qwen3; "unused_row"); the highest-id special token that is not bos/eos/pad/unk,
    not in ``exclude`` and not emitted by the chat template on a probe conversation ("special",
    e.g. <empty_output> for SmolLM2); else ``vocab_size`` with a learned extra row ("learned").
    """
    if tokenizer is None:
        return vocab_size, "learned", None
    mid = getattr(tokenizer, "mask_token_id", None)
    if mid is not None and 0 <= mid < vocab_size:
        return int(mid), "tokenizer", getattr(tokenizer, "mask_token", None)
    if len(tokenizer) < vocab_size:
        return len(tokenizer), "unused_row", MASK_TOKEN_STRING
    used = {int(i) for i in exclude}
    used |= {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    used |= _chat_template_ids(tokenizer)
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = {int(i): t.content for i, t in decoder.items() if getattr(t, "special", False)}
    free = sorted(i for i in specials if i not in used and 0 <= i < vocab_size)
    if free:
        return free[-1], "special", specials[free[-1]]
    return vocab_size, "learned", None


def _chat_template_ids(tokenizer: Any) -> set[int]:
    """Ids the chat template itself emits (role markers, turn ends) on a small conversation."""
    if not getattr(tokenizer, "chat_template", None):
        return set()
    probe = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    try:
        out = tokenizer.apply_chat_template(probe, tokenize=True, add_generation_prompt=True)
    except Exception:  # a template that rejects the probe: fall back to the special-token exclusions
        return set()
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return {int(i) for i in ids}


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DFlashConfig(SavedConfig):
    """Everything needed to rebuild the drafter; sizes default to the target's (``from_target``); saved
    with every checkpoint (``to_dict``)."""

    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    target_hidden_size: int
    vocab_size: int  # the target's: the drafter drafts over the full target vocabulary
    hidden_size: int  # must equal the target's (shared embedding and lm_head)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mask_token_id: int  # learned: vocab_size (an extra row) in training, a target id once served
    mask_source: str  # one of MASK_SOURCES
    mask_token: str | None = None
    num_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None  # non-default RoPE parameters of the target (HF rope_parameters)
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    target_model_type: str = "qwen3"  # recorded only: the served DFlash layer is a Qwen3 layer whatever the target

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2 (anchor + 1 draft), got {self.block_size}")
        if self.num_layers < 1:
            raise ValueError(f"DFlashConfig.num_layers must be >= 1, got {self.num_layers}")
        if self.mask_source not in MASK_SOURCES:
            raise ValueError(f"DFlashConfig.mask_source {self.mask_source!r} not in {MASK_SOURCES}")
        # a learned row stands for an extra id past the vocabulary (training) or, once served, for a
        # target id whose input embedding the draft replaces with it (the engines' mask_embedding.pt)
        if self.mask_source == "learned" and not 0 <= self.mask_token_id <= self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} outside [0, {self.vocab_size}] for a "
                             "learned mask row")
        if self.mask_source != "learned" and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id {self.mask_token_id} outside [0, {self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("DFlashConfig.num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_target(
        cls,
        target: Target,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """Config for ``target``: reference layer ids, the target's sizes, a mask token picked by
        ``pick_mask_token`` (or ``mask_token_id``). ``overrides`` replace any other field."""
        tc = target.config
        ids = (list(target_layer_ids) if target_layer_ids
               else default_target_layer_ids(target.num_layers, num_layers, distinct=True))
        target.check_layer_ids(ids)
        V = target.vocab_size
        if mask_token_id is not None:
            if not 0 <= mask_token_id < V:
                raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary [0, {V})")
            tok = target.tokenizer
            mask = (int(mask_token_id), "override", tok.convert_ids_to_tokens(int(mask_token_id)) if tok else None)
        else:
            exclude = target.eos_token_ids if target.tokenizer is not None else []
            mask = pick_mask_token(target.tokenizer, V, exclude=exclude)
        theta, scaling = rope_parameters(tc)
        draft_activation(tc, "DFlash")  # the layers' MLP is SiLU (DFlashDecoderLayer): says so if the target's is not
        heads = tc.num_attention_heads
        kw: dict[str, Any] = dict(
            target_layer_ids=tuple(ids),
            num_target_layers=target.num_layers,
            target_hidden_size=target.hidden_size,
            vocab_size=V,
            hidden_size=target.hidden_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=getattr(tc, "head_dim", None) or target.hidden_size // heads,
            intermediate_size=tc.intermediate_size,
            mask_token_id=mask[0],
            mask_source=mask[1],
            mask_token=mask[2],
            num_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
            target_model_type=str(getattr(tc, "model_type", "qwen3")),
        )
        kw.update(overrides)
        return cls(**kw)

    @property
    def k(self) -> int:
        """Drafted positions per chain (training) and per decode round: the block minus its anchor slot."""
        return self.block_size - 1
