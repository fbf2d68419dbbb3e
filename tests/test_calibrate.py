import numpy as np
import pytest

from vatspec.eval.calibrate import (
    RoundTimings,
    acceptance_survival,
    bootstrap_survival,
    calibrate,
    choose_k,
    expected_speedup,
    fit_cost,
    measure_round_cost,
    nondecreasing,
)
from vatspec.eval.decode import Round, generate

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


def _isotonic_reference(x: list[float]) -> list[float]:
    """The least-squares non-decreasing fit by its min-max formula: fit[i] = max over j <= i of min over
    k >= i of mean(x[j..k]) (independent of the pool-adjacent-violators loop under test)."""
    n = len(x)
    return [max(min(sum(x[j:k + 1]) / (k + 1 - j) for k in range(i, n)) for j in range(i + 1)) for i in range(n)]


def test_nondecreasing_fit():
    # the worked example of the docstring: the burst-fooled costs of a busy run pool into one level
    assert nondecreasing([1.0, 0.68, 0.66, 1.3]) == pytest.approx([0.78, 0.78, 0.78, 1.3])
    fitted, measured = fit_cost([0.0, 0.93, 0.92, 1.3], [0.03, 0.06, 0.09])  # fit_cost's worked example
    assert fitted == pytest.approx([1.0, 1.0, 1.39]) and measured == pytest.approx([1.0, 0.98, 1.39])
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = list(rng.normal(size=int(rng.integers(1, 8))))
        assert nondecreasing(x) == pytest.approx(_isotonic_reference(x))


def _timings(verify: list[float], draft: list[float], reps: int = 15) -> RoundTimings:
    """A quiet machine: every repetition times the pieces at their true cost (AR step 10 ms)."""
    ar = np.full(reps, 0.010)
    return RoundTimings(ar, np.tile(np.array(verify) * 0.010, (reps, 1)), np.tile(np.array(draft) * 0.010, (reps, 1)))


TRUE_VERIFY, TRUE_DRAFT = [0.0, 1.02, 1.10, 1.18, 1.27], [0.03, 0.06, 0.09, 0.12]  # k_max = 3
TRUE_COST = [1.0, 1.16, 1.27, 1.39]  # draft[k] + verify[k + 1]


def test_round_cost_survives_a_burst_of_load():
    quiet = _timings(TRUE_VERIFY, TRUE_DRAFT)
    assert quiet.cost()[0] == pytest.approx(TRUE_COST) and quiet.cost()[1] == pytest.approx(TRUE_COST)
    # a long burst: repetitions 0-5 run 3x slower throughout; each piece is read against its own repetition's AR step
    busy = _timings(TRUE_VERIFY, TRUE_DRAFT)
    for a in (busy.ar, busy.verify, busy.draft):
        a[:6] *= 3
    assert busy.cost()[0] == pytest.approx(TRUE_COST)
    # short bursts that hit single pieces: 6 AR steps and 5 passes over 2 tokens (k = 1) of 15 repetitions; sums
    # or means would move every cost, medians of the per-repetition ratios do not
    short = _timings(TRUE_VERIFY, TRUE_DRAFT)
    short.ar[[1, 3, 5, 7, 9, 11]] *= 2.5
    short.verify[[0, 2, 4, 6, 8], 2] *= 2.5
    assert short.cost()[0] == pytest.approx(TRUE_COST)
    naive = short.verify.sum(0)[1:] / short.ar.sum()  # summed timings, the AR sum inflated: all look cheap
    assert naive[0] < 0.9


def test_round_cost_is_non_decreasing_in_k():
    # as timed on a busy run: k = 1 at 0.65, k = 2 at 0.66 AR steps, the passes over 2-4 tokens cheaper than the
    # 1-token AR step and than each other; fitted, nothing is cheaper than the AR step or than a shorter k
    timings = _timings([0.0, 0.65, 0.62, 0.60, 1.3], [0.03, 0.03, 0.06, 0.09])
    fitted, measured = timings.cost()
    assert measured == pytest.approx([1.0, 0.65, 0.66, 1.39])
    assert fitted == pytest.approx([1.0, 1.0, 1.0, 1.39])
    assert all(b >= a for a, b in zip(fitted, fitted[1:]))
    # on a quiet machine the pieces' own order is kept: k = 2 costs its second drafted token more than k = 1
    assert _timings(TRUE_VERIFY, TRUE_DRAFT).cost()[0] == pytest.approx(TRUE_COST)


def test_cost_resamples_carry_the_timing_noise():
    # two k whose true costs are equal within the timing noise: resampling the repetitions keeps k = 2 from
    # winning on a lead of acceptance it gets for free at equal cost
    rng = np.random.default_rng(0)
    t = _timings([0.0, 1.02, 1.10, 1.10], [0.03, 0.06, 0.06])
    t.verify[:] *= rng.normal(1.0, 0.05, size=t.verify.shape)
    rounds = [Round(2, a, a + 1, 0, 0) for a, n in ((0, 50), (1, 45), (2, 5)) for _ in range(n)]
    survival, resampled = acceptance_survival(rounds, 2), bootstrap_survival(rounds, 2)
    fitted = t.cost()[0]
    resampled_cost = t.resampled_cost(2000, 1)
    assert resampled_cost.shape == (2000, 3) and np.all(np.diff(resampled_cost, axis=1) >= 0)
    assert resampled_cost[:, 2].std() > 0
    assert choose_k(survival, fitted, resampled=resampled, resampled_cost=resampled_cost) == 1


BUSY = """
import random, time
random.seed({seed})
while True:  # bursts of 5-40 ms of full load with pauses of 5-40 ms: they hit single pieces of a repetition
    end = time.perf_counter() + random.uniform(0.005, 0.04)
    while time.perf_counter() < end:
        pass
    time.sleep(random.uniform(0.005, 0.04))
"""


@pytest.mark.slow
def test_a_load_burst_during_calibration_does_not_choose_a_slower_k():
    """Bursty load on every core while calibration times the round's pieces; the chosen k is then decoded beside
    k = 1 on a quiet machine, interleaved, and must not be slower beyond the noise. The draft is untrained
    (it accepts almost nothing), so k = 1 is the right choice and a longer k pays for nothing."""
    import os
    import subprocess
    import sys

    from vatspec.eval import bench, report
    target = tiny_target(vocab=256, layers=4, hidden=256, init=0.02)
    drafter = real_drafter(kind="eagle3", draft_vocab_size=128, ttt_steps=3)(target, None)
    prompts = [[3, 17, 42, 5, 9] * 8, [11, 2] * 10, [60, 61, 62, 63, 1, 7, 7, 30] * 4]
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(seed=i)]) for i in range(os.cpu_count() or 2)]
    try:
        cal = calibrate(target, drafter, prompts, max_new_tokens=24)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert all(b >= a for a, b in zip(cal.cost, cal.cost[1:])) and cal.cost[1] >= 1.0
    name = "untrained"
    results = bench.evaluate(target, {name: (drafter, None)}, {"held-out": [[5, 9, 11] * 6, [7, 30] * 8,
                                                                            [42, 1] * 9, [63, 2, 17] * 5]},
                             max_new_tokens=24, warmup=1, k={name: cal.k}, recheck=[name], hf_baseline=False,
                             progress=False)
    results["calibration"] = {name: cal.to_dict()}
    lines = "\n".join(report.recheck_lines(results, report.speedup_intervals(results)))
    assert "did not hold" not in lines, lines
    if cal.k == 1:
        assert "k = 1 was chosen; nothing to re-check" in lines
