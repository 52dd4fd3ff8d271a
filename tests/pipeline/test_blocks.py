"""One dense block per batch and output (mpexec/_scheduler.py, mpexec/_batch.py).

An output whose samples share a shape and dtype (declared, or learned from the first
batch) is one block of shared memory per batch that the chunks write their rows into:
``Batch.as_array()`` is that block, uncopied; ``batch[i]`` a view of it; DLPack exports
it. A batch with a sample of another shape falls back to per-sample arrays; held
batches stay valid while later ones are computed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._runtime import np_from_dlpack, write_block

pytestmark = pytest.mark.usefixtures("no_leaks")

EPOCH = 40
BATCH = 8


def _source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    return np.full(6, info.idx_in_epoch, dtype=np.float32)


def _plus_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + 1


def _odd_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Sample 21 of the epoch is longer than the others: its batch is ragged."""
    return np.concatenate([x, x]) if x[0] == 21 else x * 2


def _batch_square(xs: list[Any]) -> Any:
    assert isinstance(xs, list)  # a batch function gets a list, also of a dense batch
    return np.stack(xs) ** 2


def _want(i: int, f: Any) -> np.ndarray[Any, Any]:
    return np.asarray(f(np.full(6, i, dtype=np.float32)))


def _pipe(function: Any, num_workers: int, **kw: Any) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=BATCH, num_workers=num_workers, seed=3)
    def graph() -> Any:
        src = fn.external_source(source=_source, batch=False)
        return fn.python_function(src, function=function, **kw)

    return graph()


def _is_block(batch: mpexec.Batch) -> bool:
    """The batch is one array its samples are views of (no copy made by as_array)."""
    block = batch.as_array()
    return all(np.shares_memory(batch[j], block) for j in range(len(batch)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_learned_shape_gives_one_block_per_batch(num_workers: int) -> None:
    held = []
    with _pipe(_plus_one, num_workers) as pipe:
        for k, (out,) in enumerate(pipe):
            held.append(out)
            assert out.as_array() is out.as_array()
            assert not out.as_array().flags.writeable
            if k >= 2:  # the first batch taught the shape (the second was in flight)
                assert _is_block(out)
                assert out.shape() == [(6,)] * BATCH
                assert out.dtype == np.float32
                assert out.ndim == 1
                assert out.nbytes == BATCH * 6 * 4
    assert len(held) == EPOCH // BATCH
    # Held batches stay valid and unchanged while later ones were computed.
    for k, out in enumerate(held):
        for j in range(BATCH):
            np.testing.assert_array_equal(out[j], _want(k * BATCH + j, _plus_one))
        np.testing.assert_array_equal(out[2:4].as_array(), out.as_array()[2:4])


def test_declared_shape_gives_a_block_from_the_first_batch() -> None:
    with _pipe(_plus_one, 2, output_shapes=[(6,)], output_dtypes=[np.float32]) as pipe:
        (out,) = pipe.run()
        assert _is_block(out)
        exported = np_from_dlpack(out)
        # NumPy before 2.1 cannot export read-only memory: Batch exports a copy there.
        readonly_export = np.lib.NumpyVersion(np.__version__) >= "2.1.0"
        assert np.shares_memory(exported, out.as_array()) == readonly_export
        np.testing.assert_array_equal(exported[5], _want(5, _plus_one))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_of_another_shape_makes_its_batch_ragged(num_workers: int) -> None:
    with _pipe(_odd_one, num_workers) as pipe:
        batches = [out for (out,) in pipe]
    for k, out in enumerate(batches):
        for j in range(BATCH):
            np.testing.assert_array_equal(out[j], _want(k * BATCH + j, _odd_one))
    assert not batches[21 // BATCH].is_dense()
    # The batches after it are blocks again (the shape is learned anew).
    assert _is_block(batches[-1])


def test_declared_shape_rejects_a_departing_sample() -> None:
    with (
        _pipe(_odd_one, 2, output_shapes=[(6,)], output_dtypes=[np.float32]) as pipe,
        pytest.raises(mpexec.OpOutputError, match="output_shapes declares"),
    ):
        list(pipe)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_op_writes_its_array_into_the_block(num_workers: int) -> None:
    with _pipe(_batch_square, num_workers, batch_processing=True) as pipe:
        batches = [out for (out,) in pipe]
    for k, out in enumerate(batches):
        want = np.stack([_want(k * BATCH + j, lambda x: x) for j in range(BATCH)]) ** 2
        np.testing.assert_array_equal(out.as_array(), want)
    assert _is_block(batches[-1])


def test_blocks_are_bit_identical_across_workers() -> None:
    def run(num_workers: int) -> list[bytes]:
        with _pipe(_plus_one, num_workers) as pipe:
            return [out.as_array().tobytes() for (out,) in pipe]

    assert run(0) == run(1) == run(2)


def test_write_block_takes_only_rows_of_the_blocks_shape_and_dtype() -> None:
    block = np.zeros((3, 2, 2), np.float32)
    rows = [np.full((2, 2), i, np.float32) for i in range(3)]
    assert write_block(rows, block)
    assert block.tolist() == [r.tolist() for r in rows]
    fresh = np.zeros((3, 2, 2), np.float32)
    assert not write_block([*rows[:2], rows[2].astype(np.float64)], fresh)  # a dtype departs
    assert not write_block([*rows[:2], np.zeros((4,), np.float32)], fresh)  # same size, shape
    assert not write_block(rows[:2], fresh)  # a row short
    scalars = np.zeros(3, np.int64)
    assert write_block([np.array(i, np.int64) for i in (4, 5, 6)], scalars)
    assert scalars.tolist() == [4, 5, 6]
    assert not write_block([np.array(1, np.int64), np.array(2, np.int32), np.array(3)], scalars)
    apart = np.zeros((3, 4, 2), np.float32)[:, :2, :]  # not one contiguous run of rows
    assert not write_block(rows, apart)
    assert not apart.any()
