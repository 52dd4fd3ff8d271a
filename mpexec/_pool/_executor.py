"""WorkerPool: the executor's face (``submit``, ``map``, ``shutdown``) and its seam.

It validates, counts and queues calls; the :class:`~._sender.CallSender`
pushes them to workers, the :class:`~._manager.Manager` thread delivers the
results, and ``_stop`` stops it all (see the package's docstring for the picture).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

import shm

from .. import _codec, _pid
from .._calls import call_arguments
from .._errors import PoolClosedError
from .._host import ensure_open_files, minor_faults, usable_cpus
from .._mapping import CallExecutor
from .._tracebacks import for_caller
from . import _stop
from ._factory import WorkerFactory, context
from ._future import Task, UnitFuture
from ._manager import Manager
from ._sender import CallSender
from ._state import PoolState, PoolStats, PoolStatus
from ._waiting import Waiter

T = TypeVar("T")

#: Default bytes of freed memory a worker's malloc keeps (``warm_memory=``).
WARM_MEMORY = 256 << 20


class WorkerPool(CallExecutor):
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
      arena (it grows by segments up to ``arena_capacity``, which caps each
      worker's result arena too).
    - ``results``: ``"copy"`` (default) hands every result array back as the
      caller's own; ``"view"`` hands back a result that is a view of shared
      memory (say, a function that returned a slice of its input) as a
      read-only view, uncopied, as :meth:`submit_call` does with ``view=True``.
    - ``warm_memory``: bytes of freed memory each worker's malloc may keep
      mapped (default 256 MiB; 0 keeps glibc's defaults). glibc hands large
      freed blocks back to the kernel, so a function whose temporaries run to
      hundreds of KiB, or whose result is a 64 MiB array, faults every page in
      again on every call; kept, they stay warm. Each worker's RSS may stay up
      to this much above what it uses.
    - ``ready``: ``"all"`` (default) returns once every worker has started, and
      raises here if one cannot (its ``worker_init`` failed, say); ``"first"``
      returns once the first has, so calls start while the others come up (a
      loader's first batch need not wait for its last worker). A later worker
      that cannot start then breaks the pool: calls fail with
      :class:`BrokenPoolError`, the worker's error as its cause.
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
        results: Literal["copy", "view"] = "copy",
        warm_memory: int = WARM_MEMORY,
        ready: Literal["all", "first"] = "all",
    ) -> None:
        if num_workers is None:
            num_workers = usable_cpus()
        if isinstance(num_workers, bool) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, not {num_workers!r}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive or None, not {timeout!r}")
        if type(warm_memory) is not int or warm_memory < 0:  # bool, float: refused too
            raise ValueError(f"warm_memory must be an int >= 0 (bytes), not {warm_memory!r}")
        if results not in ("copy", "view"):
            raise ValueError(f"results must be 'copy' or 'view', not {results!r}")
        if ready not in ("all", "first"):
            raise ValueError(f"ready must be 'all' or 'first', not {ready!r}")
        self.num_workers = num_workers
        self.timeout = timeout
        self.restart = restart
        self._inline = num_workers == 0
        self._state = PoolState(
            inline=self._inline, view_results=results == "view", timed=timeout is not None
        )
        seed_entropy = int(np.random.SeedSequence(seed).entropy)  # type: ignore[arg-type]
        init = (
            _codec.dump_value((worker_init, tuple(worker_init_args)), "worker_init")
            if worker_init is not None
            else None
        )
        self._manager: Manager | None = None
        self._finalizer: weakref.finalize[Any, WorkerPool] | None = None
        if self._inline:
            return
        ctx = context(start_method)
        ensure_open_files(num_workers)  # before anything starts: fail at once, or fit
        # Sealed: workers cannot write the pool's memory, even by reopening its
        # fds, but for buffers made to be written (pool.empty, pool.put).
        state = self._state
        state.adopt_arena(shm.Arena(arena_size, arena_capacity, name="pool", sealed=True))
        self._lifeline = shm.Lifeline()
        _stop.register_exit_hook()
        self._sender = CallSender(
            state, inline_max=inline_max, push_timeout=start_timeout, timeout=timeout
        )
        self._factory = WorkerFactory(
            state,
            ctx,
            self._lifeline,
            seed_entropy=seed_entropy,
            init=init,
            worker_arena_size=worker_arena_size,
            arena_capacity=arena_capacity,
            inline_max=inline_max,
            start_timeout=start_timeout,
            warm_memory=warm_memory,
        )
        try:
            self._factory.start(range(num_workers), generation=0, wait_all=ready == "all")
        except BaseException as exc:
            _stop.shutdown(state, self._lifeline, None, wait=False, cancel=True)
            # The factory's frames hold the started workers' rings, whose mappings
            # keep an fd each for as long as the error is kept (pytest keeps it).
            raise exc.with_traceback(None)  # noqa: B904 - the same error, cause kept
        # What the manager holds of the pool: a weak reference, so that the pool can be collected.
        self._manager = Manager(state, self._factory, self._sender, timeout, weakref.ref(self))
        self._manager.start()
        # Collected without shutdown(): what it was given still finishes (_stop.dropped).
        self._finalizer = weakref.finalize(
            self, _stop.dropped, state, self._lifeline, self._manager
        )
        _stop.track(self, state)

    # ------------------------------------------------------------ the executor
    def submit_call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        worker: int | None = None,
        view: bool = False,
    ) -> Future[T]:
        """``submit``, for code built on the pool: pinned calls, results as views.

        ``worker``: run it on that worker index (modulo ``num_workers``), after
        the calls submitted to that index earlier, in submission order; a
        worker that is replaced keeps its index, so state kept in a worker's
        globals stays with its index for as long as the worker lives.
        ``view``: a result's array that views shared memory other arrays may
        view too (a slice of an input) comes back as a read-only view,
        uncopied (valid for as long as it is held), not copied into an array
        of the caller's own. An array the function made is the caller's
        either way: a writable view of the worker's memory, uncopied. Raises
        as :meth:`submit` does.
        """
        kwargs = call_arguments(fn, kwargs)
        if self._inline:
            self._state.check_not_forked()
            return self._run_inline(fn, args, kwargs)
        future = self._submit(fn, args, kwargs, worker, view, None).future
        assert isinstance(future, Future)
        return future

    def run_call(
        self, fn: Callable[..., T], args: tuple[Any, ...] = (), *, worker: int | None = None
    ) -> T:
        """``submit_call(fn, args, worker=worker, view=True).result()``, with no ``Future``.

        For code built on the pool whose thread only waits for its call (a TF
        op's body, run by N TF threads at once): the call is a hooked one whose
        hook lets go of a lock the caller sleeps on (the GIL released, never
        polling), and a caller other than the main thread whose call is the
        only one queued on its worker reads that worker's done record itself.
        Returns the result or raises the call's error, as ``result()`` does;
        an interrupted wait (Ctrl-C) leaves the call running.
        """
        __tracebackhide__ = True  # the caller sees the call's error, not this re-raise
        if self._inline:
            return self.submit_call(fn, args, worker=worker, view=True).result()
        # call_arguments only to raise its TypeError (mypy's Callable is no proof): a call
        # less a call.
        kwargs: dict[str, Any] = {} if callable(fn) else call_arguments(fn, None)  # type: ignore[redundant-expr]
        waiter = Waiter()
        task = self._submit(fn, args, kwargs, worker, True, waiter)
        try:
            return waiter.wait(task)  # type: ignore[no-any-return]
        except Exception as exc:
            raise for_caller(exc)  # noqa: B904 - the same exception, its own cause kept

    def submit_hooked(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        worker: int | None,
        hook: Callable[[UnitFuture], object],
        *,
        view: bool = True,
    ) -> None:
        """``submit_call(view=view)`` for code built on the pool, with no ``Future``.

        ``hook(outcome)`` runs once the call settles, in the thread that
        settles it (the manager's, with the result; a thread that cancels or
        fails it); ``outcome`` answers ``cancelled()``, ``exception()`` and
        ``result()`` as a done ``Future``'s. A pipeline's units come back this
        way: no condition, no waiters, no guarded callback a call. Not for an
        inline pool (``num_workers=0``), whose calls run in the caller: use
        :meth:`submit_call`. Raises as :meth:`submit` does.
        """
        if self._inline:
            raise ValueError("an inline pool runs calls in the caller: use submit_call")
        self._submit(fn, args, call_arguments(fn, kwargs), worker, view, hook)

    def _submit(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        worker: int | None,
        view: bool,
        hook: Callable[[UnitFuture], object] | UnitFuture | None,
    ) -> Task:
        state = self._state
        if state.pid != _pid.pid:  # check_not_forked()'s test, inline
            state.check_not_forked()  # raises
        task = None
        try:
            with state.lock:
                # A TF op's body submits on its every call, from a thread woken cold:
                # PoolState's one-line steps (check_usable, new_task,
                # count_submitted, pick_slot's for any worker) are inline here.
                if state.broken is not None or state.closed:
                    state.check_usable()  # raises
                task = Task(state, next(state.next_task_id), fn, args, kwargs, worker, view, hook)
                if worker is None:
                    slot = state.roster.least_busy()
                else:  # state.pick_slot(task), inline
                    slots = state.slots
                    slot = slots[worker % len(slots)]
                    if not slot.has_room():
                        slot = None
                if slot is None or state.pending:
                    # Busy, or calls wait ahead of it (order kept): validate now,
                    # encode when a worker frees up.
                    self._sender.check_picklable(fn, args, kwargs)
                    state.pending.append(task)
                    if slot is not None:
                        self._sender.dispatch_pending()
                else:
                    # A run_call's caller reads its answer itself (or has the manager
                    # watch the ring again): see _delivery.read_call.
                    self._sender.send(task, slot, type(hook) is Waiter)
                state.submitted += 1
        except BaseException as exc:
            # (A Ctrl-C.) Whether the call was taken: pushed to its worker, or left
            # waiting, it runs and settles (its hook is called); its caller must not
            # send it again (a stateful op's call would run twice: the scheduler's _send).
            taken = task is not None and bool(task.sent or task in state.pending)
            exc.mpexec_taken = taken  # type: ignore[attr-defined]
            raise
        return task

    def _run_inline(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        state = self._state
        if state.closed:
            raise PoolClosedError("cannot submit to a pool after shutdown()")
        with state.lock:
            state.count_submitted()
        future.set_running_or_notify_cancel()
        try:
            result = fn(*_readonly(args), **_readonly(kwargs))
        except BaseException as exc:
            state.count_ran_inline(ok=False)
            # A plain Future's result() raises it: its traceback starts at the user's code.
            future.set_exception(for_caller(exc))
        else:
            state.count_ran_inline(ok=True)
            future.set_result(result)
        return future

    def _before_map(self) -> bool:
        self._state.check_not_forked()
        return not self._inline  # an inline pool never pickles

    # ------------------------------------------------------------ shared memory
    def empty(self, shape: int | tuple[int, ...], dtype: npt.DTypeLike = np.float64) -> Any:
        """A new array in the pool's shared memory: it reaches workers without a copy.

        It has its memory pages to itself (see ``docs/in-place-mutation.md``), so
        passed :func:`writable` a worker can write it and nothing else of ours.
        """
        state = self._state
        state.check_not_forked()
        state.check_open()
        if state.arena is None:
            return np.empty(shape, dtype)
        return state.arena.empty(shape, dtype, peer_writable=True)

    def put(self, array: Any) -> Any:
        """A copy of ``array`` in the pool's shared memory, to pass to many calls.

        Its pages are its own, as for :meth:`empty`.
        """
        state = self._state
        state.check_not_forked()
        state.check_open()
        if state.arena is None:
            return np.array(array, copy=True)
        return state.arena.put(array, peer_writable=True)

    def described(self, array: Any) -> tuple[shm.ArrayDescriptor, bytes] | None:
        """For code built on the pool: ``array``, a writable view of :meth:`empty`'s memory,
        described once (its descriptor and that packed), to pass :func:`writable` with no
        look at it each time (a pipeline's batch blocks); None: not such a view."""
        arena = self._state.arena
        desc = None if arena is None else arena.describe_own(array)
        return None if desc is None else (desc, desc.pack())

    def share(self, array: Any) -> Any:
        """A read-only copy of ``array`` in the pool's shared memory, for many calls.

        Unlike :meth:`put`'s, its memory is packed with other arrays (no pages
        of its own), so it is never passed :func:`writable`: the one copy where
        data enters code built on the pool (a pipeline's sources).
        """
        state = self._state
        state.check_not_forked()
        state.check_open()
        out = np.array(array, copy=True) if state.arena is None else state.arena.put(array)
        out.flags.writeable = False
        return out

    # ------------------------------------------------------------ looking at it
    def stats(self) -> PoolStats:
        """Counters and the arena's occupancy (a snapshot)."""
        self._state.check_not_forked()
        stats = self._state.stats(self.num_workers)
        faults = sum(minor_faults(pid) or 0 for pid in self._state.pids())
        return dataclasses.replace(stats, worker_faults=faults)

    @property
    def status(self) -> PoolStatus:
        """Whether it takes calls (running, broken, closed, forked) and its owner's pid."""
        return self._state.status()

    @property
    def pids(self) -> list[int]:
        """Process ids of the current workers (after shutdown: of the last ones)."""
        self._state.check_not_forked()
        return self._state.pids()

    @property
    def processes(self) -> list[Any]:
        """The current workers' ``multiprocessing`` process objects, by worker index.

        For code that reports on the workers as a ``multiprocessing`` user
        would (``is_alive()``, ``exitcode``, ``join()``), such as the
        ``_workers`` list torch's DataLoader iterator keeps. The pool owns
        them: it joins and closes them when it shuts down. Empty after shutdown.
        """
        self._state.check_not_forked()
        return self._state.processes()

    # ------------------------------------------------------------ stopping
    def shutdown(
        self, wait: bool = True, *, cancel_futures: bool = False, grace: float | None = None
    ) -> None:
        """Stop the pool; idempotent.

        With ``wait``, queued calls finish first (unless ``cancel_futures``):
        like ``ProcessPoolExecutor``, that takes as long as they do (set the
        pool's ``timeout``, or ``grace``, to bound it). Then every worker is
        gone within a bounded time (closed ring, timed join, SIGTERM, SIGKILL).
        Without ``wait``, queued calls are cancelled and running ones abandoned
        (their futures fail with :class:`PoolClosedError`). Safe from several
        threads.

        ``grace`` (seconds, with ``wait``): how long calls may still run; past
        it the workers running one get SIGTERM, then SIGKILL a second later,
        and every call not finished fails with :class:`PoolClosedError` (a
        function that never returns cannot hold shutdown up).

        In a process forked from the pool's, it does nothing: the workers
        are the parent's, which goes on using them.
        """
        if grace is not None and not grace >= 0:
            raise ValueError(f"grace must be seconds >= 0 or None, not {grace!r}")
        state = self._state
        if state.pid != _pid.pid:
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        if self._inline:
            state.mark_closed()
            return
        _stop.untrack(self)
        _stop.shutdown(state, self._lifeline, self._manager, wait, cancel_futures, grace)
        if self._finalizer is not None:
            self._finalizer.detach()

    def handed_out(self, timeout: float = 2.0) -> None:
        """Wait (up to ``timeout`` s) until the pool's thread has left the callbacks of
        the futures it completed, and holds nothing it handed out.

        A future's callbacks run on that thread, which can wake the caller before it
        has let go of the result. For a caller that must hold the last reference to an
        error it raises: the error's traceback holds the caller's frames, and an object
        they hold (a pipeline) is then freed in the caller's thread, at once.
        """
        manager = self._manager
        if manager is not None:
            manager.handed_out(timeout)

    def __repr__(self) -> str:
        state = self._state
        status = (
            "inherited through fork"
            if state.pid != _pid.pid
            else "broken"
            if state.broken
            else "closed"
            if state.closed
            else "running"
        )
        return f"<WorkerPool {status} workers={self.num_workers} submitted={state.submitted}>"


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
