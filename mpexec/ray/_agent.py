"""The agent: the Ray actor that runs on one node, a local ``WorkerPool`` behind it.

This room runs in the agent's process (a Ray worker on its node), not in the
driver: it takes the driver's calls in the driver's order and answers each
with ``(True, result)`` or ``(False, pickled exception, traceback)``.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
import ray

from .._errors import RemoteTraceback, SerializationError
from .._pool import WorkerPool
from .._tracebacks import format_exception


class Agent:
    """A Ray actor on one node: a local shared-memory ``WorkerPool`` that runs calls."""

    def __init__(self, num_workers: int, pool_kwargs: dict[str, Any]) -> None:
        # Results go straight into Ray's object store: no copy of our own first.
        self._pool = WorkerPool(num_workers, restart=True, results="view", **pool_kwargs)
        self._fns: dict[int, Callable[..., Any]] = {}
        self._turn = 0  # the sequence number of the next call to start
        self._turns: asyncio.Condition | None = None

    def hello(self) -> tuple[int, list[int], str]:
        """This agent's pid, its workers' pids and its node id."""
        return os.getpid(), self._pool.pids, ray.get_runtime_context().get_node_id()

    async def run(
        self,
        call: tuple[int, int, bytes | None, tuple[int, ...], Any, Any, int | None],
    ) -> tuple[Any, ...]:
        """Call ``seq`` on the local pool: ``(True, result)`` or ``(False, exc, traceback)``.

        ``call`` is ``(seq, key, fn_data, forget, args, kwargs, worker)``, one
        argument (Ray serializes each argument on its own: one is cheapest).
        Calls start in the driver's order, ``seq`` by ``seq`` (Ray does not
        promise it for async actors): a function is sent with its first call
        only, and calls pinned to one worker must reach it in order.
        """
        seq, key, fn_data, forget, args, kwargs, worker = call
        if seq != self._turn:
            if self._turns is None:
                self._turns = asyncio.Condition()
            async with self._turns:
                await self._turns.wait_for(lambda: self._turn == seq)
        try:
            for old in forget:
                self._fns.pop(old, None)
            if fn_data is not None:
                self._fns[key] = pickle.loads(fn_data)
            future = self._pool.submit_call(self._fns[key], args, kwargs, worker=worker)
        except Exception as exc:
            return failure(exc)
        finally:
            self._turn += 1
            if self._turns is not None:
                async with self._turns:
                    self._turns.notify_all()
        try:
            return (True, await asyncio.wrap_future(future))
        except Exception as exc:
            return failure(exc)

    def close(self) -> None:
        """Stop the pool, then end this actor's process through its exit handlers.

        ``ray.kill`` ends a process at once, which leaves behind what exit
        handlers clean up: multiprocessing's temporary directory holding the
        fork server's socket (one ``/tmp/pymp-*`` per agent, each pool).
        """
        self._pool.shutdown(wait=False, cancel_futures=True)
        ray.actor.exit_actor()  # type: ignore[no-untyped-call, unused-ignore]


def failure(exc: BaseException) -> tuple[Any, ...]:
    """An exception as the driver can rebuild it: its own type, the worker's traceback."""
    cause = exc.__cause__
    tb = cause.tb if isinstance(cause, RemoteTraceback) else format_exception(exc)
    try:
        data = cloudpickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        data = pickle.dumps(
            SerializationError(
                f"a call raised {type(exc).__name__}: {exc}; the exception itself cannot "
                f"be pickled, so it comes back as this error (its traceback is the cause)"
            )
        )
    return (False, data, tb)
