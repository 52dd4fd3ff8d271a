"""A newcomer's first script: no ``if __name__ == "__main__":`` guard, one run of its body.

Real script files run in a fresh interpreter (``python script.py``, ``python -m
pkg.mod``, ``python -c``, and a notebook's ``__main__``, which has no file),
each creating a pool and a pipeline at module level with functions, classes
and an exception defined in ``__main__``. Then the start-up failures of a
worker, each of which must come back as one error carrying the worker's
traceback.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import mpexec
from mpexec import WorkerPool
from tests.conftest import START_METHODS

T = 120  # seconds a script may take (it starts a pool and a pipeline, on a loaded host)

pytestmark = pytest.mark.usefixtures("no_leaks")

# The body a user writes: everything at module level, nothing guarded.
SCRIPT = """\
import enum
import os
import sys

import numpy as np
import psutil

import mpexec
from mpexec import fn

print("BODY RAN", os.getpid(), flush=True)
METHOD = sys.argv[1]
OFFSET = 10


class Scaled:
    def __init__(self, a):
        self.a = a


class Refused(Exception):
    pass


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def apply(f, *args):
    return f(*args)


def swap(c):
    return Color.BLUE if c is Color.RED else Color.RED


def double(s):
    return Scaled(s.a * 2 + OFFSET)


def refuse(x):
    raise Refused(f"no {x}")


def read(info):
    if info.idx_in_epoch >= 6:
        raise StopIteration
    return np.full(3, info.idx_in_epoch, np.int64)


def plus(x):
    return x + OFFSET


pool = mpexec.WorkerPool(2, start_method=METHOD)
out = pool.submit(double, Scaled(np.arange(4))).result(60)
print("POOL", type(out) is Scaled, out.a.tolist(), flush=True)
print("CALLBACK", pool.submit(apply, swap, Color.RED).result(60) is Color.BLUE, flush=True)
try:
    pool.submit(refuse, 7).result(60)
except Refused as exc:
    print("RAISED", exc, flush=True)
pool.shutdown()


@mpexec.pipeline_def(batch_size=3, num_workers=2, seed=1, start_method=METHOD)
def numbers():
    return fn.python_function(fn.external_source(source=read, batch=False), function=plus)


with numbers() as pipe:
    print("PIPE", [int(b.as_array().sum()) for (b,) in pipe], flush=True)

helpers = ("forkserver", "resource_tracker")  # multiprocessing's, long-lived
left = [
    p.pid
    for p in psutil.Process().children(recursive=True)
    if not any(h in " ".join(p.cmdline()) for h in helpers)
]
print("LEFT", left, flush=True)
"""

EXPECTED = [
    "POOL True [10, 12, 14, 16]",
    "CALLBACK True",
    "RAISED no 7",
    "PIPE [99, 126]",  # (10 + 11 + 12) * 3, (13 + 14 + 15) * 3
    "LEFT []",
]

# A notebook's __main__ has no __file__ and no __spec__: cells run in it.
NOTEBOOK = """\
import sys, types
main = types.ModuleType("__main__")
sys.modules["__main__"] = main
cell = open(sys.argv.pop(1)).read()
exec(compile(cell, "<cell 1>", "exec"), main.__dict__)
"""


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )


def _argv(how: str, tmp_path: Path, method: str) -> list[str]:
    if how == "script":
        (tmp_path / "first.py").write_text(SCRIPT)
        return ["first.py", method]
    if how == "module":
        (tmp_path / "app").mkdir()
        (tmp_path / "app" / "__init__.py").write_text("")
        (tmp_path / "app" / "first.py").write_text(SCRIPT)
        return ["-m", "app.first", method]
    if how == "command":
        return ["-c", SCRIPT, method]
    assert how == "notebook"
    (tmp_path / "cell.py").write_text(SCRIPT)
    return ["-c", NOTEBOOK, "cell.py", method]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("how", ["script", "module", "command", "notebook"])
def test_unguarded_script_runs_its_body_once(how: str, method: str, tmp_path: Path) -> None:
    proc = _run(_argv(how, tmp_path, method), tmp_path)
    lines = proc.stdout.splitlines()
    body = [line for line in lines if line.startswith("BODY RAN")]
    assert proc.returncode == 0, f"the script failed:\n{proc.stdout}\n{proc.stderr}"
    assert len(body) == 1, (
        f"mpexec bug: under {method}, a script run as {how} ran its body {len(body)} "
        f"times (workers must never import the caller's __main__):\n{proc.stdout}"
    )
    assert [line for line in lines if not line.startswith("BODY RAN")] == EXPECTED, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_unguarded_script_under_fork(tmp_path: Path) -> None:
    """fork runs no main module either: the same script works, its body once."""
    proc = _run(_argv("script", tmp_path, "fork"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("BODY RAN") for line in lines) == 1, proc.stdout
    assert lines[1:] == EXPECTED, proc.stdout


# The guard is still needed where the user's own code starts processes with
# spawn: those run the main module, and the pool at module level with it.
OWN_SPAWN = """\
import multiprocessing as mp

import mpexec

print("BODY RAN", flush=True)


def noop():
    pass


pool = mpexec.WorkerPool(1)
child = mp.get_context("spawn").Process(target=noop)
child.start()
child.join(60)
print("CHILD EXIT", child.exitcode, flush=True)
pool.shutdown()
"""


def test_pool_in_a_users_spawned_child_needs_the_guard(tmp_path: Path) -> None:
    (tmp_path / "own.py").write_text(OWN_SPAWN)
    proc = _run(["own.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "CHILD EXIT 1" in proc.stdout, proc.stdout
    assert proc.stderr.count("mpexec.MainModuleError") == 1, proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr
    assert "own.py" in proc.stderr, proc.stderr
    assert "bootstrapping phase" not in proc.stderr, proc.stderr


# A process started by the user with spawn (torch.multiprocessing.spawn, Lightning's
# ddp_spawn) runs the parent's script as multiprocessing's ``__mp_main__``: what
# that script defines must still reach mpexec's workers by value.
SPAWNED_MAIN = """\
import multiprocessing as mp
import os
import sys

import mpexec


class Squares:
    def __init__(self, offset):
        self.offset = offset

    def __call__(self, x):
        return x * x + self.offset


class Box:
    def __init__(self, v):
        self.v = v


def unbox(box):
    return box.v


def init(tag):
    os.environ["SPAWNED_MAIN_TAG"] = tag


def tag():
    return os.environ["SPAWNED_MAIN_TAG"]


def child(method, q):
    try:
        with mpexec.WorkerPool(
            2, start_method=method, worker_init=init, worker_init_args=("t",)
        ) as pool:
            q.put([
                pool.submit(Squares(1), 3).result(timeout=60),
                pool.submit(unbox, Box(7)).result(timeout=60),
                type(pool.submit(Box, 2).result(timeout=60)).__name__,
                pool.submit(tag).result(timeout=60),
            ])
    except BaseException as exc:
        q.put(repr(exc))


if __name__ == "__main__":
    method = None if sys.argv[1] == "default" else sys.argv[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(method, q))
    p.start()
    print("GOT", q.get(timeout=100), flush=True)
    p.join(60)
    print("CHILD EXIT", p.exitcode, flush=True)
"""


@pytest.mark.parametrize("method", ["default", *START_METHODS])
def test_main_script_objects_reach_workers_from_a_spawned_child(
    method: str, tmp_path: Path
) -> None:
    (tmp_path / "ddp_like.py").write_text(SPAWNED_MAIN)
    proc = _run(["ddp_like.py", method], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "GOT [10, 7, 'Box', 't']" in proc.stdout, proc.stdout + proc.stderr
    assert "CHILD EXIT 0" in proc.stdout, proc.stdout + proc.stderr


# A pool dropped just before a user's spawned child returns (a DDP rank's last
# epoch): multiprocessing's exit in that child joins every child process it
# listed, while the pool's stop thread closes them.
DROPPED_IN_CHILD = """\
import multiprocessing as mp
import sys

import mpexec


def child(method):
    for _ in range(3):
        pool = mpexec.WorkerPool(2, start_method=method)
        pool.submit(int, "1").result(timeout=60)
        del pool  # stopped in the background


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    codes = []
    for _ in range(4):
        p = ctx.Process(target=child, args=(sys.argv[1],))
        p.start()
        p.join(120)
        codes.append(p.exitcode)
    print("CODES", codes, flush=True)
"""


@pytest.mark.parametrize("method", ["fork", *START_METHODS])
def test_a_spawned_child_exits_cleanly_while_its_dropped_pool_stops(
    method: str, tmp_path: Path
) -> None:
    (tmp_path / "rank.py").write_text(DROPPED_IN_CHILD)
    proc = _run(["rank.py", method], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "CODES [0, 0, 0, 0]" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- start-up failures
# A directory that shadows numpy, on the workers' sys.path only: the pool's
# process imported the real numpy first. (A fork server started here finds it
# too: its sys.path starts with the working directory.)
BROKEN_ENV = """\
import os
import sys

from mpexec import BrokenPoolError, WorkerPool  # loaded here before sys.path changes

sys.path.insert(0, os.getcwd())  # the workers' numpy is broken
try:
    WorkerPool(2, start_method=sys.argv[1])
except BrokenPoolError as exc:
    print("MESSAGE", exc)
    print("CAUSE", type(exc.__cause__).__name__)
    print(getattr(exc.__cause__, "tb", ""))
"""


@pytest.mark.parametrize("method", START_METHODS)
def test_broken_environment_reports_the_workers_traceback(method: str, tmp_path: Path) -> None:
    fake = tmp_path / "env" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("numpy is broken here (test)")\n')
    (tmp_path / "broken.py").write_text(BROKEN_ENV)
    proc = _run([str(tmp_path / "broken.py"), method], fake.parent)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "MESSAGE worker 0" in out, out
    assert "failed to start" in out, out
    assert "ImportError: numpy is broken here (test)" in out, out
    assert "CAUSE RemoteTraceback" in out, out
    assert f"{fake}{os.sep}__init__.py" in out, "the worker's traceback is missing:\n" + out
    assert "Traceback" not in proc.stderr, (
        "mpexec bug: a start-up failure printed a traceback per worker:\n" + proc.stderr
    )


def test_fork_server_that_dies_preloading_is_named(tmp_path: Path) -> None:
    """An import that raises (not ImportError) kills the fork server: one clear error."""
    fake = tmp_path / "env" / "numpy"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("numpy explodes (test)")\n')
    (tmp_path / "broken.py").write_text(BROKEN_ENV)
    proc = _run([str(tmp_path / "broken.py"), "forkserver"], fake.parent)
    assert proc.returncode == 0, proc.stderr
    assert "MESSAGE mpexec's fork server could not start mpexec-worker-0" in proc.stdout
    assert "start_method='spawn'" in proc.stdout
    # The server's own traceback, once; none from workers.
    assert proc.stderr.count("Traceback") == 1, proc.stderr
    assert "RuntimeError: numpy explodes (test)" in proc.stderr


@pytest.mark.parametrize("method", START_METHODS)
def test_worker_init_from_a_module_workers_cannot_import(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded from a file path, not from sys.path: the workers cannot import it."""
    path = tmp_path / "startup_helper_i16.py"
    path.write_text("def init():\n    pass\n")
    spec = importlib.util.spec_from_file_location("startup_helper_i16", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "startup_helper_i16", module)
    with pytest.raises(mpexec.BrokenPoolError) as info:
        WorkerPool(1, start_method=method, worker_init=module.init)
    text = str(info.value)
    assert "failed to start" in text
    assert "No module named 'startup_helper_i16'" in text
    assert "register_pickle_by_value" in text
    cause: Any = info.value.__cause__
    assert isinstance(cause, mpexec.SerializationError)
    assert isinstance(cause.__cause__, mpexec.RemoteTraceback)
    assert "ModuleNotFoundError" in cause.__cause__.tb


def _exit_at_once() -> None:
    os._exit(3)


@pytest.mark.parametrize("method", START_METHODS)
def test_worker_that_exits_while_starting_is_named(method: str) -> None:
    with pytest.raises(mpexec.BrokenPoolError) as info:
        WorkerPool(1, start_method=method, worker_init=_exit_at_once)
    text = str(info.value)
    assert "died while starting (exited with code 3) without reporting an error" in text
    assert "os._exit()" in text


def test_workers_are_started_without_the_main_module() -> None:
    """The preparation data a worker gets names no main module; the rest is kept."""
    from mpexec import _launch

    data = _launch.preparation_data("w")
    assert "init_main_from_path" not in data
    assert "init_main_from_name" not in data
    assert data["sys_path"]
    assert data["dir"] == os.getcwd()


def test_bootstrap_loads_only_the_standard_library() -> None:
    """The code a child runs before mpexec is imported names nothing else."""
    from mpexec import _launch

    imported = {
        word.rstrip(",")
        for line in _launch._BOOTSTRAP.splitlines()
        if line.startswith("import ")
        for word in line.split()[1:]
    }
    assert imported <= set(sys.stdlib_module_names)


@pytest.mark.parametrize("method", START_METHODS)
def test_start_up_pipes_are_closed_once_workers_are_up(method: str) -> None:
    """Each worker's start-up report pipe is closed at its hello: no fd per worker kept."""
    with WorkerPool(3, start_method=method) as pool:
        reports = [slot.process._report for slot in pool._state.slots]
        assert len(reports) == 3
        assert all(r is not None and not r._close.alive for r in reports)
        assert pool.submit(int, "4").result(60) == 4


def test_threads_polling_a_fork_server_child_all_read_its_exit_code() -> None:
    """multiprocessing's forkserver ``poll()`` reads the exit code from the server's pipe
    unlocked: a second thread reading at the same moment (the pool's stop thread and a
    user's ``join()`` or ``exitcode``, as torch's suite does on a dropped loader's
    workers) read EOF and overwrote the code with 255. Threads polling the child when
    it exits make that race near-certain (19 runs of 20 before the fix)."""
    from mpexec import _launch

    ctx = mp.get_context("forkserver")
    for _ in range(5):
        go = ctx.Event()
        proc = _launch.context("forkserver").Process(target=go.wait, args=(60,))
        proc.start()
        popen = proc._popen
        deadline = time.monotonic() + 60
        codes: list[int | None] = []

        def poll(popen: Any = popen, deadline: float = deadline, codes: list[Any] = codes) -> None:
            while popen.poll() is None and time.monotonic() < deadline:
                pass
            codes.append(popen.returncode)

        threads = [threading.Thread(target=poll) for _ in range(4)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join(90)
        proc.join(30)
        assert codes == [0] * 4, codes
        assert proc.exitcode == 0
        proc.close()


@pytest.mark.skipif("forkserver" not in mp.get_all_start_methods(), reason="needs forkserver")
def test_pipelined_fork_server_starts_do_not_wait_for_the_fork() -> None:
    """In ``pipelined_starts()`` a fork-server start returns without waiting for the
    server to fork (a pool prepares its next worker meanwhile): with the server
    stopped, starts still return. The pid is read on first use, and until then
    neither ``is_alive()`` nor ``join()`` takes the pid's bytes on the sentinel
    for an exit."""
    from mpexec import _launch

    server = _launch.context("forkserver")
    first = server.Process(target=int)
    first.start()  # the fork server is up
    first.join(30)
    first.close()
    # The server's pid has no public face: it is stopped for a moment, then resumed.
    server_pid = _launch._fork_server()._forkserver_pid
    ctx = mp.get_context("forkserver")
    go = ctx.Event()
    procs = [server.Process(target=go.wait, args=(60,)) for _ in range(3)]

    def start_all() -> None:
        with _launch.pipelined_starts():
            for proc in procs:
                proc.start()

    starter = threading.Thread(target=start_all)
    os.kill(server_pid, signal.SIGSTOP)
    try:
        starter.start()
        starter.join(30)
        returned = not starter.is_alive()
    finally:
        os.kill(server_pid, signal.SIGCONT)
    starter.join(60)
    assert returned, "a pipelined start waited for the stopped fork server"
    assert procs[0].is_alive()  # reads the pid first, then looks for the exit
    procs[1].join(0.05)  # the same: not ended by the pid's bytes
    assert procs[1].exitcode is None
    me = os.getpid()
    children = {c.pid for c in psutil.Process(me).children(recursive=True)}
    for proc in procs:
        assert proc.pid in children  # the server's child, by its real pid
    go.set()
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
        proc.close()
