"""The per-position terms every objective combines (``losses.vat_objective``): position weights (fixed,
VAT's verification-adaptive, D-PACE, Spec-AUF's truncated), the acceptance-based divergences (TV, LK, KL)
and the heads' BCE. Pure torch, ``[..., k]`` chains in, no drafter knowledge; the formulas with worked
examples are in ``losses``' docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vatspec.objective.verify import Verification, draft_to_target

SCHEDULES = ("eagle3", "dflash")
# D-PACE's floor a in s_i = (1 - a) exp(-CE_i) + a (the D-PACE paper's value)
DPACE_A = 0.5
# -log alpha is taken of max(alpha, ALPHA_FLOOR): a draft with no overlap with p (alpha = 0 in
# float32) would give an infinite loss; 1e-6 is far below 1/Vd for any draft vocabulary used here
ALPHA_FLOOR = 1e-6


# ----------------------------------------------------------------------------------------------
# Weights


def _base_curve(offset: Tensor, schedule: str, decay: float, gamma: float) -> Tensor:
    """The fixed curve at 0-based offsets (float tensor of any shape)."""
    if schedule == "eagle3":
        return decay**offset
    if schedule == "dflash":
        return torch.exp(-offset / gamma)
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def fixed_weights(
    k: int, schedule: str, *, decay: float = 0.8, gamma: float = 7.0, device: torch.device | None = None
) -> Tensor:
    """[k] fixed position weights, 0-based.

    "eagle3": ``decay**j``        k = 4 -> 1 0.8 0.64 0.512
    "dflash": ``exp(-j/gamma)``   k = 3, gamma = 7 -> 1 0.867 0.751
    """
    j = torch.arange(k, dtype=torch.float32, device=device)
    return _base_curve(j, schedule, decay, gamma)


def vat_weights(v: Verification, schedule: str, *, decay: float = 0.8, gamma: float = 7.0) -> Tensor:
    """[..., k] VAT verification-adaptive weights (detached); 0 at invalid positions.

    Hard modes, first rejection r: ``w_j = 1`` for ``j <= r``, ``base(j - r)`` for ``j > r``::

        eagle3, r = 1:  pos = 0 1 2 3 -> w = 1 1 0.8 0.64
        eagle3, r = 0:  pos = 0 1 2 3 -> w = 1 0.8 0.64 0.512   (same as the fixed curve)
        no rejection:   pos = 0 1 2 3 -> w = 1 1 1 1

    Expected mode: r is random with ``P(j <= r) = alive_j`` and ``P(r = i) = alive_i (1 - alpha_i)``,
    so ``E[w_j] = alive_j + sum_{i<j} alive_i (1 - alpha_i) base(j - i)``. Example, eagle3, k = 2,
    alpha = (0.5, .): alive = (1, 0.5) -> E[w] = (1, 0.5 + 0.5 * 0.8) = (1, 0.9).

    Either way ``w_j >= base(j)``: each possible r gives a weight no smaller than the fixed curve's.
    """
    with torch.no_grad():
        k = v.valid.shape[-1]
        device = v.valid.device
        j = torch.arange(k, device=device)
        valid_f = v.valid.float()
        if v.first_reject is not None:
            r = v.first_reject.unsqueeze(-1)  # [..., 1]
            after = (j - r).clamp(min=0).float()  # [..., k] offset from r, 0 up to r
            w = torch.where(j <= r, torch.ones_like(after), _base_curve(after, schedule, decay, gamma))
        else:
            # B[i, j] = base(j - i) for i < j, else 0: the curve restarted at rejection i, seen at j
            offset = (j.unsqueeze(0) - j.unsqueeze(1)).float()  # [k, k] j - i
            B = torch.where(offset > 0, _base_curve(offset.clamp(min=0), schedule, decay, gamma), 0.0)
            p_reject = v.alive * (1.0 - v.accept.float())  # [..., k] P(r = i)
            w = v.alive + p_reject @ B  # [..., k]
        return w * valid_f


def dpace_weights(ce: Tensor, valid: Tensor, a: float = DPACE_A) -> Tensor:
    """[..., k] D-PACE position weights (detached) from per-position CE ``[..., k]``.

    ``s_i = (1 - a) exp(-CE_i) + a`` (exp(-CE) stands for the chance position i is accepted; a floors
    it), ``w_j = sum_{m >= j} prod_{i <= m} s_i`` over the valid positions: position j weighs what
    every later position that it leads to is worth. CE = inf (a target outside the draft vocabulary,
    never accepted) gives s = a. Example, a = 0.5::

        ce   = 0    ln 2  inf   -> exp(-ce) = 1 0.5 0 -> s = 1 0.75 0.5
        prod = 1    0.75  0.375 -> w = 2.125 1.125 0.375
    """
    with torch.no_grad():
        s = (1.0 - a) * torch.exp(-ce.float()) + a
        prod = torch.where(valid, s, torch.zeros_like(s)).cumprod(-1)  # 0 from the first invalid position on
        return prod.flip(-1).cumsum(-1).flip(-1) * valid


def first_failure(draft_argmax: Tensor, target_argmax: Tensor, d2t: Tensor | None) -> Tensor:
    """[...] long: the first position where the draft's argmax (draft ids ``[..., k]``) differs from the
    target's (target ids), i.e. the length of the leading run of matches; k if every position matches.
    draft a b x d, target a b c d -> 2."""
    with torch.no_grad():
        match = draft_to_target(draft_argmax, d2t) == target_argmax
        return match.long().cumprod(-1).sum(-1)


def truncated_weights(first_fail: Tensor, valid: Tensor, schedule: str, *, decay: float = 0.8,
                      gamma: float = 7.0) -> Tensor:
    """[..., k] Spec-AUF weights (detached): the fixed curve up to and including the draft's own first
    failure f (``first_failure``, ``[...]``), 0 after: the positions after f, which verification would
    never reach, get no loss (no tail, unlike VAT's weights)::

        eagle3, f = 1:  pos = 0 1 2 3 -> w = 1 0.8 0 0
        eagle3, f = 4:  pos = 0 1 2 3 -> w = 1 0.8 0.64 0.512   (no failure: the fixed curve)
    """
    with torch.no_grad():
        k = valid.shape[-1]
        w = fixed_weights(k, schedule, decay=decay, gamma=gamma, device=valid.device)  # [k]
        keep = torch.arange(k, device=valid.device) <= first_fail.unsqueeze(-1)  # [..., k]
        return w * (keep & valid)


# ----------------------------------------------------------------------------------------------
# Per-position terms beside CE: p [..., Vd] the target distribution over the draft vocabulary
# (``soft_targets``), the draft's logits [..., Vd].


def acceptance(p: Tensor, logits: Tensor) -> Tensor:
    """[...] expected acceptance ``alpha = sum_x min(p(x), q(x))``, q = softmax(logits), with grad
    through q; ``1 - alpha = TV(p, q)``. p = (0.7, 0.3), q = (0.4, 0.6) -> alpha = 0.4 + 0.3 = 0.7."""
    q = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return torch.minimum(p.to(q.dtype), q).sum(-1)


def entropy(p: Tensor) -> Tensor:
    """[...] ``H(p) = -sum p log p`` (0 log 0 = 0), no grad. p = (0.5, 0.5) -> ln 2."""
    with torch.no_grad():
        return torch.special.entr(p.float()).sum(-1)


def kl_divergence(soft_ce: Tensor, p_entropy: Tensor) -> Tensor:
    """[...] forward ``KL(p || q) = -sum p log q - H(p)``: the soft CE less the target's entropy, so
    its gradient is the soft CE's. p = (0.5, 0.5), q = (0.25, 0.75): soft CE = 0.5 (ln 4 + ln 4/3)
    = 0.837, H = ln 2 = 0.693 -> KL = 0.144."""
    return soft_ce - p_entropy


def tv_loss(alpha: Tensor) -> Tensor:
    """[...] total variation ``TV(p, q) = 1 - alpha``: the chance the position is rejected under
    speculative sampling. alpha = 0.7 -> 0.3."""
    return 1.0 - alpha


def lk_loss(alpha: Tensor, kl: Tensor | None, kl_share: float) -> Tensor:
    """[...] the LK hybrid ``kl_share * KL + (1 - kl_share) * -log alpha`` (``kl`` may be None when
    ``kl_share`` is 0). -log alpha is the loss of the expected acceptance itself; the KL share keeps a
    gradient on all of q when alpha is small. alpha = 0.5, KL = 0.2, share 0.5 -> 0.1 + 0.5 ln 2 = 0.447."""
    nll = -torch.log(alpha.clamp(min=ALPHA_FLOOR))
    return nll if kl_share == 0 else kl_share * kl + (1.0 - kl_share) * nll


def head_bce(head_logits: Tensor, label: Tensor, valid: Tensor) -> Tensor:
    """The head's loss: BCE of ``head_logits [..., k]`` toward ``label [..., k]`` (detached), averaged over
    the valid positions. VAT's label is the alive bit; DSpark's confidence head's the soft label alpha
    = 1 - TV(p, q). Logit 0 -> BCE = log 2 whatever the label."""
    bce = F.binary_cross_entropy_with_logits(head_logits.float(), label.detach().float(), reduction="none")
    return torch.where(valid, bce, torch.zeros_like(bce)).sum() / valid.sum().clamp(min=1)


def head_alive_logits(head_logits: Tensor, label: str) -> Tensor:
    """[..., k] the head's prediction of the alive bit, as logits (detached, for the metrics): VAT's
    head predicts it directly; a confidence head (label "alpha") predicts each position's acceptance
    c_j, so alive_j = prod_{i<j} c_i. c = 0.9 0.8 0.5 -> alive = 1 0.9 0.72."""
    if label == "alive":
        return head_logits
    with torch.no_grad():
        c = torch.sigmoid(head_logits.float())
        alive = torch.cat([torch.ones_like(c[..., :1]), c[..., :-1]], dim=-1).cumprod(-1)
        return torch.logit(alive, eps=1e-6)
