"""Faults an adversarial probe found: a broken pool's later calls, a dropped pool,
nested pools, callbacks that raise SystemExit, out-of-memory reporting."""

from __future__ import annotations

import gc
import logging
import os
import pickle
import signal
import threading
import time
import traceback
import weakref
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import mpexec
import shm
from mpexec import WorkerPool
from tests.conftest import START_METHODS, run_python, wait_until

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
            assert exc.__cause__ is crash.__cause__  # the error the pool keeps
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


def test_the_calls_a_crash_fails_get_an_error_each() -> None:
    """As RayPool's: each failed call gets a copy of the error that broke the pool (its
    ``__cause__``), so that one caller's raise never adds its frames to another's error."""
    with WorkerPool(1, restart=False) as pool:
        running, queued = pool.submit(_exit3), pool.submit(_identity, 1)
        errors = [running.exception(T), queued.exception(T)]
    first, second = errors
    assert isinstance(first, mpexec.WorkerCrashedError)
    assert first is not second
    assert type(first) is type(second)
    assert str(first) == str(second)
    assert (first.pid, first.exitcode) == (second.pid, second.exitcode)  # type: ignore[union-attr]
    stored = first.__cause__
    assert isinstance(stored, mpexec.WorkerCrashedError)
    assert second.__cause__ is stored


# ================================================================ a dropped pool
def _sleep_then(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value * 2


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_dropped_pool_finishes_the_calls_it_was_given() -> None:
    # ProcessPoolExecutor(2).submit(f, 21).result() returns 42: so must we.
    assert WorkerPool(2).submit(_sleep_then, 0, 21).result(T) == 42

    pool = WorkerPool(1)
    pids = pool.pids
    futures = [pool.submit(_sleep_then, 0.05, i) for i in range(12)]  # more than in flight
    state = weakref.ref(pool)
    del pool
    gc.collect()
    assert state() is None, "the pool was not collected"
    assert [f.result(T) for f in futures] == [2 * i for i in range(12)]
    # ...and then its workers stop, without a shutdown() call.
    wait_until(lambda: all(_gone(p) for p in pids), 10, "the dropped pool's worker to exit")


def _die_once_told(go: str) -> None:
    deadline = time.monotonic() + T
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
    os._exit(3)


@pytest.mark.parametrize("how", ["dropped", "shutdown"])
def test_a_worker_dying_while_its_pool_stops_fails_every_waiting_call(
    how: str, tmp_path: Path
) -> None:
    # More calls than a worker takes in flight: some wait in the pool itself,
    # for a worker that is not replaced while the pool stops. The worker dies
    # once the pool is stopping, not on a clock: a main thread slowed by load
    # (gc.collect, the stopper's start) let it die while the pool still ran,
    # which replaces it and runs the calls (WorkerCrashedError, not closed).
    go = str(tmp_path / "die-now")
    pool = WorkerPool(1, restart=True)
    state = pool._state
    assert pool.submit(_identity, 1).result(T) == 1
    futures = [pool.submit(_die_once_told, go)] + [pool.submit(_identity, i) for i in range(20)]
    stopper = None
    if how == "dropped":
        del pool
        gc.collect()
    else:
        stopper = threading.Thread(target=pool.shutdown, daemon=True)  # never hold up exit
        stopper.start()
    wait_until(lambda: state.stopping, T, "the pool to begin stopping")
    open(go, "w").close()
    _, not_done = wait_futures(futures, timeout=T)
    assert not not_done, "calls waiting for a worker that never comes"
    for future in futures:
        assert isinstance(future.exception(0), mpexec.PoolClosedError)
    if stopper is not None:
        stopper.join(T)
        assert not stopper.is_alive(), "shutdown() hung"


_DROPPED_AT_EXIT = """
import time
from mpexec import WorkerPool
future = WorkerPool(1).submit(time.sleep, 120)
deadline = time.monotonic() + 30  # running at exit (a 0.5 s clock: load could make it late)
while not future.running() and time.monotonic() < deadline:
    time.sleep(0.01)
print(future.running())
"""


def test_a_dropped_pool_still_running_at_exit_is_stopped_then() -> None:
    # Its call finishes only if the process lives on: at exit it is stopped.
    assert run_python("-c", _DROPPED_AT_EXIT, timeout=60).split() == ["True"]


# ================================================================ nested pools
def _square(x: int) -> int:
    return x * x


def _nested_pool(n: int, start_method: str) -> tuple[int, list[int]]:
    with WorkerPool(2, start_method=start_method) as inner:
        return sum(inner.map(_square, range(n))), inner.pids


def _nested_pipeline(n: int) -> list[float]:
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=n, num_workers=2, seed=1)
    def graph() -> Any:
        src = fn.external_source(source=lambda info: np.float64(info.idx_in_epoch), batch=False)
        return fn.python_function(src, function=lambda x: x * 2)

    with graph() as pipe:
        (out,) = pipe.run()
        return [float(x) for x in out]


@pytest.mark.parametrize("start_method", START_METHODS)
def test_a_worker_may_start_a_pool_or_a_pipeline_of_its_own(start_method: str) -> None:
    # ProcessPoolExecutor allows nesting since 3.9; a daemonic worker could not.
    with WorkerPool(1, start_method=start_method) as pool:
        total, inner_pids = pool.submit(_nested_pool, 10, start_method).result(T)
        assert total == sum(i * i for i in range(10))
        assert all(_gone(p) for p in inner_pids)
        assert pool.submit(_nested_pipeline, 4).result(T) == [0.0, 2.0, 4.0, 6.0]


def _nested_pool_pids() -> list[int]:
    inner = WorkerPool(2)
    _KEEP.append(inner)  # held by this worker until it dies
    return inner.pids


_KEEP: list[Any] = []


def test_a_nested_pools_workers_go_with_the_worker_that_made_it() -> None:
    with WorkerPool(1, restart=True) as pool:
        outer = pool.pids[0]
        inner = pool.submit(_nested_pool_pids).result(T)
        os.kill(outer, signal.SIGKILL)
        wait_until(lambda: all(_gone(p) for p in [outer, *inner]), 10, "the nested workers to exit")


# ================================================================ callbacks
def _exit_callback(future: Any) -> None:
    raise SystemExit(3)


def _interrupt_callback(future: Any) -> None:
    raise KeyboardInterrupt


class _Messages(logging.Handler):
    """Keeps what is logged as text only (a record's traceback would keep the
    manager's frames, and the rings they hold, alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(self.format(record))


@pytest.mark.parametrize("callback", [_exit_callback, _interrupt_callback])
def test_a_callback_raising_system_exit_is_logged_and_the_pool_lives_on(callback: Any) -> None:
    logger = logging.getLogger("concurrent.futures")
    logged = _Messages()
    logger.addHandler(logged)
    try:
        with WorkerPool(1) as pool:
            futures = [pool.submit(_sleep_then, 0.05, i) for i in range(3)]
            for future in futures:
                future.add_done_callback(callback)  # run by the pool's thread
            assert [f.result(T) for f in futures] == [0, 2, 4]
            assert pool.submit(_square, 7).result(T) == 49
            assert pool.status.state == "running"
            # In the thread that added it, on a done future, it propagates (as
            # concurrent.futures does).
            with pytest.raises((SystemExit, KeyboardInterrupt)):
                futures[0].add_done_callback(callback)
    finally:
        logger.removeHandler(logged)
    text = "\n".join(logged.texts)
    assert callback.__name__ in text, "the log names the callback"
    assert "bug in mpexec" not in text


# ================================================================ small ones
def _raise(x: int) -> None:
    raise ValueError(x)


def test_an_inline_pool_counts_its_calls() -> None:
    with WorkerPool(0) as pool:
        assert pool.submit(_square, 3).result(T) == 9
        with pytest.raises(ValueError, match="4"):
            pool.submit(_raise, 4).result(T)
        stats = pool.stats()
        assert (stats.submitted, stats.completed, stats.failed) == (2, 1, 1)


def _grow_result(nbytes: int) -> Any:
    return np.ones(nbytes, np.uint8)


def test_arena_capacity_caps_the_workers_arenas_too() -> None:
    # The default worker_arena_size (32 MiB) is above the cap: segments of the cap's size.
    with WorkerPool(1, arena_size=1 << 20, arena_capacity=4 << 20) as pool:
        assert pool.submit(_grow_result, 2 << 20).result(T).sum() == 2 << 20
        with pytest.raises(shm.ArenaFullError):
            pool.submit(_grow_result, 8 << 20).result(T)
        assert pool.submit(_square, 5).result(T) == 25


def _init_raises_value_error() -> None:
    raise ValueError("Worker init error")


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("method", START_METHODS)
def test_a_worker_init_error_is_also_an_instance_of_its_type(method: str) -> None:
    """torch re-raises a worker_init_fn's error as itself: ``except ValueError`` works here too."""
    with pytest.raises(ValueError, match="failed to start: ValueError: Worker init error") as info:
        WorkerPool(2, start_method=method, worker_init=_init_raises_value_error)
    err = info.value
    assert isinstance(err, mpexec.BrokenPoolError)
    assert f"{type(err).__module__}.{type(err).__qualname__}" == "mpexec.BrokenPoolError"
    assert isinstance(err.__cause__, ValueError)  # the worker's own, with its traceback
    assert "_init_raises_value_error" in str(err.__cause__.__cause__)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ValueError)
    assert isinstance(again, mpexec.BrokenPoolError)
    assert str(again) == str(err)


def test_a_start_error_that_cannot_be_both_is_a_broken_pool_error() -> None:
    from mpexec._errors import start_error

    for exc in (KeyboardInterrupt(), mpexec.PoolClosedError("x")):
        err = start_error("worker 0 failed to start", exc)
        assert type(err) is mpexec.BrokenPoolError
    err = start_error("m", LookupError("k"))
    assert isinstance(err, LookupError)
    assert type(start_error("n", LookupError("j"))) is type(err)  # one class per type
