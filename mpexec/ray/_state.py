"""What the driver's threads share: the agents, the calls, and the pool's condition.

Every change is a method of :class:`RayState` under its one lock (an RLock:
one method may call another); the face, the manager and the node watcher call
them and never assign its fields. Reading a field (``state.broken``,
``state.agents``) is fine. Outcomes for callers' futures are queued under the
lock (:meth:`RayState.settle`) and given outside it (:meth:`RayState.flush`).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable, Container
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .._errors import NodeLostError, PoolClosedError, raised_again
from .._mapping import settle
from ._sender import AgentInfo, Call, CallSender

_log = logging.getLogger("mpexec.ray")


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


class RayState:
    """What the pool, its manager and its node watcher share (those two hold only this)."""

    def __init__(self, session: str | None) -> None:
        self.lock = threading.RLock()
        self.agents: list[AgentInfo] = []
        self.pending: collections.deque[Call] = collections.deque()
        self.outstanding: set[Future[Any]] = set()
        # The manager's inbox: finished calls (from Ray's threads), None to stop.
        self.done: queue.SimpleQueue[tuple[Call, Future[Any]] | None] = queue.SimpleQueue()
        self.sender = CallSender(self.done)  # the function cache, and Ray's remote call
        self.broken: BaseException | None = None
        self.closed = False
        self.lost: list[str] = []
        self.submitted = self.completed = self.failed = 0
        self.reruns = 0
        self.joined = 0  # agents started on nodes that joined after the pool started
        self.pins: dict[int, AgentInfo] = {}  # a pinned call's worker -> its agent
        self.stop_watching = threading.Event()
        self.session = session  # the Ray connection the agents belong to
        # Outcomes to give to callers' futures once the lock is released (flush).
        self.to_settle: list[tuple[Call, Any, BaseException | None]] = []

    # ------------------------------------------------------------ reading
    def live(self) -> list[AgentInfo]:
        return [a for a in self.agents if a.alive]

    def stats(self) -> RayPoolStats:
        with self.lock:
            live = self.live()
            return RayPoolStats(
                nodes=len(live),
                workers=sum(a.workers for a in live),
                lost_nodes=tuple(self.lost),
                joined_nodes=self.joined,
                submitted=self.submitted,
                completed=self.completed,
                failed=self.failed,
                reruns=self.reruns,
                in_flight=sum(a.in_flight for a in self.agents),
                pending=len(self.pending),
            )

    def check_usable(self) -> None:
        """Raise (a new copy of) the stored error once broken, PoolClosedError once closed."""
        if self.broken is not None:
            raise raised_again(self.broken)  # never the stored object: see raised_again
        if self.closed:
            raise PoolClosedError("cannot submit to a RayPool after shutdown()")

    # ------------------------------------------------------------ agents
    def enlist(self, make: Callable[[int], AgentInfo]) -> AgentInfo | None:
        """``make(index)``'s agent, listed at once (shutdown kills it, started or not);
        None once the pool is closed (no agent it would not kill)."""
        with self.lock:
            if self.closed:
                return None
            agent = make(len(self.agents))
            self.agents.append(agent)
            return agent

    def started(self, agent: AgentInfo, pid: int, *, joined: bool = False) -> bool:
        """``agent`` answered: it takes calls. False if the pool stopped meanwhile."""
        with self.lock:
            if joined and (self.closed or self.broken is not None):
                return False  # shutdown kills it: it is in self.agents
            agent.pid, agent.alive = pid, True
            if joined:
                self.joined += 1
                self.dispatch()
            return True

    def keep_nodes(self, alive: Container[str]) -> bool:
        """Agents whose node is not in ``alive`` are lost; False once the pool has
        stopped or has no agent left (the watcher then stops)."""
        with self.lock:
            if self.closed or self.broken is not None:
                return False
            for agent in self.live():
                if agent.node_id not in alive:
                    self.lose(agent, "its node left the cluster")
            if not self.live():
                self.no_agent_left(None)
                return False
            return True

    def lose(self, agent: AgentInfo, why: str) -> None:
        """Count ``agent`` as lost; its calls in flight come back as lost."""
        with self.lock:
            if not agent.alive:
                return
            agent.alive = False
            self.lost.append(agent.node_id)
            for worker in [w for w, a in self.pins.items() if a is agent]:
                del self.pins[worker]
            _log.warning(
                "mpexec RayPool: the agent on node %s (pid %d) is lost (%s); its calls run "
                "again on the %d other agent(s)",
                agent.node_id,
                agent.pid,
                why,
                len(self.live()),
            )

    def no_agent_left(self, cause: BaseException | None) -> None:
        """Every agent is lost: the pool is broken, every waiting call fails.

        With a copy of the error that broke the pool (``cause`` its cause), also
        for a call that comes back lost after that.
        """
        with self.lock:
            if self.broken is None:
                error = NodeLostError(
                    f"every agent of the RayPool is gone (nodes lost: {', '.join(self.lost)}); "
                    "no node is left to run calls on. Check the Ray cluster (`ray status`) "
                    "and create a new pool.",
                    nodes=list(self.lost),
                )
                error.__cause__ = cause
                self.broken = error
            self.fail_pending(self.broken, stored=True)

    def ray_gone(self) -> None:
        """Ray was shut down under the pool: it is broken, every call waiting fails now."""
        with self.lock:
            if self.broken is None:
                nodes = [a.node_id for a in self.agents if a.alive]
                self.broken = NodeLostError(
                    "Ray was shut down in this process (ray.shutdown(), perhaps from another "
                    "library's atexit) while the RayPool ran: its agents and their calls are "
                    "gone. Create a new pool once Ray is running again.",
                    nodes=nodes,
                )
                for agent in self.agents:
                    agent.alive = False
            error = self.broken
            self.fail_pending(error, stored=True)
            futures = list(self.outstanding)
            self.outstanding.clear()
            self.failed += sum(not f.done() for f in futures)
        self.flush()
        for future in futures:  # in flight: Ray's callbacks for them never come
            if not future.done():
                settle(future, exc=raised_again(error))

    # ------------------------------------------------------------ calls
    def add(self, call: Call) -> None:
        """Queue a submitted call and send what can go (raises if the pool is not usable)."""
        with self.lock:
            self.check_usable()
            self.sender.fn_entry(call.fn, self.agents)
            self.pending.append(call)
            self.outstanding.add(call.future)
            self.submitted += 1
            self.dispatch()

    def pick(self, call: Call) -> AgentInfo | None:
        """The agent ``call`` goes to now (lock held): its pinned one, or the least loaded."""
        live = self.live()
        if not live:
            return None
        if call.worker is not None:
            # Pinned: the same agent every time while it lives (agents that join later
            # change nothing), so the calls keep their order and their worker's state.
            agent = self.pins.get(call.worker)
            if agent is None or not agent.alive:
                agent = self.pins[call.worker] = live[call.worker % len(live)]
            return agent
        best = min(live, key=lambda a: a.in_flight / a.workers)
        return best if best.in_flight < 2 * best.workers else None

    def dispatch(self) -> None:
        """Send pending calls, in order, while agents have room."""
        with self.lock:
            while self.pending:
                call = self.pending[0]
                if call.future.cancelled():
                    self.pending.popleft()
                    self.outstanding.discard(call.future)
                    continue
                agent = self.pick(call)
                if agent is None:
                    return
                if not self.sender.connected():
                    return  # ray.shutdown() under way: the manager fails the calls (ray_gone)
                self.pending.popleft()
                if not call.future.running() and not call.future.set_running_or_notify_cancel():
                    self.outstanding.discard(call.future)
                    continue  # cancelled while it waited
                error = self.sender.send(call, agent, self.agents)
                if error is not None:
                    self.settle(call, exc=error)

    def returned(self, agent: AgentInfo) -> bool:
        """A call of ``agent``'s came back (from Ray); True if the pool is closed."""
        with self.lock:
            agent.in_flight -= 1
            return self.closed

    def rerun(self, call: Call, agent: AgentInfo, why: str | None, cause: BaseException) -> bool:
        """``call`` was lost with its agent or its result: to the head of the queue.

        ``why``: the agent died (it is lost; a lost result alone leaves it be).
        False if no agent is left (the pool is then broken).
        """
        with self.lock:
            if why is not None:
                self.lose(agent, why)
            self.reruns += 1
            self.pending.appendleft(call)
            if not self.live():
                self.no_agent_left(cause)
                return False
            return True

    def dispatch_unless_closed(self) -> None:
        """Send more calls, unless the pool is closed with nothing left to send."""
        with self.lock:
            if not self.closed or self.pending:
                self.dispatch()

    def settle(self, call: Call, result: Any = None, exc: BaseException | None = None) -> None:
        """Give ``call`` its outcome at the next :meth:`flush`, outside the pool's lock."""
        with self.lock:
            self.outstanding.discard(call.future)
            self.to_settle.append((call, result, exc))

    def flush(self) -> None:
        """Settle the outcomes :meth:`settle` queued; never with the pool's lock held.

        A future's callbacks run here, and may take locks of their own (a
        pipeline's scheduler does, and submits more calls under it): settling
        under our lock would order the two locks both ways.
        """
        while True:
            with self.lock:
                items, self.to_settle = self.to_settle, []
                if not items:
                    return
                for call, _, exc in items:
                    if not call.future.done():
                        if exc is not None:
                            self.failed += 1
                        else:
                            self.completed += 1
            for call, result, exc in items:
                call.fn = call.args = call.kwargs = None  # type: ignore[assignment]
                if call.future.done():
                    continue
                settle(call.future, result, exc)

    def fail_pending(self, error: BaseException, *, stored: bool = False) -> None:
        """Fail every call not yet sent (:meth:`flush` settles them).

        ``stored``: ``error`` is the one the pool keeps (``self.broken``): each
        call gets a copy of it, whose ``__cause__`` it is. Each caller's
        ``result()`` raises what its future holds, and raising the stored
        object would add that caller's frames to it, kept for as long as the
        pool lives (see ``raised_again``).
        """
        with self.lock:
            calls = list(self.pending)
            self.pending.clear()
            for call in calls:
                self.settle(call, exc=raised_again(error) if stored else error)

    # ------------------------------------------------------------ closing
    def close(self, fail_pending: bool) -> tuple[bool, list[Future[Any]]]:
        """No more calls; with ``fail_pending``, the queued ones fail.

        ``(first, outstanding)``: whether this closed it, and the calls still out.
        """
        with self.lock:
            first = not self.closed
            self.closed = True
            if fail_pending:
                self.fail_pending(PoolClosedError("the pool was shut down before this call ran"))
            return first, list(self.outstanding)
