"""The pool's and the arena's bookkeeping a call, against the worker count (issue 37).

What the main process does per dispatch besides encoding: the arena reads its
peers' releases before each allocation and share, the pool picks the least
busy worker, and the manager thread does its bookkeeping on each wake-up. Each
part is timed alone (a Python loop, best of 5), with W = 2, 16, 64 and 128
workers' worth of rings and slots and no processes, so the figures are CPU
time on this host and their growth with W is what to read: flat means the part
does not look at every worker. Run with ``python -m benchmarks dispatch``.
"""

from __future__ import annotations

import os
import time
import types
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, git_state, table, write

WORKERS = (2, 16, 64, 128)


def _per_call(fn: Callable[[], object], n: int) -> float:
    """µs a call of ``fn``, best of 5 loops of ``n``."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


class _Task:
    """What the pool's state reads of a task."""

    def __init__(self, task_id: int) -> None:
        self.task_id = task_id
        self.worker = None
        self.started = time.monotonic()
        self.sent = 0.0
        self.link = types.SimpleNamespace(slot=None, seq=0)


def _collect(w: int, n: int) -> float:
    import shm

    with shm.Arena(1 << 20, name="dispatch-bench") as arena:
        for _ in range(w):
            arena.link()
        with arena._lock:  # the step under test, as allocating runs it
            return _per_call(arena._collect_locked, n)


def _pool_parts(w: int, n: int) -> tuple[float, float]:
    """(picking a worker, the manager's bookkeeping a wake-up), µs."""
    import shm
    from mpexec._pool import _state
    from mpexec._pool._manager import Manager

    saved = _state.shm
    # Slots without rings (nothing is pushed): W of them cost no fds.
    fake = types.SimpleNamespace(**{k: getattr(shm, k) for k in dir(shm) if k[0] != "_"})
    fake.Ring = lambda *a, **k: None
    _state.shm = fake  # type: ignore[assignment]
    try:
        state = _state.PoolState(inline=True, timed=True)
        for i in range(w):
            slot = _state.Slot(i, 0)
            state.install(slot)
            slot.ready = True
        for i, slot in enumerate(state.slots[:-1]):  # all busy but the last
            slot.enqueue(_Task(i + 1), 1)  # type: ignore[arg-type]
    finally:
        _state.shm = saved
    task = _Task(0)
    pick = _per_call(lambda: state.pick_slot(task), n)  # type: ignore[arg-type]
    manager = Manager(state, None, None, 30.0, lambda: None)  # type: ignore[arg-type]

    def wake() -> None:
        with state.lock:
            manager.next_deadline()
        manager.check_start_deadlines()
        manager.check_timeouts()

    return pick, _per_call(wake, n // 4)


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    n = 2_000 if quick else 20_000
    res: dict[str, dict[str, float]] = {}
    for w in WORKERS:
        pick, wake = _pool_parts(w, n)
        res[str(w)] = {"collect_us": _collect(w, n), "pick_us": pick, "manager_wake_us": wake}
    rows = [
        [
            w,
            f"{f['collect_us']:.2f}",
            f"{f['pick_us']:.2f}",
            f"{f['manager_wake_us']:.2f}",
        ]
        for w, f in res.items()
    ]
    commit, dirty = git_state("mpexec", "shm", "benchmarks")
    load = os.getloadavg()
    result = {
        "benchmark": "dispatch",
        "quick": quick,
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": commit,
        "git_dirty": dirty,
        "loadavg": list(load),
        "results": res,
        "errors": [],
    }
    text = (
        f"µs a call, best of 5 loops; load average {load[0]:.1f}. Flat in the workers: the "
        "part does not look at every worker.\n\n"
        + table(
            [
                "workers",
                "arena: collect before an allocation (idle rings)",
                "pool: pick a worker",
                "manager: bookkeeping a wake-up (call timeout set)",
            ],
            rows,
        )
        + "\n"
    )
    write("dispatch", result, text, out_dir, "pool and arena bookkeeping a call")
    print(text)
    return result


if __name__ == "__main__":
    run()
