"""The driver of test_ray.py's ``ray.shutdown()`` test: Ray stopped under a running RayPool.

Run as ``python -m tests.adapters._ray_shutdown_driver MODE`` (it starts a
local Ray of its own, so that stopping it disturbs no other test). Another
library's ``atexit`` can call ``ray.shutdown()`` while a pool runs: what was
running, a new ``submit`` and ``pool.shutdown()`` must each end with an error
or return, not wait forever. MODE ``map``: a ``map`` runs (it submits more
calls as results come); ``in_flight``: calls are out and nothing more is
submitted until they end, and a new Ray is started at once (a new connection,
which the pool must neither take for its own nor stop). Prints one JSON
object: for each step, what it raised (or ``"returned"``, or ``"hung"`` after
``T`` seconds) and its seconds (the running step's from the start of
``ray.shutdown()``, which itself takes ``ray_shutdown_s``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

T = 60  # a step still waiting after this long counts as hung

STORE = 100 << 20


def slow(i: int) -> int:
    time.sleep(0.05)
    return i


def _timed(step: Any) -> tuple[str, float]:
    """``step()`` in a thread: what it raised (or "returned", or "hung") and its seconds."""
    outcome: list[str] = []

    def target() -> None:
        try:
            step()
            outcome.append("returned")
        except BaseException as exc:
            outcome.append(type(exc).__name__)

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(T)
    return (outcome[0] if outcome else "hung"), round(time.monotonic() - t0, 2)


def main(mode: str) -> None:
    import ray

    from mpexec.ray import RayPool

    def start_ray() -> None:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=STORE,
            log_to_driver=False,
        )

    start_ray()
    pool = RayPool(workers_per_node=2)
    started = threading.Event()
    running: list[tuple[str, float]] = []

    def mapping() -> None:
        for i, _ in enumerate(pool.map(slow, range(100_000), timeout=10 * T)):
            if i == 5:
                started.set()

    def in_flight() -> None:
        assert pool.submit(slow, 0).result(T) == 0  # the agents answer
        futures = [pool.submit(time.sleep, 10 * T) for _ in range(4)]
        started.set()
        for future in futures:
            future.result(10 * T)

    step = {"map": mapping, "in_flight": in_flight}[mode]
    thread = threading.Thread(
        target=lambda: running.append((_timed(step)[0], time.monotonic())), daemon=True
    )
    thread.start()
    if not started.wait(T):
        raise SystemExit(f"the {mode} never got going")
    time.sleep(0.5)  # the calls reach their agents
    t0 = time.monotonic()
    ray.shutdown()  # as another library's atexit would
    stopped = time.monotonic() - t0
    if mode == "in_flight":
        start_ray()
    thread.join(T + 5)
    outcome, end = running[0] if running else ("hung", time.monotonic())
    report: dict[str, Any] = {
        "ray_shutdown_s": round(stopped, 2),
        "running": outcome,
        "running_s": round(end - t0, 2),
    }
    report["submit"], report["submit_s"] = _timed(lambda: pool.submit(slow, 1).result(T))
    report["shutdown"], report["shutdown_s"] = _timed(pool.shutdown)
    report["status"] = pool.status.state
    report["ray_after"] = ray.is_initialized()
    if ray.is_initialized():
        ray.shutdown()
    print(json.dumps(report), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a hung thread of the pool must not hold the process


if __name__ == "__main__":
    main(sys.argv[1])
