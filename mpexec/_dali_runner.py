"""What :func:`mpexec.dali.python_function` runs in a worker: a DALI function over rows.

A worker-side room: a worker that unpickles :class:`ChunkRunner` imports this
module and ``_runtime`` only, never the caller's side (the pool, the
pipeline), which ``mpexec.dali`` imports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._runtime import write_block


class ChunkRunner:
    """Runs in a worker: ``function`` over rows of a batch (sent once, cached there).

    ``out``: per output, the rows of the batch's output block for this chunk
    (writable shared memory), or None. An output whose samples all fit their
    rows (shape and dtype) is written there and comes back as None: only the
    block travels, as one descriptor, and the caller hands DALI its rows.

    Its per-sample loop is its own, not ``_runtime.each_sample`` (every
    pipeline op's loop): ``each_sample`` sets what ``mpexec.sample_info()``
    returns to the sample's place in a pipeline's epoch and iteration, and
    DALI's ``python_function`` contract gives the function arrays only, never
    its place (DALI does not tell the op its epoch or iteration): inside a
    DALI function ``mpexec.sample_info()`` stays None, as outside any op.
    """

    def __init__(self, function: Callable[..., Any], num_outputs: int, batch: bool) -> None:
        self.function = function
        self.num_outputs = num_outputs
        self.batch = batch

    def __call__(
        self, *columns: Sequence[Any], out: tuple[Any, ...] = ()
    ) -> tuple[float, tuple[Any, ...]]:
        """(CPU seconds the chunk took here, per output: its samples, or None if written)."""
        t0 = time.thread_time()
        n = self.num_outputs
        results = self._compute(columns)
        written = tuple(
            None if block is not None and write_block(col, block) else col
            for col, block in zip(results, out or (None,) * n, strict=True)
        )
        return time.thread_time() - t0, written

    def _compute(self, columns: Sequence[Sequence[Any]]) -> list[list[Any]]:
        n = self.num_outputs
        if self.batch:
            got = self.function(*(list(c) for c in columns))  # lists, as DALI gives
            parts = () if n == 0 else (got,) if n == 1 else outputs(got, n)
            return [[np.asarray(v) for v in p] for p in parts]
        results: list[list[Any]] = [[] for _ in range(n)]
        for row in zip(*columns, strict=True):
            got = self.function(*row)
            if n == 0:
                continue
            for col, value in zip(results, (got,) if n == 1 else outputs(got, n), strict=True):
                col.append(np.asarray(value))
        return results


def outputs(out: Any, n: int) -> tuple[Any, ...]:
    """A call's ``n`` outputs, checked: a tuple (or list) of exactly ``n``."""
    if not isinstance(out, (tuple, list)) or len(out) != n:
        got = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ValueError(
            f"the function has num_outputs={n}: it must return a tuple of {n} outputs, not {got}"
        )
    return tuple(out)
