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
import contextlib
import functools
import itertools
import numbers
import operator
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, MutableMapping
from concurrent.futures import FIRST_COMPLETED, Executor, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeoutError
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

import numpy as np

from . import _codec
from ._errors import SerializationError
from ._tracebacks import for_caller, pack_error, unpack_error

T = TypeVar("T")

# One chunk policy, for every runner that takes many calls in one worker task
# (map's automatic chunks, a pipeline's per-sample chunks, mpexec.dali's): a
# chunk carries as many calls as take a target of a worker's CPU
# (calls_in_chunk: AUTO_CHUNK_SECONDS; map's MAP_CHUNK_SECONDS), so that the
# main process's fixed cost per task (its encoding, ring push, result and
# hand-off: 100-450 us of its CPU, which on busy cores
# comes out of the workers') is a few percent of the work even with many
# workers. CPU time, not wall time: on a loaded host a call's wall time grows,
# its work does not, and the chunks must not shrink with the load.
#
# map() adds its own bounds. Calls that wait (I/O) take little CPU: a chunk of
# them runs at most AUTO_CHUNK_WALL_SIZE of wall time. A chunk carries at most
# AUTO_CHUNK_BYTES of arrays (its calls' arguments and results, at any depth:
# {"img": array} counts its array), so that reading ahead in chunks holds no
# more memory than a few calls on large arrays would, and at most
# AUTO_CHUNK_MAX calls. The worker ends a chunk itself, returning the results
# it has, once its calls run AUTO_CHUNK_WALL behind twice the rate the chunk was
# sized at, or once it has made
# AUTO_CHUNK_BYTES of arrays (calls that turned slow, or large, after the ones
# the chunk was sized from), or once the map's caller has given up (its
# timeout): the calls it did not start go out again, spread over the workers
# in chunks sized anew, or not at all. So a result waits in its chunk for at
# most twice the chunk's planned time and AUTO_CHUNK_WALL and one call, and a
# call that was not started when the caller gave up never runs.
AUTO_CHUNK_SECONDS = 0.1
# map()'s own target, larger: a chunk of map() costs the main process 350-450 us
# (submit, result, the sizer, its manager thread's delivery), so at 0.1 s, 50
# calls of 2 ms, it cost 7-10 us a call, and 3.7 at 0.3 s; at 0.4 s (200
# calls) 2.4 (docs/scaling.md). A pipeline's per-sample chunks keep
# AUTO_CHUNK_SECONDS, unchanged: their cost is their scheduler's to weigh.
MAP_CHUNK_SECONDS = 0.4
# A map that starts from the rate an earlier map of its function learned sends its
# first chunk at this target, so that its first result comes after about this long,
# not after a whole chunk (368-378 ms at 2 workers, 533-542 at 16). The rest of
# that chunk follows as the first chunk of the next round, which the same worker
# takes (the first one free): one chunk more a map, the rounds as even. Only in a
# map of at least FIRST_SPLIT_CHUNKS chunks: the chunk more costs the main process
# 350-450 us, half as much again for a map of 2 chunks (mainload's quick epoch at 2
# workers, 512 calls of 2 ms: 0.8 us a call, over the 3 us it is held to).
MAP_FIRST_CHUNK_SECONDS = AUTO_CHUNK_SECONDS
FIRST_SPLIT_CHUNKS = 8
# A batch that its caller waits for alone (mpexec.dali: DALI calls the op one batch
# at a time) is cut finer, for balance: no other batch keeps an idle worker busy.
BALANCE_CHUNK_SECONDS = 0.02
AUTO_CHUNK_WALL_SIZE = 2 * MAP_CHUNK_SECONDS
AUTO_CHUNK_WALL = 0.05
AUTO_CHUNK_BYTES = 4 << 20
AUTO_CHUNK_MAX = 256
# A chunk's results that are small arrays of one shape and dtype travel as one
# block of at most this size, taken apart into rows in the caller in one call:
# per result, the main process then does no decoding of its own. (Small: a row
# kept keeps its block, as a slab allocator's object does; and no larger than an
# array the pool copies inline, _codec.INLINE_MAX, so that the block travels as
# each of its rows would have, in the caller's own memory.)
STACK_BYTES = _codec.INLINE_MAX


def calls_in_chunk(
    cpu_per_call: float, most: int, *, alone: bool = False, target: float | None = None
) -> int:
    """How many calls a chunk carries: :data:`AUTO_CHUNK_SECONDS` of a worker's CPU, 1 to ``most``.

    ``cpu_per_call``: a call's CPU seconds in a worker, as measured (0:
    too quick to time, ``most``). ``alone``: one batch is all the workers
    have, which is cut finer (:data:`BALANCE_CHUNK_SECONDS`). ``target``:
    another CPU time a chunk (``map()``'s, :data:`MAP_CHUNK_SECONDS`).
    """
    if cpu_per_call <= 0:
        return most
    if target is None:
        target = BALANCE_CHUNK_SECONDS if alone else AUTO_CHUNK_SECONDS
    return max(1, min(most, int(target / cpu_per_call)))


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
        until the first results show that calls are short (or sized at once
        from the rate an earlier map of the same function on this pool
        learned: in a map of 8 chunks or more, a first chunk of 0.1 s and
        its rest a round later, so that the first result comes soon), then as many
        a task as take about 0.4 s of a worker's CPU (and run at most 0.8 s:
        a call of 0.4 s or more goes alone; 0.1 s and 0.2 s where the
        iterable's length is unknown), at most 256, with at most 4 MiB
        of arrays in and out (counted at any depth: a dict of arrays counts
        them); an iterable of known length in whole rounds, chunks of one size
        and as many for every worker, so that the workers end together (a
        chunk of the plan may run an eighth over those times while the rate
        of the calls wavers: the plan is not moved for less). The
        worker ends a chunk early, with the results it has, once its calls
        run 50 ms behind twice the rate it was sized at, or made 4 MiB of
        arrays (calls that turned slow or large), or when ``timeout`` has
        passed; the calls it did not start are sent again,
        spread over the workers. So a result waits in its chunk for at most
        twice the chunk's planned time, 50 ms and one call, and a call not
        started when the map times out does not run. Closing the map cancels
        the chunks not started; a chunk running then runs on to its end (its
        planned time, about 0.4 s of a worker's CPU), or to its first call
        that turned slow.
        Results still come one per item, and an exception, or a result
        that cannot be pickled, is raised at its own item, after the results
        before it; a pool with a per-call ``timeout`` never chunks by itself
        (its timeout is per call), nor does an inline one. ``chunksize=1``
        sends every call alone. ``chunksize`` > 1 sends the calls in chunks
        of that many, one task per chunk; then an exception in a call fails
        its whole chunk (the chunk's other results are not yielded), as in
        ``ProcessPoolExecutor``. Whenever calls travel in chunks, ``prefetch``
        counts chunks and a chunk is one call for the pool's ``timeout``.

        An exception raised by an input iterable is raised after the results
        of the items before it, as ``multiprocessing.Pool.imap`` does.
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
            learned=self.__dict__.setdefault("_map_learned", weakref.WeakKeyDictionary()),
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
    learned: MutableMapping[Any, Rate] | None = None,
) -> Iterator[T]:
    """``pool.map(fn, *iterables, ...)``: at most ``prefetch`` calls (or chunks) in flight.

    ``prefetch`` defaults to twice ``workers``; ``timeout`` bounds the whole
    map. With ``chunksize`` > 1 each chunk is one call of :func:`run_chunk`;
    ``check_fn`` pickles ``fn`` first, so that an error names the function
    rather than the wrapper. ``chunksize=None``: :func:`map_auto`, whose
    chunks start from the rate ``learned`` keeps for ``fn`` (per pool: a
    function's map in each epoch does not learn its calls' time again).
    """
    if chunksize is not None and (type(chunksize) is not int or chunksize < 1):
        raise ValueError(f"chunksize must be an int >= 1 (or None: automatic), not {chunksize!r}")
    given: object = prefetch  # what callers pass is not always what the annotation says
    if given is not None and (
        isinstance(given, bool) or not isinstance(given, numbers.Integral) or int(given) < 1
    ):
        raise ValueError(f"prefetch must be an int >= 1 (or None: the default), not {prefetch!r}")
    limit = int(prefetch) if prefetch is not None else 2 * max(1, workers)
    deadline = None if timeout is None else time.monotonic() + timeout
    calls = Inputs(zip(*iterables, strict=False))
    if chunksize is None:
        start = None
        if learned is not None:
            with contextlib.suppress(TypeError):  # not weakly referable, or unhashable
                start = learned.get(fn)
        # At most ``limit`` chunks are in flight: so many workers run them at once.
        sizer = ChunkSizer(min(workers, limit), known_length(iterables), start)
        return map_auto(pool, fn, calls, sizer, limit, deadline, ordered, check_fn, learned)
    if chunksize == 1:
        return map_results(pool, fn, calls, limit, deadline, ordered, calls)
    if check_fn:
        _codec.dump_value(fn)  # name the function, not the wrapper, if it cannot pickle
    chunks = iter(lambda: (calls.take(chunksize),), ((),))
    # One wrapper per map(): the workers receive and cache it once.
    run = functools.partial(run_chunk, fn)
    return Results.over(map_results(pool, run, chunks, limit, deadline, ordered, calls))


class Inputs:
    """The calls of a ``map()``: an input iterable that raises ends them, for now.

    Its exception is raised once the results of the calls before it are
    yielded (:meth:`raise_error`, at the end of the map), as
    ``multiprocessing.Pool.imap`` does: none of the calls sent is lost to it.
    """

    def __init__(self, calls: Iterator[tuple[Any, ...]]) -> None:
        self.calls = calls
        self.error: Exception | None = None

    def __iter__(self) -> Inputs:
        return self

    def __next__(self) -> tuple[Any, ...]:
        if self.error is not None:
            raise StopIteration
        try:
            return next(self.calls)
        except StopIteration:
            raise
        except Exception as exc:
            self.error = exc
            raise StopIteration from None

    def take(self, n: int) -> tuple[tuple[Any, ...], ...]:
        """The next ``n`` calls at most, read in one C loop (no Python call a call).

        An exception ends them as in :meth:`__next__`: ``list.extend`` keeps
        the calls read before it.
        """
        got: list[tuple[Any, ...]] = []
        if self.error is None:
            try:
                got.extend(itertools.islice(self.calls, n))
            except Exception as exc:
                self.error = exc
        return tuple(got)

    def raise_error(self) -> None:
        """Raise the input's exception, if one raised (once)."""
        __tracebackhide__ = True
        error, self.error = self.error, None
        if error is not None:
            raise for_caller(error)


def settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Complete ``future`` with ``result`` or ``exc``, unless it is done already.

    (Asked by setting it, not by ``done()`` first: its lock taken once, not twice.)
    """
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass  # done already: cancelled, or settled by another thread


def run_chunk(fn: Callable[..., T], calls: tuple[tuple[Any, ...], ...]) -> list[T]:
    """A chunk of ``map(chunksize=...)``, run in a worker."""
    return [fn(*call) for call in calls]


def run_measured(
    fn: Callable[..., T],
    wall: float,
    max_bytes: int,
    calls: tuple[tuple[Any, ...], ...],
    stop_at: float | None = None,
    per_call: float = 0.0,
) -> tuple[list[T], float, float, int, bytes | None]:
    """A chunk of an automatic ``map()``, run in a worker: what :func:`map_auto` needs.

    ``(results, seconds, cpu seconds, array bytes, error)``: the calls'
    results (small arrays of one shape and dtype as one block: see
    :func:`stack_results`), how long they ran (wall time, and this thread's CPU time), the
    bytes of their arrays (in and out, at any depth), and the exception of
    the call that raised (or whose result cannot be pickled), packed the
    worker's own way (see :func:`pack_error`), or None. The worker decides
    when the chunk is done: after a call that raised; once the calls have
    run ``wall`` seconds longer than twice ``per_call`` (the wall seconds a
    call took when the chunk was sized; 0: unknown) each: they turned slow,
    the slack keeps a worker that was only descheduled a moment from ending
    its chunk; once they have made ``max_bytes`` of arrays; or once ``stop_at``
    (``time.time()``) has passed, when the caller has given up. The calls
    not run are the caller's to send again, or not.
    """
    results: list[T] = []
    nbytes = 0
    error = None
    start, cpu = time.perf_counter(), time.thread_time()
    slow = 2 * per_call  # a call's time at which the chunk has turned slow
    for call in calls:
        if stop_at is not None and time.time() >= stop_at:
            break  # the map timed out: its caller does not want these
        try:
            result = fn(*call)
        except BaseException as exc:  # as the worker reports a call's exception
            error = pack_error(exc)
            break
        size = _array_bytes(result)
        if size is None:
            # Not only containers, numbers and arrays: see that it pickles now, so that
            # a result that does not fails its own item, not the chunk's others.
            try:
                size = _codec.check(result, "the result")
            except Exception as exc:
                error = pack_error(exc)
                break
        nbytes += sum(_array_bytes(a) or 0 for a in call) + size
        results.append(result)
        if nbytes >= max_bytes:
            break
        if time.perf_counter() - start >= wall + slow * len(results):
            break
    seconds = time.perf_counter() - start
    return stack_results(results), seconds, time.thread_time() - cpu, nbytes, error


def stack_results(results: list[Any]) -> Any:
    """``results`` as one array if they are small arrays of one shape and dtype, else as they are.

    The caller takes it apart with ``list(block)``: each row a view of the
    block, with the result's shape, dtype and values, writable as a result
    is. Not 0-d arrays (a block's rows would be NumPy scalars), subclasses or
    object arrays.
    """
    if len(results) < 2:
        return results
    first = results[0]
    if type(first) is not np.ndarray or not first.ndim or first.dtype.hasobject:
        return results
    if first.nbytes * len(results) > STACK_BYTES:
        return results
    shape, dtype = first.shape, first.dtype
    for r in results:
        if type(r) is not np.ndarray or r.shape != shape or r.dtype != dtype:
            return results
    return np.stack(results)


#: Types whose values pickle as they are and hold no array.
_SCALARS = frozenset({int, float, bool, str, bytes, type(None), complex})
_MAX_DEPTH = 8


def _array_bytes(value: Any, depth: int = 0) -> int | None:
    """Bytes of the arrays in ``value``, at any depth of its tuples, lists and dicts.

    None where it holds anything else (an object, an array of objects, a
    nesting too deep): then only pickling it finds its arrays, or that it
    cannot be pickled.
    """
    kind = type(value)
    if kind in _SCALARS:
        return 0
    if kind is np.ndarray:
        return None if value.dtype.hasobject else int(value.nbytes)
    if isinstance(value, np.generic):
        return None if isinstance(value, np.object_) else 0
    if depth >= _MAX_DEPTH:
        return None
    if kind is tuple or kind is list:
        items = value
    elif kind is dict:
        if not all(type(k) in _SCALARS for k in value):
            return None
        items = value.values()
    else:
        return None
    total = 0
    for item in items:
        n = _array_bytes(item, depth + 1)
        if n is None:
            return None
        total += n
    return total


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


#: A chunk's measure, the rate a map learns from: (calls run, their wall seconds,
#: CPU seconds, array bytes).
Rate = tuple[int, float, float, int]


def fitting_calls(rate: Rate, target: float, floor: int = 0) -> int:
    """How many calls at ``rate`` a chunk of ``target`` CPU seconds takes, within the bounds.

    At most :data:`AUTO_CHUNK_MAX`, :data:`AUTO_CHUNK_BYTES` of arrays and a wall
    time in the proportion :data:`AUTO_CHUNK_WALL_SIZE` is to
    :data:`MAP_CHUNK_SECONDS`, but not under ``floor`` by wall time.
    """
    ran, seconds, cpu, nbytes = rate
    best = calls_in_chunk(cpu / ran, AUTO_CHUNK_MAX, target=target)
    if seconds > 0:
        wall = AUTO_CHUNK_WALL_SIZE * target / MAP_CHUNK_SECONDS
        best = min(best, max(int(wall * ran / seconds), floor))
    if nbytes > 0:
        best = min(best, AUTO_CHUNK_BYTES * ran // nbytes)
    return max(1, best)


class ChunkSizer:
    """How many calls the next chunk of an automatic ``map()`` takes.

    One at first; after each chunk, as many as take the map's target of CPU
    (:data:`MAP_CHUNK_SECONDS`; :data:`AUTO_CHUNK_SECONDS` where the length is
    unknown), within the bounds of :func:`fitting_calls`, at the rate that
    chunk showed, at once (but by wall time, by half at most unless its
    worker ended it: calls that turn slow after it are the worker's to stop,
    :func:`run_measured`). ``learned``: the rate an earlier ``map()`` of the
    same function on the same pool ended with (a rate, not a size: each map
    sizes from it for its own target). A map of known length that starts from
    it, in :data:`FIRST_SPLIT_CHUNKS` chunks or more, sends its first chunk at
    :data:`MAP_FIRST_CHUNK_SECONDS`, so that its first result does not wait a
    whole chunk, and the rest of that chunk as the next round's first: the two
    one chunk of the plan, on one worker (the first one free).
    With a known length, the calls are planned in whole rounds: the fewest
    chunks of one size (within one call) at most that target whose count is a
    multiple of ``workers`` (the chunks in flight at most), so that each
    worker gets as many and all end together. With chunks sized only by the
    target, the last round was part full: 8,192 calls of 2 ms on 16 workers
    went in 88 chunks, 5.5 a worker, and half the workers stood idle for the
    last chunk's 0.2 s, 8% of the map. The plan holds while its chunks stay
    within an eighth over the target and the target within a quarter over
    them (a rate that wavers must not move it by a round and back: workers
    would end a chunk apart), whatever a chunk far smaller than the target
    says (its rate says little); the small chunks sent first, to learn the
    rate, are not in its rounds. At most ``workers`` - 1 chunks more than
    the target alone needs.
    """

    def __init__(self, workers: int, length: int | None, learned: Rate | None = None) -> None:
        self.workers = max(1, workers)
        self.left = length
        # Of unknown length (a generator's), no rounds even its end out: the workers'
        # last chunks end apart, by up to one chunk, so these keep the smaller target.
        self.target = MAP_CHUNK_SECONDS if length is not None else AUTO_CHUNK_SECONDS
        self.rate = learned
        self.size, self.per_call = 1, 0.0
        self.split = 0  # the first chunk's size, when it is a part of the plan's first
        self.owed = 0  # the rest of that chunk, sent as the next round's first
        if learned is not None:
            self.size, self.per_call = fitting_calls(learned, self.target), learned[1] / learned[0]
            if length is not None and length >= FIRST_SPLIT_CHUNKS * self.size:
                self.split = fitting_calls(learned, MAP_FIRST_CHUNK_SECONDS)
        self.taken = 0  # chunks taken
        self.base = 0  # chunks taken before the plan's first (small ones, sent to learn the rate)
        self.plan: int | None = None  # chunks planned for the calls left (known length)
        self.planned_at = 0  # the target it was made for
        self.sure = True  # the last chunk learned from was not small beside the target

    @property
    def learned(self) -> Rate | None:
        """The rate to start the next map of the same function from (None: none learned)."""
        return self.rate

    def next_size(self, handed_back: int = 0) -> int:
        """The next chunk's size, ``handed_back`` calls (that a worker did not run) pending."""
        size = max(1, self.size)
        if self.left is None:
            return size
        left = self.left + handed_back
        if left <= 0:
            return size
        plan = self.plan
        if plan is None or plan < 1 or 2 * self.planned_at <= size:
            # The first plan, or one for a target far smaller than this (the first chunks,
            # sent to learn the rate): the chunks so far do not count in the rounds.
            self.base, plan = self.taken, None
        else:
            planned = -(-left // plan)
            if self.sure and (
                8 * planned > 9 * size  # the calls turned slower: more chunks
                or 4 * -(-left // self._chunks_for(left, size)) >= 5 * planned  # faster: fewer
            ):
                plan = None
        if plan is None:
            plan, self.planned_at = self._chunks_for(left, size), size
        self.plan = plan
        return -(-left // plan)

    def _chunks_for(self, left: int, size: int) -> int:
        """How many chunks ``left`` calls take, at most ``size`` each, so that the plan's
        chunks (those taken since it began, and these) are whole rounds: as many a worker."""
        need = -(-left // size)
        return need + (-(self.taken - self.base + need)) % self.workers

    def take(self, calls: Iterator[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
        """The next chunk's calls, read from ``calls`` (none: they are all taken)."""
        if self.owed and self.taken == self.workers:
            # The rest of the first chunk, the next round's first: one chunk of the plan
            # with it (its calls counted taken then), sent where the small one ran.
            n, self.owed = self.owed, 0
            return calls.take(n) if type(calls) is Inputs else tuple(itertools.islice(calls, n))
        n = self.next_size()
        owed = 0
        if self.taken == 0 and 0 < self.split < n:
            owed, n = n - self.split, self.split
            self.owed = owed
        chunk = calls.take(n) if type(calls) is Inputs else tuple(itertools.islice(calls, n))
        if self.left is not None:
            self.left = max(0, self.left - len(chunk) - owed)
            if self.plan is not None:
                self.plan -= 1
        self.taken += 1
        return chunk

    def learn(self, ran: int, seconds: float, cpu: float, nbytes: int, ended: bool = False) -> None:
        """A chunk ran ``ran`` calls: ``seconds`` (``cpu`` on a CPU), ``nbytes`` of arrays.

        ``ended``: its worker ended it early, its calls having turned slow.
        """
        if ran < 1:
            return
        rate = (ran, seconds, cpu, nbytes)
        # Wall time: by half at most a chunk that ran all its calls (a worker
        # descheduled a while on a busy host is not calls that turned slow).
        best = fitting_calls(rate, self.target, 0 if ended else self.size // 2)
        # A chunk far smaller than the target (one of the first, sent to learn the rate)
        # says too little to move the plan of a known length by itself, or to be kept.
        self.sure = ended or 4 * ran >= self.size
        if self.sure or self.rate is None:
            self.rate = rate
        self.size = best
        self.per_call = seconds / ran


class _Chunk:
    """Calls of an automatic ``map()`` in a task, or handed back unrun (``future`` None)."""

    __slots__ = ("calls", "future")

    def __init__(self, calls: tuple[tuple[Any, ...], ...], future: Future[Any] | None) -> None:
        self.calls = calls
        self.future = future


class Results(itertools.chain[T]):
    """A ``map()``'s results: each chunk's in turn, item by item in C; ``close()`` cancels.

    ``itertools.chain`` over the generator of chunks, not a generator that
    yields each item: no Python frame resumed an item (one a chunk).
    """

    __slots__ = ("chunks",)
    chunks: Generator[Any, None, None]

    @classmethod
    def over(cls, chunks: Generator[Any, None, None]) -> Results[Any]:
        """The items of each of ``chunks`` (lists) in turn."""
        results: Results[Any] = cls.from_iterable(chunks)  # type: ignore[assignment]
        results.chunks = chunks
        return results

    def close(self) -> None:
        """Stop: the chunks in flight are cancelled now, not when collected."""
        self.chunks.close()


def map_auto(
    pool: Executor,
    fn: Callable[..., T],
    calls: Iterator[tuple[Any, ...]],
    sizer: ChunkSizer,
    limit: int,
    deadline: float | None,
    ordered: bool,
    check_fn: bool = True,
    learned: MutableMapping[Any, Rate] | None = None,
) -> Results[T]:
    """``map(chunksize=None)``: chunks of :func:`run_measured`, sized by ``sizer``.

    ``learned``: where the sizer's last rate is kept for ``fn``'s next map.

    Each item's result is yielded in turn; an item's exception is raised at
    that item, after the results before it; closing the generator cancels
    the chunks in flight. A chunk that its worker ended early hands back the
    calls it did not run: they are sent again, in chunks sized anew, before
    any new call, and keep their place in the order of the results.
    """
    chunks = _auto_chunks(pool, fn, calls, sizer, limit, deadline, ordered, check_fn, learned)
    return Results.over(chunks)


def _auto_chunks(
    pool: Executor,
    fn: Callable[..., T],
    calls: Iterator[tuple[Any, ...]],
    sizer: ChunkSizer,
    limit: int,
    deadline: float | None,
    ordered: bool,
    check_fn: bool,
    learned: MutableMapping[Any, Rate] | None,
) -> Generator[list[T], None, None]:
    """:func:`map_auto`'s results, a chunk's at a time."""
    __tracebackhide__ = True  # a call's error is raised from here, for the caller
    # One wrapper per map(): the workers receive and cache it once. The budgets go
    # with it, read now (a worker's module is not this process's).
    run = functools.partial(run_measured, fn, AUTO_CHUNK_WALL, AUTO_CHUNK_BYTES)
    # The deadline on the clock every process (and node) shares.
    stop_at = None if deadline is None else time.time() + (deadline - time.monotonic())
    chunks: list[_Chunk] = []  # in the order of their results (ordered: the order yielded)
    sent, ended, back_out = 0, False, 0  # back_out: chunks of calls handed back, unsent

    def fill() -> None:
        """Send chunks until ``limit`` are out: calls handed back first, then new ones."""
        nonlocal sent, ended, back_out
        while sent < limit:
            if back_out:
                back = next(i for i, c in enumerate(chunks) if c.future is None)
                rest = chunks[back]
                # They turned slow or large: spread over the workers, sized anew.
                n = min(sizer.next_size(len(rest.calls)), -(-len(rest.calls) // sizer.workers))
                piece, rest.calls = rest.calls[:n], rest.calls[n:]
                out = _Chunk(piece, pool.submit(run, piece, stop_at, sizer.per_call))
                if rest.calls:
                    chunks.insert(back, out)
                else:
                    chunks[back] = out
                    back_out -= 1
            elif ended:
                return
            else:
                piece = sizer.take(calls)
                if not piece:
                    ended = True
                    return
                chunks.append(_Chunk(piece, pool.submit(run, piece, stop_at, sizer.per_call)))
            sent += 1

    error = None
    try:
        fill()
        while chunks and error is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise FutureTimeoutError("map() ran past its timeout")
            if ordered:
                chunk, timeout = chunks[0], left
            else:
                futures = [c.future for c in chunks if c.future is not None]
                done, _ = wait_futures(futures, left, return_when=FIRST_COMPLETED)
                if not done:
                    raise FutureTimeoutError("map() ran past its timeout")
                chunk, timeout = next(c for c in chunks if c.future in done), None
            assert chunk.future is not None  # fill() sends the first calls handed back
            try:
                results, seconds, cpu, nbytes, error = chunk.future.result(timeout)
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
            sent -= 1
            if type(results) is np.ndarray:  # small arrays as one block: its rows
                results = list(results)
            ran = len(results) + (error is not None)
            if error is None and ran < len(chunk.calls):
                # Handed back: the calls turned slow or large. Sized anew before they go.
                chunk.calls, chunk.future = chunk.calls[ran:], None
                back_out += 1
                sizer.learn(ran, seconds, cpu, nbytes, ended=True)
                fill()
            else:
                chunks.remove(chunk)
                if error is None:
                    fill()  # first: the next chunk goes out before this one is read
                sizer.learn(ran, seconds, cpu, nbytes)
            yield results
    finally:
        for c in chunks:
            if c.future is not None:
                c.future.cancel()  # now, not when collected
        if learned is not None and sizer.learned is not None:
            with contextlib.suppress(TypeError):  # not weakly referable, or unhashable
                learned[fn] = sizer.learned
    if error is not None:
        raise for_caller(unpack_error(error))
    if isinstance(calls, Inputs):
        calls.raise_error()


def _function_error(fn: Callable[..., Any]) -> SerializationError | None:
    """The error naming ``fn`` if it cannot be pickled (it, not the wrapper, is at fault)."""
    try:
        _codec.dump_value(fn)
    except SerializationError as exc:
        return exc
    return None


def map_results(
    pool: Executor,
    fn: Callable[..., T],
    calls: Iterator[tuple[Any, ...]],
    limit: int,
    deadline: float | None,
    ordered: bool,
    inputs: Inputs | None = None,
) -> Generator[T, None, None]:
    """Results of ``fn(*call)`` for each call, with at most ``limit`` submitted at once.

    ``inputs``: where the calls come from, whose exception ends the results.
    """
    __tracebackhide__ = True  # a call's error is raised from here, for the caller
    window: collections.deque[Future[T]] = collections.deque()
    try:
        for call in itertools.islice(calls, limit):
            window.append(pool.submit(fn, *call))
        while window:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise FutureTimeoutError("map() ran past its timeout")
            if ordered:
                future, timeout = window[0], left
            else:
                done, _ = wait_futures(window, left, return_when=FIRST_COMPLETED)
                if not done:
                    raise FutureTimeoutError("map() ran past its timeout")
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
    if inputs is not None:
        inputs.raise_error()
