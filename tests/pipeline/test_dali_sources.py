"""DALI's ``fn.external_source``, as DALI's own code and tests use it, by renaming the import.

DALI's defaults and keywords (``cycle=None``, ``bytes_per_sample_hint``, a dtype
per output), its epoch ends (a per-sample source's partial batch is dropped; a
source that does not cycle stays exhausted after ``reset()``) and its parallel
batch mode (batch callables, iterables and generators run in the workers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn, types
from mpexec.pipeline import Pipeline

pytestmark = pytest.mark.usefixtures("no_leaks")


def _sample(info: Any) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= 10:
        raise StopIteration
    return np.full((2,), info.idx_in_epoch, np.int32)


def _pair(info: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return np.full((2,), info.idx_in_epoch, np.uint8), np.array([info.idx_in_batch], np.int32)


def _sizes(pipe: Pipeline, runs: int) -> list[Any]:
    """Batch sizes of ``runs`` calls to run(), "Stop" where it raised StopIteration."""
    out: list[Any] = []
    for _ in range(runs):
        try:
            (b, *_) = pipe.run()
        except StopIteration:
            out.append("Stop")
            pipe.reset()
            continue
        out.append(len(b))
    return out


# ================================================================ arguments (items 1, 2, 6)


@pytest.mark.parametrize("workers", [0, 2])
def test_dali_defaults_and_keywords_are_accepted(workers: int) -> None:
    """``cycle=None`` (DALI's default, passed explicitly by its helpers),
    ``bytes_per_sample_hint``, ``prefetch_queue_depth=None``, ``batch_info=None``."""
    pipe = Pipeline(4, 1, None, num_workers=workers, seed=1)
    with pipe:
        x = fn.external_source(
            _sample,
            batch=False,
            cycle=None,
            bytes_per_sample_hint=1 << 20,
            prefetch_queue_depth=None,
            batch_info=None,
            layout="X",
        )
        pipe.set_outputs(x)
    with pipe:
        (b,) = pipe.run()
        assert [int(s[0]) for s in b] == [0, 1, 2, 3]
        assert b.layout() == "X"


def test_a_dtype_per_output() -> None:
    pipe = Pipeline(3, 1, None, num_workers=0, seed=1)
    with pipe:
        a, b = fn.external_source(
            _pair, num_outputs=2, batch=False, dtype=[types.UINT8, types.INT32], ndim=[1, 1]
        )
        pipe.set_outputs(a, b)
    with pipe:
        a_out, b_out = pipe.run()
        assert a_out.dtype == np.uint8
        assert b_out.dtype == np.int32
    with Pipeline(3, 1, None, num_workers=0):  # noqa: SIM117 - the definition's block
        with pytest.raises(mpexec.OpArgumentError, match="3 output_dtypes given for 2 outputs"):
            fn.external_source(_pair, num_outputs=2, batch=False, dtype=[types.UINT8] * 3)


# ================================================================ epochs (items 4, 5)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_partial_batch_ended_by_a_sample_source_is_dropped(workers: int) -> None:
    """DALI: 10 samples in batches of 4 give [4, 4, Stop]; ``last_batch="partial"``
    (mpexec's own choice, explicit) keeps the short one: [4, 4, 2, Stop]."""
    for last_batch, expected in ((None, [4, 4, "Stop"] * 2), ("partial", [4, 4, 2, "Stop"] * 2)):
        extra = {} if last_batch is None else {"last_batch": last_batch}
        pipe = Pipeline(4, 1, None, num_workers=workers, seed=1, **extra)
        with pipe:
            pipe.set_outputs(fn.external_source(_sample, batch=False))
        with pipe:
            assert _sizes(pipe, len(expected)) == expected


def _two_batches() -> Iterator[list[np.ndarray[Any, Any]]]:
    for i in range(2):
        yield [np.full((1,), i, np.int32)] * 2


@pytest.mark.parametrize(
    "source",
    [_two_batches, [[np.zeros(1)] * 2, [np.ones(1)] * 2]],
    ids=["generator function", "list"],
)
def test_a_source_that_does_not_cycle_stays_exhausted_after_reset(source: Any) -> None:
    """DALI: [0, 1, Stop, Stop]: reset() does not start a one-pass source again;
    ``cycle="raise"`` does (the epoch ends, and the next starts it again)."""
    for cycle, expected in ((None, [2, 2, "Stop", "Stop"]), ("raise", [2, 2, "Stop"] * 2)):
        pipe = Pipeline(2, 1, None, num_workers=0, seed=1)
        with pipe:
            pipe.set_outputs(fn.external_source(source, cycle=cycle))
        with pipe:
            assert _sizes(pipe, len(expected)) == expected


# ================================================================ parallel batch mode (item 3)


def _batch_of(info: Any) -> list[np.ndarray[Any, Any]]:
    """A batch callable taking DALI's BatchInfo: 3 iterations, then the epoch ends."""
    if info.iteration >= 3:
        raise StopIteration
    base = info.iteration * 4 + 100 * info.epoch_idx
    return [np.array([base + i, os.getpid()], np.int64) for i in range(4)]


class _Batches:
    """An iterable of 3 batches of 4 (``iter()`` starts it again), with the reader's pid."""

    def __iter__(self) -> Iterator[list[np.ndarray[Any, Any]]]:
        for k in range(3):
            yield [np.array([4 * k + i, os.getpid()], np.int64) for i in range(4)]


def _gen_batches() -> Iterator[list[np.ndarray[Any, Any]]]:
    yield from _Batches()


def _epochs(pipe: Pipeline, epochs: int) -> list[list[list[int]]]:
    """Per epoch, per iteration, the first value of each sample (reset between epochs)."""
    out = []
    for _ in range(epochs):
        got = []
        while True:
            try:
                (b,) = pipe.run()
            except StopIteration:
                pipe.reset()
                break
            got.append([int(s[0]) for s in b])
        out.append(got)
    return out


def _pids(pipe: Pipeline) -> set[int]:
    (b,) = pipe.run()
    return {int(s[1]) for s in b}


def test_a_parallel_batch_callable_runs_in_the_workers() -> None:
    pipe = Pipeline(4, 1, None, py_num_workers=2, seed=1)
    with pipe:
        pipe.set_outputs(fn.external_source(_batch_of, parallel=True, batch=True, batch_info=True))
    with pipe:
        assert os.getpid() not in _pids(pipe)
        pipe.reset()
        got = _epochs(pipe, 2)
    first = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert got[0] == [[v + 100 for v in b] for b in first]  # epoch 1 (after the reset above)
    assert got[1] == [[v + 200 for v in b] for b in first]


@pytest.mark.parametrize("source", [_Batches(), _gen_batches], ids=["iterable", "generator"])
@pytest.mark.parametrize("workers", [0, 3])
def test_a_parallel_iterable_is_read_in_order_in_one_worker(source: Any, workers: int) -> None:
    results = {}
    for parallel in (False, True):
        pipe = Pipeline(4, 1, None, num_workers=workers, seed=1, prefetch_queue_depth=3)
        with pipe:
            pipe.set_outputs(fn.external_source(source, parallel=parallel, cycle="raise"))
        with pipe:
            pids = _pids(pipe)
            pipe.reset()
            results[parallel] = _epochs(pipe, 3)
        if parallel and workers:
            assert len(pids) == 1
            assert os.getpid() not in pids
    assert results[True] == results[False] == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]] * 3


@pytest.mark.parametrize(
    ("cycle", "expected"),
    [
        (None, [4, 4, 4, "Stop", "Stop", "Stop"]),
        ("raise", [4, 4, 4, "Stop", 4, 4]),
        ("quiet", [4, 4, 4, 4, 4, 4]),
    ],
)
def test_a_parallel_iterable_cycles_as_dali(cycle: Any, expected: list[Any]) -> None:
    pipe = Pipeline(4, 1, None, py_num_workers=2, seed=1)
    with pipe:
        pipe.set_outputs(fn.external_source(_gen_batches, parallel=True, cycle=cycle))
    with pipe:
        assert _sizes(pipe, len(expected)) == expected


def test_a_parallel_iterable_resumes_where_its_state_says() -> None:
    def make() -> Pipeline:
        pipe = Pipeline(4, 1, None, py_num_workers=2, seed=1)
        with pipe:
            pipe.set_outputs(fn.external_source(_Batches(), parallel=True, cycle="quiet"))
        return pipe

    with make() as pipe:
        pipe.run()
        state = pipe.state_dict()
        expected = [[int(s[0]) for s in pipe.run()[0]] for _ in range(4)]
    resumed = make()
    resumed.load_state_dict(state)
    with resumed:
        assert [[int(s[0]) for s in resumed.run()[0]] for _ in range(4)] == expected
    assert expected == [[4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]]


def _no_args() -> None:
    return None


def _three_args(a: Any, b: Any, c: Any) -> None:
    del a, b, c


@pytest.mark.parametrize(
    ("source", "batch", "words"),
    [
        (_no_args, False, "must accept exactly one argument"),
        (_three_args, True, "must accept either 0 or 1 positional arguments"),
        (_Batches(), False, "with an iterable must be run in a batch mode"),
        (_gen_batches, False, "with a generator function must be run in a batch mode"),
    ],
)
def test_parallel_sources_dali_refuses_are_refused_when_defined(
    source: Any, batch: bool, words: str
) -> None:
    with Pipeline(4, 1, None, num_workers=0), pytest.raises(TypeError, match=words):
        fn.external_source(source, parallel=True, batch=batch)


def test_dali_py_num_workers_0_refuses_a_parallel_source() -> None:
    """DALI's keyword, DALI's rule; mpexec's num_workers=0 runs the source here."""
    pipe = Pipeline(4, 1, None, py_num_workers=0)
    with pipe:
        pipe.set_outputs(fn.external_source(_sample, batch=False, parallel=True))
    with pytest.raises(RuntimeError, match="cannot run in parallel mode without Python workers"):
        pipe.build()
    pipe.close()
    pipe = Pipeline(4, 1, None, num_workers=0)
    with pipe:
        pipe.set_outputs(fn.external_source(_sample, batch=False, parallel=True))
    with pipe:
        assert len(pipe.run()[0]) == 4
