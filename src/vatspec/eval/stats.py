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

import math
from collections.abc import Callable, Sequence
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
        """estimate / statistic(B), in percent; nan when statistic(B) is 0 or unknown (printed as "-")."""
        return 100.0 * self.estimate / self.base if self.base and math.isfinite(self.base) else float("nan")

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high, "level": self.level,
                "units": self.units, "base": self.base, "relative_pct": self.relative,
                "contains_zero": self.contains_zero}

    def cell(self) -> str:
        """Compact table cell: ``+0.031 [-0.010, +0.072]``."""
        return f"{self.estimate:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"

    def sentence(self, what: str, a: str, b: str, unit: str = "units") -> str:
        """The comparison in words; says plainly when the interval contains 0."""
        head = (f"{what}: {a} - {b} = {self.estimate:+.3f} ({pct(self.relative)}), "
                f"{round(100 * self.level)}% interval [{self.low:+.3f}, {self.high:+.3f}] over {self.units} {unit}")
        if self.contains_zero:
            return head + f": the interval contains 0, so this run shows no difference between {a} and {b}."
        better = a if self.estimate > 0 else b
        return head + f": the interval excludes 0, so {better} is ahead in this run."


def pct(x: float | None) -> str:
    """A percentage for a report: ``+1.5%``; "-" for one that does not exist (of a zero baseline: nan or inf)."""
    return f"{x:+.1f}%" if x is not None and math.isfinite(x) else "-"


@dataclass(frozen=True)
class Interval:
    """A statistic (e.g. a speedup) with its bootstrap interval, read against ``null`` (1.0 for a speedup: no
    change). ``low``/``high`` are nan when there were too few units to resample."""

    estimate: float
    low: float
    high: float
    level: float
    units: int
    null: float = 1.0

    @property
    def resolved(self) -> bool:
        return math.isfinite(self.low) and math.isfinite(self.high)

    @property
    def contains_null(self) -> bool:
        return not self.resolved or self.low <= self.null <= self.high

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low if self.resolved else None,
                "high": self.high if self.resolved else None, "level": self.level, "units": self.units,
                "null": self.null, "contains_null": self.contains_null}


def stratified_resamples(sizes: Sequence[int], resamples: int = RESAMPLES, seed: int = 0) -> list[np.ndarray]:
    """Per stratum (e.g. benchmark) of ``sizes[s]`` units, ``[resamples, sizes[s]]`` indices drawn with
    replacement inside it: every resample keeps each stratum's size, so a statistic averaged over strata (the
    paper's mean over benchmarks) is resampled as it is computed. The same seed gives the same indices, so
    statistics of several methods computed from them stay paired unit by unit."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(resamples, n)) for n in sizes]


def percentile_interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The ``level`` percentile interval of bootstrap ``samples`` ``[R]``."""
    tail = (1.0 - level) / 2
    low, high = np.quantile(samples, [tail, 1.0 - tail])
    return float(low), float(high)


def bootstrap_stratified(stat: Callable[[list[np.ndarray]], np.ndarray], sizes: Sequence[int], *,
                         level: float = 0.95, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high) of ``stat`` over strata of ``sizes`` units. ``stat(indices)`` takes per stratum
    ``[R, n_s]`` unit indices and returns ``[R]`` values; the estimate is ``stat`` on every unit once. An
    interval needs at least 2 units in every stratum (one unit resampled is itself): else low = high = nan."""
    estimate = float(stat([np.arange(n)[None] for n in sizes])[0])
    if min(sizes, default=0) < 2:
        return estimate, float("nan"), float("nan")
    return (estimate, *percentile_interval(stat(stratified_resamples(sizes, resamples, seed)), level))


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
    return Difference(estimate, *percentile_interval(diffs, level), level, n, base)


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
