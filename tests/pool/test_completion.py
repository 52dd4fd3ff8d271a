"""How a call's outcome comes back: hooks for code built on the pool, futures' waiting (issue 37).

A pipeline's units come back through ``WorkerPool.submit_hooked``: the
manager thread calls a hook with the outcome, with no ``Future`` between.
Every way a call settles (result, error, worker crash, cancellation at
shutdown) reaches the hook exactly once. And many threads waiting in
``PoolFuture.result()`` at once: only one of them polls.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec._executors import LocalPoolExecutor
from mpexec._pool import _future


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _fail(x: int) -> int:
    raise ValueError(f"bad {x}")


def _die() -> None:
    os._exit(3)


class _Outcomes:
    """A hook that records each outcome it is given, and in which thread."""

    def __init__(self) -> None:
        self.got: list[tuple[str, Any]] = []
        self.threads: list[int] = []
        self.done = threading.Event()

    def __call__(self, outcome: Any) -> None:
        self.threads.append(threading.get_ident())
        if outcome.cancelled():
            self.got.append(("cancelled", None))
        elif outcome.exception() is not None:
            self.got.append(("error", outcome.exception()))
        else:
            self.got.append(("ok", outcome.result()))
        self.done.set()


@pytest.fixture
def pool(no_leaks: None) -> Iterator[mpexec.WorkerPool]:
    with mpexec.WorkerPool(2, restart=True) as p:
        yield p


def test_a_hooked_call_settles_once_with_its_result_in_the_managers_thread(
    pool: mpexec.WorkerPool,
) -> None:
    hook = _Outcomes()
    pool.submit_hooked(_double, (np.arange(4),), {}, None, hook)
    assert hook.done.wait(30)
    pool.submit(int).result()  # a later call has come back: nothing more will
    assert len(hook.got) == 1
    kind, value = hook.got[0]
    assert kind == "ok"
    np.testing.assert_array_equal(value, [0, 2, 4, 6])
    assert hook.threads[0] != threading.get_ident()


def test_a_hooked_calls_error_and_its_workers_crash_reach_the_hook(
    pool: mpexec.WorkerPool,
) -> None:
    error, crash = _Outcomes(), _Outcomes()
    pool.submit_hooked(_fail, (7,), {}, None, error)
    assert error.done.wait(30)
    assert error.got[0][0] == "error"
    assert "bad 7" in str(error.got[0][1])
    pool.submit_hooked(_die, (), {}, 0, crash)
    assert crash.done.wait(30)
    assert crash.got[0][0] == "error"
    assert isinstance(crash.got[0][1], mpexec.WorkerCrashedError)
    assert pool.submit(int, 5).result(30) == 5  # restarted
    assert len(error.got) == len(crash.got) == 1


def test_hooked_calls_still_queued_at_shutdown_are_cancelled_once(no_leaks: None) -> None:
    pool = mpexec.WorkerPool(1)
    hooks = [_Outcomes() for _ in range(12)]
    for hook in hooks:
        pool.submit_hooked(time.sleep, (0.05,), {}, None, hook)
    pool.shutdown(wait=True, cancel_futures=True)
    kinds = [h.got[0][0] for h in hooks]
    assert all(len(h.got) == 1 for h in hooks)
    assert "cancelled" in kinds  # those not started; one that runs finishes
    assert set(kinds) <= {"ok", "cancelled"}


def test_a_unit_futures_first_settling_wins() -> None:
    hook = _Outcomes()
    outcome = _future.UnitFuture(hook)
    assert not outcome.done()
    outcome.set_result(1)
    assert not outcome.cancel()
    outcome.set_exception(ValueError("late"))
    assert hook.got == [("ok", 1)]
    assert outcome.done()
    assert not outcome.cancelled()
    cancelled = _future.UnitFuture(hook)
    assert _future.cancel_now(cancelled)
    with pytest.raises(CancelledError):
        cancelled.result()


def test_a_settled_units_result_is_read_in_one_frame() -> None:
    """The scheduler reads every unit's result in the manager thread: one frame, not two."""
    frames = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal frames
        frames += event == "call"

    outcome = _future.UnitFuture(_Outcomes())
    with pytest.raises(RuntimeError, match="read by its hook"):
        outcome.result()  # not settled
    outcome.set_result(5)
    sys.setprofile(count)
    try:
        got = outcome.result()
    finally:
        sys.setprofile(None)
    assert got == 5
    assert frames == 1, frames  # 2 before: result() called exception()
    failed = _future.UnitFuture(_Outcomes())
    failed.set_exception(ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        failed.result()
    cancelled = _future.UnitFuture(_Outcomes())
    assert cancelled.cancel()
    with pytest.raises(CancelledError):
        cancelled.result()


def test_a_pipelines_units_come_back_without_a_future(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = []
    real = _future.PoolFuture.__init__

    def counted(self: Any, *args: Any) -> None:
        made.append(self)
        real(self, *args)

    monkeypatch.setattr(_future.PoolFuture, "__init__", counted)

    @mpexec.pipeline_def(batch_size=8, num_workers=2, seed=3)
    def pipe() -> Any:
        x = mpexec.fn.external_source(
            source=lambda info: np.full(3, info.idx_in_epoch), batch=False
        )
        return mpexec.fn.python_function(x, function=lambda a: a + 1)

    with pipe() as p:
        p.build()
        for _ in range(4):
            (out,) = p.run()
            assert len(out) == 8
        assert isinstance(p._scheduler.executor, LocalPoolExecutor)
    assert made == []


def test_many_threads_waiting_for_results_poll_one_at_a_time(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    futures = [pool.submit(time.sleep, 0.3) for _ in range(2)]
    futures += [pool.submit(int, i) for i in range(6)]  # queued behind them
    pool._state.latency = 0.0  # recent calls were quick: a waiter may poll
    pollers: set[int] = set()
    real_yield = os.sched_yield

    def counted() -> None:
        pollers.add(threading.get_ident())
        time.sleep(0.05)  # a long poll: the others arrive meanwhile
        real_yield()

    monkeypatch.setattr(os, "sched_yield", counted)
    # The poller's turn lasts longer than its 50 ms polls: the others, however long the
    # barrier takes to wake them (over 1 ms, the real turn, on a 16-core host), find it
    # taken. A turn that lapses while its poller sleeps is the design; not this test's.
    monkeypatch.setattr(_future, "_POLL_SECONDS", 10.0)
    start = threading.Barrier(len(futures))

    def wait(f: Any) -> None:
        start.wait()
        f.result(30)

    threads = [threading.Thread(target=wait, args=(f,)) for f in futures]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    monkeypatch.setattr(os, "sched_yield", real_yield)
    assert all(f.done() for f in futures)
    assert len(pollers) <= 2, f"{len(pollers)} of {len(futures)} waiting threads polled"
