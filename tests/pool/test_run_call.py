"""``WorkerPool.run_call``: a call its caller only waits for, with no ``Future`` (issue 32).

The TF op's body runs its calls this way: a hooked call whose hook lets go of a
lock the caller sleeps on, and, off the main thread, the caller reading its
worker's done record itself (``_delivery.read_call``). These check what it
returns and raises, that it makes no ``Future``, who settles the call, and the
ways a wait can end: the worker killed, a shutdown, an inline pool.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import mpexec
from mpexec._pool import _waiting
from tests.conftest import wait_until


def _sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def _fail(text: str) -> None:
    raise ValueError(text)


@pytest.fixture
def pool(no_leaks: None) -> Iterator[mpexec.WorkerPool]:
    with mpexec.WorkerPool(2, restart=True) as p:
        yield p


def _running(slot: Any) -> bool:
    """Its worker has started the call read directly (not merely received it)."""
    queue = list(slot.queue)
    return bool(slot.direct and queue and slot.done.progress() >= queue[0].seq)


def _in_thread(fn: Any) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def settlers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads that settled a Waiter (its call's outcome)."""
    threads: list[int] = []
    real = _waiting.Waiter._settle

    def settle(self: _waiting.Waiter, *outcome: Any) -> bool:
        threads.append(threading.get_ident())
        return real(self, *outcome)

    monkeypatch.setattr(_waiting.Waiter, "_settle", settle)
    return threads


def test_run_call_returns_the_result_and_makes_no_future(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert pool.run_call(_sleep_then, (0, 1)) == 1  # the function shipped
    made: list[object] = []
    real_init = Future.__init__

    def counted(self: Future[Any]) -> None:
        made.append(self)
        real_init(self)

    monkeypatch.setattr(Future, "__init__", counted)
    assert [pool.run_call(_sleep_then, (0, i), worker=i) for i in range(6)] == list(range(6))
    assert made == []
    out = pool.run_call(np_arange, (5,))
    assert out.tolist() == [0, 1, 2, 3, 4]


def np_arange(n: int) -> Any:
    import numpy as np

    return np.arange(n)


def test_run_call_raises_the_calls_error_with_the_worker_traceback(
    pool: mpexec.WorkerPool,
) -> None:
    with pytest.raises(ValueError, match="bad input") as info:
        pool.run_call(_fail, ("bad input",))
    assert "_fail" in str(info.value.__cause__)  # the worker's traceback, as result() gives
    with pytest.raises(TypeError, match="callable"):
        pool.run_call(3, ())  # type: ignore[arg-type]


def test_off_the_main_thread_the_caller_settles_its_call_itself(
    pool: mpexec.WorkerPool, settlers: list[int]
) -> None:
    got: list[Any] = []
    thread = _in_thread(lambda: got.append((pool.run_call(_sleep_then, (0.3, 7), worker=0),
                                            threading.get_ident())))  # fmt: skip
    wait_until(lambda: pool._state.slots[0].direct, 30)  # it reads the done ring itself
    thread.join(60)
    assert got
    assert got[0][0] == 7
    assert settlers == [got[0][1]]  # settled in the waiting thread, not the manager's
    assert pool._state.slots[0].direct is False  # let go of
    assert pool.submit(int, 3).result(30) == 3  # the manager delivers again


def test_on_the_main_thread_the_manager_settles_it(
    pool: mpexec.WorkerPool, settlers: list[int]
) -> None:
    assert pool.run_call(_sleep_then, (0.2, 8), worker=0) == 8
    assert settlers == [pool._state.manager_ident]


def test_a_worker_killed_during_run_call_is_a_clear_error(pool: mpexec.WorkerPool) -> None:
    got: list[BaseException] = []

    def call() -> None:
        try:
            pool.run_call(_sleep_then, (60, 1), worker=0)
        except BaseException as exc:
            got.append(exc)

    thread = _in_thread(call)
    slot = pool._state.slots[0]
    wait_until(lambda: _running(slot), 30)
    os.kill(slot.pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive(), "run_call hung on its dead worker"
    assert len(got) == 1
    assert isinstance(got[0], mpexec.WorkerCrashedError), got
    assert pool.run_call(_sleep_then, (0, 5), worker=0) == 5  # restarted


@pytest.mark.parametrize("wait", [True, False])
def test_a_shutdown_during_run_call_ends_the_wait(no_leaks: None, wait: bool) -> None:
    pool = mpexec.WorkerPool(2)
    got: list[Any] = []

    def call() -> None:
        try:
            got.append(pool.run_call(_sleep_then, (0.5, 9), worker=0))
        except BaseException as exc:
            got.append(exc)

    thread = _in_thread(call)
    wait_until(lambda: _running(pool._state.slots[0]), 30)
    pool.shutdown(wait=wait, cancel_futures=True)
    thread.join(60)
    assert not thread.is_alive(), "run_call hung through the shutdown"
    assert len(got) == 1
    if wait:
        assert got == [9]  # a running call finishes
    else:
        assert got[0] == 9 or isinstance(got[0], mpexec.PoolClosedError), got


def test_an_inline_pool_runs_it_in_the_caller(no_leaks: None) -> None:
    with mpexec.WorkerPool(0) as pool:
        assert pool.run_call(_sleep_then, (0, 4)) == 4
        with pytest.raises(ValueError, match="inline"):
            pool.run_call(_fail, ("inline",))


# ---------------------------------------------------------------- the ring kept aside
# A TF op's body calls its worker again and again from one thread: between two of
# its direct reads the worker's done ring stays out of the manager's poll set (no
# epoll_ctl a call), and any call for the manager to deliver has it watched again.


class _CountingPoller:
    """The manager's epoll set, its ``modify`` calls (one ``epoll_ctl`` each) counted."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.modified: list[tuple[int, int]] = []

    def modify(self, fd: int, events: int) -> None:
        self.modified.append((fd, events))
        self.real.modify(fd, events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _count_poll_changes(pool: mpexec.WorkerPool) -> _CountingPoller:
    state = pool._state
    pool.run_call(_sleep_then, (0, 0))  # the workers are up, the poll set built
    watcher = state.watcher
    assert watcher is not None
    wait_until(lambda: watcher.key == state.roster.version and watcher.poller is not None, 30)
    counting = _CountingPoller(watcher.poller)
    watcher.poller = counting
    return counting


def _calls_in_a_thread(pool: mpexec.WorkerPool, n: int, seconds: float) -> list[int]:
    got: list[int] = []
    thread = _in_thread(
        lambda: got.extend(pool.run_call(_sleep_then, (seconds, i), worker=0) for i in range(n))
    )
    thread.join(60)
    assert not thread.is_alive(), "run_call hung"
    return got


def test_a_threads_run_calls_on_one_worker_change_the_managers_poll_set_once(
    pool: mpexec.WorkerPool, settlers: list[int]
) -> None:
    counting = _count_poll_changes(pool)
    assert _calls_in_a_thread(pool, 12, 0.02) == list(range(12))
    # Each answer read directly (the worker's sleep outlasts the submit) ...
    assert len(settlers) == 13
    assert pool._state.manager_ident not in settlers[1:]
    # ... with the ring set aside once, not set aside and watched again each call (24).
    assert len(counting.modified) <= 1, counting.modified
    watcher = pool._state.watcher
    assert watcher is not None
    assert pool._state.slots[0] in watcher.aside


def test_a_direct_read_drains_the_ring_once_a_call(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpexec._pool import _delivery

    drains: list[int] = []
    real = _delivery.drain

    def counted(state: Any, slot: Any) -> None:
        drains.append(threading.get_ident())
        real(state, slot)

    monkeypatch.setattr(_delivery, "drain", counted)
    assert _calls_in_a_thread(pool, 6, 0.05) == list(range(6))
    # Not once before its wait (the answer is not there yet) and once after it.
    assert len(drains) == 6, drains


def _submit_then_result(pool: mpexec.WorkerPool) -> int:
    return pool.submit_call(_sleep_then, (0.05, 41), worker=0).result(30)  # type: ignore[no-any-return]


def _run_call_from_main(pool: mpexec.WorkerPool) -> int:
    return pool.run_call(_sleep_then, (0.05, 41), worker=0)


def _hooked(pool: mpexec.WorkerPool) -> int:
    got: list[Any] = []
    pool.submit_hooked(_sleep_then, (0.05, 41), {}, 0, got.append)
    wait_until(lambda: bool(got), 30)
    return got[0].result()  # type: ignore[no-any-return]


def _waited_by_another_thread(pool: mpexec.WorkerPool) -> int:
    future = pool.submit_call(_sleep_then, (0.05, 41), worker=0)
    out: list[int] = []
    thread = _in_thread(lambda: out.append(future.result(30)))
    thread.join(60)
    return out[0]


@pytest.mark.parametrize(
    "call", [_submit_then_result, _run_call_from_main, _hooked, _waited_by_another_thread]
)
def test_a_ring_kept_aside_is_watched_again_for_a_call_read_otherwise(
    pool: mpexec.WorkerPool, call: Any
) -> None:
    counting = _count_poll_changes(pool)
    _calls_in_a_thread(pool, 3, 0.02)
    watcher = pool._state.watcher
    slot = pool._state.slots[0]
    assert watcher is not None
    assert slot in watcher.aside
    if call is _run_call_from_main:
        assert call(pool) == 41  # the main thread never reads directly: the manager does
    else:
        out: list[int] = []
        thread = _in_thread(lambda: out.append(call(pool)))
        thread.join(60)
        assert not thread.is_alive(), "a call on a ring kept aside hung"
        assert out == [41]
    assert counting.modified  # watched again (or set aside again by a direct read)
    assert _calls_in_a_thread(pool, 3, 0.02) == [0, 1, 2]  # and kept aside again


def test_a_worker_killed_while_its_ring_is_kept_aside_is_replaced(
    pool: mpexec.WorkerPool,
) -> None:
    _calls_in_a_thread(pool, 3, 0.01)
    state = pool._state
    old = state.slots[0]
    watcher = state.watcher
    assert watcher is not None
    assert old in watcher.aside
    os.kill(old.pid, signal.SIGKILL)  # its sentinel is still watched: the manager restarts it
    wait_until(lambda: state.slots[0] is not old and state.slots[0].ready, 60)
    assert old not in watcher.aside
    assert _calls_in_a_thread(pool, 3, 0.01) == [0, 1, 2]
    assert pool.submit_call(_sleep_then, (0, 6), worker=0).result(30) == 6


def test_a_call_asks_the_kernel_for_no_process_id(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call checks that its pool was not inherited through fork, against the id kept
    after fork (``mpexec._pid``), not ``os.getpid()`` (a system call each time, twice a TF
    op's call before): submit, the direct read, the manager's delivery, ``result()``."""
    assert pool.run_call(_sleep_then, (0, 0)) == 0  # the function shipped
    asked: list[int] = []
    real = os.getpid
    monkeypatch.setattr(os, "getpid", lambda: asked.append(1) or real())
    got: list[int] = []
    thread = _in_thread(
        lambda: got.extend(pool.run_call(_sleep_then, (0.01, i), worker=0) for i in range(5))
    )
    thread.join(60)
    assert got == list(range(5))  # read directly, off the main thread
    assert [pool.run_call(_sleep_then, (0, i)) for i in range(3)] == [0, 1, 2]  # the manager's
    assert pool.submit(_sleep_then, 0, 9).result(30) == 9
    assert asked == []
