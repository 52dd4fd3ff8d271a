"""WorkerPool: a ``concurrent.futures.Executor`` over GIL-free worker processes.

::

    caller threads                    shared memory                       worker i
    --------------                    -------------                       --------
    submit(fn, *args)  [_executor]
      encode: arrays -> descriptors   main arena (owned by the pool) --->  read-only views
      push FUNC (once per fn), CALL ->  task ring i  (main -> worker) ---> pop, decode, call
        [_sender: CallSender]                                              encode the result
    manager thread  <---------------  done ring i  (worker -> main)  <---  push OK / ERROR
      [_manager: Manager]                                                  [mpexec._worker]
      decode, open result views   <-  worker arena i (owned by worker i)
      set the future [_future]
    views of results dropped  -----> result-release ring i ----------->  arena collects
    worker's views dropped    <----- arg-release ring i  <-------------  finalizer pushes

    one wait in the manager: every done ring + every worker sentinel + a wake-up doorbell

    cancel(): CANCEL, then VERDICT -> task ring i -------------------->  skips the call or runs it
    manager thread  <----------------  SKIPPED (or the call's OK)  <-----  (``_protocol`` docstring)
    workers start from ``_launch`` [_factory: WorkerFactory]: mpexec's own fork server (or
    spawn), never the caller's ``__main__``; a forked child of the caller gets ForkedPoolError

Each ring has one producer and one consumer, so no lock is ever shared between
processes; the pool's own lock is a plain thread lock in the main process. The
pool owns the main arena and the rings; each worker owns its arena, and a
result view in the caller keeps the worker's memory mapped after the worker
is gone. The records on the rings are ``mpexec._protocol``'s.

The rooms of this package:

- ``_executor``: :class:`WorkerPool`, the face: checks, queues, ``map``, shared memory.
- ``_future``: a call's task and future, and cancelling it.
- ``_state``: the worker slots and the pool's state, whose changes are its methods.
- ``_sender``: encoding calls and pushing them to workers (the function cache).
- ``_factory``: starting a worker and reading its hello.
- ``_manager``: the manager thread (results, deaths, timeouts, restarts).
- ``_crash``: what a worker's death says (exit, likely cause, OOM).
- ``_stop``: shutdown, the escalation to SIGKILL, exit and fork hooks.
- ``_waiting``: waiting for a future without the poll, reading a settled outcome
  (for code built on the pool: the TF op's body, the torch drop-in).

The manager thread holds the state, the factory and the sender, not the pool,
so that a pool that is dropped without ``shutdown`` is collected and shut down
by its finalizer.
"""

from ._executor import WorkerPool
from ._state import PoolStats, PoolStatus
from ._waiting import read_settled, wait_settled

__all__ = ["PoolStats", "PoolStatus", "WorkerPool", "read_settled", "wait_settled"]
