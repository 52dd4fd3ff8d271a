"""The worker process: a loop over its task ring, calling functions on shared arrays.

A worker pops records (the format and the cancellation handshake are in
``_protocol``), runs each call on read-only views of its arguments, writes the
result into its own arena and pushes the OK or ERROR record back. While idle
it gives back the memory the pool lets go of; it exits when its task ring is
closed, or at once when the pool's process dies (its lifeline).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import multiprocessing
import os
import pickle
import random
import signal
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np
import numpy.random  # every worker seeds it: loaded before the fork server forks

import shm

from . import _codec
from ._errors import SerializationError
from ._host import keep_memory_warm, trim_warm_memory
from ._protocol import (
    CALL,
    CANCEL,
    ERROR,
    FAILED,
    FORGET,
    FUNC,
    HEADER,
    HELLO,
    OK,
    SKIPPED,
    SPIN_SECONDS,
    VERDICT,
    body_of,
    record,
    spill,
    spin_until,
)
from ._tracebacks import FULL_TRACEBACK_ENV, pack_error


@dataclass
class WorkerBoot:
    """Everything a worker gets at its start (rings travel with their fds)."""

    index: int
    generation: int
    tasks: shm.Ring
    done: shm.Ring
    arg_releases: shm.Ring  # the main arena's link: our releases of its views go back
    result_releases: shm.Ring  # main's releases of our results come in
    lifeline: shm.Lifeline
    main_arena_id: int
    main_pid: int
    seed_entropy: int
    init: bytes | None  # cloudpickled (worker_init, args)
    segment_size: int
    inline_max: int
    capacity: int | None = None  # the pool's arena_capacity caps our arena too
    #: The caller's MPEXEC_FULL_TRACEBACK: a fork server's children have the
    #: environment of its start, not the caller's now.
    full_traceback: bool = False
    warm_memory: int = 0  # bytes of freed memory malloc may keep (0: glibc's defaults)
    #: Under fork: the fds of the other workers' starts this child inherited,
    #: closed first thing (see ``_pool._factory``); empty otherwise.
    inherited: tuple[int, ...] = ()


def seed_worker(entropy: int, index: int, generation: int) -> None:
    """Seed ``numpy.random`` and ``random`` from the pool's seed and our slot."""
    seq = np.random.SeedSequence(entropy, spawn_key=(index, generation))
    state = seq.generate_state(4)
    np.random.seed(state)
    random.seed(int.from_bytes(state.tobytes(), "little"))


def _set_parent_death_signal(main_pid: int) -> None:
    # Only when the pool's process is our parent (spawn): under forkserver our
    # parent is the fork server, and the lifeline watchdog does the job.
    if sys.platform != "linux" or os.getppid() != main_pid:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != main_pid:  # it died before prctl took effect
            os._exit(70)


def _watch_parent(lifeline: shm.Lifeline, arena: shm.Arena) -> None:
    """Exit as soon as the pool's process is gone, even in the middle of a call."""
    lifeline.wait()
    arena.unlink()  # finalizers will not run after os._exit
    os._exit(70)


#: In a worker process: its index in the pool and its arena (None elsewhere).
_current: tuple[int, shm.Arena] | None = None


def current() -> tuple[int, shm.Arena] | None:
    """This worker's index and arena, or None outside a pool's worker.

    For code that runs in the workers and wants to build its results straight
    in shared memory (``arena.empty``): such an array travels back by
    descriptor, with no copy. The loader back-ends collate batches this way.
    """
    return _current


#: Calls shorter than this (seconds) are not followed by a look at the heap
#: (~1 µs): touching enough memory to matter takes longer.
_TRIM_AFTER = 1e-3


class _Worker:
    def __init__(self, boot: WorkerBoot, arena: shm.Arena, warm: bool = False) -> None:
        self.boot = boot
        self.watch = [boot.lifeline]  # what every blocking ring wait also watches
        self.arena = arena
        self.fns: dict[int, Any] = {}  # fn id -> function, or the exception loading it
        self.peer = boot.result_releases
        self.backlog: collections.deque[bytes] = collections.deque()  # records to handle
        self.calls = 0  # CALL records started (or skipped) so far
        self.cancels: set[int] = set()  # numbers of the calls the pool asks to cancel
        self.verdicts: dict[int, bool] = {}  # call number -> cancel it
        self.closed = False  # the task ring's end marker was seen
        # malloc keeps freed memory (keep_memory_warm): checked after a call
        # long enough to have made large blocks, so that it stays within bound.
        self.warm = boot.warm_memory if warm else 0

    def serve(self) -> None:
        while True:
            if not self.backlog:
                if self.closed:
                    return
                if not spin_until(self.poll, SPIN_SECONDS):
                    self.idle()
                self.take(None)
            while self.backlog:
                self.handle(self.backlog.popleft())
            shm.flush_releases()

    def poll(self) -> bool:
        """Whether a task may wait; meanwhile the pool's releases of our results are applied.

        A released result's block is then free before the next call's result
        needs one, instead of being collected on that call's way back.
        """
        if self.boot.result_releases.may_have_records():
            self.arena.collect()
        return self.boot.tasks.may_have_records()

    def take(self, timeout: float | None) -> None:
        """Pop what the task ring holds (waiting up to ``timeout``) into the backlog."""
        if self.closed:
            return
        try:
            batch = self.boot.tasks.pop_many(timeout=timeout, watch=self.watch)
        except shm.RingTimeoutError:
            return
        except shm.RingClosedError:  # the pool closed our ring, or died
            self.closed = True
            return
        for rec in batch:
            kind = rec[0]
            if kind in (CANCEL, VERDICT):
                _, _, _, n = HEADER.unpack_from(rec)
                if n < self.calls:
                    continue  # about a call already decided: it was running
                if kind == CANCEL:
                    self.cancels.add(n)
                else:
                    self.verdicts[n] = rec[HEADER.size] == 1
            else:
                self.backlog.append(rec)

    def cancelled(self) -> bool:
        """Start the next call, or learn that the pool cancelled it (see the module doc)."""
        self.calls += 1
        n = self.calls
        if self.cancels or self.verdicts:  # left from the call before: it ran
            self.cancels.discard(n - 1)
            self.verdicts.pop(n - 1, None)
        self.boot.done.publish_progress(n)
        # A CANCEL for this call was pushed before our progress, or not at all: the
        # head (read after the barrier above) says which without a pop's syscall.
        if self.boot.tasks.may_have_records():
            self.take(0)
        if n not in self.cancels:
            return False
        while n not in self.verdicts and not self.closed:
            self.take(None)  # the pool pushes it right after CANCEL
        self.cancels.discard(n)
        return self.verdicts.pop(n, True)

    def idle(self) -> None:
        """Wait for a task; meanwhile give back what the pool lets go of.

        A result may hold the pool's memory (a function that returned a view of
        its argument): the pool's release of the result reaches this arena,
        which lets go of that memory in turn. Applied here, as it arrives, an
        idle worker never pins memory that the pool's caller has dropped.
        """
        boot = self.boot
        while True:
            self.arena.collect()
            shm.flush_releases()
            ready = shm.wait([boot.tasks, boot.result_releases, boot.lifeline])
            if boot.tasks in ready or boot.lifeline in ready:
                return

    def handle(self, rec: bytes) -> None:
        kind, flags, fn_id, task_id = HEADER.unpack_from(rec)
        if kind == CALL:
            if self.cancelled():
                # Open and drop the arguments: the pool's memory they hold goes back.
                with contextlib.suppress(Exception):
                    _codec.decode(body_of(rec, flags))
                _codec.revoke_lent()
                done, watch = self.boot.done, self.watch
                done.push(record(SKIPPED, b"", task_id), timeout=None, watch=watch)
                return
            self.call(task_id, fn_id, body_of(rec, flags))
        elif kind == FUNC:
            try:
                self.fns[fn_id] = cloudpickle.loads(body_of(rec, flags))
            except BaseException as exc:
                self.fns[fn_id] = _LoadFailure(exc)
        elif kind == FORGET:
            for (dead,) in struct.iter_unpack("<I", body_of(rec, flags)):
                self.fns.pop(dead, None)

    def call(self, task_id: int, fn_id: int, body: bytes | memoryview) -> None:
        held: list[Any] = []  # the decoded arguments, dropped once the answer is pushed
        start = time.perf_counter()
        try:
            rec = self.run(task_id, fn_id, body, held)
        except BaseException as exc:
            rec = spill(ERROR, pack_error(exc), self.arena, self.peer, task_id)
        self.boot.done.push(rec, timeout=None, watch=self.watch)
        # Only now do the arguments' views go, and their releases with them:
        # the caller is reading the answer meanwhile, not waiting on them. The
        # pool's thread that reads it often wakes on this core: let it run first.
        os.sched_yield()
        # Writable arguments are the caller's again: a view the function kept faults.
        _codec.revoke_lent()
        held.clear()
        if self.warm and time.perf_counter() - start > _TRIM_AFTER:
            # Blocks freed under one still in use stay in the heap, however
            # large (malloc trims only its top): past the bound they go back.
            trim_warm_memory(self.warm)

    def run(self, task_id: int, fn_id: int, body: bytes | memoryview, held: list[Any]) -> bytes:
        """Call the function on the decoded arguments; the OK record of its result.

        The arguments are left in ``held`` for the caller to drop.
        """
        fn = self.fns[fn_id]
        if isinstance(fn, _LoadFailure):
            raise fn.error()
        try:
            args, kwargs = _codec.decode(body)
        except Exception as exc:
            raise SerializationError(
                f"the arguments could not be unpickled in the worker: {type(exc).__name__}: {exc}"
            ) from exc
        del body
        held.append((args, kwargs))
        result = fn(*args, **kwargs)
        del args, kwargs
        enc = _codec.encode_result(result, self.arena, self.peer, self.boot.inline_max)
        return spill(OK, enc.data, self.arena, self.peer, task_id)


class _LoadFailure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def error(self) -> SerializationError:
        err = SerializationError(
            "the function could not be unpickled in the worker: "
            f"{type(self.exc).__name__}: {self.exc}"
        )
        err.__cause__ = self.exc
        return err


def _load_init(data: bytes) -> Any:
    """``(worker_init, args)``; a failure says why a module may be missing here."""
    try:
        return cloudpickle.loads(data)
    except Exception as exc:
        hint = ""
        if isinstance(exc, ImportError):
            hint = (
                ". A module the pool's process has imported cannot be imported by the "
                "workers (loaded from a file path rather than from sys.path, not installed "
                "for this interpreter, or removed since): put its directory on sys.path "
                "(or PYTHONPATH) before the pool starts, install it, or send it by value "
                "with cloudpickle.register_pickle_by_value(module)"
            )
        raise SerializationError(
            "worker_init or its arguments could not be unpickled in the worker: "
            f"{type(exc).__name__}: {exc}{hint}"
        ) from exc


def main(boot: WorkerBoot) -> None:
    """Entry point of a worker process."""
    # Ctrl-C reaches the whole process group: the pool's process decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Our copies of the objects that own these are never used or closed here
    # (a fork child leaves by os._exit: no finalizer runs).
    for fd in boot.inherited:
        with contextlib.suppress(OSError):
            os.close(fd)
    # Started daemonic (the pool's process terminates it at exit), but a function
    # may start processes of its own (a nested pool, a pipeline, a DataLoader), which
    # multiprocessing refuses a daemonic process. Its own children never outlive it:
    # ours follow their lifeline, and multiprocessing ends daemonic ones at its exit.
    multiprocessing.current_process().daemon = False
    warm = keep_memory_warm(boot.warm_memory)  # before the first call allocates anything
    if boot.full_traceback:
        os.environ[FULL_TRACEBACK_ENV] = "1"
    if shm.platform_info().backend == "memfd":
        # Named segments must be unlinked on the way out, which SIGKILL forbids:
        # then the lifeline thread alone ends the worker.
        _set_parent_death_signal(boot.main_pid)
    done = boot.done
    try:
        arena = shm.Arena(boot.segment_size, boot.capacity, name=f"worker-{boot.index}")
    except BaseException as exc:
        done.push(record(FAILED, pack_error(exc)), timeout=10)
        return

    # The pool escalates with SIGTERM: unlink named segments, then go.
    def on_sigterm(signum: int, frame: object) -> None:
        arena.unlink()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(
        target=_watch_parent, args=(boot.lifeline, arena), name="mpexec-lifeline", daemon=True
    ).start()
    arena.link(boot.result_releases)
    shm.set_release_route(boot.main_arena_id, boot.arg_releases)
    global _current
    _current = (boot.index, arena)
    try:
        seed_worker(boot.seed_entropy, boot.index, boot.generation)
        if boot.init is not None:
            init, init_args = _load_init(boot.init)
            init(*init_args)
    except BaseException as exc:
        done.push(spill(FAILED, pack_error(exc), arena, boot.result_releases), timeout=10)
        arena.unlink()
        return
    done.push(record(HELLO, pickle.dumps((os.getpid(), arena.id))), timeout=10)
    worker = _Worker(boot, arena, warm)
    try:
        worker.serve()
    finally:
        worker.fns.clear()
        shm.flush_releases()
        with contextlib.suppress(shm.RingClosedError, OSError):
            done.close_producer()
        # Forkserver children end in os._exit (no finalizers): unlink names now.
        # The pool has opened every result it will read; its mappings stay valid.
        arena.unlink()
