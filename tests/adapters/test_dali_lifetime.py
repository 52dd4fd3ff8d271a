"""mpexec.dali.python_function's lifetime: closed is final; a worker death costs one batch.

These run without DALI: the object is called as DALI's executor calls it,
with lists of arrays.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import psutil
import pytest

import mpexec
import mpexec.dali

pytestmark = pytest.mark.usefixtures("no_leaks")


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _die_on_negative(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] < 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return x + 1


def _batch(*values: int) -> list[np.ndarray[Any, Any]]:
    return [np.full(3, v, np.int64) for v in values]


def test_closed_is_final() -> None:
    spread = mpexec.dali.python_function(_double, num_workers=2)
    (out,) = [spread(_batch(1, 2))]
    assert [int(a[0]) for a in out] == [2, 4]
    children = len(psutil.Process().children(recursive=True))
    spread.close()
    with pytest.raises(mpexec.PoolClosedError, match="closed"):
        spread(_batch(1, 2))  # DALI's prefetch makes one more call, at once
    with pytest.raises(mpexec.PoolClosedError):
        _ = spread.pool
    assert len(psutil.Process().children(recursive=True)) < children, "a new pool started"
    spread.close()  # idempotent


def test_closed_before_any_call_starts_nothing() -> None:
    with mpexec.dali.python_function(_double, num_workers=2) as spread:
        pass
    with pytest.raises(mpexec.PoolClosedError):
        spread(_batch(1))


def test_a_worker_death_costs_one_batch() -> None:
    with mpexec.dali.python_function(_die_on_negative, num_workers=2) as spread:
        assert [int(a[0]) for a in spread(_batch(1, 2, 3, 4))] == [2, 3, 4, 5]
        with pytest.raises(mpexec.WorkerCrashedError):
            spread(_batch(1, -1, 3, 4))
        for _ in range(3):  # the next batches, on a replacement worker
            assert [int(a[0]) for a in spread(_batch(5, 6, 7, 8))] == [6, 7, 8, 9]
