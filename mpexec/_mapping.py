"""``map()`` for the pools: a bounded window of calls, chunks, results in order.

:class:`~mpexec.WorkerPool` and ``mpexec.ray.RayPool`` share it: both offer
``Executor.map`` with ``chunksize``, ``ordered`` and ``prefetch``, over their
own ``submit``.
"""

from __future__ import annotations

import collections
import functools
import itertools
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from . import _codec

T = TypeVar("T")


def map_calls(
    pool: Executor,
    fn: Callable[..., T],
    iterables: tuple[Iterable[Any], ...],
    *,
    workers: int,
    timeout: float | None,
    chunksize: int,
    ordered: bool,
    prefetch: int | None,
    check_fn: bool = True,
) -> Iterator[T]:
    """``pool.map(fn, *iterables, ...)``: at most ``prefetch`` calls (or chunks) in flight.

    ``prefetch`` defaults to twice ``workers``; ``timeout`` bounds the whole
    map. With ``chunksize`` > 1 each chunk is one call of :func:`run_chunk`;
    ``check_fn`` pickles ``fn`` first, so that an error names the function
    rather than the wrapper.
    """
    if type(chunksize) is not int or chunksize < 1:
        raise ValueError(f"chunksize must be an int >= 1, not {chunksize!r}")
    limit = max(1, prefetch or 2 * max(1, workers))
    deadline = None if timeout is None else time.monotonic() + timeout
    calls = zip(*iterables, strict=False)
    if chunksize == 1:
        return map_results(pool, fn, calls, limit, deadline, ordered)
    if check_fn:
        _codec.dump_value(fn)  # name the function, not the wrapper, if it cannot pickle
    chunks = iter(lambda: (tuple(itertools.islice(calls, chunksize)),), ((),))
    # One wrapper per map(): the workers receive and cache it once.
    run = functools.partial(run_chunk, fn)
    return flatten(map_results(pool, run, chunks, limit, deadline, ordered))


def run_chunk(fn: Callable[..., T], calls: tuple[tuple[Any, ...], ...]) -> list[T]:
    """A chunk of ``map(chunksize=...)``, run in a worker."""
    return [fn(*call) for call in calls]


def flatten(chunks: Generator[list[T], None, None]) -> Iterator[T]:
    """The results of each chunk in turn; closing it cancels the chunks in flight."""
    try:
        for results in chunks:
            yield from results
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
    window: collections.deque[Future[T]] = collections.deque()
    try:
        for call in itertools.islice(calls, limit):
            window.append(pool.submit(fn, *call))
        while window:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("map() ran past its timeout")
            if ordered:
                result = window[0].result(left)
                window.popleft()
            else:
                done, _ = wait_futures(window, left, return_when=FIRST_COMPLETED)
                if not done:
                    raise TimeoutError("map() ran past its timeout")
                first = next(iter(done))
                window.remove(first)
                result = first.result()
            for call in itertools.islice(calls, 1):
                window.append(pool.submit(fn, *call))
            yield result
    finally:
        for future in window:
            future.cancel()
