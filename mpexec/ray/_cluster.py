"""The driver's side of Ray itself: the connection, starting and stopping agents, the nodes.

:class:`Launcher` starts one agent on a node (the pool's start and the
watcher share it); :class:`NodeWatcher` is the thread that reads Ray's node
list, starting agents on nodes that join and counting those that left as
lost; :func:`stop` ends the agents and the pool's calls (``shutdown`` and the
pool's finalizer).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import psutil
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .._errors import PoolClosedError
from ._agent import Agent
from ._sender import AgentInfo
from ._state import RayState

_log = logging.getLogger("mpexec.ray")
NAMESPACE = "mpexec"
STOP_GRACE = 10.0  # seconds an agent gets to stop its pool before it is killed


# ---------------------------------------------------------------- the connection


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's nodes that are alive now (``ray.nodes()`` entries)."""
    # Untyped in Ray (a lint environment without Ray sees Any: hence unused-ignore).
    return [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call,unused-ignore]


def session() -> str | None:
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


def gcs_address() -> str | None:
    """The address of the cluster this process is connected to (None if Ray cannot say)."""
    try:
        return str(ray.get_runtime_context().gcs_address)
    except Exception:  # a Ray Client connection, or an older Ray
        return None


def check_connected_to(address: str | None) -> None:
    """This process is connected to Ray already: ``address``, if given, must be that Ray."""
    if address is None or address == "auto":
        return
    current = gcs_address()
    if address != current:
        raise ValueError(
            f"this process is already connected to the Ray at {current}, so RayPool cannot "
            f"use address={address!r}: leave address out to use that Ray, or call "
            "ray.shutdown() first"
        )


# ---------------------------------------------------------------- agents


class Launcher:
    """Starts one agent on a node: what the pool's start and the node watcher share."""

    def __init__(
        self,
        state: RayState,
        token: str,
        workers_per_node: int | None,
        pool_kwargs: dict[str, Any],
    ) -> None:
        self.state = state
        self.token = token
        self.workers_per_node = workers_per_node
        self.pool_kwargs = pool_kwargs
        self.agent_cls = ray.remote(Agent)
        self.seen: set[str] = set()  # nodes that got an agent, or need none

    def launch(self, node: dict[str, Any]) -> AgentInfo | None:
        """An agent on ``node``, created and listed (not yet alive); None for a CPU-less node."""
        self.seen.add(node["NodeID"])
        cpus = int(node.get("Resources", {}).get("CPU", 0))
        workers = self.workers_per_node or cpus
        if workers < 1:
            return None

        def make(index: int) -> AgentInfo:
            name = f"mpexec-agent-{self.token}-{index}"
            handle = self.agent_cls.options(
                name=name,
                namespace=NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(workers, self.pool_kwargs)
            return AgentInfo(index, name, handle, node["NodeID"], workers)

        return self.state.enlist(make)


def kill_agents(agents: list[AgentInfo], *, before_shutdown: bool = False) -> None:
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
        ray.wait(closing, num_returns=len(closing), timeout=STOP_GRACE)
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
            psutil.wait_procs(procs, timeout=STOP_GRACE)


def stop(state: RayState, agents: list[AgentInfo], owns_ray: bool) -> None:
    """Stop the agents, fail what is left, stop the manager (also the pool's finalizer)."""
    state.close(fail_pending=False)
    state.stop_watching.set()
    if session() == state.session:  # else Ray went, and the agents with it
        kill_agents(agents, before_shutdown=owns_ray)
    error = PoolClosedError("the pool was shut down before this call finished")
    state.fail_pending(error)
    state.flush()
    with state.lock:
        left = list(state.outstanding)
    for future in left:
        if not future.done():
            with contextlib.suppress(Exception):
                future.set_exception(error)
    state.done.put(None)  # the manager's last item
    if owns_ray and session() == state.session:  # not a Ray someone started since
        ray.shutdown()


# ---------------------------------------------------------------- nodes


class NodeWatcher(threading.Thread):
    """Every ``interval`` s until the pool stops: agents for new nodes, losses for gone ones.

    Ray offers no event for a node joining, so the node list is read again;
    the wait is on the pool's stop event, so shutdown never waits for a turn.
    Like the manager, it holds the state and the launcher, never the pool.
    """

    def __init__(self, state: RayState, launcher: Launcher, interval: float, timeout: float):
        super().__init__(name="mpexec-raypool-nodes", daemon=True)
        self.state = state
        self.launcher = launcher
        self.interval = interval
        self.timeout = timeout  # seconds a new node's agent gets to answer

    def run(self) -> None:
        state = self.state
        while not state.stop_watching.wait(self.interval):
            if state.broken is not None:
                return
            try:
                alive = {n["NodeID"]: n for n in alive_nodes()}
            except Exception as exc:  # the GCS briefly away: look again next time
                _log.debug("mpexec RayPool: reading Ray's node list failed: %s", exc)
                continue
            going = state.keep_nodes(alive)
            state.flush()
            if not going:
                return
            for node_id, node in alive.items():
                if node_id not in self.launcher.seen and not state.stop_watching.is_set():
                    self.join_node(node)

    def join_node(self, node: dict[str, Any]) -> None:
        """Start an agent on a node that joined; it takes calls once it has answered."""
        agent = self.launcher.launch(node)
        if agent is None:
            return
        try:
            pid = ray.get(agent.handle.hello.remote(), timeout=self.timeout)[0]
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
        if self.state.started(agent, pid, joined=True):
            _log.info(
                "mpexec RayPool: node %s joined the cluster; its agent (pid %d) runs %d workers",
                agent.node_id,
                pid,
                agent.workers,
            )
        self.state.flush()
