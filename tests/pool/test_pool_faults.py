"""Faults an adversarial probe found: a broken pool's later calls, a dropped pool,
nested pools, callbacks that raise SystemExit, out-of-memory reporting."""

from __future__ import annotations

import gc
import os
import traceback
import weakref
from typing import Any

import pytest

import mpexec
from mpexec import WorkerPool

T = 30  # every .result() in this file is bounded by this

pytestmark = pytest.mark.usefixtures("no_leaks")


def _exit3(x: Any = None) -> None:
    os._exit(3)


def _identity(x: Any) -> Any:
    return x


class _Payload:
    """Stands for a caller's big array: what a failed call must not keep alive."""


# ================================================================ a broken pool
def test_a_broken_pool_raises_a_new_error_per_call_and_keeps_no_caller_alive() -> None:
    with WorkerPool(1, restart=False) as pool:
        with pytest.raises(mpexec.WorkerCrashedError) as first:
            pool.submit(_exit3).result(T)
        crash = first.value

        def failed_call() -> tuple[int, weakref.ref[_Payload]]:
            payload = _Payload()
            with pytest.raises(mpexec.WorkerCrashedError) as info:
                pool.submit(_identity, payload).result(T)
            exc = info.value
            assert exc is not crash
            assert type(exc) is type(crash)
            assert str(exc) == str(crash)
            assert exc.pid == crash.pid
            assert exc.exitcode == crash.exitcode
            assert exc.__cause__ is crash
            return len(traceback.extract_tb(exc.__traceback__)), weakref.ref(payload)

        depths = set()
        for _ in range(5):
            depth, payload = failed_call()
            gc.collect()
            # Raising the stored error itself would chain each caller's frame
            # (and its arrays) onto its traceback, for as long as the pool lives.
            assert payload() is None, "a failed call's frame is kept alive"
            depths.add(depth)
        assert len(depths) == 1, "the traceback grows with every failed call"
        assert pool.status.state == "broken"
