"""The driver of tests/adapters/test_ray_cluster.py: a RayPool on a `ray start` cluster.

Run as ``python -m tests.adapters._ray_cluster_driver ADDRESS`` with the cluster's
environment (auth token, PYTHONPATH). It talks with the test through lines: it
prints one JSON object per step and waits for the test's word on stdin before
the next, while the test adds and kills nodes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

T = 90  # every wait here is bounded by this


def where(i: int) -> tuple[int, int]:
    """``(i * i, pid of the worker process that ran it)``, with a little work first."""
    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    return i * i, os.getpid()


def say(step: str, **facts: Any) -> None:
    print(json.dumps({"step": step, **facts}), flush=True)


def wait_for(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} from the test, got {line!r}")


def until(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + T
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {T} s waiting for {what}")
        time.sleep(0.2)


def run(pool: Any, n: int) -> set[int]:
    """``n`` calls across the pool; the results checked; the worker pids that ran them."""
    out = list(pool.map(where, range(n), timeout=T))
    assert [r for r, _ in out] == [i * i for i in range(n)], out
    return {pid for _, pid in out}


def main(address: str) -> None:
    import ray

    from mpexec.ray import RayPool

    ray.init(address=address, log_to_driver=False)
    with RayPool(address=address, workers_per_node=1, watch_interval=0.5) as pool:
        first = dict(pool._agent_processes())
        run(pool, 24)
        stats = pool.stats()
        say("started", nodes=stats.nodes, workers=pool.num_workers, repr=repr(pool))

        wait_for("added")  # the test started a third raylet
        until(lambda: pool.stats().nodes == 3, "the new node's agent")
        new = {a: w for a, w in pool._agent_processes() if a not in first}
        served = run(pool, 60)
        stats = pool.stats()
        say(
            "grown",
            nodes=stats.nodes,
            workers=pool.num_workers,
            joined=stats.joined_nodes,
            new_agent_served=bool(served & {p for w in new.values() for p in w}),
            live=pool.nodes,
            repr=repr(pool),
        )

        wait_for("killed")  # the test killed the first worker raylet, whole
        run(pool, 40)  # calls that were on the lost node run again elsewhere
        until(lambda: pool.stats().nodes == 2, "the lost node to be counted")
        stats = pool.stats()
        say(
            "lost",
            nodes=stats.nodes,
            workers=pool.num_workers,
            lost=list(stats.lost_nodes),
            live=pool.nodes,
            reruns=stats.reruns,
            failed=stats.failed,
            repr=repr(pool),
        )
        run(pool, 10)  # still usable
    ray.shutdown()
    say("done")


if __name__ == "__main__":
    main(sys.argv[1])
