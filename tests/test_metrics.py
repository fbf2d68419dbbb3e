"""Chain metrics on hand-made chains, and aggregation over batches."""

from __future__ import annotations

import math

import pytest
import torch

from vatspec.drafters.base import DraftOutput
from vatspec.objective.metrics import MetricAccumulator, chain_metrics
from vatspec.objective.verify import simulate_verification

EXACT = 1e-9  # ratios of small integer counts


def logits_for(ids: list, V: int) -> torch.Tensor:
    t = torch.tensor(ids)
    out = torch.zeros(*t.shape, V)
    out.scatter_(-1, t.unsqueeze(-1), 5.0)
    return out


def make(draft_ids, target_ids, valid=None, V=5):
    d, t = logits_for(draft_ids, V), logits_for(target_ids, V)
    valid = torch.ones(d.shape[:-1], dtype=torch.bool) if valid is None else torch.tensor(valid)
    out = DraftOutput(logits=d, hidden=torch.zeros(*d.shape[:-1], 1), target_logits=t, valid=valid)
    return out, simulate_verification(d, t, valid)


def test_tau_sim_and_conditional_accuracy_hand():
    # chain a: match = 1 1 0; chain b: match = 1 0 1
    out, v = make([[1, 2, 0], [1, 0, 3]], [[1, 2, 3], [1, 2, 3]])
    m = chain_metrics(out, v)
    assert m["acc"] == pytest.approx([1.0, 0.5, 0.5])
    assert m["cond_acc"] == pytest.approx([1.0, 0.5, 0.0])  # step 2: only chain a reaches it, misses
    assert m["tau_sim"] == pytest.approx(1 + 1 + 0.5 + 0.0)  # 2.5
    assert m["mean_first_reject"] == pytest.approx(1.5)  # accepts 2 and 1
    assert m["tokens_per_step"] == pytest.approx(2.5)
    assert m["accept_hist"] == [0, 1, 1, 0]
    assert m["post_reject_match"] == pytest.approx(1 / 1)  # chain b step 2 matches after rejection at 1
    assert m["acc_mean"] == pytest.approx(4 / 6)
    assert m.chain_accepted.tolist() == [2, 1]  # per chain, for paired comparisons


def test_chain_accepted_skips_chains_with_no_valid_position():
    # chain b is empty; chain c's only valid position misses
    out, v = make([[1, 2, 3], [1, 2, 3], [0, 2, 3]], [[1, 2, 0]] * 3,
                  [[True] * 3, [False] * 3, [True, False, False]])
    assert chain_metrics(out, v).chain_accepted.tolist() == [2, 0]


def test_invalid_positions_are_not_counted():
    # chain b has only 1 valid position (it matches): accepts 1, nothing after it
    out, v = make([[1, 0, 3], [1, 0, 0]], [[1, 2, 3], [1, 2, 3]], [[True] * 3, [True, False, False]])
    m = chain_metrics(out, v)
    assert m["acc"] == pytest.approx([1.0, 0.0, 1.0])
    assert m["cond_acc"][0] == 1.0 and m["cond_acc"][1] == 0.0 and math.isnan(m["cond_acc"][2])
    assert m["tau_sim"] == pytest.approx(2.0)
    assert m["positions"] == 4 and m["chains"] == 2
    assert m["post_reject_match"] == pytest.approx(1.0)  # chain a step 2


def test_head_accuracy_and_first_reject_error_hand():
    # true alive: chain a (reject at 1) = 1 1 0 0; chain b (no reject) = 1 1 1 1
    out, v = make([[1, 0, 3, 4], [1, 2, 3, 4]], [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert v.alive.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    # head says alive = 1 1 1 0 for a (one wrong, first failure 3 vs 2) and 1 0 1 1 for b
    # (one wrong, first failure 1 vs 4)
    head = torch.tensor([[4.0, 4.0, 4.0, -4.0], [4.0, -4.0, 4.0, 4.0]])
    m = chain_metrics(out, v, head)
    assert m["head_acc"] == pytest.approx(6 / 8)
    assert m["head_first_reject_mae"] == pytest.approx((1 + 3) / 2)
    # a stricter threshold flips nothing here (sigmoid(4) = 0.982)
    assert chain_metrics(out, v, head, head_threshold=0.6)["head_acc"] == pytest.approx(6 / 8)


def test_d2t_maps_draft_argmax():
    # draft ids 0 1 2 -> target 0 2 5
    d2t = torch.tensor([0, 1, 3])
    d, t = logits_for([[1, 2]], 3), logits_for([[2, 3]], 6)
    valid = torch.ones(1, 2, dtype=torch.bool)
    out = DraftOutput(logits=d, hidden=torch.zeros(1, 2, 1), target_logits=t, valid=valid)
    m = chain_metrics(out, simulate_verification(d, t, valid, d2t=d2t), d2t=d2t)
    assert m["acc"] == pytest.approx([1.0, 0.0])  # target 3 is outside the draft vocab


def random_batch(N, k=6, V=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    d, t = torch.randn(N, k, V, generator=g), torch.randn(N, k, V, generator=g)
    t[..., 0] += 2.0  # both favour token 0, so chains often survive several steps
    d[..., 0] += 2.0
    lengths = torch.randint(0, k + 1, (N,), generator=g)
    valid = torch.arange(k) < lengths.unsqueeze(-1)
    out = DraftOutput(logits=d, hidden=torch.zeros(N, k, 1), target_logits=t, valid=valid)
    return out, torch.randn(N, k, generator=g)


def test_accumulator_over_batches_equals_one_big_batch():
    (a, ha), (b, hb) = random_batch(30, seed=1), random_batch(50, seed=2)
    acc = MetricAccumulator()
    for out, h in ((a, ha), (b, hb)):
        acc.add(out, simulate_verification(out.logits, out.target_logits, out.valid), h)
    cat = lambda x, y: torch.cat([x, y])  # noqa: E731
    big = DraftOutput(
        logits=cat(a.logits, b.logits),
        hidden=cat(a.hidden, b.hidden),
        target_logits=cat(a.target_logits, b.target_logits),
        valid=cat(a.valid, b.valid),
    )
    whole = chain_metrics(big, simulate_verification(big.logits, big.target_logits, big.valid), cat(ha, hb))
    got = acc.compute()
    assert acc.batches == 2 and set(got) == set(whole)
    for name in whole:
        assert got[name] == pytest.approx(whole[name], abs=EXACT, nan_ok=True), name
    # the trainer's way: per-step chain_metrics results, added as they come
    acc2 = MetricAccumulator()
    for out, h in ((a, ha), (b, hb)):
        acc2.add(chain_metrics(out, simulate_verification(out.logits, out.target_logits, out.valid), h))
    again = acc2.summary()
    for name in got:
        assert again[name] == pytest.approx(got[name], abs=EXACT, nan_ok=True), name


def test_tau_sim_equals_mean_tokens_per_step_when_chains_are_full():
    out, _ = random_batch(200, seed=3)
    out.valid[:] = True  # every chain full length: the conditional product telescopes
    m = chain_metrics(out, simulate_verification(out.logits, out.target_logits, out.valid))
    assert m["tau_sim"] == pytest.approx(m["tokens_per_step"], abs=1e-9)
    assert sum(m["accept_hist"]) == 200


FP32 = 1e-6  # alpha from a float32 softmax: round-off of a few ulps on numbers of order 1


def test_expected_mode_metrics_hand():
    # V = 2, the target is sure of token 0 (p = (1, ~1e-13)); the draft puts q(0) = a on it, so
    # alpha = sum min(p, q) = a. Draft argmax is token 0 iff a > 0.5 (the greedy match).
    # chain a: a = 0.6 0.8 0.25, all valid:  alive = 1 0.6 0.48 -> E[accepted] = 0.6 + 0.48 + 0.12 = 1.2
    #          greedy match = 1 1 0 -> first mismatch 2, nothing valid after it
    # chain b: a = 0.4 0.9 (0.9), 2 valid:    alive = 1 0.4 -> E[accepted] = 0.4 + 0.36 = 0.76
    #          greedy match = 0 1 -> first mismatch 0, position 1 comes after it and matches
    a = torch.tensor([[0.6, 0.8, 0.25], [0.4, 0.9, 0.9]])
    draft = torch.stack([a.log(), (1 - a).log()], -1)  # [2, 3, 2]
    target = torch.tensor([30.0, 0.0]).expand(2, 3, 2)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    out = DraftOutput(logits=draft, hidden=torch.zeros(2, 3, 1), target_logits=target, valid=valid)
    v = simulate_verification(draft, target, valid, mode="expected")
    m = chain_metrics(out, v)
    assert "accept_hist" not in m
    assert m["mean_first_reject"] == pytest.approx((1.2 + 0.76) / 2, abs=FP32)  # 0.98
    assert m["tokens_per_step"] == pytest.approx(1.98, abs=FP32)
    assert m["post_reject_match"] == 1.0  # 1 of 1 position after the greedy first mismatch matches
    assert m["acc"] == pytest.approx([1 / 2, 2 / 2, 0 / 1])
    assert m["tau_sim"] == pytest.approx(1 + 0.5 + 0.5 * 1 + 0.5 * 1 * 0)  # cond_acc = 1/2, 1/1, 0/1


def test_expected_mode_metrics_use_the_greedy_first_mismatch():
    out, head = random_batch(40, seed=4)
    v = simulate_verification(out.logits, out.target_logits, out.valid, mode="expected")
    m = chain_metrics(out, v, head)
    g = chain_metrics(out, simulate_verification(out.logits, out.target_logits, out.valid))
    assert "accept_hist" not in m
    assert m["post_reject_match"] == pytest.approx(g["post_reject_match"], nan_ok=True)
    # mean first rejection is the mean over chains of sum_j prod_{i<=j} alpha_i, by a plain loop
    total, chains = 0.0, 0
    for alpha, ok in zip(v.accept.tolist(), out.valid.tolist()):
        if not any(ok):
            continue
        run, chains = 1.0, chains + 1
        for x, o in zip(alpha, ok):
            if not o:
                break
            run *= x
            total += run
    assert m["mean_first_reject"] == pytest.approx(total / chains, abs=FP32)


def test_accumulator_rejects_mixed_batches():
    out, head = random_batch(4)
    acc = MetricAccumulator()
    acc.add(out, simulate_verification(out.logits, out.target_logits, out.valid), head)
    with pytest.raises(ValueError, match="disagree"):
        acc.add(out, simulate_verification(out.logits, out.target_logits, out.valid))
    with pytest.raises(TypeError, match="plain dict"):
        acc.add(dict(chain_metrics(out, simulate_verification(out.logits, out.target_logits, out.valid))))
    with pytest.raises(ValueError, match="before any add"):
        MetricAccumulator().compute()
