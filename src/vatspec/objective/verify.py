"""Simulated verification: what a serving engine would accept from a batch of drafted chains.

Pure torch, no state. Training turns the result into supervision (``losses.py``) and into
diagnostics (``metrics.py``). Shapes: ``...`` are the chain dims, k the drafted positions per chain,
Vd the draft vocabulary, V the target vocabulary.

Three rules (docs/training.md, "Objectives"; the paper trains with the first):

- ``greedy``:   position j is accepted iff the draft's argmax, mapped to a target id, equals the
                target's argmax. A target argmax outside the draft vocabulary can never be matched,
                so it is a rejection by construction.
- ``sampled``:  speculative sampling at ``temperature``: draw ``x ~ q``, accept with probability
                ``min(1, p(x) / q(x))``; p is normalised over the full target vocabulary.
- ``expected``: no draws; ``accept`` holds ``alpha_j = sum_x min(p_j(x), q_j(x))``, the probability
                the sampled rule accepts position j.

Worked example (greedy, k = 4, all valid)::

    draft argmax  = a b x d        target argmax = a b c d
    accept        = 1 1 0 1        first_reject  = 2  (num_accepted = 2, tau = 3 with the bonus)
    alive (v)     = 1 1 1 0        1 iff every earlier position was accepted

Position 3 matches, yet verification never reaches it: alive is 0 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from vatspec.drafters.vocab import target_ids

MODES = ("greedy", "sampled", "expected")

# Upper bound on the elements of one full-vocab fp32 temporary (64M elements = 256 MiB). Full-vocab
# log-normalisers are computed chunk by chunk below it, so [N, k, V] target logits never get a whole
# fp32 copy (N * k * 49152 * 4 bytes is many GiB at training batch sizes).
_CHUNK_ELEMS = 1 << 26


@dataclass(frozen=True)
class Verification:
    """Outcome of simulated verification on chains of k drafted positions (all fields detached).

    accept:        [..., k] bool accept bit per position (greedy / sampled), or float acceptance
                   probability alpha_j (expected); False / 0 at invalid positions.
    first_reject:  [...] long, 0-based index of the first rejected valid position, or the number of
                   valid positions if none is rejected; None in expected mode.
    alive:         [..., k] float, the paper's label v: 1 iff every earlier position was accepted
                   (so 1 exactly for j <= first_reject); expected mode: prod_{i<j} alpha_i. 0 where invalid.
    valid:         [..., k] bool, as given (all True if none was given).
    target_argmax: [..., k] long target id of the target's argmax (hard labels and metrics reuse it).
    draft_token:   [..., k] long target id of the drafted token (argmax or sample); None in expected mode.
    mode:          the rule used, one of ``MODES``.
    """

    accept: Tensor
    first_reject: Tensor | None
    alive: Tensor
    valid: Tensor
    target_argmax: Tensor
    draft_token: Tensor | None
    mode: str

    @property
    def num_accepted(self) -> Tensor:
        """[...] accepted drafts before the first rejection (0..k); excludes the bonus token, so
        ``tokens_per_step = num_accepted + 1`` (docs/evaluation.md's tau). Long in greedy / sampled mode;
        the expectation ``sum_j prod_{i<=j} alpha_i`` (float) in expected mode."""
        if self.first_reject is not None:
            return self.first_reject
        return (self.alive * self.accept).sum(-1)


def draft_to_target(draft_ids: Tensor, d2t: Tensor | None) -> Tensor:
    """Map draft-vocab ids (any shape, long) to target ids: ``i -> i + d2t[i]``; identity if d2t is None."""
    return draft_ids if d2t is None else target_ids(d2t)[draft_ids]


def target_to_draft(d2t: Tensor | None, vocab_size: int) -> Tensor | None:
    """[V] long: the draft id of each target id, -1 outside the draft vocabulary; None for the identity.

    Example: d2t = [0, 1, 3] (draft 0 1 2 -> target 0 2 5), V = 6 -> [0, -1, 1, -1, -1, 2].
    """
    if d2t is None:
        return None
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    index[target_ids(d2t)] = torch.arange(d2t.numel(), device=d2t.device)
    return index


def log_normaliser(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """``logsumexp(logits / temperature)`` over the last dim in fp32: [..., V] -> [...].

    Works chunk by chunk along the leading dims (views, no copy of the input), so no fp32
    temporary exceeds ``_CHUNK_ELEMS`` elements. Accepts non-contiguous (strided) views.
    """
    if logits.numel() <= _CHUNK_ELEMS or logits.dim() == 1:
        return torch.logsumexp(logits.float() / temperature, dim=-1)
    d = max(range(logits.dim() - 1), key=lambda i: logits.shape[i])  # split the longest leading dim
    rows = max(1, logits.shape[d] * _CHUNK_ELEMS // logits.numel())
    parts = [log_normaliser(c, temperature) for c in logits.split(rows, dim=d)]
    return torch.cat(parts, dim=d)


def _check_inputs(draft_logits: Tensor, target_logits: Tensor, valid: Tensor | None, d2t: Tensor | None) -> Tensor:
    """Assert the shape contract; return ``valid`` as a [..., k] bool tensor."""
    lead = draft_logits.shape[:-1]  # [..., k]
    if draft_logits.dim() < 2:
        raise ValueError(f"draft_logits must be [..., k, Vd], got {tuple(draft_logits.shape)}")
    if target_logits.shape[:-1] != lead:
        raise ValueError(
            f"target_logits {tuple(target_logits.shape)} must share [..., k] with draft_logits "
            f"{tuple(draft_logits.shape)}"
        )
    Vd, V = draft_logits.shape[-1], target_logits.shape[-1]
    if d2t is None:
        if Vd != V:
            raise ValueError(f"d2t is None (identity) but draft vocab {Vd} != target vocab {V}")
    elif d2t.shape != (Vd,) or d2t.dtype != torch.long:
        raise ValueError(f"d2t must be long [{Vd}] (draft vocab), got {d2t.dtype} {tuple(d2t.shape)}")
    if valid is None:
        return torch.ones(lead, dtype=torch.bool, device=draft_logits.device)
    if valid.shape != lead or valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool {tuple(lead)}, got {valid.dtype} {tuple(valid.shape)}")
    # A prefix mask along k: once False, False after (one host sync; verification assumes it).
    if bool((valid[..., 1:] & ~valid[..., :-1]).any()):
        raise ValueError("valid must be a prefix mask along k (once False, False after)")
    return valid


def _exclusive_cumprod(x: Tensor) -> Tensor:
    """[..., k] -> [..., k]: out_j = prod_{i<j} x_i (out_0 = 1)."""
    ones = torch.ones_like(x[..., :1])
    return torch.cat([ones, x[..., :-1]], dim=-1).cumprod(-1)


def simulate_verification(
    draft_logits: Tensor,
    target_logits: Tensor,
    valid: Tensor | None = None,
    *,
    mode: str = "greedy",
    temperature: float = 1.0,
    d2t: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verification:
    """Simulate verification of chains of k drafted positions.

    draft_logits:  [..., k, Vd] draft logits over the draft vocabulary.
    target_logits: [..., k, V]  target logits for the same positions (may be a strided view; it is
                   read by argmax / gather / chunked logsumexp, never copied whole).
    valid:         [..., k] bool prefix mask, True where the position exists; None = all True.
    mode:          "greedy" | "sampled" | "expected" (see the module docstring).
    temperature:   scales both p and q in sampled / expected mode (must be > 0); unused in greedy.
    d2t:           [Vd] long offsets, draft id i -> target id i + d2t[i]; None = identity (Vd == V).
    generator:     RNG for the sampled mode's draws; must be on the logits' device (ValueError if not).

    Returns a ``Verification`` computed under no_grad.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode != "greedy" and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for mode={mode!r}, got {temperature}")
    valid = _check_inputs(draft_logits, target_logits, valid, d2t)
    if mode == "sampled" and generator is not None and generator.device.type != draft_logits.device.type:
        raise ValueError(
            f"simulate_verification: the generator is on {generator.device} but the logits are on "
            f"{draft_logits.device}; make it there (torch.Generator(device=...), train.step_generator(..., device=...))"
        )
    stat, target_argmax, draft_token = position_stats(
        draft_logits, target_logits, mode=mode, temperature=temperature, d2t=d2t, generator=generator
    )
    return chain_verification(stat, valid, target_argmax, draft_token, mode=mode, generator=generator)


def position_stats(
    draft_logits: Tensor,
    target_logits: Tensor,
    *,
    mode: str = "greedy",
    temperature: float = 1.0,
    d2t: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The per-position half of ``simulate_verification`` (no grad): each position on its own.

    draft_logits [..., Vd], target_logits [..., V] (any leading dims; a chunk of rows works as well as
    the whole batch, which is how the chunked loss path calls it).
    Returns ``(stat, target_argmax, draft_token)``, each ``[...]``: ``stat`` is the draft's argmax
    matching the target's (greedy, bool), the acceptance ratio ``p(x) / q(x)`` of the drawn x (sampled;
    the uniform draw that turns it into a bit is ``chain_verification``'s, after every position's x), or
    alpha (expected). ``draft_token`` in target ids; None in expected mode.
    """
    with torch.no_grad():
        target_argmax = target_logits.argmax(-1)  # [...] target ids
        if mode == "greedy":
            # 1. draft argmax in target ids; a target argmax outside the draft vocab never matches
            draft_token = draft_to_target(draft_logits.argmax(-1), d2t)
            return draft_token == target_argmax, target_argmax, draft_token
        logq = F.log_softmax(draft_logits.float() / temperature, dim=-1)  # [..., Vd]
        lse_p = log_normaliser(target_logits, temperature)  # [...], full-vocab normaliser
        if mode == "sampled":
            # 1. x ~ q
            Vd = logq.shape[-1]
            x = torch.multinomial(logq.exp().reshape(-1, Vd), 1, generator=generator).view(logq.shape[:-1])
            draft_token = draft_to_target(x, d2t)
            # 2. the acceptance ratio p(x) / q(x) (accepted with prob min(1, ratio))
            logq_x = logq.gather(-1, x.unsqueeze(-1)).squeeze(-1)
            logit_p_x = target_logits.gather(-1, draft_token.unsqueeze(-1)).squeeze(-1).float()
            return (logit_p_x / temperature - lse_p - logq_x).exp(), target_argmax, draft_token
        # alpha = sum_x min(p(x), q(x)); q is zero off the draft vocab's target ids, so only
        # those V_d columns of p are needed (p still normalised over the full V).
        cols = target_logits
        if d2t is not None:
            cols = target_logits.index_select(-1, target_ids(d2t))  # [..., Vd]
        p = (cols.float() / temperature - lse_p.unsqueeze(-1)).exp()  # [..., Vd]
        alpha = torch.minimum(p, logq.exp()).sum(-1).clamp(0.0, 1.0)
        return alpha, target_argmax, None


def chain_verification(
    stat: Tensor,
    valid: Tensor,
    target_argmax: Tensor,
    draft_token: Tensor | None,
    *,
    mode: str = "greedy",
    generator: torch.Generator | None = None,
) -> Verification:
    """The chain half of ``simulate_verification``: ``position_stats``'s ``[..., k]`` outputs and the
    ``valid [..., k]`` prefix mask -> accept bits, first rejection and alive labels (no grad).
    Sampled mode draws its uniforms here, one per position, after all of ``position_stats``'s draws."""
    lead = valid.shape  # [..., k]
    with torch.no_grad():
        if mode == "greedy":
            accept = stat & valid
        elif mode == "sampled":
            # u in [0, 1) so ratio >= 1 always accepts
            u = torch.rand(lead, generator=generator, device=stat.device)
            accept = (u < stat) & valid
        else:
            accept = torch.where(valid, stat, torch.zeros_like(stat))

        valid_f = valid.float()
        if mode == "expected":
            first_reject = None
            alive = _exclusive_cumprod(accept) * valid_f  # prod_{i<j} alpha_i
        else:
            # 3. first rejection = length of the accepted prefix (accept is False where invalid)
            prefix = accept.long().cumprod(-1)  # [..., k] 1 while every position so far was accepted
            first_reject = prefix.sum(-1)  # [...]
            alive = _exclusive_cumprod(accept.float()) * valid_f

    return Verification(
        accept=accept,
        first_reject=first_reject,
        alive=alive,
        valid=valid,
        target_argmax=target_argmax,
        draft_token=draft_token,
        mode=mode,
    )
