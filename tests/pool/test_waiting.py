"""Waiting for a pool future without its poll, and reading a settled outcome (issue 32).

Code built on the pool that waits in threads of its own (the TF op's body, run
by N TF threads at once; the torch drop-in) goes through ``wait_settled`` and
``read_settled``: never the poll role of ``PoolFuture.result()``, never its checks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError, Future
from typing import Any

import pytest

import mpexec
from mpexec._pool import read_settled, wait_settled


def _fail(x: int) -> int:
    raise ValueError(f"bad {x}")


@pytest.fixture
def pool(no_leaks: None) -> Iterator[mpexec.WorkerPool]:
    with mpexec.WorkerPool(2) as p:
        yield p


def test_waiting_never_polls_even_where_result_would(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool.submit(int).result()  # started
    yields: list[int] = []
    real_yield = os.sched_yield

    def counted() -> None:
        yields.append(threading.get_ident())
        real_yield()

    monkeypatch.setattr(os, "sched_yield", counted)
    for _ in range(5):
        pool._state.latency = 0.0  # recent calls were quick: result() would poll
        future = pool.submit(time.sleep, 0.02)
        assert wait_settled(future)
        assert read_settled(future) == (None, None)
    assert yields == []
    pool._state.latency = 0.0
    pool.submit(time.sleep, 0.02).result()  # the poll this replaces: it does yield
    assert yields


def test_a_settled_error_is_read_and_an_unsettled_future_refused(
    pool: mpexec.WorkerPool,
) -> None:
    future = pool.submit(_fail, 3)
    assert wait_settled(future, 30)
    result, exc = read_settled(future)
    assert result is None
    assert isinstance(exc, ValueError)
    assert "bad 3" in str(exc)
    slow = pool.submit(time.sleep, 0.5)
    with pytest.raises(RuntimeError, match="not settled"):
        read_settled(slow)
    assert not wait_settled(slow, 0.01)  # timed out: False, nothing raised
    assert wait_settled(slow, 30)


def test_a_cancelled_future_is_settled_and_read_as_cancelled() -> None:
    future: Future[Any] = Future()  # any Future (an inline pool's is a plain one)
    assert not wait_settled(future, 0)
    future.cancel()
    assert wait_settled(future, 0)
    with pytest.raises(CancelledError):
        read_settled(future)
    plain: Future[Any] = Future()
    plain.set_result(7)
    assert read_settled(plain) == (7, None)


def _frames_in(fn: Any) -> tuple[Any, int]:
    """``fn()`` and the Python frames it ran (in this thread)."""
    frames = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal frames
        frames += event == "call"

    sys.setprofile(count)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, frames


def test_a_settled_pool_future_is_waited_for_and_read_with_no_lock(
    pool: mpexec.WorkerPool,
) -> None:
    """The drop-in's main thread does this once a batch, cold: ``done()``, ``exception()``
    and ``result()`` took the future's condition four times (15 frames); 4 now."""
    future = pool.submit(int, 5)
    assert future.result(30) == 5
    both = lambda: (wait_settled(future, 30), read_settled(future))  # noqa: E731
    (settled, outcome), frames = _frames_in(both)
    assert (settled, outcome) == (True, (5, None))
    assert frames - 1 <= 4, frames  # (less the lambda's own frame)
    failed = pool.submit(_fail, 4)
    assert wait_settled(failed, 30)
    result, exc = read_settled(failed)
    assert result is None
    assert isinstance(exc, ValueError)
    # A cancelled pool future (never sent: both workers busy, it waits behind them).
    busy = [pool.submit_call(time.sleep, (0.3,), worker=w) for w in range(2)]
    queued = pool.submit_call(int, (1,), worker=0)
    assert queued.cancel()
    assert wait_settled(queued, 0)
    with pytest.raises(CancelledError):
        read_settled(queued)
    for b in busy:
        b.result(30)


def test_settling_a_future_takes_its_lock_once() -> None:
    from mpexec._mapping import settle

    def enters(future: Future[Any], *outcome: Any) -> int:
        taken = 0

        def count(frame: Any, event: str, arg: Any) -> None:
            nonlocal taken
            code = frame.f_code
            taken += (
                event == "call" and code.co_name == "__enter__" and "threading" in code.co_filename
            )

        sys.setprofile(count)
        try:
            settle(future, *outcome)
        finally:
            sys.setprofile(None)
        return taken

    future: Future[Any] = Future()
    assert enters(future, 3) == 1  # 2 before: done() first, then set_result()
    assert future.result(0) == 3
    settle(future, 4)  # done already: kept as it was
    assert future.result(0) == 3
    cancelled: Future[Any] = Future()
    cancelled.cancel()
    settle(cancelled, None, ValueError("late"))
    assert cancelled.cancelled()
    failed: Future[Any] = Future()
    settle(failed, None, ValueError("x"))
    assert isinstance(failed.exception(0), ValueError)
