"""RayPool: ``WorkerPool``'s semantics over a Ray cluster, one agent per node.

::

    caller threads (driver)            Ray                            node k: agent actor
    -----------------------            ---                            -------------------
    submit(fn, *args)
      fn pickled once: sent to   ---> with the agent's first   ---> fn cache (by key)
        each agent once                  call of it
      call -> pending deque
      dispatch: least-loaded live agent,
        at most 2 x its workers in flight
      agent.run.remote(args) --------> args: object store -------->  local WorkerPool.submit_call
                                         (arrays out of band;          shared-memory rings:
                                          zero-copy on the node)       zero-copy in the node
    manager thread  <---------------- (True, result) or  <---------- await the local future
      settle the caller's Future         (False, exc, traceback)
      agent died: its calls go back to the head of pending and run on the others
      no agent left: NodeLostError to every call
    node watcher thread (every watch_interval s): ray.nodes()
      a node that joined: start an agent there; once it answers, calls go to it too
      a node that left: its agent counts as lost (nodes, num_workers, stats() say so)

The driver owns the agents it started (named actors, killed by ``shutdown``
and by a finalizer, also those the watcher started); each agent owns its
node's ``WorkerPool`` (workers, arena, rings), whose workers exit with it.
Ray's own completion callbacks only queue the finished call: results are
settled, and more calls dispatched, on the pool's manager thread, never on a
Ray thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import pickle
import queue
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import cloudpickle
import numpy as np
import psutil

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    from ._extras import missing_message

    raise ImportError(missing_message("ray", _exc)) from _exc

from . import _codec
from ._errors import (
    BrokenPoolError,
    NodeLostError,
    PoolClosedError,
    RemoteTraceback,
    SerializationError,
    raised_again,
)
from ._mapping import CallExecutor, settle
from ._pool import PoolStatus, WorkerPool
from ._tracebacks import format_exception

__all__ = ["RayPool", "RayPoolStats"]

T = TypeVar("T")

_log = logging.getLogger("mpexec.ray")
_NAMESPACE = "mpexec"
_FN_CACHE = 1024  # functions kept with their object-store refs; older ones are forgotten
_STOP_GRACE = 10.0  # seconds an agent gets to stop its pool before it is killed
_WATCH_INTERVAL = 5.0  # seconds between two looks at Ray's node list
# While calls are out, the manager looks this often whether Ray is still this
# process's (ray.shutdown() leaves Ray's futures pending forever).
_RAY_CHECK = 0.5
# What a lost agent or node does to a call in flight: the call runs again elsewhere.
_LOST = (
    ray.exceptions.RayActorError,  # ActorDiedError, ActorUnavailableError
    ray.exceptions.ObjectLostError,  # the result's node (object store) went
    ray.exceptions.NodeDiedError,
)


class _Agent:
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
            return _failure(exc)
        finally:
            self._turn += 1
            if self._turns is not None:
                async with self._turns:
                    self._turns.notify_all()
        try:
            return (True, await asyncio.wrap_future(future))
        except Exception as exc:
            return _failure(exc)

    def close(self) -> None:
        """Stop the pool, then end this actor's process through its exit handlers.

        ``ray.kill`` ends a process at once, which leaves behind what exit
        handlers clean up: multiprocessing's temporary directory holding the
        fork server's socket (one ``/tmp/pymp-*`` per agent, each pool).
        """
        self._pool.shutdown(wait=False, cancel_futures=True)
        ray.actor.exit_actor()  # type: ignore[no-untyped-call, unused-ignore]


def _failure(exc: BaseException) -> tuple[Any, ...]:
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


class _AgentInfo:
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


class _Call:
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
        self.agent: _AgentInfo | None = None


class _State:
    """What the pool and its manager thread share (the manager holds only this)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.agents: list[_AgentInfo] = []
        self.pending: collections.deque[_Call] = collections.deque()
        self.outstanding: set[Future[Any]] = set()
        self.done: queue.SimpleQueue[tuple[_Call, Future[Any]] | None] = queue.SimpleQueue()
        self.fns: collections.OrderedDict[Any, tuple[int, bytes, Any]] = collections.OrderedDict()
        self.fn_keys = itertools.count()
        self.broken: BrokenPoolError | None = None
        self.closed = False
        self.lost: list[str] = []
        self.submitted = self.completed = self.failed = 0
        self.reruns = 0
        self.joined = 0  # agents started on nodes that joined after the pool started
        self.pins: dict[int, _AgentInfo] = {}  # a pinned call's worker -> its agent
        self.stop_watching = threading.Event()
        self.session: str | None = None  # the Ray connection the agents belong to
        # Outcomes to give to callers' futures once the lock is released (_flush).
        self.to_settle: list[tuple[_Call, Any, BaseException | None]] = []

    def live(self) -> list[_AgentInfo]:
        return [a for a in self.agents if a.alive]


@dataclass(frozen=True)
class RayPoolStats:
    """A snapshot of a :class:`RayPool` (``pool.stats()``)."""

    #: Nodes with a live agent, and those agents' workers together.
    nodes: int
    workers: int
    #: Ids of the nodes whose agents were lost, in order.
    lost_nodes: tuple[str, ...]
    #: Agents started on nodes that joined the cluster after the pool started.
    joined_nodes: int
    submitted: int
    completed: int
    #: Calls that ended in an exception (the function's, or the pool's).
    failed: int
    #: Calls sent again because the agent or node they were on was lost.
    reruns: int
    #: Calls sent to agents and not yet back; calls waiting to be sent.
    in_flight: int
    pending: int


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
        self._state = _State()
        self._owns_ray = False
        if ray.is_initialized():
            _check_connected_to(address)
        else:
            ray.init(address=address, **(ray_init or {}))
            self._owns_ray = True
        #: The GCS address of the Ray cluster the pool runs on ("host:port").
        self.address: str | None = _gcs_address()
        self._state.session = _session()
        self._token = uuid.uuid4().hex[:12]
        self._launcher = _Launcher(self._state, self._token, workers_per_node, pool_kwargs)
        try:
            self._start_agents(start_timeout)
        except BaseException:
            _kill_agents(self._state.agents, before_shutdown=self._owns_ray)
            if self._owns_ray:
                ray.shutdown()
            raise
        self._manager = threading.Thread(
            target=_manage, args=(self._state,), name="mpexec-raypool-manager", daemon=True
        )
        self._manager.start()
        self._watcher: threading.Thread | None = None
        if watch_interval is not None:
            self._watcher = threading.Thread(
                target=_watch,
                args=(self._state, self._launcher, watch_interval, start_timeout),
                name="mpexec-raypool-nodes",
                daemon=True,
            )
            self._watcher.start()
        # The agents' list itself: agents that the watcher starts later are killed too.
        self._finalizer = weakref.finalize(
            self, _abandon, self._state, self._state.agents, self._owns_ray
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
        for node in _alive_nodes():
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
            agent.pid = pid
            agent.alive = True
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
        state = self._state
        with state.lock:
            live = state.live()
            return RayPoolStats(
                nodes=len(live),
                workers=sum(a.workers for a in live),
                lost_nodes=tuple(state.lost),
                joined_nodes=state.joined,
                submitted=state.submitted,
                completed=state.completed,
                failed=state.failed,
                reruns=state.reruns,
                in_flight=sum(a.in_flight for a in state.agents),
                pending=len(state.pending),
            )

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
        if kwargs is None:
            kwargs = {}
        if not callable(fn):
            raise TypeError(f"submit() needs a callable, not {type(fn).__name__}")
        try:
            # Buffers are skipped: this checks picklability without copying arrays.
            cloudpickle.dumps((args, kwargs), protocol=5, buffer_callback=lambda _: False)
        except Exception as exc:
            raise SerializationError(
                _codec.describe_unpicklable((args, kwargs), "the arguments", exc)
            ) from exc
        state = self._state
        if _session() != state.session:
            _ray_gone(state)
        with state.lock:
            self._check_usable()
            _fn_entry(state, fn)
            call = _Call(fn, args, kwargs, worker, own=not (view or self._view))
            state.pending.append(call)
            state.outstanding.add(call.future)
            state.submitted += 1
            _dispatch(state)
        _flush(state)  # a call that could not be sent fails here, outside the lock
        return call.future

    def _check_usable(self) -> None:
        state = self._state
        if state.broken is not None:
            raise raised_again(state.broken)  # never the stored object: see raised_again
        if state.closed:
            raise PoolClosedError("cannot submit to a RayPool after shutdown()")

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
        with state.lock:
            first = not state.closed
            state.closed = True
            if cancel_futures or not wait:
                _fail_pending(state, PoolClosedError("the pool was shut down before this call ran"))
            outstanding = list(state.outstanding)
        _flush(state)
        if not first:
            return
        if wait:
            for future in outstanding:
                with contextlib.suppress(BaseException):
                    future.exception()
        self._finalizer.detach()
        _abandon(state, state.agents, self._owns_ray)
        self._manager.join(_STOP_GRACE)
        if self._watcher is not None:
            self._watcher.join(_STOP_GRACE)

    def __repr__(self) -> str:
        state = self._state
        status = "broken" if state.broken else "closed" if state.closed else "running"
        return (
            f"<RayPool {status} nodes={len(state.live())} workers={self.num_workers} "
            f"submitted={state.submitted} lost={len(state.lost)} address={self.address}>"
        )


# ---------------------------------------------------------------- agents and nodes


def _alive_nodes() -> list[dict[str, Any]]:
    # Untyped in Ray (a lint environment without Ray sees Any: hence unused-ignore).
    return [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call,unused-ignore]


def _session() -> str | None:
    """This process's Ray connection (its job id), or None when it has none.

    ``ray.shutdown()`` (another library's ``atexit`` can call it) ends it, and
    a later ``ray.init()`` makes a new one: the agents and the calls out to
    them belong to the old one, whose futures Ray never completes.
    """
    if not ray.is_initialized():
        return None
    try:
        return str(ray.get_runtime_context().get_job_id())
    except Exception:  # disconnecting meanwhile
        return None


def _ray_gone(state: _State) -> None:
    """Ray was shut down under the pool: it is broken, every call waiting fails now."""
    with state.lock:
        if state.broken is None:
            nodes = [a.node_id for a in state.agents if a.alive]
            state.broken = NodeLostError(
                "Ray was shut down in this process (ray.shutdown(), perhaps from another "
                "library's atexit) while the RayPool ran: its agents and their calls are "
                "gone. Create a new pool once Ray is running again.",
                nodes=nodes,
            )
            for agent in state.agents:
                agent.alive = False
        error = state.broken
        _fail_pending(state, error)
        futures = list(state.outstanding)
        state.outstanding.clear()
        state.failed += sum(not f.done() for f in futures)
    _flush(state)
    for future in futures:  # in flight: Ray's callbacks for them never come
        settle(future, exc=error)


def _gcs_address() -> str | None:
    """The address of the cluster this process is connected to (None if Ray cannot say)."""
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection, or an older Ray
        return None


def _check_connected_to(address: str | None) -> None:
    """This process is connected to Ray already: ``address``, if given, must be that Ray."""
    if address is None or address == "auto":
        return
    current = _gcs_address()
    if address != current:
        raise ValueError(
            f"this process is already connected to the Ray at {current}, so RayPool cannot "
            f"use address={address!r}: leave address out to use that Ray, or call "
            "ray.shutdown() first"
        )


class _Launcher:
    """Starts one agent on a node: what the pool's start and the node watcher share."""

    def __init__(
        self,
        state: _State,
        token: str,
        workers_per_node: int | None,
        pool_kwargs: dict[str, Any],
    ) -> None:
        self.state = state
        self.token = token
        self.workers_per_node = workers_per_node
        self.pool_kwargs = pool_kwargs
        self.agent_cls = ray.remote(_Agent)
        self.seen: set[str] = set()  # nodes that got an agent, or need none

    def launch(self, node: dict[str, Any]) -> _AgentInfo | None:
        """An agent on ``node``, created and listed (not yet alive); None for a CPU-less node."""
        self.seen.add(node["NodeID"])
        cpus = int(node.get("Resources", {}).get("CPU", 0))
        workers = self.workers_per_node or cpus
        if workers < 1:
            return None
        state = self.state
        with state.lock:
            if state.closed:  # the pool stopped meanwhile: no agent it would not kill
                return None
            index = len(state.agents)
            name = f"mpexec-agent-{self.token}-{index}"
            handle = self.agent_cls.options(
                name=name,
                namespace=_NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(workers, self.pool_kwargs)
            agent = _AgentInfo(index, name, handle, node["NodeID"], workers)
            state.agents.append(agent)  # listed at once: shutdown kills it, started or not
        return agent


def _watch(state: _State, launcher: _Launcher, interval: float, timeout: float) -> None:
    """Every ``interval`` s until the pool stops: agents for new nodes, losses for gone ones.

    Ray offers no event for a node joining, so the node list is read again;
    the wait is on the pool's stop event, so shutdown never waits for a turn.
    """
    while not state.stop_watching.wait(interval):
        if state.broken is not None:
            return
        try:
            alive = {n["NodeID"]: n for n in _alive_nodes()}
        except Exception as exc:  # the GCS briefly away: look again next time
            _log.debug("mpexec RayPool: reading Ray's node list failed: %s", exc)
            continue
        with state.lock:
            if state.closed or state.broken is not None:
                return
            for agent in state.live():
                if agent.node_id not in alive:
                    _lose(state, agent, "its node left the cluster")
            broken = not state.live()
            if broken:
                _no_agent_left(state, None)
        _flush(state)
        if broken:
            return
        for node_id, node in alive.items():
            if node_id not in launcher.seen and not state.stop_watching.is_set():
                _join(state, launcher, node, timeout)


def _join(state: _State, launcher: _Launcher, node: dict[str, Any], timeout: float) -> None:
    """Start an agent on a node that joined; it takes calls once it has answered."""
    agent = launcher.launch(node)
    if agent is None:
        return
    try:
        pid = ray.get(agent.handle.hello.remote(), timeout=timeout)[0]
    except Exception as exc:
        _log.warning(
            "mpexec RayPool: no agent could start on node %s, which joined the cluster "
            "(%s: %s); the pool goes on without it",
            agent.node_id,
            type(exc).__name__,
            exc,
        )
        with contextlib.suppress(Exception):
            ray.kill(agent.handle, no_restart=True)
        return
    with state.lock:
        if state.closed or state.broken is not None:
            return  # shutdown kills it: it is in state.agents
        agent.pid, agent.alive = pid, True
        state.joined += 1
        _log.info(
            "mpexec RayPool: node %s joined the cluster; its agent (pid %d) runs %d workers",
            agent.node_id,
            pid,
            agent.workers,
        )
        _dispatch(state)
    _flush(state)


def _lose(state: _State, agent: _AgentInfo, why: str) -> None:
    """Count ``agent`` as lost (the lock is held); its calls in flight come back as lost."""
    if not agent.alive:
        return
    agent.alive = False
    state.lost.append(agent.node_id)
    for worker in [w for w, a in state.pins.items() if a is agent]:
        del state.pins[worker]
    _log.warning(
        "mpexec RayPool: the agent on node %s (pid %d) is lost (%s); its calls run again "
        "on the %d other agent(s)",
        agent.node_id,
        agent.pid,
        why,
        len(state.live()),
    )


def _no_agent_left(state: _State, cause: BaseException | None) -> None:
    """Every agent is lost: the pool is broken, every waiting call fails (the lock is held)."""
    error = NodeLostError(
        f"every agent of the RayPool is gone (nodes lost: {', '.join(state.lost)}); "
        "no node is left to run calls on. Check the Ray cluster (`ray status`) "
        "and create a new pool.",
        nodes=list(state.lost),
    )
    error.__cause__ = cause
    if state.broken is None:
        state.broken = error
    _fail_pending(state, error)


# ---------------------------------------------------------------- dispatching


def _pick(state: _State, call: _Call) -> _AgentInfo | None:
    live = state.live()
    if not live:
        return None
    if call.worker is not None:
        # Pinned: the same agent every time while it lives (agents that join later
        # change nothing), so the calls keep their order and their worker's state.
        agent = state.pins.get(call.worker)
        if agent is None or not agent.alive:
            agent = state.pins[call.worker] = live[call.worker % len(live)]
        return agent
    best = min(live, key=lambda a: a.in_flight / a.workers)
    return best if best.in_flight < 2 * best.workers else None


def _dispatch(state: _State) -> None:
    """Send pending calls, in order, while agents have room (the lock is held)."""
    while state.pending:
        call = state.pending[0]
        if call.future.cancelled():
            state.pending.popleft()
            state.outstanding.discard(call.future)
            continue
        agent = _pick(state, call)
        if agent is None:
            return
        state.pending.popleft()
        if not call.future.running() and not call.future.set_running_or_notify_cancel():
            state.outstanding.discard(call.future)
            continue  # cancelled while it waited
        key, data, _ = _fn_entry(state, call.fn)
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
            _settle(state, call, exc=err)
            continue
        call.agent = agent
        agent.seq += 1
        agent.known.add(key)
        agent.forget.clear()
        agent.in_flight += 1
        out.future().add_done_callback(functools.partial(_queue_done, state.done, call))


def _fn_entry(state: _State, fn: Callable[..., Any]) -> tuple[int, bytes, Any]:
    """``(key, pickled fn, fn)``: the function pickled once (the lock is held).

    Each agent gets the bytes with its first call of the function, and drops
    them when the function leaves this cache.
    """
    try:
        hash(fn)
        cache_key: Any = fn
    except TypeError:
        cache_key = ("id", id(fn))
    entry = state.fns.get(cache_key)
    if entry is not None and entry[2] is fn:
        state.fns.move_to_end(cache_key)
        return entry
    entry = (next(state.fn_keys), _codec.dump_value(fn), fn)
    state.fns[cache_key] = entry
    if len(state.fns) > _FN_CACHE:
        _, (old, _, _) = state.fns.popitem(last=False)
        for agent in state.agents:
            if old in agent.known:
                agent.known.discard(old)
                agent.forget.append(old)
    return entry


def _queue_done(done: queue.SimpleQueue[Any], call: _Call, ray_future: Future[Any]) -> None:
    done.put((call, ray_future))  # on a Ray thread: nothing more


def _manage(state: _State) -> None:
    """Settle finished calls; requeue a lost agent's calls; runs until the pool stops."""
    while True:
        try:
            item = state.done.get(timeout=_RAY_CHECK)
        except queue.Empty:
            if state.outstanding and _session() != state.session:
                _ray_gone(state)
            continue
        if item is None:
            return
        call, ray_future = item
        try:
            _finished(state, call, ray_future)
        except Exception as exc:  # a bug here must not leave a caller waiting forever
            _settle(state, call, exc=exc)
        _flush(state)


def _finished(state: _State, call: _Call, ray_future: Future[Any]) -> None:
    agent = call.agent
    assert agent is not None
    exc = ray_future.exception()
    with state.lock:
        agent.in_flight -= 1
        if state.closed and exc is not None:
            _settle(
                state, call, exc=PoolClosedError("the pool was shut down before this call finished")
            )
            return
    if exc is None:
        out = ray_future.result()
        if out[0]:
            _settle(state, call, result=_owned(out[1]) if call.own else out[1])
        else:
            error = pickle.loads(out[1])
            error.__cause__ = RemoteTraceback(out[2])
            _settle(state, call, exc=error)
    elif isinstance(exc, _LOST):
        with state.lock:
            # A lost result (its node's object store went) leaves the agent be:
            # if its node went too, its own calls say so.
            if isinstance(exc, ray.exceptions.RayActorError):
                _lose(state, agent, f"it died: {type(exc).__name__}")
            state.reruns += 1
            state.pending.appendleft(call)
            if not state.live():
                _no_agent_left(state, exc)
                return
    else:
        err = BrokenPoolError(f"Ray failed a call: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        _settle(state, call, exc=err)
    with state.lock:
        if not state.closed or state.pending:
            _dispatch(state)


def _owned(value: Any) -> Any:
    """Arrays from Ray's object store (read-only) as writable arrays of the caller's own."""
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else np.array(value, copy=True)
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_owned(v) for v in value)
    if isinstance(value, list):
        return [_owned(v) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: _owned(v) for k, v in value.items()}
    return value


def _settle(
    state: _State, call: _Call, result: Any = None, exc: BaseException | None = None
) -> None:
    """Give ``call`` its outcome at the next :func:`_flush`, outside the pool's lock."""
    with state.lock:
        state.outstanding.discard(call.future)
        state.to_settle.append((call, result, exc))


def _flush(state: _State) -> None:
    """Settle the outcomes :func:`_settle` queued; never with the pool's lock held.

    A future's callbacks run here, and may take locks of their own (a
    pipeline's scheduler does, and submits more calls under it): settling
    under our lock would order the two locks both ways.
    """
    while True:
        with state.lock:
            items, state.to_settle = state.to_settle, []
            if not items:
                return
            for call, _, exc in items:
                if not call.future.done():
                    if exc is not None:
                        state.failed += 1
                    else:
                        state.completed += 1
        for call, result, exc in items:
            call.fn = call.args = call.kwargs = None  # type: ignore[assignment]
            if call.future.done():
                continue
            settle(call.future, result, exc)


def _fail_pending(state: _State, error: BaseException) -> None:
    """Fail every call not yet sent (the lock is held; :func:`_flush` settles them)."""
    calls = list(state.pending)
    state.pending.clear()
    for call in calls:
        _settle(state, call, exc=error)


def _kill_agents(agents: list[_AgentInfo], *, before_shutdown: bool = False) -> None:
    """Ask each agent to stop its pool and exit (bounded), then kill its actor.

    ``before_shutdown``: ``ray.shutdown()`` comes next, which would cut short the
    exit of the agents on this node; wait (bounded) for their processes to end.
    """
    live = [a for a in agents if a.alive]
    closing = []
    for a in live:
        with contextlib.suppress(Exception):
            closing.append(a.handle.close.remote())
    with contextlib.suppress(Exception):
        ray.wait(closing, num_returns=len(closing), timeout=_STOP_GRACE)
    for a in agents:
        a.alive = False
        with contextlib.suppress(Exception):
            ray.kill(a.handle, no_restart=True)
    if before_shutdown:
        with contextlib.suppress(Exception):
            here = ray.get_runtime_context().get_node_id()
            procs = []
            for a in live:
                if a.node_id == here and a.pid is not None:
                    with contextlib.suppress(psutil.Error):
                        procs.append(psutil.Process(a.pid))
            psutil.wait_procs(procs, timeout=_STOP_GRACE)


def _abandon(state: _State, agents: list[_AgentInfo], owns_ray: bool) -> None:
    """Stop the agents, fail what is left, stop the manager (also the finalizer)."""
    with state.lock:
        state.closed = True
    state.stop_watching.set()
    if _session() == state.session:  # else Ray went, and the agents with it
        _kill_agents(agents, before_shutdown=owns_ray)
    error = PoolClosedError("the pool was shut down before this call finished")
    with state.lock:
        _fail_pending(state, error)
    _flush(state)
    with state.lock:
        left = list(state.outstanding)
    for future in left:
        if not future.done():
            with contextlib.suppress(Exception):
                future.set_exception(error)
    state.done.put(None)
    if owns_ray and _session() == state.session:  # not a Ray someone started since
        ray.shutdown()
