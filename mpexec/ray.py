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

The driver owns the agents it started (named actors, killed by ``shutdown``
and by a finalizer); each agent owns its node's ``WorkerPool`` (workers,
arena, rings), whose workers exit with it. Ray's own completion callbacks only
queue the finished call: results are settled, and more calls dispatched, on
the pool's manager thread, never on a Ray thread.
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
import traceback
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

import cloudpickle
import numpy as np

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "mpexec.ray needs Ray: install the extra with `pip install mpexec[ray]` "
        f"(or `pip install ray`); importing it failed: {_exc}"
    ) from _exc

from . import _codec
from ._errors import (
    BrokenPoolError,
    NodeLostError,
    PoolClosedError,
    RemoteTraceback,
    SerializationError,
)
from ._mapping import CallExecutor, settle
from ._pool import PoolStatus, WorkerPool

__all__ = ["RayPool"]

T = TypeVar("T")

_log = logging.getLogger("mpexec.ray")
_NAMESPACE = "mpexec"
_FN_CACHE = 1024  # functions kept with their object-store refs; older ones are forgotten
_STOP_GRACE = 10.0  # seconds an agent gets to stop its pool before it is killed
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
        self._pool.shutdown(wait=False, cancel_futures=True)


def _failure(exc: BaseException) -> tuple[Any, ...]:
    """An exception as the driver can rebuild it: its own type, the worker's traceback."""
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        tb = cause.tb
    else:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
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
        self.alive = True
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
        self.submitted = 0
        self.reruns = 0

    def live(self) -> list[_AgentInfo]:
        return [a for a in self.agents if a.alive]


class RayPool(CallExecutor):
    """Run functions on every node of a Ray cluster, with ``WorkerPool``'s semantics.

    One agent (a Ray actor) per node owns a local shared-memory
    :class:`~mpexec.WorkerPool` of ``workers_per_node`` workers (default: the
    node's CPUs as Ray counts them; nodes with none are skipped). Within a
    node arrays stay in shared memory; between nodes they travel through Ray's
    object store. ``address`` is ``ray.init``'s: ``None`` joins the running
    Ray instance, or starts a local one (then :meth:`shutdown` stops it).

    - Errors keep their type, with the worker's traceback as ``__cause__``.
    - An agent or node that dies: its calls run again on the others (calls
      are assumed deterministic, as a pipeline's are); the pool logs the loss
      and lists it in :attr:`lost_nodes`. With no agent left every call fails
      with :class:`~mpexec.NodeLostError`.
    - ``seed``, ``timeout``, ``worker_init``... (``pool_kwargs``) go to each
      node's ``WorkerPool``; a worker that dies is replaced there, and only
      the call it ran fails (:class:`~mpexec.WorkerCrashedError`).
    - ``ray_init``: more keyword arguments for ``ray.init`` when it is called.
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
        if results not in ("copy", "view"):
            raise ValueError(f"results must be 'copy' or 'view', not {results!r}")
        self._view = results == "view"
        self._pid = os.getpid()
        self._state = _State()
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=address, **(ray_init or {}))
            self._owns_ray = True
        self._token = uuid.uuid4().hex[:12]
        try:
            self._start_agents(workers_per_node, pool_kwargs, start_timeout)
        except BaseException:
            _kill_agents(self._state.agents)
            if self._owns_ray:
                ray.shutdown()
            raise
        self.num_workers = sum(a.workers for a in self._state.agents)
        self._manager = threading.Thread(
            target=_manage, args=(self._state,), name="mpexec-raypool-manager", daemon=True
        )
        self._manager.start()
        self._finalizer = weakref.finalize(
            self, _abandon, self._state, list(self._state.agents), self._owns_ray
        )

    # ------------------------------------------------------------ agents
    def _start_agents(
        self, workers_per_node: int | None, pool_kwargs: dict[str, Any], timeout: float
    ) -> None:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        agent_cls = ray.remote(_Agent)
        state = self._state
        for node in nodes:
            cpus = int(node.get("Resources", {}).get("CPU", 0))
            workers = workers_per_node or cpus
            if workers < 1:
                continue
            index = len(state.agents)
            name = f"mpexec-agent-{self._token}-{index}"
            handle = agent_cls.options(
                name=name,
                namespace=_NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(workers, pool_kwargs)
            state.agents.append(_AgentInfo(index, name, handle, node["NodeID"], workers))
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
        with state.lock:
            self._check_usable()
            _fn_entry(state, fn)
            call = _Call(fn, args, kwargs, worker, own=not (view or self._view))
            state.pending.append(call)
            state.outstanding.add(call.future)
            state.submitted += 1
            _dispatch(state)
        return call.future

    def _check_usable(self) -> None:
        state = self._state
        if state.broken is not None:
            raise state.broken
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
        if not first:
            return
        if wait:
            for future in outstanding:
                with contextlib.suppress(BaseException):
                    future.exception()
        self._finalizer.detach()
        _abandon(state, state.agents, self._owns_ray)
        self._manager.join(_STOP_GRACE)

    def __repr__(self) -> str:
        state = self._state
        status = "broken" if state.broken else "closed" if state.closed else "running"
        return (
            f"<RayPool {status} nodes={len(state.live())} workers={self.num_workers} "
            f"submitted={state.submitted} lost={len(state.lost)}>"
        )


# ---------------------------------------------------------------- dispatching


def _pick(state: _State, call: _Call) -> _AgentInfo | None:
    live = state.live()
    if not live:
        return None
    if call.worker is not None:
        # Pinned: the same agent every time while it lives, so calls keep their order.
        return live[call.worker % len(live)]
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
        item = state.done.get()
        if item is None:
            return
        call, ray_future = item
        try:
            _finished(state, call, ray_future)
        except Exception as exc:  # a bug here must not leave a caller waiting forever
            _settle(state, call, exc=exc)


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
            if agent.alive and isinstance(exc, ray.exceptions.RayActorError):
                agent.alive = False
                state.lost.append(agent.node_id)
                _log.warning(
                    "mpexec RayPool: the agent on node %s (pid %d) died (%s); its calls "
                    "run again on the %d other agent(s)",
                    agent.node_id,
                    agent.pid,
                    type(exc).__name__,
                    len(state.live()),
                )
            state.reruns += 1
            state.pending.appendleft(call)
            if not state.live():
                error = NodeLostError(
                    f"every agent of the RayPool is gone (nodes lost: {', '.join(state.lost)}); "
                    "no node is left to run calls on. Check the Ray cluster (`ray status`) "
                    "and create a new pool.",
                    nodes=list(state.lost),
                )
                error.__cause__ = exc
                if state.broken is None:
                    state.broken = error
                _fail_pending(state, error)
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
    with state.lock:
        state.outstanding.discard(call.future)
    call.fn = call.args = call.kwargs = None  # type: ignore[assignment]
    settle(call.future, result, exc)


def _fail_pending(state: _State, error: BaseException) -> None:
    """Fail every call not yet sent (the lock is held)."""
    calls = list(state.pending)
    state.pending.clear()
    for call in calls:
        _settle(state, call, exc=error)


def _kill_agents(agents: list[_AgentInfo]) -> None:
    """Ask each agent to stop its pool (bounded), then kill its actor."""
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


def _abandon(state: _State, agents: list[_AgentInfo], owns_ray: bool) -> None:
    """Stop the agents, fail what is left, stop the manager (also the finalizer)."""
    with state.lock:
        state.closed = True
    if ray.is_initialized():
        _kill_agents(agents)
    error = PoolClosedError("the pool was shut down before this call finished")
    with state.lock:
        _fail_pending(state, error)
        left = list(state.outstanding)
    for future in left:
        if not future.done():
            with contextlib.suppress(Exception):
                future.set_exception(error)
    state.done.put(None)
    if owns_ray and ray.is_initialized():
        ray.shutdown()
