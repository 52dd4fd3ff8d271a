"""A source and an op that import nothing of mpexec's in a worker.

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
