"""A pipeline's lifetime: close() bounded however its functions behave."""

from __future__ import annotations

import functools
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import mpexec
from mpexec import fn

pytestmark = pytest.mark.usefixtures("no_leaks")


def _mark_then_hang(x: np.ndarray[Any, Any], marker: str = "") -> np.ndarray[Any, Any]:
    Path(marker).touch()
    threading.Event().wait()  # a function that never returns (a read of a silent FIFO, say)
    return x


def _hanging_pipeline(marker: Path) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=2, num_workers=2, prefetch_depth=1, seed=3)
    def graph() -> Any:
        x = fn.external_source(source=lambda info: np.zeros(3), batch=False)
        return fn.python_function(
            x, function=functools.partial(_mark_then_hang, marker=str(marker))
        )

    pipe: mpexec.Pipeline = graph()
    return pipe


def _start_a_hanging_run(pipe: mpexec.Pipeline, marker: Path) -> tuple[threading.Thread, list[Any]]:
    """A thread whose run() waits on a call that never returns; once that call has started."""
    pipe.build()
    raised: list[BaseException] = []

    def consume() -> None:
        try:
            pipe.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "the op never started"
        time.sleep(0.01)
    return thread, raised


def _bounded(call: Any, timeout: float) -> float:
    """Seconds ``call()`` took; fails the test if it has not returned within ``timeout``."""
    done = threading.Event()
    t0 = time.monotonic()

    def go() -> None:
        call()
        done.set()

    threading.Thread(target=go, daemon=True).start()
    if not done.wait(timeout):
        pytest.fail(f"close() still waiting after {timeout} s for a call that never returns")
    return time.monotonic() - t0


def test_close_stops_a_worker_whose_call_never_returns(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    pipe = _hanging_pipeline(marker)
    thread, raised = _start_a_hanging_run(pipe, marker)
    took = _bounded(lambda: pipe.close(grace=0.2), 30)
    assert took < 20  # grace, then SIGTERM (the worker goes at once)
    thread.join(30)
    assert not thread.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], mpexec.PoolClosedError), raised


def test_leaving_with_is_bounded_by_the_default_grace(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    pipe = _hanging_pipeline(marker)

    def leave() -> None:
        with pipe:
            _start_a_hanging_run(pipe, marker)

    _bounded(leave, 60)  # the default grace (5 s), then SIGTERM
    assert pipe.closed


def test_pool_shutdown_grace_fails_the_running_call(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    with mpexec.WorkerPool(2) as pool:
        f = pool.submit(functools.partial(_mark_then_hang, marker=str(marker)), np.zeros(2))
        idle = pool.submit(np.add, 1, 2)
        assert idle.result(60) == 3
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.01)
        _bounded(lambda: pool.shutdown(wait=True, grace=0.2), 30)
        with pytest.raises(mpexec.PoolClosedError):
            f.result(10)
    with pytest.raises(ValueError, match="grace"):
        mpexec.WorkerPool(0).shutdown(grace=-1)


def _four_samples(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= 4:
        raise StopIteration
    return np.full(2, info.idx_in_epoch)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_an_ended_epoch_again_without_reset_warns_once(workers: int) -> None:
    """DALI's rule (reset() starts the next epoch) said out loud to a PyTorch user."""

    @mpexec.pipeline_def(batch_size=2, num_workers=workers, seed=3)
    def graph() -> Any:
        return fn.external_source(source=_four_samples, batch=False)

    with graph() as pipe:
        assert len(list(pipe)) == 2
        with pytest.warns(UserWarning, match=r"pipe\.reset\(\)"):
            assert list(pipe) == []  # an empty epoch, but not a silent one
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert list(pipe) == []  # once per pipeline
            pipe.reset()
            assert len(list(pipe)) == 2  # the next epoch: no warning
            pipe.reset()
            assert len(list(pipe)) == 2


class _Failing(Exception):
    pass


def _first_fails_others_wait(info: Any, marker: str = "") -> np.ndarray[Any, Any]:
    if info.idx_in_epoch == 0:
        raise _Failing("sample 0")
    deadline = time.monotonic() + 60
    while not Path(marker).exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # still running when the caller drops the pipeline
    return np.zeros(3)


def test_a_pipeline_dropped_after_an_op_error_stops_its_workers_at_once(tmp_path: Path) -> None:
    """DALI's leak check, as its parallel external_source tests run it: the caller catches
    an op's error, drops the pipeline unclosed, and finds no worker left the moment it
    goes on. A chunk of the failed iteration still running holds the iteration (its
    callback) until it returns: the iteration must not keep the error, whose traceback
    holds the caller's frames and so the pipeline (its finalizer would run late, on the
    pool's thread, when that chunk came back)."""
    marker = tmp_path / "release"
    source = functools.partial(_first_fails_others_wait, marker=str(marker))
    # spawn, as DALI's tests: the workers are this process's children, reaped by its join
    # (a fork server's would be reaped by the server, a moment after they exit).
    pipe = mpexec.Pipeline(
        batch_size=8, num_workers=2, prefetch_depth=1, seed=1, start_method="spawn"
    )
    with pipe:
        pipe.set_outputs(fn.external_source(source, parallel=True, batch=False))
    pipe.build()
    pids = set(pipe._py_pool.pids())
    try:
        with pytest.raises(_Failing):
            pipe.run()
        del pipe
        left = {pid for pid in pids if psutil.pid_exists(pid)}  # a zombie counts: unreaped
        assert not left, "the dropped pipeline's workers outlived it"
    finally:
        marker.touch()


def test_handed_out_waits_until_the_manager_left_the_callbacks() -> None:
    """The barrier run() takes before raising an op's error: it returns only once the
    pool's thread has left the callbacks it runs (and dropped what they held)."""
    entered, go = threading.Event(), threading.Event()

    def hold(_: Any) -> None:  # a done-callback: it runs on the pool's manager thread
        entered.set()
        go.wait(30)

    with mpexec.WorkerPool(1) as pool:
        future = pool.submit(int, 1)
        future.add_done_callback(hold)
        assert entered.wait(30)
        waiter = threading.Thread(target=pool.handed_out, args=(30.0,))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive(), "handed_out returned while the manager ran a callback"
        go.set()
        waiter.join(30)
        assert not waiter.is_alive()
        pool.handed_out(30.0)  # nothing held: at once
