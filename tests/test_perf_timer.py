"""perf/timer.py, the side-by-side timer every bench in perf/ uses: the rounds' order, warm-up, parts, ratios."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def timer():
    return load_script("timer")


def test_rounds_rotate_the_order_and_skip_warmup(timer):
    t = timer.SideBySide(["a", "b", "c"], repeats=3, warmup=1)
    calls = []
    t.run({p: (lambda r, p=p: calls.append((r, p))) for p in t.paths})
    assert calls == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                     (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]
    assert all(len(t.seconds[p]) == 3 for p in "abc")  # round 0 ran, unrecorded


def test_two_paths_alternate(timer):
    t = timer.SideBySide(["x", "y"], repeats=3, warmup=0)
    assert [order for _, order in t.rounds()] == [["x", "y"], ["y", "x"], ["x", "y"]]


def test_parts_stats_and_ratio(timer):
    t = timer.SideBySide(["slow", "fast"], repeats=3, warmup=1)
    for _, order in t.rounds():
        for p in order:
            with t.time(p), t.time(f"{p} part"):
                pass
    assert all(len(t.seconds[k]) == 3 for k in ("slow", "fast", "slow part", "fast part"))
    t.seconds.update(slow=[4.0, 2.0, 3.0], fast=[1.0, 2.0, 0.5])
    assert (t.median("slow"), t.min("slow"), t.median("fast"), t.min("fast")) == (3.0, 2.0, 1.0, 0.5)
    assert t.ratio("slow", "fast") == 3.0 and t.ratio("slow", "fast", "min") == 4.0
    lines = t.lines(base="fast")
    assert lines[-1] == "ratio slow / fast: 3.000 (median), 4.000 (min), 3 interleaved rounds"
    assert set(t.to_dict()) == {"slow", "fast", "slow part", "fast part"}


def test_sync_runs_around_each_block_and_bad_paths_fail(timer):
    syncs = []
    t = timer.SideBySide(["a"], repeats=1, warmup=0, sync=lambda: syncs.append(1))
    t.run({"a": lambda r: None})
    assert len(syncs) == 2
    with pytest.raises(ValueError):
        timer.SideBySide(["a", "a"])
    with pytest.raises(ValueError):
        timer.SideBySide(["a"], repeats=0)
