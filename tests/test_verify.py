"""Simulated verification: hand-made logits, a plain-loop reference, invariants, sampled vs expected."""

from __future__ import annotations

import math

import pytest
import torch

from vatspec.objective import verify
from vatspec.objective.verify import simulate_verification, target_to_draft

# Sampled vs expected: with S independent draws the mean accept of one position has standard
# deviation sqrt(a(1-a)/S) <= 0.5/sqrt(S); 5 sigma at S = 4000 is 0.04, so a correct sampler fails
# this check with probability ~1e-6 per position, and a wrong rule (e.g. p renormalised over the
# draft vocab, or ratio q/p) moves alpha by far more on the inputs below.
N_DRAWS = 4000
SAMPLED_TOL = 5 * 0.5 / math.sqrt(N_DRAWS)
EXACT = 1e-6  # float32 round-off on probabilities of O(1)


def logits_for(ids: list, V: int) -> torch.Tensor:
    """[..., k, V] logits whose argmax is ``ids`` (nested lists of token ids)."""
    t = torch.tensor(ids)
    out = torch.zeros(*t.shape, V)
    out.scatter_(-1, t.unsqueeze(-1), 5.0)
    return out


# ---------------------------------------------------------------------------------------------
# hand-computed greedy cases (V = 5, identity vocab)


def test_all_accepted():
    v = simulate_verification(logits_for([1, 2, 3], 5), logits_for([1, 2, 3], 5))
    assert v.accept.tolist() == [True, True, True]  # accepts 3
    assert v.first_reject.item() == 3  # none rejected: the number of valid positions
    assert v.alive.tolist() == [1.0, 1.0, 1.0]
    assert v.num_accepted.item() == 3


def test_first_position_rejected():
    v = simulate_verification(logits_for([0, 2, 3], 5), logits_for([1, 2, 3], 5))
    assert v.accept.tolist() == [False, True, True]  # accepts 0: later matches are thrown away
    assert v.first_reject.item() == 0
    assert v.alive.tolist() == [1.0, 0.0, 0.0]  # position 0 is always reached


def test_rejection_in_the_middle():
    v = simulate_verification(logits_for([1, 0, 3, 4], 5), logits_for([1, 2, 3, 4], 5))
    assert v.accept.tolist() == [True, False, True, True]  # accepts 1
    assert v.first_reject.item() == 1
    assert v.alive.tolist() == [1.0, 1.0, 0.0, 0.0]  # 1 exactly for j <= first_reject


def test_invalid_tail():
    valid = torch.tensor([True, True, False, False])
    v = simulate_verification(logits_for([1, 2, 3, 4], 5), logits_for([1, 2, 3, 4], 5), valid)
    assert v.accept.tolist() == [True, True, False, False]  # accepts 2 (all the valid ones)
    assert v.first_reject.item() == 2
    assert v.alive.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert v.valid is valid


def test_d2t_mapping():
    # draft ids 0 1 2 -> target ids 0 2 5 (V = 6); target ids 1 3 4 are outside the draft vocab
    d2t = torch.tensor([0, 1, 3])
    draft = logits_for([1, 2, 0, 1], 3)  # -> target 2 5 0 2
    target = logits_for([2, 5, 0, 3], 6)
    v = simulate_verification(draft, target, d2t=d2t)
    assert v.accept.tolist() == [True, True, True, False]  # accepts 3; target 3 can never be drafted
    assert v.first_reject.item() == 3
    assert v.draft_token.tolist() == [2, 5, 0, 2]
    assert target_to_draft(d2t, 6).tolist() == [0, -1, 1, -1, -1, 2]


def test_batched_leading_dims():
    # [B=2, T=1, k=2]: chain (0, 0) accepts 2, chain (1, 0) accepts 0
    draft = logits_for([[[1, 2]], [[0, 2]]], 4)
    target = logits_for([[[1, 2]], [[1, 2]]], 4)
    v = simulate_verification(draft, target)
    assert v.first_reject.tolist() == [[2], [0]]
    assert v.alive.shape == (2, 1, 2)


# ---------------------------------------------------------------------------------------------
# plain-loop references


def loop_greedy(draft, target, valid, d2t):
    """Walk each chain left to right the way a serving engine does."""
    Vd, V = len(draft[0][0]), len(target[0][0])
    to_tgt = [i + (d2t[i] if d2t else 0) for i in range(Vd)]
    accept, first, alive = [], [], []
    for dc, tc, vc in zip(draft, target, valid):
        a = []
        for dl, tl, ok in zip(dc, tc, vc):
            x = to_tgt[max(range(Vd), key=lambda i: dl[i])]
            y = max(range(V), key=lambda i: tl[i])
            a.append(bool(ok) and x == y)
        r = 0
        while r < len(a) and a[r]:
            r += 1
        accept.append(a)
        first.append(r)
        alive.append([1.0 if (ok and j <= r) else 0.0 for j, ok in enumerate(vc)])
    return accept, first, alive


def loop_expected(draft, target, valid, d2t, T):
    """alpha_j = sum over the draft vocab of min(p(mapped x), q(x)), p softmax over the full V."""
    alphas, alive = [], []
    for dc, tc, vc in zip(draft, target, valid):
        al, li, run = [], [], 1.0
        for dl, tl, ok in zip(dc, tc, vc):
            zq = sum(math.exp(x / T) for x in dl)
            zp = sum(math.exp(x / T) for x in tl)
            a = 0.0
            for i, x in enumerate(dl):
                t = i + (d2t[i] if d2t else 0)
                a += min(math.exp(x / T) / zq, math.exp(tl[t] / T) / zp)
            al.append(a if ok else 0.0)
            li.append(run if ok else 0.0)
            run *= a
        alphas.append(al)
        alive.append(li)
    return alphas, alive


def random_case(N=64, k=5, Vd=4, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    d2t = torch.tensor([0, 1, 1, 2])  # draft 0 1 2 3 -> target 0 2 3 5
    draft = torch.randn(N, k, Vd, generator=g)
    target = torch.randn(N, k, V, generator=g)
    # bias target toward in-vocab ids so both accepts and rejects are common
    target[..., [0, 2, 3, 5]] += 0.7
    lengths = torch.randint(0, k + 1, (N,), generator=g)
    valid = torch.arange(k) < lengths.unsqueeze(-1)
    return draft, target, valid, d2t


def test_greedy_matches_loop_reference():
    draft, target, valid, d2t = random_case()
    v = simulate_verification(draft, target, valid, d2t=d2t)
    accept, first, alive = loop_greedy(draft.tolist(), target.tolist(), valid.tolist(), d2t.tolist())
    assert v.accept.tolist() == accept
    assert v.first_reject.tolist() == first
    assert v.alive.tolist() == alive
    assert 0 < v.accept.sum() < valid.sum()  # the case exercises both outcomes


@pytest.mark.parametrize("T", [1.0, 0.7])
def test_expected_matches_loop_reference(T):
    draft, target, valid, d2t = random_case(seed=1)
    v = simulate_verification(draft, target, valid, mode="expected", temperature=T, d2t=d2t)
    alphas, alive = loop_expected(draft.tolist(), target.tolist(), valid.tolist(), d2t.tolist(), T)
    torch.testing.assert_close(v.accept, torch.tensor(alphas), atol=EXACT, rtol=0)
    torch.testing.assert_close(v.alive, torch.tensor(alive), atol=EXACT, rtol=0)
    assert v.first_reject is None and v.draft_token is None


# ---------------------------------------------------------------------------------------------
# invariants


@pytest.mark.parametrize("mode", ["greedy", "sampled", "expected"])
def test_alive_starts_at_one_and_never_increases(mode):
    draft, target, valid, d2t = random_case(seed=2)
    g = torch.Generator().manual_seed(0)
    v = simulate_verification(draft, target, valid, mode=mode, d2t=d2t, generator=g)
    has = valid[:, 0]
    assert (v.alive[has, 0] == 1).all()
    assert (v.alive[..., 1:] <= v.alive[..., :-1]).all()
    assert (v.alive[~valid] == 0).all() and (v.accept[~valid] == 0).all()
    if mode != "expected":
        j = torch.arange(valid.shape[-1])
        assert torch.equal(v.alive.bool(), valid & (j <= v.first_reject.unsqueeze(-1)))
        assert torch.equal(v.num_accepted, v.accept.long().cumprod(-1).sum(-1))


def test_outputs_carry_no_grad():
    draft, target, valid, d2t = random_case(seed=3)
    draft.requires_grad_(True)
    target.requires_grad_(True)
    for mode in ("greedy", "sampled", "expected"):
        v = simulate_verification(draft, target, valid, mode=mode, d2t=d2t)
        assert not v.accept.requires_grad and not v.alive.requires_grad


def test_strided_target_view_and_chunked_normaliser(monkeypatch):
    # target logits as a non-contiguous view (every other row of a bigger buffer, transposed back)
    draft, target, valid, d2t = random_case(N=16, seed=4)
    big = torch.randn(16, 2 * target.shape[1], target.shape[2])
    big[:, ::2] = target
    view = big[:, ::2]
    assert not view.is_contiguous()
    ref = simulate_verification(draft, target, valid, mode="expected", d2t=d2t)
    monkeypatch.setattr(verify, "_CHUNK_ELEMS", 7)  # forces the chunked logsumexp path
    got = simulate_verification(draft, view, valid, mode="expected", d2t=d2t)
    torch.testing.assert_close(got.accept, ref.accept, atol=EXACT, rtol=0)
    torch.testing.assert_close(verify.log_normaliser(view), torch.logsumexp(target, -1))


def test_sampled_mean_matches_expected():
    # one small batch repeated over N_DRAWS draws via expand (no copy); also checks alive's mean
    draft, target, valid, d2t = random_case(N=4, k=3, seed=5)
    v_exp = simulate_verification(draft, target, valid, mode="expected", temperature=0.8, d2t=d2t)
    S = N_DRAWS
    g = torch.Generator().manual_seed(123)
    v = simulate_verification(
        draft.expand(S, *draft.shape),
        target.expand(S, *target.shape),
        valid.expand(S, *valid.shape),
        mode="sampled",
        temperature=0.8,
        d2t=d2t,
        generator=g,
    )
    torch.testing.assert_close(v.accept.float().mean(0), v_exp.accept, atol=SAMPLED_TOL, rtol=0)
    torch.testing.assert_close(v.alive.mean(0), v_exp.alive, atol=SAMPLED_TOL, rtol=0)
    # num_accepted lies in 0..k (k = 3), so its standard deviation is up to k times a bit's: 3x the tolerance
    mean_accepted = v.num_accepted.double().mean(0).float()
    torch.testing.assert_close(mean_accepted, v_exp.num_accepted, atol=3 * SAMPLED_TOL, rtol=0)


def test_sampled_drafts_in_vocab_only():
    draft, target, valid, d2t = random_case(seed=6)
    v = simulate_verification(draft, target, valid, mode="sampled", d2t=d2t)
    assert set(v.draft_token.unique().tolist()) <= {0, 2, 3, 5}


def test_sampled_generator_must_live_on_the_logits_device():
    # "meta" stands in for an accelerator on a CPU-only machine: on CUDA a CPU generator fails deep
    # inside torch.multinomial; here the mismatch is refused up front, naming both devices
    d, t = torch.randn(2, 3, 5, device="meta"), torch.randn(2, 3, 5, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu.*logits are on meta"):
        simulate_verification(d, t, mode="sampled", generator=torch.Generator())
    simulate_verification(d, t, mode="greedy", generator=torch.Generator())  # no draws: any generator


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampled_verification_on_cuda_with_the_training_generator():
    from vatspec.train import step_generator

    draft, target, valid, d2t = random_case(seed=7)
    dev = torch.device("cuda")
    args = [x.to(dev) for x in (draft, target, valid)]
    kw = {"mode": "sampled", "d2t": d2t.to(dev)}
    v = simulate_verification(*args, **kw, generator=step_generator(0, 1, 0, 0, device=dev))
    assert v.accept.device.type == "cuda" and v.draft_token.device.type == "cuda"
    again = simulate_verification(*args, **kw, generator=step_generator(0, 1, 0, 0, device=dev))
    assert torch.equal(v.draft_token, again.draft_token) and torch.equal(v.accept, again.accept)  # seeded replay


def test_bad_inputs_name_the_problem():
    d, t = logits_for([1, 2], 4), logits_for([1, 2], 4)
    with pytest.raises(ValueError, match="prefix"):
        simulate_verification(d, t, torch.tensor([False, True]))
    with pytest.raises(ValueError, match="mode"):
        simulate_verification(d, t, mode="beam")
    with pytest.raises(ValueError, match="temperature"):
        simulate_verification(d, t, mode="sampled", temperature=0.0)
    with pytest.raises(ValueError, match="d2t"):
        simulate_verification(d, logits_for([1, 2], 6))
    with pytest.raises(ValueError, match="target_logits"):
        simulate_verification(d, logits_for([1, 2, 3], 4))
