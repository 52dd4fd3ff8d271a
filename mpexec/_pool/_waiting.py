"""Waiting for a call's future without the pool's poll, and reading a settled outcome.

Code built on the pool that waits in a thread of its own (a TF op's body, run
by N TF threads at once; the torch drop-in, which waits for one batch at a
time) wants neither of ``PoolFuture.result()``'s extras: polling a moment for
a quick result (one waiting thread of a pool takes that role; N pollers would
take the GIL and the CPUs from the thread that delivers their results), and
the checks made before it. These two say what such a caller does instead.
They take any ``concurrent.futures.Future`` (an inline pool's is a plain one).

A caller that only blocks on its call (``WorkerPool.run_call``: a TF op's body)
needs no ``Future`` at all: its call's outcome is a :class:`Waiter`, a
``UnitFuture`` whose settling lets go of a lock the caller sleeps on. No
condition is made, taken or notified, and no done-callback list is walked, a call.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any

from ._delivery import read_call, read_direct
from ._future import PoolFuture, UnitFuture

if TYPE_CHECKING:
    from ._future import Task

__all__ = ["Waiter", "read_settled", "wait_settled"]


def wait_settled(future: Future[Any], timeout: float | None = None) -> bool:
    """Wait until ``future`` settles, never taking the pool's poll role; False on timeout.

    Settled means done: a result, an exception, or cancelled (read it with
    :func:`read_settled`). A caller (not the main thread) whose call is the only
    one queued on its worker reads that worker's done record itself
    (``_delivery``: one thread wake-up instead of two); any other sleeps on the
    future's gate (``PoolFuture.block``; a plain future's condition otherwise).
    """
    if future.settled() if type(future) is PoolFuture else future.done():
        return True
    start = time.monotonic()
    settled = read_direct(future, timeout)
    if settled is not None:
        return settled
    if timeout is not None:
        timeout = max(0.0, timeout - (time.monotonic() - start))
    if type(future) is PoolFuture:
        future.block(timeout)  # (Future.exception() takes the lock the manager needs)
        return future.settled()
    try:
        Future.exception(future, timeout)
    except CancelledError:
        pass  # settled: read_settled says so
    except FutureTimeoutError:  # the builtin TimeoutError only from Python 3.11 on
        return False
    return True


def read_settled(future: Future[Any]) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, exception)`` of a settled ``future``, with no poll checks.

    Raises ``CancelledError`` for a cancelled one, and ``RuntimeError`` for one
    not settled yet (wait with :func:`wait_settled` first): it never waits.
    """
    if type(future) is PoolFuture:  # its fields read once: no lock taken three times
        outcome = future.outcome()
        if outcome is not None:
            return outcome
    if not future.done():
        raise RuntimeError("read_settled() of a future that is not settled: wait_settled() first")
    exc = Future.exception(future, 0)
    if exc is not None:
        return None, exc
    return Future.result(future, 0), None


class Waiter(UnitFuture):
    """The outcome of a call whose caller blocks until it settles (``run_call``).

    No hook: settling it keeps the outcome and lets go of :attr:`lock` (made
    held), in the thread that settles the call: the caller's own when it reads
    its worker's done ring (``_delivery.read_call``), else the manager's, waking
    the caller asleep on the lock (the GIL released). It is the call's outcome
    itself (``Task`` takes it as its future), so a call makes no hook object and
    no hook call; the first settling thread wins, as for any ``UnitFuture``.
    """

    __slots__ = ("lock",)

    def __init__(self) -> None:
        # UnitFuture's fields set here, not by its constructor: a call less a call.
        self._hook = [_unused_hook]  # emptied by the first _settle: done()
        self._result: Any = None
        self._exception: BaseException | None = None
        self._cancelled = False
        self.lock = threading.Lock()
        self.lock.acquire()

    def _settle(self, result: Any, exc: BaseException | None, cancelled: bool) -> bool:
        try:
            self._hook.pop()
        except IndexError:
            return False  # settled already
        self._result, self._exception, self._cancelled = result, exc, cancelled
        self.lock.release()
        return True

    def wait(self, task: Task) -> Any:
        """``task``'s result (``task`` submitted with this as its hook), once it settles;
        raises its error (or ``CancelledError``) as ``result()`` does."""
        if self._hook:
            read_call(task.link, self, None)  # None, False: the manager settles it
            self.lock.acquire()
        if self._exception is None and not self._cancelled:
            return self._result  # result()'s reading, inline: a call less a call
        return self.result()  # raises


def _unused_hook(outcome: UnitFuture) -> None:  # pragma: no cover - a Waiter calls no hook
    raise AssertionError("a Waiter's hook is never called")
