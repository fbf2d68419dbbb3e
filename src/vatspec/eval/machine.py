"""How busy the machine was with other work while a measurement ran: the CPU time every other process (and,
on a virtual machine, the hypervisor's steal) took, in cores, from the kernel's counters.

    with OtherLoad() as load:
        run()
    load.cores    # 0.0 on a quiet machine; ~2.0 beside a job keeping two cores busy; None off Linux

A timing cannot tell a burst of load from its own noise when the burst is steady (every run of a prompt
slowed alike) or small (under the spread of quiet runs); the kernel's counters can: ``bench.evaluate``
measures a prompt again when other work took more than ``BUSY`` cores during one of its runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# other work above this many cores during a run marks it as measured on a busy machine: well above what a quiet
# machine's daemons take, well below a competing job's core or more (docs/LOG.md, "Figures moved out of code
# comments")
BUSY = 0.25
# the kernel counts CPU time in ticks of 10 ms, so two counters read around a run may round ~30 ms apart: over
# a window shorter than this (seconds) that is more than 0.06 of a core, and nothing is said
MIN_WINDOW_S = 0.5


def _busy_seconds() -> float | None:
    """CPU seconds every process of the machine (and the hypervisor's steal) took since boot, from /proc/stat's
    "cpu" line: user, nice, system, irq, softirq and steal; None where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system  # every thread of this process


class OtherLoad:
    """The cores other work took, on average, between ``__enter__`` and ``__exit__`` (``cores``; None where
    the kernel does not say, or over a window shorter than ``MIN_WINDOW_S``). Never negative: the two counters
    tick at 10 ms and may round apart."""

    cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._t0, self._busy0, self._own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc) -> bool:
        wall, busy = time.perf_counter() - self._t0, _busy_seconds()
        if busy is not None and self._busy0 is not None and wall >= MIN_WINDOW_S:
            others = (busy - self._busy0) - (_own_seconds() - self._own0)
            self.cores = max(0.0, others / wall)
        return False
