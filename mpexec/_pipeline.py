"""Pipeline: the public face of a graph run over batches, and ``pipeline_def``.

A :class:`Pipeline` holds the definition and the parameters, builds the plan,
starts a :class:`WorkerPool` and hands both to the scheduler
(:mod:`mpexec._scheduler`), which runs the iterations: its docstring draws
the data path and the unit of work a pool runs.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import struct
import sys
import sysconfig
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import numpy as np

from . import _autograph, _codec
from ._batch import Batch, check_outputs
from ._conditionals import Conditions
from ._errors import MpexecError, PoolClosedError, SerializationError, forked_error
from ._executors import CallPool, pool_executor
from ._graph import DataNode, Graph, Plan, defining, epoch_iterations
from ._host import usable_cpus
from ._iterations import PipelineStats
from ._modes import Device, LastBatch
from ._pool import WorkerPool
from ._scheduler import Scheduler
from ._tracebacks import for_caller
from ._types import ScalarConstant

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
# DALI's pipeline arguments: mapped onto the parameters above, or accepted for
# DALI's sake (Pipeline's docstring); never serialized either (nor is
# enable_conditionals: it shapes the graph, which is).
_DALI_PARAMS = (
    "num_threads",
    "exec_pipelined",
    "prefetch_queue_depth",
    "exec_async",
    "bytes_per_sample",
    "set_affinity",
    "max_streams",
    "default_cuda_stream_priority",
    "py_num_workers",
    "py_start_method",
    "output_dtype",
    "output_ndim",
    "enable_memory_stats",
    "enable_checkpointing",
    "checkpoint",
    "py_callback_pickler",
    "output_layout",
    "exec_dynamic",
    "experimental_exec_dynamic",
    "stream_policy",
    "concurrency",
)
_DEF_PARAMS = frozenset((*_PARAMS, *_LIVE_PARAMS, *_DALI_PARAMS, "enable_conditionals"))
_FORMAT = 2  # of serialize(): 2 adds the header, checked before anything is unpickled
# serialize()'s header: magic, format, payload length, the payload's SHA-256.
_MAGIC = b"MPEXPIPE"
_HEADER = struct.Struct("<8sIQ32s")
CLOSE_GRACE = 5.0  # seconds close() lets a running call finish before stopping its worker
_STATE_VERSION = 2  # of state_dict(): 2 adds the graph's fingerprint


class Pipeline:
    """A graph of python_function ops run over batches by worker processes.

    Define it with :func:`pipeline_def`, in ``with pipe:`` with
    :meth:`set_outputs`, or (DALI's legacy form) in a subclass's
    :meth:`define_graph`; then ``with pipe:`` builds it and starts the
    workers, :meth:`run` returns one iteration as a tuple of :class:`Batch`
    (building first if needed, also inside the ``with pipe:`` that defines it),
    iterating yields iterations until a source ends the epoch, :meth:`reset`
    starts the next epoch and :meth:`close` (idempotent) stops everything.

    The positional parameters are DALI's, in DALI's order: ``batch_size,
    num_threads, device_id, seed, exec_pipelined, prefetch_queue_depth,
    exec_async, ...``. DALI's keywords map where they mean something here
    and are accepted otherwise (docs/pipeline.md, "Porting from DALI"):

    - ``num_workers``: worker processes (default: ``py_num_workers`` if
      given, else ``num_threads`` capped at the CPUs this process may use,
      else those CPUs); ``0`` runs every call here, in order, for a debugger.
    - ``seed``: makes every op's randomness reproducible; None or -1 picks one.
    - ``prefetch_depth``: units of work in flight per worker (default:
      ``prefetch_queue_depth``, 1 with ``exec_pipelined=False``, else 2):
      that many iterations at first, then enough for every worker to hold
      that many chunks or batch calls (whole batches once samples prove
      quick), within a memory budget (docs/pipeline.md, "Many workers").
    - ``start_method``: the workers' (default: ``py_start_method`` if given).
    - ``output_dtype``/``output_ndim``: checked on every output, as DALI does.
    - no effect here: ``exec_async``, ``bytes_per_sample``, ``set_affinity``,
      ``max_streams``, ``default_cuda_stream_priority``,
      ``enable_memory_stats``, ``enable_checkpointing`` (see
      :meth:`state_dict`), ``checkpoint``, ``py_callback_pickler`` (functions
      travel with cloudpickle), ``output_layout``, ``exec_dynamic``,
      ``experimental_exec_dynamic``, ``stream_policy``, ``concurrency``.
    - ``last_batch``: ``"drop"`` (DALI's rule, the default) drops a short
      last batch of an epoch, which a source's ``StopIteration`` part-way
      through a batch leaves; ``"partial"`` (mpexec's own choice) returns it
      as it is.
    - ``debug``: checksum inputs around every call and name the function
      that changed one.
    - ``timeout``: seconds one call may run (then :class:`TaskTimeoutError`).
    - ``device_id``: the CUDA device of GPU ops (``device="gpu"``; default 0).
    - ``enable_conditionals``: DALI's conditional execution: ``if``/``elif``/
      ``else`` and ``and``/``or``/``not`` on DataNodes in the definition run
      each branch's ops on the samples where its predicate holds (the
      definition function, and ``define_graph``, are rewritten; docs/pipeline.md,
      "Conditionals"). DALI's ``pipeline_def`` takes it; here ``Pipeline`` does too.
    - ``pool``: run on this pool instead of starting one: a
      :class:`WorkerPool`, or an ``mpexec.ray.RayPool`` to spread the
      iterations over a Ray cluster. Outputs are bit-identical either way.
      The pipeline does not own it: closing the pipeline leaves it running.
      ``num_workers`` is then the pool's; ``start_method`` and ``timeout``
      are set on the pool itself.
    """

    def __init__(
        self,
        batch_size: int | None = None,
        num_threads: int | None = None,
        device_id: int | None = None,
        seed: int | None = None,
        exec_pipelined: bool = True,
        prefetch_queue_depth: int | dict[str, int] | None = None,
        exec_async: bool = True,
        bytes_per_sample: int = 0,
        set_affinity: bool = False,
        max_streams: int | None = None,
        default_cuda_stream_priority: int | None = None,
        *,
        num_workers: int | None = None,
        prefetch_depth: int | None = None,
        start_method: str | None = None,
        debug: bool = False,
        timeout: float | None = None,
        last_batch: str = "drop",
        pool: CallPool | None = None,
        py_num_workers: int | None = None,
        py_start_method: str | None = None,
        output_dtype: Any = None,
        output_ndim: int | Sequence[int] | None = None,
        enable_memory_stats: bool = False,
        enable_checkpointing: bool = False,
        checkpoint: Any = None,
        py_callback_pickler: Any = None,
        output_layout: Any = None,
        exec_dynamic: bool | None = None,
        experimental_exec_dynamic: bool | None = None,
        stream_policy: Any = None,
        concurrency: Any = None,
        enable_conditionals: bool = False,
    ) -> None:
        # DALI's keywords with no meaning here (the class docstring lists them).
        del exec_async, bytes_per_sample, set_affinity, max_streams, default_cuda_stream_priority
        del enable_memory_stats, enable_checkpointing, checkpoint, py_callback_pickler
        del output_layout, exec_dynamic, experimental_exec_dynamic, stream_policy, concurrency
        if batch_size is None:
            raise ValueError("batch_size is required: Pipeline(batch_size, ...)")
        _check_int("batch_size", batch_size, 1)
        if start_method is None:
            start_method = py_start_method
        if pool is not None:
            num_workers = _check_pool(pool, num_workers, start_method, timeout)
        if num_workers is None:
            num_workers = _workers_from_dali(py_num_workers, num_threads)
        _check_int("num_workers", num_workers, 0)
        if prefetch_depth is None:
            prefetch_depth = _prefetch_from_dali(prefetch_queue_depth, exec_pipelined)
        _check_int("prefetch_depth", prefetch_depth, 1)
        if last_batch not in (LastBatch.PARTIAL, LastBatch.DROP):
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
        self.enable_conditionals = bool(enable_conditionals)
        # DALI's py_num_workers=0 (its keyword, not num_workers=0): no Python workers,
        # which DALI's parallel external source refuses (checked at build).
        self._no_py_workers = py_num_workers == 0 and pool is None
        self._output_checks = _output_checks(output_dtype, output_ndim)
        self._graph: Graph | None = None
        self._defining: Any = None  # the context of an open `with pipe:` definition
        self._plan: Plan | None = None
        self._given_pool = pool
        self._pool: CallPool | None = None
        self._scheduler: Scheduler | None = None
        self._unforked_pid = 0  # found unforked here once built: run() checks no more
        self._gpu: Any = None  # the GPU stage (_executors.GpuExecutor), when the graph has GPU ops
        self._resume_at: tuple[int, int] | None = None  # load_state_dict() before build()
        self._lock = threading.RLock()
        self._closed = False
        self._exhausted = False  # run() raised StopIteration and reset() has not run since
        self._warned_exhausted = False
        self._iterations = 0
        self._samples = 0
        self._started = 0.0
        self._finalizer: weakref.finalize[Any, Pipeline] | None = None

    # ------------------------------------------------------------ defining
    def _params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _PARAMS}

    def define(self, graph_fn: Callable[[], Any]) -> None:
        """Define the graph by calling ``graph_fn`` (what ``pipeline_def`` does)."""
        if self._graph is not None:
            raise MpexecError("this pipeline is already defined")
        graph = self._new_graph()
        if self.enable_conditionals:
            graph_fn = _autograph.convert(graph_fn)
        with defining(graph):
            out = graph_fn()
            if out is None:
                out = ()
            elif isinstance(out, (DataNode, ScalarConstant)):
                out = (out,)
            elif isinstance(out, list):
                out = tuple(out)
            if not isinstance(out, tuple):
                raise TypeError(
                    f"a pipeline definition returns DataNodes (or a tuple of them), not "
                    f"{type(out).__name__}"
                )
            out = _scalar_outputs(out)
        graph.set_outputs(out)
        self._graph = graph

    def _new_graph(self) -> Graph:
        graph = Graph()
        graph.device_id = self.device_id
        graph.seed = self.seed
        graph.batch_size = self.batch_size
        if self.enable_conditionals:
            graph.conditions = Conditions(graph)
        return graph

    def define_graph(self) -> Any:
        """DALI's legacy definition: a subclass returns its outputs from here.

        Called once, when the pipeline is built (or :meth:`epoch_size` asked),
        unless the graph was defined otherwise (``pipeline_def``, or
        ``with pipe:`` with :meth:`set_outputs`).
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no graph: override define_graph() (DALI's legacy "
            "form), decorate a definition with @pipeline_def, or define it in `with pipe:` "
            "and call set_outputs()"
        )

    def _defined(self) -> Graph:
        """The graph, defined now if it is not yet: from an open ``with pipe:``, or
        :meth:`define_graph`."""
        if self._graph is not None:
            return self._graph
        if self._defining is not None and self._defining[0].outputs:
            # run() inside the `with pipe:` that defines it: the definition ends here.
            self._graph = self._defining[0]
        elif type(self).define_graph is not Pipeline.define_graph:
            self.define(self.define_graph)
        elif self._defining is not None:
            raise MpexecError(
                "this pipeline has no outputs yet: call pipe.set_outputs(...) inside "
                "`with pipe:` before building or running it"
            )
        else:
            raise MpexecError(
                "this pipeline has no graph: decorate its definition with "
                "@mpexec.pipeline_def, define it in `with pipe:` and call set_outputs(), "
                "or override define_graph()"
            )
        assert self._graph is not None
        self._graph.frozen = True
        return self._graph

    def set_outputs(self, *outputs: DataNode) -> None:
        """Name the pipeline's outputs, inside ``with pipe:`` (DALI style)."""
        if self._defining is None:
            raise MpexecError("set_outputs() belongs inside `with pipe:` of a new pipeline")
        graph = self._defining[0]
        graph.set_outputs(_scalar_outputs(outputs))

    def __enter__(self) -> Pipeline:
        if self._graph is None and self._defining is None:
            graph = self._new_graph()
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
            if exc_type is None and self._graph is None:
                self._graph = graph
            # Built inside the block (DALI lets run() be called there): it stays
            # open, as DALI's does, until close() or garbage collection.
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
            plan = self._defined().plan()
            if self._no_py_workers and any(op.parallel for op in plan.ops):
                # DALI's rule and words; num_workers=0 (mpexec's) runs them here instead.
                raise RuntimeError(
                    "The external source cannot run in parallel mode without Python workers "
                    "pool: py_num_workers=0 with external_source(parallel=True). Give "
                    "py_num_workers >= 1, or num_workers=0 (mpexec's) to run it here, in order"
                )
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
                if any(op.device == Device.GPU for op in plan.ops):
                    from ._executors import GpuExecutor
                    from ._gpu import require

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
        __tracebackhide__ = True  # an op's error is raised from here, for the caller
        self._check_not_forked()
        if self._scheduler is None or self._closed:
            self.build()  # (which raises once closed)
        assert self._scheduler is not None
        scheduler = self._scheduler
        before = scheduler.hand_outs  # (take_back: what was handed out since)
        try:
            try:
                result = scheduler.next_result()
            except StopIteration:
                self._exhausted = True  # until reset(): see __iter__
                raise
            except Exception as exc:
                if isinstance(pool := self._pool, WorkerPool):
                    # The caller must hold the error's last reference (its frames hold us).
                    pool.handed_out()
                # The op's exception, its traceback where it was raised (not the scheduler's).
                raise for_caller(exc)  # noqa: B904
            samples = len(result[0]) if result else 0
            if self._output_checks:
                check_outputs(result, self._output_checks)
        except KeyboardInterrupt as interrupt:
            # A Ctrl-C once the scheduler handed the batch (or its error: the exception
            # the interrupt came in) out, before run() gave it: the next run() hands it
            # out again, not the one after it.
            scheduler.take_back(interrupt.__context__, since=before)
            raise
        self._iterations += 1  # (no call from here to the return: see take_back)
        self._samples += samples
        return result

    def __iter__(self) -> Iterator[tuple[Batch, ...]]:
        """The iterations until a source ends the epoch; the next epoch needs :meth:`reset`.

        As in DALI. A ``for`` over a pipeline whose epoch ended, without
        ``reset()`` between, yields nothing: it warns (once per pipeline), as
        a loop written for PyTorch's DataLoader (which starts a new epoch at
        each ``for``) would otherwise get empty epochs without a word.
        """
        __tracebackhide__ = True
        if self._exhausted and not self._warned_exhausted:
            self._warned_exhausted = True
            warnings.warn(
                "this pipeline's epoch has ended: iterating it again yields nothing until "
                "pipe.reset() starts the next epoch (DALI's rule; a PyTorch DataLoader "
                "starts one at each `for`). Call pipe.reset() after each epoch",
                UserWarning,
                stacklevel=2,
            )
        while True:
            try:
                out = self.run()
            except StopIteration:
                return
            except Exception as exc:
                raise for_caller(exc)  # noqa: B904 - the same exception, as run() raised it
            yield out

    def epoch_size(self, name: str | None = None) -> Any:
        """Samples in one pass of a reader (DALI's ``epoch_size``), or of a sized source.

        ``name``: a reader's name (``fn.readers.file(name=...)``) or an
        ``external_source`` whose source has a length; None: a dict of every
        op that has one. Readers go round forever (as DALI's do): this is how
        many iterations make an epoch of them.
        """
        graph = self._defined()
        sizes = {op.name: n for op in graph.ops if (n := _epoch_size(op)) is not None}
        if name is None:
            return sizes
        if name not in sizes:
            known = [op.name for op in graph.ops]
            raise KeyError(
                f"no reader or sized source named {name!r} in this pipeline "
                f"(ops: {', '.join(known)}; with a known size: {', '.join(sizes) or 'none'})"
            )
        return sizes[name]

    def epoch_length(self) -> int | None:
        """Iterations in one epoch where every source that can end it has a ``len()``
        (samples, or batches), else None; a short last batch counts unless dropped."""
        return epoch_iterations(self._defined(), self.batch_size, self.last_batch == "drop")

    def declared_outputs(
        self,
    ) -> tuple[tuple[np.dtype[Any] | None, tuple[int | None, ...] | None], ...]:
        """Per output: the dtype and sample shape its op declares (``output_dtypes``,
        ``output_shapes``), each None where undeclared; ``mpexec.tf``'s ``element_spec``."""
        declared = []
        for node in self._defined().outputs:
            dtypes, shapes = node.op.output_dtypes, node.op.output_shapes
            dtype = None if dtypes is None else dtypes[node.index]
            declared.append((dtype, None if shapes is None else shapes[node.index]))
        return tuple(declared)

    @property
    def num_outputs(self) -> int:
        """How many batches :meth:`run` returns (the graph is defined now if not yet)."""
        return len(self._defined().outputs)

    @property
    def max_batch_size(self) -> int:
        """DALI's name for ``batch_size``."""
        return self.batch_size

    @property
    def num_threads(self) -> int:
        """DALI's name for the parallelism here: ``num_workers``."""
        return self.num_workers

    def start_py_workers(self) -> None:
        """DALI's early start of the Python workers (its recipe before forking): builds
        the pipeline, which starts its workers."""
        self.build()

    @property
    def _py_pool(self) -> Any:
        """DALI's handle on the workers (``pids()``, ``close()``), which DALI's tests
        read for their leak checks; None before ``build()`` and without workers."""
        pool = self._pool
        if not isinstance(pool, WorkerPool) or not pool.num_workers:
            return None
        from ._pypool import PyPool

        return PyPool(self, pool)

    def reset(self) -> None:
        """Start the next epoch: sources begin again from their start (iterables that do
        not cycle keep their place: one pass, as in DALI)."""
        self._check_not_forked()
        self._exhausted = False
        if self._scheduler is not None:
            self._scheduler.reset()

    # ------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands, as a small JSON-able dict for :meth:`load_state_dict`.

        ``epoch`` and ``iteration``: the epoch and how many of its iterations
        :meth:`run` returned; ``seed`` and ``batch_size``, which a resumed
        pipeline must share, and ``graph``, a fingerprint of the definition.
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
            "graph": self._graph.fingerprint() if self._graph is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where :meth:`state_dict` was taken, in this or another process.

        The next :meth:`run` returns exactly what an uninterrupted run returned
        after that point, iterations in flight dropped. Iterations depend only
        on (seed, op, epoch, iteration, sample), so nothing is recomputed;
        iterables read in this process (``external_source(source=iterable)``)
        are read again from their start up to there. A pipeline with
        ``stateful`` ops is refused: their state cannot be restored.

        Anything that did not come from :meth:`state_dict` of this same
        definition (another graph, edited fields) raises ``ValueError`` here.
        """
        keys = {"version", "seed", "batch_size", "epoch", "iteration", "graph"}
        given: Any = state  # what callers pass is not always what the annotation says
        if (
            not isinstance(given, dict)
            or given.get("version") != _STATE_VERSION
            or set(given) != keys
        ):
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
        mine = self._graph.fingerprint() if self._graph is not None else None
        if state["graph"] != mine:
            raise ValueError(
                "the state was taken from another pipeline definition (its graph fingerprint "
                f"{state['graph']!r} is not this one's, {mine!r}): its iterations would differ"
            )
        epoch, iteration = state.get("epoch"), state.get("iteration")
        if not all(type(v) is int and v >= 0 for v in (epoch, iteration)):  # not a bool
            raise ValueError(
                f"state epoch/iteration must be ints >= 0, not {epoch!r}/{iteration!r}"
            )
        # (A parallel iterable is stateful too, but its reader skips to the iteration.)
        stateful = [
            op.name
            for op in (self._graph.ops if self._graph else [])
            if op.stateful and not op.is_source
        ]
        if stateful:
            raise MpexecError(
                f"cannot resume a pipeline with stateful ops ({', '.join(stateful)}): "
                "their state lives in their functions and is not part of state_dict()"
            )
        at = (int(epoch), int(iteration))  # type: ignore[arg-type]
        self._exhausted = False
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

    def close(self, grace: float = CLOSE_GRACE) -> None:
        """Stop the workers and free what the pipeline holds; idempotent.

        Iterations in flight are dropped. A call still running in a worker
        gets ``grace`` seconds (default 5) to return; then its worker is
        stopped (SIGTERM, then SIGKILL a second later), so a function that
        never returns cannot hold ``close()`` (or leaving ``with``) up.
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
        if isinstance(pool, WorkerPool) and pool is not self._given_pool:  # the one we started
            pool.shutdown(wait=True, cancel_futures=True, grace=grace)
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
        if (pid := os.getpid()) == self._unforked_pid:
            return  # (its pool and GPU stage are fixed once built: ~7 calls a batch)
        owner = self._forked_from()
        if owner is not None:
            raise forked_error(owner, "this pipeline")
        if self._scheduler is not None:
            self._unforked_pid = pid

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
                samples=self._samples,
                worker_faults=sched.faults if sched is not None else 0,
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
            body = cloudpickle.dumps(payload, protocol=5)
        except Exception as exc:
            raise SerializationError(
                _codec.describe_unpicklable(self._graph, "the pipeline graph", exc)
            ) from exc
        finally:
            for m in modules:
                cloudpickle.unregister_pickle_by_value(m)
        digest = hashlib.sha256(body).digest()
        return _HEADER.pack(_MAGIC, _FORMAT, len(body), digest) + bytes(body)

    @classmethod
    def deserialize(cls, data: bytes, **overrides: Any) -> Pipeline:
        """A pipeline rebuilt from :meth:`serialize`; ``overrides`` change parameters.

        .. warning:: Deserializing runs code: the functions travel by value
           (pickled), and unpickling can run anything. Load only data you
           trust, as with ``pickle`` and ``torch.load``. The header (format,
           length, a SHA-256 of the rest) is checked first, so truncated,
           corrupted or foreign bytes are refused before anything is
           unpickled; it is no signature, and does not make untrusted data safe.
        """
        payload = cloudpickle.loads(_checked_body(data))
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


def _workers_from_dali(py_num_workers: int | None, num_threads: int | None) -> int:
    """Workers for DALI's arguments: ``py_num_workers``, else ``num_threads`` (capped)."""
    if py_num_workers is not None:
        return py_num_workers
    cpus = usable_cpus()
    if num_threads is not None and num_threads != -1:
        _check_int("num_threads", num_threads, 0)
        # DALI's threads share one process; a worker process more than the CPUs
        # only costs its start and its memory. 0: every call here (num_workers=0).
        return min(num_threads, cpus)
    return cpus


def _prefetch_from_dali(depth: int | dict[str, int] | None, pipelined: bool) -> int:
    """Iterations in flight for DALI's ``prefetch_queue_depth`` / ``exec_pipelined``."""
    if isinstance(depth, dict):  # DALI's separated queues: {"cpu_size": n, "gpu_size": m}
        return max(int(v) for v in depth.values())
    if depth is not None:
        return depth
    return 2 if pipelined else 1


def _output_checks(dtype: Any, ndim: Any) -> tuple[Any, Any] | None:
    """DALI's ``output_dtype``/``output_ndim``: one for all outputs, or one per output."""
    if dtype is None and ndim is None:
        return None
    from ._types import as_numpy_dtype

    if dtype is not None:
        items = dtype if isinstance(dtype, (list, tuple)) else [dtype]
        dtype = [None if d is None else as_numpy_dtype(d) for d in items]
    if ndim is not None:
        ndim = list(ndim) if isinstance(ndim, (list, tuple)) else [ndim]
    return dtype, ndim


def _epoch_size(op: Any) -> int | None:
    """A reader's pass, or a source's length where it has one; None where unknown."""
    size = getattr(op.function, "epoch_size", None)
    if isinstance(size, int):
        return size
    if op.kind != "external_source" or op.source_mode != "iter":
        return None
    source = op.function
    if not isinstance(source, (list, tuple)):
        return None
    if not op.batch_processing:
        return len(source)
    return sum(len(b[0] if op.num_outputs > 1 else b) for b in source)


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
    arguments. DALI's pipeline arguments are taken too (see :class:`Pipeline`),
    and ``enable_conditionals=True``: DALI's conditional execution (``if`` on
    a DataNode runs each branch on its own samples; docs/pipeline.md).
    """

    def decorate(graph_fn: Callable[..., Any]) -> Callable[..., Pipeline]:
        # The function's own parameters win over pipeline parameters of the same name
        # (DALI's rule: a definition taking `max_streams` gets it).
        own = _parameters(graph_fn)

        @functools.wraps(graph_fn)
        def create(*args: Any, **kwargs: Any) -> Pipeline:
            # An unknown pipeline parameter is an error when the pipeline is made (DALI).
            unknown = set(pipeline_kwargs) - _DEF_PARAMS
            if unknown:
                raise TypeError(f"pipeline_def got unknown pipeline parameters: {sorted(unknown)}")
            if _takes_var_keywords(graph_fn):
                # DALI's rule (and words): a keyword could be a pipeline option or not.
                raise TypeError(
                    f"{graph_fn.__name__}: **kwargs are not allowed in a pipeline_def "
                    "definition: name its parameters (pipeline options are keywords too)"
                )
            params = dict(pipeline_kwargs)
            for k in list(kwargs):
                if k in _DEF_PARAMS and k not in own:
                    params[k] = kwargs.pop(k)
            if "batch_size" not in params:
                raise TypeError(
                    f"{graph_fn.__name__}: give batch_size to pipeline_def or to the call"
                )
            pipe = Pipeline(**params)
            definition = _autograph.convert(graph_fn) if pipe.enable_conditionals else graph_fn
            pipe.define(lambda: definition(*args, **kwargs))
            return pipe

        setattr(create, "_is_pipeline_def", True)  # noqa: B010 - DALI's mark, which its code reads
        return create

    return decorate(fn) if fn is not None else decorate


# ---------------------------------------------------------------- helpers


def _parameters(function: Callable[..., Any]) -> frozenset[str]:
    """The names ``function`` takes as keywords (none where it cannot say)."""
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _takes_var_keywords(function: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD for p in params)


def _scalar_outputs(outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A ``types.Constant`` scalar returned as an output: a constant op's (DALI's too)."""
    if not any(isinstance(o, ScalarConstant) for o in outputs):
        return outputs
    from . import fn

    return tuple(
        fn.constant(fdata=o.value, dtype=o.dtype, shape=()) if isinstance(o, ScalarConstant) else o
        for o in outputs
    )


_SYSTEM_PATHS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _checked_body(data: bytes) -> memoryview:
    """The pickled body of :meth:`Pipeline.serialize`'s output, once its header checks out."""
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size or bytes(view[:8]) != _MAGIC:
        raise MpexecError(
            "not a serialized mpexec pipeline: it lacks the header serialize() writes"
        )
    _, version, length, digest = _HEADER.unpack_from(view)
    if version != _FORMAT:
        raise MpexecError(
            f"a serialized mpexec pipeline of format {version}; this version of mpexec reads "
            f"format {_FORMAT}: serialize it again with this version"
        )
    body = view[_HEADER.size :]
    if len(body) != length or hashlib.sha256(body).digest() != digest:
        raise MpexecError(
            f"a serialized mpexec pipeline, truncated or corrupted ({len(body)} bytes where "
            f"the header says {length}, or its SHA-256 does not match); nothing was unpickled"
        )
    return body


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
