"""Stopping a pool: shutdown, the bounded escalation to SIGKILL, exit and fork hooks.

Shutdown is bounded and escalates: the task rings are closed (a worker exits
when it finds its ring closed), then a timed join, SIGTERM and SIGKILL of each
worker's process tree. At interpreter exit every live pool is stopped; in a
child forked from the pool's process, the pool is the parent's and is left
alone (``multiprocessing`` must not count its workers as the child's).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from typing import Any

import psutil

import shm

from .._errors import PoolClosedError
from . import _crash
from ._state import PoolState

_STOP_GRACE = 5.0  # seconds a worker gets to exit after its ring is closed


def shutdown(
    state: PoolState,
    lifeline: shm.Lifeline,
    manager: threading.Thread | None,
    wait: bool,
    cancel: bool,
) -> None:
    """Stop a pool: let queued calls finish (``wait``), then stop every worker."""
    if state.pid != os.getpid():
        return  # a forked child's exit: the workers and memory are the parent's
    if not state.begin_shutdown(cancel=cancel or not wait):
        return
    me = threading.current_thread()
    if manager is not None and wait and manager is not me:
        # It returns once every queued call is delivered (or failed by a crash).
        while manager.is_alive():
            manager.join(0.1)
    # One caller stops the workers and closes everything; another one (say
    # shutdown(wait=False) from a second thread) waits for it, then returns.
    with state.stop_lock:
        if not state.stopped:
            stop(state, lifeline, manager, wait)


def stop(
    state: PoolState,
    lifeline: shm.Lifeline,
    manager: threading.Thread | None,
    wait: bool,
) -> None:
    """Close the rings, stop the workers and the manager, fail what is left, let go."""
    me = threading.current_thread()
    with state.lock:
        slots = list(state.slots)
    for slot in slots:
        with contextlib.suppress(shm.SharedMemoryError, ValueError):
            slot.tasks.close_producer()
    stop_processes([s.process for s in slots if s.process is not None and s.pid], wait)
    if manager is not None and manager is not me:
        state.poke()
        manager.join(_STOP_GRACE)
    error = PoolClosedError("the pool was shut down before this call finished")
    for task in state.mark_stopped():
        task.fail(state.broken or error)
    for slot in slots:
        shm.set_release_route(slot.arena_id, None)
        slot.close_rings()
        if slot.process is not None and slot.process.exitcode is not None:
            slot.process.close()
        if slot.arg_releases is not None:
            slot.arg_releases.close()
    state.release()
    lifeline.close()


def stop_processes(procs: list[Any], wait: bool) -> None:
    """Timed join (if ``wait``), then SIGTERM, then SIGKILL of each worker's tree."""
    deadline = time.monotonic() + (_STOP_GRACE if wait else 0.0)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.exitcode is None]
    for action, wait_s in (("terminate", 1.0), ("kill", 5.0)):
        if not alive:
            break
        for proc in alive:
            for child in descendants(proc.pid):
                with contextlib.suppress(psutil.Error):
                    getattr(child, action)()
            with contextlib.suppress(OSError):
                getattr(proc, action)()
        end = time.monotonic() + wait_s
        for proc in alive:
            proc.join(max(0.0, end - time.monotonic()))
        alive = [p for p in alive if p.exitcode is None]


def descendants(pid: int | None) -> list[psutil.Process]:
    if pid is None:
        return []
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


# ---------------------------------------------------------------- exit and fork hooks

_live_pools: weakref.WeakSet[Any] = weakref.WeakSet()  # each WorkerPool, until shut down
_live_states: weakref.WeakSet[PoolState] = weakref.WeakSet()  # and its state
_exit_hook_registered = False


def register_exit_hook() -> None:
    """At interpreter exit, stop every live pool (bounded); registered on first use."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_stop_all_pools)
        os.register_at_fork(after_in_child=_disown_workers)
        _crash.record_oom_baseline()
        _exit_hook_registered = True


def track(pool: Any, state: PoolState) -> None:
    """Stop ``pool`` at exit if it is still live then; disown its workers in a fork."""
    _live_pools.add(pool)
    _live_states.add(state)


def untrack(pool: Any) -> None:
    _live_pools.discard(pool)


def _disown_workers() -> None:
    """In a forked child: the workers are the parent's; multiprocessing must not
    count them as ours (its exit hook would SIGTERM every daemonic child it knows)."""
    import multiprocessing.process as mp_process

    # A private name of multiprocessing (its record of this process's children):
    # the one place where the fork hook can take the parent's workers off it.
    children = getattr(mp_process, "_children", None)
    if not isinstance(children, set):  # pragma: no cover - a future CPython
        return
    for state in list(_live_states):
        for slot in list(state.slots):
            children.discard(slot.process)


def _stop_all_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.shutdown(wait=False, cancel_futures=True)
