import numpy as np
import pytest

from vatspec.eval.stats import paired_difference


def test_hand_example_means_and_pooled_ratio():
    # per-prompt taus A = [2, 3, 4], B = [1, 3, 3]: mean difference 3 - 7/3 = 2/3
    d = paired_difference([2, 3, 4], [1, 3, 3], resamples=2000)
    assert d.estimate == pytest.approx(2 / 3)
    assert d.base == pytest.approx(7 / 3)
    assert d.relative == pytest.approx(100 * (2 / 3) / (7 / 3))
    assert d.low <= d.estimate <= d.high
    # pooled ratio: A commits 10 + 20 tokens in 5 + 5 rounds (3.0), B 9 + 9 in 6 + 6 (1.5)
    r = paired_difference([10, 20], [9, 9], [5, 5], [6, 6], resamples=2000)
    assert r.estimate == pytest.approx(1.5)


def test_identical_methods_give_a_zero_interval():
    x = np.random.default_rng(1).normal(size=50)
    d = paired_difference(x, x)
    assert (d.estimate, d.low, d.high) == (0.0, 0.0, 0.0)
    assert d.contains_zero
    assert "contains 0" in d.sentence("tau_sim", "VAT", "base", "chains")


def test_matches_a_plain_loop_bootstrap():
    rng = np.random.default_rng(7)
    a, b = rng.normal(1.0, 1.0, size=40), rng.normal(0.8, 1.0, size=40)
    d = paired_difference(a, b, resamples=3000, seed=5)
    draw = np.random.default_rng(5)
    diffs = []
    for _ in range(3000):  # one resample at a time, means written out
        idx = draw.integers(0, 40, size=40)
        diffs.append(sum(a[i] for i in idx) / 40 - sum(b[i] for i in idx) / 40)
    lo, hi = np.quantile(diffs, [0.025, 0.975])
    assert d.low == pytest.approx(lo, abs=1e-12) and d.high == pytest.approx(hi, abs=1e-12)


def test_shared_noise_cancels_and_the_width_is_the_standard_error():
    rng = np.random.default_rng(0)
    shared = rng.normal(0, 5.0, size=2000)  # prompt difficulty, common to both methods
    own = rng.normal(0, 1.0, size=2000)
    d = paired_difference(shared + 0.3 + own, shared)
    # the paired difference has sd 1: a 95% interval is about 2 * 1.96 / sqrt(2000) = 0.088 wide
    assert d.high - d.low == pytest.approx(2 * 1.96 / np.sqrt(2000), rel=0.15)
    assert not d.contains_zero and "excludes 0" in d.sentence("tau", "A", "B")


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same n"):
        paired_difference([1, 2], [1])
    with pytest.raises(ValueError, match="both den_a and den_b"):
        paired_difference([1], [1], [1])
    with pytest.raises(ValueError, match="no units"):
        paired_difference([], [])


def test_across_seeds_is_the_t_interval_of_the_per_seed_differences():
    from vatspec.eval.stats import across_seeds

    d = across_seeds([0.02, 0.04, 0.06], bases=[1.2, 1.2, 1.2])  # the docstring's worked example
    assert d.estimate == pytest.approx(0.04)
    assert d.high - d.estimate == pytest.approx(4.303 * 0.02 / np.sqrt(3))
    assert d.contains_zero and d.units == 3 and d.relative == pytest.approx(100 * 0.04 / 1.2)
    wide = across_seeds([0.05, 0.051, 0.049, 0.05, 0.052])  # tight agreement over 5 seeds: excludes 0
    assert not wide.contains_zero and "excludes 0" in wide.sentence("tau", "VAT", "base", "seeds")
    with pytest.raises(ValueError, match=">= 2"):
        across_seeds([0.1])
