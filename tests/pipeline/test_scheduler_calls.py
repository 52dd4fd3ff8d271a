"""The scheduler's own Python calls a batch (issue 37: the main process at 2 workers).

At 2 workers the main process runs its code cold after every sleep, once a
batch or so (docs/scaling.md), so what a batch costs there is about how many
Python calls it makes. These count the calls made in the scheduler's own
modules (and ``threading``'s, where an iteration's done flag lived) for a batch
in steady state, with an executor that runs each unit at once, here: the
count does not depend on timing. Before the records below were kept instead
of worked out again each batch (the window and its cap, the sources and ops an
iteration walks, an op's names and inputs, a ``threading.Event`` a batch), a
batch made 66 such calls at 2 and 16 workers (20 now); a pipeline's ``run()``
11 for its checks of a fork (1 now).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._executors import WorkUnit
from mpexec._runtime import ChunkResult
from mpexec._scheduler import Scheduler
from tests.conftest import counted_opcodes

pytestmark = pytest.mark.usefixtures("no_leaks")

BATCH = 64


def _calls_in(files: tuple[str, ...], run: Callable[[], Any]) -> int:
    """Python calls (and generator resumptions) of code in ``files`` while ``run`` runs."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.endswith(files):
            calls += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


class _Outcome:
    """What ``submit_hooked`` hands its hook: a done Future's readers."""

    def __init__(self, result: ChunkResult) -> None:
        self._result = result

    def cancelled(self) -> bool:
        return False

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> ChunkResult:
        return self._result


class _Inline:
    """Says it has ``workers`` workers; runs each unit at once, here.

    As the pipeline's own executor does, it offers blocks (``empty``) and
    hands each unit's outcome to a hook (``submit_hooked``), with no Future.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def submit_unit(self, unit: WorkUnit) -> Future[ChunkResult]:
        raise AssertionError("submit_hooked is offered")

    def submit_hooked(self, unit: WorkUnit, hook: Callable[[Any], object]) -> None:
        hook(_Outcome(unit.run()))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return np.empty(shape, dtype)

    def share(self, array: Any) -> Any:
        return array

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _Index:
    def __call__(self, info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        return np.array([info.idx_in_epoch % 251], np.float32)


def _plus_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + 1


def _graph() -> Any:
    index = fn.external_source(source=_Index(), batch=False)
    return fn.python_function(index, function=_plus_one)


def _scheduler(workers: int) -> Scheduler:
    """A scheduler of :func:`_graph`'s pipeline over an :class:`_Inline` executor."""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=1)
    pipe.define(_graph)
    assert pipe._graph is not None
    return Scheduler(
        pipe._graph.plan(),
        _Inline(workers),
        batch_size=BATCH,
        prefetch_depth=2,
        seed=1,
        last_batch="partial",
        debug=False,
    )


@pytest.mark.parametrize("workers", [2, 16])
def test_a_batch_costs_the_scheduler_few_python_calls(workers: int) -> None:
    scheduler = _scheduler(workers)
    files = ("_scheduler.py", "_iterations.py", "threading.py")
    try:
        for _ in range(4 * workers):  # the chunks learned, the window full
            scheduler.next_result()
        batches = 16
        n = _calls_in(files, lambda: [scheduler.next_result() for _ in range(batches)])
        (out,) = scheduler.next_result()
        assert len(out) == BATCH
    finally:
        scheduler.close()
    assert n / batches <= 24, n / batches  # 20 here


def _profiled_batches(scheduler: Scheduler, profile: Any, warm: int = 8) -> None:
    """``warm`` batches (learned: one unit a batch here), then 16 with ``profile`` set."""
    for _ in range(warm):
        scheduler.next_result()
    sys.setprofile(profile)
    try:
        for _ in range(16):
            scheduler.next_result()
    finally:
        sys.setprofile(None)


def test_a_units_outcome_is_read_in_two_calls() -> None:
    """``exception()`` then ``result()``: a cancelled outcome raises in ``exception()``,
    as a done Future's does, so ``cancelled()`` is not asked first (3 calls a unit before)."""
    scheduler = _scheduler(2)
    reads = {_Outcome.cancelled.__code__, _Outcome.exception.__code__, _Outcome.result.__code__}
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event == "call" and frame.f_code in reads

    try:
        _profiled_batches(scheduler, profile)
    finally:
        scheduler.close()
    assert calls / 16 <= 2, calls / 16  # one unit a batch here, once learned


def test_a_units_outcome_is_taken_in_one_scheduler_frame() -> None:
    """The hook ``submit_hooked`` calls books the unit, fills its part of the batch and
    finishes the iteration in its own frame: no helper frame a unit (2 before)."""
    scheduler = _scheduler(2)
    frames = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal frames
        code = frame.f_code
        frames += event == "call" and code.co_name in {"_on_chunk", "_chunk_in"}

    try:
        for _ in range(8):  # once learned: one unit a batch
            scheduler.next_result()
        before = sum(s.calls for s in scheduler.ops)
        _profiled_batches(scheduler, profile, warm=0)
        stats = scheduler.op_stats()
    finally:
        scheduler.close()
    assert frames / 16 <= 1, frames / 16  # one unit a batch here, once learned
    assert sum(s.calls for s in stats) > before  # its statistics were still booked


def test_a_pipelines_run_checks_for_a_fork_once_a_process() -> None:
    """run() asked its pool whether this process is a fork, twice a batch (11 calls)."""
    checks = {"build", "_check_not_forked", "_forked_from", "status", "forked"}
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code.co_name in checks:
            calls += 1

    with mpexec.Pipeline(batch_size=4, num_workers=0, seed=1) as pipe:
        pipe.define(_graph)
        for _ in range(3):
            pipe.run()
        sys.setprofile(profile)
        try:
            for _ in range(10):
                pipe.run()
        finally:
            sys.setprofile(None)
    assert calls / 10 <= 1, calls / 10  # the pid compared, in _check_not_forked


def test_an_iterations_done_flag_wakes_every_waiter_once_set() -> None:
    """Done (one lock, not an Event): set once or twice, any number of waiters wake."""
    import threading

    from mpexec._iterations import Done

    done = Done()
    assert not done.is_set()
    assert not done.wait(0.01)  # not set: the timeout passes
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(done.wait(30))) for _ in range(4)]
    for t in waiters:
        t.start()
    done.set()
    done.set()  # a second set changes nothing
    for t in waiters:
        t.join(30)
    assert woke == [True] * 4
    assert done.is_set()
    assert done.wait(0)
    assert done.wait()


def _builtin_calls(run: Callable[[], Any]) -> list[str]:
    """The builtins (C functions) called while ``run`` runs, by name."""
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and arg is not sys.setprofile:
            called.append(arg.__name__)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return called


def test_a_work_unit_is_made_with_a_store_a_field() -> None:
    """A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (8 bytecodes a field on 3.11, a call each); a unit is made once a unit and read
    once by the executor, so its fields are plain stores (3 a field)."""
    import dataclasses

    from mpexec._runtime import Chunk

    chunk = Chunk(0, 1, 0, 64, 64)
    init = WorkUnit.__init__.__code__
    with counted_opcodes(lambda code: code is init) as ran:
        unit = WorkUnit(_plus_one, chunk, (), None, ("f",))
    fields = len(dataclasses.fields(WorkUnit))
    assert ran[0] <= 4 * fields + 4, (ran[0], fields)
    assert unit.chunk is chunk
    assert unit.out == ()


def test_a_block_from_a_slab_with_room_is_cut_without_working_its_size_out() -> None:
    """``LocalPoolExecutor.empty``: a block of a (shape, dtype) whose slab has room is
    its next rows, found by the key alone (the dtype, the page span and the slab's
    bounds were worked out again each batch: math.prod, np.dtype)."""
    from mpexec._executors import LocalPoolExecutor

    with mpexec.WorkerPool(1) as pool:
        executor = LocalPoolExecutor(pool)
        dtype = np.dtype(np.float32)
        first = executor.empty((64, 16), dtype)
        blocks: list[Any] = []
        called = _builtin_calls(lambda: blocks.append(executor.empty((64, 16), dtype)))
        assert "prod" not in called, called
        assert blocks[0].shape == (64, 16)
        assert blocks[0].dtype == dtype
        assert not np.shares_memory(first, blocks[0])  # pages of its own
        blocks.clear()
        del first


def _inline_scheduler(pipe: Any, graph: Any) -> Scheduler:
    """A scheduler of ``graph`` over an inline executor that reports 2 workers."""
    pipe.define(graph)
    assert pipe._graph is not None
    return Scheduler(
        pipe._graph.plan(),
        _Inline(2),
        batch_size=BATCH,
        prefetch_depth=2,
        seed=1,
        last_batch="partial",
        debug=False,
    )


def test_a_units_statistics_are_booked_per_op_not_per_member_of_its_chain() -> None:
    """A unit's outcome counts the calls and samples once for its whole chain (the op
    it ends: ``OpState.calls`` follows), and only the time and bytes per member:
    with a chain of 4 ops, 481 bytecodes of ``_on_chunk`` a batch before, 399 now."""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=1)

    def graph() -> Any:
        x = fn.external_source(source=_Index(), batch=False)
        for _ in range(3):
            x = fn.python_function(x, function=_plus_one)
        return x

    scheduler = _inline_scheduler(pipe, graph)
    batches = 16
    try:
        assert max(len(s.members) for s in scheduler.ops) == 4  # one chain, one unit
        for _ in range(8):
            scheduler.next_result()
        with counted_opcodes(lambda code: code is Scheduler._on_chunk.__code__) as ran:
            for _ in range(batches):
                scheduler.next_result()
        stats = scheduler.op_stats()
    finally:
        scheduler.close()
    assert ran[0] / batches <= 440, ran[0] / batches
    # Each op's statistics still whole: every sample of the batches made so far
    # (and those the window made ahead), one call a sample.
    ((calls, samples),) = {(s.calls, s.samples) for s in stats}
    assert calls == samples >= 24 * BATCH, stats


def test_a_slabs_block_is_shared_with_the_descriptor_made_when_it_was_cut() -> None:
    """A batch's block goes to its unit whole (one unit a batch once the chunks are
    learned): the pool shares it with the descriptor made when it was cut from its
    slab (only the start moves from one block to the next). Each batch looked for its
    allocation (``find_anchor``), described it and packed that again (~240 bytecodes)."""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=2, seed=1)
    pipe.define(_graph)
    looked = 0
    looks = {"find_anchor", "pack", "share_own", "_share_in_place"}

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal looked
        looked += event == "call" and frame.f_code.co_name in looks

    with pipe:
        pipe.build()
        for _ in range(8):
            pipe.run()
        batches = 16
        sys.setprofile(profile)
        try:
            got = [pipe.run() for _ in range(batches)]
        finally:
            sys.setprofile(None)
    assert looked / batches <= 1, looked / batches
    for i, (out,) in enumerate(got):  # each batch's own rows, in its own block
        want = (np.arange((8 + i) * BATCH, (9 + i) * BATCH) % 251 + 1).astype(np.float32)
        assert np.array_equal(np.asarray(out).reshape(-1), want)


def _batch_plus_one(xs: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    return [x + 1 for x in xs]


@pytest.mark.parametrize("batch_mode", [False, True])
def test_a_batch_sent_as_one_unit_skips_the_per_chunk_bookkeeping(batch_mode: bool) -> None:
    """Once a batch goes out as one unit (batch mode, and per sample once learned), its
    outcome is its columns: no parts list, bounds or blocks kept by op, no ``assemble``
    of one part. Bytecodes of the scheduler's modules a batch at 2 workers: 1,384 per
    sample and 1,277 in batch mode before, 1,210 and 1,124 with it. (The bounds are
    3.10's, the highest: 1,281 and 1,200, then 10 more for the hand-out count that
    ``Pipeline.run`` reads to take back what a Ctrl-C cut off.)"""
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=0, seed=1)

    def graph() -> Any:
        index = fn.external_source(source=_Index(), batch=False)
        f = _batch_plus_one if batch_mode else _plus_one
        return fn.python_function(index, function=f, batch_processing=batch_mode)

    scheduler = _inline_scheduler(pipe, graph)
    assembled = 0

    def picked(code: Any) -> bool:
        nonlocal assembled
        if not code.co_filename.endswith(("_scheduler.py", "_iterations.py")):
            return False
        assembled += code.co_name == "assemble"
        return True

    batches = 16
    try:
        for _ in range(8):
            scheduler.next_result()
        with counted_opcodes(picked) as ran:
            got = [scheduler.next_result() for _ in range(batches)]
    finally:
        scheduler.close()
    assert assembled == 0, assembled
    assert ran[0] / batches <= (1210 if batch_mode else 1291), ran[0] / batches
    for i, (out,) in enumerate(got):  # each batch's own rows, read-only
        want = (np.arange((8 + i) * BATCH, (9 + i) * BATCH) % 251 + 1).astype(np.float32)
        assert np.array_equal(np.asarray(out).reshape(-1), want)
