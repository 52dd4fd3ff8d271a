"""Waiting for a pool future without its poll, and reading a settled outcome (issue 32).

Code built on the pool that waits in threads of its own (the TF op's body, run
by N TF threads at once; the torch drop-in) goes through ``wait_settled`` and
``read_settled``: never the poll role of ``PoolFuture.result()``, never its checks.
"""

from __future__ import annotations

import os
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
