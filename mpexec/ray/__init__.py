"""RayPool: ``WorkerPool``'s semantics over a Ray cluster, one agent per node.

::

    caller threads (driver)            Ray                            node k: agent actor
    -----------------------            ---                            -------------------
    submit(fn, *args)  [_executor]
      fn pickled once: sent to   ---> with the agent's first   ---> fn cache (by key)
        each agent once                  call of it                   [_agent: Agent]
      call -> pending deque  [_state: RayState]
      dispatch: least-loaded live agent,
        at most 2 x its workers in flight
      agent.run.remote(args) --------> args: object store -------->  local WorkerPool.submit_call
                                         (arrays out of band;          shared-memory rings:
                                          zero-copy on the node)       zero-copy in the node
    manager thread  <---------------- (True, result) or  <---------- await the local future
      [_manager: RayManager]             (False, exc, traceback)
      settle the caller's Future
      agent died: its calls go back to the head of pending and run on the others
      no agent left: NodeLostError to every call
    node watcher thread (every watch_interval s): ray.nodes()  [_cluster: NodeWatcher]
      a node that joined: start an agent there; once it answers, calls go to it too
      a node that left: its agent counts as lost (nodes, num_workers, stats() say so)

The driver owns the agents it started (named actors, stopped by ``shutdown``
and by a finalizer, also those the watcher started); each agent owns its
node's ``WorkerPool`` (workers, arena, rings), whose workers exit with it.
Ray's own completion callbacks only queue the finished call: results are
settled, and more calls dispatched, on the pool's manager thread, never on a
Ray thread.

The rooms of this package:

- ``_executor``: :class:`RayPool`, the face: checks, starting the agents, calls, shutdown.
- ``_state``: the agents, the calls and the pool's state, whose changes are its methods.
- ``_sender``: sending a call to an agent (the records of agents and calls, the function cache).
- ``_agent``: the Ray actor on each node (runs in the agent's process, not the driver).
- ``_cluster``: Ray's connection, starting and stopping agents, the node watcher thread.
- ``_manager``: the manager thread (results, reruns of a lost agent's calls, Ray gone).

The manager and the node watcher hold the state, not the pool, so that a pool
dropped without ``shutdown`` is collected and stopped by its finalizer.
"""

try:
    import ray  # noqa: F401  # the extra's check, before any room imports it
except ImportError as _exc:  # pragma: no cover - exercised without the extra
    from .._extras import missing_message

    raise ImportError(missing_message("ray", _exc)) from _exc

from ._executor import RayPool
from ._state import RayPoolStats

__all__ = ["RayPool", "RayPoolStats"]
