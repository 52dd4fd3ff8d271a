"""How much CPU other processes took while we measured something.

A throughput measured on a shared machine says little unless it comes with
the share of the CPUs that other processes used meanwhile. :class:`CpuMeter`
takes that from the machine's CPU time (``psutil.cpu_times``, every CPU)
less this process's and its descendants' (workers, the fork server): what is
left was spent by others, or stolen by the hypervisor. The demo prints it
next to its speed-up; the benchmarks record it for every section.

A descendant that exits during the measurement and is reaped by no
descendant of ours (its time then lands in nobody's ``children_*``) is
counted as another process's: measure while the workers are alive.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

__all__ = ["CpuLoad", "CpuMeter", "own_cpu_seconds"]

#: Machine CPU time fields that mean "busy" (idle and iowait do not); steal is apart.
_BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and its descendants, live ones and reaped ones."""
    me = psutil.Process()
    try:
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        procs = [me]
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _machine_cpu_seconds() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine since boot."""
    t = psutil.cpu_times()
    busy = sum(getattr(t, f, 0.0) for f in _BUSY_FIELDS)
    return busy, getattr(t, "steal", 0.0)


@dataclass(frozen=True)
class CpuLoad:
    """What the machine's CPUs did during one measurement."""

    wall_s: float
    #: CPUs of the machine (``os.cpu_count()``): the capacity the shares are of.
    cpus: int
    #: CPU seconds of this process and its descendants.
    own_cpu_s: float
    #: CPU seconds of every other process (steal included).
    other_cpu_s: float
    #: CPU seconds the hypervisor gave to other guests (0 where not reported).
    steal_cpu_s: float

    @property
    def capacity_s(self) -> float:
        return self.wall_s * self.cpus

    @property
    def other_share(self) -> float:
        """The share of all CPUs' time that other processes used (0 to 1)."""
        return min(1.0, self.other_cpu_s / self.capacity_s) if self.capacity_s > 0 else 0.0

    @property
    def steal_share(self) -> float:
        return min(1.0, self.steal_cpu_s / self.capacity_s) if self.capacity_s > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s,
            "cpus": self.cpus,
            "own_cpu_s": self.own_cpu_s,
            "other_cpu_s": self.other_cpu_s,
            "steal_cpu_s": self.steal_cpu_s,
            "other_share": self.other_share,
            "steal_share": self.steal_share,
        }


class CpuMeter:
    """Measures, from creation (or :meth:`restart`) to :meth:`stop`, who used the CPUs."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self._t0 = time.monotonic()
        self._own0 = own_cpu_seconds()
        self._busy0, self._steal0 = _machine_cpu_seconds()

    def stop(self) -> CpuLoad:
        """The load from the start until now (the meter may be stopped again later)."""
        wall = time.monotonic() - self._t0
        own = own_cpu_seconds() - self._own0
        busy, steal = _machine_cpu_seconds()
        steal -= self._steal0
        other = max(0.0, (busy - self._busy0) - own) + max(0.0, steal)
        return CpuLoad(wall, os.cpu_count() or 1, own, other, max(0.0, steal))
