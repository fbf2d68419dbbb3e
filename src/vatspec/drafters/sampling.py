"""What a drafter proposes per round, and the logits warper both sides of verification share.

The decoding engine warps the target's logits with the same ``warp_logits`` the drafter uses for
``q``, so ``p`` and ``q`` are temperature-scaled and truncated identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Proposal:
    """One round of drafted tokens (batch size 1).

    tokens:     [k'] long, target-vocabulary ids, in drafting order.
    q:          [k', V] float32, the draft's warped distribution over the *target* vocabulary that
                each token was sampled from (mass only at draft-vocabulary ids); None when greedy.
    head_probs: [k'] float32, sigmoid of the accept head at each kept position; None without a head.
    """

    tokens: Tensor
    q: Tensor | None = None
    head_probs: Tensor | None = None

    def __post_init__(self):
        k = self.tokens.shape[0]
        assert self.tokens.dim() == 1, f"tokens must be [k], got {tuple(self.tokens.shape)}"
        if self.q is not None:
            assert self.q.dim() == 2 and self.q.shape[0] == k, f"q {tuple(self.q.shape)} vs {k} tokens"
        if self.head_probs is not None:
            assert self.head_probs.shape == (k,), f"head_probs {tuple(self.head_probs.shape)} vs {k} tokens"

    def __len__(self) -> int:
        return self.tokens.shape[0]


def warp_logits(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Probabilities after temperature scaling, then top-k, then top-p (nucleus) truncation.

    logits: [..., V] -> probs [..., V] float32, each row summing to 1.
    temperature == 0 is greedy: a one-hot at the argmax (ties -> the lowest id).
    top_k <= 0 or >= V disables top-k; it keeps every id whose logit ties the k-th largest.
    top_p >= 1 disables top-p; otherwise it keeps the smallest prefix of the sorted distribution
    whose mass reaches ``top_p`` (always at least the most likely id).

    Example: logits log([0.5, 0.3, 0.2]), T = 1, top_p = 0.7 -> keeps 0.5 and 0.3 -> [0.625, 0.375, 0].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        idx = logits.argmax(-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(logits).scatter_(-1, idx, 1.0)
    logits = logits / temperature
    V = logits.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [..., V]
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely ids
        drop_sorted = mass_before >= top_p  # the first id always has mass_before = 0: kept
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One draw per row: probs [..., V] -> ids [...] long."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
