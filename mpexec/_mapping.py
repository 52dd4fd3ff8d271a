"""The pools' Executor face: ``submit`` and ``map()`` over ``submit_call``.

:class:`~mpexec.WorkerPool` and ``mpexec.ray.RayPool`` share it (as
:class:`CallExecutor`): each implements the low-level ``submit_call``, and
gets ``submit``, ``Executor.map`` with ``chunksize``, ``ordered`` and
``prefetch`` (a bounded window of calls, results in order), and a ``with``
block that stops at once on Ctrl-C. Both complete their futures with
:func:`settle`.
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
from ._tracebacks import for_caller

T = TypeVar("T")


class CallExecutor(Executor):
    """An Executor over ``submit_call`` (see the module docstring)."""

    num_workers: int
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
        chunksize: int = 1,
        ordered: bool = True,
        prefetch: int | None = None,
    ) -> Iterator[T]:
        """Like ``Executor.map``, with at most ``prefetch`` calls in flight.

        ``prefetch`` defaults to twice the number of workers; ``ordered=False``
        yields results as they complete. ``timeout`` bounds the whole map.
        ``chunksize`` > 1 sends the calls in chunks of that many, one task per
        chunk: for many tiny calls, far less overhead per call. Then
        ``prefetch`` counts chunks, a chunk is one call for the pool's
        ``timeout``, and an exception in a call fails its whole chunk (the
        chunk's other results are not yielded), as in ``ProcessPoolExecutor``.
        """
        check_fn = self._before_map()
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
