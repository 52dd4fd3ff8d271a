"""Pipeline: the graph scheduler in the main process, and ``pipeline_def``.

::

    run() / iteration           main process                          workers
    ----------------           ------------                          -------
    launch iteration i   -->   sources here (iterables, batch        per-sample sources,
      (up to prefetch_depth      callables, feed_input) run in order   in chunks
      in flight)                                  |
                               all sources in: batch size known; an iteration enters
                               the compute phase only after every earlier one did
                                                  |
                               op ready (inputs in) --> chunks --> OpRunner(chunk, *inputs)
                                                  <-- future callback (pool manager thread)
                               outputs assembled; dependants dispatched
    run() returns i      <--   all outputs in: tuple of Batch

Arrays never pass through here by value: a result is a view of the worker's
arena, and handing it to the next op sends its descriptor on (forwarded,
zero-copy). Randomness depends only on (seed, op, epoch, iteration, sample),
so results do not depend on workers, chunking, prefetch or timing. Stateful
ops run in iteration order on one worker: each has a turn counter, and an
iteration's call waits for its turn.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import cloudpickle
import numpy as np

import shm

from . import _codec
from ._batch import Batch
from ._errors import MpexecError, PoolClosedError, SerializationError
from ._graph import DataNode, Graph, Op, Plan, defining
from ._pool import WorkerPool, usable_cpus
from ._runtime import (
    ChainRunner,
    Chunk,
    ChunkResult,
    OpRunner,
    check_consistent,
    derive_seed,
    is_string_array,
)

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
_FORMAT = 1  # of serialize()
_CHUNK_SECONDS = 0.05  # what a chunk of a slow op should take (see _chunk_count)
_MAX_CHUNKS_PER_WORKER = 4


@dataclass(frozen=True)
class OpStats:
    """What one op cost so far (per-sample ops: one call per sample)."""

    name: str
    calls: int
    samples: int
    function_s: float  # inside the function, summed over workers
    waiting_s: float  # dispatched but not inside the function: queues, transport
    bytes_in: int
    bytes_out: int
    bytes_copied: int  # input bytes copied into shared memory (0 when zero-copy)


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


class _OpState:
    """An op's runtime: its runner, turn counter, source state and counters."""

    def __init__(self, op: Op, pos: int, runner: OpRunner | None, worker: int | None) -> None:
        self.op = op
        self.pos = pos
        self.runner: OpRunner | ChainRunner | None = runner
        self.inputs = op.inputs  # of the chain's head, when ops are chained into this one
        self.members = [self]  # the chain this op ends (itself alone if none)
        self.absorbed = False  # runs inside a later op's chain
        self.worker = worker  # pinned worker index (stateful ops)
        self.turn = 0  # stateful: the compute sequence number allowed next
        self.skipped: set[int] = set()
        self.iterator: Iterator[Any] | None = None
        self.fed: collections.deque[list[tuple[Any, ...]]] = collections.deque()
        self.calls = self.samples = 0
        self.function_s = self.waiting_s = 0.0
        self.bytes_in = self.bytes_out = self.bytes_copied = 0

    @property
    def source(self) -> bool:
        """This op, or the head of the chain it ends, is a source."""
        return self.members[0].op.is_source

    def stats(self) -> OpStats:
        return OpStats(
            self.op.name,
            self.calls,
            self.samples,
            self.function_s,
            self.waiting_s,
            self.bytes_in,
            self.bytes_out,
            self.bytes_copied,
        )


class _Iteration:
    """One iteration in flight."""

    def __init__(self, epoch: int, index: int, batch_size: int, n_ops: int) -> None:
        self.epoch = epoch
        self.index = index
        self.epoch_start = index * batch_size
        self.seq = -1  # compute-phase sequence number, once there
        self.size = batch_size
        self.stop: int | None = None  # a source raised StopIteration at this sample
        self.values: list[tuple[list[Any], ...] | None] = [None] * n_ops
        self.parts: dict[int, list[ChunkResult | None]] = {}
        self.dispatched: set[int] = set()
        self.sources_left = 0
        self.ops_left = 0
        self.error: BaseException | None = None
        self.dropped = False
        self.result: tuple[Batch, ...] | None = None
        self.done = threading.Event()

    @property
    def computing(self) -> bool:
        return self.seq >= 0


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
    - ``device_id``: the CUDA device of GPU ops (reserved; CPU ops ignore it).
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
    ) -> None:
        _check_int("batch_size", batch_size, 1)
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
        self._pool: WorkerPool | None = None
        self._ops: list[_OpState] = []
        self._lock = threading.RLock()
        self._window: collections.deque[_Iteration] = collections.deque()
        self._epoch = 0
        self._next_index = 0
        self._next_seq = 0
        self._ending = False  # a source ended this epoch: launch no more
        self._closed = False
        self._iterations = 0
        self._started = 0.0
        self._busy: dict[int, float] = collections.defaultdict(float)
        self._finalizer: weakref.finalize[Any, Pipeline] | None = None

    # ------------------------------------------------------------ defining
    def _params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _PARAMS}

    def define(self, graph_fn: Callable[[], Any]) -> None:
        """Define the graph by calling ``graph_fn`` (what ``pipeline_def`` does)."""
        if self._graph is not None:
            raise MpexecError("this pipeline is already defined")
        graph = Graph()
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
        with self._lock:
            if self._closed:
                raise PoolClosedError("this pipeline is closed")
            if self._pool is not None:
                return
            if self._graph is None:
                raise MpexecError(
                    "this pipeline has no graph: decorate its definition with "
                    "@mpexec.pipeline_def, or define it in `with pipe:` and call set_outputs()"
                )
            plan = self._graph.plan()
            pos = {id(op): i for i, op in enumerate(plan.ops)}
            self._pos = pos
            n_stateful = 0
            for i, op in enumerate(plan.ops):
                runner = None
                if not op.is_source or op.source_mode == "sample":
                    kind = (
                        "source" if op.is_source else "batch" if op.batch_processing else "sample"
                    )
                    runner = OpRunner(
                        op.name,
                        op.function,
                        kind,
                        op.num_outputs,
                        derive_seed(self.seed, op.index, op.seed),
                        op.output_dtypes,
                        op.output_shapes,
                        op.dlpack,
                        self.debug,
                    )
                worker = None
                if op.stateful:
                    worker = n_stateful % max(1, self.num_workers)
                    n_stateful += 1
                self._ops.append(_OpState(op, i, runner, worker))
            self._consumers = [
                sorted({pos[id(c)] for c in plan.ops if any(n.op is op for n in c.inputs)})
                for op in plan.ops
            ]
            self._plan = plan
            self._chain(plan)
            self._pool = WorkerPool(
                self.num_workers,
                start_method=self.start_method,
                seed=self.seed,
                timeout=self.timeout,
            )
            self._pool._keep_results_shared()
            self._started = time.perf_counter()
            self._finalizer = weakref.finalize(self, _close_pool, self._pool)

    def _chain(self, plan: Plan) -> None:
        """Run per-sample ops that only feed the next one inside its call."""
        outputs = {self._pos[id(n.op)] for n in plan.outputs}

        def chainable(s: _OpState) -> bool:
            op = s.op
            return not (op.is_source or op.batch_processing or op.stateful) and s.runner is not None

        for s in self._ops:
            if not chainable(s) or not s.op.inputs or s.op.num_outputs == 0:
                continue
            producers = {id(n.op) for n in s.op.inputs}
            if len(producers) != 1:
                continue
            p = self._ops[self._pos[id(s.op.inputs[0].op)]]
            # A per-sample source in the workers may head a chain too: its ops
            # then run before the batch size is known, on samples a StopIteration
            # may drop (they are stateless: the waste is one partial chunk).
            head_ok = chainable(p) or p.op.source_mode == "sample"
            if (
                head_ok
                and self._consumers[p.pos] == [s.pos]
                and p.pos not in outputs
                and not (p.op.is_source and len(s.op.inputs) != p.op.num_outputs)
            ):
                s.members = [*p.members, s]
                s.inputs = p.inputs
                for m in p.members:
                    m.absorbed = True
        for s in self._ops:
            if len(s.members) > 1 and not s.absorbed:
                picks = [tuple(n.index for n in m.op.inputs) for m in s.members]
                s.runner = ChainRunner([m.runner for m in s.members], picks)  # type: ignore[misc]

    # ------------------------------------------------------------ running
    def run(self) -> tuple[Batch, ...]:
        """The next iteration: one :class:`Batch` per output.

        Raises StopIteration when a source has ended the epoch (then
        :meth:`reset`), and re-raises an op's exception for the iteration it
        broke (later iterations go on).
        """
        self.build()
        with self._lock:
            self._fill()
            if not self._window:
                if self._ending:
                    raise StopIteration
                fed = [s.op.name for s in self._ops if s.op.source_mode == "feed" and not s.fed]
                raise MpexecError(
                    f"external_source {', '.join(map(repr, fed))} has no data for the next "
                    "iteration: call pipe.feed_input(name, batch) before run()"
                )
            it = self._window[0]
        while not it.done.wait(1.0):
            if self._closed:
                raise PoolClosedError("the pipeline was closed while waiting for an iteration")
        with self._lock:
            if self._window and self._window[0] is it:
                self._window.popleft()
            self._fill()
        if it.error is not None:
            raise it.error
        if it.result is None:
            raise StopIteration
        self._iterations += 1
        return it.result

    def __iter__(self) -> Iterator[tuple[Batch, ...]]:
        while True:
            try:
                out = self.run()
            except StopIteration:
                return
            yield out

    def reset(self) -> None:
        """Start the next epoch: sources begin again from their start."""
        with self._lock:
            while self._window:
                self._drop(self._window.popleft())
            self._epoch += 1
            self._next_index = 0
            self._ending = False
            for s in self._ops:
                s.iterator = None

    def feed_input(self, name: str, data: Any, layout: str | None = None) -> None:
        """Give the external_source ``name`` (with no ``source``) its next batch.

        ``data``: a list of per-sample arrays, or one array whose first axis
        is the batch (for a source with ``num_outputs`` > 1, a tuple of those).
        """
        del layout
        self.build()
        with self._lock:
            state = next((s for s in self._ops if s.op.name == name), None)
            if state is None or state.op.source_mode != "feed":
                names = [s.op.name for s in self._ops if s.op.source_mode == "feed"]
                raise KeyError(
                    f"no external_source named {name!r} takes feed_input "
                    f"(those that do: {names or 'none'})"
                )
            rows = _batch_samples(state.op, data, self.batch_size)
            columns = self._own(state, tuple(list(c) for c in zip(*rows, strict=True)))
            state.fed.append(list(zip(*columns, strict=True)))

    def close(self) -> None:
        """Stop the workers and free what the pipeline holds; idempotent.

        Batches already returned stay valid for as long as they are held.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._window:
                self._drop(self._window.popleft())
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if self._finalizer is not None:
            self._finalizer.detach()

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> PipelineStats:
        """Per op: calls, time in the function and waiting, bytes; per worker: busy."""
        with self._lock:
            wall = time.perf_counter() - self._started if self._started else 0.0
            n_defined = len(self._graph.ops) if self._graph is not None else 0
            merged = self._plan.merged if self._plan is not None else 0
            return PipelineStats(
                iterations=self._iterations,
                wall_s=wall,
                ops=tuple(s.stats() for s in self._ops),
                busy=tuple((pid, t / wall if wall else 0.0) for pid, t in self._busy.items()),
                merged_ops=merged,
                pruned_ops=n_defined - len(self._ops) - merged,
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
        unknown = set(overrides) - set(_PARAMS)
        if unknown:
            raise TypeError(f"unknown pipeline parameters: {sorted(unknown)}")
        pipe = cls(**{**payload["params"], **overrides})
        pipe._graph = payload["graph"]
        return pipe

    # ------------------------------------------------------------ scheduling
    def _fill(self) -> None:
        while len(self._window) < self.prefetch_depth and not self._ending and not self._closed:
            if not self._launch():
                return

    def _launch(self) -> bool:
        """Start the next iteration: run the sources here, dispatch those in workers."""
        if any(s.op.source_mode == "feed" and not s.fed for s in self._ops):
            return False
        it = _Iteration(self._epoch, self._next_index, self.batch_size, len(self._ops))
        self._next_index += 1
        self._window.append(it)
        sources = [s for s in self._ops if s.source and not s.absorbed]
        it.sources_left = len(sources)
        here = [s for s in sources if s.runner is None]
        for s in here:
            try:
                samples = self._pull(s, it)
            except Exception as exc:
                self._fail(it, _annotate(exc, s.op, it, None))
                return True
            # Fed batches were copied when fed: the caller may reuse its arrays.
            it.values[s.pos] = samples if s.op.source_mode == "feed" else self._own(s, samples)
            n = len(samples[0])
            if n < self.batch_size and s.op.source_mode == "iter" and not s.op.batch_processing:
                it.stop = n if it.stop is None else min(it.stop, n)
            it.size = min(it.size, n)
            it.sources_left -= 1
        for s in sources:
            if s.runner is not None:
                self._dispatch(it, s)
        if it.sources_left == 0:
            self._sources_in(it)
        return True

    def _pull(self, s: _OpState, it: _Iteration) -> tuple[list[Any], ...]:
        """A batch from a source that runs here; ([], ...) when it ended the epoch."""
        op = s.op
        if op.source_mode == "feed":
            rows = s.fed.popleft()
        elif op.source_mode == "batch":
            try:
                rows = _batch_samples(op, op.function(it.index, it.epoch), self.batch_size)
            except StopIteration:
                rows = []
        elif op.batch_processing:
            item = self._next_item(s)
            rows = [] if item is None else _batch_samples(op, item, self.batch_size)
        else:
            rows = []
            while len(rows) < self.batch_size:
                item = self._next_item(s)
                if item is None:
                    break
                rows.append(_sample_tuple(op, item))
        for row in rows:
            for i, a in enumerate(row):
                _check_source_value(op, i, a)
        columns = tuple([row[i] for row in rows] for i in range(op.num_outputs))
        if not rows:
            it.stop = 0
        return columns

    def _own(self, s: _OpState, columns: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
        """Copies of a source's arrays (into shared memory), read-only.

        The source, or the caller of feed_input, may refill its buffers at
        once (as DALI's external_source allows: it copies too); this one copy
        is where data enters the pipeline.
        """
        pool = self._pool
        out = []
        for col in columns:
            own = []
            for a in col:
                if self.num_workers and pool is not None and not a.dtype.hasobject and a.nbytes:
                    c = pool._copy_in(a)
                    s.bytes_copied += a.nbytes
                else:
                    c = np.array(a, copy=True)
                c.flags.writeable = False
                own.append(c)
            out.append(own)
        return tuple(out)

    def _next_item(self, s: _OpState) -> Any:
        op = s.op
        for attempt in range(2):
            if s.iterator is None:
                src = op.function() if callable(op.function) else op.function
                s.iterator = iter(src)
            try:
                return next(s.iterator)
            except StopIteration:
                s.iterator = None
                if not op.cycle or op.cycle == "raise" or attempt:
                    return None
        return None  # pragma: no cover

    def _sources_in(self, it: _Iteration) -> None:
        """Every source of ``it`` has delivered: let iterations compute, in order."""
        del it
        for it in list(self._window):
            if it.computing or it.dropped:
                continue
            if it.sources_left > 0 and it.error is None:
                return  # later iterations wait for this one: order of epoch ends
            if it.error is not None:
                continue
            size = it.size if it.stop is None else min(it.size, it.stop)
            if it.stop is not None:
                self._ending = True
                for later in [x for x in self._window if x.index > it.index]:
                    self._window.remove(later)
                    self._drop(later)
                if size == 0 or (size < self.batch_size and self.last_batch == "drop"):
                    it.result = None
                    it.done.set()
                    return
            it.size = size
            it.seq = self._next_seq
            self._next_seq += 1
            for s in self._ops:
                if s.source and not s.absorbed:
                    vals = it.values[s.pos]
                    assert vals is not None
                    it.values[s.pos] = tuple(v[:size] for v in vals)
            it.ops_left = sum(1 for s in self._ops if not (s.source or s.absorbed))
            if it.ops_left == 0:
                self._finish(it)
            else:
                self._dispatch_ready(it)

    def _dispatch_ready(self, it: _Iteration) -> None:
        for s in self._ops:
            if it.error is not None or it.dropped:
                return
            if s.source or s.absorbed or s.pos in it.dispatched:
                continue
            if any(it.values[self._pos[id(n.op)]] is None for n in s.inputs):
                continue
            if s.worker is not None and s.turn != it.seq:
                continue  # a stateful op: an earlier iteration goes first
            self._dispatch(it, s)
            if s.worker is not None:
                self._advance_turn(s)

    def _advance_turn(self, s: _OpState) -> None:
        s.turn += 1
        while s.turn in s.skipped:
            s.skipped.discard(s.turn)
            s.turn += 1
        for other in list(self._window):
            if other.seq == s.turn:
                self._dispatch_ready(other)

    def _dispatch(self, it: _Iteration, s: _OpState) -> None:
        """Send op ``s`` of iteration ``it`` to the workers, in chunks."""
        it.dispatched.add(s.pos)
        op, pool = s.op, self._pool
        assert pool is not None
        assert s.runner is not None
        inputs = []
        for n in s.inputs:
            vals = it.values[self._pos[id(n.op)]]
            assert vals is not None
            inputs.append(vals[n.index])
        chained = len(s.members) > 1  # the chain counts its ops' bytes itself
        for column in inputs:
            for a in column:
                if not chained:
                    s.bytes_in += a.nbytes
                if (
                    self.num_workers
                    and a.nbytes > _codec.INLINE_MAX
                    and not shm.in_shared_memory(a)
                ):
                    s.bytes_copied += a.nbytes
        size = it.size
        if op.batch_processing or op.stateful or self.num_workers <= 1:
            bounds = [(0, size)]
        else:
            k = self._chunk_count(s, size)
            edges = [size * j // k for j in range(k + 1)]
            bounds = [(edges[j], edges[j + 1]) for j in range(k)]
        it.parts[s.pos] = [None] * len(bounds)
        submit = pool._submit
        for ci, (a, b) in enumerate(bounds):
            chunk = Chunk(it.epoch, it.index, a, b - a, it.epoch_start)
            args = (chunk, *[col[a:b] for col in inputs])
            t0 = time.perf_counter()
            try:
                future = submit(s.runner, args, {}, s.worker)
            except Exception as exc:
                self._fail(it, _annotate(exc, op, it, None))
                return
            future.add_done_callback(functools.partial(self._on_chunk, it, s, ci, t0))

    def _chunk_count(self, s: _OpState, size: int) -> int:
        """One chunk per worker, or a few each where samples are slow.

        The workers finish an iteration together only if its chunks take them
        equally long; a worker slowed down (by the consumer, by other load)
        leaves the others idle at the end of each epoch, for up to a chunk.
        Smaller chunks shorten that tail, and cost a round trip each (under a
        millisecond), so an op is cut into chunks of about ``_CHUNK_SECONDS``,
        judged by what its calls took so far.
        """
        workers = self.num_workers
        samples = s.members[-1].samples
        if not samples:
            return max(1, min(size, workers))
        per_sample = sum(m.function_s for m in s.members) / samples
        per_worker = round(size * per_sample / workers / _CHUNK_SECONDS)
        return max(1, min(size, workers * max(1, min(_MAX_CHUNKS_PER_WORKER, per_worker))))

    def _on_chunk(
        self, it: _Iteration, s: _OpState, ci: int, t0: float, future: Future[Any]
    ) -> None:
        """A chunk came back (in the pool's manager thread, or inline)."""
        elapsed = time.perf_counter() - t0
        with self._lock:
            try:
                self._chunk_in(it, s, ci, elapsed, future)
            except Exception as exc:  # a bug here must not hang run()
                self._fail(it, exc)

    def _chunk_in(
        self, it: _Iteration, s: _OpState, ci: int, elapsed: float, future: Future[Any]
    ) -> None:
        if future.cancelled():
            self._fail(it, PoolClosedError("the pipeline was closed"))
            return
        exc = future.exception()
        if exc is not None:
            name = getattr(exc, "mpexec_op", None)
            op = next((m.op for m in s.members if m.op.name == name), s.op)
            self._fail(it, _annotate(exc, op, it, getattr(exc, "mpexec_sample", None)))
            return
        res: ChunkResult = future.result()
        batch = s.op.batch_processing
        per_op = res.per_op or ((res.seconds, 0, 0),)
        for m, (spent, b_in, b_out) in zip(s.members, per_op, strict=True):
            m.calls += 1 if batch else len(res.outputs)
            m.samples += it.size if batch else len(res.outputs)
            m.function_s += spent
            m.bytes_in += b_in
            m.bytes_out += b_out
        s.waiting_s += max(0.0, elapsed - res.seconds)
        self._busy[res.pid] += res.seconds
        if it.dropped or it.error is not None:
            return
        parts = it.parts[s.pos]
        parts[ci] = res
        if any(p is None for p in parts):
            return
        del it.parts[s.pos]
        columns = self._assemble(s, parts)  # type: ignore[arg-type]
        if len(s.members) == 1:
            for col in columns:
                for a in col:
                    s.bytes_out += a.nbytes
        it.values[s.pos] = columns
        if s.source:
            stops = [p.stop for p in parts if p is not None and p.stop is not None]
            if stops:
                it.stop = min(stops) if it.stop is None else min(it.stop, *stops)
            it.size = min(it.size, len(columns[0]))
            it.sources_left -= 1
            if it.sources_left == 0:
                self._sources_in(it)
            return
        it.ops_left -= 1
        if it.ops_left == 0:
            self._finish(it)
        else:
            self._dispatch_ready(it)

    def _assemble(self, s: _OpState, parts: list[ChunkResult]) -> tuple[list[Any], ...]:
        n = s.op.num_outputs
        if s.op.batch_processing:
            columns = tuple(list(parts[0].outputs[i]) for i in range(n))
        else:
            rows: list[tuple[Any, ...]] = []
            for p in parts:
                rows.extend(p.outputs)
                if p.stop is not None:
                    break  # samples past a source's end are not in the epoch
            columns = tuple([r[i] for r in rows] for i in range(n))
        inline = self.num_workers == 0
        for i, col in enumerate(columns):
            if inline:
                # Here the function's own arrays: it may keep and reuse them.
                col[:] = [np.array(a, copy=True) for a in col]
            for a in col:
                a.flags.writeable = False
            check_consistent(s.op.describe(), i, col)
        return columns

    def _finish(self, it: _Iteration) -> None:
        plan = self._plan
        assert plan is not None
        out = []
        for n in plan.outputs:
            vals = it.values[self._pos[id(n.op)]]
            assert vals is not None
            out.append(Batch(vals[n.index], n.op.output_layouts[n.index]))
        it.result = tuple(out)
        it.values = []
        it.done.set()

    def _fail(self, it: _Iteration, exc: BaseException) -> None:
        if it.error is None and not it.dropped:
            it.error = exc
        self._abandon(it)
        it.done.set()
        if not it.computing:
            # Its sources will not all come in: later iterations must not wait.
            self._sources_in(it)

    def _drop(self, it: _Iteration) -> None:
        it.dropped = True
        self._abandon(it)
        it.done.set()

    def _abandon(self, it: _Iteration) -> None:
        """Stateful ops this iteration will not call give up their turn."""
        it.values = [None] * len(self._ops)
        if not it.computing:
            return
        for s in self._ops:
            if s.worker is not None and s.pos not in it.dispatched:
                it.dispatched.add(s.pos)
                if s.turn == it.seq:
                    self._advance_turn(s)
                else:
                    s.skipped.add(it.seq)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self._pool else "not built"
        return (
            f"Pipeline(batch_size={self.batch_size}, num_workers={self.num_workers}, "
            f"seed={self.seed}, prefetch_depth={self.prefetch_depth}, {state})"
        )


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, not {value!r}")


def _close_pool(pool: WorkerPool) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


def pipeline_def(fn: Callable[..., Any] | None = None, **pipeline_kwargs: Any) -> Any:
    """Decorate a graph definition; calling it returns a defined :class:`Pipeline`.

    ``@pipeline_def(batch_size=64, num_workers=4, seed=42)``; the decorated
    function may also be given pipeline parameters when called
    (``augment(batch_size=8)``), and its own arguments.
    """
    unknown = set(pipeline_kwargs) - set(_PARAMS)
    if unknown:
        raise TypeError(f"pipeline_def got unknown pipeline parameters: {sorted(unknown)}")

    def decorate(graph_fn: Callable[..., Any]) -> Callable[..., Pipeline]:
        @functools.wraps(graph_fn)
        def create(*args: Any, **kwargs: Any) -> Pipeline:
            params = dict(pipeline_kwargs)
            for k in list(kwargs):
                if k in _PARAMS:
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


def _annotate(exc: BaseException, op: Op, it: _Iteration, sample: int | None) -> BaseException:
    where = f"in {op.describe()}, iteration {it.index} of epoch {it.epoch}"
    if sample is not None:
        where += f", sample {sample} (index {it.epoch_start + sample} in the epoch)"
    note = f"mpexec: raised {where}"
    notes = getattr(exc, "__notes__", None)
    if notes is None or note not in notes:
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # pragma: no cover - Python 3.10
            exc.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]
    for attr, value in (("mpexec_op", op.name), ("mpexec_iteration", it.index)):
        with contextlib.suppress(AttributeError):  # exceptions with __slots__
            setattr(exc, attr, value)
    return exc


def _sample_tuple(op: Op, item: Any) -> tuple[Any, ...]:
    if op.num_outputs == 1:
        return (np.asarray(item),)
    if not isinstance(item, (tuple, list)) or len(item) != op.num_outputs:
        raise ValueError(
            f"{op.describe()} has num_outputs={op.num_outputs}: each item of its source "
            f"must be a tuple of {op.num_outputs} arrays"
        )
    return tuple(np.asarray(v) for v in item)


def _batch_samples(op: Op, data: Any, batch_size: int) -> list[tuple[Any, ...]]:
    """Rows (one tuple of arrays per sample) of a batch a source gave."""
    outs = [data] if op.num_outputs == 1 else data
    if op.num_outputs > 1 and (not isinstance(outs, (tuple, list)) or len(outs) != op.num_outputs):
        raise ValueError(
            f"{op.describe()} has num_outputs={op.num_outputs}: its source must give a "
            f"tuple of {op.num_outputs} batches"
        )
    columns = []
    for out in outs:
        if isinstance(out, np.ndarray) or hasattr(out, "__array_interface__"):
            arr = np.asarray(out)
            if arr.ndim == 0:
                raise ValueError(f"{op.describe()} gave a 0-d array where a batch belongs")
            columns.append(list(arr))
        elif isinstance(out, (list, tuple)):
            columns.append([np.asarray(v) for v in out])
        else:
            raise TypeError(
                f"{op.describe()}: a batch is a list of arrays or one array whose first "
                f"axis is the batch, not {type(out).__name__}"
            )
    n = len(columns[0])
    if any(len(c) != n for c in columns):
        raise ValueError(f"{op.describe()}: its outputs hold different numbers of samples")
    if n > batch_size:
        raise ValueError(
            f"{op.describe()} gave a batch of {n} samples; the pipeline's batch_size is "
            f"{batch_size}"
        )
    return list(zip(*columns, strict=True))


def _check_source_value(op: Op, i: int, a: Any) -> None:
    if a.dtype.hasobject and not is_string_array(a):
        raise TypeError(
            f"{op.describe()}: output {i} is an array of Python objects; sources give "
            "numeric arrays, or arrays of strings (bytes or str)"
        )
    dts = op.output_dtypes
    if dts is not None and dts[i] is not None and a.dtype != dts[i]:
        raise TypeError(f"{op.describe()}: output {i} is {a.dtype}, but dtype={dts[i]}")
    shape = op.output_shapes[i] if op.output_shapes is not None else None
    if shape is not None and a.ndim != len(shape):
        raise ValueError(f"{op.describe()}: output {i} has rank {a.ndim}, but ndim={len(shape)}")


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
