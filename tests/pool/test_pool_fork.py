"""os.fork() with a live pool or pipeline: the child is refused, the parent unaffected.

Each scenario runs in a fresh interpreter (a forked pytest process would run
pytest's own exit paths): it makes a pool, forks, lets the child do one thing,
and then proves that the parent's pool still works, workers and memory intact.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import shm_names

T = 60

pytestmark = pytest.mark.usefixtures("no_leaks")

_SCRIPT = """
import gc, os, signal, sys, time
import numpy as np
import mpexec
from mpexec import WorkerPool

def twice(a):
    return a * 2

def slow(seconds):
    time.sleep(seconds)
    return seconds

def child(scenario, pool, held, pending):
    # What the child does with what it inherited; its exit status says whether
    # each use was refused as it must be (3: not refused).
    if scenario == "exit":
        sys.exit(0)  # atexit hooks and finalizers run
    if scenario == "submit":
        try:
            pool.submit(twice, 1)
        except mpexec.ForkedPoolError as exc:
            assert "os.fork()" in str(exc) and str(os.getppid()) in str(exc), exc
        else:
            sys.exit(3)
        for use in (lambda: pool.map(twice, [1]), lambda: pool.put(np.ones(3)), pool.stats):
            try:
                use()
            except mpexec.ForkedPoolError:
                pass
            else:
                sys.exit(3)
        assert "fork" in repr(pool)
        # The public seam: refused the same way (the pid read, not asked: mpexec._pid),
        # and the status says why.
        for use in (
            lambda: pool.share(np.ones(3)),
            lambda: pool.submit_call(twice, (1,)),
            lambda: pool.run_call(twice, (1,)),
            lambda: pool.submit_hooked(twice, (1,), {}, None, print),
        ):
            try:
                use()
            except mpexec.ForkedPoolError:
                pass
            else:
                sys.exit(3)
        assert pool.status == mpexec.PoolStatus("forked", os.getppid()), pool.status
        sys.exit(0)
    if scenario == "shutdown":
        pool.shutdown()  # does nothing to the parent's workers
        pool.shutdown(wait=False, cancel_futures=True)
        sys.exit(0)
    if scenario == "result":
        try:
            pending.result(5)  # no manager here: refused, never a hang
        except mpexec.ForkedPoolError:
            sys.exit(0)
        sys.exit(3)
    if scenario == "drop":
        assert held.sum() == 2 * 4096
        del held, pool, pending
        gc.collect()  # the views' finalizers must not release the parent's memory
        sys.exit(0)
    if scenario == "gpu":
        # Inline CPU ops, but the GPU stage's thread (and device) are the parent's:
        # refused, not queued to a thread this process does not have.
        for _ in range(4):  # past the iterations prefetched before the fork
            try:
                PIPE.run()
            except mpexec.ForkedPoolError as exc:
                assert "pipeline" in str(exc), exc
                break
        else:
            sys.exit(3)
        PIPE.close()
        sys.exit(0)
    if scenario == "pipeline":
        for use in (PIPE.run, PIPE.reset, PIPE.stats):
            try:
                use()  # refused before any lock: a parent's thread may have held one
            except mpexec.ForkedPoolError as exc:
                assert "pipeline" in str(exc), exc
            else:
                sys.exit(3)
        PIPE.close()
        sys.exit(0)
    if scenario == "fresh":
        # What ForkedPoolError advises: a pool of the child's own, under the
        # default start method (forkserver: the parent's server is not our child).
        own = WorkerPool(1)
        assert own.submit(twice, 3).result(30) == 6
        own.shutdown()
        sys.exit(0)
    sys.exit(4)

if __name__ == "__main__":
    scenario = sys.argv[1]
    if scenario == "pipeline":
        from mpexec import fn
        @mpexec.pipeline_def(batch_size=2, num_workers=1, seed=1)
        def define():
            x = fn.external_source(source=lambda info: np.full(3, info.idx_in_epoch), batch=False)
            return fn.python_function(x, function=twice)
        PIPE = define()
        PIPE.build()
        PIPE.run()
        pool = PIPE._pool
    elif scenario == "gpu":
        from mpexec import _gpu, fn
        from mpexec.testing import SimCuPy
        SIM = _gpu.use_backend(SimCuPy(0))  # held: its exit would restore CuPy
        SIM.__enter__()
        @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=1)
        def define():
            x = fn.external_source(source=lambda info: np.full(3, info.idx_in_epoch), batch=False)
            return fn.python_function(x, function=twice, device="gpu")
        PIPE = define()
        PIPE.run()
        pool = PIPE._pool
    else:
        pool = WorkerPool(2)
    pids = list(pool.pids)
    big = np.ones(1 << 20)  # through the pool's arena (well above the inline limit)
    held = pool.submit(twice, np.ones(4096)).result(T := 30)
    pending = pool.submit(slow, 0.5)
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a child that hangs dies (and fails the test), never lingers
        child(scenario, pool, held, pending)  # always ends in SystemExit: a real exit
        os._exit(5)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child exit {os.waitstatus_to_exitcode(status)}"
    # The parent: same workers, alive; calls, arena arrays and held results fine.
    assert pending.result(T) == 0.5
    assert held.sum() == 2 * 4096
    assert pool.pids == pids, (pool.pids, pids)
    for _ in range(20):
        assert pool.submit(twice, big).result(T).sum() == 2 * big.size
    assert pool.submit(twice, pool.put(np.ones(10))).result(T).sum() == 20
    if scenario in ("pipeline", "gpu"):
        assert len(PIPE.run()[0]) == 2
        PIPE.close()
    else:
        pool.shutdown()
    print("ok", *pids)
"""


@pytest.mark.parametrize("backend", ["memfd", "posix"])
@pytest.mark.parametrize(
    "scenario", ["exit", "submit", "shutdown", "result", "drop", "pipeline", "gpu", "fresh"]
)
def test_forked_child_leaves_the_parents_pool_working(scenario: str, backend: str) -> None:
    before = shm_names()
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, scenario],
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
        env={**os.environ, "SHM_BACKEND": backend},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    assert shm_names() - before == set()


def test_the_process_id_kept_is_the_childs_after_a_fork() -> None:
    """``mpexec._pid.pid``, read where a call checks for a fork, follows ``os.fork()``,
    also in a child forked from a thread that is not the main one."""
    code = """
import os, sys, threading
from mpexec import _pid

def fork_and_check(results):
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os._exit(0 if _pid.pid == os.getpid() != parent else 3)
    _, status = os.waitpid(child, 0)
    results.append(os.waitstatus_to_exitcode(status))

results = []
fork_and_check(results)
thread = threading.Thread(target=fork_and_check, args=(results,))
thread.start()
thread.join(30)
assert _pid.pid == os.getpid(), "the parent's own id changed"
print(results)
sys.exit(0 if results == [0, 0] else 1)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=T, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
