"""A large per-sample output is copied into its batch block as soon as it is made.

``_runtime.row_writer``: rows of ``EARLY_ROW_BYTES`` or more go into the block
while still in the CPU's caches, not after the chunk's other samples (issue 37:
53 us an image at the chunk's end in the demo, 12 as made). The result is the
same: a column written into the block, or, where a sample departs from the
block's row, every sample's array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mpexec._runtime import EARLY_ROW_BYTES, ChainRunner, Chunk, OpRunner

ROW = (EARLY_ROW_BYTES // 4,)  # float32 rows just large enough
CHUNK = 5


class Watching:
    """Makes row ``x[0]``, recording what row ``x[0] - 1`` of ``block`` held then."""

    def __init__(self, block: np.ndarray[Any, Any], odd: int = -1, shape: tuple[int, ...] = ROW):
        self.block, self.odd, self.shape = block, odd, shape
        self.seen: list[float] = []

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        j = int(x[0])
        if j:
            self.seen.append(float(self.block[j - 1, 0]))
        if j == self.odd:  # departs from the block's row
            return np.full(self.shape[0] + 1, j + 0.5, np.float32)
        return np.full(self.shape, j + 0.5, np.float32)


def _inputs() -> list[np.ndarray[Any, Any]]:
    return [np.array([j]) for j in range(CHUNK)]


def _run(runner: Any, block: np.ndarray[Any, Any]) -> Any:
    return runner(Chunk(0, 0, 0, CHUNK, 0), _inputs(), out=(block,))


@pytest.mark.parametrize("chained", [False, True])
def test_a_large_row_is_in_its_block_before_the_next_sample_runs(chained: bool) -> None:
    block = np.zeros((CHUNK, *ROW), np.float32)
    fn = Watching(block)
    runner: Any = OpRunner("w", fn, "sample", 1, entropy=1)
    if chained:
        first = OpRunner("id", np.asarray, "sample", 1, entropy=2)
        runner = ChainRunner([first, runner], [(0,)] * 2)
    got = _run(runner, block)
    assert fn.seen == [j + 0.5 for j in range(CHUNK - 1)]
    assert got.written == (True,)
    assert got.outputs == (None,)
    assert block[:, 0].tolist() == [j + 0.5 for j in range(CHUNK)]
    assert (block == block[:, :1]).all()


def test_a_small_row_waits_for_the_chunks_end() -> None:
    shape = (EARLY_ROW_BYTES // 4 - 1,)
    block = np.zeros((CHUNK, *shape), np.float32)
    fn = Watching(block, shape=shape)
    got = _run(OpRunner("w", fn, "sample", 1, entropy=1), block)
    assert fn.seen == [0.0] * (CHUNK - 1)
    assert got.written == (True,)
    assert block[:, 0].tolist() == [j + 0.5 for j in range(CHUNK)]


@pytest.mark.parametrize("odd", [0, 2, CHUNK - 1])
def test_a_departing_sample_gives_every_samples_array(odd: int) -> None:
    block = np.zeros((CHUNK, *ROW), np.float32)
    got = _run(OpRunner("w", Watching(block, odd=odd), "sample", 1, entropy=1), block)
    assert got.written == (False,)
    column = got.outputs[0]
    assert [len(a) for a in column] == [ROW[0] + (j == odd) for j in range(CHUNK)]
    for j, a in enumerate(column):
        assert a.dtype == np.float32
        assert (a == j + 0.5).all()
    # The arrays stand alone: the block is scratch once the column went as arrays.
    block[:] = -1
    assert all((a == j + 0.5).all() for j, a in enumerate(column))


def test_another_dtype_is_not_written_early() -> None:
    block = np.zeros((CHUNK, *ROW), np.float64)  # rows are float32: they travel as arrays
    got = _run(OpRunner("w", Watching(block), "sample", 1, entropy=1), block)
    assert got.written == (False,)
    assert [float(a[0]) for a in got.outputs[0]] == [j + 0.5 for j in range(CHUNK)]
