"""A lone waiting caller reads its worker's done record itself (issue 32).

``wait_settled`` on a call that is the only one queued on its worker takes
that worker's done record in the waiting thread (``mpexec._pool._delivery``):
the manager thread stands aside for that ring and keeps watching the worker's
death. These check the direct path is taken, and every way it can end: the
worker killed mid-call, a shutdown, a timeout, two callers on one worker; and
that every call settles exactly once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import mpexec
from mpexec._pool import read_settled, wait_settled
from tests.conftest import wait_until


def _sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def _after(gate: str, value: int) -> int:
    """``value`` once the file ``gate`` exists: the test says when the call may end."""
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.001)
    return value


def _open(gate: Any) -> None:
    gate.write_text("")


@pytest.fixture
def pool(no_leaks: None) -> Iterator[mpexec.WorkerPool]:
    with mpexec.WorkerPool(2, restart=True) as p:
        yield p


def _settler(future: Future[Any]) -> list[int]:
    """The threads that settled ``future`` (a done-callback runs in the one that settles).

    Only while ``future`` is not done yet: a callback added to a done future runs
    at once in the thread that adds it, so the call must wait (``_after``) until
    this is in place; on a loaded host any sleep can be outrun.
    """
    assert not future.done()
    threads: list[int] = []
    future.add_done_callback(lambda _: threads.append(threading.get_ident()))
    return threads


def _in_thread(fn: Any) -> tuple[Any, int]:
    """``fn()`` run in a thread of its own (not the main one): its result and the thread."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append((fn(), threading.get_ident())))
    thread.start()
    thread.join(60)
    assert out, "the waiting thread hung"
    return out[0]  # type: ignore[no-any-return]


def test_a_lone_waiting_caller_settles_its_call_itself(
    pool: mpexec.WorkerPool, tmp_path: Any
) -> None:
    gate = tmp_path / "gate"
    future = pool.submit_call(_after, (str(gate), 7), worker=0)
    settled_by = _settler(future)
    got: list[tuple[bool, int]] = []
    thread = threading.Thread(target=lambda: got.append((wait_settled(future, 30),
                                                         threading.get_ident())))  # fmt: skip
    thread.start()
    # The answer comes only once the thread reads the ring itself.
    wait_until(lambda: pool._state.slots[0].direct, 30)
    _open(gate)
    thread.join(60)
    assert got, "the waiting thread hung"
    settled, waiter = got[0]
    assert settled
    assert read_settled(future) == (7, None)
    # The waiting thread took the done record, not the manager thread.
    assert settled_by == [waiter]
    assert pool._state.slots[0].direct is False  # let go of
    assert pool.submit(int, 3).result(30) == 3  # the manager delivers again


def test_the_main_thread_never_reads_directly(pool: mpexec.WorkerPool, tmp_path: Any) -> None:
    # A Ctrl-C between taking a record and settling its call would lose the call's
    # outcome: the main thread waits on the future, and the manager delivers.
    gate = tmp_path / "gate"
    future = pool.submit_call(_after, (str(gate), 8), worker=0)
    settled_by = _settler(future)
    _open(gate)
    assert wait_settled(future, 30)
    assert read_settled(future) == (8, None)
    assert settled_by
    assert settled_by != [threading.get_ident()]


def _killed_while_read(pool: mpexec.WorkerPool, worker: int) -> tuple[list[bool], Any]:
    """SIGKILL ``worker`` while another thread reads its call's outcome directly: what
    that thread's wait returned, and the call's error."""
    future = pool.submit_call(_sleep_then, (60, 1), worker=worker)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(wait_settled(future, 60)))
    waiter.start()
    slot = pool._state.slots[worker]
    wait_until(lambda: bool(slot.direct and future.running()), 30)
    os.kill(slot.pid, signal.SIGKILL)
    waiter.join(60)
    assert not waiter.is_alive(), "the direct reader hung on its dead worker"
    return got, read_settled(future)[1]


def test_a_worker_killed_while_its_caller_reads_directly_is_a_clear_error(
    pool: mpexec.WorkerPool,
) -> None:
    got, exc = _killed_while_read(pool, 0)
    assert got == [True]
    assert isinstance(exc, mpexec.WorkerCrashedError)
    assert "SIGKILL" in str(exc) or "killed" in str(exc)
    assert pool.submit_call(_sleep_then, (0, 5), worker=0).result(30) == 5  # restarted


def test_a_worker_killed_without_restart_breaks_the_pool_for_its_direct_reader(
    no_leaks: None,
) -> None:
    with mpexec.WorkerPool(2) as pool:
        _, exc = _killed_while_read(pool, 1)
        assert isinstance(exc, mpexec.BrokenPoolError)
        with pytest.raises(mpexec.BrokenPoolError):
            pool.submit(int)


@pytest.mark.parametrize("wait", [True, False])
def test_a_shutdown_while_a_caller_reads_directly_settles_its_call(
    no_leaks: None, wait: bool
) -> None:
    pool = mpexec.WorkerPool(2)
    future = pool.submit_call(_sleep_then, (0.5, 9), worker=0)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(wait_settled(future, 60)))
    waiter.start()
    slot = pool._state.slots[0]
    wait_until(lambda: bool(slot.direct and future.running()), 30)
    pool.shutdown(wait=wait, cancel_futures=True)
    waiter.join(60)
    assert not waiter.is_alive(), "the direct reader hung through the shutdown"
    assert got == [True]
    result, exc = read_settled(future)
    if wait:
        assert (result, exc) == (9, None)  # a running call finishes
    else:
        assert result == 9 or isinstance(exc, mpexec.PoolClosedError)


def test_a_direct_reads_timeout_leaves_the_call_to_the_manager(
    pool: mpexec.WorkerPool, tmp_path: Any
) -> None:
    gate = tmp_path / "gate"
    future = pool.submit_call(_after, (str(gate), 4), worker=1)
    settled_by = _settler(future)
    slot = pool._state.slots[1]
    claimed: list[bool] = []
    real_poll = slot.done.fileno  # the direct read asks for the doorbell's fd once claimed

    def fileno() -> int:
        claimed.append(slot.direct)
        return real_poll()

    slot.done.fileno = fileno  # type: ignore[method-assign]
    settled, _ = _in_thread(lambda: wait_settled(future, 0.01))
    del slot.done.fileno
    assert settled is False
    assert any(claimed), "the wait did not read directly"
    assert not future.done()
    _open(gate)
    # Nobody waits now: the manager must have taken the ring back to deliver it.
    wait_until(future.done, 30)
    assert read_settled(future) == (4, None)
    assert settled_by != [threading.get_ident()]


def test_two_callers_on_one_worker_each_get_their_own_outcome(pool: mpexec.WorkerPool) -> None:
    futures = [pool.submit_call(_sleep_then, (0.2, i), worker=0) for i in range(2)]
    got: dict[int, Any] = {}
    start = threading.Barrier(2)

    def wait(i: int) -> None:
        start.wait()
        assert wait_settled(futures[i], 60)
        got[i] = read_settled(futures[i])

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: (0, None), 1: (1, None)}


def test_every_call_settles_once_whoever_delivers_it(pool: mpexec.WorkerPool) -> None:
    # Threads that each wait directly for calls on both workers, with calls that
    # nobody waits for mixed in (the manager's): every future is settled once.
    settles: Counter[int] = Counter()
    lock = threading.Lock()
    futures: list[Future[Any]] = []

    def count(f: Future[Any]) -> None:
        with lock:
            settles[id(f)] += 1

    def caller(k: int) -> None:
        for i in range(40):
            f = pool.submit_call(_sleep_then, (0.001 * (i % 3), i), worker=(k + i) % 2)
            f.add_done_callback(count)
            futures.append(f)
            if i % 4:
                assert wait_settled(f, 60)
                assert read_settled(f) == (i, None)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for f in futures:
        assert wait_settled(f, 60)
    assert len(futures) == 120
    assert all(settles[id(f)] == 1 for f in futures), settles.most_common(3)
    stats = pool.stats()
    assert stats.completed == pool._state.submitted
    assert stats.pending == 0
