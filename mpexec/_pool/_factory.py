"""Starting workers: a slot's rings, the boot data, the process, its hello.

A :class:`WorkerFactory` knows how to start worker ``i`` of a pool (start
method, seed, ``worker_init``, sizes) and nothing of the pool itself: the
executor uses it to start the workers, the manager to replace a lost one.

Under ``fork`` a child inherits every fd of the pool's process, and with them
the main-side ends of every worker started before it (14 fds each on Python
3.11: eight doorbells, four ring mappings, the process's two pipes): worker
``k`` held ``14 k`` fds, O(W^2) in all (30,000 at 64 workers). So the factory
notes the fds each worker's start opened here, and a fork child closes those
of the other live workers first thing (:attr:`WorkerBoot.inherited`); what
the user opened before the pool stays inherited, as ``fork`` promises.

Finding a start's fds costs O(what it opens), not O(every open fd): the kernel
gives each new fd the lowest free number, so a start's fds can only take the
numbers that were the lowest free ones before it (:class:`_FreeFds`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pickle
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import shm

from .. import _launch, _worker
from .._errors import BrokenPoolError, RemoteTraceback, start_error
from .._host import cuda_initialised, default_start_method, resolve_malloc_controls
from .._protocol import FAILED, HEADER, HELLO, body_of
from .._tracebacks import full_tracebacks
from ._crash import describe_exit
from ._state import PoolState, Slot


class WorkerFactory:
    """Starts the workers of one pool, each in its slot of ``state``."""

    def __init__(
        self,
        state: PoolState,
        ctx: Any,
        lifeline: shm.Lifeline,
        *,
        seed_entropy: int,
        init: bytes | None,
        worker_arena_size: int,
        inline_max: int,
        start_timeout: float,
        arena_capacity: int | None = None,
        warm_memory: int = 0,
    ) -> None:
        self.state = state  # where a started worker's slot goes
        self.ctx = ctx  # the multiprocessing context (``_launch``'s) that starts them
        self.lifeline = lifeline  # every worker watches it: the pool's process died
        self.seed_entropy = seed_entropy
        self.init = init  # cloudpickled (worker_init, args), or None
        self.worker_arena_size = worker_arena_size
        self.arena_capacity = arena_capacity  # each worker's arena's cap (None: the default)
        self.inline_max = inline_max
        self.start_timeout = start_timeout
        self.warm_memory = warm_memory  # malloc's bound in each worker (_host.keep_memory_warm)
        # Under fork: index -> (its slot's generation, the fds its start opened here), see
        # the module doc. Not the slot: it holds the rings, whose mappings would then
        # outlive the pool's shutdown for as long as the pool object does.
        self.opened: dict[int, tuple[int, frozenset[int]]] | None = (
            {} if getattr(ctx, "method", None) == "fork" and _FD_DIR.is_dir() else None
        )
        self.live_fds: set[int] = set()  # the union of ``opened``'s fds: kept, not rebuilt
        self.fds_lock = threading.Lock()  # the manager relaunches while the first start runs
        self.free_fds = _FreeFds()

    def start(self, indices: Iterable[int], generation: int, wait_all: bool = True) -> None:
        """Start workers in parallel, then wait for each to say hello (``wait_all``)
        or for the first only: the manager reads the others' as replacements'."""
        # The fork server forks each worker while the next one is prepared here.
        with _launch.pipelined_starts():
            started = [self.launch(index, generation) for index in indices]
        for slot in started:
            slot.pid = slot.process.pid  # before any wait on its sentinel
        deadline = time.monotonic() + self.start_timeout
        if wait_all or len(started) < 2:
            for slot in started:
                self.await_hello(slot, deadline)
            return
        # The first to say anything (a hello, a failure, its death) is read here.
        watched = [x for slot in started for x in (slot.done, slot.process)]
        first = started[0]
        for obj in shm.wait(watched, max(0.0, deadline - time.monotonic())):
            first = next(s for s in started if obj is s.done or obj is s.process)
            break
        self.await_hello(first, deadline)
        for slot in started:
            if slot is not first:
                slot.start_deadline = deadline

    def launch(self, index: int, generation: int) -> Slot:
        """Start worker ``index`` (it is ready once its hello is read)."""
        arena = self.state.arena
        assert arena is not None
        free: tuple[int, ...] = ()
        if self.opened is not None:
            arena.prepare_links()  # the links' shared flag page: no one start's fds
            free = self.free_fds.lowest()
        slot = Slot(index, generation)
        slot.arg_releases = arena.link()
        inherited = self.others_fds(free) if self.opened is not None else ()
        boot = _worker.WorkerBoot(
            index=index,
            generation=generation,
            tasks=slot.tasks,
            done=slot.done,
            arg_releases=slot.arg_releases,
            result_releases=slot.result_releases,
            lifeline=self.lifeline,
            main_arena_id=arena.id,
            main_pid=os.getpid(),
            seed_entropy=self.seed_entropy,
            init=self.init,
            # A cap below the segment size: segments of the cap's size.
            segment_size=min(self.worker_arena_size, self.arena_capacity or self.worker_arena_size),
            capacity=self.arena_capacity,
            inline_max=self.inline_max,
            full_traceback=full_tracebacks(),
            warm_memory=self.warm_memory,
            inherited=inherited,
        )
        slot.process = self.ctx.Process(
            target=_worker.main, args=(boot,), name=f"mpexec-worker-{index}", daemon=True
        )
        try:
            slot.process.start()
        except BaseException:
            slot.close_rings()
            arena.reclaim(slot.arg_releases)
            raise
        for ring in (slot.tasks, slot.done, slot.result_releases, slot.arg_releases):
            ring.handed_over()  # the worker has its fds: ours would only count
        if self.opened is not None:
            # Noted after those closed: a later child must never close a number
            # that was free when it started (its own pipe may have taken it).
            opened = self.free_fds.taken(free)
            with self.fds_lock:
                self.forget(index)
                self.opened[index] = (slot.generation, opened)
                self.live_fds |= opened
        self.state.install(slot)
        return slot

    def others_fds(self, free: tuple[int, ...]) -> tuple[int, ...]:
        """The fds a fork child inherits of the other live workers' starts.

        Only a worker not yet retired counts: a retired one's fds are closed and
        their numbers may be taken by other files. ``free`` (the numbers free
        before this start) never goes: a number free then is no other worker's
        fd, whatever worker once had it, and this start's own may take it.
        """
        with self.fds_lock:
            fds = self.live_fds - set(free)
        return tuple(sorted(fds))

    def forget(self, index: int) -> None:
        """Drop worker ``index``'s noted fds (its pool closes them next); under ``fds_lock``."""
        assert self.opened is not None
        gone = self.opened.pop(index, None)
        if gone is not None:
            self.live_fds -= gone[1]

    def relaunch(self, slot: Slot) -> Slot:
        """A replacement for ``slot``'s lost worker; the manager reads its hello."""
        new = self.launch(slot.index, slot.generation + 1)
        new.pid = new.process.pid
        new.start_deadline = time.monotonic() + self.start_timeout
        return new

    def retire(self, slot: Slot) -> None:
        """``slot``'s worker is gone: the arena takes back what it had not released."""
        if self.opened is not None:
            with self.fds_lock:
                if self.opened.get(slot.index, (None,))[0] == slot.generation:
                    self.forget(slot.index)
        arena = self.state.arena
        if arena is not None and slot.arg_releases is not None:
            arena.reclaim(slot.arg_releases)

    def await_hello(self, slot: Slot, deadline: float) -> None:
        try:
            rec = slot.done.pop(max(0.0, deadline - time.monotonic()), [slot.process])
        except shm.RingTimeoutError:
            raise BrokenPoolError(
                f"worker {slot.index} (pid {slot.pid}) did not start within {self.start_timeout} s"
            ) from None
        except shm.SharedMemoryError:
            slot.process.join(1)
            err = died_starting(slot)
            raise err from err.__cause__
        hello(slot, rec)


_FD_DIR = Path("/proc/self/fd")
#: What a worker's start opens here: doorbells (eventfds), ring mappings
#: (memfds, duplicated by ``mmap`` before Python 3.13), the process's pipes.
_SLOT_KINDS = ("anon_inode:[eventfd]", "/memfd:mpx-", "pipe:")


class _FreeFds:
    """The fds a start opens, found among the numbers that were free before it.

    The kernel gives each new fd the lowest free number, so whatever a start
    opens takes some of the ``spare`` lowest free numbers, as long as it never
    holds more than ``spare`` new fds at once: so only those are read after it,
    never the whole fd table (O(W) at W workers). ``spare`` doubles once a
    start used over half of them, to keep that margin.
    """

    def __init__(self, spare: int = 64) -> None:
        self.spare = spare

    def lowest(self) -> tuple[int, ...]:
        """The ``spare`` lowest free fd numbers (fewer at the open-file limit).

        Taken by duplicates of one fd, then closed: the next fds opened get them.
        """
        held: list[int] = []
        try:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            while len(held) < self.spare:
                held.append(os.dup(held[0]))
        except OSError as exc:
            # At the limit every free number below it is held: none is missed.
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
        finally:
            for fd in held:
                os.close(fd)
        return tuple(held)

    def taken(self, free: tuple[int, ...]) -> frozenset[int]:
        """Those of ``free`` now open on a worker's kind of file.

        Only those kinds: a file another thread opened meanwhile is the user's,
        and stays inherited.
        """
        fds = set()
        used = 0
        for i, fd in enumerate(free):
            with contextlib.suppress(OSError):  # closed again, or never opened
                fcntl.fcntl(fd, fcntl.F_GETFD)  # a closed fd fails here, 4x cheaper
                used = i + 1
                if os.readlink(f"{_FD_DIR}/{fd}").startswith(_SLOT_KINDS):
                    fds.add(fd)
        if 2 * used > self.spare:
            self.spare *= 2
        return frozenset(fds)


def hello(slot: Slot, rec: bytes) -> None:
    """Read a worker's first record: it is ready, or it failed to start (raised)."""
    kind, flags, _, _ = HEADER.unpack_from(rec)
    body = body_of(rec, flags)
    if kind == FAILED:
        exc, tb = pickle.loads(body)
        err = start_error(
            f"worker {slot.index} (pid {slot.pid}) failed to start: "
            f"{type(exc).__name__}: {exc} (the worker's traceback follows)",
            exc,
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


def died_starting(slot: Slot) -> BrokenPoolError:
    """A worker died before its hello: with its start-up traceback as the cause."""
    return _launch.start_failure(
        f"worker {slot.index} (pid {slot.pid})",
        slot.process,
        describe_exit(slot.process.exitcode),
    )


def context(start_method: str | None) -> Any:
    """The multiprocessing context for ``start_method`` (default: the host's), checked."""
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
    if method == "fork":
        resolve_malloc_controls()
    return _launch.context(method)
