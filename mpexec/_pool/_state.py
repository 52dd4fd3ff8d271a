"""What the pool and its manager thread share: worker slots, queues, counters, flags.

Every change of the pool's condition (broken, closing, stopped) and of its
queues is a method of :class:`PoolState`, under its one lock: the executor,
the manager thread and a cancelling caller call these, never set the fields
themselves. Reading a field (``state.slots``, ``state.broken``) is fine.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import shm

from .. import _pid, _protocol
from .._errors import PoolClosedError, forked_error, raised_again
from ._future import Task, cancel_now, cancel_pushed

if TYPE_CHECKING:
    from ._manager import Watcher

_IN_FLIGHT = 8  # tasks queued on one worker at most; the rest wait in the pool
# Up to this many workers the roster keeps no heap: least_busy() looks at each (at 2
# workers ~50 bytecodes a pick, where the heap's upkeep and stale entries took ~240).
_SCAN_MAX = 4
# A task takes up to five records (forget, function, call; cancel and verdict):
# 40 in flight. A busy worker gives freed slots back only every half ring, so it
# may sit on up to half of them: the task ring needs 40 + 47 < 96. The manager
# gives freed done-ring slots back every half ring too (up to 11 held), and a
# worker sends one record a task: 8 + 11 < 24.
_TASK_RING = 96
_DONE_RING = 3 * _IN_FLIGHT


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool: work done, and the shared memory behind it."""

    num_workers: int
    submitted: int
    completed: int
    failed: int
    pending: int
    restarts: int
    bytes_shared: int
    bytes_copied: int
    arena: shm.ArenaStats
    #: Minor page faults the live workers took since they started (Linux; 0
    #: elsewhere): compare two snapshots to see what a stretch of work faulted.
    worker_faults: int = 0


@dataclass(frozen=True)
class PoolStatus:
    """Whether a pool can take calls, and which process it belongs to (a snapshot).

    ``state`` is ``"running"``; ``"broken"`` (a worker died or failed to start:
    every call raises the stored :class:`~mpexec.BrokenPoolError`); ``"closed"``
    (shut down); or ``"forked"`` (this process inherited the pool through
    ``os.fork()`` from ``owner_pid``, and cannot use it).
    """

    state: Literal["running", "broken", "closed", "forked"]
    owner_pid: int

    @property
    def usable(self) -> bool:
        """True while calls may be submitted."""
        return self.state == "running"


class Slot:
    """One worker process and the rings and bookkeeping that go with it.

    Its ``ready`` and ``start_deadline``, and its queue through :meth:`enqueue`
    and :meth:`PoolState.complete`, are reported to the pool's :class:`Roster`
    as they change.
    """

    def __init__(self, index: int, generation: int) -> None:
        self.index = index
        self.generation = generation
        self.process: Any = None
        self.pid = 0
        self.tasks = shm.Ring(_TASK_RING, _protocol.RECORD_SIZE)
        self.done = shm.Ring(_DONE_RING, _protocol.RECORD_SIZE)
        self.arg_releases: shm.Ring | None = None
        self.result_releases = shm.Ring(4096, shm.RELEASE_RECORD_SIZE)
        self.arena_id = 0
        self.queue: collections.deque[Task] = collections.deque()
        self.fns: set[int] = set()
        self.forget: list[int] = []
        self.calls = 0  # CALL records pushed (the worker numbers them the same way)
        self.roster: Roster | None = None  # the pool's, once installed
        # Held by whoever pops the done ring: the manager delivering, or a caller
        # reading it directly (``_delivery``); ``direct``: a caller has claimed it.
        self.reading = threading.Lock()
        self.direct = False
        self.direct_poll: Any = None  # that caller's wait: the doorbell and the sentinel
        self.retired = False  # its rings are closed (set under ``reading``)
        self._ready = False
        self.tick = 0  # the roster's tick when its queue last changed (ready)
        # While a replacement starts (the manager reads its hello, never waits for it).
        self._start_deadline: float | None = None

    @property
    def ready(self) -> bool:
        """Whether it takes calls (its hello was read, and it was not lost since)."""
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value
        if self.roster is not None:
            self.roster.changed(self)

    @property
    def start_deadline(self) -> float | None:
        """While it starts (after the pool's): when it must have said hello."""
        return self._start_deadline

    @start_deadline.setter
    def start_deadline(self, value: float | None) -> None:
        self._start_deadline = value
        if self.roster is not None:
            self.roster.changed(self)

    def take_forgotten(self) -> list[int]:
        """The ids of functions its worker is to drop with its next task (taken off)."""
        forget, self.forget = self.forget, []
        return forget

    def enqueue(self, task: Task, fn_id: int) -> None:
        """``task`` was pushed to this worker, which now knows function ``fn_id``."""
        self.fns.add(fn_id)
        self.calls += 1
        task.link.slot, task.link.seq = self, self.calls  # where its future looks
        first = not self.queue
        if first:
            task.started = time.monotonic()
        self.queue.append(task)
        if self.roster is not None:
            self.roster.loaded(self, first)

    def has_room(self) -> bool:
        return self._ready and len(self.queue) < _IN_FLIGHT

    def close_rings(self) -> None:
        """Close its rings (``reading`` held: nobody pops or waits on them now)."""
        self.retired = True
        self.direct_poll = None
        for ring in (self.tasks, self.done, self.result_releases):
            ring.close()


class Roster:
    """The workers, ordered as the pool and its manager read them (under the state's lock).

    So that neither a dispatch nor a wake-up of the manager looks at every
    worker (with 64-128 workers, most of a call's cost in the main process):

    - by load: ``(calls queued, tick, index)`` of the ready workers, in a heap:
      the least busy one in O(log W) (:meth:`least_busy`), and among equally
      busy ones the one whose queue changed longest ago (``tick``: when it was
      last given or gave back a call). Lowest index first, a pool's first map
      over workers that started a few ms apart gave the early, low ones a
      second chunk of the last round while a late one got none;
    - with a call timeout, by deadline: when each worker's oldest call started;
    - the workers starting (with a start deadline), a set;
    - ``version``, bumped whenever which workers are ready or starting changes
      (the manager rebuilds its poll set only then).

    A heap entry is pushed at each change and checked against its worker when
    it reaches the top (one that is not its worker's latest is dropped there),
    and the heap is rebuilt when stale entries outnumber live ones. With
    ``_SCAN_MAX`` workers or fewer there is no heap: a pick looks at each.
    """

    def __init__(self, state: PoolState, timed: bool) -> None:
        self.state = state
        self.timed = timed  # the pool has a call timeout: keep the deadlines
        self.by_load: list[tuple[int, int, int, int]] = []  # (queued, tick, index, gen)
        self.ticks = itertools.count(1)
        # Up to _SCAN_MAX workers, no heap: a look at each costs less than its upkeep.
        self.scan = True
        self.by_start: list[tuple[float, int, int, int]] = []  # (started, index, gen, task id)
        self.starting: set[Slot] = set()
        self.version = 0

    def _current(self, index: int, generation: int) -> Slot | None:
        slots = self.state.slots
        slot = slots[index] if index < len(slots) else None
        return slot if slot is not None and slot.generation == generation else None

    def changed(self, slot: Slot) -> None:
        """``slot`` became ready or not, started or stopped starting, or was installed."""
        with self.state.lock:  # the manager's steps change these without it
            self.version += 1
            if slot.start_deadline is not None:
                self.starting.add(slot)
            else:
                self.starting.discard(slot)
            self.loaded(slot, bool(slot.queue))

    def loaded(self, slot: Slot, new_head: bool) -> None:
        """``slot``'s queue changed; ``new_head``: its oldest call is a new one (lock held)."""
        # The attribute, not the property (this module's own): this runs twice a call.
        if slot._ready:  # noqa: SLF001
            slot.tick = tick = next(self.ticks)
            if not self.scan:  # (a few workers: least_busy() reads them all, no heap)
                heapq.heappush(self.by_load, (len(slot.queue), tick, slot.index, slot.generation))
                if len(self.by_load) > 4 * len(self.state.slots) + 64:
                    self._rebuild()
            if self.timed and new_head and slot.queue:
                task = slot.queue[0]
                heapq.heappush(
                    self.by_start, (task.started, slot.index, slot.generation, task.task_id)
                )

    def _rebuild(self) -> None:
        """The heap by load afresh: one entry a ready worker, its latest."""
        self.by_load = [
            (len(s.queue), s.tick, s.index, s.generation) for s in self.state.slots if s.ready
        ]
        heapq.heapify(self.by_load)

    def clear(self) -> None:
        """Forget every worker (the pool let go of them): a worker kept here would keep
        its process object, and what that holds, for as long as the pool's state lives."""
        self.by_load.clear()
        self.scan = True
        self.by_start.clear()
        self.starting.clear()
        self.version += 1

    def least_busy(self) -> Slot | None:
        """The ready worker with the fewest calls queued (of those, the one whose queue
        changed longest ago); None: all full."""
        slots = self.state.slots
        if self.scan:  # the same choice, by a look at each (a handful) of them
            best = None
            key = (_IN_FLIGHT, 0)
            for one in slots:
                if one._ready:  # noqa: SLF001 - this module's own
                    k = (len(one.queue), one.tick)
                    if k < key:
                        best, key = one, k
            return best
        heap = self.by_load
        while heap:
            queued, tick, index, generation = heap[0]
            # _current() and the ready property inline: this runs once a call, and
            # looks at a stale entry or two each time (the manager pushes entries too).
            slot = slots[index] if index < len(slots) else None
            if (
                slot is not None
                and slot.generation == generation
                and slot._ready  # noqa: SLF001 - this module's own
                and slot.tick == tick
                and len(slot.queue) == queued
            ):
                return slot if queued < _IN_FLIGHT else None
            heapq.heappop(heap)
        return None

    def oldest_call(self) -> tuple[float, Slot] | None:
        """When the longest-running worker's call started, and that worker (with a timeout)."""
        heap = self.by_start
        while heap:
            started, index, generation, task_id = heap[0]
            slot = self._current(index, generation)
            if slot is not None and slot.ready and slot.queue:
                head = slot.queue[0]
                if head.task_id == task_id and head.started == started:
                    return started, slot
            heapq.heappop(heap)
        return None


class PoolState:
    """Everything the pool and its manager thread share (the manager holds only this).

    ``arena`` is the pool's main arena (None for an inline pool, and once
    stopped: its memory is unmapped as soon as nothing made from it is held).
    """

    def __init__(
        self, *, inline: bool = False, view_results: bool = False, timed: bool = False
    ) -> None:
        self.pid = _pid.pid  # the process that owns it; a forked child does not
        self.inline = inline  # num_workers=0: calls run in the caller
        self.arena: shm.Arena | None = None
        self.last_pids: list[int] = []  # the workers' pids, kept after shutdown
        self.lock = threading.RLock()
        self.slots: list[Slot] = []
        # ``timed``: calls have a timeout, so the manager needs their deadlines.
        self.roster = Roster(self, timed)
        self.pending: collections.deque[Task] = collections.deque()
        self.broken: BaseException | None = None
        self.closed = False  # no more submissions
        self.stopping = False  # the manager returns once nothing is queued
        self.stopped = False  # workers gone, rings closed
        self.stop_lock = threading.Lock()  # held by the one caller that stops them
        # The manager waits on it with the done rings; None once the pool stopped.
        self.wake: shm.Ring | None = None if inline else shm.Ring(4, 1)
        self.next_task_id = itertools.count(1)
        self.submitted = self.completed = self.failed = self.restarts = 0
        self.bytes_shared = self.bytes_copied = 0
        # Results that are forwarded read-only views stay views (results="view")
        # instead of being copied.
        self.view_results = view_results
        self.manager_ident: int | None = None
        # Seconds from dispatch to delivery of the latest call: waiters poll
        # for their result only while calls come back within the poll budget.
        self.latency = 0.0
        # Until when the one waiter that polls for its result polls (PoolFuture._poll).
        self.polling_until = 0.0
        # The manager's poll set, while it runs on epoll: callers that read their
        # worker's done ring directly have it stand aside (``_delivery``).
        self.watcher: Watcher | None = None

    def adopt_arena(self, arena: shm.Arena) -> None:
        """The pool's main arena: its workers' arguments go through it."""
        self.arena = arena

    # ------------------------------------------------------------ checks
    @property
    def forked(self) -> bool:
        """Whether this process is a fork of the owner (an inline pool never is)."""
        return self.pid != _pid.pid and not self.inline

    def check_not_forked(self, what: str = "this WorkerPool") -> None:
        """Raise ForkedPoolError in a process forked from the pool's (before any lock:
        another thread of the parent may have held one at the fork)."""
        if self.pid != _pid.pid and not self.inline:  # self.forked, one call less
            raise forked_error(self.pid, what)

    def check_open(self) -> None:
        if self.closed and not self.inline:
            raise PoolClosedError("this pool was shut down: its shared memory is released")

    def check_usable(self) -> None:
        """Raise (a new copy of) the stored error once broken, PoolClosedError once closed."""
        if self.broken is not None:
            raise raised_again(self.broken)
        if self.closed:
            raise PoolClosedError("cannot submit to a pool after shutdown()")

    def status(self) -> PoolStatus:
        state: Literal["running", "broken", "closed", "forked"]
        if self.forked:
            state = "forked"
        elif self.broken:
            state = "broken"
        elif self.closed:
            state = "closed"
        else:
            state = "running"
        return PoolStatus(state, self.pid)

    # ------------------------------------------------------------ calls and workers
    def pick_slot(self, task: Task) -> Slot | None:
        """The worker ``task`` goes to now: its pinned one, or the least busy; None if full."""
        if task.worker is not None:
            slot = self.slots[task.worker % len(self.slots)]
            return slot if slot.has_room() else None
        return self.roster.least_busy()

    def install(self, slot: Slot) -> None:
        """Put a started worker in its place (a replacement takes its predecessor's)."""
        with self.lock:
            if slot.index < len(self.slots):
                old = self.slots[slot.index]
                old.roster = None  # gone: it reports nothing more
                self.roster.starting.discard(old)
                self.slots[slot.index] = slot
            else:
                self.slots.append(slot)
                if self.roster.scan and len(self.slots) > _SCAN_MAX:
                    self.roster.scan = False  # too many to look at each: the heap from here
                    self.roster._rebuild()  # noqa: SLF001 - this module's own
            slot.roster = self.roster
            self.roster.changed(slot)

    def dispatch_pending(self, send: Callable[[Task, Slot], None]) -> None:
        """``send`` waiting calls, in order, to workers with room (the lock is held).

        A call that cannot be sent fails alone; one that must wait (its worker,
        or every worker, is full) keeps every later call of its kind waiting.
        """
        if self.broken is not None:
            return
        kept: collections.deque[Task] = collections.deque()
        blocked: set[int | None] = set()  # an earlier call of this kind is still waiting
        held = None  # taken off pending, not handled yet
        try:
            while self.pending:
                held = task = self.pending.popleft()
                if task.future.cancelled():
                    held = None
                    task.release()
                    continue
                slot = None if task.worker in blocked else self.pick_slot(task)
                if slot is None:
                    kept.append(task)
                    held = None
                    blocked.add(task.worker)
                    continue
                try:
                    send(task, slot)
                except Exception as exc:
                    held = None
                    self.failed += 1
                    task.fail(exc)
                held = None
        except BaseException:
            # (A Ctrl-C in a caller's submit.) What was not sent waits on, in order:
            # a call lost here would never settle, and its caller would wait forever.
            if held is not None and not held.sent:  # (sent: its worker runs it)
                kept.append(held)
            kept.extend(self.pending)
            self.pending = kept
            raise
        self.pending = kept

    def manager_started(self) -> None:
        self.manager_ident = threading.get_ident()

    def count_submitted(self) -> None:
        self.submitted += 1  # the lock is held (by submit)

    def count_ran_inline(self, ok: bool) -> None:
        """A call of an inline pool (``num_workers=0``) returned or raised."""
        with self.lock:
            if ok:
                self.completed += 1
            else:
                self.failed += 1

    def count_failed(self, n: int = 1) -> None:
        with self.lock:
            self.failed += n

    def count_restart(self) -> None:
        with self.lock:
            self.restarts += 1

    def poke(self) -> None:
        """Wake the manager (it sleeps until a result, a death or a deadline)."""
        # Under the lock: the wake-up ring has one producer end, and any
        # thread may poke.
        with self.lock, contextlib.suppress(shm.SharedMemoryError, ValueError):
            if self.wake is not None:
                self.wake.try_push(b"!")

    def complete(self, slot: Slot, task_id: int, skipped: bool, ok: bool) -> Task:
        """Take the call at the head of ``slot``'s queue off it: its record came back."""
        with self.lock:
            queue = slot.queue
            if not queue or queue[0].task_id != task_id:  # pragma: no cover
                raise AssertionError(f"completion for task {task_id} out of order")
            task = queue.popleft()
            if queue:
                queue[0].started = time.monotonic()
            self.roster.loaded(slot, True)
            if skipped:
                return task
            if ok:
                self.completed += 1
            else:
                self.failed += 1
        self.latency = time.perf_counter() - task.sent
        return task

    def lose_worker(self, slot: Slot) -> list[Task]:
        """``slot``'s worker is gone: it takes nothing more; its queued calls, in order."""
        with self.lock:
            slot.ready = False
            tasks = list(slot.queue)
            slot.queue.clear()
            return tasks

    def requeue_first(self, tasks: list[Task]) -> None:
        """Put calls a lost worker never started first in line, in their order."""
        with self.lock:
            self.pending.extendleft(reversed(tasks))

    def fail_pending_if_no_worker(self, error: BaseException) -> None:
        """While stopping: fail the waiting calls if no worker is left to run them."""
        with self.lock:
            if any(slot.ready for slot in self.slots):
                return
            tasks = list(self.pending)
            self.pending.clear()
            self.failed += len(tasks)
        for task in tasks:
            task.fail(error)

    def mark_broken(self, error: BaseException, tasks: list[Task] | None = None) -> None:
        """One step: record the error, fail ``tasks`` and every queued call, stop the workers."""
        with self.lock:
            if self.broken is None:
                self.broken = error
            tasks = [*(tasks or ()), *self._take_queued()]
            self.failed += len(tasks)
        for task in tasks:
            # Each a copy, whose __cause__ is the error (as RayPool's): a caller's raise adds
            # its frames to its own copy, never to what the pool keeps (see raised_again).
            task.fail(raised_again(error))
        for slot in self.slots:
            if slot.process is not None and slot.process.exitcode is None:
                slot.process.kill()

    def _take_queued(self) -> list[Task]:
        """Every call waiting in the pool or queued on a worker, taken off (lock held)."""
        tasks = list(self.pending)
        self.pending.clear()
        for slot in self.slots:
            tasks += slot.queue
            slot.queue.clear()
            self.roster.loaded(slot, False)
        return tasks

    # ------------------------------------------------------------ stopping
    def mark_closed(self) -> None:
        """An inline pool's shutdown: no more calls (it has nothing to stop)."""
        self.closed = True

    def begin_shutdown(self, cancel: bool) -> bool:
        """Close to new calls; with ``cancel``, cancel every call not started.

        False if the pool is already closed and stopped (nothing to do).
        """
        with self.lock:
            if self.closed and self.stopped:
                return False
            self.closed = True
            self.stopping = True
            if cancel:
                for task in self.pending:
                    cancel_now(task.future)
                self.pending.clear()
                # And those pushed to a worker that has not started them: it skips them.
                for slot in self.slots:
                    for task in list(slot.queue):
                        if slot.ready:
                            cancel_pushed(slot, task.seq, task.future)
            self.poke()
            return True

    def mark_stopped(self) -> list[Task]:
        """The workers are gone: calls still queued will never complete."""
        with self.lock:
            self.stopped = True
            return self._take_queued()

    def release(self) -> None:
        """Let go of the rings and the arena now, not when the pool is collected.

        Their mappings go with the last reference (a delivered future holds none).
        """
        with self.lock:
            if self.wake is not None:
                self.wake.close()
                self.wake = None
        arena, self.arena = self.arena, None
        if arena is not None:
            arena.close()
        with self.lock:
            self.last_pids = [s.pid for s in self.slots]
            self.slots = []
            self.roster.clear()

    # ------------------------------------------------------------ reading
    def pids(self) -> list[int]:
        with self.lock:
            return [s.pid for s in self.slots] or list(self.last_pids)

    def processes(self) -> list[Any]:
        with self.lock:
            return [s.process for s in self.slots if s.process is not None]

    def stats(self, num_workers: int) -> PoolStats:
        arena = self.arena.stats() if self.arena is not None else None
        with self.lock:
            pending = len(self.pending) + sum(len(s.queue) for s in self.slots)
            return PoolStats(
                num_workers=num_workers,
                submitted=self.submitted,
                completed=self.completed,
                failed=self.failed,
                pending=pending,
                restarts=self.restarts,
                bytes_shared=self.bytes_shared,
                bytes_copied=self.bytes_copied,
                arena=arena,  # type: ignore[arg-type]
            )
