"""The manager thread: delivers results, notices deaths and timeouts, restarts workers.

Modelled on CPython's ``_ExecutorManagerThread``: :class:`Manager` is given,
when it is made, exactly what it works with (the pool's state, the
:class:`WorkerFactory` that starts a replacement, the :class:`CallSender` that
hands waiting calls to workers) and the pool itself only as a weak reference,
so that a pool dropped without ``shutdown`` is collected (its finalizer then
stops everything, this thread included). Its loop is a few named steps.
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
import weakref
from typing import Any

import shm

from .._errors import BrokenPoolError, PoolClosedError, TaskTimeoutError
from . import _crash, _stop
from ._delivery import drain
from ._factory import WorkerFactory, died_starting, hello
from ._sender import CallSender
from ._state import PoolState, Slot


class Manager(threading.Thread):
    """Runs until the pool stops: one wait, then what it woke for (see :meth:`manage_once`)."""

    def __init__(
        self,
        state: PoolState,
        factory: WorkerFactory,
        sender: CallSender,
        timeout: float | None,
        pool_ref: weakref.ref[Any],
    ) -> None:
        super().__init__(name="mpexec-pool-manager", daemon=True)
        self.state = state  # the slots, queues and flags it shares with the pool
        self.factory = factory  # starts a replacement for a lost worker
        self.sender = sender  # hands waiting calls to workers with room
        self.timeout = timeout  # seconds a call may run, or None
        # The pool, weakly: only to ask whether it still lives and restarts workers.
        self.pool_ref = pool_ref
        # Held while it runs, except while it waits: see handed_out.
        self.handing_out = threading.Lock()

    def run(self) -> None:
        state = self.state
        state.manager_started()
        # Local, as every slot it polls: the rings go with the pool's stop, not with
        # this thread object (which the pool keeps).
        watcher = Watcher(state)
        self.handing_out.acquire()
        try:
            self.loop(watcher)
        finally:
            self.handing_out.release()
            watcher.close()
            # The pool was collected without shutdown(): nobody else stops the workers.
            _stop.drained(state)

    def loop(self, watcher: Watcher) -> None:
        """Manage until stopped; a failure breaks the pool (nothing else would settle it)."""
        state = self.state
        try:
            while self.manage_once(watcher):
                pass
        except BaseException as exc:
            if state.closed and isinstance(exc, (shm.SharedMemoryError, ValueError)):
                return  # rings closed under us by shutdown
            # Nothing else would ever complete a future: break the pool, loudly.
            err = BrokenPoolError(
                f"the pool's manager thread failed ({type(exc).__name__}: {exc}); the pool "
                "can run nothing more. This is a bug in mpexec: please report it with the "
                "traceback (the __cause__)"
            )
            err.__cause__ = exc  # with its traceback: where the manager failed
            state.mark_broken(err)

    def manage_once(self, watcher: Watcher) -> bool:
        """Wait for a result, a death, a deadline or a poke; handle it. False: stopped."""
        state = self.state
        with state.lock:
            if state.stopping and not state.pending and not any(s.queue for s in state.slots):
                return False
            # No deadline to look for (no call timeout, no worker starting): the common case.
            timeout = (
                None if self.timeout is None and not state.roster.starting else self.next_deadline()
            )
            if state.closed and (timeout is None or timeout > _CLOSING_WAIT):
                # Shut down: its rings may be closed under us, which an epoll set
                # drops without a word (poll said POLLNVAL): look again soon.
                timeout = _CLOSING_WAIT
        self.handing_out.release()  # waiting, it holds nothing it handed out
        try:
            ready = watcher.wait(timeout)
        finally:
            self.handing_out.acquire()
        died: list[Slot] = []
        for slot, what in ready:
            if slot is None:
                watcher.drain_wake()
            elif slot.start_deadline is not None:
                self.started(slot, died=what == "died")
            elif what == "done":
                self.deliver(slot)
            else:
                died.append(slot)
        for slot in died:
            if slot.ready:
                self.worker_lost(slot, died=True)
        if state.roster.starting:
            self.check_start_deadlines()
        if self.timeout is not None:
            self.check_timeouts()
        if state.pending:
            self.dispatch_pending()
        return True

    def handed_out(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until this thread holds nothing it handed out.

        A caller woken by a result (a future's callbacks run here) can go on
        before this thread has left them and dropped its references. An
        error's traceback holds the caller's frames: the caller's last
        reference to an object in them (a pipeline) would not be the last one,
        and its finalizer would run late, on this thread.
        """
        if threading.current_thread() is self:
            return
        # Seen free once is enough: this thread holds it whenever it runs. Polled, not
        # acquired: a Ctrl-C as an acquire(timeout) returned would keep it held for good
        # (the manager would then wait forever), and the poll holds nothing.
        lock = self.handing_out
        end = time.monotonic() + timeout
        while lock.locked() and time.monotonic() < end:
            time.sleep(0.0005)

    # ------------------------------------------------------------ the steps
    def deliver(self, slot: Slot) -> None:
        """Complete the futures of every record waiting in ``slot``'s done ring.

        Unless a caller reads that ring itself (see ``_delivery``): it holds the
        ring's ``reading`` lock and delivers them; the ring's doorbell stays
        readable until someone has, so nothing is missed by stepping aside.
        """
        if not slot.reading.acquire(blocking=False):
            return
        try:
            drain(self.state, slot)
        finally:
            slot.reading.release()

    def started(self, slot: Slot, died: bool) -> None:
        """A replacement worker said hello (it is ready now), failed, or died starting."""
        state = self.state
        try:
            rec = slot.done.try_pop()
            if rec is None and not died:
                return
            if rec is None:
                slot.process.join(1)
                raise died_starting(slot)
            with state.lock:
                hello(slot, rec)
        except (BrokenPoolError, shm.SharedMemoryError) as exc:
            slot.start_deadline = None
            state.mark_broken(exc if isinstance(exc, BrokenPoolError) else died_starting(slot))

    def worker_lost(self, slot: Slot, died: bool) -> None:
        """A worker died or overran its call: fail that call, then restart or break."""
        state = self.state
        proc = slot.process
        # Its sentinel can fire before the exit status is there to read: decide by
        # the event, never by ``exitcode is None``.
        overran = not died
        if overran:
            proc.kill()
        proc.join(5)
        # A caller reading its done ring directly wakes on the death and lets go.
        with slot.reading:
            with contextlib.suppress(shm.SharedMemoryError):
                drain(state, slot)  # what it finished before dying still counts
            progress = slot.done.progress()  # how many of its calls it had started
            tasks = state.lose_worker(slot)
            shm.set_release_route(slot.arena_id, None)
            pool = self.pool_ref()
            if pool is not None:
                self.factory.retire(slot)
            slot.close_rings()
        # Calls run in order: only the first undelivered one can have started.
        running = tasks[0] if tasks and (overran or tasks[0].seq <= progress) else None
        error: BaseException
        if state.stopping:
            error = PoolClosedError("the pool was shut down before this call finished")
        elif overran:
            error = _timeout_error(self.timeout, slot.pid)
        else:
            error = _crash.crash_error(slot.index, slot.pid, proc.exitcode, running is not None)
        restart = not state.stopping and pool is not None and (overran or pool.restart)
        if not restart and not state.stopping:
            # Broken before any future fails: a caller woken by the failure must
            # find the pool broken (as concurrent.futures does).
            state.mark_broken(_crash.as_broken(error), tasks)
            return
        # The running call fails; the others never started: with a restart, rerun them.
        rerun = []
        for task in tasks:
            if task is running or not restart:
                state.count_failed()
                task.fail(error)
            elif task.future.cancelled():
                task.release()
            else:
                task.unpushed()
                rerun.append(task)
        state.requeue_first(rerun)
        if state.stopping:
            # No replacement while stopping: with no worker left, the calls still
            # waiting would wait forever (and shutdown with them).
            state.fail_pending_if_no_worker(error)
            return
        if restart and pool is not None:
            try:
                # Not waiting for its hello here: the manager reads it with the results.
                self.factory.relaunch(slot)
            except BaseException as exc:
                state.mark_broken(_crash.as_broken(exc))
            else:
                state.count_restart()

    def check_start_deadlines(self) -> None:
        """A replacement that has not said hello in time breaks the pool."""
        roster = self.state.roster
        if not roster.starting:
            return
        with self.state.lock:
            starting = sorted(roster.starting, key=lambda s: s.index)
        for slot in starting:
            if slot.start_deadline is not None and time.monotonic() > slot.start_deadline:
                self.state.mark_broken(
                    BrokenPoolError(f"worker {slot.index} (pid {slot.pid}) did not start")
                )
                slot.start_deadline = None

    def check_timeouts(self) -> None:
        """A worker whose call has run past the pool's timeout is killed and replaced."""
        timeout = self.timeout
        if timeout is None:
            return
        state = self.state
        while True:
            with state.lock:  # the oldest call first: only those past it are looked at
                oldest = state.roster.oldest_call()
            if oldest is None or time.monotonic() - oldest[0] <= timeout:
                return
            self.worker_lost(oldest[1], died=False)  # it is not ready after this

    def dispatch_pending(self) -> None:
        """Calls waiting in the pool go to workers that have room now."""
        # A collected pool's calls are dispatched too: it finishes what it was given.
        with self.state.lock:
            self.sender.dispatch_pending()

    def next_deadline(self) -> float | None:
        """Seconds until the earliest start or call deadline (None: no deadline; lock held)."""
        roster = self.state.roster
        ends = [s.start_deadline for s in roster.starting if s.start_deadline is not None]
        if self.timeout is not None and (oldest := roster.oldest_call()) is not None:
            ends.append(oldest[0] + self.timeout)
        if not ends:
            return None
        return max(0.0, min(ends) - time.monotonic()) + 0.001


class Watcher:
    """One poll set over the wake-up ring, every done ring and every sentinel.

    Rebuilt only when the workers change (the roster's version): the manager
    waits once per completion, and building a poll set costs as much as the
    rest of the wait. An ``epoll`` set where there is one (Linux): ``poll``
    hands the kernel every fd on every wait (2 a worker: 4 µs of system time
    a wait at 64 workers, growing with them), ``epoll`` keeps them registered
    and a wait costs what is ready.
    """

    def __init__(self, state: PoolState) -> None:
        self.state = state
        self.key = -1
        self.poller: Any = None
        self.by_fd: dict[int, tuple[Slot | None, str]] = {}
        # Done rings a caller reads itself (stand_aside), or kept aside after its read
        # for the next (nothing queued on them but calls their callers will read
        # directly; see _delivery.read_call and sent()): watched for nothing meanwhile.
        self.aside: set[Slot] = set()
        self.lock = threading.Lock()  # the poll set's changes: this thread's and callers'
        if _EPOLL:
            state.watcher = self  # callers may read a done ring directly (epoll only)

    def close(self) -> None:
        """Give the epoll fd back (the manager ends)."""
        with self.lock:
            if self.state.watcher is self:
                self.state.watcher = None
            if _EPOLL and self.poller is not None:
                self.poller.close()
            self.poller = None

    def stand_aside(self, slot: Slot) -> bool:
        """Stop watching ``slot``'s done ring (a caller reads it); False: not watched here."""
        fd = slot.done.fileno()  # once: a ring's fileno() is three calls
        with self.lock:
            if self.poller is None or self.by_fd.get(fd, (None,))[0] is not slot:
                return False  # not started, or not yet in the poll set (a replacement)
            self.poller.modify(fd, 0)
            self.aside.add(slot)
            return True

    def resume(self, slot: Slot) -> None:
        """Watch ``slot``'s done ring again: what came meanwhile wakes the manager."""
        with self.lock:
            try:  # not contextlib.suppress: three calls less a call
                fd = slot.done.fileno()
                if self.poller is not None and self.by_fd.get(fd, (None,))[0] is slot:
                    self.poller.modify(fd, select.EPOLLIN)
            except (OSError, ValueError):
                pass
            # Only once watched: interrupted before (Ctrl-C in the main thread), it
            # is still aside, which the next call sent to it puts right (sent()).
            self.aside.discard(slot)

    def sent(self, slot: Slot) -> None:
        """A call whose caller will not read it directly went to ``slot`` (state lock
        held): a done ring kept aside since a direct read (``_delivery.read_call``)
        is watched again, so that the manager delivers its answer."""
        if not slot.direct and slot in self.aside:
            self.resume(slot)

    def wait(self, timeout: float | None) -> list[tuple[Slot | None, str]]:
        state = self.state
        if state.roster.version != self.key:
            with state.lock:
                key, slots = state.roster.version, list(state.slots)
            wake = self.state.wake
            if wake is None:
                self.close()
                raise ValueError("the pool stopped")  # its rings are closed: the manager ends
            with self.lock:
                if self.poller is not None:
                    self.poller.close()
                self.poller = select.epoll() if _EPOLL else select.poll()
                self.by_fd = {wake.fileno(): (None, "wake")}
                for slot in slots:
                    if slot.ready or slot.start_deadline is not None:
                        self.by_fd[slot.done.fileno()] = (slot, "done")
                        self.by_fd[slot.process.sentinel] = (slot, "died")
                self.aside &= set(slots)
                watch = select.EPOLLIN if _EPOLL else select.POLLIN
                for fd, (owner, what) in self.by_fd.items():
                    aside = what == "done" and owner in self.aside
                    self.poller.register(fd, 0 if aside else watch)
                self.key = key
        # deliver() drains a done ring (try_pop until None), so it never holds
        # credits that its doorbell no longer shows: polling the fds is enough.
        if _EPOLL:  # seconds, rounded up to the next millisecond by epoll itself
            events = self.poller.poll(-1 if timeout is None else max(0.0, timeout))
        else:
            events = self.poller.poll(
                None if timeout is None else max(0, int(timeout * 1000 + 0.999))
            )
        by_fd = self.by_fd
        ready = []
        for fd, _ in events:  # a loop, not a comprehension: one Python call less a wait
            if fd in by_fd:
                ready.append(by_fd[fd])
        return ready

    def drain_wake(self) -> None:
        """Take the pokes off the wake-up ring."""
        with contextlib.suppress(shm.RingTimeoutError):
            wake = self.state.wake
            if wake is not None:
                wake.pop_many(timeout=0)


_EPOLL = hasattr(select, "epoll")
_CLOSING_WAIT = 0.05  # seconds the manager of a shut-down pool sleeps at most


def _timeout_error(timeout: float | None, pid: int) -> TaskTimeoutError:
    return TaskTimeoutError(
        f"a call ran longer than the pool's timeout of {timeout} s; its worker "
        f"(pid {pid}) was killed and replaced"
    )
