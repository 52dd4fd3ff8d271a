"""The pool's lifecycle: its manager thread failing, cancellation, idle deaths, restarts."""

from __future__ import annotations

import time
import traceback
from typing import Any

import pytest

import mpexec
from mpexec import WorkerPool

T = 30  # every .result() in this file is bounded by this

pytestmark = pytest.mark.usefixtures("no_leaks")


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _square(x: int) -> int:
    return x * x


def test_a_failing_manager_thread_breaks_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec import _pool

    real = _pool._deliver

    def failing_deliver(*args: Any) -> None:
        raise RuntimeError("injected manager failure")

    with WorkerPool(1) as pool:
        assert pool.submit(_square, 3).result(T) == 9
        queued = [pool.submit(_sleep, 0.2) for _ in range(3)]
        monkeypatch.setattr(_pool, "_deliver", failing_deliver)
        t0 = time.monotonic()
        for fut in queued:
            with pytest.raises(mpexec.BrokenPoolError, match="manager thread failed") as info:
                fut.result(T)
            cause = info.value.__cause__
            assert isinstance(cause, RuntimeError)
            assert "injected manager failure" in str(cause)
            tb = "".join(traceback.format_tb(cause.__traceback__))
            assert "failing_deliver" in tb
            assert "_manage_once" in tb
        assert time.monotonic() - t0 < 5, "pending calls must fail promptly"
        with pytest.raises(mpexec.BrokenPoolError, match="manager thread failed"):
            pool.submit(_square, 2)
        assert "broken" in repr(pool)
        monkeypatch.setattr(_pool, "_deliver", real)
