"""A batch's dense block is cut from a slab of blocks, not allocated a batch (issue 37).

``Arena.empty`` cost the main process 40-75 µs of CPU a batch (cold) in
``python -m benchmarks mainload``; a slice of a slab costs a few. Each block
still starts on a page and has its pages to itself: a worker given its rows
writable reaches no other batch's.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _executors


def _source(info: Any) -> np.ndarray[Any, Any]:
    return np.full(16, info.idx_in_epoch, np.float32)


def test_small_blocks_come_from_slabs_on_pages_of_their_own(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with mpexec.WorkerPool(2) as pool:
        allocated: list[tuple[Any, ...]] = []
        real = mpexec.WorkerPool.empty

        def counted(self: Any, shape: Any, dtype: Any = np.float64) -> Any:
            allocated.append(shape)
            return real(self, shape, dtype)

        monkeypatch.setattr(mpexec.WorkerPool, "empty", counted)
        ex = _executors.LocalPoolExecutor(pool)
        blocks = [ex.empty((64, 16), np.dtype(np.float32)) for _ in range(40)]
        assert len(allocated) == 1  # one slab for 40 blocks of 4 KiB
        starts = [b.__array_interface__["data"][0] for b in blocks]
        assert all(s % mmap.PAGESIZE == 0 for s in starts)
        assert len({s // mmap.PAGESIZE for s in starts}) == len(blocks)
        for i, b in enumerate(blocks):
            b[...] = i
        assert all((b == i).all() for i, b in enumerate(blocks))
        big = ex.empty((64, 4096), np.dtype(np.float32))  # 1 MiB: its own allocation
        assert len(allocated) == 2
        assert big.shape == (64, 4096)


def test_a_pipelines_batches_share_a_slab_and_stay_right(
    no_leaks: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = mpexec.WorkerPool.empty

    def counted(self: Any, shape: Any, dtype: Any = np.float64) -> Any:
        calls.append(shape)
        return real(self, shape, dtype)

    monkeypatch.setattr(mpexec.WorkerPool, "empty", counted)

    @mpexec.pipeline_def(batch_size=64, num_workers=2, seed=1)
    def pipe() -> Any:
        x = mpexec.fn.external_source(source=_source, batch=False)
        return mpexec.fn.python_function(x, function=lambda a: a * 2)

    kept = []
    with pipe() as p:
        p.build()
        for i in range(12):
            (out,) = p.run()
            arr = np.asarray(out.as_array())
            expect = 2 * np.arange(64 * i, 64 * (i + 1), dtype=np.float32)
            np.testing.assert_array_equal(arr[:, 0], expect)
            kept.append((arr, expect))
    for arr, expect in kept:  # a later batch wrote none of an earlier one's rows
        np.testing.assert_array_equal(arr[:, 0], expect)
    assert len(calls) < 6, calls  # 12 batches: a slab holds 64 of them
