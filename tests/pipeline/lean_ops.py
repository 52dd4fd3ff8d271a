"""Sources and an op that import nothing of mpexec's in a worker.

A test module's functions would import their module in a worker, and with it
whatever it imports: these show what a worker imports for mpexec's own sake.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np


class Indices:
    """``n`` samples, each its index."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.array([info.idx_in_epoch], np.int64)


def modules_loaded(ids: list[Any]) -> list[Any]:
    """A batch op: each sample, the number of mpexec's modules its process has loaded."""
    loaded = sum(name.startswith("mpexec") for name in sys.modules)
    return [np.array([loaded], np.int64) for _ in ids]


class Samples:
    """``n`` samples: (3 floats drawn from ``np.random``, the sample's index)."""

    def __init__(self, n: int, fail_at: int = -1, ragged_at: int = -1) -> None:
        self.n, self.fail_at, self.ragged_at = n, fail_at, ragged_at

    def __call__(self, info: Any) -> tuple[np.ndarray[Any, Any], ...]:
        i = info.idx_in_epoch
        if i >= self.n:
            raise StopIteration
        if i == self.fail_at:
            raise ValueError(f"no sample {i}")
        x = np.random.rand(3) + i
        if i == self.ragged_at:
            x = x.reshape(1, 3)  # another rank than its batch's other samples
        return x, np.array([i], np.int64)
