import numpy as np
import pytest

from vatspec.calibrate import (
    acceptance_survival,
    bootstrap_survival,
    calibrate,
    choose_k,
    expected_speedup,
    measure_round_cost,
)
from vatspec.decode import Round, generate

from .test_decode import PROMPTS, real_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def test_worked_example():
    # S = [1, 0.5, 0.25], cost = [1, 1.2, 1.5]: tokens 1, 1.5, 1.75; speedups 1, 1.25, 1.1667
    tokens, speedup = expected_speedup([1.0, 0.5, 0.25], [1.0, 1.2, 1.5])
    assert tokens == pytest.approx([1.0, 1.5, 1.75])
    assert speedup == pytest.approx([1.0, 1.25, 1.75 / 1.5])
    assert choose_k([1.0, 0.5, 0.25], [1.0, 1.2, 1.5]) == 1
    # drafts that are never accepted: the AR baseline (k = 0) would win; the choice stays at k = 1
    assert choose_k([1.0, 0.0, 0.0], [1.0, 1.1, 1.2], k_min=0) == 0
    assert choose_k([1.0, 0.0, 0.0], [1.0, 1.1, 1.2]) == 1
    # free drafting and certain acceptance: the longest k wins
    assert choose_k([1.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == 2


def test_a_longer_draft_needs_a_confident_lead():
    # a demo run's calibration: 101 rounds at k_max = 3, 62 rejected at slot 0, 29 accepted 1, 1 accepted 2, 9 all
    rounds = [Round(3, a, a + 1, 0, 0) for a, n in ((0, 62), (1, 29), (2, 1), (3, 9)) for _ in range(n)]
    cost = [1.0, 1.17, 1.41, 1.32]  # cost(2) > cost(3), as measured
    survival = acceptance_survival(rounds, 3)
    _, speedup = expected_speedup(survival, cost)
    assert speedup[3] > speedup[1] > speedup[2]  # 1.192 > 1.185: k = 3 leads by 0.007
    assert choose_k(survival, cost) == 3  # the point estimate follows the lead
    resampled = bootstrap_survival(rounds, 3, resamples=2000)
    assert resampled.shape == (2000, 4) and np.all(resampled[:, 0] == 1)
    assert resampled.mean(0) == pytest.approx(survival, abs=0.01)
    assert choose_k(survival, cost, resampled=resampled) == 1  # a coin flip: stay at the shorter draft
    # at confidence 0.5 the bootstrap agrees with the point estimate's ordering
    assert choose_k(survival, cost, resampled=resampled, confidence=0.5) == 3
    # a clear lead moves up: every round accepts all three drafts
    full = [Round(3, 3, 4, 0, 0)] * 20
    assert choose_k(acceptance_survival(full, 3), cost, resampled=bootstrap_survival(full, 3)) == 3


def test_survival_counts_only_rounds_that_drafted_that_far():
    rounds = [Round(3, 0, 1, 0, 0), Round(3, 2, 3, 0, 0), Round(3, 3, 4, 0, 0), Round(1, 1, 2, 0, 0)]
    # j = 1: 4 rounds drafted >= 1, accepted >= 1 in 3; j = 2, 3: 3 rounds drafted that far, 2 and 1 accepted
    assert acceptance_survival(rounds, 3) == pytest.approx([1.0, 3 / 4, 2 / 3, 1 / 3])


def test_calibrate_reads_the_decodes_acceptance_and_prices_every_k():
    target = tiny_target()
    drafter = real_drafter(kind="eagle3", draft_vocab_size=48, ttt_steps=3)(target, None)
    cal = calibrate(target, drafter, PROMPTS, max_new_tokens=16, reps=2)
    # the survival curve, recounted by a plain loop over the same decodes
    rounds = [r for p in PROMPTS for r in generate(target, p, drafter, k=3, max_new_tokens=16).rounds]
    for j in range(1, 4):
        seen = [r.accepted >= j for r in rounds if r.drafted >= j]
        assert cal.survival[j] == pytest.approx(sum(seen) / len(seen))
    assert cal.rounds == len(rounds)
    assert len(cal.cost) == 4 and cal.cost[0] == 1.0 and all(c > 0 for c in cal.cost)
    assert cal.k == choose_k(cal.survival, cal.cost, resampled=bootstrap_survival(rounds, 3))
    # no longer k beats the chosen one with confidence; the chosen k never beats itself
    assert cal.faster[cal.k] == 0.0 and all(f < cal.confidence for f in cal.faster[cal.k + 1:])
    assert cal.k >= 1 and cal.confidence == 0.95
    assert cal.ar_wins == (cal.speedup[cal.k] < 1.0) and cal.to_dict()["ar_wins"] == cal.ar_wins


def test_round_cost_prices_every_k_of_a_dflash_block_and_refuses_no_prompts():
    target = tiny_target()
    drafter = real_drafter(kind="dflash", num_layers=1, block_size=5, mask_token_id=63)(target, None)
    cost, ar_s = measure_round_cost(target, drafter, PROMPTS[0], 4, reps=1)
    assert len(cost) == 5 and cost[0] == 1.0 and ar_s > 0 and all(c > 0 for c in cost)
    with pytest.raises(ValueError, match="no calibration prompts"):
        calibrate(target, drafter, [])
