"""Draft-training losses: position weights, per-position token terms, the accept-head BCE.

Pure torch; the loss holds no state. Every drafter reduces a batch to chains ``[..., k]`` (see
``drafters/base.py``), so each function here acts on ``[..., k]`` and knows nothing of the drafter.
Weights and labels are computed under no_grad and returned detached.

Position weights (0-based j; the paper writes them 1-based):

- fixed, "eagle3" curve: ``w_j = decay**j``       pos = 0 1 2 3 -> w = 1 0.8 0.64 0.512
- fixed, "dflash" curve: ``w_j = exp(-j/gamma)``  pos = 0 1 2 3 -> w = 1 e^-1/g e^-2/g e^-3/g
- adaptive (VAT): 1 up to and including the first rejection r, then the same curve restarted at r:
  ``w_j = 1 if j <= r else base(j - r)``.     r = 1:  pos = 0 1 2 3 -> w = 1 1 0.8 0.64
  In expected mode r is random; the weight is its exact expectation (see ``vat_weights``).
- dpace (D-PACE): ``w_j = sum_{m>=j} prod_{i<=m} s_i``, ``s_i = (1 - a) exp(-CE_i) + a`` (``dpace_weights``).
- truncated (Spec-AUF): the fixed curve up to and including the draft's own first failure f, then 0:
  f = 1:  pos = 0 1 2 3 -> w = 1 0.8 0 0   (``truncated_weights``).

Per-position token terms, with p the target softmax over the draft vocabulary (renormalised,
``soft_targets``) and q the draft's softmax:

- soft CE ``-sum p log q``; hard CE ``-log q(argmax p)``;
- kl: ``KL(p || q) = soft CE - H(p)`` (the same gradient as soft CE; ``kl_divergence``);
- tv: ``TV(p, q) = 1 - alpha``, ``alpha = sum_x min(p, q)`` the expected acceptance (``acceptance``);
- lk: ``lk_kl * KL + (1 - lk_kl) * -log alpha`` (the LK losses' hybrid; ``lk_loss``).

Heads: VAT's head is trained by BCE on the alive bit (every earlier position accepted); DSpark's
confidence head (``head_label="alpha"``) by BCE toward alpha, its sigmoids multiplied along the chain
at inference (``head_bce``, ``AcceptHead.prefix_alive``).

The full VAT objective (paper): ``sum_j w_j (CE_soft + CE_hard) + beta * BCE(head, alive)``, beta = 1.
Every kind is one ``LossConfig`` preset of these switches (``_PRESETS``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from vatspec.drafters.base import DraftOutput
from vatspec.drafters.vocab import target_ids
from vatspec.objective.terms import (
    SCHEDULES,
    acceptance,
    dpace_weights,
    entropy,
    first_failure,
    fixed_weights,
    head_bce,
    kl_divergence,
    lk_loss,
    truncated_weights,
    tv_loss,
    vat_weights,
)
from vatspec.objective.verify import MODES, Verification, target_to_draft

KINDS = ("eagle3", "dflash", "vat", "kl", "tv", "lk", "dpace", "specauf", "dspark")
WEIGHTS = ("fixed", "adaptive", "dpace", "truncated")
HEAD_LABELS = ("alive", "alpha")  # VAT: the alive bit; DSpark: alpha = 1 - TV(p, q)

# Positions per chunk of the chunked lm_head + CE path (loss.chunk_size; 0 = all at once): the lowest peak
# memory among the sizes whose step is not slower than the unchunked one (perf/bench_vocab_memory.py;
# docs/design.md, "Memory at large vocabularies").
DEFAULT_CHUNK_SIZE = 256

# The DFlash reference's gammas per block size. Other block sizes use
# round(block / 2.3), which reproduces 16 -> 7 and stays close to the rest (10 -> 4, 8 -> 3).
DFLASH_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}

# What each kind switches on. A curve of None is the drafter's schedule's, and STANDARD soft / hard
# the drafter's own CE (EAGLE-3: soft, DFlash: hard), both filled by resolve().
STANDARD = "standard"
_OFF = {"kl": False, "tv": False, "lk": False, "head_label": "alive"}
_PRESETS: dict[str, dict[str, object]] = {
    "eagle3": {**_OFF, "weights": "fixed", "soft": True, "hard": False, "head": False, "curve": "eagle3"},
    "dflash": {**_OFF, "weights": "fixed", "soft": False, "hard": True, "head": False, "curve": "dflash"},
    "vat": {**_OFF, "weights": "adaptive", "soft": True, "hard": True, "head": True, "curve": None},
    "kl": {**_OFF, "weights": "fixed", "soft": False, "hard": False, "head": False, "curve": "eagle3", "kl": True},
    "tv": {**_OFF, "weights": "fixed", "soft": False, "hard": False, "head": False, "curve": None, "tv": True},
    "lk": {**_OFF, "weights": "fixed", "soft": False, "hard": False, "head": False, "curve": None, "lk": True},
    "dpace": {**_OFF, "weights": "dpace", "soft": STANDARD, "hard": STANDARD, "head": False, "curve": None},
    "specauf": {**_OFF, "weights": "truncated", "soft": STANDARD, "hard": STANDARD, "head": False, "curve": None},
    "dspark": {**_OFF, "weights": "fixed", "soft": STANDARD, "hard": STANDARD, "head": True, "curve": None,
               "head_label": "alpha"},
}
# the baseline kind of each drafter schedule: what the other kinds are compared with
BASELINE = {"eagle3": "eagle3", "dflash": "dflash"}

# The paper's ablations, each one part of VAT switched on over a baseline kind:
# LossConfig(kind="dflash", **ABLATIONS["head"]) is "DFlash + head only".
ABLATIONS: dict[str, dict[str, object]] = {
    "head": {"head": True},
    "adaptive": {"weights": "adaptive"},
    "labels": {"soft": True, "hard": True},
}


def dflash_gamma(block_size: int) -> float:
    """The DFlash reference decay constant for a block size: 16 -> 7, 10 -> 5, 8 -> 4, else
    ``max(1, round(block_size / 2.3))``."""
    if block_size in DFLASH_GAMMA:
        return DFLASH_GAMMA[block_size]
    return float(max(1, round(block_size / 2.3)))


@dataclass(frozen=True)
class LossConfig:
    """Which terms make up the draft loss. ``None`` fields are filled from ``kind``'s preset by
    ``resolve``; set one to override it (that is how the ablations are written, and how kinds
    compose: ``kind="lk", weights="adaptive"`` is LK with VAT's weights).

    kind:        "eagle3" (soft CE, fixed 0.8**j), "dflash" (hard CE, fixed exp(-j/gamma)), "vat"
                 (adaptive weights + soft + hard + head), "kl" (forward KL, fixed 0.8**j), "tv" (1 - alpha,
                 the drafter's curve), "lk" (the LK hybrid, the drafter's curve), "dpace" (the drafter's
                 CE with D-PACE weights), "specauf" (the drafter's CE up to its first failure only),
                 "dspark" (the drafter's CE + a confidence head trained toward alpha).
    weights:     "fixed" | "adaptive" | "dpace" | "truncated" position weights.
    soft, hard:  soft CE to the target distribution over the draft vocab / hard CE to its argmax.
    kl, tv, lk:  the per-position KL(p || q), TV(p, q) = 1 - alpha, and LK hybrid terms.
    lk_kl:       the LK hybrid's KL share: ``lk_kl * KL + (1 - lk_kl) * -log alpha``; 0 = -log alpha
                 alone. Default 0.5: an even blend (the LK paper adapts it over training; not tuned here).
    head:        accept-head BCE, scaled by ``beta``.
    head_grad:   the head's BCE reaches the draft through its hidden states (True, the paper) or
                 trains the head alone on detached hidden states (False).
    head_label:  what the head learns: "alive" (VAT: every earlier position accepted) or "alpha"
                 (DSpark: the position's expected acceptance, multiplied along the chain at inference).
    verify:      verification rule simulated for the labels ("greedy" | "sampled" | "expected").
    temperature: verification temperature (sampled / expected); the CE targets always use T = 1.
    decay:       base of the "eagle3" curve, ``decay**j``.
    gamma:       "dflash" curve ``exp(-j/gamma)``; None = the DFlash reference for the block size
                 (``dflash_gamma``: 7 for block 16, 5 for 10, 4 for 8).
    curve:       "eagle3" | "dflash" shape of the fixed curve and of VAT's restarted curve; None =
                 the kind's own, and for "vat", "tv", "lk", "dpace", "specauf", "dspark" the drafter's.
    chunk_size:  0 = the logits [N, Vd] and target logits [N, V] of all N = chains x k positions at
                 once; C > 0 = the lm_head, CE and verification statistics C positions at a time
                 (``vatspec.objective.chunked``): same values and gradients, peak memory of C rows instead of
                 N.
    """

    kind: str = "vat"
    weights: str | None = None
    soft: bool | None = None
    hard: bool | None = None
    kl: bool | None = None
    tv: bool | None = None
    lk: bool | None = None
    lk_kl: float = 0.5
    head: bool | None = None
    head_label: str | None = None
    beta: float = 1.0
    head_grad: bool = True
    verify: str = "greedy"
    temperature: float = 1.0
    decay: float = 0.8
    gamma: float | None = None
    curve: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        def bad(field: str, want: str) -> ValueError:
            return ValueError(f"LossConfig.{field} must be {want}, got {getattr(self, field)!r}")

        if self.kind not in KINDS:
            raise bad("kind", f"one of {KINDS}")
        if self.weights is not None and self.weights not in WEIGHTS:
            raise bad("weights", f"one of {WEIGHTS} or None")
        for name in ("soft", "hard", "kl", "tv", "lk", "head"):
            if getattr(self, name) not in (None, True, False):
                raise bad(name, "a bool or None")
        if self.head_grad not in (True, False):
            raise bad("head_grad", "a bool")
        if not (isinstance(self.lk_kl, (int, float)) and 0 <= self.lk_kl <= 1):
            raise bad("lk_kl", "in [0, 1]")
        if self.head_label is not None and self.head_label not in HEAD_LABELS:
            raise bad("head_label", f"one of {HEAD_LABELS} or None")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta >= 0):
            raise bad("beta", "a finite number >= 0")
        if self.verify not in MODES:
            raise bad("verify", f"one of {MODES}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise bad("temperature", "> 0")
        if not (isinstance(self.decay, (int, float)) and 0 < self.decay <= 1):
            raise bad("decay", "in (0, 1]")
        if self.gamma is not None and not (isinstance(self.gamma, (int, float)) and self.gamma > 0):
            raise bad("gamma", "> 0 or None")
        if self.curve is not None and self.curve not in SCHEDULES:
            raise bad("curve", f"one of {SCHEDULES} or None")
        if not (isinstance(self.chunk_size, int) and not isinstance(self.chunk_size, bool) and self.chunk_size >= 0):
            raise bad("chunk_size", "an int >= 0 (0 = unchunked)")

    @property
    def resolved(self) -> bool:
        """True when no field is left for ``resolve`` to fill."""
        need = (self.weights, self.soft, self.hard, self.kl, self.tv, self.lk, self.head, self.head_label, self.curve)
        return all(x is not None for x in need) and (self.curve != "dflash" or self.gamma is not None)

    @property
    def uses_alpha(self) -> bool:
        """The loss reads alpha = sum min(p, q) per position (tv, lk, DSpark's head)."""
        return bool(self.tv or self.lk or (self.head and self.head_label == "alpha"))

    @property
    def uses_entropy(self) -> bool:
        """The loss reads H(p) per position (KL = soft CE - H(p): kl, and lk with a KL share)."""
        return bool(self.kl or (self.lk and self.lk_kl > 0))

    @property
    def uses_soft_labels(self) -> bool:
        """The loss reads p, the target softmax over the draft vocabulary."""
        return bool(self.soft or self.uses_alpha or self.uses_entropy)

    def resolve(self, schedule: str, *, block_size: int | None = None) -> LossConfig:
        """Fill every None from the kind's preset and the drafter's ``schedule`` ("eagle3" | "dflash"),
        and refuse a combination that cannot train (ValueError, one line).

        block_size: the drafter's block (DFlash: k + 1) for the default gamma; needed only when the
        curve is "dflash" and gamma is None. Idempotent.
        """
        preset = {**_PRESETS[self.kind], "curve": self.curve_for(schedule)}
        for name in ("soft", "hard"):  # the drafter's own CE
            if preset[name] == STANDARD:
                preset[name] = _PRESETS[BASELINE[schedule]][name]
        fill = {name: v for name, v in preset.items() if getattr(self, name) is None}
        cfg = dataclasses.replace(self, **fill)
        if cfg.curve == "dflash" and cfg.gamma is None:
            if block_size is None:
                raise ValueError("LossConfig.gamma is None and no block_size was given to pick the default")
            cfg = dataclasses.replace(cfg, gamma=dflash_gamma(block_size))
        if not (cfg.soft or cfg.hard or cfg.kl or cfg.tv or cfg.lk or cfg.head):
            raise ValueError("LossConfig: soft, hard, kl, tv, lk and head are all False; there is nothing to train")
        if cfg.weights == "dpace" and not (cfg.soft or cfg.hard):
            raise ValueError("loss.weights=dpace weighs positions by exp(-CE): it needs loss.soft or loss.hard on")
        if cfg.head_label == "alpha" and not cfg.head:
            raise ValueError("loss.head_label=alpha is the label of a head: it needs loss.head=true")
        return cfg

    def curve_for(self, schedule: str) -> str:
        """The curve ``resolve`` picks for a drafter of ``schedule``: ``curve`` if set, else the kind's
        own ("eagle3" | "dflash"), else (``vat`` and the kinds built on the drafter's loss) the drafter's schedule."""
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        return self.curve or _PRESETS[self.kind]["curve"] or schedule

    @classmethod
    def ablation(cls, base: str, part: str, **overrides: object) -> LossConfig:
        """One VAT part on a baseline kind: ``part`` in ``ABLATIONS`` ("head", "adaptive", "labels")."""
        if part not in ABLATIONS:
            raise ValueError(f"ablation part must be one of {tuple(ABLATIONS)}, got {part!r}")
        return cls(kind=base, **{**ABLATIONS[part], **overrides})


# ----------------------------------------------------------------------------------------------
# Objective
#
# Reduction. For each position j: average w * ce over the chains supervised at j (valid and with the
# target argmax in the draft vocab), then sum over j. The head BCE is averaged over all valid
# positions. How the references normalise, and why this choice:
# - EAGLE-3 (SafeAILab, SpecForge `_compute_loss`): per TTT step `-(mask * p * logq).sum(-1).mean()`
#   over every B*T slot, masked ones included, then `sum_i 0.8**i * loss_i`. Same per-step-mean,
#   weighted-sum-over-steps structure as ours, but its denominator counts masked slots, so padding
#   and out-of-vocab targets silently scale each step down. Ours divides by the supervised count and
#   equals it when every slot is supervised.
# - DFlash (z-lab reference, SpecForge OnlineDFlashModel): `sum(w * ce) / sum(w)` over all tokens, a
#   weighted mean that is invariant to the scale of w. Under that normalisation VAT's raised weights
#   would partly cancel (raising late weights lowers the early ones' share), so the paper's "weight 1
#   up to r, curve after" would not mean what it says. Ours keeps w absolute: VAT only adds weight.
#   Consequence: our DFlash baseline loss is sum_j w_j (about 6 for block 16) times the reference's
#   at equal per-token CE; with Adam that changes nothing but the interplay with grad clipping and
#   with the head's beta.
# Worked example: k = 2, chains n = 0, 1; ce = [[1, 2], [3, 4]], w = [[1, 1], [1, 0.8]],
#   chain 1 position 1 unsupervised -> j=0: (1*1 + 1*3)/2 = 2; j=1: (1*2)/1 = 2; loss = 4.


def _reduce(per_pos: Tensor, mask: Tensor) -> Tensor:
    """Sum over j of the mean over supervised chains at j: [..., k] -> scalar."""
    k = mask.shape[-1]
    per_pos = torch.where(mask, per_pos, torch.zeros_like(per_pos)).reshape(-1, k)  # [N, k]
    count = mask.reshape(-1, k).sum(0).clamp(min=1)  # [k]
    return (per_pos.sum(0) / count).sum()


def soft_targets(target_logits: Tensor, d2t: Tensor | None) -> Tensor:
    """[..., k, V] -> [..., k, Vd] EAGLE-3 soft labels (detached): the target softmax restricted to the
    draft vocab's target ids and renormalised over them. Gathers only those Vd columns."""
    with torch.no_grad():
        cols = target_logits
        if d2t is not None:
            cols = target_logits.index_select(-1, target_ids(d2t))  # [..., k, Vd]
        return torch.softmax(cols.float(), dim=-1)


class _TokenCE(torch.autograd.Function):
    """Soft and hard CE of draft logits ``x [N, V]`` sharing one log-softmax ``logq``.

    Forward: ``soft = -sum_v p_v logq_v`` (a batched dot, no [N, V] product), ``hard = -logq[label]``.
    Backward in two [N, V] passes: with upstream grads gs, gh the grad w.r.t. logq is
    ``G = -(gs p + gh onehot)``, and log-softmax's own fused backward gives
    ``dx = G - softmax(x) sum(G) = (gs + gh) softmax(x) - gs p - gh onehot``.
    Autograd on the plain expression would also write the product p * logq, a zero-filled scatter
    for the gather and their sum: three more [N, V] passes, which is most of VAT's extra step time.
    """

    @staticmethod
    def forward(ctx, x: Tensor, p: Tensor | None, labels: Tensor | None):
        logq = torch.log_softmax(x, dim=-1)
        soft = -torch.einsum("nv,nv->n", p, logq) if p is not None else None
        hard = -logq.gather(-1, labels[:, None]).squeeze(-1) if labels is not None else None
        ctx.save_for_backward(logq, p, labels)
        return soft, hard

    @staticmethod
    def backward(ctx, g_soft: Tensor | None, g_hard: Tensor | None):
        logq, p, labels = ctx.saved_tensors
        g = p * (-g_soft)[:, None] if p is not None and g_soft is not None else torch.zeros_like(logq)
        if labels is not None and g_hard is not None:
            g.scatter_add_(-1, labels[:, None], -g_hard[:, None])
        return torch._log_softmax_backward_data(g, logq, -1, logq.dtype), None, None


def token_ce(logits: Tensor, p: Tensor | None, labels: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    """Per-position soft CE to ``p`` and hard CE to ``labels`` of ``logits [..., V]`` (in fp32 or wider).

    Returns ``(soft [...] or None, hard [...] or None)``; None where that input is None. Equal to
    ``-(p * log_softmax(logits)).sum(-1)`` and ``-log_softmax(logits).gather(labels)``, gradients
    included, but fused (``_TokenCE``).
    """
    shape = logits.shape[:-1]
    V = logits.shape[-1]
    dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (bf16 logits are upcast)
    x = logits.to(dtype).reshape(-1, V)
    pf = p.to(dtype).reshape(-1, V) if p is not None else None
    lf = labels.reshape(-1) if labels is not None else None
    soft, hard = _TokenCE.apply(x, pf, lf)
    return (soft.view(shape) if soft is not None else None, hard.view(shape) if hard is not None else None)


def hard_targets(v: Verification, d2t: Tensor | None, t2d: Tensor | None, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Hard labels in draft ids and the in-vocab mask, from the target argmax (detached).

    Returns (labels [..., k] long, 0 where out of vocab; in_vocab [..., k] bool). Example: d2t maps
    draft 0 1 2 -> target 0 2 5; target argmax 2 3 5 -> labels 1 0 2, in_vocab 1 0 1.
    """
    return hard_labels(v.target_argmax, d2t, t2d, vocab_size)


def hard_labels(
    target_argmax: Tensor, d2t: Tensor | None, t2d: Tensor | None, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """``hard_targets`` from the target argmax ``[..., k]`` (target ids) itself."""
    with torch.no_grad():
        index = target_to_draft(d2t, vocab_size)  # [V] or None (identity)
        if index is None:
            labels = target_argmax
            in_vocab = torch.ones_like(labels, dtype=torch.bool)
        else:
            labels = index[target_argmax]  # [..., k], -1 outside
            in_vocab = labels >= 0 if t2d is None else t2d[target_argmax]
            labels = labels.clamp(min=0)
        return labels, in_vocab


class PositionTerms(NamedTuple):
    """The per-position quantities the objective reduces, each ``[..., k]`` or None when not needed:
    soft / hard CE (with grad), alpha = sum min(p, q) (with grad), H(p) (no grad)."""

    soft: Tensor | None
    hard: Tensor | None
    alpha: Tensor | None = None
    entropy: Tensor | None = None


def position_terms(out: DraftOutput, cfg: LossConfig, labels: Tensor, d2t: Tensor | None) -> PositionTerms:
    """``PositionTerms`` of ``out`` from its full logits (``loss.chunk_size = 0``; the chunked path
    computes the same ones chunk by chunk, ``chunked.chunked_pass``). labels: [..., k] draft ids."""
    p = soft_targets(out.target_logits, d2t) if cfg.uses_soft_labels else None  # [..., k, Vd]
    soft = hard = None
    if p is not None or cfg.hard:
        soft, hard = token_ce(out.logits, p, labels if cfg.hard else None)  # [..., k] each
    alpha = acceptance(p, out.logits) if cfg.uses_alpha else None
    h = entropy(p) if cfg.uses_entropy else None
    return PositionTerms(soft, hard, alpha, h)


def position_weights(cfg: LossConfig, v: Verification, terms: PositionTerms, sup: Tensor,
                     first_fail: Tensor | None) -> Tensor:
    """[..., k] the weights ``cfg.weights`` names (detached); 0 at invalid positions except for the fixed curve
    (``_reduce`` masks those). first_fail: [...] the draft's first failure, for "truncated"."""
    k, valid = sup.shape[-1], v.valid
    g = cfg.gamma or 1.0
    if cfg.weights == "fixed":
        return fixed_weights(k, cfg.curve, decay=cfg.decay, gamma=g, device=sup.device).expand(sup.shape)
    if cfg.weights == "adaptive":
        return vat_weights(v, cfg.curve, decay=cfg.decay, gamma=g)
    if cfg.weights == "truncated":
        return truncated_weights(first_fail, valid, cfg.curve, decay=cfg.decay, gamma=g)
    ce = terms.hard if cfg.hard else terms.soft  # dpace: the drafter's own CE (hard when both are on)
    return dpace_weights(torch.where(sup, ce.detach(), torch.full_like(ce, math.inf)), valid)


def token_terms(cfg: LossConfig, t: PositionTerms) -> dict[str, Tensor]:
    """name -> [..., k] per-position loss, for each token term ``cfg`` switches on."""
    kl = kl_divergence(t.soft, t.entropy) if cfg.uses_entropy else None
    terms = {"soft": t.soft if cfg.soft else None, "hard": t.hard if cfg.hard else None,
             "kl": kl if cfg.kl else None, "tv": tv_loss(t.alpha) if cfg.tv else None,
             "lk": lk_loss(t.alpha, kl, cfg.lk_kl) if cfg.lk else None}
    return {name: x for name, x in terms.items() if x is not None}


def vat_objective(
    out: DraftOutput,
    v: Verification,
    head_logits: Tensor | None,
    cfg: LossConfig,
    *,
    d2t: Tensor | None = None,
    t2d: Tensor | None = None,
    terms: PositionTerms | None = None,
    draft_argmax: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The draft loss for one batch of chains, for every ``loss.kind``.

    out:          DraftOutput (logits [..., k, Vd], target_logits [..., k, V], valid [..., k]).
    v:            the Verification of ``out`` (labels for the head, first rejection for the weights).
    head_logits:  [..., k] accept-head logits, required when the config has the head on.
    cfg:          a resolved LossConfig (``cfg.resolved``): resolved once for the drafter when the run
                  config loads (``config.resolve_loss``), or by hand with ``LossConfig.resolve``.
    d2t, t2d:     [Vd] long offsets and [V] bool draft-vocab mask; None = identity vocab.
    terms:        the per-position terms already computed (with grad) by the chunked path
                  (``chunked.chunked_pass``; ``out.logits`` is None there); None = computed here from
                  ``out.logits`` and ``out.target_logits``.
    draft_argmax: [..., k] draft ids, the argmax of the logits; needed with ``terms`` for the
                  "truncated" weights (else read from ``out.logits``).

    Returns (loss: scalar with grad, parts: detached scalars). parts has "loss", one entry per
    active term ("soft", "hard", "kl", "tv", "lk": the weighted reduced term as added; "head": the
    mean BCE before beta) and "weight_mean" (mean weight over supervised positions).
    """
    assert cfg.resolved, (
        f"vat_objective needs a resolved LossConfig, got {cfg}: resolve it once for the drafter, "
        "with config.load_config / config.resolve_loss or LossConfig.resolve(drafter.schedule, block_size=...)"
    )
    if v.valid.shape != out.valid.shape:
        raise ValueError(f"Verification valid {tuple(v.valid.shape)} vs DraftOutput valid {tuple(out.valid.shape)}")
    valid = out.valid  # [..., k]

    # 1. labels (no grad)
    labels, in_vocab = hard_targets(v, d2t, t2d, out.vocab_size)  # [..., k]
    sup = valid & in_vocab  # supervised by the token terms; out-of-vocab positions stay rejections in v

    # 2. per-position terms: CE (one fused soft + hard pass), alpha, H(p)
    t = terms if terms is not None else position_terms(out, cfg, labels, d2t)

    # 3. weights (no grad)
    first_fail = None
    if cfg.weights == "truncated":
        first_fail = first_failure(out.logits.argmax(-1) if draft_argmax is None else draft_argmax,
                                   v.target_argmax, d2t)
    w = position_weights(cfg, v, t, sup, first_fail)

    # 4. token terms, weighted and reduced
    parts: dict[str, Tensor] = {}
    loss = out.hidden.new_zeros((), dtype=torch.float32)
    for name, per_pos in token_terms(cfg, t).items():
        parts[name] = _reduce(w * per_pos, sup)
        loss = loss + parts[name]

    # 5. head over every valid position (out-of-vocab ones included): VAT's on the alive bit, DSpark's
    # toward alpha (0 where the target's token is outside the draft vocabulary: never accepted)
    if cfg.head:
        if head_logits is None:
            raise ValueError("LossConfig.head is on but vat_objective got head_logits=None")
        if head_logits.shape != valid.shape:
            raise ValueError(f"head_logits {tuple(head_logits.shape)} must be {tuple(valid.shape)}")
        label = v.alive if cfg.head_label == "alive" else t.alpha.detach() * in_vocab
        parts["head"] = head_bce(head_logits, label, valid)
        loss = loss + cfg.beta * parts["head"]

    parts = {name: x.detach() for name, x in parts.items()}
    parts["loss"] = loss.detach()
    parts["weight_mean"] = (w * sup).sum() / sup.sum().clamp(min=1)
    return loss, parts
