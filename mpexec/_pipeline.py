"""Pipeline: the public face of a graph run over batches, and ``pipeline_def``.

A :class:`Pipeline` holds the definition and the parameters, builds the plan,
starts a :class:`WorkerPool` and hands both to the scheduler
(:mod:`mpexec._scheduler`), which runs the iterations: its docstring draws
the data path and the unit of work a pool runs.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

from . import _codec
from ._batch import Batch
from ._errors import MpexecError, PoolClosedError, SerializationError, forked_error
from ._graph import DataNode, Graph, Plan, defining
from ._host import usable_cpus
from ._pool import WorkerPool
from ._scheduler import CallPool, OpStats, Scheduler, pool_executor

_PARAMS = (
    "batch_size",
    "num_workers",
    "seed",
    "prefetch_depth",
    "device_id",
    "start_method",
    "debug",
    "timeout",
    "last_batch",
)
# Accepted where parameters are, never serialized: they name live objects.
_LIVE_PARAMS = ("pool",)
_FORMAT = 1  # of serialize()
_STATE_VERSION = 1  # of state_dict()


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a pipeline's work: per op, and per worker."""

    iterations: int
    wall_s: float
    ops: tuple[OpStats, ...]
    busy: tuple[tuple[int, float], ...]  # (worker pid, busy fraction of wall time)
    merged_ops: int
    pruned_ops: int

    def __str__(self) -> str:
        head = (
            f"{'op':<28}{'calls':>8}{'fn ms':>10}{'wait ms':>10}"
            f"{'MiB in':>9}{'MiB out':>9}{'copied':>9}"
        )
        summary = (
            f"{self.iterations} iterations in {self.wall_s:.2f} s "
            f"({self.merged_ops} ops merged, {self.pruned_ops} pruned)"
        )
        lines = [summary, head]
        lines += [
            f"{s.name[:27]:<28}{s.calls:>8}{s.function_s * 1e3:>10.1f}"
            f"{s.waiting_s * 1e3:>10.1f}{s.bytes_in / 2**20:>9.1f}"
            f"{s.bytes_out / 2**20:>9.1f}{s.bytes_copied / 2**20:>9.1f}"
            for s in self.ops
        ]
        if self.busy:
            lines.append(
                "workers busy: "
                + ", ".join(f"pid {pid} {frac:.0%}" for pid, frac in sorted(self.busy))
            )
        return "\n".join(lines)


class Pipeline:
    """A graph of python_function ops run over batches by worker processes.

    Define it with :func:`pipeline_def` (or ``with pipe:`` and
    :meth:`set_outputs`), then ``with pipe:`` builds it and starts the
    workers, :meth:`run` returns one iteration as a tuple of :class:`Batch`,
    iterating yields iterations until a source ends the epoch, :meth:`reset`
    starts the next epoch and :meth:`close` (idempotent) stops everything.

    - ``num_workers``: worker processes (default: the CPUs this process may
      use); ``0`` runs every call here, in order, for a debugger.
    - ``seed``: makes every op's randomness reproducible; None picks one.
    - ``prefetch_depth``: iterations in flight at once.
    - ``last_batch``: ``"partial"`` returns a short last batch of an epoch as
      it is; ``"drop"`` drops it.
    - ``debug``: checksum inputs around every call and name the function
      that changed one.
    - ``timeout``: seconds one call may run (then :class:`TaskTimeoutError`).
    - ``device_id``: the CUDA device of GPU ops (``device="gpu"``; default 0).
    - ``pool``: run on this pool instead of starting one: a
      :class:`WorkerPool`, or an ``mpexec.ray.RayPool`` to spread the
      iterations over a Ray cluster. Outputs are bit-identical either way.
      The pipeline does not own it: closing the pipeline leaves it running.
      ``num_workers`` is then the pool's; ``start_method`` and ``timeout``
      are set on the pool itself.
    """

    def __init__(
        self,
        batch_size: int,
        num_workers: int | None = None,
        seed: int | None = None,
        prefetch_depth: int = 2,
        device_id: int | None = None,
        start_method: str | None = None,
        *,
        debug: bool = False,
        timeout: float | None = None,
        last_batch: str = "partial",
        pool: CallPool | None = None,
    ) -> None:
        _check_int("batch_size", batch_size, 1)
        if pool is not None:
            num_workers = _check_pool(pool, num_workers, start_method, timeout)
        if num_workers is None:
            num_workers = usable_cpus()
        _check_int("num_workers", num_workers, 0)
        _check_int("prefetch_depth", prefetch_depth, 1)
        if last_batch not in ("partial", "drop"):
            raise ValueError(f"last_batch must be 'partial' or 'drop', not {last_batch!r}")
        if seed is None or seed == -1:
            seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0]) >> 1
        _check_int("seed", seed, 0)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = int(seed)
        self.prefetch_depth = prefetch_depth
        self.device_id = device_id
        self.start_method = start_method
        self.debug = debug
        self.timeout = timeout
        self.last_batch = last_batch
        self._graph: Graph | None = None
        self._defining: Any = None  # the context of an open `with pipe:` definition
        self._plan: Plan | None = None
        self._given_pool = pool
        self._pool: CallPool | None = None
        self._scheduler: Scheduler | None = None
        self._gpu: Any = None  # the GPU stage (_gpu.GpuExecutor), when the graph has GPU ops
        self._resume_at: tuple[int, int] | None = None  # load_state_dict() before build()
        self._lock = threading.RLock()
        self._closed = False
        self._iterations = 0
        self._started = 0.0
        self._finalizer: weakref.finalize[Any, Pipeline] | None = None

    # ------------------------------------------------------------ defining
    def _params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _PARAMS}

    def define(self, graph_fn: Callable[[], Any]) -> None:
        """Define the graph by calling ``graph_fn`` (what ``pipeline_def`` does)."""
        if self._graph is not None:
            raise MpexecError("this pipeline is already defined")
        graph = Graph()
        graph.device_id = self.device_id
        with defining(graph):
            out = graph_fn()
        if out is None:
            out = ()
        elif isinstance(out, DataNode):
            out = (out,)
        elif isinstance(out, list):
            out = tuple(out)
        if not isinstance(out, tuple):
            raise TypeError(
                f"a pipeline definition returns DataNodes (or a tuple of them), not "
                f"{type(out).__name__}"
            )
        graph.set_outputs(out)
        self._graph = graph

    def set_outputs(self, *outputs: DataNode) -> None:
        """Name the pipeline's outputs, inside ``with pipe:`` (DALI style)."""
        if self._defining is None:
            raise MpexecError("set_outputs() belongs inside `with pipe:` of a new pipeline")
        graph = self._defining[0]
        graph.set_outputs(outputs)

    def __enter__(self) -> Pipeline:
        if self._graph is None and self._defining is None:
            graph = Graph()
            graph.device_id = self.device_id
            ctx = defining(graph)
            ctx.__enter__()
            self._defining = (graph, ctx)
            return self
        self.build()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._defining is not None:
            graph, ctx = self._defining
            self._defining = None
            ctx.__exit__(exc_type, exc, tb)
            if exc_type is None:
                self._graph = graph
            return
        self.close()

    # ------------------------------------------------------------ building
    def build(self) -> None:
        """Plan the graph and start the workers (``with pipe:`` calls it)."""
        self._check_not_forked()
        with self._lock:
            if self._closed:
                raise PoolClosedError("this pipeline is closed")
            if self._scheduler is not None:
                return
            if self._graph is None:
                raise MpexecError(
                    "this pipeline has no graph: decorate its definition with "
                    "@mpexec.pipeline_def, or define it in `with pipe:` and call set_outputs()"
                )
            plan = self._graph.plan()
            pool: CallPool
            # A pipeline dropped unclosed stops its GPU stage too (first: it unregisters
            # the pool's memory before the pool unmaps it), so the finalizer takes both;
            # a pool it was given is its owner's to close, not ours.
            stages: list[Any] = []
            if self._given_pool is not None:
                pool = self._given_pool
            else:
                own = WorkerPool(
                    self.num_workers,
                    start_method=self.start_method,
                    seed=self.seed,
                    timeout=self.timeout,
                    results="view",  # outputs are read-only anyway: no copies of results
                )
                stages.append(own)
                pool = own
            self._finalizer = weakref.finalize(self, _close_stages, stages)
            try:
                if any(op.device == "gpu" for op in plan.ops):
                    from ._gpu import GpuExecutor, require

                    device = self.device_id or 0
                    xp = require(f"a pipeline with GPU ops on device {device}", device)
                    self._gpu = GpuExecutor(xp, device)
                    stages.insert(0, self._gpu)
                scheduler = Scheduler(
                    plan,
                    pool_executor(pool),
                    batch_size=self.batch_size,
                    prefetch_depth=self.prefetch_depth,
                    seed=self.seed,
                    last_batch=self.last_batch,
                    debug=self.debug,
                    gpu=self._gpu,
                )
            except BaseException:
                self._finalizer()
                raise
            self._plan, self._pool, self._scheduler = plan, pool, scheduler
            if self._resume_at is not None:
                scheduler.seek(*self._resume_at)
                self._resume_at = None
            self._started = time.perf_counter()

    # ------------------------------------------------------------ running
    def run(self) -> tuple[Batch, ...]:
        """The next iteration: one :class:`Batch` per output.

        Raises StopIteration when a source has ended the epoch (then
        :meth:`reset`), and re-raises an op's exception for the iteration it
        broke (later iterations go on).
        """
        self._check_not_forked()
        self.build()
        assert self._scheduler is not None
        result = self._scheduler.next_result()
        self._iterations += 1
        return result

    def __iter__(self) -> Iterator[tuple[Batch, ...]]:
        while True:
            try:
                out = self.run()
            except StopIteration:
                return
            yield out

    def reset(self) -> None:
        """Start the next epoch: sources begin again from their start."""
        self._check_not_forked()
        if self._scheduler is not None:
            self._scheduler.reset()

    # ------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, as a small JSON-able dict for :meth:`load_state_dict`.

        ``epoch`` and ``iteration``: the epoch and how many of its iterations
        :meth:`run` returned; ``seed`` and ``batch_size``, which a resumed
        pipeline must share.
        """
        if self._scheduler is not None:
            epoch, iteration = self._scheduler.position()
        else:
            epoch, iteration = self._resume_at or (0, 0)
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "epoch": epoch,
            "iteration": iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken, in this or another process.

        The next :meth:`run` returns exactly what an uninterrupted run returned
        after that point, iterations in flight dropped. Iterations depend only
        on (seed, op, epoch, iteration, sample), so nothing is recomputed;
        iterables read in this process (``external_source(source=iterable)``)
        are read again from their start up to there. A pipeline with
        ``stateful`` ops is refused: their state cannot be restored.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"load_state_dict() needs a dict from Pipeline.state_dict() "
                f"(version {_STATE_VERSION}), not {state!r:.200}"
            )
        for key in ("seed", "batch_size"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"the state was taken from a pipeline with {key}={state.get(key)!r}, this "
                    f"one has {key}={getattr(self, key)!r}: its iterations would differ; "
                    f"build the pipeline with {key}={state.get(key)!r}"
                )
        epoch, iteration = state.get("epoch"), state.get("iteration")
        if not all(isinstance(v, int) and v >= 0 for v in (epoch, iteration)):
            raise ValueError(
                f"state epoch/iteration must be ints >= 0, not {epoch!r}/{iteration!r}"
            )
        stateful = [op.name for op in (self._graph.ops if self._graph else []) if op.stateful]
        if stateful:
            raise MpexecError(
                f"cannot resume a pipeline with stateful ops ({', '.join(stateful)}): "
                "their state lives in their functions and is not part of state_dict()"
            )
        at = (int(epoch), int(iteration))  # type: ignore[arg-type]
        with self._lock:
            if self._scheduler is None:
                self._resume_at = at
                return
        self._scheduler.seek(*at)

    def feed_input(self, name: str, data: Any, layout: str | None = None) -> None:
        """Give the external_source ``name`` (with no ``source``) its next batch.

        ``data``: a list of per-sample arrays, or one array whose first axis
        is the batch (for a source with ``num_outputs`` > 1, a tuple of those).
        """
        del layout
        self.build()
        assert self._scheduler is not None
        self._scheduler.feed(name, data)

    def close(self) -> None:
        """Stop the workers and free what the pipeline holds; idempotent.

        Batches already returned stay valid for as long as they are held.
        In a process forked from the pipeline's, it only marks this copy
        closed: the workers are the parent's.
        """
        if self._forked_from() is not None:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer.detach()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._scheduler is not None:
                self._scheduler.close()
            pool, self._pool = self._pool, None
            gpu, self._gpu = self._gpu, None
        if gpu is not None:
            gpu.shutdown(wait=True, cancel_futures=True)  # waits for copies, unregisters
        if pool is not None and pool is not self._given_pool:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._finalizer is not None:
            self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def _forked_from(self) -> int | None:
        """The pid of the process that started its pool or GPU stage, if not this one."""
        gpu = self._gpu  # runs in the pipeline's process even when num_workers=0
        if gpu is not None and gpu.pid != os.getpid():
            return int(gpu.pid)
        pool = self._pool
        if not isinstance(pool, WorkerPool):
            return None  # a RayPool is Ray's to fork-check
        status = pool.status  # an inline pool (num_workers=0) is never "forked"
        return status.owner_pid if status.state == "forked" else None

    def _check_not_forked(self) -> None:
        # Before any lock: another thread of the parent may have held one at the fork.
        owner = self._forked_from()
        if owner is not None:
            raise forked_error(owner, "this pipeline")

    def stats(self) -> PipelineStats:
        """Per op: calls, time in the function and waiting, bytes; per worker: busy."""
        self._check_not_forked()
        with self._lock:
            wall = time.perf_counter() - self._started if self._started else 0.0
            n_defined = len(self._graph.ops) if self._graph is not None else 0
            merged = self._plan.merged if self._plan is not None else 0
            sched = self._scheduler
            ops = sched.op_stats() if sched is not None else ()
            busy = dict(sched.busy) if sched is not None else {}
            return PipelineStats(
                iterations=self._iterations,
                wall_s=wall,
                ops=ops,
                busy=tuple((pid, t / wall if wall else 0.0) for pid, t in busy.items()),
                merged_ops=merged,
                pruned_ops=n_defined - len(ops) - merged,
            )

    # ------------------------------------------------------------ serializing
    def serialize(self) -> bytes:
        """The pipeline's definition and parameters as bytes, functions by value.

        :meth:`deserialize` rebuilds it in any process, with identical outputs.
        """
        if self._graph is None:
            raise MpexecError("only a defined pipeline can be serialized")
        payload = {"format": _FORMAT, "params": self._params(), "graph": self._graph}
        modules = _user_modules(self._graph)
        for m in modules:
            cloudpickle.register_pickle_by_value(m)
        try:
            return bytes(cloudpickle.dumps(payload, protocol=5))
        except Exception as exc:
            raise SerializationError(
                _codec.describe_unpicklable(self._graph, "the pipeline graph", exc)
            ) from exc
        finally:
            for m in modules:
                cloudpickle.unregister_pickle_by_value(m)

    @classmethod
    def deserialize(cls, data: bytes, **overrides: Any) -> Pipeline:
        """A pipeline rebuilt from :meth:`serialize`; ``overrides`` change parameters."""
        payload = cloudpickle.loads(data)
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise MpexecError("not a serialized mpexec pipeline (or from another version)")
        unknown = set(overrides) - set(_PARAMS) - set(_LIVE_PARAMS)
        if unknown:
            raise TypeError(f"unknown pipeline parameters: {sorted(unknown)}")
        pipe = cls(**{**payload["params"], **overrides})
        pipe._graph = payload["graph"]
        return pipe

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._pool else "not built"
        return (
            f"Pipeline(batch_size={self.batch_size}, num_workers={self.num_workers}, "
            f"seed={self.seed}, prefetch_depth={self.prefetch_depth}, {state})"
        )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value!r}")


def _close_stages(stages: list[Any]) -> None:
    """A pipeline's finalizer: its GPU stage (if any) first, then the pool it owns (if any)."""
    for stage in stages:
        if isinstance(stage, WorkerPool):
            stage.shutdown(wait=False, cancel_futures=True)
        else:
            # Joining the GPU thread from itself (a collection it triggered) would raise.
            current = stage.on_own_thread()
            stage.shutdown(wait=not current, cancel_futures=True)


def _check_pool(
    pool: object, num_workers: int | None, start_method: str | None, timeout: float | None
) -> int:
    """The number of workers of a pool given to a pipeline, checked."""
    if not (
        callable(getattr(pool, "submit_call", None)) and callable(getattr(pool, "share", None))
    ):
        raise TypeError(
            f"pool must be an mpexec.WorkerPool or an mpexec.ray.RayPool, not {type(pool).__name__}"
        )
    n = int(getattr(pool, "num_workers", 0))
    if num_workers is not None and num_workers != n:
        raise ValueError(
            f"num_workers={num_workers} disagrees with the given pool's {n} workers; "
            "leave num_workers out when giving a pool"
        )
    for name, value in (("start_method", start_method), ("timeout", timeout)):
        if value is not None:
            raise ValueError(
                f"{name} belongs to the pool when a pool is given: create the pool with it"
            )
    return n


def pipeline_def(fn: Callable[..., Any] | None = None, **pipeline_kwargs: Any) -> Any:
    """Decorate a graph definition; calling it returns a defined :class:`Pipeline`.

    ``@pipeline_def(batch_size=64, num_workers=4, seed=42)``; the decorated
    function may also be given pipeline parameters when called
    (``augment(batch_size=8)``, ``augment(pool=ray_pool)``), and its own
    arguments.
    """
    unknown = set(pipeline_kwargs) - set(_PARAMS) - set(_LIVE_PARAMS)
    if unknown:
        raise TypeError(f"pipeline_def got unknown pipeline parameters: {sorted(unknown)}")

    def decorate(graph_fn: Callable[..., Any]) -> Callable[..., Pipeline]:
        @functools.wraps(graph_fn)
        def create(*args: Any, **kwargs: Any) -> Pipeline:
            params = dict(pipeline_kwargs)
            for k in list(kwargs):
                if k in _PARAMS or k in _LIVE_PARAMS:
                    params[k] = kwargs.pop(k)
            if "batch_size" not in params:
                raise TypeError(
                    f"{graph_fn.__name__}: give batch_size to pipeline_def or to the call"
                )
            pipe = Pipeline(**params)
            pipe.define(lambda: graph_fn(*args, **kwargs))
            return pipe

        return create

    return decorate(fn) if fn is not None else decorate


# ---------------------------------------------------------------- helpers

_SYSTEM_PATHS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _user_modules(graph: Graph) -> list[Any]:
    """Modules of the graph's functions to pickle by value: the user's own code."""
    found: dict[str, Any] = {}
    todo = [op.function for op in graph.ops]
    seen: set[int] = set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        name = str(getattr(obj, "__module__", None) or type(obj).__module__)
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if (
            module is not None
            and path
            and name not in ("__main__", "builtins")
            and name.split(".", maxsplit=1)[0] not in ("mpexec", "shm", "numpy")
            and not os.path.realpath(path).startswith(_SYSTEM_PATHS)
        ):
            found[name] = module
        for attr in ("function", "func", "__wrapped__"):
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj:
                todo.append(inner)
    return list(found.values())
