"""The suite's own leak check (tests/conftest.py): whose named segments it counts.

Pids wrap within one run of the suite (32768 on many hosts), so a pid this test
process started long ago can belong to another xdist worker's or tox env's
process by the time a test ends; that process's segments are not this test's.
"""

from __future__ import annotations

import os
import subprocess

import psutil

from tests import conftest


def _segment_of(pid: int) -> str:
    name = f"mpx-leakcheck-{pid}-{os.urandom(4).hex()}"
    with open(f"/dev/shm/{name}", "wb"):
        pass
    return name


def test_a_segment_of_a_reused_pid_is_not_counted_as_ours() -> None:
    # Another process (not ours: started by a shell that exits at once), under a
    # pid recorded as ours with another start time, as after a wrap.
    out = subprocess.run(
        ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    pid = int(out.stdout)
    other = psutil.Process(pid)
    assert other.pid not in {c.pid for c in psutil.Process().children(recursive=True)}
    name = _segment_of(pid)
    saved = conftest._STARTED.get(pid, "absent")
    try:
        conftest._STARTED[pid] = other.create_time() - 100.0  # ours, once, long ago
        assert name not in conftest.shm_names()
        conftest._STARTED[pid] = other.create_time()  # the same process: ours
        assert name in conftest.shm_names()
    finally:
        if saved == "absent":
            del conftest._STARTED[pid]
        else:
            conftest._STARTED[pid] = saved  # type: ignore[assignment]
        os.unlink(f"/dev/shm/{name}")
        other.kill()
        other.wait(30)


def test_a_segment_of_a_process_we_started_and_that_is_gone_is_counted() -> None:
    # A child killed before it unlinked its segment: the leak the check is for.
    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=_sleep)
    child.start()
    name = _segment_of(child.pid or 0)
    try:
        child.kill()
        child.join(30)
        assert name in conftest.shm_names()
    finally:
        os.unlink(f"/dev/shm/{name}")


def _sleep() -> None:
    import time

    time.sleep(30)
