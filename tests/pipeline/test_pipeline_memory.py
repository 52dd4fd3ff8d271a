"""A pipeline under a full arena: every run() returns a batch or a typed error, never blocks.

The scheduler allocates shared memory for an iteration in the window (a
source's copy, an op's dense output block); when that fails, the iteration
fails with the error, and the iterations after it go on once memory is back.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import fn

pytestmark = pytest.mark.usefixtures("no_leaks")

MIB = 1 << 20
SHAPE = (1024, 1024)  # 4 MiB of float32 per sample


def _big(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.full(SHAPE, float(x[0]), np.float32)


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x[:1, :1] * 2


def _bounded_run(pipe: mpexec.Pipeline, timeout: float = 60.0) -> Any:
    """``pipe.run()``'s batch, or the exception it raised; fails the test if it blocks."""
    got: list[Any] = []

    def go() -> None:
        try:
            got.append(pipe.run())
        except Exception as exc:
            got.append(exc)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"run() blocked for {timeout} s after a memory error")
    return got[0]


def _drive(pipe: mpexec.Pipeline, runs: int) -> list[str]:
    """Run ``runs`` times, holding batches until a run fails, then dropping them all."""
    held: list[Any] = []
    seen = []
    for _ in range(runs):
        out = _bounded_run(pipe)
        if isinstance(out, Exception):
            assert isinstance(out, (shm.ArenaFullError, shm.ReservationError)), out
            seen.append("error")
            held.clear()  # the caller lets go: memory comes back
        else:
            seen.append("ok")
            held.append(out)
    return seen


def test_a_full_arena_for_an_output_block_fails_that_iteration_only() -> None:
    """Declared outputs go to a block in the pool's arena; a full arena must not hang run()."""
    pool = mpexec.WorkerPool(2, arena_size=8 * MIB, arena_capacity=48 * MIB)

    @mpexec.pipeline_def(batch_size=2, prefetch_depth=2, pool=pool, seed=1)
    def pipe_def() -> Any:
        x = fn.external_source(
            source=lambda info: np.full(4, info.idx_in_epoch, np.float32), batch=False
        )
        return fn.python_function(
            x, function=_big, output_shapes=[SHAPE], output_dtypes=[np.float32]
        )

    try:
        with pipe_def() as pipe:
            seen = _drive(pipe, 14)
    finally:
        pool.shutdown()
    assert "error" in seen
    # After the first error the caller dropped its batches: batches come again.
    assert "ok" in seen[seen.index("error") :]


def test_a_full_arena_for_a_source_copy_fails_that_iteration_only() -> None:
    """A batch source read here is copied into the pool's arena; a full arena must not hang."""
    pool = mpexec.WorkerPool(2, arena_size=8 * MIB, arena_capacity=48 * MIB)

    def batches(info: Any) -> list[np.ndarray[Any, Any]]:
        return [np.full(SHAPE, info.iteration, np.float32) for _ in range(2)]

    @mpexec.pipeline_def(batch_size=2, prefetch_depth=2, pool=pool, seed=1)
    def pipe_def() -> Any:
        # Its batches are the pipeline's output: held, they hold the arena's memory.
        x = fn.external_source(source=batches, batch=True, batch_info=True)
        return x, fn.python_function(x, function=_double)

    try:
        with pipe_def() as pipe:
            seen = _drive(pipe, 14)
    finally:
        pool.shutdown()
    assert "error" in seen
    assert "ok" in seen[seen.index("error") :]
