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
from concurrent.futures import TimeoutError as FuturesTimeoutError
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
# How long a waiter sleeps on its gate before it looks again. Only a gate left shut
# needs the look (a waiter interrupted between taking and giving it back, a cancel
# interrupted as it opened the gates), so it is long: each look wakes a waiter of a
# slow call (0.1 s cost map's main thread ~0.6 us a sample at 2 workers).
_GATE_SECONDS = 1.0
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
    their future's gate (so N threads may wait in ``result()`` at once).
    The waiter never touches the pool's state nor takes the future's
    condition (which the manager takes to settle it): a Ctrl-C in
    ``result()`` can interrupt nothing but its own wait.
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
        if slot is None or self._state in _SETTLED:
            return self._state == "RUNNING"  # (Future's, with no lock taken)
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

    def _condition_lock(self) -> Any:
        """The lock of its condition, for a ``with``: taken with no window.

        ``with self._condition`` takes it in ``Condition.__enter__``, a Python
        function: a Ctrl-C as its acquire returns (a point where CPython raises
        one) leaves the lock taken for good, and the manager hangs settling the
        future. ``with`` on the lock itself calls its C ``__enter__``, with no
        such point between the acquire and the block.
        """
        return self._condition._lock  # type: ignore[attr-defined]  # noqa: SLF001 - Condition's

    def cancel_unsent(self) -> bool:
        """Cancel it (no worker will run it) and wake its waiters at once."""
        # Future.cancel() leaves waiters asleep until set_running_or_notify_cancel(),
        # which only the standard executors call: both steps here, as one. Under the
        # condition's lock itself, taken by ``with`` (see _condition_lock).
        with self._condition_lock():
            state = self._state
            if state in ("RUNNING", "FINISHED"):
                return False
            if state in _SETTLED:
                return True  # cancelled already
            self._state = "CANCELLED_AND_NOTIFIED"
            for waiter in self._waiters:
                waiter.add_cancelled(self)
            self._condition.notify_all()
        self._invoke_callbacks()  # type: ignore[attr-defined]
        return True

    def add_done_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """As ``Future``'s; a callback run by the pool's thread cannot stop the pool.

        ``concurrent.futures`` logs an ``Exception`` from a callback and goes on;
        a ``SystemExit`` or ``KeyboardInterrupt`` would escape into the thread
        that completed the future, the pool's manager: that is logged too,
        naming the callback, and the pool lives on. In the thread that added
        the callback (a callback run at once, or by ``cancel()``) it propagates.
        """
        guarded = _GuardedCallback(fn)
        with self._condition_lock():
            if self._state not in _SETTLED:
                self._done_callbacks.append(guarded)  # type: ignore[attr-defined]
                return
        try:
            guarded(self)
        except Exception:
            _LOGGER.exception("exception calling callback for %r", self)

    def done(self) -> bool:
        """As ``Future``'s, with no lock taken (see :meth:`settled`)."""
        return self._state in _SETTLED

    def result(self, timeout: float | None = None) -> T:
        __tracebackhide__ = True  # the caller sees the call's error, not this re-raise
        value, exc = self._wait(timeout)
        if exc is None:
            return value  # type: ignore[no-any-return]
        try:
            # The same exception, its own __cause__ kept (a user sees this line).
            raise for_caller(exc) if isinstance(exc, Exception) else exc
        finally:
            # As Future.result: this frame, in the traceback, would keep the future
            # (which holds the exception) alive in a cycle.
            self = exc = None  # type: ignore[assignment]  # noqa: PLW0642

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._wait(timeout)[1]

    def _wait(self, timeout: float | None) -> tuple[Any, BaseException | None]:
        """Its outcome once settled, waiting up to ``timeout``, never holding ``_condition``.

        ``Future.result()`` takes the future's condition, and a Ctrl-C as its
        acquire returns (``Condition.__enter__``, ``Condition.wait``) leaves it
        held for good: the manager, settling the future, then blocks on it and
        the whole pool hangs. Here the waiter reads the state lock-free and
        sleeps on a gate of its own (see :class:`_Gate`) that only the manager
        releases; an interrupt anywhere here leaves nothing the manager needs.
        """
        got = self.outcome()
        if got is None:
            left = self._poll(timeout)
            if self._state not in _SETTLED:
                self.block(left)
            got = self.outcome()
            if got is None:
                raise FuturesTimeoutError
        return got

    def block(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for it to settle, asleep on its gate (no poll, no lock
        the manager takes: a Ctrl-C anywhere here leaves the pool working)."""
        gate: _Gate | None = self.__dict__.get("_mp_gate")
        if gate is None:
            new = _Gate()
            # Registered before it is published: a gate others find is always one
            # the manager will open (an interrupt in between leaves a spare).
            self._waiters.append(new)  # type: ignore[arg-type]
            gate = self.__dict__.setdefault("_mp_gate", new)
        end = None if timeout is None else time.monotonic() + timeout
        lock = gate.lock
        while self._state not in _SETTLED:
            # Bounded: a waiter interrupted between its acquire and release holds
            # the gate shut for the others; they find the state settled on waking.
            wait = _GATE_SECONDS if end is None else min(_GATE_SECONDS, end - time.monotonic())
            if wait <= 0:
                return
            if lock.acquire(timeout=wait):
                lock.release()  # open again, for the next waiter
                return

    def _poll(self, timeout: float | None) -> float | None:
        """Poll for up to the pool's budget; the caller's ``timeout`` left over."""
        state = self._mp_link.state
        if state is not None and state.pid != _pid.pid and self._state not in _SETTLED:
            # No manager thread here will ever complete it: refuse, never hang.
            raise forked_error(state.pid, "a Future of a WorkerPool")
        if (
            state is None
            or state.latency > _POLL_SECONDS
            or self._state in _SETTLED
            or state.manager_ident == threading.get_ident()
        ):
            return timeout
        # One waiter of the pool's polls at a time: N threads polling at once (a
        # TF map's N calls) would take the CPU and the GIL from the manager
        # thread that completes their futures. The others sleep on their gate.
        # A deadline, not a lock: one an interrupt leaves set lapses by itself.
        start = time.perf_counter()
        if state.polling_until > start:
            return timeout
        end = start + (_POLL_SECONDS if timeout is None else min(timeout, _POLL_SECONDS))
        state.polling_until = end
        while self._state not in _SETTLED and time.perf_counter() < end:
            os.sched_yield()
        state.polling_until = 0.0
        if timeout is None:
            return None
        return max(0.0, timeout - (time.perf_counter() - start))


class _Gate:
    """What a :class:`PoolFuture`'s waiters sleep on: a lock shut until the future settles.

    One of the future's ``_waiters`` (as ``concurrent.futures.wait`` adds its
    own), so the manager opens it as it settles the future, under the future's
    condition; a waiter takes it and gives it back at once. Nobody but the
    manager ever waits on a lock the manager takes.
    """

    __slots__ = ("add_cancelled", "add_exception", "add_result", "lock")

    def __init__(self) -> None:
        lock = threading.Lock()
        lock.acquire()
        self.lock = lock
        # ``add_result(future)`` and the others are the lock's own C ``__exit__``, which
        # releases it whatever its arguments: opening the gate runs no Python frame (a
        # call less a settle, and no frame entry before the release for a Ctrl-C).
        self.add_result: Callable[..., Any] = lock.__exit__
        self.add_exception: Callable[..., Any] = lock.__exit__
        self.add_cancelled: Callable[..., Any] = lock.__exit__


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
    watch, ring = [slot.process], slot.tasks
    before = ring.pushed
    started = True  # (until the progress is read: the verdict "run it")
    try:
        ring.push(record(CANCEL, b"", seq), timeout=_PUSH_SECONDS, watch=watch)
        started = slot.done.progress() >= seq
        verdict = b"\x00" if started else b"\x01"
        ring.push(record(VERDICT, verdict, seq), timeout=_PUSH_SECONDS, watch=watch)
        return not started and cancel_now(future)
    except (shm.SharedMemoryError, ValueError):
        return False  # the worker died or the pool is stopping: the manager fails it
    except BaseException:
        # A Ctrl-C: a worker that saw CANCEL waits for its verdict, and one told to
        # skip the call leaves its future to us. The ring's count says how far it got.
        sent = ring.pushed - before
        if sent == 1:
            ring.push(record(VERDICT, b"\x00", seq), timeout=_PUSH_SECONDS, watch=watch)
        elif sent == 2 and not started:
            cancel_now(future)
        raise
