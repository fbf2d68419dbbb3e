"""warp_logits (temperature, top-k, top-p) and the Proposal container."""

from __future__ import annotations

import math

import pytest
import torch

from vatspec.drafters.sampling import Proposal, sample, warp_logits

ATOL = 1e-6  # float32 softmax of small vectors


def reference_warp(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Python loop reference: scale, keep top-k (ties kept), keep the nucleus, renormalise."""
    V = len(logits)
    z = [x / temperature for x in logits]
    if 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = [math.exp(x - m) for x in z]
    p = [x / sum(e) for x in e]
    if top_p < 1.0:
        order = sorted(range(V), key=lambda i: -p[i])
        keep, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += p[i]
        p = [p[i] if i in keep else 0.0 for i in range(V)]
        s = sum(p)
        p = [x / s for x in p]
    return p


def test_greedy_is_one_hot_at_argmax():
    probs = warp_logits(torch.tensor([[0.1, 2.0, -1.0], [3.0, 3.0, 0.0]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]  # tie -> lowest id


def test_top_p_hand_example():
    probs = warp_logits(torch.tensor([0.5, 0.3, 0.2]).log(), 1.0, top_p=0.7)
    # 0.5 < 0.7 so 0.3 is needed too; 0.8 >= 0.7 so 0.2 is dropped
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0]), atol=ATOL)


def test_top_k_hand_example():
    probs = warp_logits(torch.tensor([1.0, 3.0, 2.0, 0.0]), 1.0, top_k=2)
    e = torch.tensor([math.e**3, math.e**2])
    assert torch.allclose(probs, torch.tensor([0.0, e[0] / e.sum(), e[1] / e.sum(), 0.0]), atol=ATOL)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 8, 0.6)])
def test_matches_loop_reference(temperature: float, top_k: int, top_p: float):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 20, generator=g) * 2
    got = warp_logits(logits, temperature, top_k, top_p)
    for row, want in zip(got, [reference_warp(r.tolist(), temperature, top_k, top_p) for r in logits]):
        assert torch.allclose(row, torch.tensor(want), atol=ATOL)
    assert torch.allclose(got.sum(-1), torch.ones(4), atol=ATOL)


def test_sample_is_reproducible_and_in_support():
    probs = warp_logits(torch.randn(3, 50, generator=torch.Generator().manual_seed(1)), 1.0, top_k=3)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and a.shape == (3,)
    assert (probs.gather(-1, a[:, None]) > 0).all()


def test_bad_arguments_fail():
    with pytest.raises(ValueError, match="temperature"):
        warp_logits(torch.zeros(3), -1.0)
    with pytest.raises(ValueError, match="top_p"):
        warp_logits(torch.zeros(3), 1.0, top_p=0.0)


def test_proposal_checks_shapes():
    p = Proposal(tokens=torch.tensor([4, 5]), q=torch.zeros(2, 9), head_probs=torch.ones(2))
    assert len(p) == 2
    with pytest.raises(AssertionError):
        Proposal(tokens=torch.tensor([4, 5]), q=torch.zeros(3, 9))
