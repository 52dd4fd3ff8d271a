"""WorkerPool end to end: calls, arrays, errors, crashes, timeouts, shutdown, soak."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import multiprocessing as mp
import os
import pickle
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import BrokenExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError  # not the builtin on 3.10
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import mpexec
import shm
from mpexec import WorkerPool
from tests.conftest import SIGINT_STORM, START_METHODS, run_python, wait_until

T = 30  # every .result() in this file is bounded by this
KiB = 1 << 10
BIG = 64 * KiB  # well above the 16 KiB inline limit: travels through an arena

pytestmark = pytest.mark.usefixtures("no_leaks")


# ---------------------------------------------------------------- worker functions
def _square(x: int) -> int:
    return x * x


def _add(a: int, b: int = 0, *, c: int = 0) -> int:
    return a + b + c


def _pid() -> int:
    return os.getpid()


def _identity(x: Any) -> Any:
    return x


def _describe(a: np.ndarray[Any, Any]) -> tuple[bool, str, tuple[int, ...], float]:
    total = float(np.sum(a)) if a.dtype.kind in "biuf" else float("nan")
    return bool(a.flags.writeable), a.dtype.str, a.shape, total


def _write(a: np.ndarray[Any, Any]) -> None:
    a[...] = 1


def _filled(value: int, n: int) -> np.ndarray[Any, Any]:
    return np.full(n, value, dtype=np.int64)


def _nested(d: dict[str, Any]) -> dict[str, Any]:
    return {
        "pair": (d["small"] * 2, [d["big"] + 1, {"deep": d["big"][:3].copy()}]),
        "n": len(d["list"]),
        "list": [x.sum() for x in d["list"]],
    }


def _raise_value_error(n: int) -> None:
    raise ValueError(f"bad value {n}")


class _UnpicklableError(Exception):
    """Holds a lock: pickling it fails."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self.lock = threading.Lock()


class _NotRebuildableError(Exception):
    """Pickles, but unpickling calls __init__ with one argument instead of two."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}/{b}")


def _raise_unpicklable() -> None:
    raise _UnpicklableError("with a lock inside")


def _raise_not_rebuildable() -> None:
    raise _NotRebuildableError("a", "b")


def _return_lock() -> Any:
    return threading.Lock()


def _exit3() -> None:
    sys.exit(3)


def _crash(kind: str) -> None:
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "sigsegv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "sigbus":
        os.kill(os.getpid(), signal.SIGBUS)
    elif kind == "sigabrt":
        os.abort()
    else:
        os._exit(5)
    time.sleep(T)  # a signal may take a moment to land; never return normally


def _wait_for(path: str) -> bool:
    """Block until ``path`` exists (bounded): holds a worker busy on demand."""
    deadline = time.monotonic() + T
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _sleep_then_pid(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


_GLOBAL: dict[str, Any] = {}


def _init_set_global(value: str) -> None:
    _GLOBAL["value"] = value


def _read_global() -> Any:
    return _GLOBAL.get("value")


def _init_raises() -> None:
    raise RuntimeError("init exploded on purpose")


def _peek_random() -> tuple[int, float]:
    """The worker's next ``np.random.random()``, without consuming it."""
    state = np.random.get_state()
    value = float(np.random.random())
    np.random.set_state(state)
    return os.getpid(), value


def _soak(i: int, a: np.ndarray[Any, Any]) -> Any:
    """An int for a small input; a large array (through the worker's arena) for a large one."""
    if a.size > 4:
        return np.full(a.size, i + int(a[0]), dtype=a.dtype)
    return i + int(a[0])


# ---------------------------------------------------------------- helpers
def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie has exited too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _mpx_names() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpx")}
    except FileNotFoundError:
        return set()


def _unlink_names_of(*pids: int) -> None:
    """Remove the named segments (posix backend) created by ``pids``.

    For processes killed on purpose: a SIGKILLed owner cannot unlink its names,
    as shm documents; no_leaks then checks everything else.
    """
    for name in _mpx_names():
        if any(f"-{pid}-" in name for pid in pids):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


@contextlib.contextmanager
def _one_posix_child_at_a_time() -> Iterator[None]:
    """Keep the posix-backend child scenarios of parallel test processes apart.

    A process making its first named segment unlinks every name whose creator
    is dead (shm's reap_orphans): a posix child starting in another xdist
    worker could remove the very names a test is looking for.
    """
    path = os.path.join(tempfile.gettempdir(), "mpexec-test-pool-posix.lock")
    with open(path, "a") as f:

        def locked() -> bool:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        wait_until(locked, 60, "the posix scenario lock")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def killed() -> Iterator[list[int]]:
    """Pids of workers a test kills on purpose: their named segments go afterwards."""
    pids: list[int] = []
    yield pids
    _unlink_names_of(*pids)


# ================================================================ 1. basics
def test_submit_scalars_lambdas_closures_kwargs() -> None:
    offset = 7

    def closure(x: int) -> int:
        return x + offset

    with WorkerPool(2) as pool:
        assert pool.submit(_square, 12).result(T) == 144
        assert pool.submit(pow, 2, 10).result(T) == 1024
        assert pool.submit(lambda s: s.upper() + "!", "hi").result(T) == "HI!"
        assert pool.submit(closure, 5).result(T) == 12
        assert pool.submit(_add, 1, 2, c=3).result(T) == 6
        assert pool.submit(_add, a=1, b=10).result(T) == 11
        res = pool.submit(lambda: (None, 1.5, 2**70, "é", b"\x00", {1: [2]})).result(T)
        assert res == (None, 1.5, 2**70, "é", b"\x00", {1: [2]})
        assert pool.submit(_pid).result(T) in pool.pids
        assert os.getpid() not in pool.pids


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_polling_waiters_leave_nothing_undelivered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Quick calls' waiters poll for their results instead of sleeping: calls
    # nobody waits on (callbacks, wait(), as_completed), calls on other
    # workers, slow calls and timeouts must behave as they would otherwise.
    from mpexec._pool import _future

    # "Quick" up to 20 ms, so that a loaded machine does not turn it off.
    monkeypatch.setattr(_future, "_POLL_SECONDS", 0.02)
    with WorkerPool(2) as pool:
        for i in range(200):
            assert pool.submit(_square, i).result(T) == i * i
        assert pool._state.latency < 0.02
        fired = threading.Event()
        pool.submit(_square, 3).add_done_callback(lambda f: fired.set())
        assert fired.wait(T)
        slow = pool.submit(_sleep, 0.1)  # longer than result()'s polling
        assert slow.result(T) == 0.1
        slower = pool.submit(_sleep, 0.5)
        t0 = time.monotonic()
        with pytest.raises(FutureTimeoutError):
            slower.result(0.1)  # the polling counts against the timeout
        assert time.monotonic() - t0 < 0.4
        assert slower.result(T) == 0.5
        futures = [pool.submit(_square, i) for i in range(40)]
        assert futures[-1].result(T) == 39 * 39
        _, not_done = wait_futures(futures, T)
        assert not not_done
        assert [f.result() for f in futures] == [i * i for i in range(40)]
        assert pool.submit(_raise_value_error, 5).exception(T).args == ("bad value 5",)
        stats = pool.stats()
        assert (stats.completed, stats.failed, stats.pending) == (243, 1, 0)


_CHILD_CTRL_C = (
    SIGINT_STORM
    + """
import mpexec

def square(x):
    return x * x

if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupter, args=(0.003,))
    interrupted = calls = 0
    with mpexec.WorkerPool(2) as pool:
        sender.start()
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            future = pool.submit(square, calls)
            try:
                armed[0] = True
                value = future.result(30)
                armed[0] = False
                assert value == calls * calls
            except KeyboardInterrupt:
                interrupted += 1
            calls += 1
        stop.set()
        sender.join(30)
        assert pool.submit(square, 12).result(30) == 144
        end = time.monotonic() + 30
        while pool.stats().pending and time.monotonic() < end:
            time.sleep(0.01)
        stats = pool.stats()
        assert (stats.pending, stats.completed) == (0, calls + 1), (stats, calls)
    print(interrupted, calls)
"""
)


def test_ctrl_c_in_result_leaves_the_pool_working() -> None:
    # KeyboardInterrupt can land anywhere in a waiting result(): the pool's
    # state must not depend on where (only the manager thread changes it).
    # In a child process, whose main thread is ours to give a SIGINT handler.
    interrupted, calls = map(int, run_python("-c", _CHILD_CTRL_C, timeout=2 * T).split())
    assert interrupted > 0, "no interrupt landed in result(): the test tested nothing"
    assert calls > interrupted


_CHILD_SECOND_CTRL_C = """
import os, signal, sys, time
import mpexec
from mpexec._pool import _stop as _pool

# A shell starts a background job with SIGINT ignored, and Python then installs no
# KeyboardInterrupt handler: the Ctrl-Cs below would do nothing (the child then
# sleeps, then waits for its calls, past the test's timeout). Ctrl-C as at a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

where = sys.argv[1]
real = getattr(_pool, where)
sent = []

def second_ctrl_c(*args, **kwargs):
    # The second Ctrl-C lands in the middle of the interrupted shutdown.
    if not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the KeyboardInterrupt is raised in here
    return real(*args, **kwargs)

setattr(_pool, where, second_ctrl_c)
with mpexec.WorkerPool(2) as pool:
    running = [pool.submit(time.sleep, 30) for _ in range(2)]
    queued = [pool.submit(time.sleep, 30) for _ in range(4)]
    print(os.getpid(), *pool.pids, flush=True)
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C
    time.sleep(30)
"""


@pytest.mark.parametrize("where", ["stop_processes", "descendants"])
def test_a_second_ctrl_c_during_an_interrupted_shutdown_ends_bounded(
    where: str, killed: list[int]
) -> None:
    # Ctrl-C stops a pool at once; a second one, impatient, lands inside that
    # stop: the process must still end promptly, leaving no worker and no
    # named segment (posix backend: what a lost cleanup would leave behind).
    with _one_posix_child_at_a_time():
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD_SECOND_CTRL_C, where],
            capture_output=True,
            text=True,
            timeout=2 * T,
            check=False,
            env={**os.environ, "SHM_BACKEND": "posix"},
        )
        elapsed = time.monotonic() - t0
        pids = [int(p) for p in proc.stdout.split()]
        assert len(pids) == 3, proc.stdout + proc.stderr
        killed.extend(pids)  # stopped by SIGTERM: their names are checked below first
        assert proc.returncode in (-signal.SIGINT, 130, 1), proc.stderr
        assert "in second_ctrl_c" in proc.stderr, "the second Ctrl-C never landed"
        assert elapsed < 20, f"an interrupted shutdown took {elapsed:.1f} s"
        wait_until(lambda: all(_gone(p) for p in pids[1:]), 10, "the workers to exit")
        left = {n for n in _mpx_names() if any(f"-{p}-" in n for p in pids)}
        assert not left, f"named segments left behind: {sorted(left)}"


def test_callbacks_never_run_in_a_waiting_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # Callbacks run in the manager thread (as concurrent.futures does), not
    # inside a polling result(), where the caller may hold a lock they take.
    from mpexec._pool import _future

    monkeypatch.setattr(_future, "_POLL_SECONDS", 0.02)
    ran_in: list[int] = []
    ran = threading.Event()

    def callback(f: Any) -> None:
        ran_in.append(threading.get_ident())
        ran.set()

    with WorkerPool(1) as pool:
        for i in range(20):  # the waiters poll
            assert pool.submit(_square, i).result(T) == i * i
        first = pool.submit(_square, 3)
        first.add_done_callback(callback)
        assert pool.submit(_square, 4).result(T) == 16
        assert ran.wait(T)
        assert ran_in == [pool._state.manager_ident]
        assert first.result(T) == 9


def test_map_ordered_unordered_and_prefetch() -> None:
    items = list(range(60))
    expected = [x * x for x in items]
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, items, timeout=T)) == expected
        unordered = list(pool.map(_square, items, timeout=T, ordered=False))
        assert sorted(unordered) == expected
        assert list(pool.map(_square, items, timeout=T, prefetch=1)) == expected
        assert list(pool.map(_add, [1, 2, 3], [10, 20, 30], timeout=T)) == [11, 22, 33]
        assert list(pool.map(_square, [], timeout=T)) == []


def _fail_at(x: int, bad: int) -> int:
    if x == bad:
        raise ValueError(f"bad item {x}")
    return x * x


@pytest.mark.parametrize("workers", [0, 2])
def test_map_chunksize_gives_the_same_results(workers: int) -> None:
    items = list(range(23))  # not a multiple of any chunk size below
    arrays = [np.full(4, i, np.float32) for i in items]
    with WorkerPool(workers) as pool:
        for chunksize in (1, 2, 5, 23, 100):
            assert list(pool.map(_square, items, chunksize=chunksize, timeout=T)) == [
                x * x for x in items
            ]
            got = pool.map(_add, items, items, chunksize=chunksize, ordered=False, timeout=T)
            assert sorted(got) == [2 * x for x in items]
            sums = pool.map(np.sum, arrays, chunksize=chunksize, prefetch=1, timeout=T)
            assert list(sums) == [4 * x for x in items]
        assert list(pool.map(_square, [], chunksize=4, timeout=T)) == []


def test_map_chunks_are_one_call_each() -> None:
    with WorkerPool(2) as pool:
        assert list(pool.map(_square, range(100), chunksize=10, timeout=T)) == [
            x * x for x in range(100)
        ]
        assert pool.stats().submitted == 10


def test_map_chunk_failure_fails_its_chunk_only() -> None:
    with WorkerPool(2) as pool:
        results = pool.map(_fail_at, range(20), [13] * 20, chunksize=5, timeout=T)
        got = [next(results) for _ in range(10)]  # chunks [0, 5) and [5, 10)
        assert got == [x * x for x in range(10)]
        with pytest.raises(ValueError, match="bad item 13") as info:
            next(results)
        assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
        assert "_fail_at" in str(info.value.__cause__)
        assert list(pool.map(_square, range(3), chunksize=2, timeout=T)) == [0, 1, 4]


@pytest.mark.parametrize("chunksize", [0, -3, 2.5, "4", True])
def test_map_rejects_a_bad_chunksize(chunksize: Any) -> None:
    with WorkerPool(1) as pool, pytest.raises(ValueError, match="chunksize must be an int >= 1"):
        pool.map(_square, range(4), chunksize=chunksize)


def test_map_chunked_names_an_unpicklable_function() -> None:
    lock = threading.Lock()
    with WorkerPool(1) as pool, pytest.raises(mpexec.SerializationError, match="lock"):
        pool.map(lambda x: (lock, x), range(4), chunksize=2)


def test_inline_pool_runs_in_caller_with_readonly_arrays() -> None:
    with WorkerPool(0) as pool:
        assert pool.pids == []
        assert pool.submit(_pid).result(T) == os.getpid()
        assert list(pool.map(_square, range(5), timeout=T)) == [0, 1, 4, 9, 16]
        a = np.zeros(4)
        assert pool.submit(_describe, a).result(T)[0] is False
        fut = pool.submit(_write, a)
        with pytest.raises(ValueError, match="read-only"):
            fut.result(T)
        fut = pool.submit(lambda d: _write(d["k"][1]), d={"k": [1, a]})
        with pytest.raises(ValueError, match="read-only"):
            fut.result(T)
        nested = pool.submit(lambda d: d["k"][0].flags.writeable, {"k": (a,)}).result(T)
        assert nested is False
        assert a.flags.writeable
        assert not a.any()
    with pytest.raises(mpexec.PoolClosedError):
        pool.submit(_pid)


# ================================================================ 2. arrays
def _structured(n: int) -> np.ndarray[Any, Any]:
    """Four fields, one a sub-array: its pickled dtype is a few hundred bytes."""
    dt = np.dtype([("x", "<f4"), ("id", "<i8"), ("tag", "S3"), ("v", "<i2", (2,))])
    a = np.zeros(n, dt)
    a["x"] = np.arange(n) / 3
    a["id"] = np.arange(n) * 7
    a["tag"] = b"ab"
    a["v"] = np.arange(2 * n).reshape(n, 2)
    return a


def _pairs(n: int) -> np.ndarray[Any, Any]:
    """A simple two-field record array."""
    a = np.zeros(n, [("x", "<f8"), ("y", "<i4")])
    a["x"] = np.arange(n) / 7
    a["y"] = -np.arange(n)
    return a


def _small_arrays() -> list[np.ndarray[Any, Any]]:
    return [
        np.array(3.5),
        np.array(7, dtype=np.int8),
        np.empty((0,), np.float32),
        np.empty((3, 0, 2), np.int64),
        np.arange(5, dtype=np.uint16),
        np.arange(12, dtype=np.float64).reshape(3, 4),
        np.arange(24, dtype=np.int32).reshape(2, 3, 4),
        np.arange(48, dtype=np.float32).reshape(2, 2, 3, 4),
        np.linspace(-1, 1, 9).astype(np.float16),
        (np.arange(6) + 1j * np.arange(6)).astype(np.complex128),
        np.array([True, False, True]),
        np.array(["a", "bcde", "hello"], dtype="U5"),
        _structured(4),
        _pairs(3),
        np.arange(20, dtype=">i4"),  # non-native byte order
        np.array(["2020-01-01", "1969-12-31"], dtype="datetime64[D]"),
        np.arange(40, dtype=np.float64).reshape(5, 8)[::2, 1::3],  # not contiguous
        np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    ]


def _big_arrays() -> list[np.ndarray[Any, Any]]:
    n = BIG
    return [
        np.arange(n // 8, dtype=np.float64),
        np.arange(n // 4, dtype=np.int32).reshape(64, -1),
        np.arange(n // 4, dtype=np.float32).reshape(8, 16, -1),
        np.arange(n // 2, dtype=np.int16).reshape(4, 8, 16, -1),
        np.linspace(-4, 4, n // 2).astype(np.float16),
        (np.arange(n // 16) - 2j * np.arange(n // 16)).astype(np.complex128),
        np.arange(n) % 3 == 0,
        np.array([f"s{i % 997}" for i in range(n // 20)], dtype="U5"),
        _pairs(n // 12),
        _structured(n // 16),
        np.arange(n // 2, dtype=np.float64).reshape(-1, 16)[::2, ::3],  # not contiguous
        np.asfortranarray(np.arange(n // 4, dtype=np.int32).reshape(64, -1)),
    ]


def _ids(arrays: list[np.ndarray[Any, Any]]) -> list[str]:
    ids = []
    for a in arrays:
        kind = f"struct{len(a.dtype.names)}" if a.dtype.names else a.dtype.str.lstrip("<|=")
        shape = "x".join(map(str, a.shape)) or "0d"
        layout = "" if a.flags.c_contiguous else "-F" if a.flags.f_contiguous else "-strided"
        ids.append(f"{kind}-{shape}{layout}")
    return ids


def _check_same(got: Any, want: np.ndarray[Any, Any]) -> None:
    assert isinstance(got, np.ndarray), type(got)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape
    assert np.array_equal(got, want)
    assert got.flags.writeable, "results must be writable"
    assert got.flags.aligned, "an unaligned result is slow, and refused by some C code"


def _round_trip_problems(pool: WorkerPool, arrays: list[np.ndarray[Any, Any]]) -> list[str]:
    """Send each array to a worker and back; what went wrong, one line per array."""
    problems = []
    for name, array in zip(_ids(arrays), arrays, strict=True):
        try:
            fut = pool.submit(_identity, array)
        except mpexec.SerializationError as exc:
            problems.append(
                f"{name}: mpexec bug: a {array.dtype} array (which pickles fine) cannot be "
                f"sent: SerializationError: {exc}"
            )
            continue
        try:
            got = fut.result(T)
            _check_same(got, array)
            got[...] = got  # writable in place
            seen = pool.submit(_describe, array).result(T)
            assert seen[0] is False, "the worker's view must be read-only"
            assert seen[1:3] == (array.dtype.str, array.shape), seen
            if array.dtype.kind in "biu":
                assert seen[3] == float(np.sum(array)), seen
        except Exception as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return problems


def test_small_array_round_trip() -> None:
    """0-d, empty, 1..4-d, float16, complex, bool, U5, structured, strided: inline."""
    arrays = _small_arrays()
    assert all(a.nbytes <= 16 * KiB for a in arrays)
    with WorkerPool(1) as pool:
        problems = _round_trip_problems(pool, arrays)
        assert pool.stats().bytes_shared == 0, "small arrays travel inline"
    assert not problems, "\n".join(problems)


def test_plain_values_never_fall_back_to_cloudpickle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays, containers and numbers go through the fast C pickler on every Python."""
    from mpexec import _codec

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("encoding fell back to cloudpickle")

    monkeypatch.setattr(_codec, "_CloudPickler", refuse)
    value = ((np.arange(5), [np.zeros((2, 3), np.float32), 7]), {"k": (np.ones(2), "s")})
    enc = _codec.encode(value, None, None)
    for writable in (False, True):
        (a, (b, n)), kw = _codec.decode(enc.data, writable)
        assert a.tolist() == [0, 1, 2, 3, 4]
        assert b.shape == (2, 3)
        assert n == 7
        assert kw["k"][0].tolist() == [1.0, 1.0]
        assert kw["k"][1] == "s"
        assert a.flags.writeable == writable


def test_array_with_a_huge_structured_dtype_round_trips() -> None:
    """A dtype whose description pickles to more than 64 KiB, on a small (inline) array."""
    dt = np.dtype([(f"field_{i:04d}_{'x' * 30}", "u1") for i in range(1500)])
    a = np.zeros(2, dt)
    a[dt.names[7]] = [3, 4]
    assert len(pickle.dumps(dt)) > 64 * KiB
    with WorkerPool(1) as pool:
        problems = _round_trip_problems(pool, [a])
    assert not problems, "\n".join(problems)


def test_large_array_round_trip() -> None:
    """The same kinds of arrays above the inline limit: through the arenas."""
    arrays = _big_arrays()
    assert all(a.nbytes > 16 * KiB for a in arrays)
    with WorkerPool(1) as pool:
        problems = _round_trip_problems(pool, arrays)
        shared = pool.stats().bytes_shared
    assert not problems, "\n".join(problems)
    # each array goes to the worker twice (round trip, then _describe)
    assert shared >= 2 * sum(a.nbytes for a in arrays), "large arrays go through the arena"


@pytest.mark.parametrize("size", [16, BIG // 8], ids=["inline", "arena"])
def test_worker_sees_readonly_arrays(size: int) -> None:
    a = np.zeros(size)
    with WorkerPool(1) as pool:
        fut = pool.submit(_write, a)
        with pytest.raises(ValueError, match="read-only") as info:
            fut.result(T)
        assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
        assert "_write" in info.value.__cause__.tb
        shared = pool.put(a)
        with pytest.raises(ValueError, match="read-only"):
            pool.submit(_write, shared).result(T)
        assert not a.any()
        assert not shared.any()


def test_results_writable_and_held_results_stay_valid() -> None:
    n = BIG // 8
    with WorkerPool(1) as pool:
        first = pool.submit(_filled, 0, n).result(T)
        small = pool.submit(_filled, -1, 4).result(T)
        assert first.flags.writeable
        assert small.flags.writeable
        assert pool.submit(_pid).result(T) in pool.pids
        for i in range(1, 51):
            r = pool.submit(_filled, i, n).result(T)
            assert (r == i).all()
            del r
            if i % 10 == 0:
                gc.collect()
                pool.stats()  # applies the releases that came back
        assert (first == 0).all(), "mpexec bug: a held result was overwritten by later calls"
        assert (small == -1).all()
        first[:] = 42
        assert (first == 42).all()
        # A held result can be sent back to a worker.
        assert pool.submit(np.sum, first).result(T) == 42 * n


def test_nested_containers_of_arrays() -> None:
    small = np.arange(4, dtype=np.int32)
    big = np.arange(BIG // 8, dtype=np.int64)
    payload = {"small": small, "big": big, "list": [small, big, np.ones((2, 2))]}
    with WorkerPool(1) as pool:
        out = pool.submit(_nested, payload).result(T)
    assert set(out) == {"pair", "n", "list"}
    pair = out["pair"]
    assert isinstance(pair, tuple)
    assert isinstance(pair[1], list)
    assert isinstance(pair[1][1], dict)
    np.testing.assert_array_equal(pair[0], small * 2)
    np.testing.assert_array_equal(pair[1][0], big + 1)
    np.testing.assert_array_equal(pair[1][1]["deep"], big[:3])
    assert out["n"] == 3
    assert out["list"] == [small.sum(), big.sum(), 4.0]
    assert pair[1][0].flags.writeable


def _times_into(x: np.ndarray[Any, Any], k: float, out: np.ndarray[Any, Any]) -> Any:
    assert not x.flags.writeable
    assert out.flags.writeable
    return np.multiply(x, k, out=out)


def _fill_all(outs: dict[str, np.ndarray[Any, Any]], value: int) -> int:
    for a in outs.values():
        a[...] = value
    return len(outs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_writable_arguments_are_written_in_place(num_workers: int) -> None:
    n = BIG // 4
    with WorkerPool(num_workers) as pool:
        x = pool.put(np.arange(n, dtype=np.float32))
        out = pool.empty(n, np.float32)
        copied = pool.stats().bytes_copied
        back = pool.submit(_times_into, x, 2.0, mpexec.writable(out)).result(T)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) * 2)
        np.testing.assert_array_equal(back, out)
        assert back.flags.writeable
        if num_workers:
            assert pool.stats().bytes_copied == copied  # nothing copied either way
            small = pool.empty((3, 4), np.int16)  # small arrays too: still in place
            outs = {"a": small, "b": out[:5]}
            wrapped = {k: mpexec.writable(v) for k, v in outs.items()}
            assert pool.submit(_fill_all, wrapped, 7).result(T) == 2
            assert (small == 7).all()
            assert (out[:5] == 7).all()
            assert out[5] == 10.0
            # private memory cannot be written by a worker: refused in submit()
            with pytest.raises(mpexec.SerializationError, match="pool's shared memory"):
                pool.submit(_times_into, x, 2.0, mpexec.writable(np.empty(n, np.float32)))
        # everything else still arrives read-only
        with pytest.raises(AssertionError):
            pool.submit(_times_into, x, 2.0, out).result(T)


def test_task_ring_takes_every_record_in_flight_while_its_worker_holds_slots() -> None:
    """Eight three-record tasks (forget, function, call) must never wait for ring space.

    A busy worker hands freed slots back only every half ring, so the ring must
    hold what may be in flight plus what the worker sits on.
    """
    from mpexec._pool import _state as _pool

    ring = shm.Ring(_pool._TASK_RING, 64)
    try:
        # The worker takes tasks one by one, always finding the next: it never
        # sleeps, so it returns no slot until it has freed half the ring.
        freed = 0
        while freed + 3 < _pool._TASK_RING // 2:
            ring.push_many([b"forget", b"function", b"call"])
            freed += len(ring.pop_many())
        in_flight = [b"record"] * (3 * _pool._IN_FLIGHT)
        assert all(ring.try_push(r) for r in in_flight), "submit() would block on a busy worker"
    finally:
        ring.close()


def _cached_functions() -> int:
    """How many functions this worker holds (its _Worker's cache)."""
    workers = [o for o in gc.get_objects() if type(o).__name__ == "_Worker"]
    assert len(workers) == 1
    return len(workers[0].fns)


def test_function_cache_is_bounded_and_evicted_functions_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mpexec._pool import _sender

    monkeypatch.setattr(_sender, "_FN_CACHE", 4)
    adders = [functools.partial(_add, i) for i in range(12)]
    with WorkerPool(1) as pool:
        for _ in range(2):  # the second time round, every one was evicted
            assert [pool.submit(f, 100).result(T) for f in adders] == [i + 100 for i in range(12)]
        # the worker dropped evicted functions (sent with the next tasks): 4 kept,
        # plus _cached_functions itself, plus at most the one just evicted for it
        assert pool.submit(_cached_functions).result(T) <= 4 + 2
        assert len(pool._sender.fn_ids) <= 4


def test_calls_too_big_for_a_ring_slot_go_through_the_arena() -> None:
    """Many small arrays (inline each), a big closure: records spilled, all given back."""
    parts = [np.full(1024, i, np.float64) for i in range(12)]  # 12 x 8 KiB inline arrays
    table = {f"key{i}": "x" * 100 for i in range(400)}  # ~45 KiB of captured state

    def lookup(arrays: list[np.ndarray[Any, Any]]) -> tuple[list[np.ndarray[Any, Any]], int]:
        return [a * 2 for a in arrays], len(table)

    with WorkerPool(1) as pool:
        for _ in range(3):
            doubled, n = pool.submit(lookup, parts).result(T)
            assert n == 400
            assert [float(d[0]) for d in doubled] == [2.0 * i for i in range(12)]
            assert all(d.flags.writeable for d in doubled)
        del doubled
        gc.collect()

        def drained() -> bool:
            arena = pool.stats().arena
            return arena.in_use == 0 and arena.exported == 0

        wait_until(drained, T, "the spilled records' memory to come back")
        assert pool.stats().bytes_shared == 0, "inline arrays: nothing shared by descriptor"


def test_memory_held_by_a_result_comes_back_while_workers_idle() -> None:
    # A function that returns (a view of) its argument: the result holds the
    # pool's memory through the worker, which must let go of it as soon as
    # the caller drops the result, not at its next call.
    with WorkerPool(1) as pool:
        x = pool.put(np.ones(BIG // 8))
        out = pool.empty(BIG // 8)
        r1 = pool.submit(_identity, x).result(T)
        r2 = pool.submit(_times_into, x, 3.0, mpexec.writable(out)).result(T)
        assert r1[0] == 1.0
        assert r2[-1] == 3.0
        del x, out, r1, r2
        gc.collect()

        def drained() -> bool:
            arena = pool.stats().arena
            return arena.in_use == 0 and arena.exported == 0

        wait_until(drained, T, "the pool's arena to be empty")


def test_writable_rejects_what_it_cannot_share() -> None:
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        mpexec.writable([1, 2])  # type: ignore[arg-type]
    ro = np.zeros(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        mpexec.writable(ro)
    with pytest.raises(TypeError, match="Python objects"):
        mpexec.writable(np.array([None]))
    assert "float64" in repr(mpexec.writable(np.zeros(2)))


def test_put_and_empty_travel_without_copy() -> None:
    n = BIG // 8
    with WorkerPool(1) as pool:
        copied = pool.stats().bytes_copied
        put = pool.put(np.arange(n, dtype=np.float64))
        empty = pool.empty((n,), np.float64)
        empty[:] = 2.0
        assert put.flags.writeable
        assert empty.flags.writeable
        assert pool.submit(_describe, put).result(T) == (False, "<f8", (n,), float(put.sum()))
        assert pool.submit(_describe, empty).result(T) == (False, "<f8", (n,), 2.0 * n)
        # views of arena arrays are shared in place too, down to small ones (2 KiB)
        view = put[10:266]
        shared = pool.stats().bytes_shared
        assert pool.submit(_describe, view).result(T)[3] == float(view.sum())
        assert pool.stats().bytes_shared == shared + view.nbytes
        assert pool.stats().bytes_copied == copied, "arena arrays must not be copied"
        assert pool.stats().bytes_shared >= 2 * put.nbytes
        # ... but a tiny view rides in the record: cheaper than a descriptor
        assert pool.submit(_describe, put[10:20]).result(T)[3] == float(put[10:20].sum())
        assert pool.stats().bytes_shared == shared + view.nbytes
        plain = np.ones(n)
        assert pool.submit(_describe, plain).result(T)[3] == float(n)
        assert pool.stats().bytes_copied == copied + plain.nbytes
        small = np.ones(8)
        pool.submit(_describe, small).result(T)
        assert pool.stats().bytes_copied == copied + plain.nbytes, "inline arrays are not counted"


# ================================================================ 3. errors
def test_user_exception_keeps_type_with_remote_traceback() -> None:
    with WorkerPool(1) as pool:
        fut = pool.submit(_raise_value_error, 42)
        exc = fut.exception(T)
        assert type(exc) is ValueError
        assert str(exc) == "bad value 42"
        cause = exc.__cause__
        assert isinstance(cause, mpexec.RemoteTraceback)
        assert "_raise_value_error" in cause.tb
        assert "ValueError: bad value 42" in cause.tb
        assert "_raise_value_error" in str(cause)
        with pytest.raises(ValueError, match="bad value 42"):
            fut.result(T)
        assert pool.submit(_square, 3).result(T) == 9
        stats = pool.stats()
        assert stats.failed == 1
        assert stats.completed == 1


def test_unpicklable_argument_fails_in_submit_naming_its_path() -> None:
    lock = threading.Lock()
    with WorkerPool(1) as pool:
        with pytest.raises(mpexec.SerializationError) as info:
            pool.submit(_identity, [1, {"k": lock}])
        assert isinstance(info.value, TypeError)
        assert isinstance(info.value.__cause__, TypeError)
        msg = str(info.value)
        assert "_thread.lock" in msg
        assert "['k']" in msg
        assert pool.submit(_square, 4).result(T) == 16
        assert pool.stats().submitted == 1
    # The error's traceback holds the pool's arena: let it go before failing.
    del info, pool
    assert "args[0][1]['k']" in msg, (
        "mpexec bug: SerializationError names the wrong path for the unpicklable first "
        f"argument's [1]['k'] (expected args[0][1]['k']): {msg}"
    )


def test_unpicklable_keyword_argument_fails_in_submit() -> None:
    lock = threading.Lock()
    with WorkerPool(1) as pool:
        with pytest.raises(mpexec.SerializationError, match="lock") as info:
            pool.submit(_add, 1, b={"inner": lock})
        msg = str(info.value)
        assert pool.submit(_add, 1, b=2).result(T) == 3
    del info, pool
    assert "kwargs['b']['inner']" in msg, (
        f"mpexec bug: SerializationError does not name kwargs['b']['inner']: {msg}"
    )


def test_unpicklable_argument_fails_in_submit_while_workers_busy(tmp_path: Path) -> None:
    """With every worker busy, submit queues the call: it must still check it first."""
    gate = tmp_path / "open"
    lock = threading.Lock()
    with WorkerPool(1) as pool:
        blocked = pool.submit(_wait_for, str(gate))
        queued = [pool.submit(_square, i) for i in range(12)]
        assert pool.stats().pending == 13
        with pytest.raises(mpexec.SerializationError, match="lock"):
            pool.submit(_identity, [1, {"k": lock}])
        gate.touch()
        assert blocked.result(T) is True
        assert [f.result(T) for f in queued] == [i * i for i in range(12)]
        assert pool.stats().submitted == 13


def test_unpicklable_function_is_refused_whether_workers_are_busy_or_not(
    tmp_path: Path,
) -> None:
    """A refused function is not remembered as sent: queued, it is checked again."""
    gate = tmp_path / "open"
    lock = threading.Lock()

    def holds_lock(x: int) -> Any:
        return lock, x

    with WorkerPool(1) as pool:
        with pytest.raises(mpexec.SerializationError, match="lock"):
            pool.submit(holds_lock, 1)  # idle worker: encoded at once
        blocked = pool.submit(_wait_for, str(gate))
        queued = [pool.submit(_square, i) for i in range(12)]
        assert pool.stats().pending == 13
        with pytest.raises(mpexec.SerializationError, match="lock"):
            pool.submit(holds_lock, 2)  # busy: checked, then queued
        gate.touch()
        assert blocked.result(T) is True
        assert [f.result(T) for f in queued] == [i * i for i in range(12)]


def test_unpicklable_result_raises_serialization_error() -> None:
    with WorkerPool(1) as pool:
        fut = pool.submit(_return_lock)
        with pytest.raises(mpexec.SerializationError, match="lock") as info:
            fut.result(T)
        assert "result" in str(info.value)
        assert pool.submit(_square, 5).result(T) == 25


@pytest.mark.parametrize(
    ("fn", "name"),
    [(_raise_unpicklable, "_UnpicklableError"), (_raise_not_rebuildable, "_NotRebuildableError")],
)
def test_unpicklable_exception_becomes_serialization_error(fn: Any, name: str) -> None:
    with WorkerPool(1) as pool:
        fut = pool.submit(fn)
        with pytest.raises(mpexec.SerializationError) as info:
            fut.result(T)
        assert name in str(info.value)
        assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
        assert name in info.value.__cause__.tb
        assert pool.submit(_square, 6).result(T) == 36


def test_sys_exit_in_function_is_reported_and_pool_survives() -> None:
    with WorkerPool(1) as pool:
        pid = pool.submit(_pid).result(T)
        fut = pool.submit(_exit3)
        with pytest.raises(SystemExit) as info:
            fut.result(T)
        assert info.value.code == 3
        assert pool.submit(_pid).result(T) == pid, "sys.exit must not end the worker"
        assert pool.stats().restarts == 0


# ================================================================ 4. crashes
CRASHES = [
    pytest.param("sigkill", -9, "SIGKILL", id="sigkill"),
    pytest.param("sigsegv", -11, "SIGSEGV", id="sigsegv"),
    pytest.param("sigbus", -signal.SIGBUS, "SIGBUS", id="sigbus"),
    pytest.param("sigabrt", -signal.SIGABRT, "SIGABRT", id="sigabrt"),
    pytest.param("exit5", 5, "exited with code 5", id="exit5"),
]


def _crash_error(fut: Any, kind: str, start_method: str) -> mpexec.WorkerCrashedError:
    """The WorkerCrashedError the crashing call ``fut`` failed with (within 5 s)."""
    t0 = time.monotonic()
    exc = fut.exception(T)
    assert time.monotonic() - t0 < 5, "the crash must be reported within a few seconds"
    if not isinstance(exc, mpexec.WorkerCrashedError):
        pytest.fail(
            f"mpexec bug: a worker killed by {kind} under {start_method} is reported as "
            f"{type(exc).__name__}: {exc} (expected WorkerCrashedError; _worker_lost reads "
            "exitcode None, the child not yet reaped when its sentinel fires, as 'overran')"
        )
    return exc


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize(("kind", "exitcode", "text"), CRASHES)
def test_crash_breaks_pool(
    kind: str, exitcode: int, text: str, start_method: str, killed: list[int]
) -> None:
    with WorkerPool(1, start_method=start_method) as pool:
        pid = pool.submit(_pid).result(T)
        killed.append(pid)
        err = _crash_error(pool.submit(_crash, kind), kind, start_method)
        assert isinstance(err, BrokenExecutor)
        assert isinstance(err, mpexec.BrokenPoolError)
        assert err.pid == pid
        assert err.exitcode == exitcode
        assert text in str(err)
        assert f"pid {pid}" in str(err)
        assert err.cause
        assert err.cause in str(err)
        wait_until(lambda: "broken" in repr(pool), 5, "the pool to be marked broken")
        with pytest.raises(mpexec.BrokenPoolError) as info:
            pool.submit(_pid)
        assert info.value is err or text in str(info.value)
        with pytest.raises(mpexec.BrokenPoolError):
            pool.submit(_square, 2)
        assert pool.stats().restarts == 0
        wait_until(lambda: _gone(pid), 5, "the crashed worker to be gone")


def _submit_when_crash_reported(killed: list[int]) -> list[Any]:
    """Futures of the calls submit() accepted from the crashed call's done-callback."""
    accepted: list[Any] = []
    with WorkerPool(1) as pool:
        killed.append(pool.submit(_pid).result(T))
        fut = pool.submit(_crash, "exit5")

        def submit_again(_: Any) -> None:
            with contextlib.suppress(mpexec.BrokenPoolError):
                accepted.append(pool.submit(_pid))

        fut.add_done_callback(submit_again)
        assert isinstance(fut.exception(T), mpexec.WorkerCrashedError)
        wait_until(lambda: "broken" in repr(pool), 5, "the pool to be marked broken")
        for late in accepted:  # it was accepted: at least it must fail, not hang
            assert isinstance(late.exception(T), mpexec.BrokenPoolError)
    return accepted


def test_crash_marks_pool_broken_before_failing_futures(killed: list[int]) -> None:
    """A submit made as soon as the crash is reported must already be refused."""
    accepted = _submit_when_crash_reported(killed)
    assert not accepted, (
        "mpexec bug: submit() accepted a call after the crashed call's future had "
        "failed with WorkerCrashedError (_worker_lost settles the futures before "
        "_break marks the pool broken; concurrent.futures marks it broken first)"
    )


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize(("kind", "exitcode", "text"), CRASHES)
def test_crash_with_restart(
    kind: str, exitcode: int, text: str, start_method: str, killed: list[int]
) -> None:
    with WorkerPool(1, start_method=start_method, restart=True) as pool:
        pid = pool.submit(_pid).result(T)
        killed.append(pid)
        err = _crash_error(pool.submit(_crash, kind), kind, start_method)
        assert err.pid == pid
        assert err.exitcode == exitcode
        assert text in str(err)
        new_pid = pool.submit(_pid).result(T)
        assert new_pid != pid
        assert pool.pids == [new_pid]
        assert pool.submit(_square, 9).result(T) == 81
        stats = pool.stats()
        assert stats.restarts == 1
        assert stats.failed == 1
        assert "running" in repr(pool)


def _allocate_under_rlimit_as(nbytes: int) -> int:
    """Allocate ``nbytes`` with the address space capped well below that (RLIMIT_AS)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = psutil.Process().memory_info().vms + (256 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        return int(np.ones(nbytes, np.uint8).sum())
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("restart", [False, True])
def test_memory_error_under_rlimit_as_is_typed_and_the_pool_survives(restart: bool) -> None:
    with WorkerPool(1, restart=restart) as pool:
        pid = pool.submit(_pid).result(T)
        t0 = time.monotonic()
        fut = pool.submit(_allocate_under_rlimit_as, 8 << 30)
        with pytest.raises(MemoryError) as info:
            fut.result(T)
        assert time.monotonic() - t0 < 5
        assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
        assert "_allocate_under_rlimit_as" in info.value.__cause__.tb
        assert pool.submit(_allocate_under_rlimit_as, 1 << 20).result(T) == 1 << 20
        assert pool.submit(_pid).result(T) == pid, "a MemoryError must not cost the worker"
        assert pool.stats().restarts == 0


def test_crash_with_restart_reruns_queued_calls(killed: list[int]) -> None:
    with WorkerPool(1, restart=True) as pool:
        killed.append(pool.submit(_pid).result(T))
        crash = pool.submit(_crash, "sigkill")
        queued = [pool.submit(_square, i) for i in range(5)]
        with pytest.raises(mpexec.WorkerCrashedError):
            crash.result(T)
        assert [f.result(T) for f in queued] == [0, 1, 4, 9, 16]
        assert pool.stats().restarts == 1


# ================================================================ 5. timeout
def test_timeout_kills_and_replaces_worker(killed: list[int]) -> None:
    # Builtins only: a first call of a test-module function imports this module in
    # the worker, which on a loaded machine can itself take longer than 0.5 s.
    with WorkerPool(1, timeout=0.5) as pool:
        pid = pool.submit(os.getpid).result(T)
        killed.append(pid)
        t0 = time.monotonic()
        fut = pool.submit(time.sleep, 30)
        with pytest.raises(mpexec.TaskTimeoutError) as info:
            fut.result(T)
        elapsed = time.monotonic() - t0
        assert 0.4 < elapsed < 5
        assert isinstance(info.value, TimeoutError)
        assert "0.5" in str(info.value)
        assert str(pid) in str(info.value)
        new_pid = pool.submit(os.getpid).result(T)
        assert new_pid != pid
        assert pool.submit(time.sleep, 0.01).result(T) is None
        assert pool.pids == [new_pid]
        stats = pool.stats()
        assert stats.restarts == 1
        assert stats.failed == 1
        wait_until(lambda: _gone(pid), 5, "the timed-out worker to be gone")


# ================================================================ 6. worker_init, seed
@pytest.mark.parametrize("num_workers", [1, 2])
def test_worker_init_failure_breaks_construction(num_workers: int) -> None:
    t0 = time.monotonic()
    with pytest.raises(mpexec.BrokenPoolError, match="init exploded on purpose") as info:
        WorkerPool(num_workers, worker_init=_init_raises)
    assert time.monotonic() - t0 < 20
    assert "RuntimeError" in str(info.value)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert isinstance(cause.__cause__, mpexec.RemoteTraceback)
    assert "_init_raises" in cause.__cause__.tb


def _start_failure(monkeypatch: pytest.MonkeyPatch) -> BaseException | None:
    """What WorkerPool(2) raises when starting its second worker process fails."""
    from mpexec import _launch

    real = _launch._SpawnProcess._Popen
    calls: list[int] = []

    def popen(process_obj: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable (simulated)")
        return real(process_obj)

    monkeypatch.setattr(_launch._SpawnProcess, "_Popen", staticmethod(popen))
    try:
        WorkerPool(2, start_method="spawn")
    except BaseException as exc:  # reported below, whatever it is
        return exc
    finally:
        monkeypatch.undo()
    return None


def test_process_start_failure_raises_the_real_error(monkeypatch: pytest.MonkeyPatch) -> None:
    exc = _start_failure(monkeypatch)
    assert exc is not None, "WorkerPool() must fail when a worker process cannot start"
    text = f"{type(exc).__name__}: {exc}"
    del exc  # its traceback holds the half-built pool
    gc.collect()
    for proc in mp.active_children():  # the first worker, should cleanup have stopped early
        proc.kill()
        proc.join(T)
    assert "simulated" in text, (
        "mpexec bug: when a worker process fails to start, WorkerPool() raises "
        f"{text!r} instead of the start error (the cleanup joins a process that never "
        "started, and the rest of the cleanup is skipped)"
    )


def test_worker_init_sets_global() -> None:
    with WorkerPool(2, worker_init=_init_set_global, worker_init_args=("hello",)) as pool:
        assert set(pool.map(lambda _: _read_global(), range(20), timeout=T)) == {"hello"}
        assert _read_global() is None  # not in the caller


def _draws(pool: WorkerPool) -> dict[int, float]:
    """Each worker's next random number, by worker index."""
    seen: dict[int, float] = {}

    def both_seen() -> bool:
        for pid, value in pool.map(lambda _: _peek_random(), range(8), timeout=T):
            assert seen.get(pid, value) == value
            seen[pid] = value
        return len(seen) == pool.num_workers

    wait_until(both_seen, 10, "every worker to run a call")
    return {pool.pids.index(pid): value for pid, value in seen.items()}


def test_seed_reproducible_and_distinct_per_worker() -> None:
    with WorkerPool(2, seed=1234) as pool:
        first = _draws(pool)
    with WorkerPool(2, seed=1234) as pool:
        second = _draws(pool)
    with WorkerPool(2, seed=99) as pool:
        other = _draws(pool)
    assert first == second
    assert first[0] != first[1], "the two workers of one pool must draw differently"
    assert set(first.values()).isdisjoint(other.values())


# ================================================================ 7. shutdown
def test_shutdown_twice_and_submit_after() -> None:
    with WorkerPool(1) as pool:
        fut = pool.submit(_square, 3)
        pool.shutdown()
        assert fut.result(T) == 9, "shutdown(wait=True) lets queued calls finish"
        pool.shutdown()
        pool.shutdown(wait=False)
        with pytest.raises(mpexec.PoolClosedError, match="shutdown"):
            pool.submit(_square, 1)
        with pytest.raises(mpexec.PoolClosedError):
            list(pool.map(_square, [1]))
    assert isinstance(mpexec.PoolClosedError("x"), RuntimeError)
    assert not isinstance(mpexec.PoolClosedError("x"), mpexec.BrokenPoolError)
    assert "closed" in repr(pool)


def test_shutdown_nowait_cancels_running_and_queued(killed: list[int]) -> None:
    with WorkerPool(1) as pool:
        killed.extend(pool.pids)  # stopped by SIGTERM
        running = pool.submit(_sleep_then_pid, 30)
        queued = [pool.submit(_sleep_then_pid, 30) for _ in range(3)]
        t0 = time.monotonic()
        pool.shutdown(wait=False, cancel_futures=True)
        assert time.monotonic() - t0 < 5
        futures = [running, *queued]
        _, not_done = wait_futures(futures, timeout=5)
        assert not not_done, "every future must end after shutdown(wait=False)"
        for f in futures:
            if not f.cancelled():
                assert isinstance(f.exception(0), mpexec.PoolClosedError), f.exception(0)


def test_dropped_pool_stops_its_workers() -> None:
    pool = WorkerPool(2)
    assert pool.submit(_square, 2).result(T) == 4
    pids = list(pool.pids)
    del pool
    gc.collect()
    wait_until(lambda: all(_gone(p) for p in pids), 10, "workers of a dropped pool to exit")


# ================================================================ 8. main process killed
_CHILD = """
import sys, time
from mpexec import WorkerPool
import shm
pool = WorkerPool(2, start_method=sys.argv[1])
assert pool.submit(int, "5").result(30) == 5
print(" ".join(map(str, pool.pids)), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("start_method", START_METHODS)
def test_workers_exit_when_main_process_is_killed(start_method: str, backend: str) -> None:
    with _one_posix_child_at_a_time() if backend == "posix" else contextlib.nullcontext():
        _main_killed(start_method, backend)


def _main_killed(start_method: str, backend: str) -> None:
    before = _mpx_names()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, start_method],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SHM_BACKEND": backend},
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], T)
        line = proc.stdout.readline() if ready else ""
        pids = [int(p) for p in line.split()]
        if len(pids) == 2:
            assert all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(T)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert len(pids) == 2, f"the child printed {line!r} and stderr {err!r}"
    # Poll tightly: a dead creator's names can be reaped by any process that makes
    # its first named segment, so look as soon as the workers are gone.
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, f"workers {pids} still alive 5 s after the kill"
        time.sleep(0.001)
    created = _mpx_names() - before
    by_workers = {n for n in created if any(f"-{p}-" in n for p in pids)}
    # The killed process's own named segments (posix backend) cannot be unlinked by it,
    # by design; remove everything so that no_leaks does not report this twice.
    _unlink_names_of(proc.pid, *pids)
    assert not by_workers, (
        f"mpexec bug: with the {backend} backend under {start_method}, the workers of a "
        f"SIGKILLed pool process exited but left their named segments: {sorted(by_workers)} "
        "(spawn: PR_SET_PDEATHSIG SIGKILLs the worker before its lifeline thread can "
        "unlink; forkserver: the main thread's exit on the closed ring races that thread)"
    )


_CHILD_SHUTDOWN = """
import os, sys
from mpexec import WorkerPool
import shm
with WorkerPool(2, start_method=sys.argv[1]) as pool:
    assert pool.submit(int, "5").result(30) == 5
    assert len(pool.submit(bytes, 1 << 16).result(30)) == 1 << 16
# The workers are joined: look at once, before anyone else can reap their names.
left = [n for n in os.listdir("/dev/shm") if any(f"-{p}-" in n for p in pool.pids)]
print(" ".join(map(str, pool.pids)))
print(" ".join(sorted(left)), flush=True)
"""


@pytest.mark.parametrize("start_method", START_METHODS)
def test_named_segments_unlinked_after_shutdown_posix(start_method: str) -> None:
    """With named segments (posix backend), a clean shutdown leaves no name behind.

    Run in a child process: the backend is read from the environment when each
    process makes its arena, and a forkserver already running here has its own.
    """
    with _one_posix_child_at_a_time():
        _clean_shutdown_posix(start_method)


def _clean_shutdown_posix(start_method: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD_SHUTDOWN, start_method],
        capture_output=True,
        text=True,
        timeout=T,
        env={**os.environ, "SHM_BACKEND": "posix"},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    pids = [int(p) for p in lines[0].split()]
    left = lines[1].split()
    assert len(pids) == 2, proc.stdout
    wait_until(lambda: all(_gone(p) for p in pids), 10, f"workers {pids} to exit")
    _unlink_names_of(*pids)
    assert not left, (
        f"mpexec bug: under {start_method} with the posix backend, workers that exited "
        f"after a clean shutdown() left their arenas' named segments in /dev/shm: {left} "
        "(the worker never closes or unlinks its arena on the way out: _worker.main's "
        "finally does not, and a forkserver child ends with os._exit, so no finalizer runs)"
    )


# ================================================================ 9. soak
def test_soak_no_fd_or_arena_growth() -> None:
    small = np.ones(4, dtype=np.int64)
    big = np.ones(BIG // 8, dtype=np.int64)
    with WorkerPool(2) as pool:
        warm_up = pool.map(_soak, range(100), [small] * 100, chunksize=1, timeout=T)
        assert list(warm_up) == list(range(1, 101))
        gc.collect()
        wait_until(lambda: pool.stats().arena.in_use == 0, 10, "warm-up releases")
        in_use = pool.stats().arena.in_use
        fds = _fds()
        n = 20_000
        args = (big if i % 100 == 0 else small for i in range(n))
        total = 0
        # One task a call (map would chunk these by itself): the per-call path is soaked.
        for i, r in enumerate(pool.map(_soak, range(n), args, chunksize=1, timeout=60)):
            if i % 100 == 0:
                assert r.shape == big.shape
                assert r[-1] == i + 1
                total += int(r[0])
            else:
                total += r
        assert total == n * (n - 1) // 2 + n
        stats = pool.stats()
        assert stats.completed >= n + 100
        assert stats.bytes_copied == (n // 100) * big.nbytes
        gc.collect()
        wait_until(
            lambda: pool.stats().arena.in_use == in_use, 10, "the arena to return to its start"
        )
        assert _fds() <= fds + 2, f"fds grew from {fds} to {_fds()}"
        assert pool.stats().pending == 0


def test_shutdown_from_two_threads_at_once(no_leaks: None) -> None:
    # One thread waits behind a call that hangs; another stops the pool without waiting.
    # An exception in the waiting thread fails the test (pytest turns it into an error).
    pool = WorkerPool(2)
    pool.submit(os.getpid).result(T)
    hung = pool.submit(time.sleep, 60)
    wait_until(hung.running, 10, "the hanging call to start")  # else it is cancelled
    state = pool._state
    waiter = threading.Thread(target=pool.shutdown, kwargs={"wait": True})
    waiter.start()
    wait_until(lambda: state.closed, 10, "the first shutdown to begin")
    t0 = time.monotonic()
    pool.shutdown(wait=False, cancel_futures=True)
    waiter.join(T)
    assert not waiter.is_alive()
    assert time.monotonic() - t0 < 10
    with pytest.raises(mpexec.PoolClosedError):
        hung.result(T)
    del pool, hung, waiter
