"""Batch mode (``batch_processing=True``) in the workers: fused with its source, on every worker.

A stateless batch op whose only producer is a per-sample source in the workers
(with any per-sample ops chained to it) runs in the same call as that source:
one unit per batch. A pipeline with a stateless batch op in the workers keeps
``prefetch_depth`` batches in flight per worker, not ``prefetch_depth`` in all. These
tests hold that both change nothing a user sees but the speed: outputs (also
their randomness), order, epoch ends, errors, stats and stateful order are
those of the unfused pipeline.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._executors import WorkUnit
from mpexec._runtime import ChunkResult
from mpexec._scheduler import Scheduler
from tests.pipeline.lean_ops import Samples

pytestmark = pytest.mark.usefixtures("no_leaks")

T = 30  # bound of every wait in this file
BATCH = 4


def _jitter(x: np.ndarray[Any, Any], i: Any, rng: np.random.Generator) -> tuple[Any, Any]:
    return x + rng.standard_normal(3), i


def _mix(xs: list[Any], ids: list[Any]) -> tuple[Any, Any]:
    """A batch op that reads the whole batch and draws from ``np.random``."""
    assert all(not x.flags.writeable for x in xs)  # inputs are read-only, as always
    info = mpexec.sample_info()
    assert isinstance(info, mpexec.BatchInfo)
    total = float(sum(x.sum() for x in xs))
    return np.stack(xs) * np.random.rand() + total, [i + 1000 * info.iteration for i in ids]


def _graph(n: int, *, jitter: bool, unfused: bool, **source: Any) -> Any:
    x, i = fn.external_source(source=Samples(n, **source), batch=False, num_outputs=2, name="src")
    if jitter:
        x, i = fn.python_function(x, i, function=_jitter, num_outputs=2, name="jitter")
    a, b = fn.python_function(x, i, function=_mix, batch_processing=True, num_outputs=2, name="mix")
    # The source's index also an output: it has another consumer, so nothing fuses.
    return (a, b, i) if unfused else (a, b)


def _epochs(
    n: int,
    *,
    jitter: bool = False,
    unfused: bool = False,
    num_workers: int = 2,
    prefetch_depth: int = 2,
    last_batch: str = "partial",
    epochs: int = 2,
) -> list[list[bytes]]:
    pipe = mpexec.Pipeline(
        batch_size=BATCH,
        num_workers=num_workers,
        seed=7,
        prefetch_depth=prefetch_depth,
        last_batch=last_batch,
    )
    pipe.define(lambda: _graph(n, jitter=jitter, unfused=unfused))
    got = []
    with pipe:
        for e in range(epochs):
            if e:
                pipe.reset()
            got.extend([np.asarray(s).tobytes() for b in outs[:2] for s in b] for outs in pipe)
    return got


# ---------------------------------------------------------------- one unit a batch


class _Recording:
    """An executor that runs units here, in order, and keeps them (``workers`` of them)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.units: list[WorkUnit] = []
        self._lock = threading.Lock()

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        with self._lock:
            self.units.append(unit)
            future: Future[ChunkResult] = Future()
            future.set_result(unit.run())
        return future

    def share(self, array: Any) -> Any:
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        return copy

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


@pytest.mark.parametrize("jitter", [False, True])
def test_a_batch_op_after_a_per_sample_source_is_one_unit_a_batch(jitter: bool) -> None:
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=7)
    pipe.define(lambda: _graph(10, jitter=jitter, unfused=False))
    assert pipe._graph is not None
    executor = _Recording(workers=3)
    scheduler = Scheduler(
        pipe._graph.plan(),
        executor,
        batch_size=BATCH,
        prefetch_depth=1,
        seed=7,
        last_batch="partial",
        debug=False,
    )
    try:
        got = []
        while True:
            try:
                outs = scheduler.next_result()
            except StopIteration:
                break
            got.append([np.asarray(s).tobytes() for b in outs for s in b])
    finally:
        scheduler.close()
    ops = ("src", "jitter", "mix") if jitter else ("src", "mix")
    assert {u.ops for u in executor.units} == {ops}
    # One unit per iteration (3 batches, and the past-the-end ones the window launched),
    # each the whole batch.
    assert {u.chunk.count for u in executor.units} == {BATCH}
    assert sorted(u.chunk.iteration for u in executor.units)[:3] == [0, 1, 2]
    assert len(got) == 3
    assert got == _epochs(10, jitter=jitter, num_workers=0, epochs=1)


# ---------------------------------------------------------------- same outputs


@pytest.mark.parametrize("jitter", [False, True])
@pytest.mark.parametrize("n", [10, 12])  # a short last batch, and none
@pytest.mark.parametrize("last_batch", ["partial", "drop"])
def test_fused_outputs_are_the_unfused_ones(jitter: bool, n: int, last_batch: str) -> None:
    reference = _epochs(n, jitter=jitter, unfused=True, num_workers=0, last_batch=last_batch)
    assert len(reference) == 2 * (n // BATCH if last_batch == "drop" else -(-n // BATCH))
    for workers, depth in [(0, 1), (1, 2), (3, 1)]:
        got = _epochs(
            n, jitter=jitter, num_workers=workers, prefetch_depth=depth, last_batch=last_batch
        )
        assert got == reference, (workers, depth)
    unfused = _epochs(n, jitter=jitter, unfused=True, num_workers=2, last_batch=last_batch)
    assert unfused == reference


def test_an_epoch_that_ends_on_a_batch_boundary_gives_no_empty_batch() -> None:
    calls: list[int] = []

    def count(xs: list[Any]) -> list[Any]:
        calls.append(len(xs))
        return list(xs)

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=0, seed=1, prefetch_depth=3)
    def pipe() -> Any:
        x, _ = fn.external_source(source=Samples(8), batch=False, num_outputs=2)
        return fn.python_function(x, function=count, batch_processing=True)

    with pipe() as p:
        sizes = [len(out) for (out,) in p]
    assert sizes == [BATCH, BATCH]
    assert calls == [BATCH, BATCH]  # never called on the empty batch past the end


def test_a_short_last_batch_that_is_dropped_never_reaches_the_batch_op() -> None:
    def full_only(xs: list[Any]) -> list[Any]:
        if len(xs) != BATCH:
            raise AssertionError(f"a batch of {len(xs)}")
        return list(xs)

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=2, seed=1, last_batch="drop")
    def pipe() -> Any:
        x, _ = fn.external_source(source=Samples(10), batch=False, num_outputs=2)
        return fn.python_function(x, function=full_only, batch_processing=True, name="full")

    with pipe() as p:
        for epoch in range(2):
            if epoch:
                p.reset()
            assert [len(out) for (out,) in p] == [BATCH, BATCH]
        (full,) = [s for s in p.stats().ops if s.name == "full"]
    assert (full.calls, full.samples) == (4, 4 * BATCH)


def test_stats_count_each_op_of_the_fused_unit() -> None:
    @mpexec.pipeline_def(batch_size=BATCH, num_workers=2, seed=1, last_batch="partial")
    def pipe() -> Any:
        return _graph(10, jitter=True, unfused=False)

    with pipe() as p:
        assert len(list(p)) == 3
        stats = {s.name: s for s in p.stats().ops}
    assert (stats["src"].calls, stats["src"].samples) == (10, 10)
    assert (stats["jitter"].calls, stats["jitter"].samples) == (10, 10)
    assert (stats["mix"].calls, stats["mix"].samples) == (3, 10)
    assert stats["mix"].bytes_in == 10 * (3 * 8 + 8)
    assert stats["mix"].bytes_out == 10 * (3 * 8 + 8)


# ---------------------------------------------------------------- errors


def _error(num_workers: int, *, unfused: bool, **source: Any) -> BaseException:
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=num_workers, seed=7)
    pipe.define(lambda: _graph(20, jitter=False, unfused=unfused, **source))
    with pipe, pytest.raises(Exception) as info:
        for _ in pipe:
            pass
    return info.value


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_source_error_names_the_source_and_sample(num_workers: int) -> None:
    exc = _error(num_workers, unfused=False, fail_at=6)
    assert type(exc) is ValueError
    assert str(exc) == "no sample 6"
    note = "mpexec: raised in external_source 'src', iteration 1 of epoch 0, sample 2 (index 6"
    assert any(n.startswith(note) for n in exc.__notes__)
    unfused = _error(num_workers, unfused=True, fail_at=6)
    assert unfused.__notes__ == exc.__notes__


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_ragged_source_sample_is_the_sources_error(num_workers: int) -> None:
    exc = _error(num_workers, unfused=False, ragged_at=5)
    assert isinstance(exc, mpexec.OpOutputError)
    assert "output 0 of external_source 'src' is inconsistent across the batch" in str(exc)
    assert any("raised in external_source 'src', iteration 1" in n for n in exc.__notes__)
    unfused = _error(num_workers, unfused=True, ragged_at=5)
    assert str(unfused) == str(exc)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_op_error_names_the_batch_op(num_workers: int) -> None:
    def fails(xs: list[Any]) -> list[Any]:
        if mpexec.sample_info().iteration == 1:  # type: ignore[union-attr]
            raise KeyError("batch 1")
        return list(xs)

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=num_workers, seed=1)
    def pipe() -> Any:
        x, _ = fn.external_source(source=Samples(20), batch=False, num_outputs=2, name="src")
        return fn.python_function(x, function=fails, batch_processing=True, name="fails")

    with pipe() as p:
        p.run()
        with pytest.raises(KeyError, match="batch 1") as info:
            p.run()
    assert any(
        n.startswith("mpexec: raised in python_function 'fails', iteration 1 of epoch 0")
        and "sample" not in n
        for n in info.value.__notes__
    )


# ---------------------------------------------------------------- a batch a worker


class _Meet:
    """A batch op whose first ``n`` calls wait (bounded) until all ``n`` have begun.

    Each call leaves a mark in ``where`` and returns, per sample, how many
    marks it saw when it stopped waiting: ``n`` where ``n`` calls ran at
    once, fewer where they could not (the wait then ends at its bound).
    """

    def __init__(self, where: Path, n: int) -> None:
        self.where, self.n = where, n

    def __call__(self, xs: list[Any]) -> list[Any]:
        info = mpexec.sample_info()
        assert isinstance(info, mpexec.BatchInfo)
        (self.where / f"{info.epoch_idx}-{info.iteration}").touch()
        deadline = time.monotonic() + 10
        while len(os.listdir(self.where)) < self.n and time.monotonic() < deadline:
            time.sleep(0.002)
        seen = len(os.listdir(self.where))
        return [np.array([seen]) for _ in xs]


def _ready_pool(workers: int) -> mpexec.WorkerPool:
    """A pool whose every worker has answered a call (so each is there to take a batch)."""
    pool = mpexec.WorkerPool(workers)
    for f in [pool.submit_call(os.getpid, worker=i) for i in range(workers)]:
        f.result(timeout=T)
    return pool


@pytest.mark.parametrize("source", ["per sample, in the workers", "an iterable, here"])
def test_more_batch_calls_than_prefetch_depth_run_at_once(tmp_path: Path, source: str) -> None:
    workers = 4
    meet = _Meet(tmp_path, workers)

    def batches() -> Any:
        for i in range(8):
            yield [np.array([i * BATCH + j]) for j in range(BATCH)]

    pool = _ready_pool(workers)
    try:

        @mpexec.pipeline_def(batch_size=BATCH, seed=1, prefetch_depth=2, pool=pool)
        def pipe() -> Any:
            if source == "an iterable, here":
                x = fn.external_source(source=batches, batch=True)
            else:
                x, _ = fn.external_source(source=Samples(8 * BATCH), batch=False, num_outputs=2)
            return fn.python_function(x, function=meet, batch_processing=True)

        with pipe() as p:
            seen = [int(out.as_array()[0, 0]) for (out,) in p]
    finally:
        pool.shutdown()
    assert len(seen) == 8
    # The first four batch calls ran at once: each saw the others' marks (and maybe more).
    assert all(n >= workers for n in seen[:workers]), seen


def test_a_stateful_batch_op_keeps_its_order_among_many_batches_in_flight() -> None:
    class Running:
        """Stateful: numbers its calls, and says which process made each."""

        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, xs: list[Any]) -> tuple[list[Any], list[Any]]:
            self.calls += 1
            return [np.array([self.calls]) for _ in xs], [np.array([os.getpid()]) for _ in xs]

    def slow_first(xs: list[Any]) -> list[Any]:
        # Early batches take longest: later ones finish first, if anything lets them.
        info = mpexec.sample_info()
        assert isinstance(info, mpexec.BatchInfo)
        time.sleep(0.02 * max(0, 4 - info.iteration))
        return [x * 2 for x in xs]

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=4, seed=1, prefetch_depth=1)
    def pipe() -> Any:
        x, i = fn.external_source(source=Samples(12 * BATCH), batch=False, num_outputs=2)
        doubled = fn.python_function(x, function=slow_first, batch_processing=True)
        counts, pids = fn.python_function(
            doubled, function=Running(), batch_processing=True, stateful=True, num_outputs=2
        )
        return counts, pids, i

    with pipe() as p:
        assert p._scheduler is not None
        assert p._scheduler.window == 4  # prefetch_depth (1) batches a worker
        got = [
            (int(c.as_array()[0, 0]), int(pid.as_array()[0, 0]), i.as_array()) for c, pid, i in p
        ]
    assert [c for c, _, _ in got] == list(range(1, 13))  # in iteration order, one state
    assert len({pid for _, pid, _ in got}) == 1  # on one worker
    indices = np.concatenate([i.reshape(-1) for _, _, i in got])
    assert indices.tolist() == list(range(12 * BATCH))  # batches in order


def test_the_window_is_prefetch_depth_without_a_stateless_batch_op() -> None:
    def double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return x * 2

    def per_sample() -> Any:
        x, _ = fn.external_source(source=Samples(8), batch=False, num_outputs=2)
        return fn.python_function(x, function=double)

    def stateful_batch() -> Any:
        x, _ = fn.external_source(source=Samples(8), batch=False, num_outputs=2)
        return fn.python_function(x, function=list, batch_processing=True, stateful=True)

    for graph in (per_sample, stateful_batch):
        pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=3, seed=1, prefetch_depth=2)
        pipe.define(graph)
        with pipe:
            pipe.build()
            assert pipe._scheduler is not None
            assert pipe._scheduler.window == 2
            assert len(list(pipe)) == 2


def test_unit_runs_the_same_pickled() -> None:
    """The fused runner travels to a worker as any runner does: pickled, by value."""
    import cloudpickle

    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=7)
    pipe.define(lambda: _graph(10, jitter=True, unfused=False))
    assert pipe._graph is not None
    executor = _Recording(workers=2)
    scheduler = Scheduler(
        pipe._graph.plan(),
        executor,
        batch_size=BATCH,
        prefetch_depth=1,
        seed=7,
        last_batch="partial",
        debug=False,
    )
    try:
        scheduler.next_result()
    finally:
        scheduler.close()
    unit = executor.units[0]
    fresh = dataclasses.replace(unit, runner=cloudpickle.loads(cloudpickle.dumps(unit.runner)))
    here, there = unit.run(), fresh.run()
    assert here.count == there.count == BATCH
    for a, b in zip(here.outputs, there.outputs, strict=True):
        assert [x.tobytes() for x in a] == [y.tobytes() for y in b]
