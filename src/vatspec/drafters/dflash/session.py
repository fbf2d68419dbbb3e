"""DFlash inference: one sequence's context K/V cache and block drafting (``DFlashSession``, made by
``DFlashDrafter.new_session``)."""

from __future__ import annotations

import torch
from torch import Tensor

from vatspec.drafters.base import AcceptHead
from vatspec.drafters.sampling import Proposal, sample, warp_logits

MIN_CACHE = 256  # initial context-cache capacity of a session (positions); doubles when full


class DFlashSession:
    """Incremental drafting for one sequence (batch size 1).

    ``extend`` appends committed positions (their target features) and sets the pending token;
    ``propose`` drafts the block ``[pending, MASK x (B-1)]`` at positions ``n .. n+B-1`` in one pass.
    The block's own keys are never cached: only committed context is, so nothing needs cropping.
    """

    def __init__(self, drafter, head: AcceptHead | None = None, exit_threshold: float | None = None):
        if exit_threshold is not None and head is None:
            raise ValueError("exit_threshold needs an accept head")
        self.drafter, self.head, self.exit_threshold = drafter, head, exit_threshold
        self.length = 0  # committed positions in the context cache
        self.pending: Tensor | None = None  # [1] the anchor token of the next block
        self._k: list[Tensor] = []  # per layer [1, hkv, capacity, D]
        self._v: list[Tensor] = []

    @torch.no_grad()
    def extend(self, features: Tensor, tokens: Tensor) -> None:
        """features ``[m, n*H_t]`` at the next m positions; tokens ``[m]``, tokens[j] follows position j.

        The last token is the pending one (not yet run by the target): the next block's anchor.
        """
        d = self.drafter
        n_feat = len(d.target_layer_ids) * d.config.target_hidden_size
        assert features.dim() == 2 and features.shape[1] == n_feat, (
            f"features must be [m, {n_feat}], got {tuple(features.shape)}"
        )
        m = features.shape[0]
        assert m >= 1 and tokens.shape == (m,), f"tokens must be [{m}], got {tuple(tokens.shape)}"
        pos = torch.arange(self.length, self.length + m, device=features.device)[None]
        kv = d.project_context(features[None], pos)
        for i, (k, v) in enumerate(kv):
            if i == len(self._k):
                self._k.append(k.new_empty(1, k.shape[1], 0, k.shape[3]))
                self._v.append(v.new_empty(1, v.shape[1], 0, v.shape[3]))
            self._k[i] = _append(self._k[i], k, self.length)
            self._v[i] = _append(self._v[i], v, self.length)
        self.length += m
        self.pending = tokens[-1:].to(device=features.device, dtype=torch.long)

    @torch.no_grad()
    def draft_block(self, k: int | None = None) -> tuple[Tensor, Tensor]:
        """Run the block once -> (logits ``[k, V]`` float32, hidden ``[k, H]``) for slots 1..k
        (default all B-1). The whole block runs either way (its slots attend to each other); only
        the lm_head, the costly part of a draft on a 49k vocabulary, is limited to the k slots used."""
        if self.pending is None:
            raise RuntimeError("propose before extend: the session has no pending token")
        d = self.drafter
        Bs, n = d.block_size, self.length
        dev = self.pending.device
        ids = torch.full((1, Bs), d.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = self.pending[0]
        pos = torch.arange(n, n + Bs, device=dev)[None]
        ctx = [(k[:, :, :n], v[:, :, :n]) for k, v in zip(self._k, self._v)]
        k = d.k if k is None else k
        hidden = d.run_block(ids, pos, ctx, mask=None)[0, 1 : 1 + k]  # everything committed is < n: no mask
        return d.compute_logits(hidden), hidden

    @torch.no_grad()
    def propose(
        self,
        k: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Draft slots 1..k (k <= drafter.k = B-1). Greedy at temperature 0 (q None), else sample each slot from
        ``q = warp_logits(logits)``. With an accept head, ``head_probs`` = sigmoid(head(hidden)); with
        an exit threshold as well, keep only the leading slots whose survival under the head's rule
        (``AcceptHead.prefix_alive``) is >= threshold (k' may be 0)."""
        if not 0 <= k <= self.drafter.k:
            raise ValueError(f"k must be in [0, {self.drafter.k}] (drafter.k = block_size - 1), got {k}")
        logits, hidden = self.draft_block(k)  # [k, V], [k, H]
        head_probs = None
        if self.head is not None:
            w = next(self.head.parameters(), None)
            h = hidden.to(w.dtype) if w is not None else hidden
            head_probs = torch.sigmoid(self.head(h).float())  # [k]
            if self.exit_threshold is not None:  # the head's own rule (HEAD_RULES)
                keep = int((self.head.prefix_alive(head_probs) >= self.exit_threshold).long().cumprod(0).sum())
                logits, head_probs = logits[:keep], head_probs[:keep]
        if temperature <= 0:
            return Proposal(tokens=logits.argmax(-1), q=None, head_probs=head_probs)
        if logits.shape[0] == 0:
            return Proposal(tokens=logits.new_zeros(0, dtype=torch.long), q=logits, head_probs=head_probs)
        q = warp_logits(logits, temperature, top_k, top_p)  # [k', V]
        tokens = sample(q, generator)  # [k'], each slot from its own marginal
        return Proposal(tokens=tokens, q=q, head_probs=head_probs)


def _append(buf: Tensor, new: Tensor, length: int) -> Tensor:
    """Write ``new [1, h, m, D]`` at ``buf[:, :, length:]``, growing capacity by doubling."""
    need = length + new.shape[2]
    if need > buf.shape[2]:
        grown = buf.new_empty(1, buf.shape[1], max(need, 2 * buf.shape[2], MIN_CACHE), buf.shape[3])
        grown[:, :, :length] = buf[:, :, :length]
        buf = grown
    buf[:, :, length:need] = new
    return buf
