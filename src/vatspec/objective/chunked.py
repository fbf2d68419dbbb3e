"""The vocabulary-wide work of a training step, chunk by chunk (``loss.chunk_size`` > 0).

With ``loss.chunk_size = 0`` a step holds, for its N = chains x k positions, the draft logits
[N, Vd], the target logits of every position [N, V] (DFlash gathers them; EAGLE-3 reads a view of
a padded copy), the soft labels [N, Vd], their log-softmax, and in backward two more [N, Vd]
buffers, all float32: at V = 152k, DFlash with 512 anchors x block 16 is 4.7 GB each.

Here the drafter returns its last hidden state [N, H] with its lm_head weight [Vd, H] instead of
logits, and the target's rows with an index per position (P target positions; EAGLE-3's k steps and
DFlash's overlapping blocks share rows): its final hidden state [P, H_t] with ``Target.logits`` to
turn it into logits (the loop runs the target without logits), or logits [P, V] it already has. Then:

1. teacher (no grad), over the P' rows the supervised positions read, in chunks: the target's
   logits, its argmax [P'] and, for the soft term, its softmax over the draft vocabulary [P', Vd]
   (EAGLE-3: the ``t2d`` columns, renormalised; DFlash: all V). Never [N, V] or [B, T, V].
2. one pass over the N' kept positions (the valid ones; every one in sampled mode, whose draws walk
   every position as ``simulate_verification`` does), C rows at a time: ``x = h W^T`` in float32
   (bf16 under bf16 autocast),
   the draft argmax, the soft and hard CE, alpha = sum min(p, q) when the loss reads it (tv, lk,
   DSpark's head), and (sampled / expected) ``verify.position_stats``; H(p) for KL comes from step 1.
3. backward (``_ChunkedHeadCE``): recompute x per chunk and hand
   ``dx = (gs + gh) softmax(x) - gs p - gh onehot`` (``losses._TokenCE``'s gradient; plus alpha's,
   see the class) to the matmuls ``dh = dx W``, ``dW += dx^T h``. Nothing of width V outlives its
   chunk but DFlash's [P', V] teacher.

The per-position results (``losses.PositionTerms`` [..., k] with grad, draft argmax, a
``Verification``) feed ``losses.vat_objective`` and ``metrics.chain_metrics`` unchanged, so weights
and reduction are the unchunked path's. Values and gradients equal it to float rounding
(``tests/test_chunked.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from vatspec.drafters.base import DraftOutput
from vatspec.drafters.vocab import target_ids
from vatspec.objective.losses import LossConfig, PositionTerms, entropy, hard_labels
from vatspec.objective.verify import Verification, chain_verification, draft_to_target, position_stats
from vatspec.target.precision import frozen_cast


def head_logits(hidden: Tensor, weight: Tensor, softcap: float | None = None, out: Tensor | None = None) -> Tensor:
    """``hidden [n, H] @ weight[Vd, H]^T`` in at least float32, soft-capped (Gemma) if ``softcap``.
    ``out``: a float32-or-wider [n, Vd] buffer to write into (reused across chunks: no fresh pages)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    h = hidden.to(weight.dtype)
    if out is None:
        x = F.linear(h, weight).to(dtype)
        return torch.tanh(x / softcap) * softcap if softcap else x
    x = torch.mm(h, weight.T, out=out) if weight.dtype == dtype else out.copy_(F.linear(h, weight))
    return x.div_(softcap).tanh_().mul_(softcap) if softcap else x


class _ChunkedHeadCE(torch.autograd.Function):
    """Soft and hard CE (and alpha) of ``head_logits(hidden, weight)`` over rows, ``chunk`` rows at a time.

    Inputs: hidden [N, H], weight [Vd, H], p [P, Vd] soft labels read at rows p_index [N] (or None),
    labels [N] draft ids (or None), alpha (bool: also ``sum min(p, q)``, needs p). ``on_chunk(x, start,
    end)``, if given, sees each chunk's float32 logits (no grad) once in forward. Returns (soft [N] or
    None, hard [N] or None, alpha [N] or None, argmax [N]).
    Saves its inputs and the log-normaliser [N]; backward recomputes each chunk's logits. One
    [chunk, Vd] buffer (two with soft labels, three with alpha) serves every chunk, worked on in place.

    With ``lse = logsumexp(x)``, ``q = exp(x - lse)`` and p summing to 1: ``soft = lse - p.x``,
    ``hard = lse - x[label]``, ``alpha = sum min(p, q)``; backward, with ``m = [q < p]`` and
    ``S = sum m q``: ``dx = (gs + gh - ga S) q + ga m q - gs p - gh onehot`` (``losses._TokenCE``'s
    gradient, plus alpha's: ``d alpha / dx_u = m_u q_u - q_u S``).
    Both run outside autocast, which would cast into the float32 buffers; ``mm_dtype`` (bf16 when
    ``chunked_token_ce`` is called under bf16 autocast, else None) is the matmuls' own input dtype
    instead: ``x = h W^T``, ``dh = dx W`` and ``dW += dx^T h`` multiply in it (the logits rounded to
    bf16, as autocast's own linear returns them) and the softmax, the CE and dW are float32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, p, p_index, labels, alpha, chunk, softcap, on_chunk, mm_dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            return _ChunkedHeadCE._forward(ctx, hidden, weight, p, p_index, labels, alpha, chunk, softcap, on_chunk,
                                           mm_dtype)

    @staticmethod
    def backward(ctx, g_soft, g_hard, g_alpha, _g_argmax):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _ChunkedHeadCE._backward(ctx, g_soft, g_hard, g_alpha)

    @staticmethod
    def _forward(ctx, hidden, weight, p, p_index, labels, alpha, chunk, softcap, on_chunk, mm_dtype):
        N = hidden.shape[0]
        dtype = torch.promote_types(weight.dtype, torch.float32)
        w = frozen_cast(weight, mm_dtype) if mm_dtype is not None else weight  # once a call, not a chunk
        dev = hidden.device
        soft = torch.empty(N, dtype=dtype, device=dev) if p is not None else None
        hard = torch.empty(N, dtype=dtype, device=dev) if labels is not None else None
        acc = torch.empty(N, dtype=dtype, device=dev) if alpha else None
        argmax = torch.empty(N, dtype=torch.long, device=dev)
        lse = torch.empty(N, dtype=dtype, device=dev)
        xbuf = torch.empty(min(chunk, N), weight.shape[0], dtype=dtype, device=dev)
        pbuf = torch.empty_like(xbuf) if p is not None else None
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            x = head_logits(hidden[s:e], w, softcap, out=xbuf[: e - s])  # [c, Vd]
            argmax[s:e] = x.argmax(-1)
            if on_chunk is not None:
                on_chunk(x, s, e)
            dot = None
            if p is not None:
                pc = torch.index_select(p, 0, p_index[s:e], out=pbuf[: e - s]) if p.dtype == dtype \
                    else p[p_index[s:e]].to(dtype)
                dot = torch.einsum("nv,nv->n", pc, x)
            x_label = x.gather(-1, labels[s:e, None]).squeeze(-1) if labels is not None else None
            m = x.amax(-1)
            z = x.sub_(m[:, None]).exp_().sum(-1)  # x holds exp(x - m) from here on
            lse[s:e] = z.log().add_(m)
            if p is not None:
                soft[s:e] = lse[s:e] - dot
            if labels is not None:
                hard[s:e] = lse[s:e] - x_label
            if alpha:  # q = exp(x - m) / z
                acc[s:e] = torch.minimum(x.div_(z[:, None]), pc, out=x).sum(-1)
        ctx.save_for_backward(hidden, weight, p, p_index, labels, lse)
        ctx.chunk, ctx.softcap, ctx.mm_dtype = chunk, softcap, mm_dtype
        ctx.mark_non_differentiable(argmax)
        return soft, hard, acc, argmax

    @staticmethod
    def _backward(ctx, g_soft, g_hard, g_alpha):
        hidden, weight, p, p_index, labels, lse = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        N, cap = hidden.shape[0], ctx.softcap
        dtype = torch.promote_types(weight.dtype, torch.float32)
        w = frozen_cast(weight, ctx.mm_dtype) if ctx.mm_dtype is not None else weight
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        use_soft = p is not None and g_soft is not None
        use_hard = labels is not None and g_hard is not None
        use_alpha = p is not None and g_alpha is not None
        xbuf = torch.empty(min(ctx.chunk, N), weight.shape[0], dtype=dtype, device=hidden.device)
        pbuf = torch.empty_like(xbuf) if use_soft or use_alpha else None
        mbuf = torch.empty_like(xbuf) if use_alpha else None
        zero = torch.zeros(N, dtype=dtype, device=hidden.device)
        gs = g_soft.to(dtype) if use_soft else zero
        gh = g_hard.to(dtype) if use_hard else zero
        ga = g_alpha.to(dtype) if use_alpha else zero
        for s in range(0, N, ctx.chunk):
            e = min(N, s + ctx.chunk)
            h = hidden[s:e].to(w.dtype)
            x = head_logits(h, w, cap, out=xbuf[: e - s])  # [c, Vd]
            dcap = 1 - (x / cap) ** 2 if cap else None  # x = c tanh(z / c): dx/dz = 1 - (x / c)^2
            pc = None
            if use_soft or use_alpha:
                pc = torch.index_select(p, 0, p_index[s:e], out=pbuf[: e - s]) if p.dtype == dtype \
                    else p[p_index[s:e]].to(dtype)
            q = x.sub_(lse[s:e, None]).exp_()  # in place: softmax
            coef = gs[s:e] + gh[s:e]
            if use_alpha:
                mq = torch.mul(q, q < pc, out=mbuf[: e - s])  # m q: the columns where q < p
                coef = coef - ga[s:e] * mq.sum(-1)
                dx = q.mul_(coef[:, None]).add_(mq.mul_(ga[s:e, None]))
            else:
                dx = q.mul_(coef[:, None])
            if use_soft:
                dx.addcmul_(pc, gs[s:e, None], value=-1)
            if use_hard:
                dx.scatter_add_(-1, labels[s:e, None], -gh[s:e, None])
            if cap:
                dx.mul_(dcap)
            dxw = dx.to(w.dtype)
            if need_h:
                dh[s:e] = (dxw @ w).to(dh.dtype)
            if need_w and ctx.mm_dtype is not None:
                dw.add_(dxw.T @ h)
            elif need_w:
                dw.addmm_(dx.T, h.to(dtype))
        return dh, dw.to(weight.dtype) if need_w else None, None, None, None, None, None, None, None, None


def chunked_token_ce(
    hidden: Tensor,
    weight: Tensor,
    p: Tensor | None,
    p_index: Tensor | None,
    labels: Tensor | None,
    *,
    chunk_size: int,
    softcap: float | None = None,
    on_chunk: Callable[[Tensor, int, int], None] | None = None,
    alpha: bool = False,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """Per-row soft and hard CE of the logits ``hidden [N, H] @ weight [Vd, H]^T`` (float32 or wider),
    never holding more than ``chunk_size`` rows of them.

    p [P, Vd] soft labels read at ``p_index [N]`` (None: no soft term); labels [N] draft ids (None: no
    hard term); alpha: also the expected acceptance ``sum min(p, q)`` per row (needs p). Returns
    ``(soft [N] or None, hard [N] or None, alpha [N] or None, draft argmax [N])``. Equal to
    ``losses.token_ce(head_logits(hidden, weight), p[p_index], labels)`` and ``losses.acceptance``,
    gradients w.r.t. hidden and weight included. Under bf16 autocast (``train.precision=bf16``) the
    matmuls multiply bf16 copies of hidden and weight, and round the logits to bf16, as autocast's
    own linear does; the softmax and CE stay float32.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], (
        f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [Vd, H]"
    )
    if p is not None:
        assert p_index is not None and p_index.shape == hidden.shape[:1] and p.shape[1] == weight.shape[0], (
            f"p {tuple(p.shape)} must be [P, Vd] with p_index [N]"
        )
    if alpha and p is None:
        raise ValueError("chunked_token_ce: alpha needs the soft labels p")
    dev = hidden.device.type
    mm_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    return _ChunkedHeadCE.apply(hidden, weight, p, p_index, labels, bool(alpha), int(chunk_size), softcap, on_chunk,
                                mm_dtype)


def teacher(
    table: Tensor,
    rows: Tensor,
    d2t: Tensor | None,
    *,
    chunk_size: int,
    soft: bool,
    head: Callable[[Tensor], Tensor] | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The target side of the chunked path (no grad): for ``table [P, V]`` target logits (or, with
    ``head``, rows [P, H_t] that ``head`` turns into logits) read at ``rows [U]``, the target argmax
    ``[U]`` (full vocabulary), if ``soft`` the soft labels ``[U, Vd]``: the target softmax over
    the draft vocabulary's target ids (``d2t``; all V if None), renormalised over them
    (``losses.soft_targets``), and if ``with_entropy`` their entropy ``[U]`` (``losses.entropy``).
    ``chunk_size`` rows of width V at a time."""
    with torch.no_grad():
        tid = target_ids(d2t) if d2t is not None else None
        U = rows.shape[0]
        argmax = torch.empty(U, dtype=torch.long, device=table.device)
        p = None
        for s in range(0, U, chunk_size):
            e = min(U, s + chunk_size)
            t = table[rows[s:e]] if head is None else head(table[rows[s:e]])  # [c, V]
            if soft and p is None:
                Vd = tid.numel() if tid is not None else t.shape[1]
                p = torch.empty(U, Vd, dtype=torch.promote_types(t.dtype, torch.float32), device=table.device)
            argmax[s:e] = t.argmax(-1)
            if soft:
                cols = t.index_select(-1, tid) if tid is not None else t
                p[s:e] = torch.softmax(cols.to(p.dtype), dim=-1)
        return argmax, p, (entropy(p) if with_entropy and p is not None else None)


class _Taught(NamedTuple):
    table: Tensor
    rows: Tensor
    d2t: Tensor | None
    head: Callable[[Tensor], Tensor] | None
    argmax: Tensor
    p: Tensor | None


@dataclass
class TeacherShare:
    """The ``teacher`` results of one lockstep batch, kept for its later arms (``shared_teacher``).
    ``keep_soft``: compute the soft labels even for an arm that does not read them, because a
    later arm does (``train.arms_micro_step`` sets it when any arm reads them). The results live
    until the batch's last arm is done: in lockstep one ``[rows, Vd]`` float32 tensor per drafter
    kind stays in memory a little longer than each arm alone would keep it."""

    keep_soft: bool = True
    taught: list[_Taught] = field(default_factory=list)


def shared_teacher(
    share: TeacherShare, table: Tensor, rows: Tensor, d2t: Tensor | None, *, chunk_size: int,
    soft: bool, head: Callable[[Tensor], Tensor] | None = None, with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``teacher``, computed once for the arms of one lockstep batch: the arms that read the same
    target rows of the same table through the same head and draft vocabulary (EAGLE-3 and EAGLE-3 +
    VAT; the two DFlash arms, whose anchors come from the same seed) get the result the first of
    them computed. The vocabulary-wide matmul is most of a teacher's cost."""
    for e in share.taught:  # the arms' tables are views of one tensor (kept alive here, so its address is its own)
        same_table = (e.table.data_ptr() == table.data_ptr() and e.table.shape == table.shape
                      and e.table.stride() == table.stride() and e.table.dtype == table.dtype)
        if (same_table and e.head == head and torch.equal(e.rows, rows) and (e.p is not None or not soft)
                and (e.d2t is d2t or (e.d2t is not None and d2t is not None and torch.equal(e.d2t, d2t)))):
            return e.argmax, e.p if soft else None, entropy(e.p) if with_entropy else None
    argmax, p, _ = teacher(table, rows, d2t, chunk_size=chunk_size, soft=soft or share.keep_soft, head=head)
    share.taught.append(_Taught(table, rows, d2t, head, argmax, p))
    return argmax, p if soft else None, entropy(p) if with_entropy else None


def chunked_pass(
    out: DraftOutput,
    cfg: LossConfig,
    *,
    d2t: Tensor | None = None,
    t2d: Tensor | None = None,
    generator: torch.Generator | None = None,
    shared: TeacherShare | None = None,
) -> tuple[Verification, PositionTerms, Tensor]:
    """Verification, the per-position terms and the draft argmax of a chunked ``DraftOutput`` (one function:
    every chunk's pass reads the running state of the ones before it)
    (``out.logits`` is None; ``out.lm_head``, ``out.target_logits [P, V]`` and ``out.target_index``
    given), ``cfg.chunk_size`` rows at a time.

    Returns ``(v, PositionTerms (soft / hard CE, alpha, H(p), each [..., k] or None), draft_argmax
    [..., k])``: what ``simulate_verification``, ``losses.position_terms`` and the metrics compute from
    full logits, for ``vat_objective(..., terms=..., draft_argmax=...)`` and ``chain_metrics(...,
    draft_argmax=...)``. Every term is 0 and the argmax 0 at positions the pass skips (invalid ones,
    outside sampled mode): every consumer masks them. ``shared``: kept over the arms of one
    lockstep batch, so that arms reading the same target rows compute their teacher once
    (``shared_teacher``); None = always computed here.
    """
    if out.logits is not None or out.lm_head is None or out.target_index is None:
        raise ValueError("chunked_pass needs a DraftOutput made with with_logits=False (lm_head and target_index)")
    if cfg.verify == "sampled" and generator is not None and generator.device.type != out.hidden.device.type:
        raise ValueError(
            f"chunked_pass: the generator is on {generator.device} but the drafter's states are on "
            f"{out.hidden.device}; make it there (train.step_generator(..., device=...))"
        )
    C = cfg.chunk_size
    valid = out.valid  # [..., k]
    lead, H = valid.shape, out.hidden.shape[-1]
    table, V = out.target_logits, out.vocab_size
    keep = valid.reshape(-1) if cfg.verify != "sampled" else torch.ones(valid.numel(), dtype=torch.bool,
                                                                      device=valid.device)
    pos = keep.nonzero().squeeze(-1)  # [N'] flat positions the pass computes
    rows = out.target_index.reshape(-1)[pos]  # [N'] target rows they read

    # 1. teacher, once per target row read
    used, inv = torch.unique(rows, return_inverse=True)  # [U], [N']
    teach = teacher if shared is None else functools.partial(shared_teacher, shared)
    t_argmax, p, ent = teach(table, used, d2t, chunk_size=C, soft=cfg.uses_soft_labels, head=out.target_head,
                             with_entropy=cfg.uses_entropy)
    target_argmax = torch.zeros(valid.numel(), dtype=torch.long, device=valid.device)
    target_argmax[pos] = t_argmax[inv]
    target_argmax = target_argmax.view(lead)
    labels, _ = hard_labels(target_argmax, d2t, t2d, V)  # [..., k]

    # 2. the chunk pass; sampled / expected verification statistics from the same logits
    stat = draft_token = None
    if cfg.verify != "greedy":
        stat = torch.zeros(pos.numel(), device=valid.device)
        draft_token = torch.zeros(pos.numel(), dtype=torch.long, device=valid.device)

        def on_chunk(x: Tensor, s: int, e: int) -> None:
            t = table[rows[s:e]] if out.target_head is None else out.target_head(table[rows[s:e]])  # [c, V]
            st, _, tok = position_stats(x, t, mode=cfg.verify, temperature=cfg.temperature, d2t=d2t,
                                        generator=generator)
            stat[s:e] = st.to(stat.dtype)
            if tok is not None:
                draft_token[s:e] = tok
    else:
        on_chunk = None
    hidden = out.hidden.reshape(-1, H)[pos]  # [N', H]
    if out.logit_scale != 1.0:  # (h @ W^T) * s = (h * s) @ W^T: a bias-free head's scale, on the few rows read
        hidden = hidden * out.logit_scale
    soft, hard, alpha, argmax = chunked_token_ce(
        hidden, out.lm_head, p, inv if p is not None else None, labels.reshape(-1)[pos] if cfg.hard else None,
        chunk_size=C, softcap=out.softcap, on_chunk=on_chunk, alpha=cfg.uses_alpha,
    )

    # 3. back to [..., k], 0 where the pass skipped a position
    def spread(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.new_zeros(valid.numel()).index_put((pos,), x).view(lead)

    terms = PositionTerms(spread(soft), spread(hard), spread(alpha), spread(ent[inv] if ent is not None else None))
    draft_argmax = spread(argmax)
    with torch.no_grad():
        if cfg.verify == "greedy":
            draft_token = draft_to_target(draft_argmax, d2t)
            stat = draft_token == target_argmax
        else:
            stat = spread(stat)
            draft_token = spread(draft_token) if cfg.verify == "sampled" else None
    v = chain_verification(stat, valid, target_argmax, draft_token, mode=cfg.verify, generator=generator)
    return v, terms, draft_argmax
