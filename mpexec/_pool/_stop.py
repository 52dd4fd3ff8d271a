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
from collections.abc import Sequence
from typing import Any

import psutil

import shm

from .. import _pid
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
    grace: float | None = None,
) -> None:
    """Stop a pool: let queued calls finish (``wait``), then stop every worker.

    ``grace``: with ``wait``, the longest the calls still running get; past
    it, the workers running one are stopped at once (SIGTERM, then SIGKILL)
    and those calls fail with :class:`PoolClosedError`. None: no bound.
    """
    if state.pid != _pid.pid:
        return  # a forked child's exit: the workers and memory are the parent's
    if not state.begin_shutdown(cancel=cancel or not wait):
        return
    me = threading.current_thread()
    overran = False
    if manager is not None and wait and manager is not me:
        # It returns once every queued call is delivered (or failed by a crash).
        end = None if grace is None else time.monotonic() + grace
        while manager.is_alive():
            left = 0.1 if end is None else min(0.1, end - time.monotonic())
            if left <= 0:
                overran = True
                break
            manager.join(left)
    # One caller stops the workers and closes everything; another one (say
    # shutdown(wait=False) from a second thread) waits for it, then returns.
    with state.stop_lock:
        if not state.stopped:
            stop(state, lifeline, manager, wait, overran=overran)


#: Pools collected without ``shutdown`` whose calls still run: their manager
#: threads stop the workers once the last call is delivered.
_draining: dict[PoolState, tuple[shm.Lifeline, threading.Thread]] = {}


def dropped(state: PoolState, lifeline: shm.Lifeline, manager: threading.Thread | None) -> None:
    """A pool was collected without ``shutdown``: let what it was given finish.

    As with ``ProcessPoolExecutor``, a future that is running cannot be
    cancelled, nor are queued calls dropped: the pool closes to new calls, and
    its manager thread stops the workers once the last result is delivered
    (:func:`drained`). It takes no time here (a finalizer may run anywhere);
    at interpreter exit the exit hook stops whatever still runs.
    """
    if state.pid != _pid.pid:
        return  # a forked child's: the workers are the parent's
    if _exiting or manager is None or not manager.is_alive():
        # At exit (finalizers run then too) nothing is left to wait for the calls.
        shutdown(state, lifeline, manager, wait=False, cancel=True)
        return
    _draining[state] = (lifeline, manager)
    if state.begin_shutdown(cancel=False) and not manager.is_alive():
        drained(state)  # it ended meanwhile: nobody else will stop the workers


def drained(state: PoolState) -> None:
    """The manager of a collected pool delivered its last call (or failed): stop it."""
    entry = _draining.pop(state, None)
    if entry is None:
        return
    lifeline, manager = entry
    with state.stop_lock:
        if not state.stopped:
            stop(state, lifeline, manager, wait=True)


def stop(
    state: PoolState,
    lifeline: shm.Lifeline,
    manager: threading.Thread | None,
    wait: bool,
    overran: bool = False,
) -> None:
    """Close the rings, stop the workers and the manager, fail what is left, let go.

    ``overran``: shutdown's grace ran out; a worker still running a call
    would not see its closed ring until that call returns (perhaps never):
    it gets no timed join, only the escalation.
    """
    me = threading.current_thread()
    with state.lock:
        slots = list(state.slots)
        busy = {id(s) for s in slots if s.queue} if overran else set()
    for slot in slots:
        with contextlib.suppress(shm.SharedMemoryError, ValueError):
            slot.tasks.close_producer()
    live = [s for s in slots if s.process is not None and s.pid]
    stop_processes(
        [s.process for s in live if id(s) not in busy],
        wait,
        also=[s.process for s in live if id(s) in busy],
    )
    if manager is not None and manager is not me:
        state.poke()
        manager.join(_STOP_GRACE)
    error = PoolClosedError("the pool was shut down before this call finished")
    for task in state.mark_stopped():
        task.fail(state.broken or error)
    for slot in slots:
        shm.set_release_route(slot.arena_id, None)
        # A caller reading its done ring directly woke on its worker's exit.
        held = slot.reading.acquire(timeout=_STOP_GRACE)
        try:
            slot.close_rings()
        finally:
            if held:
                slot.reading.release()
        if slot.process is not None and slot.process.exitcode is not None:
            slot.process.close()
        if slot.arg_releases is not None:
            slot.arg_releases.close()
    state.release()
    lifeline.close()


def stop_processes(procs: list[Any], wait: bool, also: Sequence[Any] = ()) -> None:
    """Timed join (if ``wait``), then SIGTERM, then SIGKILL of each worker's tree.

    ``also``: workers to escalate against with no timed join (their grace is over).
    """
    deadline = time.monotonic() + (_STOP_GRACE if wait else 0.0)
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in [*procs, *also] if p.exitcode is None]
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
_exiting = False  # set by the exit hook: a pool collected now is stopped, not drained


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
    global _exiting
    _exiting = True
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.shutdown(wait=False, cancel_futures=True)
    for state, (lifeline, manager) in list(_draining.items()):
        with contextlib.suppress(Exception):
            shutdown(state, lifeline, manager, wait=False, cancel=True)
        _draining.pop(state, None)
