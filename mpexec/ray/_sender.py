"""Sending a call to an agent: the driver's records of agents and calls, the function cache.

A function is pickled once (:meth:`CallSender.fn_entry`); each agent gets
the bytes with its first call of it, and is told to drop them when the
function leaves the cache. Everything here runs under the state's lock.
"""

from __future__ import annotations

import collections
import functools
import itertools
import queue
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray

from .. import _codec
from .._errors import SerializationError

_FN_CACHE = 1024  # functions kept with their object-store refs; older ones are forgotten


class AgentInfo:
    """The driver's record of one agent (its Ray handle, node, load and functions)."""

    __slots__ = (
        "alive",
        "forget",
        "handle",
        "in_flight",
        "index",
        "known",
        "name",
        "node_id",
        "pid",
        "seq",
        "workers",
    )

    def __init__(self, index: int, name: str, handle: Any, node_id: str, workers: int) -> None:
        self.index = index
        self.name = name
        self.handle = handle
        self.node_id = node_id
        self.workers = workers
        self.pid = 0
        self.in_flight = 0
        self.alive = False  # until it has answered
        self.seq = 0  # of the next call sent to it
        self.known: set[int] = set()  # keys of the functions it holds
        self.forget: list[int] = []  # keys it is to drop with its next call


class Call:
    """A submitted call: what runs, its caller's future, and the agent it was sent to."""

    __slots__ = ("agent", "args", "fn", "future", "kwargs", "own", "worker")

    def __init__(
        self, fn: Callable[..., Any], args: Any, kwargs: Any, worker: int | None, own: bool
    ) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.worker = worker
        self.own = own  # hand results back writable, the caller's own (as WorkerPool does)
        self.future: Future[Any] = Future()
        self.agent: AgentInfo | None = None


class CallSender:
    """Hands calls to agents' ``run`` (Ray's remote call); holds the function cache."""

    def __init__(self, done: queue.SimpleQueue[Any]) -> None:
        self.done = done  # the manager's inbox, where Ray's callbacks put finished calls
        self.fns: collections.OrderedDict[Any, tuple[int, bytes, Any]] = collections.OrderedDict()
        self.keys = itertools.count()

    @staticmethod
    def connected() -> bool:
        """Whether Ray is still this process's, to call into now.

        ``ray.shutdown()`` (another library's ``atexit`` can call it) marks the
        process disconnected, then shuts its core worker down; a call into Ray
        from another thread after that ends the whole process (Ray's own exit:
        "The core worker has already been shutdown"). Asked right before each
        send: the race is then that of this look and the call.
        """
        return bool(ray.is_initialized())

    def send(self, call: Call, agent: AgentInfo, agents: list[AgentInfo]) -> BaseException | None:
        """``call`` to ``agent``; the error if Ray cannot take it (the call fails alone)."""
        key, data, _ = self.fn_entry(call.fn, agents)
        known = key in agent.known
        try:
            out = agent.handle.run.remote(
                (
                    agent.seq,
                    key,
                    None if known else data,
                    tuple(agent.forget),
                    call.args,
                    call.kwargs,
                    call.worker,
                )
            )
        except Exception as exc:
            err = SerializationError(
                f"a call could not be sent to Ray: {type(exc).__name__}: {exc}"
            )
            err.__cause__ = exc
            return err
        call.agent = agent
        agent.seq += 1
        agent.known.add(key)
        agent.forget.clear()
        agent.in_flight += 1
        out.future().add_done_callback(functools.partial(_queue_done, self.done, call))
        return None

    def fn_entry(self, fn: Callable[..., Any], agents: list[AgentInfo]) -> tuple[int, bytes, Any]:
        """``(key, pickled fn, fn)``: the function pickled once.

        Each agent gets the bytes with its first call of the function, and drops
        them when the function leaves this cache.
        """
        try:
            hash(fn)
            cache_key: Any = fn
        except TypeError:
            cache_key = ("id", id(fn))
        entry = self.fns.get(cache_key)
        if entry is not None and entry[2] is fn:
            self.fns.move_to_end(cache_key)
            return entry
        entry = (next(self.keys), _codec.dump_value(fn), fn)
        self.fns[cache_key] = entry
        if len(self.fns) > _FN_CACHE:
            _, (old, _, _) = self.fns.popitem(last=False)
            for agent in agents:
                if old in agent.known:
                    agent.known.discard(old)
                    agent.forget.append(old)
        return entry


def _queue_done(done: queue.SimpleQueue[Any], call: Call, ray_future: Future[Any]) -> None:
    done.put((call, ray_future))  # on a Ray thread: nothing more
