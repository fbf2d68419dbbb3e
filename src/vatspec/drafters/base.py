"""What every drafter gives the training loop, and the accept head that sits beside it.

One loop trains both drafters because each reduces a batch to the same shape: N verification
chains of k drafted positions (EAGLE-3: one chain per sequence index, k = TTT steps; DFlash: one
chain per anchor, k = block_size - 1 slots; ``drafter.k`` either way). Verification, weights and
losses then act on ``[..., k]`` without knowing which drafter made them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

# a drafter's linears are plain: the decode loop gives a step's few rows the faster kernel of this CPU
# (``vatspec.eval.kernels.few_row_kernel``), for the draft as for the target
from torch.nn import Linear


@dataclass
class DraftOutput:
    """Chains of k drafted positions; ``...`` are the chain dims ([B, T] or [B, A]).

    logits:        [..., k, Vd] draft logits over the draft vocabulary; None when the drafter was
                   asked for none (``with_logits=False``, the chunked path: ``lm_head`` instead).
    hidden:        [..., k, H]  the drafter's last hidden state at each position (what the lm_head and
                   the accept head read).
    target_logits: [..., k, V]  target logits predicting the same tokens (may be a strided view); with
                   ``target_index``: the target's rows [P, V], position (..., j) reading row
                   ``target_index[..., j]``; with ``target_head`` too: rows [P, H_t] of the target's
                   final hidden state, which ``target_head`` turns into logits [P, V].
    valid:         [..., k] bool, True where the position exists and is supervised; a prefix mask along k.
    lm_head:       [Vd, H] weight with ``logits = (hidden @ lm_head^T) * logit_scale`` (float32, then
                   soft-capped by ``softcap`` if set); given when ``logits`` is None.
    target_index:  [..., k] long, see ``target_logits``; None when that is per position already.
    target_head:   ``Target.logits`` (hidden [n, H_t] -> logits [n, V] float32) when the target was run
                   without logits; see ``target_logits``. ``vocab_size`` is then the head's V.
    """

    logits: Tensor | None
    hidden: Tensor
    target_logits: Tensor
    valid: Tensor
    lm_head: Tensor | None = None
    softcap: float | None = None
    logit_scale: float = 1.0
    target_index: Tensor | None = None
    target_head: Callable[[Tensor], Tensor] | None = None
    target_vocab_size: int | None = None

    @property
    def vocab_size(self) -> int:
        """V, the target vocabulary."""
        return self.target_vocab_size if self.target_head is not None else self.target_logits.shape[-1]

    def __post_init__(self):
        k = self.valid.shape[-1]
        lead = self.valid.shape
        if self.logits is None:
            assert self.lm_head is not None and self.lm_head.shape[-1] == self.hidden.shape[-1], (
                "a DraftOutput without logits needs lm_head [Vd, H]"
            )
        else:
            assert self.logits.shape[:-1] == lead, f"logits {tuple(self.logits.shape)} vs valid {tuple(lead)}"
        assert self.hidden.shape[:-1] == lead, f"hidden {tuple(self.hidden.shape)} vs valid {tuple(lead)}"
        if self.target_index is None:
            assert self.target_logits.shape[:-1] == lead, (
                f"target_logits {tuple(self.target_logits.shape)} vs valid {tuple(lead)}"
            )
        else:
            assert self.target_index.shape == lead and self.target_logits.dim() == 2, (
                f"target_index {tuple(self.target_index.shape)} must be {tuple(lead)} over target rows [P, V], "
                f"got {tuple(self.target_logits.shape)}"
            )
        assert k >= 1 and self.valid.dtype == torch.bool
        assert self.target_head is None or self.target_vocab_size, "target_head needs target_vocab_size"


def batch_field(batch: Any, name: str, required: bool = True) -> Tensor | None:
    """``batch[name]`` of a mapping, else ``batch.name`` (a ``Batch``); a missing required field fails."""
    value = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
    if value is None and required:
        raise ValueError(f"batch has no {name!r}")
    return value


_C = TypeVar("_C", bound="SavedConfig")


def distinct_layers(ids: list[int], num_layers: int, what: str) -> list[int]:
    """``ids`` (increasing, maybe repeating) made distinct: each repeat moves up to the next layer. A reference
    formula repeats a layer only on targets shallower than any real one (EAGLE-3's ``1, L//2 - 1, L - 4`` on 6
    layers gives ``1, 2, 2``); a repeated layer is a wasted input the engines refuse to capture twice."""
    out: list[int] = []
    for i in ids:
        out.append(max(int(i), out[-1] + 1) if out else int(i))
    if out[-1] >= num_layers:
        raise ValueError(f"a {num_layers}-layer target has too few layers for {len(ids)} distinct {what} target "
                         "layers; set drafter.target_layer_ids")
    return out


class SavedConfig:
    """``to_dict`` / ``from_dict`` of a drafter's frozen config dataclass, the form every checkpoint
    saves (``drafter.json``); both drafters' configs inherit them."""

    def to_dict(self) -> dict:
        """JSON-ready dict (``target_layer_ids`` as a list)."""
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d

    @classmethod
    def from_dict(cls: type[_C], d: Mapping[str, Any]) -> _C:
        """Inverse of ``to_dict``; unknown keys fail loudly."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**dict(d))


HEAD_RULES = {  # the head's label -> what its sigmoid is, and how decoding reads it
    "alive": "P(every earlier draft of the round accepted): the early exit thresholds it as is",
    "alpha": "P(this draft accepted | the earlier ones were): the early exit thresholds its running product",
}


class AcceptHead(nn.Module):
    """One dense layer on the draft's last hidden state -> a logit per drafted position. Training-only
    by default; never part of a served draft.

    ``label`` says what it was trained on (``HEAD_RULES``): "alive", VAT's verification head, predicts
    that the prefix before this position survived; "alpha", DSpark's confidence head, predicts this
    position's acceptance, so the prefix through position j survives with ``prod_{i<=j} sigmoid``."""

    def __init__(self, hidden_size: int, label: str = "alive"):
        super().__init__()
        if label not in HEAD_RULES:
            raise ValueError(f"AcceptHead label must be one of {tuple(HEAD_RULES)}, got {label!r}")
        self.label = label
        self.proj = Linear(hidden_size, 1)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., ]
        return self.proj(hidden).squeeze(-1)

    def prefix_alive(self, probs: Tensor) -> Tensor:
        """``[k']`` sigmoids of the drafted positions so far -> ``[k']`` what the early exit compares with
        its threshold: the sigmoids themselves ("alive"), or their running product ("alpha").
        alpha: 0.9 0.8 0.5 -> 0.9 0.72 0.36 (threshold 0.5 keeps 2 drafts)."""
        return probs if self.label == "alive" else probs.cumprod(-1)
