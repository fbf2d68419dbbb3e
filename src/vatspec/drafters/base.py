"""The drafter interface every kind implements (``Drafter``), what it gives the training loop
(``DraftOutput``, ``DrafterPlan``), and the accept head that sits beside it.

One loop trains every drafter because each reduces a batch to the same shape: N verification
chains of k drafted positions (EAGLE-3: one chain per sequence index, k = TTT steps; DFlash: one
chain per anchor, k = block_size - 1 slots; ``drafter.k`` either way). Verification, weights and
losses then act on ``[..., k]`` without knowing which drafter made them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from vatspec.drafters.served import ServedFormat


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


@dataclass
class DrafterPlan:
    """What one micro-batch needs: where the target must produce logits (None = everywhere)
    and the extra keyword arguments of ``training_forward`` (DFlash's anchors)."""

    logits_at: Tensor | None = None  # bool [B, T]
    kwargs: dict = field(default_factory=dict)
    target_logits: bool = True  # False: the chunked path computes them from the target's hidden state


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


class Drafter(nn.Module):
    """The interface every drafter kind implements; ``vatspec.drafters.DRAFTERS`` lists each subclass under its
    ``kind``. Training, the feature cache, checkpoints, exports, ``check`` and decoding hold a ``Drafter`` (or its
    class) and ask it what they need, never which kind it is.

    The kind, asked before there is a drafter (class attributes and class methods):
        kind, title        the name in configs, checkpoints and records ("eagle3"), and the one users read
        config_class       its frozen config (a ``SavedConfig``: every checkpoint's ``drafter.json``)
        schedule           the fixed loss curve of its reference trainer (``LossConfig.resolve``), and
        baseline_loss      that trainer's ``loss.kind``
        reference_optim    that trainer's ``lr``, ``warmup_ratio`` and ``grad_clip``
        formats            its served formats (``vatspec.drafters.served.ServedFormat``), the default first
        fixed_depth        its decoder layers where fixed (EAGLE-3: 1); None: ``drafter.num_layers`` sets them
    The drafter: ``config``, ``k`` (drafted positions per chain and per decode round), ``target_layer_ids``,
    ``hidden_size`` (the accept head's input), ``d2t`` / ``t2d`` (its draft vocabulary; None: the target's),
    ``attach_target``, ``training_forward`` (-> ``DraftOutput``) and ``new_session`` (decoding, batch size 1).
    """

    kind: ClassVar[str]
    title: ClassVar[str]
    config_class: ClassVar[type[SavedConfig]]
    schedule: ClassVar[str]
    baseline_loss: ClassVar[str]
    reference_optim: ClassVar[dict[str, float]]
    formats: ClassVar[tuple[ServedFormat, ...]]
    fixed_depth: ClassVar[int | None] = None

    @classmethod
    def build(cls, cfg, target, token_counts: Tensor | None = None) -> Drafter:
        """A freshly initialised drafter for ``target`` from a ``DrafterConfig`` (``token_counts`` [V]: the
        supervised tokens' counts, for a drafter that picks a draft vocabulary)."""
        raise NotImplementedError

    @classmethod
    def default_layer_ids(cls, num_target_layers: int, num_layers: int = 1) -> list[int]:
        """The target layers (output of layer i) a drafter of ``num_layers`` layers reads unless told: distinct,
        as training builds them. A ``ValueError`` naming ``drafter.target_layer_ids`` for a target too shallow."""
        raise NotImplementedError

    @classmethod
    def curve_block(cls, cfg) -> int | None:
        """The block a ``dflash`` loss curve takes its default gamma from (``LossConfig.resolve``); None: none."""
        return None

    @classmethod
    def config_with_k(cls, config: dict, k: int) -> dict:
        """A saved config (``to_dict``) drafting ``k`` per chain, where k is a setting no weight depends on;
        unchanged where the weights fix it."""
        return config

    @property
    def max_k(self) -> int | None:
        """The most tokens a decode round can draft; None: any number."""
        return None

    def init_mismatch(self, cfg, vocab_size: int) -> str | None:
        """What of a ``DrafterConfig`` this drafter, trained on from ``--init-from``, does not have, as
        "has X, but drafter.F=Y; pass drafter.F=X"; None when it fits."""
        return None

    def plan_batch(self, batch, cfg, generator: torch.Generator | None, *, with_logits: bool = True) -> DrafterPlan:
        """What the target must compute for ``batch`` (by default: logits everywhere) and the keyword arguments of
        ``training_forward``. ``with_logits=False``: the drafter returns its hidden state and lm_head instead of
        logits (the chunked loss path, ``vatspec.objective.chunked``)."""
        return DrafterPlan(kwargs={} if with_logits else {"with_logits": False}, target_logits=with_logits)

    def attach_target(self, target) -> None:
        """Read the target's frozen pieces (embedding, lm_head) by reference: never parameters, never saved."""
        raise NotImplementedError

    def training_forward(self, batch, tout, **kwargs) -> DraftOutput:
        """The batch's chains of k drafted positions, from the target's output ``tout`` (``plan_batch``'s kwargs)."""
        raise NotImplementedError

    def new_session(self, head: AcceptHead | None = None, exit_threshold: float | None = None):
        """A decoding session for one sequence: ``extend(features, tokens)``, ``propose(k, ...) -> Proposal``."""
        raise NotImplementedError


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
        self.proj = nn.Linear(hidden_size, 1)

    def forward(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., ]
        return self.proj(hidden).squeeze(-1)

    def prefix_alive(self, probs: Tensor) -> Tensor:
        """``[k']`` sigmoids of the drafted positions so far -> ``[k']`` what the early exit compares with
        its threshold: the sigmoids themselves ("alive"), or their running product ("alpha").
        alpha: 0.9 0.8 0.5 -> 0.9 0.72 0.36 (threshold 0.5 keeps 2 drafts)."""
        return probs if self.label == "alive" else probs.cumprod(-1)
