"""The one side-by-side timer of the benches in perf/: two or more code paths timed in interleaved rounds.

Every round runs each path once, and the order rotates by one path a round (two paths: a b, b a, a b, ...),
so a machine that slows down, warms up or is busy with other work weighs on every path alike, and no path
always runs right after the same other one. The first ``warmup`` rounds run but are not recorded. Each path's
seconds give its min and median, and ``ratio`` / ``lines`` the ratios to a base path.

    t = SideBySide(["plain", "chunked"], repeats=8, warmup=1)
    t.run({"plain": lambda r: step(0), "chunked": lambda r: step(256)})   # r: the round, 0-based
    t.report(base="plain")          # each path's median and min; chunked / plain, by median and by min

A bench whose rounds need more than one call per path (a batch shared by the paths of a round, a part of a
path timed apart) drives the rounds itself:

    for r, order in t.rounds():
        batch = next(batches)
        for path in order:
            with t.time(path):
                ...
                with t.time(f"{path} drafter"):   # any other key: a part, recorded beside the paths
                    ...

A bench runs from its folder (``python perf/bench_x.py``), which puts this file on ``sys.path``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager


class SideBySide:
    """Seconds of ``paths`` (their names) over ``repeats`` recorded rounds after ``warmup`` unrecorded ones.
    ``sync``: called before and after each timed block (``torch.cuda.synchronize`` for GPU work)."""

    def __init__(self, paths: Sequence[str], *, repeats: int = 5, warmup: int = 1,
                 sync: Callable[[], object] | None = None):
        if len(set(paths)) != len(paths) or not paths:
            raise ValueError(f"paths: expected distinct names, got {list(paths)}")
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
        self.paths = list(paths)
        self.repeats, self.warmup, self.sync = repeats, warmup, sync
        self.seconds: dict[str, list[float]] = {p: [] for p in self.paths}
        self._recording = True  # a block timed outside rounds() is recorded

    def rounds(self) -> Iterator[tuple[int, list[str]]]:
        """``(round, order of the paths)`` for every round, the warm-up ones first."""
        n = len(self.paths)
        try:
            for r in range(self.warmup + self.repeats):
                self._recording = r >= self.warmup
                k = r % n
                yield r, self.paths[k:] + self.paths[:k]
        finally:
            self._recording = True

    @contextmanager
    def time(self, key: str):
        """Time the block under ``key`` (a path, or any other name: a part of one) when the round is recorded."""
        if self.sync:
            self.sync()
        t0 = time.perf_counter()
        yield
        if self.sync:
            self.sync()
        if self._recording:
            self.seconds.setdefault(key, []).append(time.perf_counter() - t0)

    def run(self, fns: Mapping[str, Callable[[int], object]]) -> dict[str, object]:
        """Each path's ``fns[path](round)`` once a round, timed whole; returns each path's last result."""
        out: dict[str, object] = {}
        for r, order in self.rounds():
            for path in order:
                with self.time(path):
                    out[path] = fns[path](r)
        return out

    def median(self, key: str) -> float:
        return statistics.median(self.seconds[key])

    def min(self, key: str) -> float:
        return min(self.seconds[key])

    def ratio(self, a: str, b: str, stat: str = "median") -> float:
        """``a``'s seconds over ``b``'s (``stat``: "median" or "min"); below 1: ``a`` is faster."""
        f = self.median if stat == "median" else self.min
        return f(a) / f(b)

    def lines(self, base: str | None = None, keys: Sequence[str] | None = None) -> list[str]:
        """One line per key (default: the paths): median and min seconds over the recorded rounds, and for each
        other key its ratio to ``base`` (default: the first path), by median and by min."""
        keys = list(keys or self.paths)
        base = base or self.paths[0]
        width = max(map(len, keys))
        n = len(self.seconds[base])
        out = [f"{k:<{width}}  median {self.median(k):8.3f} s  min {self.min(k):8.3f} s" for k in keys]
        out += [f"ratio {k} / {base}: {self.ratio(k, base):.3f} (median), {self.ratio(k, base, 'min'):.3f} (min), "
                f"{n} interleaved rounds" for k in keys if k != base]
        return out

    def report(self, base: str | None = None, keys: Sequence[str] | None = None, indent: str = "  ") -> None:
        print("\n".join(indent + line for line in self.lines(base, keys)), flush=True)

    def to_dict(self) -> dict:
        """Every key's seconds, median and min (for a bench's --json)."""
        return {k: {"seconds": v, "median": statistics.median(v), "min": min(v)} for k, v in self.seconds.items() if v}
