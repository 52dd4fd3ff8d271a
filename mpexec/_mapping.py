"""The pools' Executor face: ``submit`` and ``map()`` over ``submit_call``.

:class:`~mpexec.WorkerPool` and ``mpexec.ray.RayPool`` share it (as
:class:`CallExecutor`): each implements the low-level ``submit_call``, and
gets ``submit``, ``Executor.map`` with ``chunksize`` (automatic by default,
see :func:`map_auto`), ``ordered`` and ``prefetch`` (a bounded window of
calls, results in order), and a ``with`` block that stops at once on Ctrl-C.
Both complete their futures with :func:`settle`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import numpy as np

from . import _codec
from ._errors import SerializationError
from ._tracebacks import for_caller, pack_error, unpack_error

T = TypeVar("T")

# Automatic chunking (map's default): once calls prove short, they travel in
# chunks of about AUTO_CHUNK_SECONDS of a worker's CPU time, so that the main
# process's fixed cost per task (100-200 us of its CPU, which on busy cores
# comes out of the workers') is a percent or so of the work. CPU time, not
# wall time: on a loaded host a call's wall time grows, its work does not. A
# chunk still runs at most AUTO_CHUNK_WALL seconds (calls that wait, on I/O
# say, use little CPU), so calls of half that or more go alone. A chunk
# carries at most AUTO_CHUNK_BYTES of arrays (its calls' arguments and
# results, top level), so that reading ahead in chunks holds no more memory
# than a few calls on large arrays would, and at most AUTO_CHUNK_MAX calls.
AUTO_CHUNK_SECONDS = 0.02
AUTO_CHUNK_WALL = 0.05
AUTO_CHUNK_BYTES = 4 << 20
AUTO_CHUNK_MAX = 256


class CallExecutor(Executor):
    """An Executor over ``submit_call`` (see the module docstring)."""

    num_workers: int
    #: Seconds one call may run (a chunk counts as one call), or None.
    timeout: float | None
    #: ``submit_call(fn, args=(), kwargs=None, *, worker=None, view=False)``: the
    #: seam each pool implements (see :meth:`mpexec.WorkerPool.submit_call`).
    submit_call: Callable[..., Future[Any]]

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; a Future of its result.

        Raises :class:`SerializationError` here, in the caller, if ``fn`` or an
        argument cannot be pickled; :class:`PoolClosedError` after ``shutdown``;
        once the pool is broken, a new :class:`BrokenPoolError` like the one
        that broke it (its ``__cause__``), as ``ProcessPoolExecutor`` does.
        """
        return self.submit_call(fn, args, kwargs)

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int | None = None,
        ordered: bool = True,
        prefetch: int | None = None,
    ) -> Iterator[T]:
        """Like ``Executor.map``, with at most ``prefetch`` calls in flight.

        ``prefetch`` defaults to twice the number of workers; ``ordered=False``
        yields results as they complete. ``timeout`` bounds the whole map.

        ``chunksize=None`` (the default) chunks automatically: one call a task
        until the first results show that calls are short, then as many a
        task as take about 20 ms of a worker's CPU (and run at most 50 ms: a
        call of 25 ms or more goes alone), at most 256, with at most 4 MiB of
        arrays in and out; fewer again near the end of an iterable of known
        length. Results still come one per item, and an
        exception is raised at its own item, after the results before it; a
        pool with a per-call ``timeout`` never chunks by itself (its timeout
        is per call), nor does an inline one. ``chunksize=1`` sends every
        call alone. ``chunksize`` > 1 sends the calls in chunks of that many,
        one task per chunk; then an exception in a call fails its whole chunk
        (the chunk's other results are not yielded), as in
        ``ProcessPoolExecutor``. Whenever calls travel in chunks, ``prefetch``
        counts chunks and a chunk is one call for the pool's ``timeout``.
        """
        check_fn = self._before_map()
        if chunksize is None and not self._chunks_by_itself():
            chunksize = 1
        return map_calls(
            self,
            fn,
            iterables,
            workers=self.num_workers,
            timeout=timeout,
            chunksize=chunksize,
            ordered=ordered,
            prefetch=prefetch,
            check_fn=check_fn,
        )

    def _before_map(self) -> bool:
        """Checks before a ``map()``; True: pickle ``fn`` first, to name it in an error."""
        return True

    def _chunks_by_itself(self) -> bool:
        """Whether ``map(chunksize=None)`` may group calls: not under a per-call timeout."""
        return self.num_workers > 0 and self.timeout is None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Ctrl-C: stop now (running calls are abandoned) rather than wait for the queue.
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        self.shutdown(wait=not interrupted, cancel_futures=interrupted)


def map_calls(
    pool: Executor,
    fn: Callable[..., T],
    iterables: tuple[Iterable[Any], ...],
    *,
    workers: int,
    timeout: float | None,
    chunksize: int | None,
    ordered: bool,
    prefetch: int | None,
    check_fn: bool = True,
) -> Iterator[T]:
    """``pool.map(fn, *iterables, ...)``: at most ``prefetch`` calls (or chunks) in flight.

    ``prefetch`` defaults to twice ``workers``; ``timeout`` bounds the whole
    map. With ``chunksize`` > 1 each chunk is one call of :func:`run_chunk`;
    ``check_fn`` pickles ``fn`` first, so that an error names the function
    rather than the wrapper. ``chunksize=None``: :func:`map_auto`.
    """
    if chunksize is not None and (type(chunksize) is not int or chunksize < 1):
        raise ValueError(f"chunksize must be an int >= 1 (or None: automatic), not {chunksize!r}")
    limit = max(1, prefetch or 2 * max(1, workers))
    deadline = None if timeout is None else time.monotonic() + timeout
    calls = zip(*iterables, strict=False)
    if chunksize is None:
        sizer = ChunkSizer(workers, known_length(iterables))
        return map_auto(pool, fn, calls, sizer, limit, deadline, ordered, check_fn)
    if chunksize == 1:
        return map_results(pool, fn, calls, limit, deadline, ordered)
    if check_fn:
        _codec.dump_value(fn)  # name the function, not the wrapper, if it cannot pickle
    chunks = iter(lambda: (tuple(itertools.islice(calls, chunksize)),), ((),))
    # One wrapper per map(): the workers receive and cache it once.
    run = functools.partial(run_chunk, fn)
    return flatten(map_results(pool, run, chunks, limit, deadline, ordered))


def settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``future`` with ``result`` or ``exc``, unless it is done already."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def run_chunk(fn: Callable[..., T], calls: tuple[tuple[Any, ...], ...]) -> list[T]:
    """A chunk of ``map(chunksize=...)``, run in a worker."""
    return [fn(*call) for call in calls]


def run_measured(
    fn: Callable[..., T], calls: tuple[tuple[Any, ...], ...]
) -> tuple[list[T], float, float, int, bytes | None]:
    """A chunk of an automatic ``map()``, run in a worker: what :func:`map_auto` needs.

    ``(results, seconds, cpu seconds, array bytes, error)``: the calls' results
    up to the first that raised, how long they ran (wall time, and this
    thread's CPU time), the bytes of their arrays (in and out, top level), and
    that exception packed (the worker's own way, see :func:`pack_error`), or
    None. Later calls of the chunk are not run.
    """
    results: list[T] = []
    nbytes = 0
    start, cpu = time.perf_counter(), time.thread_time()
    for call in calls:
        try:
            result = fn(*call)
        except BaseException as exc:  # as the worker reports a call's exception
            error = pack_error(exc)
            break
        nbytes += _array_bytes(call) + _array_bytes(result)
        results.append(result)
    else:
        error = None
    return results, time.perf_counter() - start, time.thread_time() - cpu, nbytes, error


def _array_bytes(value: Any) -> int:
    """Bytes of the arrays in ``value``, or among its items (a tuple or list)."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if type(value) is tuple or type(value) is list:
        return sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return 0


def known_length(iterables: tuple[Iterable[Any], ...]) -> int | None:
    """An upper bound on how many calls ``zip(*iterables)`` makes, if any says its length."""
    lengths = []
    for it in iterables:
        try:
            n = operator.length_hint(it, -1)
        except Exception:  # a __len__ that raises: no hint
            n = -1
        if n >= 0:
            lengths.append(n)
    return min(lengths) if lengths else None


class ChunkSizer:
    """How many calls the next chunk of an automatic ``map()`` takes.

    One at first; after each chunk, as many as take :data:`AUTO_CHUNK_SECONDS`
    of CPU, run at most :data:`AUTO_CHUNK_WALL` and carry at most
    :data:`AUTO_CHUNK_BYTES` at the rate that chunk showed (at most twice as
    many as it had: calls that were quick may turn slow). With a known
    length, the last calls go in smaller chunks, so that every worker has a
    share of the end.
    """

    def __init__(self, workers: int, length: int | None) -> None:
        self.size = 1
        self.share = 2 * max(1, workers)  # chunks of the calls left, at least
        self.left = length

    def take(self, calls: Iterator[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
        size = self.size
        if self.left is not None:
            size = max(1, min(size, self.left // self.share))
        chunk = tuple(itertools.islice(calls, size))
        if self.left is not None:
            self.left = max(0, self.left - len(chunk))
        return chunk

    def learn(self, ran: int, seconds: float, cpu: float, nbytes: int) -> None:
        """A chunk ran ``ran`` calls: ``seconds`` (``cpu`` on a CPU), ``nbytes`` of arrays."""
        if ran < 1:
            return
        best = AUTO_CHUNK_MAX
        if cpu > 0:
            best = min(best, int(AUTO_CHUNK_SECONDS * ran / cpu))
        if seconds > 0:
            best = min(best, int(AUTO_CHUNK_WALL * ran / seconds))
        if nbytes > 0:
            best = min(best, AUTO_CHUNK_BYTES * ran // nbytes)
        self.size = max(1, min(best, 2 * ran))


def map_auto(
    pool: Executor,
    fn: Callable[..., T],
    calls: Iterator[tuple[Any, ...]],
    sizer: ChunkSizer,
    limit: int,
    deadline: float | None,
    ordered: bool,
    check_fn: bool = True,
) -> Generator[T, None, None]:
    """``map(chunksize=None)``: chunks of :func:`run_measured`, sized by ``sizer``.

    Each item's result is yielded in turn; an item's exception is raised at
    that item, after the results before it; closing the generator cancels
    the chunks in flight.
    """
    __tracebackhide__ = True  # a call's error is raised from here, for the caller
    chunks = iter(lambda: (sizer.take(calls),), ((),))
    # One wrapper per map(): the workers receive and cache it once.
    run = functools.partial(run_measured, fn)
    outcomes = map_results(pool, run, chunks, limit, deadline, ordered)
    error = None
    try:
        while error is None:
            try:
                results, seconds, cpu, nbytes, error = next(outcomes)
            except StopIteration:
                return
            except SerializationError as exc:
                named = _function_error(fn) if check_fn else None
                if named is not None:
                    # fn itself does not pickle: say so, not the wrapper (its cause kept).
                    named.__suppress_context__ = True
                    raise named  # noqa: B904 - the context is suppressed, not lost
                # The same exception, its own __cause__ kept (a user sees this line).
                raise for_caller(exc)  # noqa: B904
            except Exception as exc:
                raise for_caller(exc)  # noqa: B904 - as above
            sizer.learn(len(results) + (error is not None), seconds, cpu, nbytes)
            yield from results
    finally:
        outcomes.close()  # now, not when collected: it cancels the chunks in flight
    assert error is not None  # the loop ends at the first error, or returns
    raise for_caller(unpack_error(error))


def _function_error(fn: Callable[..., Any]) -> SerializationError | None:
    """The error naming ``fn`` if it cannot be pickled (it, not the wrapper, is at fault)."""
    try:
        _codec.dump_value(fn)
    except SerializationError as exc:
        return exc
    return None


def flatten(chunks: Generator[list[T], None, None]) -> Iterator[T]:
    """The results of each chunk in turn; closing it cancels the chunks in flight."""
    __tracebackhide__ = True  # a call's error is raised from here, for the caller
    try:
        for results in chunks:
            yield from results
    except Exception as exc:
        # The same exception, its own __cause__ kept (a user sees this line).
        raise for_caller(exc)  # noqa: B904
    finally:
        chunks.close()  # now, not when collected: it cancels the chunks in flight


def map_results(
    pool: Executor,
    fn: Callable[..., T],
    calls: Iterator[tuple[Any, ...]],
    limit: int,
    deadline: float | None,
    ordered: bool,
) -> Generator[T, None, None]:
    """Results of ``fn(*call)`` for each call, with at most ``limit`` submitted at once."""
    __tracebackhide__ = True  # a call's error is raised from here, for the caller
    window: collections.deque[Future[T]] = collections.deque()
    try:
        for call in itertools.islice(calls, limit):
            window.append(pool.submit(fn, *call))
        while window:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("map() ran past its timeout")
            if ordered:
                future, timeout = window[0], left
            else:
                done, _ = wait_futures(window, left, return_when=FIRST_COMPLETED)
                if not done:
                    raise TimeoutError("map() ran past its timeout")
                future, timeout = next(iter(done)), None
            try:
                result = future.result(timeout)
            except Exception as exc:
                # The same exception, its own __cause__ kept (a user sees this line).
                raise for_caller(exc)  # noqa: B904
            if ordered:
                window.popleft()
            else:
                window.remove(future)
            for call in itertools.islice(calls, 1):
                window.append(pool.submit(fn, *call))
            yield result
    finally:
        for future in window:
            future.cancel()
