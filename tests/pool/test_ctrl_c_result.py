"""A Ctrl-C at every point of ``PoolFuture.result()`` (and others): the pool goes on.

``Future.result()`` waits on the future's condition; an interrupt as its lock's
acquire returns (in ``Condition.__enter__``, or as ``Condition.wait`` takes it
back) left the lock held for good, and the manager, settling that future,
blocked on it: the whole pool hung. As in tests/pipeline/test_ctrl_c_anywhere.py,
a profile function raises ``KeyboardInterrupt`` at the n-th ``call`` /
``return`` / ``c_return`` event of the wait (where CPython can raise a real
one; here in every frame, ``threading``'s and ``concurrent.futures``' too), for
n = 1, 2, ... until a wait ends before its n-th event.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from typing import Any

import pytest

import mpexec
from mpexec._pool import _future
from mpexec._pool._waiting import wait_settled
from tests.conftest import InterruptAt
from tests.pool.test_direct import _after

pytestmark = pytest.mark.usefixtures("no_leaks")


def _call(x: int, pause: float) -> int:
    time.sleep(pause)
    if x % 3 == 0:
        raise ValueError(f"call {x}")
    return x


def _wait(future: Any, method: str, interrupt: InterruptAt) -> bool:
    """``future.<method>(timeout=30)`` with ``interrupt`` armed; True if it landed."""
    sys.setprofile(interrupt)
    try:
        if method == "add_done_callback":
            future.add_done_callback(id)
        elif method == "wait_settled":
            wait_settled(future, 30)
        else:
            getattr(future, method)(timeout=30)
    except KeyboardInterrupt:
        return True
    except ValueError:
        pass
    finally:
        sys.setprofile(None)
    return False


@pytest.mark.parametrize(
    ("method", "quick"),
    [
        ("result", False),
        ("result", True),
        ("exception", False),
        ("exception", True),
        ("add_done_callback", False),  # it takes the lock too, and cancel() (by the same code)
        ("wait_settled", False),  # the torch drop-in's wait
    ],
)
def test_a_ctrl_c_anywhere_in_a_wait_leaves_the_future_and_the_pool_working(
    monkeypatch: pytest.MonkeyPatch, method: str, quick: bool
) -> None:
    # A slow call is not yet done when the wait sleeps (its events the same each
    # time); a quick one is polled for (the pool's calls come back within the budget).
    pause = 0.0 if quick else 0.03
    with mpexec.WorkerPool(2) as pool:
        for x in range(1, 4):
            pool.submit(_call, x, 0.0).exception(30)  # warm: the latency a quick call has
        target, landed = 1, 0
        for x in range(1, 2000):
            future = pool.submit(_call, x, pause)
            interrupt = InterruptAt(target)
            watchdog = threading.Timer(60, pool.shutdown, kwargs={"wait": False})
            watchdog.start()  # a hang fails, not hangs, the test
            try:
                if not _wait(future, method, interrupt):
                    break  # the wait ended before its target-th event: all swept
                landed, target = landed + 1, target + 1
                # The manager settles it: nothing the interrupted wait left holds it up.
                deadline = time.monotonic() + 10
                while not future.done() and time.monotonic() < deadline:
                    time.sleep(0.001)
                if not future.done():
                    while future._condition._is_owned():  # let the pool close
                        future._condition.release()
                    pytest.fail(f"the pool hung after an interrupt at {interrupt.where}")
                if x % 3:
                    assert future.result(30) == x
                    assert future.exception(30) is None
                else:
                    with pytest.raises(ValueError, match=f"call {x}$"):
                        future.result(30)
                assert pool.submit(_call, 1, 0.0).result(30) == 1, interrupt.where
            finally:
                watchdog.cancel()
        else:
            pytest.fail("a wait was interrupted at every target: the sweep never ended")
    assert landed >= (1 if quick else 5), "too few interrupts landed: the sweep tested little"


def test_waiters_of_every_kind_wake_as_a_future_settles() -> None:
    # result() waits on a gate among the future's _waiters; concurrent.futures.wait,
    # as_completed and done-callbacks use _waiters and _condition: all still wake.
    with mpexec.WorkerPool(2) as pool:
        futures = [pool.submit(_call, x, 0.2) for x in (1, 2)]
        got: list[Any] = []
        threads = [
            threading.Thread(target=lambda f=f: got.append(f.result(30)))
            for f in futures
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        called = threading.Event()
        futures[0].add_done_callback(lambda _: called.set())
        _, pending = concurrent.futures.wait(futures, timeout=30)
        assert not pending
        assert [f.result(0) for f in concurrent.futures.as_completed(futures, timeout=30)]
        for t in threads:
            t.join(30)
        assert sorted(got) == [1, 1, 1, 2, 2, 2]
        assert called.wait(30)
        # A cancelled call wakes its waiter too (never run: its worker is busy).
        busy = [pool.submit_call(_call, (1, 0.5), worker=w) for w in (0, 1)]
        later = pool.submit_call(_call, (2, 0.0), worker=0)
        woke: list[BaseException] = []

        def wait_later() -> None:
            try:
                later.result(30)
            except BaseException as exc:
                woke.append(exc)

        waiter = threading.Thread(target=wait_later)
        waiter.start()
        time.sleep(0.05)
        assert later.cancel()
        waiter.join(5)
        assert not waiter.is_alive()
        assert isinstance(woke[0], concurrent.futures.CancelledError)
        assert [b.result(30) for b in busy] == [1, 1]
        with pytest.raises(concurrent.futures.TimeoutError):
            pool.submit(_call, 1, 0.5).result(timeout=0.01)


def test_a_waiter_whose_gate_was_left_shut_looks_again_and_wakes(tmp_path: Any) -> None:
    # What an interrupted waiter or cancel can leave: the future settled, its gate
    # never opened. Made here by taking the gate off the future's waiters before the
    # manager settles it: the waiter finds the result at its next look.
    end = tmp_path / "end"
    with mpexec.WorkerPool(1) as pool:
        future = pool.submit(_after, str(end), 1)
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(future.result(30)))
        waiter.start()
        deadline = time.monotonic() + 10
        while "_mp_gate" not in future.__dict__ and time.monotonic() < deadline:
            time.sleep(0.001)
        gate = future.__dict__["_mp_gate"]
        with future._condition:
            future._waiters.remove(gate)
        end.touch()
        assert future.exception(30) is None  # settled, the gate still shut
        assert gate.lock.locked()
        waiter.join(_future._GATE_SECONDS + 5)
        assert not waiter.is_alive()
        assert got == [1]


def _cancel(future: Any, interrupt: InterruptAt) -> bool:
    """``future.cancel()`` with ``interrupt`` armed; False if it ended before its target."""
    sys.setprofile(interrupt)
    try:
        future.cancel()
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


def test_a_ctrl_c_anywhere_in_cancel_of_a_pushed_call_leaves_its_worker_working() -> None:
    # cancel() of a call pushed to a busy worker is a handshake (CANCEL, then a
    # VERDICT the worker waits for): cut short, the worker must not wait for good,
    # and the call must settle, run or cancelled.
    with mpexec.WorkerPool(1) as pool:
        target, landed = 1, 0
        for x in range(1, 2000):
            busy = pool.submit_call(_call, (1, 0.3), worker=0)
            queued = pool.submit_call(_call, (x, 0.0), worker=0)
            assert queued.link.slot is not None, "not pushed: the test would test nothing"
            interrupt = InterruptAt(target)
            watchdog = threading.Timer(60, pool.shutdown, kwargs={"wait": False})
            watchdog.start()
            try:
                if not _cancel(queued, interrupt):
                    if queued.cancelled():
                        break  # cancel() ended before its target-th event: all swept
                    # The busy call ended first (a loaded host): the queued one ran. Again.
                    assert busy.result(30) == 1
                    assert wait_settled(queued, 10)
                    continue
                landed, target = landed + 1, target + 1
                assert busy.result(30) == 1
                if not wait_settled(queued, 10):
                    pool.shutdown(wait=False, cancel_futures=True)  # (its worker hangs)
                    pytest.fail(f"a cancelled call never settled ({interrupt.where})")
                if not queued.cancelled():
                    assert queued.exception(0) is not None if x % 3 == 0 else queued.result(0) == x
                after = pool.submit_call(_call, (1, 0.0), worker=0)
                if not wait_settled(after, 10):
                    pool.shutdown(wait=False, cancel_futures=True)
                    pytest.fail(f"the worker hung after an interrupt at {interrupt.where}")
                assert after.result(0) == 1
            finally:
                watchdog.cancel()
        else:
            pytest.fail("cancel() was interrupted at every target: the sweep never ended")
    assert landed >= 5, "too few interrupts landed: the sweep tested little"
