"""Executors: what runs the scheduler's units of work, behind one protocol.

::

    Scheduler                 UnitExecutor                      where the unit runs
    ---------                 ------------                      -------------------
    WorkUnit (a chunk    -->  PoolExecutor.submit_unit   -->    WorkerPool.submit_call
      through an op or          (LocalPoolExecutor: also          (view=True): a worker;
      a fused chain)            ``empty``, the batch's            RayPool: a node's pool;
                                dense blocks)                     num_workers=0: here
                          -->  GpuExecutor.submit_unit   -->    the GPU thread: H2D copy,
                                                                  the op on its stream
    Future[ChunkResult]  <--  completed on the pool's manager thread, or the GPU thread
    a GPU op's column    -->  GpuExecutor.handoff        -->    queued on the GPU thread:
      for a CPU op              Future[host column]               D2H into the CPU
                                                                  executor's shared memory

    who owns what: an executor owns nothing of the pool's (the pipeline owns
    the pool and the GPU executor; a pool given with ``pool=`` stays its
    owner's). The GPU executor owns its thread, its stage (streams, staging,
    registrations) and the events of the ops it ran.

The unit of work is a :class:`WorkUnit`: one chunk (samples ``start ..
start+count`` of one iteration) through one op, or through a chain of
per-sample ops fused into one call (``_runtime.ChainRunner``), or the whole
batch through a per-sample source's chain and the batch op it feeds
(``_source_runners.SourceBatchRunner``), given the chunk's rows of each input column.
``unit.runner(unit.chunk, *unit.inputs)`` (what ``unit.run()`` does) is the
whole computation, the same in any process: seeding, ``SampleInfo``, calls,
output checks. It returns a ``ChunkResult`` (outputs, seconds, pid, where a
source stopped).

A :class:`UnitExecutor` is anything that runs units and returns futures:

- ``workers``: how many units it runs at once (the scheduler cuts an op into
  about that many chunks); ``0`` means it runs them in the caller, at once.
- ``submit_unit(unit)``: a ``Future[ChunkResult]``; raising here fails the
  iteration. The future's callback may run in any thread. An executor that
  ships units elsewhere sends each runner once and keeps it there (by
  identity, as WorkerPool does): a stateful op's state lives in its runner.
  A unit with ``worker`` set (a stateful op) must run after that index's
  earlier units, in submission order.
- ``share(array)``: a read-only copy of a source's array that later units can
  take as input cheaply (the one copy where data enters the pipeline).
- ``shutdown(wait, cancel_futures)``: stop (its owner calls it, not the
  scheduler); pending futures are cancelled.

and may offer (the scheduler looks for each once per op; without it, the
default said here):

- ``empty(shape, dtype)``: a writable array its units can write to. Where an
  executor has it, an output whose samples share one shape and dtype
  (declared by ``output_shapes``/``output_dtypes``, or learned from an
  earlier batch) is one block per batch: each unit gets its rows of it as
  ``unit.out`` and fills them (an executor that runs units elsewhere copies
  the rows back into ``unit.out`` before it completes the future). The
  batch's column is then the block itself: one allocation and one
  descriptor, not one per sample. A chunk whose samples do not fit returns
  its arrays, and that batch is assembled from them instead. Default: none.
- ``runner(op, entropy, *, debug)``: what its units of ``op`` run. Default:
  :func:`op_runner`, an ``OpRunner`` (host arrays in, host arrays out).
- ``copied_bytes(column)``: how many bytes of a unit's input column it copies
  to reach its units (an op's ``bytes_copied``). Default: 0.
- ``handoff(column, producer, consumer)``: a ``Future`` of output ``column``
  of op ``producer`` made readable by the units of executor ``consumer``.
  Default: host arrays, which every executor reads as they are.
- ``columns(parts, num_outputs, what)``: an op's columns from its chunks'
  results, checked, where its outputs are not host arrays. Default: the
  scheduler's assembly (blocks, or lists of read-only host arrays).
- ``batch(samples, layout, producer)``: an output ``Batch``. Default:
  ``Batch(samples, layout)``.

:class:`PoolExecutor` adapts a pool (a ``WorkerPool`` or a ``RayPool``;
:class:`LocalPoolExecutor` adds ``empty`` for a local one);
:class:`GpuExecutor` runs ``device="gpu"`` ops on the GPU thread. Each op's
executor is picked once, by its device; a chain never spans two executors.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

import shm

from . import _codec
from ._errors import GpuError, forked_error
from ._grouping import FanOut
from ._modes import CallKind, Reseed, SourceMode
from ._pool import WorkerPool
from ._runtime import (
    ChainRunner,
    Chunk,
    ChunkResult,
    Chunks,
    ManyRunner,
    OpRunner,
    check_consistent,
)
from ._source_runners import SourceBatchRunner, WorkerBatchSource

if TYPE_CHECKING:
    from ._gpu import GpuBatch, GpuOpRunner
    from ._graph import Op


@dataclass(slots=True)  # (not frozen: a frozen init costs an object.__setattr__ a field)
class WorkUnit:
    """One chunk of an iteration's samples through an op (or a fused chain of ops).

    ``runner(chunk, *inputs)`` computes it; ``inputs`` holds, per input column
    of the chain's head, the chunk's rows (read-only arrays). ``worker`` pins
    the unit to one worker index (stateful ops), else None. ``ops`` names the
    ops it runs, head first. ``out`` (empty, or one entry per output of the
    last op): a writable array of ``chunk.count`` rows in the batch's block
    (from the executor's ``empty``), which the unit fills where its samples
    fit; the result says which outputs it wrote (``ChunkResult.written``).
    """

    runner: OpRunner | ChainRunner | SourceBatchRunner  # or a GPU op's GpuOpRunner
    chunk: Chunk
    inputs: tuple[Sequence[Any], ...]
    worker: int | None = None
    ops: tuple[str, ...] = ()
    out: tuple[Any, ...] = ()  # per output: rows of the batch's block to write, or None

    def run(self) -> ChunkResult:
        """Compute the unit here (what an executor's worker does with it)."""
        return self.runner(self.chunk, *self.inputs, out=self.out)


class UnitExecutor(Protocol):
    """Something that runs :class:`WorkUnit` s and returns futures (see the module doc)."""

    @property
    def workers(self) -> int: ...

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]: ...

    def share(self, array: Any) -> Any: ...

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None: ...


def op_runner(
    op: Op, entropy: int, *, debug: bool, timed: bool = False
) -> OpRunner | WorkerBatchSource:
    """The runner of a host op ``op``: its function, declaration and seed.

    ``timed``: its calls run under a timeout, so none may run twice (a call
    run again could take twice the time allowed, on every replacement worker).
    A batch-mode source run in the workers gets a :class:`WorkerBatchSource`.
    """
    if op.source_mode in (SourceMode.WORKER_BATCH, SourceMode.WORKER_ITER):
        return WorkerBatchSource(
            op.name,
            op.function,
            op.num_outputs,
            entropy,
            iterable=op.source_mode is SourceMode.WORKER_ITER,
            cycle=op.cycle,
            output_dtypes=op.output_dtypes,
            output_shapes=op.output_shapes,
        )
    kind = (
        CallKind.SOURCE
        if op.is_source
        else CallKind.BATCH
        if op.batch_processing
        else CallKind.SAMPLE
    )
    return OpRunner(
        op.name,
        op.function,
        kind,
        op.num_outputs,
        entropy,
        op.output_dtypes,
        op.output_shapes,
        op.dlpack,
        debug,
        repeatable=not (
            op.stateful or op.preserve or op.num_outputs == 0 or op.reseed is Reseed.ALWAYS or timed
        ),
    )


# ---------------------------------------------------------------- pools


class CallPool(Protocol):
    """What :class:`PoolExecutor` needs of a pool: a :class:`WorkerPool` or a ``RayPool``.

    Their public low-level seam (docs/pool.md, "Building on the pool").
    """

    @property
    def num_workers(self) -> int: ...

    def submit_call(
        self,
        fn: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        worker: int | None = None,
        view: bool = False,
    ) -> Future[Any]: ...

    def share(self, array: Any) -> Any: ...

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None: ...


class PoolExecutor:
    """The :class:`UnitExecutor` over a pool (:class:`CallPool`): units as pool calls.

    The runner travels once per worker (the pool caches functions by
    identity); a unit's input rows travel as descriptors of shared memory
    (within a node, for a ``RayPool``; through Ray's object store between
    nodes). Results come back uncopied (``view=True``), so a pool the
    pipeline does not own keeps its promise to its other callers.
    """

    def __init__(self, pool: CallPool) -> None:
        self.pool = pool
        self.workers = pool.num_workers
        # id(block) -> a Writable of it with its descriptor, made when it was cut (empty)
        self._described: dict[int, Any] = {}

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        return self.pool.submit_call(
            unit.runner,
            (unit.chunk, *unit.inputs),
            _out(unit, self._described),
            worker=unit.worker,
            view=True,
        )

    def runner(self, op: Op, entropy: int, *, debug: bool) -> OpRunner | WorkerBatchSource:
        # A pool with a timeout (a RayPool's nodes' too) never runs a call twice.
        timed = getattr(self.pool, "timeout", None) is not None
        return op_runner(op, entropy, debug=debug, timed=timed)

    def copied_bytes(self, column: Any) -> int:
        """Bytes of ``column`` the pool copies into shared memory to send them."""
        if not self.workers:
            return 0  # run here: nothing crosses a process boundary
        arrays = (column,) if isinstance(column, np.ndarray) else column
        return sum(
            a.nbytes for a in arrays if a.nbytes > _codec.INLINE_MAX and not shm.in_shared_memory(a)
        )

    def share(self, array: Any) -> Any:
        return self.pool.share(array)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._described.clear()
        self.pool.shutdown(wait, cancel_futures=cancel_futures)


class LocalPoolExecutor(PoolExecutor):
    """A :class:`PoolExecutor` over this machine's :class:`WorkerPool`.

    Its shared memory is the workers' too, so it also offers ``empty``: the
    dense block a batch's chunks write their rows into (and where a GPU
    stage copies a GPU op's outputs for CPU ops).
    """

    pool: WorkerPool

    def __init__(self, pool: WorkerPool) -> None:
        super().__init__(pool)
        self._lock = threading.Lock()  # the GPU thread takes blocks too (handoff)
        # (shape, dtype) -> [a slab of blocks of that size, how many it gave out]
        self._slabs: dict[tuple[tuple[int, ...], np.dtype[Any]], list[Any]] = {}

    def submit_hooked(self, unit: WorkUnit, hook: Callable[[Any], object]) -> None:
        """``submit_unit`` without a Future: ``hook(outcome)`` once the unit settles.

        ``outcome`` answers ``cancelled()``, ``exception()`` and ``result()``
        as a done Future's (:meth:`WorkerPool.submit_hooked`).
        """
        if not self.workers:  # run here, at once: its Future is done already
            self.submit_unit(unit).add_done_callback(hook)
            return
        args = (unit.chunk, *unit.inputs)
        self.pool.submit_hooked(unit.runner, args, _out(unit, self._described), unit.worker, hook)

    def submit_many(
        self,
        many: ManyRunner,
        units: list[WorkUnit],
        hooks: list[Callable[[Any], object]],
        worker: int | None = None,
    ) -> None:
        """Several iterations' whole-batch units of one op as one call (issue 37)."""
        described = self._described
        width = max(len(u.out) for u in units)
        outs: list[Any] = []
        for u in units:
            got = _out(u, described).get("out", ())
            outs.extend(got or (None,) * width)
        c0 = units[0].chunk
        record = Chunks(
            c0.epoch,
            tuple([u.chunk.iteration for u in units]),
            tuple([u.chunk.count for u in units]),
            tuple([u.chunk.epoch_start for u in units]),
            width,
        )
        kwargs = {"out": tuple(outs)} if width else {}
        # Units with no inputs (a source's chain): one record, in the codec's fixed layout.
        args = (
            (record,) if not any(u.inputs for u in units) else (record, [u.inputs for u in units])
        )
        self.pool.submit_hooked(many, args, kwargs, worker, FanOut(hooks))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A block on pages of its own: a small one from a slab of them (see :data:`SLAB_BYTES`)."""
        key = (shape, dtype)
        with self._lock:  # (a slab with a block left: nothing worked out again)
            slab = self._slabs.get(key)
            if slab is not None and slab[1] < len(slab[0]):
                rows, taken, described = slab
                slab[1] = taken + 1
                block = np.ndarray(shape, dtype, rows[taken])
                if described is not None:  # described with the slab: only its start moves
                    desc, packed = described
                    at = desc.at(desc.start + taken * rows.strides[0], packed)
                    self._described[id(block)] = _codec.Writable(block, *at)
                return block
        dt = np.dtype(dtype)
        span = -(-math.prod(shape) * dt.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
        if span <= 0 or span * _SLAB_BLOCKS_MIN > SLAB_BYTES or dt.hasobject:
            return self.pool.empty(shape, dt)
        with self._lock:
            slab = self._slabs.get(key)
            if slab is None or slab[1] == len(slab[0]):
                rows = self.pool.empty((SLAB_BYTES // span, span), np.uint8)
                described = getattr(self.pool, "described", None)
                if described is not None:
                    described = described(np.ndarray(shape, dt, rows[0]))
                # The blocks of the slab before: shared the general way from here on.
                self._described.clear()
                slab = self._slabs[key] = [rows, 0, described]
            rows, taken, described = slab
            slab[1] = taken + 1
            block = np.ndarray(shape, dt, rows[taken])
            if described is not None:
                desc, packed = described
                at = desc.at(desc.start + taken * span, packed)
                self._described[id(block)] = _codec.Writable(block, *at)
        return block


#: A batch's dense block of at most 1/_SLAB_BLOCKS_MIN of this is cut from a slab
#: of such blocks, one arena allocation for many batches: each block still starts
#: on a page and has its pages to itself (a worker given its rows writable
#: reaches no other batch's), but a batch costs a slice, not an allocation
#: (``Arena.empty`` took 40-75 µs of the main process's CPU a batch, cold, in
#: ``python -m benchmarks mainload``). A slab's memory goes back when the last of
#: its blocks does: a block kept holds at most SLAB_BYTES.
SLAB_BYTES = 1 << 20
_SLAB_BLOCKS_MIN = 8


def _out(unit: WorkUnit, described: dict[int, Any] | None = None) -> dict[str, Any]:
    """A unit's keyword arguments: its rows of the batch's blocks, writable.

    A whole block cut from a slab goes as the :class:`Writable` made when it was cut
    (``described``, by the block's id, which it keeps alive: it carries the block's
    descriptor, shared by the codec with no look at the array); a part of one goes
    alone.
    """
    if not unit.out:
        return {}
    # (Writable, not writable(): a block's rows are a writable array, never of objects.)
    if not described:
        return {"out": tuple([None if o is None else _codec.Writable(o) for o in unit.out])}
    pop = described.pop
    return {
        "out": tuple(
            [None if o is None else pop(id(o), None) or _codec.Writable(o) for o in unit.out]
        )
    }


def pool_executor(pool: CallPool) -> PoolExecutor:
    """The executor for ``pool``: with shared-memory blocks where the pool is local."""
    return LocalPoolExecutor(pool) if isinstance(pool, WorkerPool) else PoolExecutor(pool)


# ---------------------------------------------------------------- the GPU


class GpuExecutor:
    """Runs GPU ops' calls in this process, on one thread that owns the device.

    :meth:`submit` queues one call (a chunk through a :class:`GpuOpRunner`) and
    returns a future of its :class:`ChunkResult` (outputs are device arrays).
    The thread copies host inputs to the device (the op's stream waits on the
    copy), makes the op's stream wait on the events of the GPU ops that
    produced its device inputs (and on nothing else), runs the function, and
    records the op's event. It never synchronizes the device: calls of later
    iterations are queued while earlier ones still run on the GPU, which is
    what overlaps the copy of iteration i+1 with the compute of iteration i.
    """

    workers = 1

    def __init__(self, xp: Any, device_id: int = 0, *, register: bool = True) -> None:
        self.xp = xp
        self.pid = os.getpid()  # the process whose thread and device context these are
        from ._gpu import GpuStage  # imported where a pipeline has GPU ops, not before

        self.stage = GpuStage(xp, device_id, register=register)
        self._lock = threading.Lock()  # the stage is shared with to_host callers
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._events: dict[tuple[str, int, int], Any] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(
        self, runner: GpuOpRunner, chunk: Chunk, inputs: Sequence[Sequence[Any]]
    ) -> Future[ChunkResult]:
        """Queue one call of ``runner`` over ``chunk``; a future of its result."""
        return self._queue(functools.partial(self._run, runner, chunk, inputs))

    def _queue(self, task: Callable[[], Any]) -> Future[Any]:
        """Run ``task`` on the GPU thread, after the tasks queued before it."""
        if self.pid != os.getpid():
            # Forked: the thread is the parent's (a call queued here would wait forever),
            # and so is the device context.
            raise forked_error(self.pid, "this GPU stage")
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise GpuError("the GPU stage is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mpexec-gpu", daemon=True)
                self._thread.start()
        self._tasks.put((task, future))
        return future

    def runner(self, op: Op, entropy: int, *, debug: bool = False) -> GpuOpRunner:
        """The runner of GPU op ``op`` (``debug``'s input checks are the CPU runner's)."""
        from ._gpu import GpuOpRunner

        return GpuOpRunner(
            op.name,
            op.function,
            op.batch_processing,
            op.num_outputs,
            entropy,
            op.dlpack,
            tuple(n.op.name for n in op.inputs),
        )

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        """The scheduler's entry point: a unit of a GPU op."""
        # A dense block's rows, as samples: adjacent, so the stage copies them in one run.
        columns: tuple[Any, ...] = unit.inputs
        inputs = [list(c) if isinstance(c, np.ndarray) else c for c in columns]
        return self.submit(unit.runner, unit.chunk, inputs)  # type: ignore[arg-type]

    def share(self, array: Any) -> Any:
        """A read-only copy (GPU ops are never sources; here for the executor protocol)."""
        out = np.array(array, copy=True)
        out.flags.writeable = False
        return out

    def batch(self, samples: Sequence[Any], layout: str | None, producer: str) -> GpuBatch:
        """A GPU op's output as a ``GpuBatch`` on that op's stream."""
        from ._gpu import GpuBatch

        return GpuBatch(samples, layout, self.xp, self.stage.stream(producer))

    def is_device_column(self, column: Sequence[Any]) -> bool:
        return bool(column) and isinstance(column[0], self.xp.ndarray)

    def to_host(
        self,
        columns: Sequence[Sequence[Any]],
        producer: str,
        alloc: Callable[[int], np.ndarray[Any, Any]] | None = None,
    ) -> list[list[Any]]:
        """Host copies of GPU op ``producer``'s output columns, complete on return."""
        with self._lock:
            stream = self.stage.stream(producer)
            return self.stage.to_host(columns, stream, alloc)

    def handoff(
        self, column: Sequence[Any], producer: str, consumer: UnitExecutor
    ) -> Future[list[Any]]:
        """GPU op ``producer``'s output ``column`` in host memory, for ``consumer``'s units.

        Into the consumer's shared memory where it offers it (so its workers
        read the bytes with no further copy), else into pinned memory. The copy
        is queued on the GPU thread, after the work that made the column: the
        thread that completed the producer's chunk never waits on the device.
        """
        empty = getattr(consumer, "empty", None) if consumer.workers else None
        alloc = None if empty is None else functools.partial(_bytes_from, empty)

        def copy() -> list[Any]:
            (host,) = self.to_host([column], producer, alloc)
            return host

        return self._queue(copy)

    def columns(
        self, parts: Sequence[ChunkResult], num_outputs: int, what: str
    ) -> tuple[list[Any], ...]:
        """A GPU op's outputs: device arrays, one list per output (no blocks)."""
        columns = tuple([x for p in parts for x in p.outputs[i]] for i in range(num_outputs))
        for i, col in enumerate(columns):
            check_consistent(what, i, col)
        return columns

    def _loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            task, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = task()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _run(
        self, runner: GpuOpRunner, chunk: Chunk, inputs: Sequence[Sequence[Any]]
    ) -> ChunkResult:
        t0 = time.perf_counter()
        with self._lock:
            stage = self.stage
            stream = stage.stream(runner.name)
            host = [i for i, col in enumerate(inputs) if not self.is_device_column(col)]
            args = [list(col) for col in inputs]
            if host:
                try:
                    copied = stage.to_device([inputs[i] for i in host], stream)
                except self.xp.cuda.runtime.CUDARuntimeError as exc:
                    raise GpuError(
                        f"copying the inputs of GPU op '{runner.name}' to device "
                        f"{stage.device_id} failed: {exc}"
                    ) from exc
                for i, col in zip(host, copied, strict=True):
                    args[i] = col
            for i, producer in enumerate(runner.producers):
                if i not in host:
                    event = self._events.get((producer, chunk.epoch, chunk.iteration))
                    if event is not None:
                        stream.wait_event(event)
        with stage.device:
            columns = runner(self.xp, stream, chunk, args)
        with self._lock:
            self._events[(runner.name, chunk.epoch, chunk.iteration)] = stream.record()
            stage.hold(stream, args)
            stage.reap()
            for key in [k for k, e in self._events.items() if e.done]:
                del self._events[key]  # complete: consumers need not wait on it
        seconds = time.perf_counter() - t0
        return ChunkResult(tuple(columns), chunk.count, seconds, os.getpid())

    def on_own_thread(self) -> bool:
        """Whether the caller is the stage's own thread (which cannot join itself)."""
        return threading.current_thread() is self._thread

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the thread (after queued calls, unless cancelled) and close the stage.

        In a process forked from the owner's it does nothing: the stage's device
        memory and registrations are the parent's.
        """
        if self.pid != os.getpid():
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if cancel_futures:
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[1].cancel()
        self._tasks.put(None)
        if thread is not None and wait:
            thread.join(timeout=60)
        with self._lock:
            self._events.clear()
            self.stage.close()


def _bytes_from(empty: Any, nbytes: int) -> np.ndarray[Any, Any]:
    """``nbytes`` of an executor's shared memory, as bytes (where a GPU stage copies)."""
    return empty((nbytes,), np.dtype(np.uint8))  # type: ignore[no-any-return]
