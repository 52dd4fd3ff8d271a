"""Open-file limits: a pool fits under RLIMIT_NOFILE or says at once that it cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpexec import WorkerCrashedError, WorkerPool
from mpexec._host import FDS_PER_WORKER
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]

resource = pytest.importorskip("resource")
pytestmark = pytest.mark.usefixtures("no_leaks")


def _run(soft: int, hard: int, workers: int) -> dict[str, object]:
    """Start ``WorkerPool(workers)`` in a fresh Python whose limits are (soft, hard)."""
    code = textwrap.dedent(
        f"""
        import json, resource, time
        resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))
        import psutil
        import mpexec
        out = {{}}
        t0 = time.monotonic()
        try:
            with mpexec.WorkerPool({workers}) as pool:
                out["results"] = list(pool.map(abs, range(-{workers}, 0)))
                out["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except Exception as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
            out["errno"] = getattr(exc, "errno", None)
            out["oserror"] = isinstance(exc, OSError)
            out["seconds"] = time.monotonic() - t0
            out["children"] = [
                p.pid for p in psutil.Process().children(recursive=True)
                if "forkserver" not in " ".join(p.cmdline())
            ]
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # the forkserver included
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_low_soft_limit_is_raised_toward_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit here is {hard}: too low to raise anything")
    out = _run(128, 2048, 12)  # 12 workers need about 12 * FDS_PER_WORKER open files
    assert out.get("error") is None, out
    assert out["results"] == list(range(12, 0, -1))
    assert out["soft"] == 2048


def test_a_hard_limit_too_low_fails_at_once_naming_the_limit_and_the_fix() -> None:
    out = _run(128, 128, 12)
    assert out["error"] == "ResourceLimitError"
    assert out["oserror"] is True
    assert out["errno"] == 24  # EMFILE, as the limit would have caused
    message = str(out["message"])
    for words in ("WorkerPool(12)", "RLIMIT_NOFILE", "128", "ulimit -n", "at most"):
        assert words in message, message
    assert out["children"] == []  # refused before any worker started


def test_a_worker_costs_the_caller_at_most_its_budget_of_open_files() -> None:
    def open_now() -> int:
        return len(os.listdir("/proc/self/fd"))

    with WorkerPool(1) as one:
        one.submit(abs, -1).result(30)
        with_one = open_now()
    with WorkerPool(5) as five:
        list(five.map(abs, range(-50, 0)))
        with_five = open_now()
    per_worker = (with_five - with_one) / 4
    assert per_worker <= FDS_PER_WORKER, per_worker


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds through /proc")
@pytest.mark.usefixtures("forkable")
def test_fork_workers_hold_no_fds_of_the_workers_started_before_them() -> None:
    # Under fork a child inherits every fd of the pool's process: the main-side
    # ends of each worker started before it (14 each), O(W^2) fds in all. Each
    # worker now holds the same few, whatever its index; what the user opened
    # before the pool is still inherited, as fork promises.
    psutil = pytest.importorskip("psutil")
    user_r, user_w = os.pipe()
    try:
        with WorkerPool(6, start_method="fork") as pool:
            counts = [psutil.Process(pid).num_fds() for pid in pool.pids]
            assert max(counts) - min(counts) <= 1, counts
            assert all(pool.map(_fd_is_open, [user_r] * 12, chunksize=1))
    finally:
        os.close(user_r)
        os.close(user_w)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds through /proc")
@pytest.mark.usefixtures("forkable")
def test_a_fork_worker_started_again_keeps_its_own_fds() -> None:
    # A replacement closes the other live workers' fds, never its own, even
    # where a dead worker's numbers were taken by the new worker's rings.
    psutil = pytest.importorskip("psutil")
    with WorkerPool(3, start_method="fork", restart=True) as pool:
        for index in (1, 2):  # the second replacement starts beside the first's
            victim = pool.pids[index]
            with pytest.raises(WorkerCrashedError):
                pool.submit_call(os._exit, (3,), worker=index).result(30)
            wait_until(
                lambda v=victim: v not in pool.pids and len(pool.pids) == 3, 30, "a replacement"
            )
        assert list(pool.map(abs, range(-12, 0), chunksize=1)) == list(range(12, 0, -1))
        # Each worker answers a call of its own: its start is over, and with it the
        # closing of the fds it inherited (the map above need not reach a replacement
        # still starting; one counted then still held the others' fds).
        pids = [pool.submit_call(os.getpid, worker=i).result(30) for i in range(3)]
        assert pids == pool.pids
        counts = [psutil.Process(pid).num_fds() for pid in pids]
        # The replacement, started by the manager thread, may hold that thread's
        # few fds too; not another worker's 14.
        assert max(counts) - min(counts) < 8, counts


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts fds through /proc")
@pytest.mark.usefixtures("forkable")
def test_a_fork_start_reads_only_the_fds_it_may_have_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Telling a fork worker's fds apart must cost O(what its start opens), not
    # O(every fd open here): a listing of /proc/self/fd per start made W starts
    # O(W^2), each start reading the fds of all the workers before it.
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 4096:
        pytest.skip("needs room for 2,000 open files")
    read = {"entries": 0}
    listdir, scandir, readlink = os.listdir, os.scandir, os.readlink

    def counted_listdir(path: object = ".") -> list[str]:
        names = listdir(path)  # type: ignore[arg-type]
        read["entries"] += len(names)
        return names

    def counted_scandir(path: object = ".") -> object:
        entries = list(scandir(path))  # type: ignore[arg-type]
        read["entries"] += len(entries)
        return iter(entries)

    def counted_readlink(path: object, *args: object, **kwargs: object) -> object:
        read["entries"] += 1
        return readlink(path, *args, **kwargs)  # type: ignore[arg-type]

    def reads_to_start(workers: int) -> int:
        read["entries"] = 0
        with monkeypatch.context() as patched:
            patched.setattr(os, "listdir", counted_listdir)
            patched.setattr(os, "scandir", counted_scandir)
            patched.setattr(os, "readlink", counted_readlink)
            pool = WorkerPool(workers, start_method="fork")
        with pool:
            assert list(pool.map(abs, range(-8, 0), chunksize=1)) == list(range(8, 0, -1))
        return read["entries"]

    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(2000)]
    try:
        # Told apart from what a pool reads once (its open-file check, a listing).
        per_start = (reads_to_start(6) - reads_to_start(2)) / 4
    finally:
        for fd in spare:
            os.close(fd)
    # A start reads at most its few dozen new numbers; a listing reads 2,000.
    assert per_start < 100, per_start
