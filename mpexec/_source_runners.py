"""Runners whose calls make a whole batch: a fused source + batch op, and a worker-side source.

Both run in a worker (or inline) like :class:`~mpexec._runtime.OpRunner`, and are
built on its pieces (chunks, seeding, the output checks); they live apart from it
because each makes a batch rather than running a function sample by sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import numpy as np

from ._runtime import (
    BatchInfo,
    ChainRunner,
    Chunk,
    ChunkResult,
    OpRunner,
    call_seeds,
    check_consistent,
    is_string_array,
    nbytes,
    reseed,
    set_call_info,
    thread_faults,
    write_columns,
)


class SourceBatchRunner:
    """A per-sample source (and the per-sample ops chained to it) and the batch op it feeds.

    One call makes a whole batch: the source part runs over the batch's
    samples (``head``: an :class:`OpRunner` or a :class:`ChainRunner`, each
    sample with its own seed, as in chunks), then the batch op (``tail``)
    runs once on the samples it made, as lists of read-only arrays: the batch
    it would get unfused. So a batch is one round trip to one worker instead
    of one per chunk and one more for the batch op, and its samples never
    leave that worker (the scheduler keeps batches in flight on every worker).

    ``pick``: which of the head's outputs the batch op takes (None: all, in
    order); ``what``: the head's last op, for its errors. Where the source
    ended the epoch before the batch was full, the batch op is called on the
    short batch, except where nothing came or ``drop_short`` (the pipeline's
    ``last_batch="drop"``) drops it: then it is not called at all.
    """

    def __init__(
        self,
        head: OpRunner | ChainRunner,
        tail: OpRunner,
        pick: tuple[int, ...] | None,
        what: str,
        drop_short: bool,
    ) -> None:
        self.head = head
        self.tail = tail
        self.pick = pick
        self.what = what
        self.drop_short = drop_short
        # The head's last op, which an error in its outputs' checks names.
        last = head.runners[-1] if isinstance(head, ChainRunner) else head
        self._head_name = last.name

    def __call__(self, chunk: Chunk, *inputs: Any, out: tuple[Any, ...] = ()) -> ChunkResult:
        """Make the batch (``chunk``: the whole of it); ``out`` as :meth:`OpRunner.__call__`."""
        t0 = time.perf_counter()
        faults = thread_faults()
        try:
            made = self.head(chunk, *inputs)
            columns = made.outputs
            for i, column in enumerate(columns):
                check_consistent(self.what, i, column)
        except BaseException as exc:
            if getattr(exc, "mpexec_op", None) is None:
                with contextlib.suppress(AttributeError):
                    exc.mpexec_op = self._head_name  # type: ignore[attr-defined]
            raise
        count = made.count
        per_op = made.per_op or ((made.seconds, 0, sum(nbytes(c) for c in columns)),)
        tail = self.tail
        if not count or (self.drop_short and count < chunk.count):
            # No batch anyone receives (nothing came, or last_batch="drop" drops it):
            # unfused, the batch op would not be called on it either. Its stats get
            # no per_op entry: it was not called.
            empty: tuple[Any, ...] = tuple([] for _ in range(tail.num_outputs))
            return ChunkResult(
                empty,
                count,
                time.perf_counter() - t0,
                os.getpid(),
                made.stop,
                per_op,
                (False,) * tail.num_outputs,
                thread_faults() - faults,
            )
        if self.pick is not None:
            columns = tuple(columns[i] for i in self.pick)
        args = []
        for column in columns:  # read-only views, as every op's inputs
            views = [a.view() for a in column]
            for v in views:
                v.setflags(False)
            args.append(views)
        if count < chunk.count:
            chunk = dataclasses.replace(chunk, count=count)
            out = tuple(None if o is None else o[:count] for o in out)
        try:
            batch = tail(chunk, *args, out=out)
        except BaseException as exc:
            with contextlib.suppress(AttributeError):
                exc.mpexec_op = tail.name  # type: ignore[attr-defined]
            raise
        bytes_out = 0
        for i, column in enumerate(batch.outputs):
            wrote = bool(batch.written) and batch.written[i]
            bytes_out += nbytes(out[i] if wrote else column)  # rows of the block, or arrays
        tail_stats = (batch.seconds, sum(nbytes(c) for c in args), bytes_out)
        return ChunkResult(
            batch.outputs,
            count,
            time.perf_counter() - t0,
            os.getpid(),
            made.stop,
            (*per_op, tail_stats),
            batch.written,
            thread_faults() - faults,
        )


class WorkerBatchSource:
    """A batch-mode source run in a worker: DALI's parallel external source with ``batch=True``.

    ``source`` is what ``fn.external_source`` made of the user's source: a
    callable of ``(iteration, epoch)`` (which calls the user's with a
    ``BatchInfo``, the iteration, or nothing), or, with ``iterable=True``, an
    object whose ``open()`` starts the user's iterable or generator function.
    A callable may run in any worker: each call is one iteration's batch. An
    iterable lives in the one worker its op is pinned to (the op is stateful,
    so its calls come in iteration order) and each call takes its next item,
    as the main process would, with DALI's ``cycle``: ``False`` reads it once
    (after it ends it stays exhausted, across epochs), ``"raise"`` ends the
    epoch and starts it again in the next, ``True``/``"quiet"`` starts it again
    at once. A call for an iteration past the one expected (a pipeline resumed
    with ``load_state_dict``) skips the items between; calls of an epoch that
    already ended here (prefetched past its end) take nothing.

    ``StopIteration`` ends the epoch: the result holds no samples and ``stop=0``.
    ``np.random``/``random`` are reseeded from (seed, op, epoch, iteration)
    before each call, as for a batch op's.
    """

    def __init__(
        self,
        name: str,
        source: Any,
        num_outputs: int,
        entropy: int,
        *,
        iterable: bool,
        cycle: Any,
        output_dtypes: tuple[np.dtype[Any] | None, ...] | None = None,
        output_shapes: tuple[tuple[int | None, ...] | None, ...] | None = None,
    ) -> None:
        self.name = name
        self.source = source
        self.num_outputs = num_outputs
        self.entropy = entropy
        self.iterable = iterable
        self.cycle = cycle
        self.output_dtypes = output_dtypes
        self.output_shapes = output_shapes
        # An iterable's place, in the worker that reads it.
        self._iterator: Any = None
        self._exhausted = False  # cycle=False: it ended, for good
        self._epoch: int | None = None
        self._next = 0  # the iteration its next item is for
        self._ended = False  # it ended the epoch self._epoch
        self._last: Any = None  # the item for iteration self._next - 1

    def __call__(self, chunk: Chunk, *inputs: Any, out: tuple[Any, ...] = ()) -> ChunkResult:
        """The batch of ``chunk``'s iteration; ``out`` as :meth:`OpRunner.__call__`."""
        t0 = time.perf_counter()
        faults = thread_faults()
        (np_seed,), (py_seed,) = call_seeds(self.entropy, chunk.epoch, chunk.iteration, 0, 1)
        set_call_info(BatchInfo(chunk.iteration, chunk.epoch))
        try:
            reseed(np_seed, py_seed)
            if self.iterable:
                data = self._item(chunk)
            else:
                try:
                    data = self.source(chunk.iteration, chunk.epoch)
                except StopIteration:
                    data = None
            rows = [] if data is None else self._rows(data)
        except BaseException as exc:
            with contextlib.suppress(AttributeError):
                exc.mpexec_op = self.name  # type: ignore[attr-defined]
            raise
        finally:
            set_call_info(None)
        if data is None:
            empty: tuple[list[Any], ...] = tuple([] for _ in range(self.num_outputs))
            return ChunkResult(
                empty,
                0,
                time.perf_counter() - t0,
                os.getpid(),
                0,
                written=(False,) * self.num_outputs,
                faults=thread_faults() - faults,
            )
        columns, written = write_columns(rows, self.num_outputs, out)
        return ChunkResult(
            columns,
            len(rows),
            time.perf_counter() - t0,
            os.getpid(),
            written=written,
            faults=thread_faults() - faults,
        )

    def _item(self, chunk: Chunk) -> Any:
        """The iterable's item for ``chunk``'s iteration; None where the epoch ended."""
        if chunk.epoch != self._epoch:
            self._epoch, self._next, self._ended, self._last = chunk.epoch, 0, False, None
            if self.cycle:
                self._iterator = None  # a new epoch starts it again
        if self._ended:
            return None
        if chunk.iteration == self._next - 1:
            # Asked again (a unit a Ctrl-C in the main process left it unsure was
            # sent, sent again): the same batch, not the next one.
            return self._last
        item = None
        while self._next <= chunk.iteration:
            item = self._take()
            self._next += 1
            if item is None:
                self._ended = True
                return None
        self._last = item
        return item

    def _take(self) -> Any:
        for attempt in range(2):
            if self._iterator is None:
                if self._exhausted:
                    return None
                self._iterator = iter(self.source.open())
            try:
                return next(self._iterator)
            except StopIteration:
                self._iterator = None
                if not self.cycle:
                    self._exhausted = True
                    return None
                if self.cycle == "raise" or attempt:
                    return None
        return None  # pragma: no cover - the loop returns

    def _rows(self, data: Any) -> list[tuple[Any, ...]]:
        """A batch the source gave, as one tuple of arrays per sample, checked."""
        what = f"external_source '{self.name}'"
        rows = batch_rows(what, data, self.num_outputs, getattr(self.source, "batch_size", None))
        for i, column in enumerate(zip(*rows, strict=True)) if rows else ():
            for a in column:
                check_source_value(what, i, a, self.output_dtypes, self.output_shapes)
            check_consistent(what, i, column)
        return rows


#: A source's batch up to this size is copied as one block (small samples, whose copies
#: cost the main process more than their bytes); larger ones a sample at a time, so that
#: a large batch does not need one run of free shared memory as large as itself.
BLOCK_BYTES = 4 << 20


def own_columns(columns: tuple[list[Any], ...], executor: Any) -> tuple[tuple[Any, ...], int]:
    """Copies of a source's columns made in the main process, read-only; and the bytes shared.

    The source, or the caller of feed_input, may refill its buffers at once
    (as DALI's external_source allows: it copies too); this one copy is where
    data enters the pipeline. ``executor``: where the copies go (its
    ``share``; its ``empty`` for a block), or None: this process's memory (no
    workers). A column whose samples are arrays of one shape and dtype is
    copied as one block, the batch's rows (one allocation, one copy and one
    descriptor for the batch, as an op's output block), up to
    :data:`BLOCK_BYTES`; otherwise each sample is copied on its own.
    """
    out: list[Any] = []
    shared = 0
    for col in columns:
        block = _one_block(col, executor)
        if block is not None:
            shared += block.nbytes if executor is not None else 0
            out.append(block)
            continue
        own = []
        for a in col:
            if executor is not None and not a.dtype.hasobject and a.nbytes:
                c = executor.share(a)
                shared += a.nbytes
            else:
                c = np.array(a, copy=True)
            c.flags.writeable = False
            own.append(c)
        out.append(own)
    return tuple(out), shared


def _one_block(col: list[Any], executor: Any) -> Any:
    """``col``'s samples copied into one read-only block, if they share a shape and dtype."""
    if len(col) < 2:
        return None
    shape, dtype = col[0].shape, col[0].dtype
    if dtype.hasobject or not col[0].nbytes or col[0].nbytes * len(col) > BLOCK_BYTES:
        return None
    for a in col:
        if a.shape != shape or a.dtype != dtype:
            return None
    empty = None if executor is None else getattr(executor, "empty", None)
    if executor is not None and empty is None:
        return None  # no block of its own to give (a RayPool's): a copy a sample
    block = (
        np.empty((len(col), *shape), dtype) if empty is None else empty((len(col), *shape), dtype)
    )
    np.stack(col, out=block)
    block.flags.writeable = False
    return block


def sample_tuple(what: str, num_outputs: int, item: Any) -> tuple[Any, ...]:
    """A per-sample source's item as a tuple of arrays, one per output; ``what`` names it."""
    if num_outputs == 1:
        return (np.asarray(item),)
    if not isinstance(item, (tuple, list)) or len(item) != num_outputs:
        raise ValueError(
            f"{what} has num_outputs={num_outputs}: each item of its source "
            f"must be a tuple of {num_outputs} arrays"
        )
    return tuple(np.asarray(v) for v in item)


def batch_rows(what: str, data: Any, num_outputs: int, limit: int | None) -> list[tuple[Any, ...]]:
    """Rows (one tuple of arrays per sample) of a batch a source gave; ``what`` names it."""
    outs = [data] if num_outputs == 1 else data
    if num_outputs > 1 and (not isinstance(outs, (tuple, list)) or len(outs) != num_outputs):
        raise ValueError(
            f"{what} has num_outputs={num_outputs}: its source must give a "
            f"tuple of {num_outputs} batches"
        )
    columns = []
    for out in outs:
        if isinstance(out, np.ndarray) or hasattr(out, "__array_interface__"):
            arr = np.asarray(out)
            if arr.ndim == 0:
                raise ValueError(f"{what} gave a 0-d array where a batch belongs")
            columns.append(list(arr))
        elif isinstance(out, (list, tuple)):
            columns.append([np.asarray(v) for v in out])
        else:
            raise TypeError(
                f"{what}: a batch is a list of arrays or one array whose first "
                f"axis is the batch, not {type(out).__name__}"
            )
    n = len(columns[0])
    if any(len(c) != n for c in columns):
        raise ValueError(f"{what}: its outputs hold different numbers of samples")
    if limit is not None and n > limit:
        raise ValueError(
            f"{what} gave a batch of {n} samples; the pipeline's batch_size is {limit}"
        )
    return list(zip(*columns, strict=True))


def check_source_value(
    what: str,
    i: int,
    a: Any,
    dtypes: tuple[np.dtype[Any] | None, ...] | None,
    shapes: tuple[tuple[int | None, ...] | None, ...] | None,
) -> None:
    """Refuse a source's output ``i`` whose dtype or rank is not what was declared."""
    if a.dtype.hasobject and not is_string_array(a):
        raise TypeError(
            f"{what}: output {i} is an array of Python objects; sources give "
            "numeric arrays, or arrays of strings (bytes or str)"
        )
    want = dtypes[i] if dtypes is not None else None
    if want is not None and a.dtype != want:
        raise TypeError(f"{what}: output {i} is {a.dtype}, but dtype={want}")
    shape = shapes[i] if shapes is not None else None
    if shape is not None and a.ndim != len(shape):
        raise ValueError(f"{what}: output {i} has rank {a.ndim}, but ndim={len(shape)}")
