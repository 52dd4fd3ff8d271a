"""The scheduler's records: an op's runtime state, an iteration in flight, the stats.

Also how a source read here gives its next batch (:func:`pull`).

Plain records the scheduler (``_scheduler.py``) keeps and changes, and the
snapshots a pipeline reports (``OpStats``, ``PipelineStats``); apart from it so
that the scheduler's module holds the policy (windows, chunks, assembly) and
these hold the state it works on.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._batch import Batch
from ._executors import UnitExecutor
from ._graph import Op
from ._modes import OpKind, SourceMode
from ._runtime import ChunkResult, check_consistent
from ._source_runners import batch_rows, check_source_value, sample_tuple


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


class OpState:
    """An op's runtime: its runner, turn counter, source state and counters."""

    def __init__(
        self,
        op: Op,
        pos: int,
        runner: Any,
        worker: int | None,
        executor: UnitExecutor,
    ) -> None:
        self.op = op
        self.pos = pos
        self.runner: Any = runner  # what its executor runs (None: a source read here)
        self.inputs = op.inputs  # of the chain's head, when ops are chained into this one
        # What it waits for: those inputs, and the predicates of the branch it runs in.
        self.waits = tuple(op.waits())
        # A split or merge of DALI's conditional execution: computed here, by selecting rows.
        self.selects = op.kind in (OpKind.SPLIT, OpKind.MERGE)
        self.members = [self]  # the chain this op ends (itself alone if none)
        # This op, or the head of the chain it ends, is a source (set again where
        # the scheduler chains ops: an attribute, read several times an iteration).
        self.source = op.is_source
        self.absorbed = False  # runs inside a later op's chain
        self.worker = worker  # pinned worker index (stateful ops)
        self.executor = executor  # where its units run
        # What the executor offers beyond the protocol (_executors' doc), looked up once.
        self.copied_bytes = getattr(executor, "copied_bytes", None)
        self.handoff = getattr(executor, "handoff", None)
        self.columns = getattr(executor, "columns", None)
        self.batch = getattr(executor, "batch", None)
        self.submit_hooked = getattr(executor, "submit_hooked", None)
        self.empty = getattr(executor, "empty", None)
        self.groupable = False  # its units may carry several iterations (_grouping)
        # Set by the scheduler once ops are chained: (producer, output index) per
        # input, and the names of the ops a unit runs (head first).
        self.producers: list[tuple[OpState, int]] = []
        self.names: tuple[str, ...] = (op.name,)
        # Per output: (sample shape, dtype) of the batch's dense block, or None.
        self.declared = declared_blocks(op)
        self.blocks: list[tuple[tuple[int, ...], np.dtype[Any]] | None] = list(self.declared)
        self.turn = 0  # stateful: the compute sequence number allowed next
        self.skipped: set[int] = set()
        self.iterator: Iterator[Any] | None = None
        self.fed: collections.deque[list[tuple[Any, ...]]] = collections.deque()
        self.reading: list[Any] = []  # items of a per-sample read a Ctrl-C stopped
        self.pulled: list[tuple[Any, ...]] | None = None  # the rows pull() left first in fed
        # Counted per unit of the chain this op ends, not per member (a unit's
        # outcome runs these adds once, whatever the chain's length): ``units``
        # and ``cpu_samples`` below; ``uncalled``: the units (and their samples)
        # where this op, a batch op ending a source's chain, was not called.
        # ``chain``: the op whose units run this one (itself, or a later op's
        # chain it is absorbed into). :attr:`calls` and :attr:`samples` follow.
        self.chain = self
        self.units = 0
        self.uncalled = self.uncalled_samples = 0
        self.function_s = self.waiting_s = 0.0
        # The CPU its units took in the workers, and their samples: what sizes its chunks.
        self.cpu_s = 0.0
        self.cpu_samples = 0
        self.bytes_in = self.bytes_out = self.bytes_copied = 0

    @property
    def samples(self) -> int:
        """The samples this op ran on."""
        chain = self.chain
        return chain.cpu_samples - chain.uncalled_samples if chain is self else chain.cpu_samples

    @property
    def calls(self) -> int:
        """The calls of its function: one a unit (a batch op), or one a sample."""
        if not self.op.batch_processing:
            return self.samples
        chain = self.chain
        return chain.units - chain.uncalled if chain is self else chain.units

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


class Iteration:
    """One iteration in flight."""

    def __init__(self, epoch: int, index: int, batch_size: int, n_ops: int) -> None:
        self.epoch = epoch
        self.index = index
        self.epoch_start = index * batch_size
        self.seq = -1  # compute-phase sequence number, once there
        self.size = batch_size
        self.stop: int | None = None  # a source raised StopIteration at this sample
        # Per op: its output columns (a list of per-sample arrays, or one dense block).
        self.values: list[tuple[Any, ...] | None] = [None] * n_ops
        # Per branch of an `if` on a DataNode (by id): (mask over its parent's samples,
        # their indices in the batch), worked out when first needed.
        self.scopes: dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]] = {}
        # op -> its chunks' results so far; a batch sent as one unit: its blocks (a token).
        self.parts: dict[int, list[Any]] = {}
        self.bounds: dict[int, list[tuple[int, int]]] = {}  # op -> its chunks' rows
        self.blocks: dict[int, list[Any]] = {}  # op -> per output: the batch's block, or None
        self.dispatched: set[int] = set()
        # (op, output) -> its column handed off to another executor (a GPU op's
        # output copied to the host for CPU ops), as a future.
        self.host: dict[tuple[int, int], Future[list[Any]]] = {}
        self.sources_left = 0
        self.ops_left = 0
        self.nbytes = 0  # its outputs computed by the pipeline's workers so far
        self.error: BaseException | None = None
        self.dropped = False
        self.result: tuple[Batch, ...] | None = None
        self.done = Done()

    @property
    def computing(self) -> bool:
        return self.seq >= 0

    def take_error(self) -> BaseException | None:
        """The error run() is to raise, which this iteration lets go of (None: none).

        Its chunks still running hold the iteration (their callbacks) until they come
        back, and the error's traceback will hold the caller's frames: kept here, it
        would keep them (and a pipeline they hold) alive. ``dropped`` is set first: a
        late chunk's callback (under the scheduler's lock, not held here) then ignores it.
        """
        error = self.error
        if error is not None:
            self.dropped = True
            self.error = None
        return error


class Done:
    """Set once, when an iteration is done: ``threading.Event``'s ``set``, ``is_set``
    and ``wait``, on one lock.

    An iteration makes one and sets it once, every batch: an Event's condition
    costs ~20 Python calls a batch between them (its lock, waiter list and
    notify), which the main process runs cold at 2 workers (docs/scaling.md).
    The lock is held until ``set`` releases it; a waiter takes it and hands it
    on at once, so any number of waiters wake.
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = _allocate_lock()
        self._lock.acquire()

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        try:  # noqa: SIM105 - not contextlib.suppress: 3 Python calls a batch
            self._lock.release()
        except RuntimeError:  # set twice at once: released already
            pass

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if ``timeout`` seconds passed first."""
        if self._flag:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else timeout):
            try:  # noqa: SIM105 - (see set)
                self._lock.release()  # the next waiter's turn
            except RuntimeError:  # (see set)
                pass
            return True
        return self._flag


_allocate_lock = threading.Lock


def declared_blocks(op: Op) -> list[tuple[tuple[int, ...], np.dtype[Any]] | None]:
    """Per output: (shape, dtype) where ``output_shapes``/``output_dtypes`` fix both."""
    found: list[tuple[tuple[int, ...], np.dtype[Any]] | None] = []
    for i in range(op.num_outputs):
        shape = op.output_shapes[i] if op.output_shapes is not None else None
        dtype = op.output_dtypes[i] if op.output_dtypes is not None else None
        if (
            shape is None
            or dtype is None
            or np.dtype(dtype).hasobject
            or any(d is None or d < 0 for d in shape)
        ):
            found.append(None)
        else:
            found.append((tuple(int(d) for d in shape), np.dtype(dtype)))  # type: ignore[arg-type]
    return found


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a pipeline's work: per op, and per worker."""

    iterations: int
    wall_s: float
    ops: tuple[OpStats, ...]
    busy: tuple[tuple[int, float], ...]  # (worker pid, busy fraction of wall time)
    merged_ops: int
    pruned_ops: int
    samples: int = 0  # samples delivered by run()
    #: Minor page faults the workers took inside this pipeline's chunks (Linux).
    worker_faults: int = 0

    @property
    def faults_per_sample(self) -> float:
        """Workers' minor page faults per delivered sample (0.0 before any)."""
        return self.worker_faults / self.samples if self.samples else 0.0

    #: Under the table: how to read the summed columns.
    READING_GUIDE = (
        "fn/wait ms: sums over all calls on all workers (can exceed the wall time); "
        "wait = sent, not yet running; copied should be 0"
    )

    def __str__(self) -> str:
        head = (
            f"{'op':<28}{'calls':>8}{'fn ms sum':>11}{'wait ms sum':>13}"
            f"{'MiB in':>9}{'MiB out':>9}{'MiB copied':>12}"
        )
        summary = (
            f"{self.iterations} iterations in {self.wall_s:.2f} s "
            f"({self.merged_ops} ops merged, {self.pruned_ops} pruned)"
        )
        lines = [summary, head]
        lines += [
            f"{s.name[:27]:<28}{s.calls:>8}{s.function_s * 1e3:>11.1f}"
            f"{s.waiting_s * 1e3:>13.1f}{s.bytes_in / 2**20:>9.1f}"
            f"{s.bytes_out / 2**20:>9.1f}{s.bytes_copied / 2**20:>12.1f}"
            for s in self.ops
        ]
        if self.busy:
            lines.append(
                "workers busy: "
                + ", ".join(f"pid {pid} {frac:.0%}" for pid, frac in sorted(self.busy))
            )
        if self.samples:
            lines.append(f"worker page faults: {self.faults_per_sample:.1f} per sample")
        lines.append(self.READING_GUIDE)
        return "\n".join(lines)


def annotate(exc: BaseException, op: Op, it: Iteration, sample: int | None) -> BaseException:
    """``exc`` with a note naming op ``op``, iteration ``it`` and ``sample`` (if any)."""
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


# ---------------------------------------------------------------- sources read here


def pull(s: OpState, it: Iteration, batch_size: int) -> tuple[list[Any], ...]:
    """A batch from a source that runs here; ([], ...) when it ended the epoch.

    Left first in ``s.fed`` (for _launch to take): fed, or read again after an
    interrupted launch (a source read here is not read twice).
    """
    op = s.op
    what = op.describe()
    if s.fed:
        rows = s.fed[0]
    elif op.source_mode == SourceMode.BATCH:
        try:
            rows = batch_rows(what, op.function(it.index, it.epoch), op.num_outputs, batch_size)
        except StopIteration:
            rows = []
    elif op.batch_processing:
        item = next_item(s)
        rows = [] if item is None else batch_rows(what, item, op.num_outputs, batch_size)
    else:
        items = s.reading  # (what a read a Ctrl-C stopped took: kept)
        while len(items) < batch_size:
            item = next_item(s)
            if item is None:
                break
            items.append(item)
        rows = [sample_tuple(what, op.num_outputs, item) for item in items]
    for row in rows:
        for i, a in enumerate(row):
            check_source_value(what, i, a, op.output_dtypes, op.output_shapes)
    if not s.fed:
        s.reading = []
        s.fed.append(rows)
    s.pulled = rows  # (first in s.fed until _launch takes it: see Scheduler._unlaunch)
    columns = tuple([row[i] for row in rows] for i in range(op.num_outputs))
    if not rows:
        it.stop = 0
    return columns


def next_item(s: OpState) -> Any:
    op = s.op
    for attempt in range(2):
        if s.iterator is None:
            src = op.function() if callable(op.function) else op.function
            s.iterator = iter(src)
        try:
            return next(s.iterator)
        except StopIteration:
            if one_pass(op):  # stays exhausted, also after reset() (DALI's rule)
                s.iterator = iter(())
                return None
            s.iterator = None
            if op.cycle == "raise" or attempt:
                return None
    return None  # pragma: no cover


def one_pass(op: Op) -> bool:
    """An iterable read here that does not cycle: one pass, never started again."""
    return op.source_mode == SourceMode.ITER and not op.cycle


# ---------------------------------------------------------------- assembly


def assemble_one(s: OpState, res: ChunkResult, blocks: list[Any], here: bool) -> tuple[Any, ...]:
    """:func:`assemble` of a batch sent as one unit: where it wrote its one output's
    block, that block is the column (nothing else to look at)."""
    written = res.written
    if s.columns is None and len(written) == 1 and written[0] and blocks[0] is not None:
        col = blocks[0][: res.count]
        col.flags.writeable = False
        return (col,)
    return assemble(s, [res], [(0, res.count)], blocks, here)


def assemble(
    s: OpState,
    parts: list[ChunkResult],
    bounds: list[tuple[int, int]],
    blocks: list[Any],
    here: bool,
) -> tuple[Any, ...]:
    """Op ``s``'s chunks' outputs as one column per output: a dense block, or a list.

    ``here``: the units ran in this process (``num_workers=0``), so their
    arrays are the function's own, copied here as it may keep and reuse them.
    """
    if s.op.batch_processing:  # one call (short where a source it ends ended)
        parts, bounds = parts[:1], bounds[:1]
        counts = [parts[0].count]
    else:
        counts = []
        for p in parts:
            counts.append(p.count)
            if p.stop is not None:
                break  # samples past a source's end are not in the epoch
        parts, bounds = parts[: len(counts)], bounds[: len(counts)]
    if s.columns is not None:  # not host arrays: its executor knows them
        return s.columns(parts, s.op.num_outputs, s.op.describe())  # type: ignore[no-any-return]
    total = sum(counts)
    columns: list[Any] = []
    for i in range(s.op.num_outputs):
        block = blocks[i] if blocks else None
        written = [bool(p.written) and p.written[i] for p in parts]
        if block is not None and all(written):
            col: Any = block[:total]
            col.flags.writeable = False
        else:
            col = []
            for p, (a, _), count, w in zip(parts, bounds, counts, written, strict=True):
                if w:  # rows of the batch's block: ours, not the function's
                    assert block is not None
                    col.extend(block[a : a + count])
                    continue
                got = p.outputs[i]
                if here:
                    got = [np.array(x, copy=True) for x in got]
                col.extend(got)
            for a in col:
                a.setflags(False)
            check_consistent(s.op.describe(), i, col)
            _learn(s, i, col)
        columns.append(col)
    return tuple(columns)


def _learn(s: OpState, i: int, col: list[Any]) -> None:
    """Output ``i`` of ``s`` came back as arrays: a block for the next batches?

    A batch whose samples share a shape and dtype sets the block of the
    next ones (a learned shape that changed is learned anew); a ragged
    batch leaves it as it was: one odd sample costs only its own batch.
    """
    if s.declared[i] is not None or not col:
        return  # declared: a departing sample only makes this batch fall back
    first = col[0]
    shape, dtype = first.shape, first.dtype
    if dtype.hasobject or not all(a.shape == shape and a.dtype == dtype for a in col):
        return
    s.blocks[i] = (tuple(shape), dtype)
