"""EAGLE-3 inference: chain drafting for one sequence with the draft's own KV cache (``Eagle3Session``,
made by ``Eagle3Drafter.new_session``)."""

from __future__ import annotations

import torch
from torch import Tensor

from vatspec.drafters.base import AcceptHead
from vatspec.drafters.layers import attention
from vatspec.drafters.sampling import Proposal, sample, warp_logits
from vatspec.drafters.vocab import target_ids


class _KVCache:
    """Per-session keys/values [1, nkv, capacity, hd]; slot s holds RoPE position s.

    Calling it appends the new keys and attends (causal among the new queries)."""

    def __init__(
        self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 256
    ):
        self.k = torch.empty(1, num_kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        m, start = k.shape[-2], self.length
        end = start + m
        if end > self.k.shape[-2]:  # grow geometrically
            cap = max(2 * self.k.shape[-2], end)
            k_new = self.k.new_empty(1, self.k.shape[1], cap, self.k.shape[-1])
            v_new = torch.empty_like(k_new)
            k_new[:, :, :start] = self.k[:, :, :start]
            v_new[:, :, :start] = self.v[:, :, :start]
            self.k, self.v = k_new, v_new
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        visible = None
        if m > 1:
            qpos = torch.arange(start, end, device=k.device)
            visible = torch.arange(end, device=k.device)[None, :] <= qpos[:, None]  # [m, end]
        return attention(q, self.k[:, :, :end], self.v[:, :, :end], visible)


class Eagle3Session:
    """Chain drafting for one sequence (batch size 1 only) with the draft's own KV cache.

    State: committed positions 0..n-1 (their keys come from the target's features and the token
    that follows each), plus speculative keys of the last ``propose``, dropped by the next
    ``extend`` or ``propose``. Draft step i after context end t runs at RoPE position t + i and sees
    the committed keys and its own earlier speculative keys: the training unroll's pattern.
    """

    def __init__(self, drafter, head: AcceptHead | None = None, exit_threshold: float | None = None):
        if exit_threshold is not None and head is None:
            raise ValueError("exit_threshold needs an accept head")
        c = drafter.config
        w = drafter.fc.weight
        self.drafter = drafter
        self.head = head
        self.exit_threshold = exit_threshold
        self.committed = 0
        self._cache = _KVCache(c.num_kv_heads, c.head_dim, w.dtype, w.device)
        self._tid = target_ids(drafter.d2t)  # [Vd] target id of every draft id
        self._cos = self._sin = w.new_empty(0, c.head_dim)  # RoPE table [slots, hd], grown with the cache
        self._h: Tensor | None = None  # [1, 1, H] pre-norm output at the last committed position
        self._hn: Tensor | None = None  # [1, 1, H] its post-norm state
        self._logits: Tensor | None = None  # [Vd] its draft logits: the first proposal

    def _step(self, emb: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """emb, h [1, m, H] at the next m slots -> (pre-norm, post-norm) outputs [1, m, H]."""
        d = self.drafter
        start = self._cache.length
        end = start + h.shape[1]
        if end > self._cos.shape[0]:  # one table for all steps: no per-step RoPE kernels
            self._cos, self._sin = d._rope(torch.arange(max(2 * self._cos.shape[0], end, 256), device=h.device))
        h = d.midlayer(emb, h, self._cos[start:end], self._sin[start:end], self._cache)
        return h, d.norm(h)

    @torch.no_grad()
    def extend(self, features: Tensor, tokens: Tensor) -> None:
        """Append m committed positions.

        features: [m, n*H_t] the target's layer outputs (``target_layer_ids`` order) at m newly
                  verified positions.
        tokens:   [m] long, tokens[j] follows position j (the last is the pending token the
                  target has not processed yet).
        """
        d = self.drafter
        n_feat = d.fc.in_features
        if features.dim() != 2 or features.shape[1] != n_feat or tokens.shape != (features.shape[0],):
            raise ValueError(
                f"extend: features {tuple(features.shape)} must be [m, {n_feat}] and tokens "
                f"{tuple(tokens.shape)} [m] (batch size 1 only)"
            )
        self._cache.crop(self.committed)
        m = features.shape[0]
        if m == 0:
            return
        w = d.fc.weight
        h = d.fc(features.to(device=w.device, dtype=w.dtype)[None])  # [1, m, H]
        h, hn = self._step(d.embed(tokens[None]), h)
        self.committed += m
        self._h, self._hn = h[:, -1:], hn[:, -1:]
        self._logits = d.lm_head(hn[0, -1])  # [Vd]

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
        """Draft up to k tokens after the committed context (greedy when temperature == 0).

        With an accept head, ``head_probs`` holds sigmoid(head(post-norm hidden)) per kept token;
        with ``exit_threshold``, drafting stops at the first position whose survival under the head's
        rule (``AcceptHead.prefix_alive``: the prob itself, or the running product for a confidence
        head) is below it (that token and later ones are not drafted; k' may be 0).
        """
        if self._h is None:
            raise RuntimeError("propose: extend() the session with the prompt first")
        d = self.drafter
        self._cache.crop(self.committed)
        dev = self._h.device
        tokens = torch.empty(k, dtype=torch.long, device=dev)
        q = torch.zeros(k, d.config.vocab_size, device=dev) if temperature > 0 else None
        head_probs = torch.empty(k, device=dev) if self.head is not None else None
        logits, h, hn = self._logits, self._h, self._hn
        kept = k
        for j in range(k):
            if j > 0:  # feed the previous draft token and the pre-norm output
                h, hn = self._step(d.embed(tokens[j - 1 : j][None]), h)
                logits = d.lm_head(hn[0, 0])
            if self.head is not None:
                hw = self.head.proj.weight
                head_probs[j] = torch.sigmoid(self.head(hn[0, 0].to(device=hw.device, dtype=hw.dtype)).float())
                alive = self.head.prefix_alive(head_probs[: j + 1])[-1]  # the head's own rule (HEAD_RULES)
                if self.exit_threshold is not None and float(alive) < self.exit_threshold:
                    kept = j
                    break
            if temperature == 0:
                i = logits.argmax()
            else:
                probs = warp_logits(logits, temperature, top_k, top_p)  # [Vd]
                i = sample(probs, generator)
                q[j, self._tid] = probs  # place the mass at the target ids
            tokens[j] = self._tid[i]
        return Proposal(
            tokens=tokens[:kept],
            q=q[:kept] if q is not None else None,
            head_probs=head_probs[:kept] if head_probs is not None else None,
        )
