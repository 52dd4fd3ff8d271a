"""Delivering a worker's done records: by the manager thread, or by the one caller waiting.

The manager thread delivers every result (``drain``), except while a caller
reads its own worker's done ring: a thread (not the main one) blocked on a call
that is the only one queued on its worker takes the done record itself
(:func:`read_direct`).
That takes two thread wake-ups out of the chain between two calls on one
worker (the manager's, then the caller's on its future's condition), and the
manager's GIL hand-off with them: the worker's push wakes the caller, which
decodes, completes and settles the call and goes on.

The protocol (every step says which lock):

- Claim, under the state lock: the call is the only one queued on a ready
  worker, nobody else reads that ring directly, the pool is open.
- The manager's poll set stands aside for that done ring (``Watcher.stand_aside``:
  epoll watches the fd for nothing), so its records wake only the caller. The
  manager still watches the worker's sentinel.
- The caller holds the slot's ``reading`` lock while it drains the ring and
  sleeps on it (the doorbell and the sentinel). Only the holder pops a done
  ring: the manager's ``deliver`` skips a ring whose lock is held (its doorbell
  stays readable until the holder has drained it, so the manager's level-
  triggered wait cannot miss a record), and the manager's handling of a death
  and shutdown's closing of the rings wait for it (the holder wakes on the
  death: the sentinel is in its wait).
- Done, the caller lets go of ``reading``, then, under the state lock, of
  its claim. If a call is still queued on that worker the ring is watched
  again: a record that came between its last drain and the resume wakes the
  manager, which takes the free lock and delivers it.
- Else the ring stays aside (*kept*): nothing queued means no record can
  come, and a TF op's body calls that worker again at once, so two
  ``epoll_ctl`` and a lock a call are saved. A kept ring is watched again,
  under the state lock, as soon as a call goes to that worker that its
  caller will not read directly (``CallSender.send`` without ``reader``:
  every call but ``run_call``'s, ``Watcher.sent``), and by a ``run_call``
  caller that does not read directly after all (the main thread, a second
  call queued): so every queued call's record has a reader or the manager.
  The worker's sentinel stays watched throughout; a replaced worker's slot
  leaves the kept set with the poll set's rebuild.

A death, a shutdown or a timeout ends the direct read: the caller then waits
on its future as any other, and the manager settles it as always.
"""

from __future__ import annotations

import select
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import shm

from .. import _codec, _pid
from .._errors import BrokenPoolError, SerializationError
from .._protocol import HEADER, OK, SKIPPED, body_of
from .._tracebacks import unpack_error
from ._future import CallLink, PoolFuture, UnitFuture, cancel_now

if TYPE_CHECKING:
    from ._manager import Watcher
    from ._state import PoolState, Slot


_MAIN = threading.main_thread().ident  # where a KeyboardInterrupt is raised


def drain(state: PoolState, slot: Slot) -> None:
    """Complete the futures of every record waiting in ``slot``'s done ring (``reading`` held)."""
    done = slot.done
    # Until the ring's hint says nothing more waits, not until a pop finds
    # nothing: that empty pop costs a system call (it hands the freed slots
    # back first; a worker never runs short of them, see _DONE_RING). No
    # credit is left held either way, so the doorbell's fd tells the next wait.
    while done.may_have_records():
        try:
            rec = done.try_pop()
        except shm.RingClosedError:
            return
        if rec is None:
            return
        kind, flags, _, task_id = HEADER.unpack_from(rec)
        skipped = kind == SKIPPED
        # Only the holder of ``reading`` takes tasks off the head of the queue. The
        # sender pushes a call and then queues its task, both under the state lock:
        # a quick worker's answer can come in between, so wait for the lock then.
        head = slot.queue[0] if slot.queue else None
        if head is None or head.task_id != task_id:
            with state.lock:
                head = slot.queue[0] if slot.queue else None
        view = state.view_results or (head is not None and head.view)
        ok, outcome = True, None
        if not skipped:  # the record's outcome read inline: a call less a record
            ok = kind == OK
            try:
                body = body_of(rec, flags)
                outcome = _codec.decode(body, True, view) if ok else unpack_error(body)
            except Exception as exc:
                ok, outcome = False, _unreadable(exc)
        task = state.complete(slot, task_id, skipped, ok)
        if skipped:
            task.release()
            cancel_now(task.future)  # cancelled already: cancel() said so
        elif ok:
            task.finish(outcome)  # released and settled in one frame
        else:
            task.finish(None, outcome)


def read_direct(future: Future[Any], timeout: float | None) -> bool | None:
    """Wait for ``future`` reading its worker's done ring; None: not here (wait as usual).

    True once settled, False on timeout; None when the direct path does not
    apply (not a pool future, not the only call queued on its worker, another
    caller reads that ring, the main thread, no epoll) or ended unsettled (its
    worker died, the pool stops): the caller then waits on the future's condition.
    """
    if type(future) is not PoolFuture:
        return None
    return read_call(future.link, future, timeout)


def read_call(
    link: CallLink, future: PoolFuture[Any] | UnitFuture, timeout: float | None
) -> bool | None:
    """:func:`read_direct` for the call of ``link`` whose outcome is ``future`` (a hooked
    call's too: its hook then runs in this thread)."""
    state, slot = link.state, link.slot
    if state is None or slot is None or state.pid != _pid.pid:
        return None  # settled, unsent, or a forked child's copy (the parent's call)
    watcher = state.watcher
    if watcher is None:
        return None
    if threading.get_ident() in (_MAIN, state.manager_ident):
        # The main thread never reads directly: a Ctrl-C between popping a record
        # and settling its call would lose that call's outcome (a waiter never pops
        # where a KeyboardInterrupt can reach it). The manager: it delivers. No
        # lock unless the ring is kept aside (which it cannot become with this call
        # queued on it): then the manager must watch it again.
        if slot in watcher.aside:
            _unkeep(state, slot, watcher)
        return None
    with state.lock:
        queue = slot.queue
        if (
            slot.direct
            or not slot.ready
            or state.closed
            or len(queue) != 1
            or queue[0].future is not future
        ):
            # Not here: the manager delivers it, so it watches that ring again if a
            # read before kept it aside (``run_call``'s send left it so for us).
            if not slot.direct and slot in watcher.aside:
                watcher.resume(slot)
            return None
        slot.direct = True
    settled = None
    try:
        # Kept aside since this ring's last direct read: no epoll_ctl, no lock.
        if slot in watcher.aside or watcher.stand_aside(slot):
            with slot.reading:
                if not slot.retired:
                    settled = _read(state, slot, future, timeout)
    finally:
        with state.lock:
            slot.direct = False
            # Nothing more queued on it: no record can come, and its ring stays
            # aside for the next direct read (a TF op's body calls its worker again
            # and again), whatever became of the worker or the pool meanwhile. A
            # call sent to it for the manager to deliver has it watched again
            # (``Watcher.sent``).
            if slot.queue:
                watcher.resume(slot)
    if state.pending or state.stopping:
        state.poke()  # its worker has room: the manager dispatches what waits
    return settled


def _unkeep(state: PoolState, slot: Slot, watcher: Watcher) -> None:
    """Have the manager watch ``slot``'s done ring again if it is kept aside (no claim)."""
    with state.lock:
        if not slot.direct and slot in watcher.aside:
            watcher.resume(slot)


def _read(
    state: PoolState, slot: Slot, future: PoolFuture[Any] | UnitFuture, timeout: float | None
) -> bool | None:
    """Drain ``slot``'s done ring until ``future`` settles (``reading`` held)."""
    poller = slot.direct_poll
    if poller is None:
        poller = slot.direct_poll = select.poll()
        poller.register(slot.done.fileno(), select.POLLIN)
        poller.register(slot.process.sentinel, select.POLLIN)
    deadline = None if timeout is None else time.monotonic() + timeout
    done_fd = slot.done.fileno()
    died = False
    # No drain before the first wait: the answer is rarely there yet, and if it is,
    # its doorbell is readable (drain leaves no credit held) and the poll returns
    # at once. The future is looked at first (the manager may have settled it
    # before this claim).
    look = False
    while True:
        if look:
            try:
                drain(state, slot)
            except Exception as exc:  # a bug, as in the manager: nothing else would settle
                if state.broken is None and not state.closed:
                    err = BrokenPoolError(
                        f"delivering a result failed ({type(exc).__name__}: {exc}); the pool "
                        "can run nothing more. This is a bug in mpexec: please report it"
                    )
                    err.__cause__ = exc
                    state.mark_broken(err)
                return None
        if future.done():
            return True
        if died:
            # Its worker died (or was killed): what it pushed first counted; the
            # manager, woken by the same death, settles the rest.
            return None
        if deadline is None:
            ms = None
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ms = max(1, int(left * 1000 + 0.999))
        for fd, _ in poller.poll(ms):
            if fd != done_fd:
                died = True  # (a loop, not any() over a generator: two calls less a wait)
        look = True  # woken (or timed out): drain what came


def _unreadable(exc: Exception) -> Exception:
    """The error of a call whose done record could not be read back (``exc`` raised reading it)."""
    if isinstance(exc, MemoryError):
        # Out of memory or address space mapping the result (shm.ReservationError is
        # a MemoryError): not a pickling problem, so not disguised as one.
        return exc
    err = SerializationError(
        f"the result of a call could not be read back: {type(exc).__name__}: {exc}"
    )
    err.__cause__ = exc
    return err
