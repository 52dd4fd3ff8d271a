"""The pool's public low-level seam (docs/pool.md, "Building on the pool").

``submit_call`` (pinned, ordered, results as views), ``results="view"``,
``share`` and ``status``: what the pipeline, the torch loader, the eager
TensorFlow functions and RayPool's agents build on.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import WorkerPool

T = 60

pytestmark = pytest.mark.usefixtures("no_leaks")

_seen: list[int] = []  # per worker process: the calls it ran, in order


def _record(n: int) -> tuple[int, list[int]]:
    _seen.append(n)
    return os.getpid(), list(_seen)


def _tail(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a[1:]  # a view of the caller's shared memory


def _boom() -> None:
    os._exit(3)


def test_pinned_calls_run_in_order_on_their_worker() -> None:
    with WorkerPool(2) as pool:
        futures = [pool.submit_call(_record, (n,), worker=n % 2) for n in range(40)]
        results = [f.result(T) for f in futures]
    for w in (0, 1):
        mine = results[w::2]
        assert len({pid for pid, _ in mine}) == 1, "a pinned call ran on another worker"
        assert mine[-1][1] == list(range(w, 40, 2)), "pinned calls ran out of order"
    assert results[0][0] != results[1][0]
    # An index past num_workers wraps round, as a replaced worker keeps its index.
    with WorkerPool(2) as pool:
        assert pool.submit_call(os.getpid, worker=2).result(T) == pool.pids[0]


def test_submit_call_takes_args_and_kwargs_as_a_tuple_and_a_dict() -> None:
    with WorkerPool(1) as pool:
        assert pool.submit_call(divmod, (7, 2)).result(T) == (3, 1)
        assert pool.submit_call(int, ("ff",), {"base": 16}).result(T) == 255
        assert pool.submit_call(int).result(T) == 0
        with pytest.raises(TypeError, match="needs a callable"):
            pool.submit_call(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["call", "pool"])
def test_view_results_are_read_only_views_uncopied(how: str) -> None:
    # A result that is a view of shared memory: submit copies it (the caller's own);
    # view=True (or results="view") hands it back as a read-only view instead.
    with WorkerPool(1, results="view" if how == "pool" else "copy") as pool:
        x = pool.put(np.arange(100_000, dtype=np.float64))
        own = pool.submit(_tail, x).result(T) if how == "call" else None
        view = (
            pool.submit_call(_tail, (x,), view=True).result(T)
            if how == "call"
            else pool.submit(_tail, x).result(T)
        )
        assert np.array_equal(view, x[1:])
        assert not view.flags.writeable
        assert shm.in_shared_memory(view)
        assert pool.stats().bytes_copied == 0
        if own is not None:
            assert own.flags.writeable
            assert not shm.in_shared_memory(own)
            assert np.array_equal(own, x[1:])


@pytest.mark.parametrize("view", [True, False])
def test_a_hooked_calls_view_result_is_a_view_or_the_callers_own(view: bool) -> None:
    # submit_hooked hands a pipeline's units back as views (view=True, its default);
    # the torch drop-in's batches with view=False, as submit_call does: a slice
    # of shared memory becomes the caller's own writable copy.
    outcomes: list[Any] = []
    with WorkerPool(1) as pool:
        x = pool.put(np.arange(100_000, dtype=np.float64))
        kwargs = {} if view else {"view": False}
        pool.submit_hooked(_tail, (x,), {}, None, outcomes.append, **kwargs)
        deadline = time.monotonic() + T
        while not outcomes and time.monotonic() < deadline:
            time.sleep(0.01)
        got = outcomes[0].result()
        assert np.array_equal(got, x[1:])
        assert got.flags.writeable is not view
        assert shm.in_shared_memory(got) is view
        del got, outcomes[:]


def test_a_view_result_is_a_view_even_when_it_beats_its_task_to_the_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The sender pushes a call, then queues its task (under the pool's lock). A
    # worker quick enough answers in between: the manager then read no task at
    # the head of the queue, took the result for a copy-mode one, and copied it.
    from mpexec._pool._state import Slot

    enqueue = Slot.enqueue

    def slow_enqueue(self: Slot, task: Any, fn_id: int) -> None:
        popped, deadline = self.done.stats().popped, time.monotonic() + 10
        while self.done.stats().popped == popped and time.monotonic() < deadline:
            time.sleep(0.001)  # the worker answers, and the manager takes the answer...
        time.sleep(0.02)  # ... and decides how to decode it
        enqueue(self, task, fn_id)

    with WorkerPool(1) as pool:
        x = pool.put(np.arange(100_000, dtype=np.float64))
        pool.submit_call(_tail, (x,), view=True).result(T)  # the function is known
        time.sleep(0.2)  # the manager is back waiting for results, not for the lock
        monkeypatch.setattr(Slot, "enqueue", slow_enqueue)
        view = pool.submit_call(_tail, (x,), view=True).result(T)
        monkeypatch.undo()
        assert not view.flags.writeable
        assert shm.in_shared_memory(view)
        assert np.array_equal(view, x[1:])


def test_results_must_be_copy_or_view() -> None:
    with pytest.raises(ValueError, match="results must be 'copy' or 'view'"):
        WorkerPool(1, results="mine")  # type: ignore[arg-type]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_share_is_a_read_only_copy_in_shared_memory(num_workers: int) -> None:
    data = np.arange(50_000, dtype=np.int32)
    with WorkerPool(num_workers) as pool:
        shared = pool.share(data)
        data[:] = -1  # the caller may refill its buffer at once
        assert not shared.flags.writeable
        assert np.array_equal(shared, np.arange(50_000, dtype=np.int32))
        assert shm.in_shared_memory(shared) == (num_workers > 0)
        assert pool.submit(np.sum, shared).result(T) == np.arange(50_000).sum()
        with pytest.raises(ValueError, match="read-only"):
            mpexec.writable(shared)  # never passed writable
    if num_workers:
        with pytest.raises(mpexec.PoolClosedError):
            pool.share(data)


def test_status_says_running_broken_closed() -> None:
    pool = WorkerPool(1)
    try:
        status = pool.status
        assert status == mpexec.PoolStatus("running", os.getpid())
        assert status.usable
        with pytest.raises(mpexec.WorkerCrashedError):
            pool.submit(_boom).result(T)
        assert pool.status.state == "broken"
        assert not pool.status.usable
    finally:
        pool.shutdown()
    assert pool.status.state == "broken"  # what broke it is still what it says
    with WorkerPool(0) as inline:
        assert inline.status.state == "running"
    assert inline.status == mpexec.PoolStatus("closed", os.getpid())
    with WorkerPool(1) as closed:
        pass
    assert closed.status.state == "closed"
    with pytest.raises(AttributeError):
        closed.status.state = "running"  # type: ignore[misc]  # a frozen snapshot


def test_processes_are_the_workers_by_index() -> None:
    pool = WorkerPool(2)
    try:
        procs = pool.processes
        assert [p.pid for p in procs] == pool.pids
        assert all(p.is_alive() and p.exitcode is None for p in procs)
        # Pinned to worker i: runs in processes[i].
        assert [pool.submit_call(os.getpid, worker=i).result(T) for i in (0, 1)] == pool.pids
    finally:
        pool.shutdown()
    assert pool.processes == []  # the pool joined and closed them
    with WorkerPool(0) as inline:
        assert inline.processes == []
