"""WorkerPool: a ``concurrent.futures.Executor`` over GIL-free worker processes.

::

    caller threads                    shared memory                       worker i
    --------------                    -------------                       --------
    submit(fn, *args)
      encode: arrays -> descriptors   main arena (owned by the pool) --->  read-only views
      push FUNC (once per fn), CALL ->  task ring i  (main -> worker) ---> pop, decode, call
                                                                           encode the result
    manager thread  <---------------  done ring i  (worker -> main)  <---  push OK / ERROR
      decode, open result views   <-  worker arena i (owned by worker i)
      set the future
    views of results dropped  -----> result-release ring i ----------->  arena collects
    worker's views dropped    <----- arg-release ring i  <-------------  finalizer pushes

    one wait in the manager: every done ring + every worker sentinel + a wake-up doorbell

    cancel(): CANCEL, then VERDICT -> task ring i -------------------->  skips the call or runs it
    manager thread  <----------------  SKIPPED (or the call's OK)  <-----  (``_protocol`` docstring)
    workers start from ``_launch``: mpexec's own fork server (or spawn), never the
    caller's ``__main__``; a forked child of the caller gets ForkedPoolError

Each ring has one producer and one consumer, so no lock is ever shared between
processes; the pool's own lock is a plain thread lock in the main process. The
pool owns the main arena and the rings; each worker owns its arena, and a
result view in the caller keeps the worker's memory mapped after the worker
is gone.

The manager thread holds the state, not the pool, so that a pool that is
dropped without ``shutdown`` is collected and shut down by its finalizer.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import os
import pickle
import select
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import psutil

import shm

from . import _codec, _launch, _protocol, _worker
from ._errors import (
    BrokenPoolError,
    PoolClosedError,
    RemoteTraceback,
    SerializationError,
    TaskTimeoutError,
    WorkerCrashedError,
    forked_error,
    signal_name,
)
from ._host import cuda_initialised, default_start_method, ensure_open_files, usable_cpus
from ._mapping import map_calls
from ._protocol import (
    CALL,
    CANCEL,
    FAILED,
    FORGET,
    FUNC,
    HEADER,
    HELLO,
    OK,
    SKIPPED,
    VERDICT,
    body_of,
    record,
    spill,
)

T = TypeVar("T")

_IN_FLIGHT = 8  # tasks queued on one worker at most; the rest wait in the pool
# A task takes up to five records (forget, function, call; cancel and verdict):
# 40 in flight. A busy worker gives freed slots back only every half ring, so it
# may sit on up to half of them: the task ring needs 40 + 47 < 96. The manager
# drains the done ring to empty (which returns every slot), and a worker sends
# one record a task.
_TASK_RING = 96
_DONE_RING = 3 * _IN_FLIGHT
_FN_CACHE = 1024  # functions kept (strongly) with their ids; older ones are forgotten
_STOP_GRACE = 5.0  # seconds a worker gets to exit after its ring is closed
_POLL_SECONDS = 1e-3  # how long result() polls for a quick call's result


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


class _Task:
    __slots__ = (
        "args",
        "fn",
        "future",
        "kwargs",
        "sent",
        "shared",
        "started",
        "task_id",
        "worker",
    )

    future: _PoolFuture[Any]

    def __init__(
        self,
        task_id: int,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        worker: int | None = None,
        shared: bool = False,
    ) -> None:
        self.task_id = task_id
        self.shared = shared  # deliver the result's arrays as read-only views, uncopied
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.worker = worker  # the worker index it must run on, or None for any
        self.future: _PoolFuture[Any] = _PoolFuture()
        self.started = 0.0  # when it reached the head of its worker's queue
        self.sent = 0.0  # when it was pushed to its worker (perf_counter)

    def release(self) -> None:
        """Drop the call's function and arguments (kept only to rerun it elsewhere)."""
        self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        self.future._mp_slot = None
        self.future._mp_state = None  # settled: it needs the pool no more


class _PoolFuture(Future[T]):
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

    _mp_state: _State | None = None
    _mp_slot: _Slot | None = None  # the worker it was pushed to, until delivered
    _mp_seq = 0  # its number among the calls pushed to that worker

    def running(self) -> bool:
        """True once a worker has started the call (not merely received it)."""
        slot = self._mp_slot
        if slot is None or self.done():
            return super().running()
        try:
            return slot.done.progress() >= self._mp_seq
        except (ValueError, TypeError):  # pragma: no cover - its rings released
            return False

    def cancel(self) -> bool:
        """Cancel the call if no worker has started it; True if it will never run.

        A call waiting in the pool is dropped; one already pushed to a
        worker is skipped by that worker (see ``_worker``'s cancellation).
        """
        state = self._mp_state
        if state is None:
            return _cancel_now(self)
        if state.pid != os.getpid():
            return False  # a forked child: the call is the parent's
        with state.lock:
            slot = self._mp_slot
            if slot is None:
                return _cancel_now(self)
            return _cancel_pushed(slot, self)

    def result(self, timeout: float | None = None) -> T:
        return super().result(self._poll(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._poll(timeout))

    def _poll(self, timeout: float | None) -> float | None:
        """Poll for up to the pool's budget; the caller's ``timeout`` left over."""
        state = self._mp_state
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


class _Slot:
    """One worker process and the rings and bookkeeping that go with it."""

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
        self.queue: collections.deque[_Task] = collections.deque()
        self.fns: set[int] = set()
        self.forget: list[int] = []
        self.calls = 0  # CALL records pushed (the worker numbers them the same way)
        self.ready = False
        # While a replacement starts (the manager reads its hello, never waits for it).
        self.start_deadline: float | None = None

    def close_rings(self) -> None:
        for ring in (self.tasks, self.done, self.result_releases):
            ring.close()


class _State:
    """Everything the pool and its manager thread share (the manager holds only this)."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the process that owns it; a forked child does not
        self.last_pids: list[int] = []  # the workers' pids, kept after shutdown
        self.lock = threading.RLock()
        self.slots: list[_Slot] = []
        self.pending: collections.deque[_Task] = collections.deque()
        self.broken: BaseException | None = None
        self.closed = False  # no more submissions
        self.stopping = False  # the manager returns once nothing is queued
        self.stopped = False  # workers gone, rings closed
        self.stop_lock = threading.Lock()  # held by the one caller that stops them
        # The manager waits on it with the done rings; None once the pool stopped.
        self.wake: shm.Ring | None = shm.Ring(4, 1)
        self.fn_ids: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self.next_fn_id = itertools.count(1)
        self.next_task_id = itertools.count(1)
        self.submitted = self.completed = self.failed = self.restarts = 0
        self.bytes_shared = self.bytes_copied = 0
        # Results that are forwarded read-only views stay views (the pipeline
        # sets this; its outputs are read-only anyway) instead of being copied.
        self.shared_results = False
        self.manager_ident: int | None = None
        # Seconds from dispatch to delivery of the latest call: waiters poll
        # for their result only while calls come back within the poll budget.
        self.latency = 0.0

    def poke(self) -> None:
        # Under the lock: the wake-up ring has one producer end, and any
        # thread may poke.
        with self.lock, contextlib.suppress(shm.SharedMemoryError, ValueError):
            if self.wake is not None:
                self.wake.try_push(b"!")


class WorkerPool(Executor):
    """Run functions in worker processes, with arrays passed through shared memory.

    ``num_workers`` defaults to the CPUs this process may use; ``0`` runs
    every call inline in the caller (for a debugger). Arguments and results
    may be any picklable values; the ndarrays in them travel zero-copy
    (functions get read-only views; results are the caller's to keep).

    - ``start_method``: ``"forkserver"`` (Linux default) or ``"spawn"``;
      ``"fork"`` only on request, and refused once CUDA is initialised.
    - ``seed``: ``numpy.random`` and ``random`` in each worker are seeded from
      it with ``numpy.random.SeedSequence`` (worker index as spawn key).
    - ``worker_init(*worker_init_args)``: called in each worker after seeding.
    - ``timeout``: seconds a single call may run; past it the call fails with
      :class:`TaskTimeoutError` and its worker is replaced.
    - ``restart``: replace a worker that dies; only the call it was running
      fails. Without it a crash breaks the pool (:class:`BrokenPoolError`).
    - ``arena_size``: the size of each shared-memory segment of the pool's
      arena (it grows by segments up to ``arena_capacity``).
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        start_method: str | None = None,
        seed: int | None = None,
        worker_init: Callable[..., object] | None = None,
        worker_init_args: tuple[Any, ...] = (),
        timeout: float | None = None,
        restart: bool = False,
        arena_size: int = 64 << 20,
        arena_capacity: int | None = None,
        worker_arena_size: int = 32 << 20,
        inline_max: int = _codec.INLINE_MAX,
        start_timeout: float = 60.0,
    ) -> None:
        if num_workers is None:
            num_workers = usable_cpus()
        if isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, not {num_workers!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive or None, not {timeout!r}")
        self.num_workers = num_workers
        self.timeout = timeout
        self.restart = restart
        self._state = _State()
        self._seed = int(np.random.SeedSequence(seed).entropy)  # type: ignore[arg-type]
        self._inline_max = inline_max
        self._worker_arena_size = worker_arena_size
        self._init = (
            _codec.dump_value((worker_init, tuple(worker_init_args)), "worker_init")
            if worker_init is not None
            else None
        )
        self._start_timeout = start_timeout
        self._inline = num_workers == 0
        self._arena: shm.Arena | None = None
        self._manager: threading.Thread | None = None
        self._finalizer: weakref.finalize[Any, WorkerPool] | None = None
        self._ref = weakref.ref(self)  # what the manager holds: the pool can be collected
        if self._inline:
            return
        self._ctx = _context(start_method)
        ensure_open_files(num_workers)  # before anything starts: fail at once, or fit
        # Sealed: workers cannot write the pool's memory, even by reopening its
        # fds, but for buffers made to be written (pool.empty, pool.put).
        self._arena = shm.Arena(arena_size, arena_capacity, name="pool", sealed=True)
        self._lifeline = shm.Lifeline()
        _register_exit_hook()
        try:
            self._start_workers(range(num_workers), generation=0)
        except BaseException:
            _shutdown(self._state, self._arena, self._lifeline, None, wait=False, cancel=True)
            raise
        self._manager = threading.Thread(
            target=_manage,
            args=(self._state, self._ref, timeout),
            name="mpexec-pool-manager",
            daemon=True,
        )
        self._manager.start()
        self._finalizer = weakref.finalize(
            self, _shutdown, self._state, self._arena, self._lifeline, self._manager, False, True
        )
        _live_pools.add(self)

    # ------------------------------------------------------------ workers
    def _start_workers(self, indices: Iterable[int], generation: int) -> None:
        """Start workers in parallel, then wait for each to say hello."""
        started = [self._launch(index, generation) for index in indices]
        deadline = time.monotonic() + self._start_timeout
        for slot in started:
            self._await_hello(slot, deadline)

    def _launch(self, index: int, generation: int) -> _Slot:
        """Start worker ``index`` (it is ready once its hello is read)."""
        state, arena = self._state, self._arena
        assert arena is not None
        slot = _Slot(index, generation)
        slot.arg_releases = arena.link()
        boot = _worker.WorkerBoot(
            index=index,
            generation=generation,
            tasks=slot.tasks,
            done=slot.done,
            arg_releases=slot.arg_releases,
            result_releases=slot.result_releases,
            lifeline=self._lifeline,
            main_arena_id=arena.id,
            main_pid=os.getpid(),
            seed_entropy=self._seed,
            init=self._init,
            segment_size=self._worker_arena_size,
            inline_max=self._inline_max,
        )
        slot.process = self._ctx.Process(
            target=_worker.main, args=(boot,), name=f"mpexec-worker-{index}", daemon=True
        )
        try:
            slot.process.start()
        except BaseException:
            slot.close_rings()
            arena.reclaim(slot.arg_releases)
            raise
        slot.pid = slot.process.pid
        for ring in (slot.tasks, slot.done, slot.result_releases, slot.arg_releases):
            ring.handed_over()  # the worker has its fds: ours would only count
        with state.lock:
            if index < len(state.slots):
                state.slots[index] = slot
            else:
                state.slots.append(slot)
        return slot

    def _await_hello(self, slot: _Slot, deadline: float) -> None:
        try:
            rec = slot.done.pop(max(0.0, deadline - time.monotonic()), [slot.process])
        except shm.RingTimeoutError:
            raise BrokenPoolError(
                f"worker {slot.index} (pid {slot.pid}) did not start within {self._start_timeout} s"
            ) from None
        except shm.SharedMemoryError:
            slot.process.join(1)
            err = _died_starting(slot)
            raise err from err.__cause__
        _hello(slot, rec)

    # ------------------------------------------------------------ the executor
    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; a Future of its result.

        Raises :class:`SerializationError` here, in the caller, if ``fn`` or an
        argument cannot be pickled; :class:`PoolClosedError` after ``shutdown``;
        the stored :class:`BrokenPoolError` once the pool is broken.
        """
        return self._submit(fn, args, kwargs, None)

    def _submit(
        self,
        fn: Callable[..., T],
        args: Any,
        kwargs: Any,
        worker: int | None,
        *,
        shared: bool = False,
    ) -> Future[T]:
        """``submit``; with ``worker``, on that worker index, after its earlier calls.

        Calls pinned to one worker run in submission order there (the pipeline
        runs ``stateful`` ops this way); a replaced worker keeps the index.
        ``shared``: this call's result arrays come back as read-only views of
        shared memory, uncopied (for a pipeline run on a pool it does not own).
        """
        if not callable(fn):
            raise TypeError(f"submit() needs a callable, not {type(fn).__name__}")
        state = self._state
        self._check_not_forked()
        if self._inline:
            return self._run_inline(fn, args, kwargs)
        with state.lock:
            self._check_usable()
            task = _Task(next(state.next_task_id), fn, args, kwargs, worker, shared)
            task.future._mp_state = state
            slot = self._pick_slot(task)
            if slot is None or state.pending:
                # Busy, or calls wait ahead of it (order kept): validate now,
                # encode when a worker frees up.
                _check_picklable(fn, args, kwargs, self._arena, self._known_function(fn))
                state.pending.append(task)
                if slot is not None:
                    _dispatch_pending(state, self._ref)
            else:
                self._dispatch(task, slot)
            state.submitted += 1
        return task.future

    def _run_inline(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        if self._state.closed:
            raise PoolClosedError("cannot submit to a pool after shutdown()")
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*_readonly(args), **_readonly(kwargs)))
        except BaseException as exc:
            future.set_exception(exc)
        return future

    def _keep_results_shared(self) -> None:
        """Deliver results that are read-only views of shared memory as such, uncopied.

        For the pipeline, whose outputs are read-only anyway; a pool's own
        callers are promised arrays of their own.
        """
        self._state.shared_results = True

    def _check_not_forked(self) -> None:
        """Raise ForkedPoolError in a process forked from the pool's (before any lock:
        another thread of the parent may have held one at the fork)."""
        if self._state.pid != os.getpid() and not self._inline:
            raise forked_error(self._state.pid, "this WorkerPool")

    def _check_open(self) -> None:
        if self._state.closed and not self._inline:
            raise PoolClosedError("this pool was shut down: its shared memory is released")

    def _check_usable(self) -> None:
        state = self._state
        if state.broken is not None:
            raise state.broken
        if state.closed:
            raise PoolClosedError("cannot submit to a pool after shutdown()")

    def _pick_slot(self, task: _Task) -> _Slot | None:
        if task.worker is not None:
            slot = self._state.slots[task.worker % len(self._state.slots)]
            return slot if slot.ready and len(slot.queue) < _IN_FLIGHT else None
        best = None
        for slot in self._state.slots:
            n = len(slot.queue)
            if slot.ready and n < _IN_FLIGHT and (best is None or n < len(best.queue)):
                best = slot
        return best

    def _dispatch(self, task: _Task, slot: _Slot) -> None:
        """Encode ``task`` for ``slot`` and push it (the state lock is held)."""
        state, arena = self._state, self._arena
        assert arena is not None
        fn_id = self._function_id(task.fn)
        records = []
        if slot.forget:
            body = struct.pack(f"<{len(slot.forget)}I", *slot.forget)
            records.append(spill(FORGET, body, arena, slot.arg_releases))
            slot.forget.clear()
        if fn_id not in slot.fns:
            try:
                body = _codec.dump_value(task.fn)
            except SerializationError:
                self._forget_function(task.fn)
                raise
            records.append(spill(FUNC, body, arena, slot.arg_releases, fn_id=fn_id))
        enc = _codec.encode_call(task.args, task.kwargs, arena, slot.arg_releases, self._inline_max)
        records.append(spill(CALL, enc.data, arena, slot.arg_releases, task.task_id, fn_id))
        try:
            if len(records) == 1:
                slot.tasks.push(records[0], timeout=self._start_timeout, watch=[slot.process])
            else:
                slot.tasks.push_many(records, timeout=self._start_timeout, watch=[slot.process])
        except BaseException:
            enc.refs.undo()
            raise
        slot.fns.add(fn_id)
        slot.calls += 1
        task.future._mp_slot, task.future._mp_seq = slot, slot.calls
        state.bytes_shared += enc.bytes_shared
        state.bytes_copied += enc.bytes_copied
        task.sent = time.perf_counter()
        if not slot.queue:
            task.started = time.monotonic()
        slot.queue.append(task)
        if self.timeout is not None:
            state.poke()  # the manager sleeps until the earliest deadline

    def _known_function(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` pickled before (a function keeps its id only if it did)."""
        try:
            return fn in self._state.fn_ids
        except TypeError:  # unhashable
            return False

    def _forget_function(self, fn: Callable[..., Any]) -> None:
        """Drop ``fn`` (it no longer pickles): checked again next time, gone from workers."""
        fn_id = None
        with contextlib.suppress(TypeError):
            fn_id = self._state.fn_ids.pop(fn, None)
        if fn_id is not None:
            _forget_everywhere(self._state, fn_id)

    def _function_id(self, fn: Callable[..., Any]) -> int:
        state = self._state
        key: Any = fn
        try:
            fn_id = state.fn_ids.get(key)
        except TypeError:  # unhashable callable: a new id each time
            fn_id, key = None, _Unhashable(fn)
        if fn_id is not None:
            state.fn_ids.move_to_end(key)
            return fn_id
        fn_id = next(state.next_fn_id)
        state.fn_ids[key] = fn_id
        if len(state.fn_ids) > _FN_CACHE:
            _, old = state.fn_ids.popitem(last=False)
            _forget_everywhere(state, old)
        return fn_id

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        ordered: bool = True,
        prefetch: int | None = None,
    ) -> Iterator[T]:
        """Like ``Executor.map``, with at most ``prefetch`` calls in flight.

        ``prefetch`` defaults to twice the number of workers; ``ordered=False``
        yields results as they complete. ``timeout`` bounds the whole map.
        ``chunksize`` > 1 sends the calls in chunks of that many, one task per
        chunk: for many tiny calls, far less overhead per call. Then
        ``prefetch`` counts chunks, a chunk is one call for the pool's
        ``timeout``, and an exception in a call fails its whole chunk (the
        chunk's other results are not yielded), as in ``ProcessPoolExecutor``.
        """
        self._check_not_forked()
        return map_calls(
            self,
            fn,
            iterables,
            workers=self.num_workers,
            timeout=timeout,
            chunksize=chunksize,
            ordered=ordered,
            prefetch=prefetch,
            check_fn=not self._inline,
        )

    def empty(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float64) -> Any:
        """A new array in the pool's shared memory: it reaches workers without a copy.

        It has its memory pages to itself (see ``docs/in-place-mutation.md``), so
        passed :func:`writable` a worker can write it and nothing else of ours.
        """
        self._check_not_forked()
        self._check_open()
        if self._arena is None:
            return np.empty(shape, dtype)
        return self._arena.empty(shape, dtype, peer_writable=True)

    def put(self, array: Any) -> Any:
        """A copy of ``array`` in the pool's shared memory, to pass to many calls.

        Its pages are its own, as for :meth:`empty`.
        """
        self._check_not_forked()
        self._check_open()
        if self._arena is None:
            return np.array(array, copy=True)
        return self._arena.put(array, peer_writable=True)

    def _copy_in(self, array: np.ndarray[Any, Any]) -> Any:
        """:meth:`put` packed with others (no pages of its own), never passed writable."""
        assert self._arena is not None
        return self._arena.put(array)

    def stats(self) -> PoolStats:
        """Counters and the arena's occupancy (a snapshot)."""
        self._check_not_forked()
        state = self._state
        arena = self._arena.stats() if self._arena is not None else None
        with state.lock:
            pending = len(state.pending) + sum(len(s.queue) for s in state.slots)
            return PoolStats(
                num_workers=self.num_workers,
                submitted=state.submitted,
                completed=state.completed,
                failed=state.failed,
                pending=pending,
                restarts=state.restarts,
                bytes_shared=state.bytes_shared,
                bytes_copied=state.bytes_copied,
                arena=arena,  # type: ignore[arg-type]
            )

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (after shutdown: of the last ones)."""
        self._check_not_forked()
        with self._state.lock:
            return [s.pid for s in self._state.slots] or list(self._state.last_pids)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the pool; idempotent.

        With ``wait``, queued calls finish first (unless ``cancel_futures``):
        like ``ProcessPoolExecutor``, that takes as long as they do (set the
        pool's ``timeout`` to bound it). Then every worker is gone within a
        bounded time (closed ring, timed join, SIGTERM, SIGKILL). Without
        ``wait``, queued calls are cancelled and running ones abandoned (their
        futures fail with :class:`PoolClosedError`). Safe from several threads.

        In a process forked from the pool's, it does nothing: the workers
        are the parent's, which goes on using them.
        """
        if self._state.pid != os.getpid():
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        if self._inline:
            self._state.closed = True
            return
        _live_pools.discard(self)
        _shutdown(self._state, self._arena, self._lifeline, self._manager, wait, cancel_futures)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._state.stopped:
            # Unmapped as soon as nothing made from it is held (pool.empty() arrays are).
            self._arena = None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Ctrl-C: stop now (running calls are abandoned) rather than wait for the queue.
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.shutdown(wait=not interrupted, cancel_futures=interrupted)

    def __repr__(self) -> str:
        state = self._state
        status = (
            "inherited through fork"
            if state.pid != os.getpid()
            else "broken"
            if state.broken
            else "closed"
            if state.closed
            else "running"
        )
        return f"<WorkerPool {status} workers={self.num_workers} submitted={state.submitted}>"


def _hello(slot: _Slot, rec: bytes) -> None:
    """Read a worker's first record: it is ready, or it failed to start (raised)."""
    kind, flags, _, _ = HEADER.unpack_from(rec)
    body = body_of(rec, flags)
    if kind == FAILED:
        exc, tb = pickle.loads(body)
        err = BrokenPoolError(
            f"worker {slot.index} (pid {slot.pid}) failed to start: "
            f"{type(exc).__name__}: {exc} (the worker's traceback follows)"
        )
        exc.__cause__ = RemoteTraceback(tb)
        raise err from exc
    if kind != HELLO:  # pragma: no cover - protocol error
        raise BrokenPoolError(f"worker {slot.index} sent record kind {kind} first")
    slot.pid, slot.arena_id = pickle.loads(body)
    _launch.started(slot.process)
    shm.set_release_route(slot.arena_id, slot.result_releases)
    slot.start_deadline = None
    slot.ready = True


def _died_starting(slot: _Slot) -> BrokenPoolError:
    """A worker died before its hello: with its start-up traceback as the cause."""
    return _launch.start_failure(
        f"worker {slot.index} (pid {slot.pid})",
        slot.process,
        _describe_exit(slot.process.exitcode),
    )


def _forget_everywhere(state: _State, fn_id: int) -> None:
    """Workers that cached function ``fn_id`` drop it with their next task."""
    for slot in state.slots:
        if fn_id in slot.fns:
            slot.fns.discard(fn_id)
            slot.forget.append(fn_id)


class _Unhashable:
    """Stands in for an unhashable callable as a cache key (by identity)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn


def _check_picklable(
    fn: Callable[..., Any], args: Any, kwargs: Any, arena: shm.Arena | None, fn_known: bool
) -> None:
    if not fn_known:  # pickling a function again costs as much as a small call
        _codec.dump_value(fn)
    # Arrays are not copied: nothing is shared, only checked.
    _codec.encode_call(args, kwargs, None, None, inline_max=-1, owner=arena)


def _readonly(value: Any) -> Any:
    """Arrays in ``value`` as read-only views, as a worker would see them."""
    if type(value) is _codec.Writable:
        return value.array
    if isinstance(value, np.ndarray):
        view = value.view()
        view.flags.writeable = False
        return view
    if isinstance(value, tuple):
        return tuple(_readonly(v) for v in value)
    if isinstance(value, list):
        return [_readonly(v) for v in value]
    if isinstance(value, dict):
        return {k: _readonly(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- the manager


def _manage(state: _State, pool_ref: weakref.ref[WorkerPool], timeout: float | None) -> None:
    """Deliver results, notice deaths and timeouts; runs until the pool stops.

    Holds the pool only weakly, so that a pool dropped without ``shutdown``
    is collected (its finalizer then stops everything, this thread included).
    """
    state.manager_ident = threading.get_ident()
    try:
        watcher = _Watcher(state)
        while _manage_once(state, pool_ref, timeout, watcher):
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
        _break(state, err)


class _Watcher:
    """One poll set over the wake-up ring, every done ring and every sentinel.

    Rebuilt only when the workers change: the manager waits once per
    completion, and building a poll set costs as much as the rest of the wait.
    """

    def __init__(self, state: _State) -> None:
        self.state = state
        self.key: tuple[tuple[int, bool, bool], ...] = ()
        self.poller = select.poll()
        self.by_fd: dict[int, tuple[_Slot | None, str]] = {}

    def wait(self, slots: list[_Slot], timeout: float | None) -> list[tuple[_Slot | None, str]]:
        key = tuple((id(s), s.ready, s.start_deadline is not None) for s in slots)
        if key != self.key:
            self.poller = select.poll()
            wake = self.state.wake
            if wake is None:
                raise ValueError("the pool stopped")  # its rings are closed: the manager ends
            self.by_fd = {wake.fileno(): (None, "wake")}
            for slot in slots:
                if slot.ready or slot.start_deadline is not None:
                    self.by_fd[slot.done.fileno()] = (slot, "done")
                    self.by_fd[slot.process.sentinel] = (slot, "died")
            for fd in self.by_fd:
                self.poller.register(fd, select.POLLIN)
            self.key = key
        # _deliver() drains a done ring (try_pop until None), so it never holds
        # credits that its doorbell no longer shows: polling the fds is enough.
        ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
        return [self.by_fd[fd] for fd, _ in self.poller.poll(ms) if fd in self.by_fd]


def _manage_once(
    state: _State, pool_ref: weakref.ref[WorkerPool], timeout: float | None, watcher: _Watcher
) -> bool:
    with state.lock:
        slots = list(state.slots)
        if state.stopping and not state.pending and not any(s.queue for s in slots):
            return False
    ready = watcher.wait(slots, _next_deadline(slots, timeout))
    died: list[_Slot] = []
    for slot, what in ready:
        if slot is None:
            with contextlib.suppress(shm.RingTimeoutError):
                if state.wake is not None:
                    state.wake.pop_many(timeout=0)
        elif slot.start_deadline is not None:
            _started(state, slot, died=what == "died")
        elif what == "done":
            _deliver(state, slot)
        else:
            died.append(slot)
    for slot in died:
        if slot.ready:
            _worker_lost(state, slot, timeout, pool_ref, died=True)
    for slot in slots:
        if slot.start_deadline is not None and time.monotonic() > slot.start_deadline:
            _break(state, BrokenPoolError(f"worker {slot.index} (pid {slot.pid}) did not start"))
            slot.start_deadline = None
    if timeout is not None:
        for slot in slots:
            if slot.ready and _timed_out(slot, timeout):
                _worker_lost(state, slot, timeout, pool_ref, died=False)
    if state.pending:
        with state.lock:
            _dispatch_pending(state, pool_ref)
    return True


def _next_deadline(slots: list[_Slot], timeout: float | None) -> float | None:
    ends = [s.start_deadline for s in slots if s.start_deadline is not None]
    if timeout is not None:
        ends += [s.queue[0].started + timeout for s in slots if s.ready and s.queue]
    if not ends:
        return None
    return max(0.0, min(ends) - time.monotonic()) + 0.001


def _started(state: _State, slot: _Slot, died: bool) -> None:
    """A replacement worker said hello (it is ready now), failed, or died starting."""
    try:
        rec = slot.done.try_pop()
        if rec is None and not died:
            return
        if rec is None:
            slot.process.join(1)
            raise _died_starting(slot)
        with state.lock:
            _hello(slot, rec)
    except (BrokenPoolError, shm.SharedMemoryError) as exc:
        slot.start_deadline = None
        _break(state, exc if isinstance(exc, BrokenPoolError) else _died_starting(slot))


def _timed_out(slot: _Slot, timeout: float | None) -> bool:
    return (
        timeout is not None
        and bool(slot.queue)
        and time.monotonic() - slot.queue[0].started > timeout
    )


def _deliver(state: _State, slot: _Slot) -> None:
    """Complete the futures of every record waiting in ``slot``'s done ring."""
    while True:
        try:
            rec = slot.done.try_pop()
        except shm.RingClosedError:
            return
        if rec is None:
            return
        kind, flags, _, task_id = HEADER.unpack_from(rec)
        skipped = kind == SKIPPED
        # Only this thread takes tasks off the head of the queue.
        shared = state.shared_results or (bool(slot.queue) and slot.queue[0].shared)
        ok, outcome = (True, None) if skipped else _outcome(rec, kind, flags, shared)
        with state.lock:
            if not slot.queue or slot.queue[0].task_id != task_id:  # pragma: no cover
                raise AssertionError(f"completion for task {task_id} out of order")
            task = slot.queue.popleft()
            if slot.queue:
                slot.queue[0].started = time.monotonic()
            if skipped:
                pass
            elif ok:
                state.completed += 1
            else:
                state.failed += 1
        task.release()
        if skipped:
            _cancel_now(task.future)  # cancelled already: cancel() said so
            continue
        state.latency = time.perf_counter() - task.sent
        if ok:
            _settle(task.future, result=outcome)
        else:
            _settle(task.future, exc=outcome)


def _outcome(rec: bytes, kind: int, flags: int, shared_ok: bool) -> tuple[bool, Any]:
    """(True, the result) or (False, the exception) that a done record carries."""
    try:
        body = body_of(rec, flags)
        if kind == OK:
            return True, _codec.decode(body, True, shared_ok)
        exc, tb = pickle.loads(body)
        exc.__cause__ = RemoteTraceback(tb)
        return False, exc
    except Exception as exc:
        err = SerializationError(
            f"the result of a call could not be read back: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
        return False, err


def _cancel_now(future: Future[Any]) -> bool:
    """Cancel a call no worker will run, and tell its waiters (``wait()``) at once."""
    with future._condition:
        if not Future.cancel(future):
            return False
        if future._state == "CANCELLED":
            future.set_running_or_notify_cancel()
        return True


def _cancel_pushed(slot: _Slot, future: _PoolFuture[Any]) -> bool:
    """Cancel a call pushed to ``slot``'s worker unless it started (state lock held).

    The handshake of ``_protocol``'s cancellation: CANCEL, read the worker's
    progress, VERDICT. The worker, which waits for the verdict once it has
    seen CANCEL, then skips the call exactly when this returns True.
    """
    if future.done():
        return future.cancelled()
    seq = future._mp_seq
    if not slot.ready or slot.done.progress() >= seq:
        return False  # running, or its worker is being replaced: it decides
    watch = [slot.process]
    try:
        slot.tasks.push(record(CANCEL, b"", seq), timeout=_STOP_GRACE, watch=watch)
        started = slot.done.progress() >= seq
        verdict = b"\x00" if started else b"\x01"
        slot.tasks.push(record(VERDICT, verdict, seq), timeout=_STOP_GRACE, watch=watch)
    except (shm.SharedMemoryError, ValueError):
        return False  # the worker died or the pool is stopping: the manager fails it
    return not started and _cancel_now(future)


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _worker_lost(
    state: _State,
    slot: _Slot,
    timeout: float | None,
    pool_ref: weakref.ref[WorkerPool],
    died: bool,
) -> None:
    """A worker died or overran its call: fail that call, then restart or break."""
    proc = slot.process
    # Its sentinel can fire before the exit status is there to read: decide by
    # the event, never by ``exitcode is None``.
    overran = not died
    if overran:
        proc.kill()
    proc.join(5)
    with contextlib.suppress(shm.SharedMemoryError):
        _deliver(state, slot)  # what it finished before dying still counts
    progress = slot.done.progress()  # how many of its calls it had started
    with state.lock:
        slot.ready = False
        tasks = list(slot.queue)
        slot.queue.clear()
    shm.set_release_route(slot.arena_id, None)
    pool = pool_ref()
    if pool is not None and pool._arena is not None and slot.arg_releases is not None:
        pool._arena.reclaim(slot.arg_releases)
    slot.close_rings()
    # Calls run in order: only the first undelivered one can have started.
    running = tasks[0] if tasks and (overran or tasks[0].future._mp_seq <= progress) else None
    error: BaseException
    if state.stopping:
        error = PoolClosedError("the pool was shut down before this call finished")
    elif overran:
        error = TaskTimeoutError(
            f"a call ran longer than the pool's timeout of {timeout} s; its worker "
            f"(pid {slot.pid}) was killed and replaced"
        )
    else:
        error = _crash_error(slot, proc.exitcode, running is not None)
    restart = not state.stopping and pool is not None and (overran or pool.restart)
    if not restart and not state.stopping:
        # Broken before any future fails: a caller woken by the failure must
        # find the pool broken (as concurrent.futures does).
        _break(state, error if isinstance(error, BrokenPoolError) else _as_broken(error), tasks)
        return
    # The running call fails; the others never started: with a restart, rerun them.
    rerun = []
    for task in tasks:
        if task is running or not restart:
            with state.lock:
                state.failed += 1
            task.release()
            _settle(task.future, exc=error)
        elif task.future.cancelled():
            task.release()
        else:
            task.future._mp_slot = None
            rerun.append(task)
    with state.lock:
        state.pending.extendleft(reversed(rerun))  # first in line, in their order
    if state.stopping:
        return
    if restart and pool is not None:
        try:
            # Not waiting for its hello here: the manager reads it with the results.
            new = pool._launch(slot.index, slot.generation + 1)
            new.start_deadline = time.monotonic() + pool._start_timeout
        except BaseException as exc:
            _break(state, exc if isinstance(exc, BrokenPoolError) else _as_broken(exc))
        else:
            with state.lock:
                state.restarts += 1


def _as_broken(exc: BaseException) -> BrokenPoolError:
    err = BrokenPoolError(f"the pool is broken: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def _break(state: _State, error: BrokenPoolError, tasks: list[_Task] | None = None) -> None:
    """One step: record the error, fail ``tasks`` and every queued call, stop the workers."""
    with state.lock:
        if state.broken is None:
            state.broken = error
        tasks = [*(tasks or ()), *state.pending]
        state.pending.clear()
        for slot in state.slots:
            tasks += slot.queue
            slot.queue.clear()
        state.failed += len(tasks)
    for task in tasks:
        task.release()
        _settle(task.future, exc=error)
    for slot in state.slots:
        if slot.process is not None and slot.process.exitcode is None:
            slot.process.kill()


def _dispatch_pending(state: _State, pool_ref: weakref.ref[WorkerPool]) -> None:
    """Hand waiting calls to workers with room (the state lock is held)."""
    pool = pool_ref()
    if pool is None or state.broken is not None:
        return
    kept: collections.deque[_Task] = collections.deque()
    blocked: set[int | None] = set()  # an earlier call of this kind is still waiting
    while state.pending:
        task = state.pending.popleft()
        if task.future.cancelled():
            task.release()
            continue
        slot = None if task.worker in blocked else pool._pick_slot(task)
        if slot is None:
            kept.append(task)
            blocked.add(task.worker)
            continue
        try:
            pool._dispatch(task, slot)
        except Exception as exc:
            state.failed += 1
            task.release()
            _settle(task.future, exc=exc)
    state.pending = kept


def _crash_error(slot: _Slot, exitcode: int | None, running: bool) -> WorkerCrashedError:
    cause = _likely_cause(exitcode)
    doing = "while running a call" if running else "while idle (it had started no call)"
    return WorkerCrashedError(
        f"worker {slot.index} (pid {slot.pid}) died {doing}: {_describe_exit(exitcode)}. {cause}",
        pid=slot.pid,
        exitcode=exitcode,
        cause=cause,
    )


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by {signal_name(-exitcode)}({exitcode})"
    return f"exited with code {exitcode}"


def _oom_kills() -> int | None:
    """The cgroup's OOM-kill count (cgroup v2), or None where it cannot be read."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        with open(f"/sys/fs/cgroup{path}/memory.events") as f:
            for line in f:
                key, value = line.split()
                if key == "oom_kill":
                    return int(value)
    except (OSError, StopIteration, ValueError):
        return None
    return None


def _likely_cause(exitcode: int | None) -> str:
    import signal as _signal

    if exitcode == -_signal.SIGKILL:
        kills = _oom_kills()
        if kills is not None and _OOM_BASELINE is not None and kills > _OOM_BASELINE:
            return (
                "The kernel's OOM killer ended it (the cgroup's oom_kill count rose): the "
                "workers need more memory than this machine or container allows; use "
                "fewer workers or smaller inputs"
            )
        return (
            "SIGKILL comes from the kernel's OOM killer (see dmesg) or from someone's "
            "kill -9; if memory was short, use fewer workers or smaller inputs"
        )
    if exitcode in (-_signal.SIGSEGV, -_signal.SIGBUS, -_signal.SIGILL, -_signal.SIGABRT):
        return (
            "A crash in native code: a C extension called by the function, or memory "
            "corrupted through ctypes or an unsafe buffer; run it with num_workers=0 "
            "under a debugger, or enable faulthandler in worker_init"
        )
    if exitcode is not None and exitcode >= 0:
        return (
            "The function (or a library it called) ended the process with os._exit() "
            "or a fatal error; exceptions, sys.exit() included, would have been reported"
        )
    return "It was stopped by a signal from outside the pool"


_OOM_BASELINE: int | None = None


# ---------------------------------------------------------------- shutting down


def _shutdown(
    state: _State,
    arena: shm.Arena | None,
    lifeline: shm.Lifeline,
    manager: threading.Thread | None,
    wait: bool,
    cancel: bool,
) -> None:
    """Stop a pool: let queued calls finish (``wait``), then stop every worker."""
    if state.pid != os.getpid():
        return  # a forked child's exit: the workers and memory are the parent's
    with state.lock:
        if state.closed and state.stopped:
            return
        state.closed = True
        state.stopping = True
        if cancel or not wait:
            for task in state.pending:
                _cancel_now(task.future)
            state.pending.clear()
            # And those pushed to a worker that has not started them: it skips them.
            for slot in state.slots:
                for task in list(slot.queue):
                    if slot.ready:
                        _cancel_pushed(slot, task.future)
        state.poke()
    me = threading.current_thread()
    if manager is not None and wait and manager is not me:
        # It returns once every queued call is delivered (or failed by a crash).
        while manager.is_alive():
            manager.join(0.1)
    # One caller stops the workers and closes everything; another one (say
    # shutdown(wait=False) from a second thread) waits for it, then returns.
    with state.stop_lock:
        if not state.stopped:
            _stop(state, arena, lifeline, manager, wait)


def _stop(
    state: _State,
    arena: shm.Arena | None,
    lifeline: shm.Lifeline,
    manager: threading.Thread | None,
    wait: bool,
) -> None:
    me = threading.current_thread()
    with state.lock:
        slots = list(state.slots)
    for slot in slots:
        with contextlib.suppress(shm.SharedMemoryError, ValueError):
            slot.tasks.close_producer()
    _stop_processes([s.process for s in slots if s.process is not None and s.pid], wait)
    if manager is not None and manager is not me:
        state.poke()
        manager.join(_STOP_GRACE)
    error = PoolClosedError("the pool was shut down before this call finished")
    with state.lock:
        state.stopped = True
        leftovers = list(state.pending)
        state.pending.clear()
        for slot in slots:
            leftovers += slot.queue
            slot.queue.clear()
    for task in leftovers:
        task.release()
        _settle(task.future, exc=state.broken or error)
    for slot in slots:
        shm.set_release_route(slot.arena_id, None)
        slot.close_rings()
        if slot.process is not None and slot.process.exitcode is not None:
            slot.process.close()
        if slot.arg_releases is not None:
            slot.arg_releases.close()
    with state.lock:
        if state.wake is not None:
            state.wake.close()
            state.wake = None
    if arena is not None:
        arena.close()
    lifeline.close()
    # Let go of the rings now, not when the pool is collected: their mappings
    # go with the last reference (a delivered future holds none).
    with state.lock:
        state.last_pids = [s.pid for s in slots]
        state.slots = []


def _stop_processes(procs: list[Any], wait: bool) -> None:
    """Timed join (if ``wait``), then SIGTERM, then SIGKILL of each worker's tree."""
    deadline = time.monotonic() + (_STOP_GRACE if wait else 0.0)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.exitcode is None]
    for action, wait_s in (("terminate", 1.0), ("kill", 5.0)):
        if not alive:
            break
        for proc in alive:
            for child in _descendants(proc.pid):
                with contextlib.suppress(psutil.Error):
                    getattr(child, action)()
            with contextlib.suppress(OSError):
                getattr(proc, action)()
        end = time.monotonic() + wait_s
        for proc in alive:
            proc.join(max(0.0, end - time.monotonic()))
        alive = [p for p in alive if p.exitcode is None]


def _descendants(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()
_exit_hook_registered = False


def _register_exit_hook() -> None:
    """At interpreter exit, stop every live pool (bounded); registered on first use."""
    global _exit_hook_registered, _OOM_BASELINE
    if not _exit_hook_registered:
        atexit.register(_stop_all_pools)
        os.register_at_fork(after_in_child=_disown_workers)
        _OOM_BASELINE = _oom_kills()
        _exit_hook_registered = True


def _disown_workers() -> None:
    """In a forked child: the workers are the parent's; multiprocessing must not
    count them as ours (its exit hook would SIGTERM every daemonic child it knows)."""
    import multiprocessing.process as mp_process

    children = getattr(mp_process, "_children", None)
    if not isinstance(children, set):  # pragma: no cover - a future CPython
        return
    for pool in list(_live_pools):
        for slot in list(pool._state.slots):
            children.discard(slot.process)


def _stop_all_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.shutdown(wait=False, cancel_futures=True)


def _context(start_method: str | None) -> Any:
    import multiprocessing as mp

    method = start_method or default_start_method()
    if method not in mp.get_all_start_methods():
        raise ValueError(
            f"start_method {method!r} is not available here; "
            f"choose one of {mp.get_all_start_methods()}"
        )
    if method == "fork" and cuda_initialised():
        raise ValueError(
            "start_method='fork' after CUDA was initialised in this process: the "
            "children would inherit a CUDA context they cannot use; use 'forkserver' "
            "or 'spawn'"
        )
    return _launch.context(method)
