"""Paired comparisons with a bootstrap interval: is method A's tau really different from B's?

Two methods measured on the same units (held-out chains in training, prompts in decoding) are
compared unit by unit: resampling the units with replacement keeps each pair together, so the
noise both methods share (an easy prompt is easy for both) cancels in the difference.

    d = paired_difference(num_a, num_b, den_a, den_b)   # pooled ratios: sum(num) / sum(den)
    d.estimate, d.low, d.high                           # A - B and its 95% percentile interval
    d.sentence("decode tau", "VAT", "EAGLE-3")          # the verdict in words

With ``den_*`` left out the statistic is the plain mean (e.g. per-chain accepted lengths).
Worked example: per-prompt taus A = [2, 3, 4], B = [1, 3, 3] -> estimate = mean(A) - mean(B) = 2/3;
a resample that draws prompts (0, 0, 2) gives (2 + 2 + 4)/3 - (1 + 1 + 3)/3 = 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 10_000  # percentile-interval error at 95% is ~0.2% of the interval width at this count


@dataclass(frozen=True)
class Difference:
    """``estimate`` = statistic(A) - statistic(B) on all units; [low, high] its bootstrap interval."""

    estimate: float
    low: float
    high: float
    level: float  # e.g. 0.95
    units: int  # paired units (chains, prompts)
    base: float  # statistic(B), for the relative change

    @property
    def contains_zero(self) -> bool:
        return self.low <= 0.0 <= self.high

    @property
    def relative(self) -> float:
        """estimate / statistic(B), in percent."""
        return 100.0 * self.estimate / self.base if self.base else float("nan")

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level,
                "units": self.units, "base": self.base, "relative_pct": self.relative,
                "contains_zero": self.contains_zero}

    def cell(self) -> str:
        """Compact table cell: ``+0.031 [-0.010, +0.072]``."""
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"

    def sentence(self, what: str, a: str, b: str, unit: str = "units") -> str:
        """The comparison in words; says plainly when the interval contains 0."""
        head = (f"{what}: {a} - {b} = {self.estimate:+.3f} ({self.relative:+.1f}%), "
                f"{round(100 * self.level)}% interval [{self.low:+.3f}, {self.high:+.3f}] over {self.units} {unit}")
        if self.contains_zero:
            return head + f": the interval contains 0, so this run shows no difference between {a} and {b}."
        better = a if self.estimate > 0 else b
        return head + f": the interval excludes 0, so {better} is ahead in this run."


def paired_difference(
    num_a: Sequence[float],
    num_b: Sequence[float],
    den_a: Sequence[float] | None = None,
    den_b: Sequence[float] | None = None,
    *,
    level: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Difference:
    """Paired bootstrap of statistic(A) - statistic(B) over units.

    num_a, num_b: [n] per-unit values of A and B (unit i of A is paired with unit i of B).
    den_a, den_b: [n] per-unit denominators; given, the statistic is the pooled ratio
                  sum(num) / sum(den) (e.g. committed tokens / verify rounds per prompt), else the mean.
    """
    xa, xb = np.asarray(num_a, dtype=np.float64), np.asarray(num_b, dtype=np.float64)
    ratio = den_a is not None or den_b is not None
    if ratio and (den_a is None or den_b is None):
        raise ValueError("paired_difference: give both den_a and den_b, or neither")
    da = np.asarray(den_a, dtype=np.float64) if ratio else np.ones_like(xa)
    db = np.asarray(den_b, dtype=np.float64) if ratio else np.ones_like(xb)
    n = xa.shape[0]
    if xa.ndim != 1 or any(v.shape != (n,) for v in (xb, da, db)):
        raise ValueError(f"paired_difference: every input must be [n] with the same n, got "
                         f"{[v.shape for v in (xa, xb, da, db)]}")
    if n == 0:
        raise ValueError("paired_difference: no units to compare")
    if not 0.0 < level < 1.0:
        raise ValueError(f"paired_difference: level must be in (0, 1), got {level}")

    def stat(idx: np.ndarray) -> np.ndarray:  # idx [R, n] -> [R] differences
        return xa[idx].sum(-1) / da[idx].sum(-1) - xb[idx].sum(-1) / db[idx].sum(-1)

    base = float(xb.sum() / db.sum())
    estimate = float(xa.sum() / da.sum()) - base
    rng = np.random.default_rng(seed)
    diffs = np.concatenate([stat(rng.integers(0, n, size=(min(1000, resamples - r), n)))
                            for r in range(0, resamples, 1000)])
    tail = (1.0 - level) / 2
    low, high = np.quantile(diffs, [tail, 1.0 - tail])
    return Difference(estimate, float(low), float(high), level, n, base)


# two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); above 30 the normal's 1.96 is
# within 2% of t's
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def across_seeds(estimates: Sequence[float], bases: Sequence[float] | None = None) -> Difference:
    """The mean of per-seed differences (A - B, one per independent training seed) with a 95%
    Student-t interval over seeds: the seed is the unit of replication, so the interval holds what
    a rerun with a new seed could give. With 3 seeds the interval is mean +- 4.303 * s / sqrt(3).

    Worked example: per-seed differences [0.02, 0.04, 0.06] -> mean 0.04, s = 0.02,
    half-width 4.303 * 0.02 / sqrt(3) = 0.0497 -> [-0.0097, +0.0897]: contains 0.
    ``bases`` (statistic(B) per seed) give the relative change; else it is undefined (nan)."""
    x = np.asarray(estimates, dtype=np.float64)
    if x.ndim != 1 or x.shape[0] < 2:
        raise ValueError(f"across_seeds: needs >= 2 per-seed estimates, got {x.shape}")
    n = x.shape[0]
    mean = float(x.mean())
    half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * float(x.std(ddof=1)) / np.sqrt(n)
    base = float(np.mean(bases)) if bases is not None else float("nan")
    return Difference(mean, mean - half, mean + half, 0.95, n, base)
