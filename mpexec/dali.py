"""mpexec inside a real DALI pipeline, both ways (``nvidia-dali``, an optional extra).

A DALI pipeline keeps its GPU decoders and augmentations; mpexec brings the
Python steps in it to every core:

- :func:`python_function` wraps a Python function for DALI's
  ``fn.python_function(..., function=f, batch_processing=True)``: each batch
  DALI hands it is spread over mpexec's worker processes, instead of running
  under the GIL in DALI's one Python thread.
- :func:`source` (and :func:`external_source`, which makes the DALI op) feeds
  an mpexec pipeline's batches to DALI's ``fn.external_source``: epochs end
  where the mpexec pipeline's do, with its seeded determinism.

Nothing here imports DALI except :func:`external_source`.

::

    DALI's executor thread           mpexec.dali.python_function     WorkerPool
    ----------------------           ---------------------------     ----------
    python_function op  -- lists of arrays (views of DALI's buffers) -->
                                     one copy into a shared block
                                     per input (the one copy: DALI's
                                     memory is not shared), a chunk's
                                     rows just before the chunk goes
                                     chunks of rows, and their rows
                                     of an output block  -- submit() -->  workers call
                                                                          f per sample,
                                                                          write its result
                                     the block's rows (or, ragged,         into the block
                         <-- lists --  the workers' own arrays)  <-------
    DALI copies them into its outputs (DALI's own copy)

    mpexec Pipeline.run() --> Batch (shared memory) --> source(pipe) --> DALI
                              dense block as one array, no_copy=True: DALI reads it in place
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from typing import Any

import numpy as np

from ._batch import Batch
from ._codec import writable
from ._dali_runner import ChunkRunner
from ._errors import PoolClosedError
from ._extras import INSTALL_DOC, install_command
from ._mapping import AUTO_CHUNK_MAX, calls_in_chunk
from ._pipeline import Pipeline
from ._pool import WorkerPool

__all__ = ["DaliFunction", "PipelineSource", "external_source", "python_function", "source"]

_MAX_CHUNKS_PER_WORKER = 4
#: Chunks a worker holds at once (one running, one queued behind it): a batch's
#: first ``_IN_FLIGHT_PER_WORKER * workers`` chunks go out together.
_IN_FLIGHT_PER_WORKER = 2


def python_function(
    function: Callable[..., Any],
    num_workers: int | None = None,
    *,
    num_outputs: int = 1,
    batch_processing: bool = False,
    pool: WorkerPool | None = None,
    start_method: str | None = None,
    timeout: float | None = None,
) -> DaliFunction:
    """``function`` run in mpexec's workers, for DALI's ``fn.python_function``.

    Pass the result as ``function=`` with ``batch_processing=True`` (and the
    same ``num_outputs``)::

        spread = mpexec.dali.python_function(augment, num_workers=4)
        out = nvidia.dali.fn.python_function(images, function=spread, batch_processing=True)

    ``function`` is called per sample (``batch_processing=False``, DALI's
    default meaning) with one array per input, or, with
    ``batch_processing=True``, with lists of samples: then each call gets a
    part of the batch, and its outputs are joined in order. Exceptions come
    back with their own type. The workers start on the first call (or use
    ``pool``); ``close()`` (or the returned object's ``with``) stops them,
    garbage collection and exit do too. Closed is final: a later call
    raises :class:`~mpexec.PoolClosedError` (DALI's prefetch may still make
    one). A worker of its own that dies costs the batch it was working on
    (:class:`~mpexec.WorkerCrashedError`), and is replaced for the next.
    """
    return DaliFunction(
        function,
        num_workers,
        num_outputs=num_outputs,
        batch_processing=batch_processing,
        pool=pool,
        start_method=start_method,
        timeout=timeout,
    )


class DaliFunction:
    """What :func:`python_function` returns: call it with DALI's batches (lists of arrays)."""

    def __init__(
        self,
        function: Callable[..., Any],
        num_workers: int | None = None,
        *,
        num_outputs: int = 1,
        batch_processing: bool = False,
        pool: WorkerPool | None = None,
        start_method: str | None = None,
        timeout: float | None = None,
    ) -> None:
        if not callable(function):
            raise TypeError(f"function must be callable, not {type(function).__name__}")
        if isinstance(num_outputs, bool) or num_outputs < 0:
            raise ValueError(f"num_outputs must be an int >= 0, not {num_outputs!r}")
        self.function = function
        self.num_outputs = num_outputs
        self.batch_processing = batch_processing
        self._runner = ChunkRunner(function, num_outputs, batch_processing)
        self._given_pool = pool
        self._pool_args = {"start_method": start_method, "timeout": timeout}
        self._num_workers = num_workers
        self._pool: WorkerPool | None = pool
        self._closed = False
        self._lock = threading.Lock()
        self._per_sample = 0.0  # seconds per sample seen so far, for the chunk size
        # Per output: (sample shape, dtype) of the last batch, where all its samples
        # shared them: the next batch gets an output block of that.
        self._specs: list[tuple[tuple[int, ...], np.dtype[Any]] | None] = [None] * num_outputs
        self._spares = _Spares()  # the last batch's blocks, for the next one
        self._finalizer: weakref.finalize[Any, DaliFunction] | None = None

    @property
    def pool(self) -> WorkerPool:
        """The workers (started now if not yet); PoolClosedError once closed."""
        with self._lock:
            if self._closed:
                raise PoolClosedError(f"{self!r} is closed: it starts no workers again")
            if self._pool is None:
                # restart: a worker that dies fails the batch it was working on, not
                # every later one (a batch of DALI's is the unit that fails, as in a pipeline).
                own = WorkerPool(
                    self._num_workers,
                    restart=True,
                    **self._pool_args,  # type: ignore[arg-type]
                )
                self._finalizer = weakref.finalize(self, own.shutdown, False, cancel_futures=True)
                self._pool = own
            return self._pool

    def __call__(self, *inputs: Sequence[Any]) -> Any:
        pool = self.pool
        if not inputs:
            raise TypeError("mpexec.dali.python_function needs at least one input (a batch)")
        size = len(inputs[0])
        if any(len(x) != size for x in inputs):
            raise ValueError("the inputs hold batches of different sizes")
        spares, self._spares = self._spares, _Spares()  # none kept if this batch fails
        columns = [_SharedRows(pool, list(x), spares) for x in inputs]
        workers = max(1, pool.num_workers)
        bounds = _chunks(size, workers, self._per_sample)
        blocks = [
            None if sp is None else spares.take(pool, (size, *sp[0]), sp[1]) for sp in self._specs
        ]
        timed = self._run_chunks(pool, workers, columns, bounds, blocks)
        # Every chunk is back: the workers are done with the blocks.
        self._spares = _Spares(spares.taken)
        results = [r for _, r in timed]
        if size:  # CPU seconds per sample in the workers, whatever the load: the next cut
            self._per_sample = sum(t for t, _ in timed) / size
        n = self.num_outputs
        if n == 0:
            return None
        joined = []
        for i in range(n):
            block = blocks[i]
            if block is not None and all(r[i] is None for r in results):
                # Every row written into the block, made from what _learn last set: its
                # rows are the output, and there is nothing new to learn from them.
                joined.append(list(block))
                continue
            col: list[Any] = []
            for r, (a, b) in zip(results, bounds, strict=True):
                if r[i] is None:  # written into the block: its rows
                    col.extend(blocks[i][a:b])  # type: ignore[index]
                else:
                    col.extend(r[i])
            self._learn(i, col)
            joined.append(col)
        return joined[0] if n == 1 else tuple(joined)

    def _learn(self, i: int, col: list[Any]) -> None:
        """A batch whose samples of output ``i`` share a shape and dtype sets the next
        batch's block; a ragged batch leaves it as it was."""
        if not col:
            return
        first = col[0]
        if first.dtype.hasobject:
            return
        if all(a.shape == first.shape and a.dtype == first.dtype for a in col):
            self._specs[i] = (tuple(first.shape), first.dtype)

    def _run_chunks(
        self,
        pool: WorkerPool,
        workers: int,
        columns: list[Any],
        bounds: list[tuple[int, int]],
        blocks: list[Any],
    ) -> list[Any]:
        """Each chunk's result, in order. Two chunks a worker are in flight (one running,
        one queued behind it, so that no worker waits for a round trip between
        chunks); the rest go out as chunks come back, to the least busy worker:
        one slowed down by other load takes fewer of them. Once every chunk is
        out, this thread sleeps until all are back (or one fails): waking it
        for each chunk would send nothing more (a batch of quick samples is
        one chunk a worker, all out at once: 1 wake-up a batch)."""
        results: list[Any] = [None] * len(bounds)
        todo = list(enumerate(bounds))[::-1]
        running: dict[Future[Any], int] = {}

        def submit_next() -> None:
            if todo:
                i, (a, b) = todo.pop()
                out = tuple(None if k is None else writable(k[a:b]) for k in blocks)
                # Each chunk's rows are copied in just before it goes: the first
                # worker starts after a chunk's copy, not the whole batch's.
                rows = (c.rows(a, b) for c in columns)
                running[pool.submit(self._runner, *rows, out=out)] = i

        try:
            for _ in range(_IN_FLIGHT_PER_WORKER * workers):
                submit_next()
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED if todo else FIRST_EXCEPTION)
                for f in done:
                    results[running.pop(f)] = f.result()
                    submit_next()
        finally:
            for f in running:  # the batch failed: its other chunks are not wanted
                f.cancel()
        return results

    def close(self) -> None:
        """Stop the workers it started (a pool it was given is left running); idempotent.

        Final: a later call raises :class:`~mpexec.PoolClosedError`.
        """
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, self._given_pool
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> DaliFunction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        name = getattr(self.function, "__qualname__", type(self.function).__name__)
        return f"mpexec.dali.python_function({name}, num_outputs={self.num_outputs})"


class _Spares:
    """A batch's blocks, offered to the next batch: one of the same shape and dtype
    that nothing else holds is taken again instead of a new one.

    A block is allocated in the pool's shared memory and freed through its
    arena: at DALI's pace, every batch paid for both, the arena's collection of
    the last batch's blocks (about 0.1 ms of the calling thread's CPU) falling
    on the first allocation, before any worker had work. Nothing else holds a
    block when no view of it is left: the rows handed to DALI are views of the
    output block, and DALI copies them and lets them go before its next call;
    a caller that keeps them (or a worker's view of a failed batch's block,
    never offered) makes the next batch take a new block.
    """

    def __init__(self, blocks: Sequence[tuple[Any, int]] = ()) -> None:
        self.blocks = list(blocks)  # (block, its _refs() when it had no view)
        self.taken: list[tuple[Any, int]] = []  # what this batch took, for the next

    def take(self, pool: WorkerPool, shape: tuple[int, ...], dtype: Any) -> Any:
        dt = np.dtype(dtype)
        for i, (block, alone) in enumerate(self.blocks):
            if block.shape == shape and block.dtype == dt and _refs(block) <= alone:
                self.taken.append(self.blocks.pop(i))
                return block
        block = pool.empty(shape, dt)
        refs = _refs(block)  # new: no view of it yet
        if refs >= 0:
            self.taken.append((block, refs))
        return block


def _refs(block: np.ndarray[Any, Any]) -> int:
    """References to the array that owns ``block``'s memory (-1: ``block`` owns it,
    never offered again). Every view of ``block`` (rows, chunks) holds one, so a
    count no higher than when it was new says no view is left; the count is taken
    the same way both times, whatever the interpreter counts of its own."""
    return -1 if block.base is None else sys.getrefcount(block.base)


class _SharedRows:
    """One input's samples in the pool's shared memory, copied in a chunk at a time.

    Dense samples go into one block (its rows are the samples), samples of
    different shapes into views of one buffer: one copy in all, and a chunk of
    rows travels as one descriptor. A chunk's dense rows are copied in with no
    Python call a sample (:func:`_gather`).
    """

    def __init__(self, pool: WorkerPool, samples: list[Any], spares: _Spares | None = None) -> None:
        self.arrays = [np.asarray(s) for s in samples]
        self.shared: Any = []  # the block, or the list of views
        arrays = self.arrays
        if not arrays:
            return
        first = arrays[0]
        if all(a.shape == first.shape and a.dtype == first.dtype for a in arrays):
            shape = (len(arrays), *first.shape)
            taken = (
                spares.take(pool, shape, first.dtype) if spares else pool.empty(shape, first.dtype)
            )
            self.shared = taken
            return
        nbytes = [a.nbytes for a in arrays]
        raw = pool.empty((sum(nbytes),), np.uint8)
        at = 0
        for a, nb in zip(arrays, nbytes, strict=True):
            self.shared.append(raw[at : at + nb].view(a.dtype).reshape(a.shape))
            at += nb

    def rows(self, a: int, b: int) -> Any:
        """Rows ``a:b``, copied in now (each chunk's rows are asked for once)."""
        part = self.shared[a:b]
        if isinstance(part, np.ndarray):
            if b > a:
                _gather(self.arrays[a:b], part)
            return part
        for view, src in zip(part, self.arrays[a:b], strict=True):
            np.copyto(view, src)
        return part


def _gather(arrays: list[np.ndarray[Any, Any]], out: np.ndarray[Any, Any]) -> None:
    """Samples of ``out``'s row shape and dtype into its rows, one assignment a row:
    no Python call a sample, whatever their strides or places in memory. (Before, a
    check that DALI's views lay back to back read each one's address through
    ``ndarray.ctypes``, two Python calls a sample, to copy a chunk as one run; a
    batch of 16 128x128x3 images in two chunks, the calling thread's CPU with caches
    evicted: 124 us that way, 42 us this way, 54 us by ``np.concatenate``.)"""
    for j, x in enumerate(arrays):
        out[j] = x


def _chunks(size: int, workers: int, per_sample: float) -> list[tuple[int, int]]:
    """Rows per call: one chunk per worker, more where samples are slow (a shorter tail).

    How many samples a chunk should hold is the one chunk policy's
    (:func:`~mpexec._mapping.calls_in_chunk`), with its target for a batch
    its caller waits for alone (``BALANCE_CHUNK_SECONDS`` of a worker's CPU,
    at most ``AUTO_CHUNK_MAX`` samples: DALI calls the op one batch at a
    time, so a batch is cut finer than a pipeline's), learned from the last
    batch's CPU seconds per sample; a batch is then cut into 1 to
    ``_MAX_CHUNKS_PER_WORKER`` chunks a worker. A cut that would all go out at
    once (up to ``_IN_FLIGHT_PER_WORKER`` chunks a worker) is one chunk a
    worker instead: chunks sent together are placed together, before any
    worker has shown itself slower, so the finer cut rebalances nothing, and
    each chunk costs a send, a result and a wake-up of the pool's thread.
    """
    if size == 0:
        return [(0, 0)]
    per_worker = 1
    if per_sample:
        carry = calls_in_chunk(per_sample, min(AUTO_CHUNK_MAX, 2 * size), alone=True)
        per_worker = round(size / carry / workers)  # CPU time only, whatever the load
    if per_worker <= _IN_FLIGHT_PER_WORKER:
        per_worker = 1
    k = max(1, min(size, workers * min(_MAX_CHUNKS_PER_WORKER, per_worker)))
    return [(size * i // k, size * (i + 1) // k) for i in range(k)]


# ---------------------------------------------------------------- mpexec as a source


class PipelineSource:
    """An mpexec pipeline's batches, as DALI's ``external_source`` reads an iterable.

    Each item is one iteration: per output, the batch as one array where it is
    dense (the pipeline's block itself, uncopied), else its list of arrays; a
    tuple of them for several outputs. The last ``keep`` iterations are held,
    so DALI may read them in place (``no_copy=True``) until it has used them.
    ``iter()`` after the first starts the pipeline's next epoch (DALI calls it
    again at the end of an epoch with ``cycle="raise"``).
    """

    def __init__(self, pipe: Pipeline, outputs: Sequence[int] | None = None, keep: int = 4) -> None:
        self.pipe = pipe
        self.outputs = tuple(outputs) if outputs is not None else None
        self._held: collections.deque[tuple[Batch, ...]] = collections.deque(maxlen=max(1, keep))
        self._started = False

    def __iter__(self) -> Iterator[Any]:
        if self._started:
            self.pipe.reset()
        self._started = True
        return self

    def __next__(self) -> Any:
        result = self.pipe.run()  # StopIteration ends DALI's epoch too
        if self.outputs is not None:
            result = tuple(result[i] for i in self.outputs)
        self._held.append(result)
        items = tuple(b.as_array() if b.is_dense() and len(b) else list(b) for b in result)
        return items[0] if len(items) == 1 else items


def source(pipe: Pipeline, outputs: Sequence[int] | None = None, keep: int = 4) -> PipelineSource:
    """``pipe``'s batches for ``nvidia.dali.fn.external_source(source=..., batch=True)``.

    ``outputs``: which of the pipeline's outputs (default: all; give DALI
    ``num_outputs`` to match when there are several). See :class:`PipelineSource`.
    """
    return PipelineSource(pipe, outputs, keep)


def external_source(
    pipe: Pipeline, outputs: Sequence[int] | None = None, keep: int = 4, **kwargs: Any
) -> Any:
    """DALI's ``fn.external_source`` fed by ``pipe``: call it inside a DALI pipeline definition.

    Defaults, each overridable: ``batch=True``, ``no_copy=True`` (DALI reads
    mpexec's shared memory in place; :class:`PipelineSource` holds it long
    enough), ``cycle="raise"`` (each DALI epoch is one of ``pipe``'s; reset the
    DALI pipeline after its ``StopIteration``) and ``num_outputs``. Returns what
    DALI's op returns.
    """
    try:
        from nvidia.dali import fn as dali_fn
    except ImportError as exc:
        raise ImportError(
            "mpexec.dali.external_source needs NVIDIA DALI: from a checkout of mpexec, "
            f"{install_command('dali')} (see {INSTALL_DOC}; or feed mpexec.dali.source(pipe) "
            "to your own DALI external_source)"
        ) from exc
    src = source(pipe, outputs, keep)
    n = len(outputs) if outputs is not None else pipe.num_outputs
    options: dict[str, Any] = {"batch": True, "no_copy": True, "cycle": "raise"}
    if n > 1:
        options["num_outputs"] = n
    options.update(kwargs)
    return dali_fn.external_source(source=src, **options)
