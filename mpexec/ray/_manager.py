"""The manager thread: settles finished calls, sends more, and sends a lost agent's calls again.

Modelled on CPython's ``_ExecutorManagerThread``: :class:`RayManager` is
given the state it works with and the pool only as a weak reference, so that
a pool dropped without ``shutdown`` is collected (its finalizer then stops
everything, this thread included). Ray's completion callbacks only queue the
finished call (``state.done``); everything else happens here, never on a Ray
thread.
"""

from __future__ import annotations

import pickle
import queue
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np
import ray

from .._errors import BrokenPoolError, PoolClosedError, RemoteTraceback
from . import _cluster
from ._sender import Call
from ._state import RayState

# While calls are out, the manager looks this often whether Ray is still this
# process's (ray.shutdown() leaves Ray's futures pending forever).
_RAY_CHECK = 0.5
# What a lost agent or node does to a call in flight: the call runs again elsewhere.
_LOST = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.ObjectLostError,  # the result's node (object store) went
    ray.exceptions.NodeDiedError,
)


class RayManager(threading.Thread):
    """Runs until the pool stops: one wait on the finished calls, then what came."""

    def __init__(self, state: RayState, pool_ref: weakref.ref[Any]) -> None:
        super().__init__(name="mpexec-raypool-manager", daemon=True)
        self.state = state  # the agents, calls and flags it shares with the pool
        # The pool, weakly: only to learn, while idle, that it was collected.
        self.pool_ref = pool_ref

    def run(self) -> None:
        while self.manage_once():
            pass

    def manage_once(self) -> bool:
        """Wait (bounded) for a finished call and settle it; False once the pool stopped."""
        state = self.state
        try:
            item = state.done.get(timeout=_RAY_CHECK)
        except queue.Empty:
            if state.outstanding and _cluster.session() != state.session:
                state.ray_gone()
            # A collected pool's finalizer stops this thread; this is the belt to it.
            return not (state.closed and self.pool_ref() is None and not state.outstanding)
        if item is None:
            return False
        call, ray_future = item
        try:
            self.finished(call, ray_future)
        except Exception as exc:  # a bug here must not leave a caller waiting forever
            state.settle(call, exc=exc)
        state.flush()
        return True

    def finished(self, call: Call, ray_future: Future[Any]) -> None:
        """``call`` came back from its agent: its outcome, or a rerun; then send more."""
        state = self.state
        agent = call.agent
        assert agent is not None
        exc = ray_future.exception()
        if state.returned(agent) and exc is not None:
            state.settle(
                call, exc=PoolClosedError("the pool was shut down before this call finished")
            )
            return
        if exc is None:
            out = ray_future.result()
            if out[0]:
                state.settle(call, result=owned(out[1]) if call.own else out[1])
            else:
                error = pickle.loads(out[1])
                error.__cause__ = RemoteTraceback(out[2])
                state.settle(call, exc=error)
        elif isinstance(exc, _LOST):
            # A lost result (its node's object store went) leaves the agent be:
            # if its node went too, its own calls say so.
            died = isinstance(exc, ray.exceptions.RayActorError)
            why = f"it died: {type(exc).__name__}" if died else None
            if not state.rerun(call, agent, why, exc):
                return
        else:
            err = BrokenPoolError(f"Ray failed a call: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            state.settle(call, exc=err)
        state.dispatch_unless_closed()


def owned(value: Any) -> Any:
    """Arrays from Ray's object store (read-only) as writable arrays of the caller's own."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else np.array(value, copy=True)
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(owned(v) for v in value)
    if isinstance(value, list):
        return [owned(v) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: owned(v) for k, v in value.items()}
    return value
