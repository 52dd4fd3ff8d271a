"""A call on its way through the pool: its task, its future, and cancelling it.

A :class:`Task` is the pool's record of one call (function, arguments, the
worker it is pinned to); its :class:`PoolFuture` is what the caller holds. The
two share a :class:`CallLink`: the pool's state, the worker the call was
pushed to and its number there, for as long as the call is unsettled, so that
a future the caller keeps never keeps the pool's rings alive.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import shm

from .._errors import forked_error
from .._mapping import settle
from .._protocol import CANCEL, VERDICT, record

if TYPE_CHECKING:
    from ._state import PoolState, Slot

T = TypeVar("T")

_POLL_SECONDS = 1e-3  # how long result() polls for a quick call's result
_PUSH_SECONDS = 5.0  # how long a cancellation waits for room in a task ring


class CallLink:
    """What a call's future knows of the pool; emptied once the call settles."""

    __slots__ = ("seq", "slot", "state")

    def __init__(self, state: PoolState) -> None:
        self.state: PoolState | None = state
        self.slot: Slot | None = None  # the worker it was pushed to, until delivered
        self.seq = 0  # its number among the calls pushed to that worker


class Task:
    """One call: what to run, where, and the future that gets its outcome."""

    __slots__ = (
        "args",
        "fn",
        "future",
        "kwargs",
        "link",
        "sent",
        "started",
        "task_id",
        "view",
        "worker",
    )

    def __init__(
        self,
        state: PoolState,
        task_id: int,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        worker: int | None = None,
        view: bool = False,
    ) -> None:
        self.task_id = task_id
        self.view = view  # deliver the result's arrays as read-only views, uncopied
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.worker = worker  # the worker index it must run on, or None for any
        self.link = link = CallLink(state)
        # Future's own constructor, then the link: a constructor of PoolFuture's
        # would cost a call more on every submit (the two classes are one unit).
        self.future: PoolFuture[Any] = PoolFuture()
        self.future._mp_link = link  # noqa: SLF001 - see above
        self.started = 0.0  # when it reached the head of its worker's queue
        self.sent = 0.0  # when it was pushed to its worker (perf_counter)

    @property
    def seq(self) -> int:
        """Its number among the calls pushed to its worker (0 until pushed)."""
        return self.link.seq

    def unpushed(self) -> None:
        """Its worker was lost before starting it: it waits to be pushed again."""
        self.link.slot = None

    def release(self) -> None:
        """Drop the call's function and arguments (kept only to rerun it elsewhere)."""
        self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        self.link.slot = None
        self.link.state = None  # settled: it needs the pool no more

    def fail(self, exc: BaseException) -> None:
        """Release it and fail its future with ``exc`` (unless already done)."""
        self.release()
        settle(self.future, exc=exc)


class PoolFuture(Future[T]):
    """A Future whose waiter polls for a quick call's result instead of sleeping.

    The manager thread delivers every result. A waiter asleep on the
    future's condition costs a thread wake-up and a GIL hand-off more (~50 us,
    most of a small call's round trip); so ``result()`` first polls
    ``done()`` for a moment, yielding the CPU (and the GIL, which the manager
    needs) between polls, and sleeps only if the result is slow to come. It
    polls only while recent calls on the pool came back within that moment.
    The waiter never touches the pool's state: a Ctrl-C in ``result()`` can
    interrupt nothing but its own wait.
    """

    _mp_link: CallLink  # set by its Task, at once

    def running(self) -> bool:
        """True once a worker has started the call (not merely received it)."""
        slot = self._mp_link.slot
        if slot is None or self.done():
            return super().running()
        try:
            return slot.done.progress() >= self._mp_link.seq
        except (ValueError, TypeError):  # pragma: no cover - its rings released
            return False

    def cancel(self) -> bool:
        """Cancel the call if no worker has started it; True if it will never run.

        A call waiting in the pool is dropped; one already pushed to a
        worker is skipped by that worker (see ``_protocol``'s cancellation).
        """
        link = self._mp_link
        state = link.state
        if state is None:
            return cancel_now(self)
        if state.pid != os.getpid():
            return False  # a forked child: the call is the parent's
        with state.lock:
            slot = link.slot
            if slot is None:
                return cancel_now(self)
            return cancel_pushed(slot, link.seq, self)

    def result(self, timeout: float | None = None) -> T:
        return super().result(self._poll(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._poll(timeout))

    def _poll(self, timeout: float | None) -> float | None:
        """Poll for up to the pool's budget; the caller's ``timeout`` left over."""
        state = self._mp_link.state
        if state is not None and state.pid != os.getpid() and not self.done():
            # No manager thread here will ever complete it: refuse, never hang.
            raise forked_error(state.pid, "a Future of a WorkerPool")
        if (
            state is None
            or state.latency > _POLL_SECONDS
            or self.done()
            or state.manager_ident == threading.get_ident()
        ):
            return timeout
        start = time.perf_counter()
        end = start + (_POLL_SECONDS if timeout is None else min(timeout, _POLL_SECONDS))
        while not self.done() and time.perf_counter() < end:
            os.sched_yield()
        if timeout is None:
            return None
        return max(0.0, timeout - (time.perf_counter() - start))


def cancel_now(future: Future[Any]) -> bool:
    """Cancel a call no worker will run, and tell its waiters (``wait()``) at once."""
    # Future.cancel() leaves waiters asleep until set_running_or_notify_cancel(),
    # which only the standard executors call: the future's own condition is the
    # one lock that makes the two steps one.
    with future._condition:  # noqa: SLF001 - concurrent.futures' lock, see above
        if not Future.cancel(future):
            return False
        if future._state == "CANCELLED":  # noqa: SLF001 - not yet CANCELLED_AND_NOTIFIED
            future.set_running_or_notify_cancel()
        return True


def cancel_pushed(slot: Slot, seq: int, future: Future[Any]) -> bool:
    """Cancel call ``seq`` pushed to ``slot``'s worker unless it started (state lock held).

    The handshake of ``_protocol``'s cancellation: CANCEL, read the worker's
    progress, VERDICT. The worker, which waits for the verdict once it has
    seen CANCEL, then skips the call exactly when this returns True.
    """
    if future.done():
        return future.cancelled()
    if not slot.ready or slot.done.progress() >= seq:
        return False  # running, or its worker is being replaced: it decides
    watch = [slot.process]
    try:
        slot.tasks.push(record(CANCEL, b"", seq), timeout=_PUSH_SECONDS, watch=watch)
        started = slot.done.progress() >= seq
        verdict = b"\x00" if started else b"\x01"
        slot.tasks.push(record(VERDICT, verdict, seq), timeout=_PUSH_SECONDS, watch=watch)
    except (shm.SharedMemoryError, ValueError):
        return False  # the worker died or the pool is stopping: the manager fails it
    return not started and cancel_now(future)
