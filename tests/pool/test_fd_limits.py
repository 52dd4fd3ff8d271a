"""Open-file limits: a pool fits under RLIMIT_NOFILE or says at once that it cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpexec import WorkerPool
from mpexec._host import FDS_PER_WORKER

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
