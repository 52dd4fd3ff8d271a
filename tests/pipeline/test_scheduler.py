"""The scheduler's unit of work and executor interface (mpexec/_executors.py, _scheduler.py).

Another executor (a Ray pool, a GPU stage) plugs in behind ``UnitExecutor``: these
tests drive the scheduler with one that sends every unit through a pickle round trip,
as a remote agent would receive it, and check the outputs are bit-identical to the
pipeline's own, inline and with workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import cloudpickle
import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._executors import UnitExecutor, WorkUnit
from mpexec._runtime import ChunkResult
from mpexec._scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("no_leaks")

SEED = 99
EPOCH = 11
BATCH = 4


def _source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    return np.random.randint(0, 100, size=3) + info.idx_in_epoch


def _noise(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return rng.standard_normal(3) + x


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _batch_sum(xs: list[Any]) -> list[Any]:
    return [x + sum(float(y.sum()) for y in xs) for x in xs]


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.n += 1
        return x + self.n


def _graph() -> Any:
    src = fn.external_source(source=_source, batch=False, name="src")
    noisy = fn.python_function(src, function=_noise, name="noise")
    doubled = fn.python_function(noisy, function=_double, name="double")  # chained
    summed = fn.python_function(doubled, function=_batch_sum, batch_processing=True, name="sum")
    counted = fn.python_function(summed, function=_Counter(), stateful=True, name="count")
    return doubled, summed, counted


Run = list[list[bytes]]


def _collect(next_result: Callable[[], tuple[mpexec.Batch, ...]], reset: Callable[[], None]) -> Run:
    got: Run = []
    for epoch in range(2):
        if epoch:
            reset()
        while True:
            try:
                outs = next_result()
            except StopIteration:
                break
            got.append([np.asarray(s).tobytes() for b in outs for s in b])
    return got


def _pipeline_run(num_workers: int) -> Run:
    pipe = mpexec.Pipeline(
        batch_size=BATCH, num_workers=num_workers, seed=SEED, last_batch="partial"
    )
    pipe.define(_graph)
    with pipe:
        return _collect(pipe.run, pipe.reset)


def _scheduler_run(executor: Any, prefetch_depth: int) -> Run:
    """The test graph's run straight on a Scheduler over ``executor`` (then shut down)."""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=SEED)
    pipe.define(_graph)
    assert pipe._graph is not None
    scheduler = Scheduler(
        pipe._graph.plan(),
        executor,
        batch_size=BATCH,
        prefetch_depth=prefetch_depth,
        seed=SEED,
        last_batch="partial",
        debug=False,
    )
    try:
        return _collect(scheduler.next_result, scheduler.reset)
    finally:
        scheduler.close()
        executor.shutdown()


class PickledUnits:
    """An executor that sends each unit through cloudpickle, as to a remote agent.

    The agent keeps each runner it was sent (by identity, as WorkerPool's
    workers do): a stateful op's state lives there. One thread runs the units
    (NumPy's global random state is per process, and the ops reseed it: a
    remote agent is a process of its own), which also keeps a pinned unit
    after the earlier ones of its worker index.
    """

    workers = 2

    def __init__(self) -> None:
        self.units: list[WorkUnit] = []
        self._threads = ThreadPoolExecutor(1)
        self._lock = threading.Lock()
        self._runners: dict[int, bytes] = {}  # sent once per runner
        self._agent: dict[int, Any] = {}  # what the agent unpickled

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        with self._lock:
            self.units.append(unit)
            key = id(unit.runner)
            sent = self._runners.setdefault(key, cloudpickle.dumps(unit.runner))
        blob = cloudpickle.dumps(dataclasses.replace(unit, runner=None))
        return self._threads.submit(self._run_remote, key, sent, blob)

    def _run_remote(self, key: int, sent: bytes, blob: bytes) -> ChunkResult:
        runner = self._agent.get(key)
        if runner is None:
            runner = self._agent[key] = cloudpickle.loads(sent)
        unit = dataclasses.replace(cloudpickle.loads(blob), runner=runner)
        result: ChunkResult = unit.run()
        return result

    def share(self, array: Any) -> Any:
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        return copy

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._threads.shutdown(wait, cancel_futures=cancel_futures)


def test_another_executor_gives_bit_identical_outputs() -> None:
    reference = _pipeline_run(0)
    assert reference == _pipeline_run(2)
    executor = PickledUnits()
    checked: UnitExecutor = executor  # it satisfies the protocol (mypy checks this line)
    got = _scheduler_run(checked, prefetch_depth=2)
    assert got == reference
    # The chain src -> noise -> double is one unit per chunk: cut in two (a chunk per
    # worker) until its time is known, then whole batches (quick samples).
    chained = [u for u in executor.units if u.ops == ("src", "noise", "double")]
    assert chained
    first = {u.chunk.count for u in chained if (u.chunk.epoch, u.chunk.iteration) == (0, 0)}
    assert first == {BATCH // 2}
    assert {u.chunk.count for u in chained if u.chunk.epoch == 1} <= {BATCH, EPOCH % BATCH}
    assert all(u.worker is None for u in chained)
    counted = [u for u in executor.units if u.ops == ("count",)]
    assert counted
    assert {u.worker for u in counted} == {0}
    assert all(u.chunk.start == 0 for u in counted)  # a stateful op takes the whole batch


def test_a_unit_runs_the_same_anywhere() -> None:
    """``WorkUnit.run()`` is the whole computation: pickled or not, one result."""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=SEED)
    pipe.define(_graph)
    assert pipe._graph is not None
    executor = PickledUnits()
    scheduler = Scheduler(
        pipe._graph.plan(),
        executor,
        batch_size=BATCH,
        prefetch_depth=1,
        seed=SEED,
        last_batch="partial",
        debug=False,
    )
    try:
        scheduler.next_result()
    finally:
        scheduler.close()
        executor.shutdown()
    unit = next(u for u in executor.units if u.ops == ("src", "noise", "double"))
    here = unit.run()
    there = cloudpickle.loads(cloudpickle.dumps(unit)).run()
    assert here.count == there.count == unit.chunk.count
    (here_column,), (there_column,) = here.outputs, there.outputs
    assert len(here_column) == len(there_column) == unit.chunk.count
    for a, b in zip(here_column, there_column, strict=True):
        assert a.tobytes() == b.tobytes()


class PickledUnitsWithBlocks(PickledUnits):
    """As :class:`PickledUnits`, giving units blocks to write (``empty``).

    The agent writes into its own copies of ``unit.out`` (they travel pickled),
    so the rows are copied back into the scheduler's block before the future
    completes, as the interface asks of an executor that runs units elsewhere.
    """

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return np.empty(shape, dtype)

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        inner = super().submit_unit(unit)
        outer: Future[ChunkResult] = Future()

        def copy_back(done: Future[Any]) -> None:
            exc = done.exception()
            if exc is not None:
                outer.set_exception(exc)
                return
            result, filled = done.result()
            for mine, theirs, wrote in zip(unit.out, filled, result.written, strict=False):
                if mine is not None and wrote:
                    np.copyto(mine[: len(theirs)], theirs)
            outer.set_result(result)

        inner.add_done_callback(copy_back)
        return outer

    def _run_remote(self, key: int, sent: bytes, blob: bytes) -> Any:
        runner = self._agent.get(key)
        if runner is None:
            runner = self._agent[key] = cloudpickle.loads(sent)
        unit = dataclasses.replace(cloudpickle.loads(blob), runner=runner)
        return unit.run(), unit.out


def test_another_executor_with_blocks_gives_bit_identical_outputs() -> None:
    reference = _pipeline_run(2)
    executor = PickledUnitsWithBlocks()
    got = _scheduler_run(executor, prefetch_depth=1)
    assert got == reference
    # After the first batch taught the shapes, units were given rows to fill.
    assert any(u.out and u.out[0] is not None for u in executor.units)


class _ManyWorkers:
    """An executor that says it has ``workers`` workers (its units run on 2 threads)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.units: list[WorkUnit] = []
        self._threads = ThreadPoolExecutor(2)

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        self.units.append(unit)
        return self._threads.submit(unit.run)

    def share(self, array: Any) -> Any:
        copy = np.array(array, copy=True)
        copy.flags.writeable = False
        return copy

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._threads.shutdown(wait, cancel_futures=cancel_futures)


def _per_sample_graph(nbytes: int, samples: int = 40 * 16) -> Callable[[], Any]:
    def graph() -> Any:
        src = fn.external_source(source=_Indices(samples), batch=False, name="src")
        return fn.python_function(src, function=_Filler(nbytes), name="fill")

    return graph


class _Indices:
    def __init__(self, samples: int = 40 * 16) -> None:
        self.samples = samples  # an epoch's

    def __call__(self, info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.samples:
            raise StopIteration
        return np.array([info.idx_in_epoch])


class _Filler:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.full(self.nbytes, x[0] % 251, np.uint8)


def _scheduler_over(executor: Any, graph: Callable[[], Any], batch: int) -> Scheduler:
    pipe = mpexec.Pipeline(batch_size=batch, num_workers=0, seed=SEED)
    pipe.define(graph)
    assert pipe._graph is not None
    return Scheduler(
        pipe._graph.plan(),
        executor,
        batch_size=batch,
        prefetch_depth=2,
        seed=SEED,
        last_batch="partial",
        debug=False,
    )


@pytest.mark.parametrize(("workers", "batch"), [(16, 16), (2, 256)])
def test_chunks_carry_whole_batches_and_the_window_follows_the_workers(
    workers: int, batch: int
) -> None:
    """Quick samples: one dispatch a batch, not one per worker (issue 37), however large.

    Cut into a chunk per worker, a batch of 16 over 16 workers is 16 dispatches
    of one sample each: the main process's CPU a sample grows with the workers.
    Once the first calls say how long a sample takes, a chunk carries the whole
    batch, and the window keeps prefetch_depth batches in flight per worker. A
    batch of 256 too: cut into chunks of 64, it cost the main process 2.3x
    its CPU a sample (light samples, 2 workers).
    """
    executor = _ManyWorkers(workers)
    scheduler = _scheduler_over(executor, _per_sample_graph(16, 40 * batch), batch=batch)
    try:
        assert scheduler.window == 2  # nothing learned yet
        got = [scheduler.next_result() for _ in range(20)]
        assert scheduler.window == 2 * workers
    finally:
        scheduler.close()
        executor.shutdown()
    first = [u for u in executor.units if u.chunk.iteration == 0]
    assert len(first) == workers  # the first batch: a chunk per worker, to learn the timing
    later = [u for u in executor.units if u.chunk.iteration >= 4]
    assert later
    assert all(u.chunk.count == batch for u in later), {u.chunk.count for u in later}
    # The same samples, however they were cut.
    values = np.concatenate([b.as_array()[:, 0] for (b,) in got])
    assert values.tolist() == [i % 251 for i in range(20 * batch)]


@pytest.mark.parametrize(
    ("workers", "batch", "chunks"), [(64, 64, 16), (128, 256, 16), (16, 16, 16), (2, 3, 2)]
)
def test_the_first_batch_is_cut_a_chunk_per_worker_sixteen_at_most(
    workers: int, batch: int, chunks: int
) -> None:
    """Before a sample's CPU time is known, a batch goes out a chunk per worker, 16
    at most: a batch of 64 over 64 workers was 64 one-sample units (each a dispatch
    of the main process's, ~150 µs, for maybe a µs of work). The window still gives
    every worker ``prefetch_depth`` units to begin with."""
    executor = _ManyWorkers(workers)
    scheduler = _scheduler_over(executor, _per_sample_graph(16, 40 * batch), batch=batch)
    try:
        got = [scheduler.next_result() for _ in range(3)]
    finally:
        scheduler.close()
        executor.shutdown()
    first = [u.chunk for u in executor.units if u.chunk.iteration == 0]
    assert len(first) == chunks
    assert sorted(c.count for c in first)[0] == batch // chunks
    assert sum(c.count for c in first) == batch
    values = np.concatenate([b.as_array()[:, 0] for (b,) in got])
    assert values.tolist() == [i % 251 for i in range(3 * batch)]


class _Waits:
    """A sample that takes 50 ms of wall time and almost no CPU: a loaded host's view."""

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        time.sleep(0.05)
        return np.full(4, x[0] % 251, np.uint8)


def test_a_loaded_host_does_not_cut_batches_smaller() -> None:
    """Chunks are sized by the workers' CPU time, not wall time (one policy with map's).

    On a loaded host a sample's wall time grows while its work does not: sized
    by wall time, 8 samples of 50 ms (0.4 s) were cut in two, so the busier the
    host, the more the main process spent a sample. Their CPU is a few µs: the
    batch stays whole.
    """
    executor = _ManyWorkers(4)

    def waiting() -> Any:
        src = fn.external_source(source=_Indices(), batch=False, name="src")
        return fn.python_function(src, function=_Waits(), name="wait")

    scheduler = _scheduler_over(executor, waiting, batch=8)
    try:
        got = [scheduler.next_result() for _ in range(5)]
    finally:
        scheduler.close()
        executor.shutdown()
    later = [u for u in executor.units if u.chunk.iteration >= 2]
    assert later
    assert all(u.chunk.count == 8 for u in later), [u.chunk.count for u in later]
    values = np.concatenate([b.as_array()[:, 0] for (b,) in got])
    assert values.tolist() == [i % 251 for i in range(5 * 8)]


def test_an_epoch_launches_no_further_than_the_last_one_ended() -> None:
    """Iterations past an epoch's end cost dispatches: the next epoch stops where it ended.

    With 16 workers the window holds 32 iterations, so the first epoch (40
    batches, its end found in the workers) launches up to 32 past its end;
    the second launches up to where the first ended, then waits for that
    iteration to say whether the epoch goes on.
    """
    executor = _ManyWorkers(16)
    scheduler = _scheduler_over(executor, _per_sample_graph(4), batch=16)
    try:
        epochs = []
        for _ in range(2):
            got = []
            with contextlib.suppress(StopIteration):
                while True:
                    got.append(scheduler.next_result())
            epochs.append(got)
            scheduler.reset()
    finally:
        scheduler.close()
        executor.shutdown()
    assert [len(e) for e in epochs] == [40, 40]
    second = {u.chunk.iteration for u in executor.units if u.chunk.epoch == 1}
    assert max(second) == 40, sorted(second)  # its end (iteration 40), none past it
    for got in epochs:
        values = np.concatenate([b.as_array()[:, 0] for (b,) in got])
        assert values.tolist() == [i % 251 for i in range(40 * 16)]


class _Growing:
    """Epoch e has 10 + 5 * e batches of 16."""

    def __call__(self, info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= (10 + 5 * info.epoch_idx) * 16:
            raise StopIteration
        return np.array([info.idx_in_epoch])


def test_an_epoch_longer_than_the_last_goes_on_past_its_end() -> None:
    executor = _ManyWorkers(16)

    def graph() -> Any:
        src = fn.external_source(source=_Growing(), batch=False, name="src")
        return fn.python_function(src, function=_Filler(4), name="fill")

    scheduler = _scheduler_over(executor, graph, batch=16)
    try:
        lengths = []
        for _ in range(3):
            n = 0
            with contextlib.suppress(StopIteration):
                while True:
                    (b,) = scheduler.next_result()
                    assert b.as_array()[0, 0] == (n * 16) % 251
                    n += 1
            lengths.append(n)
            scheduler.reset()
    finally:
        scheduler.close()
        executor.shutdown()
    assert lengths == [10, 15, 20]


def test_the_window_stays_within_its_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large iterations: fewer in flight, each cut into more chunks to keep workers busy."""
    from mpexec import _scheduler

    batch, nbytes = 16, 4096
    monkeypatch.setattr(_scheduler, "_WINDOW_BYTES", 4 * batch * nbytes)  # 4 iterations
    executor = _ManyWorkers(16)
    scheduler = _scheduler_over(executor, _per_sample_graph(nbytes), batch=batch)
    try:
        for _ in range(20):
            scheduler.next_result()
        assert scheduler.window == 4
    finally:
        scheduler.close()
        executor.shutdown()
    later = [u for u in executor.units if u.chunk.iteration >= 4]
    # 2 (prefetch_depth) x 16 workers over 4 iterations: 8 chunks a batch.
    assert later
    assert all(u.chunk.count == batch // 8 for u in later)


class _Blocks(_ManyWorkers):
    """Counts the source arrays shared one by one; gives blocks of its memory."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.shared = 0
        self.blocks = 0

    def share(self, array: Any) -> Any:
        self.shared += 1
        return super().share(array)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        self.blocks += 1
        return np.empty(shape, dtype)


@pytest.mark.parametrize("ragged", [False, True])
def test_a_source_read_here_is_copied_a_batch_at_a_time(ragged: bool) -> None:
    """A source read in this process: its batch's samples enter shared memory as one block.

    One allocation and one copy a batch (the samples' rows), not one share a
    sample; ragged samples still go one by one.
    """
    batch, n = 8, 40
    samples = [np.full(3 + (i % 2 if ragged else 0), i, np.int32) for i in range(n)]
    executor = _Blocks(2)

    def graph() -> Any:
        src = fn.external_source(source=samples, batch=False, name="src", cycle=False)
        return src, fn.python_function(src, function=_Twice(), name="twice")

    scheduler = _scheduler_over(executor, graph, batch=batch)
    try:
        got = [scheduler.next_result() for _ in range(n // batch)]
        stats = {s.name: s for s in scheduler.op_stats()}
    finally:
        scheduler.close()
        executor.shutdown()
    for k, (src, twice) in enumerate(got):
        for j in range(batch):
            i = k * batch + j
            np.testing.assert_array_equal(src[j], samples[i])
            np.testing.assert_array_equal(twice[j], 2 * samples[i])
            assert not src[j].flags.writeable
    assert executor.shared == (n if ragged else 0)
    assert stats["src"].bytes_copied == sum(a.nbytes for a in samples)


class _Twice:
    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return 2 * x
