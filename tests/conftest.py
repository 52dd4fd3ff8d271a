"""Shared fixtures: every test that starts processes proves it leaked nothing."""

from __future__ import annotations

import contextlib
import dis
import gc
import multiprocessing as mp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import psutil
import pytest

from mpexec._host import cuda_initialised

START_METHODS = ["forkserver", "spawn"]


def run_python(*args: str, stdin: str = "", timeout: float = 120) -> str:
    """``python *args`` in a fresh interpreter that imports this checkout; its stdout.

    Fails the test, with the child's stderr, if it exits non-zero.
    """
    proc = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


#: The start of a child script that storms itself with SIGINT (run it with
#: :func:`run_python`): its handler raises one ``KeyboardInterrupt`` per arming
#: (``armed[0] = True`` just inside the ``try`` that catches it, so never in
#: its ``except`` clause, never outside), and ``interrupter(every)``, run in a
#: thread, sends a SIGINT every ``every`` seconds until ``stop`` is set.
SIGINT_STORM = """
import os, signal, threading, time

stop = threading.Event()
armed = [False]  # a plain list: no lock to interrupt

def on_sigint(signum, frame):
    if armed[0]:
        armed[0] = False  # disarmed before raising
        raise KeyboardInterrupt

def interrupter(every):
    while not stop.wait(every):
        os.kill(os.getpid(), signal.SIGINT)
"""


_RETURNS = {dis.opmap[n] for n in ("RETURN_VALUE", "RETURN_CONST") if n in dis.opmap}


class InterruptAt:
    """A profile function (``sys.setprofile``) that raises ``KeyboardInterrupt`` at its
    ``target``-th event: a Python call starting, or any call returning, the points where
    CPython raises a real Ctrl-C's. So a sweep over ``target`` lands one everywhere a
    user's could, deterministically.

    Skipped, as no signal is checked there: a return while an exception unwinds.
    Skipped, as a documented limit: a view's release finalizer (``_fire``) as it starts.
    Skipped, as the sweep's own: the return of the ``sys.setprofile`` call that armed
    it. CPython 3.12+ reports that return when a thread has ended with a profile
    function set (its events stay on: tests/pool/test_pool_calls.py's manager
    threads), and an interrupt there lands in the test's own frame.
    ``skip(frame, event)``: a test's own limits. ``where`` names the point it landed.
    """

    def __init__(
        self, target: int = 0, skip: Callable[[FrameType, str], bool] | None = None
    ) -> None:
        self.seen = 0
        self.target = target
        self.where = ""
        self.skip = skip

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return", "c_return"):
            return
        code = frame.f_code
        if event == "return" and code.co_code[frame.f_lasti] not in _RETURNS:
            return
        if event == "call" and code.co_name == "_fire":
            return
        if event == "c_return" and arg is sys.setprofile:
            return
        if self.skip is not None and self.skip(frame, event):
            return
        self.seen += 1
        if self.seen == self.target:
            sys.setprofile(None)
            name = getattr(arg, "__name__", "") if event == "c_return" else ""
            self.where = f"{event} {code.co_name} {name} ({code.co_filename}:{frame.f_lineno})"
            raise KeyboardInterrupt

    def run(self, call: Callable[[], Any]) -> Any:
        """``call()`` with this armed (from its first event); its result, or None if
        interrupted (``where`` then says where)."""
        self.seen, self.where = 0, ""
        sys.setprofile(self)
        try:
            return call()
        except KeyboardInterrupt:
            return None
        finally:
            sys.setprofile(None)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until true or fail after ``timeout`` (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


#: Every process this test process started through multiprocessing (recorded by
#: the patched ``BaseProcess.start`` below), alive or not: pid -> its start time
#: (None: gone before it was read). Pids wrap (32768 on many hosts) within one run
#: of the suite, so a pid alone would claim another process's segments.
_STARTED: dict[int, float | None] = {}
_start = mp.process.BaseProcess.start


#: The popens of fork-server starts that did not wait for the pid (mpexec's
#: ``_launch.pipelined_starts``): reading it here would make them wait.
_PENDING: list[Any] = []


def _recording_start(self: mp.process.BaseProcess) -> None:
    _start(self)
    popen = self._popen  # type: ignore[attr-defined]
    if getattr(popen, "_pid", 0) is None:
        _PENDING.append(popen)
    elif self.pid is not None:
        _STARTED[self.pid] = _born(self.pid)


def _born(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _started() -> dict[int, float | None]:
    """The processes started so far (those read by now, for pipelined ones), by pid."""
    for popen in list(_PENDING):
        if popen._pid is not None:
            _STARTED[popen._pid] = _born(popen._pid)
            _PENDING.remove(popen)
    return _STARTED


def _started_by_us(pid: int) -> bool:
    """``pid`` is (or was) one we started: gone, or alive since the start we recorded.

    A live process under a pid we started long ago, born at another time, is another
    test process's (an xdist worker's, a tox env's): its segments are not ours.
    """
    started = _started()
    if pid not in started:
        return False
    born = started[pid]
    now = _born(pid)
    return now is None or now == born


mp.process.BaseProcess.start = _recording_start  # type: ignore[method-assign]


def shm_names() -> set[str]:
    """Named segments in /dev/shm created by this process or one it started.

    Names read ``{tag}-{pid}-{hex}``. Other pytest-xdist workers and tox envs
    create (and, with killed children, leave for reaping) segments at the same
    time; only names whose creator is ours are counted: this process, a
    process it started through multiprocessing, or a live descendant.
    """
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("mpx")]
    except FileNotFoundError:
        return set()
    me = psutil.Process()
    live = {me.pid} | {c.pid for c in me.children(recursive=True)}
    return {n for n in names if _creator(n) in live or _started_by_us(_creator(n))}


def _creator(name: str) -> int:
    parts = name.split("-")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else -1


def memfd_count(pid: int | None = None, prefix: str = "/memfd:mpx") -> int:
    """How many of mpexec's memfd files (``prefix``: of one kind) ``pid`` (default: this
    process) holds open."""
    n = 0
    base = f"/proc/{pid or os.getpid()}/fd"
    for fd in os.listdir(base):
        try:
            if os.readlink(f"{base}/{fd}").startswith(prefix):
                n += 1
        except OSError:
            pass
    return n


def _children() -> list[psutil.Process]:
    # The forkserver and the resource tracker are long-lived helpers of
    # multiprocessing itself, started once per test process; not ours to reap.
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "forkserver" not in " ".join(_cmdline(p))
        and "resource_tracker" not in " ".join(_cmdline(p))
    ]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _helper_fds() -> set[str]:
    """The fds this process's helpers hold for as long as it lives, once started.

    multiprocessing's resource tracker and fork server, and mpexec's own fork
    server: the first test to start a worker starts them, and no test leaks them.
    """
    from multiprocessing import forkserver, resource_tracker

    from mpexec import _launch

    held = [getattr(resource_tracker._resource_tracker, "_fd", None)]
    servers = (forkserver._forkserver, _launch._server)
    held += [getattr(server, "_forkserver_alive_fd", None) for server in servers]
    return {str(fd) for fd in held if fd is not None}


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """Fail the test if it leaves a child process, fd or named segment behind."""
    gc.collect()
    fds_before = len(_open_fds() - _helper_fds())
    names_before = shm_names()
    yield
    gc.collect()
    wait_until(lambda: not _children(), 10, "child processes to exit")
    for p in mp.active_children():
        p.join(1)
    # The forkserver keeps a socket to us: allow for the one opened on first use.
    # (Collected on each look: under load, a pool's last fds may close with a
    # cycle that only the collector frees, after the first collect above.)
    wait_until(
        lambda: gc.collect() >= 0 and len(_open_fds() - _helper_fds()) <= fds_before + 2,
        10,
        "fds to be closed",
    )
    assert shm_names() - names_before == set()


@pytest.fixture
def forkable() -> None:
    """For a test whose workers start by fork: mpexec refuses fork once the process holds
    a CUDA context (docs/pool.md), which an earlier test in the same xdist worker makes
    on a host with a GPU. There the test is skipped, saying so; on a host without one
    (CI) it always runs."""
    if cuda_initialised():
        pytest.skip(
            "an earlier test made a CUDA context in this process (a GPU host): mpexec refuses "
            "fork after that, by design; run this test in a process of its own to cover it"
        )


@pytest.fixture(params=START_METHODS)
def ctx(request: pytest.FixtureRequest) -> Any:
    """A multiprocessing context for each start method we support."""
    return mp.get_context(request.param)


@pytest.fixture(params=["memfd", "posix"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def counted_opcodes(picked: Callable[[Any], bool]) -> Iterator[list[int]]:
    """Count the bytecodes this thread runs in frames whose code object ``picked``
    accepts (``sys.settrace``'s opcode events); the count is the yielded list's item."""
    ran = [0]

    def count(frame: Any, event: str, arg: Any) -> Any:
        ran[0] += event == "opcode"
        return count

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if not picked(frame.f_code):
            return None
        frame.f_trace_opcodes = True
        return count

    sys.settrace(trace)
    try:
        yield ran
    finally:
        sys.settrace(None)
