"""``map()``'s automatic chunking (``chunksize=None``, the default): what a user keeps.

Order, one result per item, an exception at its own item, laziness over an
endless iterable, a pool timeout that stays per call, bounded memory a chunk.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
import mpexec._mapping
from mpexec import WorkerPool
from mpexec._mapping import (
    AUTO_CHUNK_BYTES,
    AUTO_CHUNK_MAX,
    AUTO_CHUNK_SECONDS,
    AUTO_CHUNK_WALL_SIZE,
    FIRST_SPLIT_CHUNKS,
    MAP_CHUNK_SECONDS,
    MAP_FIRST_CHUNK_SECONDS,
    ChunkSizer,
    calls_in_chunk,
    known_length,
)
from tests.conftest import wait_until

T = 30  # every wait in this file is bounded by this

pytestmark = pytest.mark.usefixtures("no_leaks")


def _square(x: int) -> int:
    return x * x


def _add(a: int, b: int) -> int:
    return a + b


def _fail_at(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x * x


def _slow_square(x: int) -> int:
    time.sleep(1.25 * AUTO_CHUNK_WALL_SIZE)  # longer than a chunk's longest run: never chunked
    return x * x


def _identity(x: Any) -> Any:
    return x


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("holds a lock")
        self.lock = threading.Lock()


def _raise_unpicklable(x: int) -> int:
    if x == 50:
        raise _Unpicklable
    return x


# ---------------------------------------------------------------- end to end
def test_short_calls_travel_in_chunks_and_come_back_one_per_item_in_order() -> None:
    n = 2000
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(n), timeout=T)) == [x * x for x in range(n)]
        tasks = pool.stats().submitted
        assert tasks < n // 4, f"{tasks} tasks for {n} trivial calls: not chunked"
        unordered = pool.map(_add, range(n), range(n), ordered=False, timeout=T)
        assert sorted(unordered) == [2 * x for x in range(n)]
        assert list(pool.map(_square, [], timeout=T)) == []


def test_calls_longer_than_a_chunk_go_alone() -> None:
    with WorkerPool(2) as pool:
        assert list(pool.map(_slow_square, range(6), timeout=T)) == [x * x for x in range(6)]
        assert pool.stats().submitted == 6


def test_a_pool_timeout_stays_per_call() -> None:
    with WorkerPool(2, timeout=T) as pool:
        assert list(pool.map(_square, range(300), timeout=T)) == [x * x for x in range(300)]
        assert pool.stats().submitted == 300


def test_chunksize_1_sends_every_call_alone() -> None:
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(300), chunksize=1, timeout=T)) == [
            x * x for x in range(300)
        ]
        assert pool.stats().submitted == 300


@pytest.mark.parametrize("bad", [0, 1, 700])
def test_an_error_is_raised_at_its_item_after_the_results_before_it(bad: int) -> None:
    with WorkerPool(2) as pool:
        results = pool.map(_fail_at, range(1000), itertools.repeat(bad), timeout=T)
        got = [next(results) for _ in range(bad)]
        assert got == [x * x for x in range(bad)]
        with pytest.raises(ValueError, match=f"bad item {bad}") as info:
            next(results)
        assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
        assert "_fail_at" in str(info.value.__cause__)
        with pytest.raises(StopIteration):
            next(results)  # a raised map() is over
        if bad > 100:
            assert pool.stats().submitted < bad // 4, "not chunked: the test proves nothing"
        assert list(pool.map(_square, range(3), timeout=T)) == [0, 1, 4]


def test_an_error_in_an_unordered_map_keeps_its_type_and_traceback() -> None:
    with WorkerPool(2) as pool:
        results = pool.map(_fail_at, range(1000), itertools.repeat(600), ordered=False, timeout=T)
        got = []
        with pytest.raises(ValueError, match="bad item 600") as info:
            got.extend(results)
        assert "_fail_at" in str(info.value.__cause__)
        assert set(got) <= {x * x for x in range(1000) if x != 600}


def test_an_exception_that_cannot_be_pickled_is_reported_at_its_item() -> None:
    with WorkerPool(2) as pool:
        results = pool.map(_raise_unpicklable, range(400), timeout=T)
        assert [next(results) for _ in range(50)] == list(range(50))
        with pytest.raises(mpexec.SerializationError, match="_Unpicklable"):
            next(results)


def test_an_unpicklable_function_is_named() -> None:
    lock = threading.Lock()
    with WorkerPool(1) as pool, pytest.raises(mpexec.SerializationError, match="lock") as info:
        list(pool.map(lambda x: (lock, x), range(4), timeout=T))
    assert info.value.__cause__ is not None, "the pickling error it names is its cause"


def test_an_endless_iterable_is_read_lazily_and_closing_stops_it() -> None:
    pulled = 0

    def endless() -> Iterator[int]:
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield i

    with WorkerPool(2) as pool:
        results = pool.map(_square, endless(), timeout=T)
        assert next(results) == 0
        assert pulled <= 2 * pool.num_workers + 1, "read ahead before any chunk came back"
        got = [0] + [next(results) for _ in range(2999)]
        assert got == [x * x for x in range(3000)]
        # At most the window of chunks (twice the workers), each of at most the largest size.
        assert pulled <= 3000 + (2 * pool.num_workers + 1) * AUTO_CHUNK_MAX
        assert pool.stats().submitted < 3000 // 4, "not chunked: the test proves nothing"
        results.close()
        before = pulled
        assert list(pool.map(_square, range(5), timeout=T)) == [0, 1, 4, 9, 16]
        assert pulled == before, "a closed map read on"


def test_a_chunk_carries_a_bounded_size_of_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 KiB in and 64 KiB out a call, at most 256 KiB a chunk: two calls a chunk at most.
    monkeypatch.setattr(mpexec._mapping, "AUTO_CHUNK_BYTES", 256 << 10)
    n, half = 128, 64 << 10
    arrays = (np.full(half // 8, i, np.float64) for i in range(n))  # no length
    with WorkerPool(2) as pool:
        for i, out in enumerate(pool.map(_identity, arrays, timeout=T)):
            assert out[0] == i
            assert out.nbytes == half
        tasks = pool.stats().submitted
    assert n // 2 <= tasks < n, tasks


# ---------------------------------------------------------------- the sizing rule
KNOWN = 10**9  # a map of known length, long: its chunks at MAP_CHUNK_SECONDS


def test_a_map_of_unknown_length_keeps_the_smaller_target() -> None:
    # With no rounds planned, the workers' last chunks end apart by up to a chunk: a
    # generator's map at 16 workers ended at 1.29 of ideal with MAP_CHUNK_SECONDS, 1.12
    # with AUTO_CHUNK_SECONDS (docs/scaling.md).
    sizer = ChunkSizer(workers=16, length=None)
    sizer.learn(ran=4, seconds=4 * 0.002, cpu=4 * 0.002, nbytes=0)
    assert sizer.size == calls_in_chunk(0.002, AUTO_CHUNK_MAX)
    sizer.learn(ran=16, seconds=16 * 0.002, cpu=16 * 1e-6, nbytes=0)  # calls that wait
    want = int(AUTO_CHUNK_WALL_SIZE * AUTO_CHUNK_SECONDS / MAP_CHUNK_SECONDS / 0.002)
    assert sizer.size == max(want, calls_in_chunk(0.002, AUTO_CHUNK_MAX) // 2)
    known = ChunkSizer(workers=16, length=KNOWN)
    known.learn(ran=4, seconds=4 * 0.002, cpu=4 * 0.002, nbytes=0)
    assert known.size == calls_in_chunk(0.002, AUTO_CHUNK_MAX, target=MAP_CHUNK_SECONDS)


def test_chunk_size_goes_to_the_target_at_once() -> None:
    """No doubling from one call: a chunk that turns slow is its worker's to end."""
    sizer = ChunkSizer(workers=2, length=KNOWN)
    assert sizer.size == 1
    ms = 1e-3  # a millisecond of CPU a call: MAP_CHUNK_SECONDS / ms calls make the target
    sizer.learn(ran=1, seconds=ms, cpu=ms, nbytes=0)
    assert sizer.size == min(AUTO_CHUNK_MAX, int(MAP_CHUNK_SECONDS / ms))
    assert sizer.per_call == ms  # what the worker compares its calls with
    slow = 0.75 * AUTO_CHUNK_WALL_SIZE  # over MAP_CHUNK_SECONDS of CPU and half the wall bound
    sizer.learn(ran=20, seconds=20 * slow, cpu=20 * slow, nbytes=0)  # turned slow: alone at once
    assert sizer.size == 1
    sizer.learn(ran=1, seconds=0.0, cpu=0.0, nbytes=0)  # too quick to time: the cap
    assert sizer.size == AUTO_CHUNK_MAX


def test_a_map_of_2_ms_calls_goes_in_chunks_of_the_target_cpu_time() -> None:
    """The one policy in CPU time: AUTO_CHUNK_SECONDS of a worker's CPU (a pipeline's
    per-sample chunks), MAP_CHUNK_SECONDS for map()'s (0.4 s: 200 calls of 2 ms)."""
    assert calls_in_chunk(0.002, AUTO_CHUNK_MAX) == int(AUTO_CHUNK_SECONDS / 0.002)
    assert calls_in_chunk(0.002, 64) == min(64, int(AUTO_CHUNK_SECONDS / 0.002))
    assert calls_in_chunk(0.0, 64) == 64  # too quick to time
    assert calls_in_chunk(10.0, 64) == 1
    assert calls_in_chunk(0.002, 1000, target=0.5) == 250
    sizer = ChunkSizer(workers=16, length=KNOWN)
    sizer.learn(ran=4, seconds=4 * 0.002, cpu=4 * 0.002, nbytes=4 * 64)
    assert sizer.size == calls_in_chunk(0.002, AUTO_CHUNK_MAX, target=MAP_CHUNK_SECONDS)
    # A chunk of map() costs its main process ~450 µs (docs/scaling.md, "what a chunk
    # costs"): at most 3 µs a call takes 150 calls a chunk, CPU-bound calls included.
    assert sizer.size * 3e-6 >= 450e-6, f"{sizer.size} calls of 2 ms a chunk: > 3 µs a call"


def test_chunk_size_follows_cpu_time_within_a_wall_time_bound() -> None:
    ms = 1e-3
    sizer = ChunkSizer(workers=2, length=KNOWN)
    sizer.size = 16
    # A loaded host: 1 ms of CPU a call took 2 ms; the CPU target still rules.
    sizer.learn(ran=16, seconds=16 * 2 * ms, cpu=16 * ms, nbytes=0)
    assert sizer.size == min(AUTO_CHUNK_MAX, int(MAP_CHUNK_SECONDS / ms))
    # Calls that wait (I/O): little CPU, but a chunk runs at most AUTO_CHUNK_WALL_SIZE,
    # reached by halves (a worker descheduled a moment is not calls turned slow).
    sizer.learn(ran=16, seconds=16 * 5 * ms, cpu=16 * 0.01 * ms, nbytes=0)
    assert sizer.size == max(
        int(AUTO_CHUNK_WALL_SIZE / (5 * ms)), min(AUTO_CHUNK_MAX, int(MAP_CHUNK_SECONDS / ms)) // 2
    )
    sizer.learn(ran=16, seconds=16 * 5 * ms, cpu=16 * 0.01 * ms, nbytes=0)
    assert sizer.size == int(AUTO_CHUNK_WALL_SIZE / (5 * ms))
    sizes = []
    wait = 0.75 * AUTO_CHUNK_WALL_SIZE  # over half the wall bound: alone
    for _ in range(8):
        sizer.learn(ran=4, seconds=4 * wait, cpu=4 * 0.0001, nbytes=0)
        sizes.append(sizer.size)
    assert sizes[0] == int(AUTO_CHUNK_WALL_SIZE / (5 * ms)) // 2
    assert sizes[-1] == 1
    # A chunk its worker ended (its calls turned slow): its rate holds at once.
    sizer.size = 40
    sizer.learn(ran=4, seconds=4 * wait, cpu=4 * 0.0001, nbytes=0, ended=True)
    assert sizer.size == 1


def test_chunk_size_keeps_within_the_bytes_bound() -> None:
    sizer = ChunkSizer(workers=2, length=None)
    for _ in range(10):
        sizer.learn(ran=sizer.size, seconds=0.0, cpu=0.0, nbytes=sizer.size * (1 << 20))
    assert sizer.size == AUTO_CHUNK_BYTES >> 20
    sizer.learn(ran=2, seconds=0.0, cpu=0.0, nbytes=2 * AUTO_CHUNK_BYTES)
    assert sizer.size == 1


def _sizes(sizer: ChunkSizer, length: int, learn: Any = None) -> list[int]:
    """The sizes ``sizer`` takes ``length`` calls in; ``learn(sizer, ran)`` after each chunk."""
    calls = iter([(i,) for i in range(length)])
    sizes = []
    while chunk := sizer.take(calls):
        sizes.append(len(chunk))
        if learn is not None:
            learn(sizer, len(chunk))
    assert sum(sizes) == length
    return sizes


def _sized(workers: int, length: int, size: int, per_call: float) -> ChunkSizer:
    """A sizer of a map under way: at ``size``, calls of ``per_call`` wall seconds."""
    sizer = ChunkSizer(workers=workers, length=length)
    sizer.size, sizer.per_call = size, per_call
    return sizer


def _per_worker(sizes: list[int], workers: int) -> list[int]:
    """Calls each worker runs when equal workers take the chunks in turn (in lockstep)."""
    return [sum(sizes[w::workers]) for w in range(workers)]


@pytest.mark.parametrize(
    ("workers", "length", "size"),
    [(2, 100, 50), (2, 130, 50), (2, 1000, 50), (16, 8192, 96), (64, 32768, 96), (16, 100, 96)],
)
def test_a_known_length_goes_in_whole_rounds(workers: int, length: int, size: int) -> None:
    """Chunks of one size, as many for every worker: all end together (mainload's 8,192
    calls of 2 ms on 16 workers went in 88 chunks, half the workers idle the last 0.2 s)."""
    sizer = _sized(workers, length, size, 0.002)
    sizes = _sizes(sizer, length)
    assert max(sizes) <= size
    assert max(sizes) - min(sizes) <= 1, sizes
    if length >= workers:
        assert len(sizes) % workers == 0, f"{len(sizes)} chunks for {workers} workers"
    # Not one chunk a call at the end: less than a round more than the calls need.
    assert len(sizes) < -(-length // size) + workers
    share = _per_worker(sizes, workers)
    assert max(share) - min(share) <= len(sizes) // workers, share  # a call a round at most


def test_a_map_ends_in_few_chunks_for_many_workers() -> None:
    """64 workers, 7,680 calls of 2 ms: chunks of the target to the end, not one a call."""
    for cpu in (0.002, 0.0):  # calls on a CPU, and calls that wait (mainload's stand-in)
        sizer = ChunkSizer(workers=64, length=7680)
        sizer.take(iter([(0,)]))
        sizer.learn(ran=1, seconds=0.002, cpu=cpu, nbytes=0)
        sizes = [1, *_sizes(sizer, 7679)]
        best = calls_in_chunk(cpu, int(AUTO_CHUNK_WALL_SIZE / 0.002))
        # Whole rounds: less than a round more than the target needs (was 597 chunks).
        assert len(sizes) < -(-7680 // best) + 64 + 1, f"{len(sizes)} chunks"
        assert (len(sizes) - 1) % 64 == 0  # the first one, sent to learn the rate, apart


def test_the_first_chunks_sent_to_learn_the_rate_are_not_in_the_rounds() -> None:
    """A first map: a window of one-call chunks (and the one sent as the first comes back),
    each saying its own rate; then whole rounds of one size, which those rates do not move."""
    workers, length = 16, 8192
    sizer = ChunkSizer(workers=workers, length=length)
    calls = iter([(i,) for i in range(length)])
    first = [len(sizer.take(calls)) for _ in range(2 * workers + 1)]
    assert first == [1] * (2 * workers + 1)
    walls = itertools.cycle([0.0021, 0.0030, 0.0019, 0.0024])  # one sleep each: they waver

    probes = iter(range(2 * workers))  # the rest of the first window's chunks come back

    def learn(s: ChunkSizer, ran: int) -> None:
        if next(probes, None) is not None:
            s.learn(ran=1, seconds=next(walls), cpu=1e-5, nbytes=0)

    sizer.learn(ran=1, seconds=0.002, cpu=1e-5, nbytes=0)
    rest = _sizes(sizer, length - len(first), learn)
    assert len(rest) % workers == 0, f"{len(rest)} chunks after the first for {workers} workers"
    assert max(rest) - min(rest) <= 1, rest
    assert max(rest) <= int(AUTO_CHUNK_WALL_SIZE / 0.002)


def test_a_wavering_rate_does_not_move_the_plan() -> None:
    """Chunks whose rate wavers a few % around a round's edge keep one plan: moving it by a
    round and back left workers a chunk apart at the end (mainload's 64 workers: 86 and 66
    alternating, 0.07 of the map idle)."""
    workers, length = 64, 32768
    sizer = _sized(workers, length, 96, 0.002)
    # 86 and 84 calls a target: 32,768 calls take 382 chunks (6 rounds: 384) at 86, 391
    # (7 rounds: 448) at 84.
    walls = itertools.cycle([AUTO_CHUNK_WALL_SIZE / 86, AUTO_CHUNK_WALL_SIZE / 84.5])

    def learn(s: ChunkSizer, ran: int) -> None:
        s.learn(ran=ran, seconds=ran * next(walls), cpu=ran * 1e-5, nbytes=0)

    sizes = _sizes(sizer, length, learn)
    assert len(sizes) % workers == 0, f"{len(sizes)} chunks"
    assert max(sizes) - min(sizes) <= 1, sorted(set(sizes))
    share = _per_worker(sizes, workers)
    assert max(share) - min(share) <= len(sizes) // workers, share


def test_calls_that_turn_slower_get_a_new_plan_of_whole_rounds() -> None:
    """The plan holds within an eighth of the target; past it, more chunks, whole rounds."""
    workers, length = 4, 4000
    per = AUTO_CHUNK_WALL_SIZE / 100  # calls that wait: 100 of them make a chunk's wall bound
    sizer = _sized(workers, length, 100, per)
    calls = iter([(i,) for i in range(length)])
    before = [len(sizer.take(calls)) for _ in range(8)]
    assert before == [100] * 8
    sizer.learn(ran=100, seconds=100 * 2 * per, cpu=100 * 1e-5, nbytes=0)  # twice as slow
    after = _sizes(sizer, length - sum(before))
    assert max(after) <= int(AUTO_CHUNK_WALL_SIZE / (2 * per))
    assert max(after) - min(after) <= 1
    assert (len(before) + len(after)) % workers == 0
    # ... and a little slower (under an eighth) keeps it.
    sizer = _sized(workers, length, 100, per)
    calls = iter([(i,) for i in range(length)])
    taken = [len(sizer.take(calls)) for _ in range(4)]
    sizer.learn(ran=100, seconds=100 * 1.1 * per, cpu=100 * 1e-5, nbytes=0)
    assert sizer.size < 100
    assert sizer.next_size() == taken[0] == 100


MS2 = (100, 100 * 0.002, 100 * 0.002, 0)  # a chunk's rate: 100 calls of 2 ms, on a CPU


def test_a_learned_map_sends_a_small_first_chunk_and_its_rest_a_round_later() -> None:
    """Its first result comes after MAP_FIRST_CHUNK_SECONDS, not a whole chunk (0.4 s:
    368-378 ms at 2 workers); the rest of that chunk goes as the next round's first,
    which the worker that ran the small one takes: the rounds stay even."""
    workers = 16
    size = calls_in_chunk(0.002, AUTO_CHUNK_MAX, target=MAP_CHUNK_SECONDS)
    small = calls_in_chunk(0.002, AUTO_CHUNK_MAX, target=MAP_FIRST_CHUNK_SECONDS)
    assert small < size
    length = FIRST_SPLIT_CHUNKS * size + 1000
    sizer = ChunkSizer(workers=workers, length=length, learned=MS2)
    assert sizer.size == size
    sizes = _sizes(sizer, length)
    assert sizes[0] == small
    plan = [sizes[0] + sizes[workers], *sizes[1:workers], *sizes[workers + 1 :]]
    assert max(plan) <= size, sizes
    assert max(plan) - min(plan) <= 1, sizes
    assert len(plan) % workers == 0, f"{len(plan)} chunks of the plan for {workers} workers"
    # Each chunk to the least busy worker (of those, the one whose queue changed longest
    # ago): the first round one each, the rest of the small chunk to the small one's
    # worker, then in turn from the next. Every worker runs as many calls, a call a round.
    runs = [*range(workers), 0, *((1 + j) % workers for j in range(len(sizes) - workers - 1))]
    share = [
        sum(n for w, n in zip(runs, sizes, strict=True) if w == worker) for worker in range(workers)
    ]
    assert max(share) - min(share) <= len(plan) // workers, share


def test_a_short_learned_map_sends_no_small_first_chunk() -> None:
    """Under FIRST_SPLIT_CHUNKS chunks its chunk more would cost the main process a
    quarter more (512 calls at 2 workers: 2 chunks, 0.8 us a call more)."""
    size = calls_in_chunk(0.002, AUTO_CHUNK_MAX, target=MAP_CHUNK_SECONDS)
    length = FIRST_SPLIT_CHUNKS * size - 1
    sizes = _sizes(ChunkSizer(workers=2, length=length, learned=MS2), length)
    need = -(-length // size)
    assert len(sizes) == need + need % 2, sizes  # whole rounds of 2
    assert max(sizes) - min(sizes) <= 1, sizes


@pytest.mark.parametrize("first", ["generator", "list"])
def test_a_map_plans_from_the_learned_rate_at_its_own_target(first: str) -> None:
    """What a map learns is a rate, not a size: a list's map after a generator's starts
    at MAP_CHUNK_SECONDS (it started at the generator's smaller chunks: 1.18 of ideal at
    16 workers, against 1.05), a generator's after a list's at AUTO_CHUNK_SECONDS (it
    started at the list's, with no rounds to even its end: 1.45)."""
    per = 0.004  # calls that wait: the wall bounds rule (0.8 s for a list's, 0.2 s)
    known = ChunkSizer(workers=16, length=None if first == "generator" else KNOWN)
    known.learn(ran=50, seconds=50 * per, cpu=50 * 1e-5, nbytes=0)
    learned = known.learned
    assert learned is not None
    as_list = ChunkSizer(workers=16, length=KNOWN, learned=learned)
    as_generator = ChunkSizer(workers=16, length=None, learned=learned)
    assert as_list.size == int(AUTO_CHUNK_WALL_SIZE / per)
    assert as_generator.size == int(
        AUTO_CHUNK_WALL_SIZE * AUTO_CHUNK_SECONDS / MAP_CHUNK_SECONDS / per
    )
    assert as_list.per_call == as_generator.per_call == per
    # A generator's map sends no small chunk first: its chunks are small already.
    calls = iter([(i,) for i in range(1000)])
    assert len(as_generator.take(calls)) == as_generator.size


def test_the_rate_kept_is_of_a_chunk_not_small_beside_the_target() -> None:
    """A first map's one-call chunks, or a last chunk of a few calls, do not set the rate
    the next map starts from."""
    sizer = ChunkSizer(workers=2, length=KNOWN)
    assert sizer.learned is None
    sizer.learn(ran=1, seconds=0.002, cpu=0.002, nbytes=0)  # the first: all there is
    assert sizer.learned == (1, 0.002, 0.002, 0)
    sizer.learn(ran=100, seconds=0.2, cpu=0.2, nbytes=0)
    sizer.learn(ran=1, seconds=0.01, cpu=0.01, nbytes=0)  # small beside the size: kept out
    assert sizer.learned == (100, 0.2, 0.2, 0)


def _pid_after(x: int, sleep: float) -> int:
    time.sleep(sleep)
    return os.getpid()


def test_a_learned_maps_small_first_chunk_and_its_rest_run_on_one_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pool gives the next round's first chunk to the worker that ran the small one
    (the least busy, of those the one whose queue changed longest ago): the rounds even."""
    taken: list[list[int]] = []

    class Recording(ChunkSizer):
        def take(self, calls: Iterator[tuple[Any, ...]]) -> tuple[tuple[Any, ...], ...]:
            chunk = super().take(calls)
            taken[-1].append(len(chunk))
            return chunk

    def made(*args: Any) -> ChunkSizer:
        taken.append([])
        return Recording(*args)

    monkeypatch.setattr(mpexec._mapping, "ChunkSizer", made)
    sleep = 0.001  # a 1 ms call: chunks of 256 (the cap), a small one of ~190 (0.2 s)
    n = FIRST_SPLIT_CHUNKS * AUTO_CHUNK_MAX
    with WorkerPool(2) as pool:
        for _ in range(2):
            pids = list(pool.map(_pid_after, range(n), itertools.repeat(sleep), timeout=T))
    sizes = taken[-1]
    assert sizes[0] < AUTO_CHUNK_MAX, sizes  # the small first chunk
    assert abs(sizes[0] + sizes[2] - sizes[1]) <= 1, sizes  # with its rest, one of the plan
    assert sum(sizes) == n
    ends = list(itertools.accumulate(sizes))
    first = set(pids[: ends[0]])
    rest = set(pids[ends[1] : ends[2]])  # chunk 2: the next round's first, at 2 workers
    assert len(first) == 1, (sizes, first)
    assert rest == first, (sizes, first, rest)
    assert set(pids[ends[0] : ends[1]]) != first  # the other worker ran the first round's other


def test_the_rounds_are_of_the_chunks_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``prefetch`` under the workers, so many chunks run at once: rounds of that many."""
    made: list[int] = []

    class Recording(ChunkSizer):
        def __init__(self, workers: int, *args: Any) -> None:
            made.append(workers)
            super().__init__(workers, *args)

    monkeypatch.setattr(mpexec._mapping, "ChunkSizer", Recording)
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(10), prefetch=1, timeout=T)) == [
            x * x for x in range(10)
        ]
        assert list(pool.map(_square, range(10), timeout=T)) == [x * x for x in range(10)]
    assert made == [1, 2]


class _NoLen:
    def __len__(self) -> int:
        raise RuntimeError("no length")

    def __iter__(self) -> Iterator[int]:
        return iter(())


def test_known_length_is_the_shortest_known_one() -> None:
    assert known_length((range(10), [1, 2, 3])) == 3
    assert known_length((range(10), (x for x in range(2)))) == 10
    assert known_length(((x for x in range(2)),)) is None
    assert known_length((_NoLen(),)) is None


def _soak(i: int, a: np.ndarray[Any, Any]) -> Any:
    return a + i if a.size > 4 else i + 1


def test_chunks_give_back_their_memory() -> None:
    small, big = np.ones(4, np.int64), np.ones(8192, np.int64)  # big: past the inline limit
    with WorkerPool(2) as pool:
        start = pool.stats().arena.in_use
        n = 5000
        args = (big if i % 50 == 0 else small for i in range(n))
        total = 0
        for i, r in enumerate(pool.map(_soak, range(n), args, timeout=T)):
            total += int(r[-1]) if i % 50 == 0 else r
        assert total == sum(i + 1 for i in range(n))
        assert pool.stats().submitted < n // 4, "not chunked: the test proves nothing"
        wait_until(lambda: pool.stats().arena.in_use == start, 10, "the arena to empty again")
        assert pool.stats().pending == 0


# ---------------------------------------------------------------- chunks the worker ends
def _stamped(x: int, slow_from: int, slow_s: float) -> tuple[int, int, float, float]:
    """(x, pid, start, end): calls from ``slow_from`` on sleep ``slow_s``."""
    start = time.time()
    if x >= slow_from:
        time.sleep(slow_s)
    return x, os.getpid(), start, time.time()


def _endless(n: int | None = None) -> Iterator[int]:
    """Ints with no length to read (a map's last chunks are not made smaller)."""
    yield from itertools.count() if n is None else range(n)


def test_calls_that_turn_slow_are_spread_over_the_workers() -> None:
    """Quick calls make big chunks; the slow calls after them must not run in one of them."""
    fast, slow, slow_s = 600, 12, 0.15
    with WorkerPool(2) as pool:
        out = list(
            pool.map(
                _stamped,
                _endless(fast + slow),
                itertools.repeat(fast),
                itertools.repeat(slow_s),
                timeout=T,
            )
        )
    assert [r[0] for r in out] == list(range(fast + slow))
    # Counted, not timed: a span under 0.8 of the calls run one after another (the old
    # check) is at most 9 of the 12 on one worker, and a span also counted a loaded host's
    # scheduling delays (it failed once at load 30).
    per_worker = collections.Counter(r[1] for r in out[fast:])
    assert len(per_worker) == 2, "the slow calls ran on one worker"
    assert max(per_worker.values()) <= 3 * slow // 4, f"the slow calls ran unevenly: {per_worker}"


def test_a_result_waits_in_its_chunk_for_one_slow_call_at_most() -> None:
    """Results computed before slow calls in the same chunk come back after one of them."""
    fast, slow, slow_s = 600, 4, 0.6
    with WorkerPool(2) as pool:
        late = []
        results = pool.map(
            _stamped,
            _endless(fast + slow + 200),
            itertools.repeat(fast),
            itertools.repeat(slow_s),
            ordered=False,
            timeout=T,
        )
        for x, _, _, end in results:
            late.append(time.time() - end)
            if x >= fast + slow:
                results.close()
                break
    # One slow call, the chunk's budget, and a loaded host's slack; not several slow calls.
    assert max(late) < slow_s + 0.7, f"a result came {max(late):.2f} s after it was made"


def _log_start(x: int, path: str, slow_from: int) -> int:
    start = time.time()
    with open(path, "a") as f:
        f.write(f"{x} {start!r}\n")
    if x >= slow_from:
        time.sleep(0.1)
    return x


def _starts(path: Path) -> list[float]:
    return [float(line.split()[1]) for line in path.read_text().splitlines()]


def _warm(pool: WorkerPool) -> None:
    """Each worker has imported this module (a loaded host may take seconds to)."""
    pids = {r[1] for r in pool.map(_stamped, range(2), [0, 0], [0.3, 0.3], chunksize=1)}
    assert len(pids) == 2


def test_calls_not_started_when_map_times_out_do_not_run(tmp_path: Path) -> None:
    log = tmp_path / "starts"
    fast, timeout = 600, 3.0
    with WorkerPool(2) as pool:
        _warm(pool)
        began = time.time()
        results = pool.map(
            _log_start,
            _endless(fast + 400),
            itertools.repeat(str(log)),
            itertools.repeat(fast),
            timeout=timeout,
        )
        with pytest.raises(FutureTimeoutError):  # the builtin TimeoutError only from 3.11
            list(results)
        gave_up = time.time()
        assert gave_up - began < timeout + 5
        pool.shutdown(wait=True)  # whatever still runs, finishes
    latest = max(_starts(log))
    # (The slack: a worker preempted between its look at the clock and the call's.)
    assert latest <= began + timeout + 0.5, f"a call started {latest - gave_up:.2f} s after"


def test_calls_not_started_when_map_is_closed_do_not_run(tmp_path: Path) -> None:
    log = tmp_path / "starts"
    fast = 600
    with WorkerPool(2) as pool:
        _warm(pool)
        results = pool.map(
            _log_start,
            _endless(fast + 400),
            itertools.repeat(str(log)),
            itertools.repeat(fast),
            timeout=T,
        )
        for x in results:
            if x >= fast:  # the first slow call is done: slow calls are in chunks now
                break
        results.close()
        closed = time.time()
        pool.shutdown(wait=True)
    after = [t for t in _starts(log) if t > closed]
    # A chunk running when the map closed ends after the call it runs: none starts later.
    assert len(after) <= pool.num_workers, f"{len(after)} calls started after close()"


def _img(x: int) -> dict[str, Any]:
    return {"img": np.full(16 << 10, x % 256, np.uint8), "label": x}


class _Sample:
    def __init__(self, x: int) -> None:
        self.img = np.full(16 << 10, x % 256, np.uint8)


def _sample(x: int) -> _Sample:
    return _Sample(x)


@pytest.mark.parametrize("make", [_img, _sample])
def test_a_chunk_counts_the_arrays_inside_results(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """{"img": array} (or an object holding one) counts its array toward a chunk's bytes."""
    # 16 KiB a result, at most 64 KiB a chunk: four calls a chunk at most.
    monkeypatch.setattr(mpexec._mapping, "AUTO_CHUNK_BYTES", 64 << 10)
    n = 400
    with WorkerPool(2) as pool:
        for i, out in enumerate(pool.map(make, _endless(n), timeout=T)):
            img = out["img"] if isinstance(out, dict) else out.img
            assert img[0] == i % 256
        tasks = pool.stats().submitted
    assert tasks >= n // 4, f"{tasks} tasks for {n} results of 16 KiB: chunks past 64 KiB"


def _unpicklable_at(x: int, bad: int) -> Any:
    return threading.Lock() if x == bad else x


def test_a_result_that_cannot_be_pickled_fails_its_own_item_only() -> None:
    bad = 1500
    with WorkerPool(2) as pool:
        results = pool.map(_unpicklable_at, _endless(3000), itertools.repeat(bad), timeout=T)
        got = [next(results) for _ in range(bad)]
        assert got == list(range(bad))
        with pytest.raises(mpexec.SerializationError, match=r"cannot pickle the result:") as info:
            next(results)
        assert "[0]" not in str(info.value), "an internal path of the chunk is named"
        assert pool.stats().submitted < bad // 4, "not chunked: the test proves nothing"
        with pytest.raises(mpexec.SerializationError, match=r"cannot pickle the result:") as one:
            list(pool.map(_unpicklable_at, range(2), itertools.repeat(1), chunksize=1))
    assert str(one.value).split(":")[0] == str(info.value).split(":")[0]


def _raising_input(n: int, at: int) -> Iterator[int]:
    for i in range(n):
        if i == at:
            raise KeyError(f"input {i}")
        yield i


@pytest.mark.parametrize("chunksize", [None, 1, 7])
def test_an_input_that_raises_ends_the_map_after_every_result_before_it(
    chunksize: int | None,
) -> None:
    at = 1000
    with WorkerPool(2) as pool:
        got: list[int] = []
        results = pool.map(_square, _raising_input(2000, at), chunksize=chunksize, timeout=T)
        with pytest.raises(KeyError, match="input 1000"):
            got.extend(results)
        assert got == [x * x for x in range(at)]  # as multiprocessing.Pool.imap
        assert list(pool.map(_square, range(3), timeout=T)) == [0, 1, 4]


@pytest.mark.parametrize("prefetch", [0, -3, 1.5, True, "2"])
def test_map_refuses_a_prefetch_that_is_not_a_positive_int(prefetch: Any) -> None:
    with WorkerPool(1) as pool, pytest.raises(ValueError, match="prefetch must be an int >= 1"):
        pool.map(_square, range(3), prefetch=prefetch)


def test_map_takes_a_numpy_integer_prefetch() -> None:
    with WorkerPool(1) as pool:
        assert list(pool.map(_square, range(5), prefetch=np.int64(2), timeout=T)) == [
            0,
            1,
            4,
            9,
            16,
        ]


# ---------------------------------------------------------------- the main process's share
def _row(x: int) -> np.ndarray[Any, Any]:
    return np.full(16, x, np.float32)


def _scalar_array(x: int) -> np.ndarray[Any, Any]:
    return np.array(x, np.int64)  # 0-d: not stacked (its row would be a NumPy scalar)


def _mixed(x: int) -> Any:
    return np.full(4 + x % 2, x, np.int32)


def test_a_second_map_of_the_same_function_starts_at_the_size_learned() -> None:
    """A map per epoch does not send its first calls one a task again (per pool, per fn)."""
    n = 400
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(n), timeout=T)) == [x * x for x in range(n)]
        first = pool.stats().submitted
        assert list(pool.map(_square, range(n), timeout=T)) == [x * x for x in range(n)]
        second = pool.stats().submitted - first
        # The first map sent a window of single calls before it knew their time; the
        # second shares its calls evenly over the workers at once (a round of chunks).
        assert first > 2 * pool.num_workers
        assert second == pool.num_workers, (first, second)
        # Another function learns for itself.
        assert list(pool.map(_add, range(n), range(n), timeout=T)) == [2 * x for x in range(n)]
        assert pool.stats().submitted - first - second > 2 * pool.num_workers


def test_the_caller_runs_no_python_frame_of_map_an_item() -> None:
    """Items are read and results handed out in C loops: map's Python runs a chunk.

    At 2 workers the caller runs this cold once a batch, so its Python calls are
    its cost: the input's ``__next__`` and the generator's resume made two frames
    of ``_mapping`` an item (2.04 a result before, 0.04 after); ``Inputs.take`` and
    ``itertools.chain`` over the chunks leave a few a chunk.
    """
    n = 2048
    frames = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal frames
        frames += event == "call" and frame.f_code.co_filename == mpexec._mapping.__file__

    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(n), timeout=T)) == [x * x for x in range(n)]
        results = pool.map(_square, range(n), timeout=T)  # starts at the size learned
        sys.setprofile(count)
        try:
            got = list(results)
        finally:
            sys.setprofile(None)
        chunks = pool.stats().submitted
    assert got == [x * x for x in range(n)]
    assert chunks < n // 64, "not chunked: the test proves nothing"
    assert frames / n < 0.25, (frames / n, chunks)


@pytest.mark.parametrize("make", [_row, _scalar_array, _mixed])
def test_small_array_results_come_back_as_they_were_made(make: Any) -> None:
    """Results of one shape and dtype travel as one block; each item is still its own."""
    n = 600
    with WorkerPool(2) as pool:
        got = list(pool.map(make, range(n), timeout=T))
        assert pool.stats().submitted < n // 4, "not chunked: the test proves nothing"
    for x, r in enumerate(got):
        want = make(x)
        assert type(r) is np.ndarray
        assert (r.shape, r.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(r, want)
        assert r.flags.writeable  # the caller's own, as every result is
    got[0][...] = -1  # a row is its item's alone
    np.testing.assert_array_equal(got[1], make(1))


def test_the_worker_stacks_only_small_arrays_of_one_shape() -> None:
    from mpexec._mapping import STACK_BYTES, stack_results

    same = [np.full(8, i, np.float64) for i in range(10)]
    block = stack_results(same)
    assert type(block) is np.ndarray
    assert block.shape == (10, 8)
    assert type(stack_results(same[:1])) is list
    assert type(stack_results([np.array(1), np.array(2)])) is list  # 0-d
    big = [np.zeros(STACK_BYTES // 8, np.float64) for _ in range(2)]
    assert type(stack_results(big)) is list
    assert type(stack_results([np.zeros(3), np.zeros(4)])) is list
    assert type(stack_results([np.zeros(3), np.zeros(3, np.float32)])) is list
    assert type(stack_results([np.zeros(3), [0.0, 0.0, 0.0]])) is list


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("chunksize", [None, 1, 4])
def test_a_map_past_its_timeout_raises_the_futures_timeout_error(
    chunksize: int | None, ordered: bool
) -> None:
    """``Executor.map``'s class, ``concurrent.futures.TimeoutError``: before Python
    3.11 it is not the builtin ``TimeoutError``, which a map past its deadline raised
    there (a caller catching the futures' class missed it; tox's py310 caught it)."""
    with WorkerPool(2) as pool:
        _warm(pool)
        results = pool.map(
            time.sleep, [0.3] * 8, chunksize=chunksize, ordered=ordered, timeout=1e-9
        )
        with pytest.raises(FutureTimeoutError) as info:
            list(results)
        assert type(info.value) is FutureTimeoutError
