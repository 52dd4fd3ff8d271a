"""RayPool, the face: checks, the start of the agents, ``submit_call``, stats and shutdown.

Its manager thread (:mod:`._manager`) and node watcher (:mod:`._cluster`)
hold the pool's :class:`~._state.RayState`, not the pool; the pool's
finalizer stops the agents of a pool dropped without ``shutdown``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

import cloudpickle
import numpy as np
import ray

from .. import _codec
from .._calls import call_arguments
from .._errors import BrokenPoolError, SerializationError
from .._mapping import CallExecutor
from .._pool import PoolStatus
from . import _cluster
from ._cluster import STOP_GRACE, Launcher, NodeWatcher
from ._manager import RayManager
from ._sender import Call
from ._state import RayPoolStats, RayState

T = TypeVar("T")

_log = logging.getLogger("mpexec.ray")
_WATCH_INTERVAL = 5.0  # seconds between two looks at Ray's node list


class RayPool(CallExecutor):
    """Run functions on every node of a Ray cluster, with ``WorkerPool``'s semantics.

    One agent (a Ray actor) per node owns a local shared-memory
    :class:`~mpexec.WorkerPool` of ``workers_per_node`` workers (default: the
    node's CPUs as Ray counts them; nodes with none are skipped). Within a
    node arrays stay in shared memory; between nodes they travel through Ray's
    object store.

    ``address`` says which Ray, when this process has not called
    ``ray.init`` yet: ``"local"`` starts a Ray of the pool's own on this
    machine; ``"host:port"`` (or ``"ray://host:port"``) joins that cluster;
    ``None``, ``ray.init``'s default, joins whatever Ray is running (the
    ``RAY_ADDRESS`` environment variable, else the latest one started on this
    machine) and starts a local one only when there is none. Once connected,
    :meth:`shutdown` disconnects (stopping Ray only where it was the pool's
    own). When this process is already connected, the pool uses that
    connection, and an ``address`` other than it is an error. :attr:`address`
    says where the pool is.

    - Errors keep their type, with the worker's traceback as ``__cause__``.
    - An agent or node that dies: its calls run again on the others (calls
      are assumed deterministic, as a pipeline's are); the pool logs the loss
      and lists it in :attr:`lost_nodes`. With no agent left every call fails
      with :class:`~mpexec.NodeLostError`.
    - ``seed``, ``timeout``, ``worker_init``... (``pool_kwargs``) go to each
      node's ``WorkerPool``; a worker that dies is replaced there, and only
      the call it ran fails (:class:`~mpexec.WorkerCrashedError`).
    - ``ray_init``: more keyword arguments for ``ray.init`` when it is called.
    - Nodes that join the cluster later get an agent too, and nodes that
      leave count as lost, as the pool sees them in Ray's node list every
      ``watch_interval`` seconds (None: the nodes are those of the start).
      :attr:`num_workers`, :attr:`nodes` and :meth:`stats` follow.
    - ``results``: ``"copy"`` (default) hands result arrays back writable, the
      caller's own; ``"view"`` hands back Ray's read-only arrays, uncopied (as
      :meth:`submit_call` does with ``view=True``).

    Agents take no Ray CPUs (``num_cpus=0``): their workers are processes of
    their own, outside Ray's accounting.
    """

    def __init__(
        self,
        address: str | None = None,
        workers_per_node: int | None = None,
        *,
        ray_init: dict[str, Any] | None = None,
        start_timeout: float = 120.0,
        watch_interval: float | None = _WATCH_INTERVAL,
        results: Literal["copy", "view"] = "copy",
        **pool_kwargs: Any,
    ) -> None:
        if workers_per_node is not None and (
            type(workers_per_node) is not int or workers_per_node < 1
        ):
            raise ValueError(f"workers_per_node must be an int >= 1, not {workers_per_node!r}")
        for bad in ("num_workers", "restart"):
            if bad in pool_kwargs:
                raise TypeError(f"RayPool sets {bad} of each node's WorkerPool itself")
        if watch_interval is not None and not watch_interval > 0:
            raise ValueError(f"watch_interval must be > 0 seconds or None, not {watch_interval!r}")
        if results not in ("copy", "view"):
            raise ValueError(f"results must be 'copy' or 'view', not {results!r}")
        self._view = results == "view"
        #: Seconds one call may run on a node's worker (from ``pool_kwargs``), or None.
        self.timeout: float | None = pool_kwargs.get("timeout")
        self._pid = os.getpid()
        self._owns_ray = False
        if ray.is_initialized():
            _cluster.check_connected_to(address)
        else:
            ray.init(address=address, **(ray_init or {}))
            self._owns_ray = True
        #: The GCS address of the Ray cluster the pool runs on ("host:port").
        self.address: str | None = _cluster.gcs_address()
        self._state = RayState(_cluster.session())
        self._token = uuid.uuid4().hex[:12]
        self._launcher = Launcher(self._state, self._token, workers_per_node, pool_kwargs)
        try:
            self._start_agents(start_timeout)
        except BaseException:
            _cluster.kill_agents(self._state.agents, before_shutdown=self._owns_ray)
            if self._owns_ray:
                ray.shutdown()
            raise
        self._manager = RayManager(self._state, weakref.ref(self))
        self._manager.start()
        self._watcher: NodeWatcher | None = None
        if watch_interval is not None:
            self._watcher = NodeWatcher(self._state, self._launcher, watch_interval, start_timeout)
            self._watcher.start()
        # The agents' list itself: agents that the watcher starts later are killed too.
        self._finalizer = weakref.finalize(
            self, _cluster.stop, self._state, self._state.agents, self._owns_ray
        )
        _log.info(
            "mpexec RayPool: %d agents, %d workers, on the Ray at %s",
            len(self._state.agents),
            self.num_workers,
            self.address,
        )

    # ------------------------------------------------------------ agents
    def _start_agents(self, timeout: float) -> None:
        state = self._state
        for node in _cluster.alive_nodes():
            self._launcher.launch(node)
        if not state.agents:
            raise BrokenPoolError(
                "RayPool found no Ray node with a CPU to start an agent on; give "
                "workers_per_node, or add nodes with CPUs to the cluster"
            )
        try:
            hellos = ray.get([a.handle.hello.remote() for a in state.agents], timeout=timeout)
        except Exception as exc:
            raise BrokenPoolError(
                f"RayPool's agents did not start within {timeout} s: {type(exc).__name__}: "
                f"{exc}. Is every node able to import mpexec (and the functions' modules)?"
            ) from exc
        for agent, (pid, _, _) in zip(state.agents, hellos, strict=True):
            state.started(agent, pid)
        self._launcher.seen.update(a.node_id for a in state.agents)

    # Read-only here (CallExecutor declares a plain int, WorkerPool's): the count
    # follows the live agents as nodes join and leave.
    @property
    def num_workers(self) -> int:  # type: ignore[override]
        """The workers of every live agent together (it changes as nodes join and leave)."""
        with self._state.lock:
            return sum(a.workers for a in self._state.live())

    def stats(self) -> RayPoolStats:
        """Nodes, workers and calls now: a frozen snapshot."""
        return self._state.stats()

    @property
    def nodes(self) -> list[str]:
        """Ids of the nodes whose agents are alive."""
        with self._state.lock:
            return [a.node_id for a in self._state.live()]

    @property
    def lost_nodes(self) -> list[str]:
        """Ids of the nodes whose agents died while the pool ran (in order)."""
        with self._state.lock:
            return list(self._state.lost)

    def agent_names(self) -> list[str]:
        """The names (namespace ``"mpexec"``) of the live agents' Ray actors."""
        with self._state.lock:
            return [a.name for a in self._state.live()]

    def _agent_processes(self) -> list[tuple[int, list[int]]]:
        """(agent pid, its workers' pids) for each live agent (for tests and tools)."""
        agents = self._state.live()
        hellos = ray.get([a.handle.hello.remote() for a in agents], timeout=30)
        return [(pid, pids) for pid, pids, _ in hellos]

    # ------------------------------------------------------------ calls
    def submit_call(
        self,
        fn: Callable[..., T],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        worker: int | None = None,
        view: bool = False,
    ) -> Future[T]:
        """``submit``, for code built on the pool (:meth:`WorkerPool.submit_call`'s seam).

        ``worker`` pins the call (in order) to one agent and one worker there;
        ``view``: result arrays come back as Ray's read-only arrays, uncopied
        (what a pipeline takes), not as the caller's own.
        """
        kwargs = call_arguments(fn, kwargs)
        try:
            # Buffers are skipped: this checks picklability without copying arrays.
            cloudpickle.dumps((args, kwargs), protocol=5, buffer_callback=lambda _: False)
        except Exception as exc:
            raise SerializationError(
                _codec.describe_unpicklable((args, kwargs), "the arguments", exc)
            ) from exc
        state = self._state
        if _cluster.session() != state.session:
            state.ray_gone()
        call = Call(fn, args, kwargs, worker, own=not (view or self._view))
        state.add(call)
        state.flush()  # a call that could not be sent fails here, outside the lock
        return call.future

    def share(self, array: Any) -> Any:
        """A read-only copy of ``array`` (what a pipeline does with a source's data).

        It reaches each node through Ray's object store with the calls that take it.
        """
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        return copy

    @property
    def status(self) -> PoolStatus:
        """Whether it takes calls (running, broken, closed, forked) and its owner's pid."""
        state = self._state
        if self._pid != os.getpid():
            return PoolStatus("forked", self._pid)
        if state.broken is not None:
            return PoolStatus("broken", self._pid)
        return PoolStatus("closed" if state.closed else "running", self._pid)

    # ------------------------------------------------------------ closing
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop every agent this pool started, and Ray if it started it; idempotent.

        With ``wait``, queued calls finish first (unless ``cancel_futures``);
        without it they fail with :class:`PoolClosedError`. Then each agent
        stops its workers and is killed; no actor of the pool is left.
        """
        state = self._state
        first, outstanding = state.close(fail_pending=cancel_futures or not wait)
        state.flush()
        if not first:
            return
        if wait:
            for future in outstanding:
                with contextlib.suppress(BaseException):
                    future.exception()
        self._finalizer.detach()
        _cluster.stop(state, state.agents, self._owns_ray)
        self._manager.join(STOP_GRACE)
        if self._watcher is not None:
            self._watcher.join(STOP_GRACE)

    def __repr__(self) -> str:
        state = self._state
        status = "broken" if state.broken else "closed" if state.closed else "running"
        return (
            f"<RayPool {status} nodes={len(state.live())} workers={self.num_workers} "
            f"submitted={state.submitted} lost={len(state.lost)} address={self.address}>"
        )
