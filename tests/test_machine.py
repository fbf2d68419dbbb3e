"""``vatspec.eval.machine.OtherLoad``: the cores other work took while a measurement ran, from the kernel's counters."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from vatspec.eval.machine import OtherLoad, _busy_seconds

SPIN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end:\n    pass\n"


def _spin_here(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(_busy_seconds() is None, reason="no /proc/stat (not Linux)")
def test_other_load_counts_other_processes_not_this_one():
    # this process spinning: its own CPU time is not "other work"
    with OtherLoad() as own:
        _spin_here(0.6)
    # another process spinning for the whole window: about one core of other work, on top of what own saw
    p = subprocess.Popen([sys.executable, "-c", SPIN.format(s=2.0)])
    try:
        time.sleep(0.4)  # past its start-up
        with OtherLoad() as other:
            time.sleep(0.8)
    finally:
        p.wait()
    assert own.cores is not None and other.cores is not None and own.cores >= 0.0
    assert other.cores > own.cores + 0.6, (own.cores, other.cores)  # 10 ms ticks over 0.8 s: ~1 core, +-0.1
