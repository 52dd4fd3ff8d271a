"""A call on its way through the pool: its task, its future, and cancelling it.

A :class:`Task` is the pool's record of one call (function, arguments, the
worker it is pinned to); its :class:`PoolFuture` is what the caller holds. The
two share a :class:`CallLink`: the pool's state, the worker the call was
pushed to and its number there, for as long as the call is unsettled, so that
a future the caller keeps never keeps the pool's rings alive.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any, TypeVar

import shm

from .. import _pid
from .._errors import forked_error
from .._mapping import settle
from .._protocol import CANCEL, VERDICT, record
from .._tracebacks import for_caller

if TYPE_CHECKING:
    from ._state import PoolState, Slot

T = TypeVar("T")

_POLL_SECONDS = 1e-3  # how long result() polls for a quick call's result
_PUSH_SECONDS = 5.0  # how long a cancellation waits for room in a task ring
_LOGGER = logging.getLogger("concurrent.futures")  # where Future logs its callbacks' errors


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
        hook: Callable[[UnitFuture], object] | UnitFuture | None = None,
    ) -> None:
        self.task_id = task_id
        self.view = view  # deliver the result's arrays as read-only views, uncopied
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.worker = worker  # the worker index it must run on, or None for any
        self.link = link = CallLink(state)
        self.future: PoolFuture[Any] | UnitFuture
        if isinstance(hook, UnitFuture):
            self.future = hook  # an outcome that needs no hook (run_call's Waiter)
        elif hook is not None:
            self.future = UnitFuture(hook)
        else:
            # Future's own constructor, then the link: a constructor of PoolFuture's
            # would cost a call more on every submit (the two classes are one unit).
            future: PoolFuture[Any] = PoolFuture()
            future._mp_link = link  # noqa: SLF001 - see above
            self.future = future
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

    def settle(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Complete its future with ``result`` or ``exc``, unless it is done already."""
        future = self.future
        if isinstance(future, UnitFuture):  # run_call's Waiter too
            future._settle(result, exc, False)  # noqa: SLF001 - one unit with UnitFuture
        else:
            settle(future, result, exc)

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """:meth:`release` then :meth:`settle`, in one frame: its record came back."""
        self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        link = self.link
        link.slot = link.state = None
        future = self.future
        if isinstance(future, UnitFuture):  # run_call's Waiter too
            future._settle(result, exc, False)  # noqa: SLF001 - one unit with UnitFuture
        else:
            settle(future, result, exc)

    def fail(self, exc: BaseException) -> None:
        """Release it and fail its future with ``exc`` (unless already done)."""
        self.release()
        self.settle(exc=exc)


#: ``concurrent.futures``' states of a settled future (its ``done()``).
_SETTLED = frozenset(("CANCELLED", "CANCELLED_AND_NOTIFIED", "FINISHED"))


class PoolFuture(Future[T]):
    """A Future whose waiter polls for a quick call's result instead of sleeping.

    The manager thread delivers every result. A waiter asleep on the
    future's condition costs a thread wake-up and a GIL hand-off more (~50 us,
    most of a small call's round trip); so ``result()`` first polls
    ``done()`` for a moment, yielding the CPU (and the GIL, which the manager
    needs) between polls, and sleeps only if the result is slow to come. It
    polls only while recent calls on the pool came back within that moment,
    and only one waiting thread of the pool at a time: the others sleep on
    their future's condition (so N threads may wait in ``result()`` at once).
    The waiter never touches the pool's state: a Ctrl-C in ``result()`` can
    interrupt nothing but its own wait.
    """

    _mp_link: CallLink  # set by its Task, at once

    @property
    def link(self) -> CallLink:
        """What it knows of the pool, while unsettled (for the pool's own rooms)."""
        return self._mp_link

    def settled(self) -> bool:
        """``done()`` with no lock taken: one read (a state that moves only towards settled)."""
        return self._state in _SETTLED

    def outcome(self) -> tuple[Any, BaseException | None] | None:
        """``(result, None)`` or ``(None, exception)`` once finished, with no lock taken
        (the fields are set before the state, and change no more); None if not settled.

        Raises ``CancelledError`` for a cancelled one.
        """
        state = self._state
        if state == "FINISHED":
            return self._result, self._exception
        if state in _SETTLED:
            raise CancelledError
        return None

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
        if state.pid != _pid.pid:
            return False  # a forked child: the call is the parent's
        with state.lock:
            slot = link.slot
            if slot is None:
                return cancel_now(self)
            return cancel_pushed(slot, link.seq, self)

    def cancel_unsent(self) -> bool:
        """Cancel it (no worker will run it) and wake its waiters at once."""
        # Future.cancel() leaves waiters asleep until set_running_or_notify_cancel(),
        # which only the standard executors call: the future's own condition is the
        # one lock that makes the two steps one.
        with self._condition:
            if not Future.cancel(self):
                return False
            if self._state == "CANCELLED":  # not yet CANCELLED_AND_NOTIFIED
                self.set_running_or_notify_cancel()
            return True

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """As ``Future``'s; a callback run by the pool's thread cannot stop the pool.

        ``concurrent.futures`` logs an ``Exception`` from a callback and goes on;
        a ``SystemExit`` or ``KeyboardInterrupt`` would escape into the thread
        that completed the future, the pool's manager: that is logged too,
        naming the callback, and the pool lives on. In the thread that added
        the callback (a callback run at once, or by ``cancel()``) it propagates.
        """
        super().add_done_callback(_GuardedCallback(fn))

    def result(self, timeout: float | None = None) -> T:
        __tracebackhide__ = True  # the caller sees the call's error, not this re-raise
        try:
            return super().result(self._poll(timeout))
        except Exception as exc:
            # The same exception, its own __cause__ kept (a user sees this line).
            raise for_caller(exc)  # noqa: B904

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._poll(timeout))

    def _poll(self, timeout: float | None) -> float | None:
        """Poll for up to the pool's budget; the caller's ``timeout`` left over."""
        state = self._mp_link.state
        if state is not None and state.pid != _pid.pid and not self.done():
            # No manager thread here will ever complete it: refuse, never hang.
            raise forked_error(state.pid, "a Future of a WorkerPool")
        if (
            state is None
            or state.latency > _POLL_SECONDS
            or self.done()
            or state.manager_ident == threading.get_ident()
        ):
            return timeout
        # One waiter of the pool's polls at a time: N threads polling at once (a
        # TF map's N calls) would take the CPU and the GIL from the manager
        # thread that completes their futures. The others sleep on the condition.
        polling = state.polling
        if not polling.acquire(blocking=False):
            return timeout
        try:
            start = time.perf_counter()
            end = start + (_POLL_SECONDS if timeout is None else min(timeout, _POLL_SECONDS))
            while not self.done() and time.perf_counter() < end:
                os.sched_yield()
        finally:
            polling.release()
        if timeout is None:
            return None
        return max(0.0, timeout - (time.perf_counter() - start))


class UnitFuture:
    """The outcome of a call made with a completion hook (code built on the pool).

    What a pipeline's units need and no more: no condition, no waiters, no
    callbacks list. The thread that settles it (the manager, with the result;
    or whoever cancels or fails it) calls ``hook(self)`` once, and ``hook`` reads
    ``cancelled()``, ``exception()`` and ``result()`` as a done ``Future``'s.
    Nobody waits on it: ``result()`` of one not done raises. The first of
    settling threads wins (``list.pop`` is atomic), as ``Future``'s condition
    makes it for a ``Future``.
    """

    __slots__ = ("_cancelled", "_exception", "_hook", "_result")

    def __init__(self, hook: Callable[[UnitFuture], object]) -> None:
        self._hook = [hook]
        self._result: Any = None
        self._exception: BaseException | None = None
        self._cancelled = False

    def done(self) -> bool:
        return not self._hook

    def cancelled(self) -> bool:
        return self._cancelled

    def running(self) -> bool:
        return False

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._hook:
            raise RuntimeError("a UnitFuture is read by its hook, once settled")
        if self._cancelled:
            raise CancelledError()
        return self._exception

    def result(self, timeout: float | None = None) -> Any:
        # (Settled and not cancelled read here: no exception() frame a unit.)
        exc = self._exception if not self._hook and not self._cancelled else self.exception()
        if exc is not None:
            raise exc
        return self._result

    def set_result(self, result: Any) -> None:
        self._settle(result, None, False)

    def set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc, False)

    def cancel(self) -> bool:
        """Cancel it if not settled yet (the pool decides when; see :func:`cancel_now`)."""
        return self._settle(None, None, True)

    def _settle(self, result: Any, exc: BaseException | None, cancelled: bool) -> bool:
        try:
            hook = self._hook.pop()
        except IndexError:
            return False  # settled already
        self._result, self._exception, self._cancelled = result, exc, cancelled
        hook(self)
        return True


class _GuardedCallback:
    """A done-callback whose ``BaseException`` is logged outside the thread that added it."""

    __slots__ = ("fn", "owner")

    def __init__(self, fn: Callable[[Future[Any]], object]) -> None:
        self.fn = fn
        self.owner = threading.get_ident()

    def __call__(self, future: Future[Any]) -> None:
        try:
            self.fn(future)
            return
        except Exception:
            raise  # concurrent.futures logs it and goes on
        except BaseException as exc:
            if threading.get_ident() == self.owner:
                raise
            # As text: a record holding the traceback would keep the manager's
            # frames (and the rings they hold) alive in any handler that keeps it.
            trace = "".join(traceback.format_exception(exc))
        _LOGGER.error(
            "a done-callback of %r, %r, raised; it is ignored and the pool goes on\n%s",
            future,
            self.fn,
            trace,
        )


def cancel_now(future: PoolFuture[Any] | UnitFuture) -> bool:
    """Cancel a call no worker will run, and tell its waiters (``wait()``) at once."""
    if isinstance(future, UnitFuture):  # run_call's Waiter too
        return future.cancel()  # no waiters: its hook is told
    return future.cancel_unsent()


def cancel_pushed(slot: Slot, seq: int, future: PoolFuture[Any] | UnitFuture) -> bool:
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
