"""RayPool on a local Ray instance and on a simulated two-node cluster.

Each Ray set-up starts once per module (Ray takes seconds to start) and is
torn down, with a check that it left no process behind, before the next.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import threading
import traceback
import weakref
from collections.abc import Iterator
from concurrent.futures import BrokenExecutor
from typing import Any

import numpy as np
import psutil
import pytest

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

import mpexec  # noqa: E402
from mpexec import (  # noqa: E402
    NodeLostError,
    PoolClosedError,
    RemoteTraceback,
    WorkerPool,
    fn,
)
from mpexec.ray import RayPool  # noqa: E402
from tests.conftest import _children, run_python, wait_until  # noqa: E402
from tests.pipeline.test_determinism import assert_identical, make, run_two_epochs  # noqa: E402

T = 60  # every .result() here is bounded by this
START = 300  # but a pool's first calls, which wait for Ray and the agents to be up
STORE = 100 << 20  # each node's object store: small, the machine is shared


# ---------------------------------------------------------------- functions run remotely
def _square(x: Any) -> Any:
    return x * x


def _add(a: int, b: int = 0, *, c: int = 0) -> int:
    return a + b + c


def _checksum(a: np.ndarray[Any, Any]) -> tuple[float, bool, tuple[int, ...]]:
    return float(a.sum()), a.flags.writeable, a.shape


def _noisy(seed: int, n: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal(n)


def _fail(x: int) -> int:
    raise KeyError(f"no key {x}")


def _slow_square(x: int) -> int:
    import time

    end = time.monotonic() + 0.02
    while time.monotonic() < end:
        pass
    return x * x


class _Payload:
    """An argument whose life a weak reference can watch."""

    def __init__(self) -> None:
        self.data = bytearray(1 << 20)


class _Unpicklable(Exception):
    def __init__(self, lock: Any) -> None:
        super().__init__("has a lock")
        self.lock = lock


def _raise_unpicklable() -> None:
    raise _Unpicklable(threading.Lock())


# ---------------------------------------------------------------- Ray set-ups


@pytest.fixture(scope="module", params=["local", "two_nodes"])
def ray_setup(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A running Ray: one local node of 2 CPUs, or a head and a worker node of 1 CPU each."""
    if ray.is_initialized():  # pragma: no cover - a test left it running
        ray.shutdown()
    cluster = None
    # Ray's workers import the functions' module, this one, as any Ray task would.
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(os.path.dirname(here))])
    job = {"log_to_driver": False, "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
    if request.param == "local":
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, object_store_memory=STORE, **job
        )
    else:
        cluster = cluster_utils.Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "object_store_memory": STORE,
                "include_dashboard": False,
            },
        )
        cluster.add_node(num_cpus=1, object_store_memory=STORE)
        ray.init(address=cluster.address, **job)
        cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        wait_until(lambda: not _children(), 60, "Ray's processes to exit")


@pytest.fixture(scope="module")
def pool(ray_setup: Any) -> Iterator[RayPool]:
    """One pool for the tests that leave it usable (agents take seconds to start)."""
    with RayPool() as p:
        # Warmed first, under a bound of its own: on a loaded host (CI runs two
        # suites at once on 2 cores) Ray's processes and the agents' workers can
        # take over a minute to come up, which is not what these tests time.
        warm = [p.submit(_square, i) for i in range(2 * p.num_workers)]
        assert [f.result(START) for f in warm] == [i * i for i in range(len(warm))]
        yield p
    assert_gone(p)


@pytest.fixture(scope="module")
def local_pool() -> Iterator[WorkerPool]:
    with WorkerPool(2) as p:
        yield p


def assert_gone(p: RayPool, processes: list[tuple[int, list[int]]] | None = None) -> None:
    """No actor of ``p`` is registered, and none of its agents' processes lives."""
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not {n for n in names if n.startswith(f"mpexec-agent-{p._token}")}
    for agent_pid, worker_pids in processes or ():
        for pid in (agent_pid, *worker_pids):
            wait_until(lambda pid=pid: not _alive(pid), 30, f"process {pid} to exit")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- parity with the local pool
def test_one_agent_per_node(pool: RayPool, ray_setup: Any) -> None:
    expected = 1 if ray_setup is None else 2
    assert len(pool.nodes) == expected
    assert len(set(pool.nodes)) == expected
    assert pool.num_workers == 2
    assert "running" in repr(pool)


def test_submit_parity(pool: RayPool, local_pool: WorkerPool) -> None:
    a = np.arange(300_000, dtype=np.float32).reshape(300, 1000)  # out of band, > 100 KiB
    for func, args, kwargs in [
        (_square, (7,), {}),
        (_add, (1, 2), {"c": 3}),
        (_square, (a,), {}),
        (_checksum, (a,), {}),
        (_noisy, (5, 1000), {}),
    ]:
        here = local_pool.submit(func, *args, **kwargs).result(T)
        there = pool.submit(func, *args, **kwargs).result(T)
        if isinstance(here, np.ndarray):
            assert there.dtype == here.dtype
            np.testing.assert_array_equal(there, here)
            assert there.flags.writeable  # the caller's own, as WorkerPool promises
        else:
            assert there == here


@pytest.mark.parametrize("chunksize", [1, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_map_parity(pool: RayPool, local_pool: WorkerPool, chunksize: int, ordered: bool) -> None:
    items = list(range(24))
    expected = list(local_pool.map(_slow_square, items, chunksize=chunksize))
    got = list(pool.map(_slow_square, items, chunksize=chunksize, ordered=ordered, timeout=T))
    assert got == expected if ordered else sorted(got) == sorted(expected)


_seen: list[int] = []  # per worker process: the calls it ran, in order


def _record(n: int) -> tuple[int, list[int]]:
    _seen.append(n)
    return os.getpid(), list(_seen)


def test_the_low_level_seam_as_on_worker_pool(pool: RayPool) -> None:
    # submit_call: pinned calls run in order on one worker of one agent.
    futures = [pool.submit_call(_record, (n,), worker=0) for n in range(100, 110)]
    results = [f.result(T) for f in futures]
    assert len({pid for pid, _ in results}) == 1
    assert results[-1][1][-10:] == list(range(100, 110))
    assert pool.submit_call(_add, (1, 2), {"c": 3}).result(T) == 6
    # view=True: Ray's read-only array, uncopied; by default the caller's own.
    a = np.arange(300_000, dtype=np.float32)
    assert not pool.submit_call(_square, (a,), view=True).result(T).flags.writeable
    assert pool.submit_call(_square, (a,)).result(T).flags.writeable
    # share: a read-only copy the calls take.
    shared = pool.share(a)
    assert not shared.flags.writeable
    assert pool.submit(np.sum, shared).result(T) == a.sum()
    assert pool.status == mpexec.PoolStatus("running", os.getpid())
    with pytest.raises(ValueError, match="results must be 'copy' or 'view'"):
        RayPool(results="mine")  # type: ignore[arg-type]


def test_map_prefetch_is_bounded(pool: RayPool) -> None:
    pulled = 0

    def items() -> Iterator[int]:
        nonlocal pulled
        for i in range(100):
            pulled += 1
            yield i

    it = pool.map(_square, items(), prefetch=3, timeout=T)
    assert next(it) == 0
    assert pulled <= 4
    assert list(it) == [i * i for i in range(1, 100)]


def test_user_error_keeps_type_and_remote_traceback(pool: RayPool) -> None:
    with pytest.raises(KeyError, match="no key 3") as info:
        pool.submit(_fail, 3).result(T)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "_fail" in cause.tb
    assert "_worker.py" not in cause.tb  # mpexec's frames hidden, and said so
    assert "frames of mpexec hidden" in cause.tb
    with pytest.raises(KeyError) as mapped:
        list(pool.map(_fail, [1, 2], timeout=T))
    # Raised by map() itself, not from concurrent.futures' Future.result().
    frames = [f.filename for f in traceback.extract_tb(mapped.value.__traceback__)]
    assert not [f for f in frames if f"concurrent{os.sep}futures" in f], frames
    assert pool.submit(_square, 4).result(T) == 16  # the pool is still fine


def test_unpicklable_exception_comes_back_typed(pool: RayPool) -> None:
    with pytest.raises(mpexec.SerializationError, match="_Unpicklable"):
        pool.submit(_raise_unpicklable).result(T)


def test_unpicklable_argument_fails_in_the_caller(pool: RayPool) -> None:
    with pytest.raises(mpexec.SerializationError, match="lock"):
        pool.submit(_square, threading.Lock())
    with pytest.raises(TypeError, match="callable"):
        pool.submit(3)  # type: ignore[arg-type]


def test_closed_pool_refuses_work(ray_setup: Any) -> None:
    p = RayPool()
    p.shutdown()
    p.shutdown()  # idempotent
    with pytest.raises(PoolClosedError):
        p.submit(_square, 1)
    assert "closed" in repr(p)
    assert_gone(p)


def test_workers_per_node_and_bad_arguments(ray_setup: Any) -> None:
    with pytest.raises(ValueError, match="workers_per_node"):
        RayPool(workers_per_node=0)
    with pytest.raises(TypeError, match="num_workers"):
        RayPool(num_workers=2)
    with RayPool(workers_per_node=1) as p:
        assert p.num_workers == len(p.nodes)
        assert list(p.map(_square, range(5), timeout=T)) == [0, 1, 4, 9, 16]


def _fork_server_dirs(processes: list[tuple[int, list[int]]]) -> set[str]:
    """The directories of the agents' fork-server sockets: multiprocessing's temp dirs."""
    dirs = set()
    for agent_pid, _ in processes:
        for child in psutil.Process(agent_pid).children():
            with contextlib.suppress(psutil.Error):
                for conn in child.net_connections(kind="unix"):
                    if os.path.basename(conn.laddr).startswith("listener-"):
                        dirs.add(os.path.dirname(conn.laddr))
    return dirs


def test_close_leaves_no_actor_process_or_temp_dir(ray_setup: Any) -> None:
    """Agents exit through their exit handlers: ray.kill alone left one /tmp/pymp-* each."""
    p = RayPool()
    processes = p._agent_processes()
    assert len(processes) == len(p.nodes)
    dirs = _fork_server_dirs(processes)
    assert len(dirs) == len(processes), dirs  # one fork server each (all nodes are here)
    futures = [p.submit(_slow_square, i) for i in range(8)]
    p.shutdown(wait=True)
    assert [f.result(0) for f in futures] == [i * i for i in range(8)]
    assert_gone(p, processes)
    wait_until(lambda: not any(map(os.path.exists, dirs)), 30, f"{sorted(dirs)} to go")


def test_shutdown_without_wait_fails_queued_calls(ray_setup: Any) -> None:
    p = RayPool()
    processes = p._agent_processes()
    futures = [p.submit(_slow_square, i) for i in range(40)]
    p.shutdown(wait=False)
    for f in futures:
        with contextlib.suppress(PoolClosedError):
            f.result(T)  # each settles: done before the stop, or failed by it
    assert_gone(p, processes)


# ---------------------------------------------------------------- faults
def test_killed_agent_calls_run_again_on_the_others(ray_setup: Any) -> None:
    """Two nodes: the same results from the survivor. One node: a typed error, no hang."""
    with RayPool() as p:
        processes = p._agent_processes()
        n_nodes = len(p.nodes)
        victim = p.agent_names()[-1]
        items = list(range(60))
        results = []

        def run() -> None:
            # Chunks of 5 calls (0.1 s), as the automatic ones were before map's grew to
            # 0.4 s of CPU: with those, the victim could be done with every call it had
            # before the kill, and the pool had nothing of it to lose or notice.
            for i, r in enumerate(p.map(_slow_square, items, timeout=T, chunksize=5)):
                results.append(r)
                if i == 5:
                    ray.kill(ray.get_actor(victim, namespace="mpexec"), no_restart=True)

        if n_nodes == 1:
            with pytest.raises(NodeLostError):
                run()
        else:
            run()
            assert results == [i * i for i in items]
            assert len(p.nodes) == n_nodes - 1
        assert len(p.lost_nodes) == 1
        assert "lost=1" in repr(p)
    assert_gone(p, processes)


def test_no_agent_left_is_a_typed_error(ray_setup: Any) -> None:
    p = RayPool()
    processes = p._agent_processes()
    futures = [p.submit(_slow_square, i) for i in range(10)]
    for name in p.agent_names():
        ray.kill(ray.get_actor(name, namespace="mpexec"), no_restart=True)
    errors = []
    for f in futures:
        try:
            f.result(T)
        except NodeLostError as exc:
            errors.append(exc)
    assert errors  # some calls were in flight or queued when the last agent went
    assert isinstance(errors[0], BrokenExecutor)
    assert "every agent" in str(errors[0])
    assert len(errors[0].nodes) == len(processes)
    with pytest.raises(NodeLostError):
        p.submit(_square, 1)
    restored = pickle.loads(pickle.dumps(errors[0]))
    assert restored.nodes == errors[0].nodes
    p.shutdown()
    assert_gone(p, processes)


def test_a_broken_pool_raises_a_new_error_per_call_and_keeps_no_caller_alive(
    ray_setup: Any,
) -> None:
    """As WorkerPool (tests/pool/test_pool_faults.py): each later submit raises a new
    NodeLostError, the stored one its ``__cause__``, and keeps none of its frames. The
    calls that failed when it broke got copies too: raising them (as each caller's
    ``result()`` does) never adds a frame to the stored error."""
    p = RayPool()
    processes = p._agent_processes()
    # More calls than the agents take at once (2 a worker): some wait in the pool.
    futures = [p.submit(_slow_square, i) for i in range(2 * p.num_workers + 4)]
    for name in p.agent_names():
        ray.kill(ray.get_actor(name, namespace="mpexec"), no_restart=True)
    failed = [f for f in futures if f.exception(T) is not None]
    assert len(failed) >= 4
    for f in failed:
        with pytest.raises(NodeLostError):
            f.result(T)
    assert p.status.state == "broken"

    def failed_call() -> tuple[BaseException | None, int, weakref.ref[_Payload]]:
        payload = _Payload()
        with pytest.raises(NodeLostError) as info:
            p.submit(_square, payload)
        exc, stored = info.value, info.value.__cause__
        assert isinstance(stored, NodeLostError)
        assert exc is not stored
        assert type(exc) is type(stored)
        assert str(exc) == str(stored)
        assert exc.nodes == stored.nodes
        return stored, len(traceback.extract_tb(exc.__traceback__)), weakref.ref(payload)

    causes, depths = set(), set()
    for _ in range(5):
        stored, depth, payload = failed_call()
        gc.collect()
        # Raising the stored error itself would chain each caller's frame (and
        # its arguments) onto its traceback, for as long as the pool lives.
        assert payload() is None, "a failed call's frame is kept alive"
        causes.add(id(stored))
        depths.add(depth)
    assert len(causes) == 1, "each later call's cause is the error that broke the pool"
    assert len(depths) == 1, "the traceback grows with every failed call"
    # Raised by nobody: it holds no caller's frame (nor, through them, their arguments).
    assert stored.__traceback__ is None, "a failed call's result() raised the stored error"
    errors = [f.exception(0) for f in failed]
    assert all(e is not stored and e.__cause__ is stored for e in errors)
    assert len({id(e) for e in errors}) == len(errors), "one error object for many callers"
    p.shutdown()
    assert_gone(p, processes)


def test_callbacks_of_failed_calls_run_outside_the_pools_lock(ray_setup: Any) -> None:
    """A future's callback that waits for a lock held by a thread that is submitting
    (a pipeline's scheduler does that) must not deadlock when the last agent dies."""
    if ray_setup is not None:
        pytest.skip("needs the one-node set-up: its only agent dies")
    scheduler_lock = threading.Lock()
    in_callback = threading.Event()

    def callback(_: Any) -> None:
        in_callback.set()
        with scheduler_lock:
            pass

    p = RayPool()
    processes = p._agent_processes()
    future = p.submit(_slow_square, 1)
    future.add_done_callback(callback)
    submitted = threading.Event()

    def submit_more() -> None:
        with contextlib.suppress(NodeLostError):
            p.submit(_square, 2)
        submitted.set()

    with scheduler_lock:
        ray.kill(ray.get_actor(p.agent_names()[0], namespace="mpexec"), no_restart=True)
        assert in_callback.wait(T), "the call never failed"
        threading.Thread(target=submit_more, daemon=True).start()
        # Before the fix the pool's manager ran the callback under the pool's lock:
        # submit() waited for that lock, the callback for ours, forever.
        assert submitted.wait(T), "submit() is stuck behind a callback holding the pool's lock"
    with pytest.raises(NodeLostError):
        future.result(T)
    p.shutdown()
    assert_gone(p, processes)


def test_joins_running_ray_and_leaves_it_running(ray_setup: Any) -> None:
    with RayPool() as p:
        assert p.submit(os.getpid).result(T) != os.getpid()
        assert p.address == ray.get_runtime_context().gcs_address
        assert f"address={p.address}" in repr(p)
    assert ray.is_initialized()


def test_an_address_other_than_the_connected_ray_is_an_error(ray_setup: Any) -> None:
    here = ray.get_runtime_context().gcs_address
    for address in ("local", "127.0.0.1:1"):
        with pytest.raises(ValueError, match="already connected to the Ray at"):
            RayPool(address=address)
    with RayPool(address=here, watch_interval=None) as p:  # the same Ray: fine
        assert p.address == here
    with pytest.raises(ValueError, match="watch_interval"):
        RayPool(watch_interval=0)


def test_stats_count_calls_and_nodes(pool: RayPool) -> None:
    before = pool.stats()
    # One call a chunk: automatic chunks would count as fewer calls (a chunk is one).
    assert list(pool.map(_square, range(6), timeout=T, chunksize=1)) == [i * i for i in range(6)]
    with pytest.raises(KeyError):
        pool.submit(_fail, 1).result(T)
    after = pool.stats()
    assert after.submitted - before.submitted == 7
    assert after.completed - before.completed == 6
    assert after.failed - before.failed == 1
    assert (after.nodes, after.workers) == (len(pool.nodes), pool.num_workers)
    assert after.lost_nodes == ()
    assert after.in_flight == after.pending == 0


def test_a_node_that_joins_gets_an_agent(ray_setup: Any) -> None:
    """Elastic growth: the pool starts an agent on a node added while it runs."""
    if ray_setup is None:
        pytest.skip("the local set-up has one node and cannot add one")
    with RayPool(workers_per_node=1, watch_interval=0.2) as p:
        assert p.stats().nodes == 2
        node = ray_setup.add_node(num_cpus=1, object_store_memory=STORE)
        try:
            wait_until(lambda: p.stats().nodes == 3, 90, "an agent on the new node")
            assert node.node_id in p.nodes
            assert (p.num_workers, p.stats().joined_nodes) == (3, 1)
            assert list(p.map(_slow_square, range(30), timeout=T)) == [i * i for i in range(30)]
            ray_setup.remove_node(node)
            node = None
            wait_until(lambda: p.stats().nodes == 2, 90, "the removed node to count as lost")
            stats = p.stats()
            assert (stats.workers, len(stats.lost_nodes)) == (2, 1)
            assert "nodes=2 workers=2" in repr(p)
            assert list(p.map(_square, range(10), timeout=T)) == [i * i for i in range(10)]
        finally:
            if node is not None:
                ray_setup.remove_node(node)
    assert_gone(p)


# ---------------------------------------------------------------- pipelines on a RayPool
class _Counter:
    """A stateful op: its count is right only if its calls run in order, on one worker."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        self.n += 1
        return np.array([self.n, int(x[0])], dtype=np.int64)


def _index(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= 48:
        raise StopIteration
    return np.array([info.idx_in_epoch], dtype=np.int64)


def _slow_noise(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    import time

    end = time.monotonic() + 0.01
    while time.monotonic() < end:
        pass
    return rng.standard_normal(1000).astype(np.float32) * 2 + x[0]  # 4 KB out


def make_slow(pool: Any = None, num_workers: int | None = None) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=8, seed=7, prefetch_depth=2, num_workers=num_workers)
    def graph() -> Any:
        src = fn.external_source(source=_index, batch=False)
        noisy = fn.python_function(src, function=_slow_noise)
        count = fn.python_function(noisy, function=_Counter(), stateful=True)
        return noisy, count

    return graph(pool=pool)


def run_epoch(pipe: mpexec.Pipeline, on_iteration: Any = None) -> list[list[bytes]]:
    out = []
    with pipe:
        for i, outs in enumerate(pipe):
            out.append([a.tobytes() for b in outs for a in b])
            if on_iteration is not None:
                on_iteration(i)
    return out


@pytest.fixture(scope="module")
def determinism_reference() -> Any:
    return run_two_epochs(make(0))


@pytest.fixture(scope="module")
def slow_reference() -> list[list[bytes]]:
    return run_epoch(make_slow(num_workers=0))


def test_pipeline_parity(pool: RayPool, determinism_reference: Any) -> None:
    """Every kind of randomness, two epochs: bit-identical to the inline run."""
    for prefetch_depth in (1, 3):
        pipe = make(None, prefetch_depth, pool=pool)
        assert pipe.num_workers == pool.num_workers
        got = run_two_epochs(pipe)
        assert_identical(got, determinism_reference, f"RayPool, prefetch {prefetch_depth}")
    assert pool.submit(_square, 3).result(T) == 9  # the pipeline left the pool running


def test_pipeline_stateful_parity(pool: RayPool, slow_reference: list[list[bytes]]) -> None:
    assert run_epoch(make_slow(pool)) == slow_reference


def test_pipeline_agent_killed_mid_epoch(ray_setup: Any, slow_reference: list[list[bytes]]) -> None:
    """Two nodes: the lost node's chunks run again, same outputs. One: a typed error."""
    with RayPool() as p:
        processes = p._agent_processes()
        n_nodes = len(p.nodes)
        # The stateful op lives on the first agent: kill another one (or the only one).
        victim = p.agent_names()[-1]

        def kill(i: int) -> None:
            if i == 1:
                ray.kill(ray.get_actor(victim, namespace="mpexec"), no_restart=True)

        if n_nodes == 1:
            with pytest.raises(NodeLostError, match="every agent"):
                run_epoch(make_slow(p), kill)
        else:
            assert run_epoch(make_slow(p), kill) == slow_reference
            assert len(p.nodes) == n_nodes - 1
        assert len(p.lost_nodes) == 1
    assert_gone(p, processes)


def test_node_removed_mid_run(ray_setup: Any) -> None:
    """A whole node goes (raylet, object store, agent): its calls run on the others."""
    if ray_setup is None:
        pytest.skip("the local set-up has one node and cannot add one")
    node = ray_setup.add_node(num_cpus=1, object_store_memory=STORE)
    ray_setup.wait_for_nodes()
    try:
        with RayPool() as p:
            assert node.node_id in p.nodes
            items = list(range(60))
            results = []
            # (Chunks of 5: see test_killed_agent_calls_run_again_on_the_others.)
            for i, r in enumerate(p.map(_slow_square, items, timeout=T, chunksize=5)):
                results.append(r)
                if i == 5:
                    ray_setup.remove_node(node)
                    node = None
            assert results == [i * i for i in items]
            wait_until(lambda: len(p.lost_nodes) == 1, 60, "the lost node to be noticed")
            assert p.lost_nodes[0] not in p.nodes
        assert_gone(p)
    finally:
        if node is not None:
            ray_setup.remove_node(node)


@pytest.mark.parametrize("mode", ["map", "in_flight"])
def test_ray_shutdown_under_a_running_pool_fails_its_calls(mode: str) -> None:
    """``ray.shutdown()`` (another library's atexit) while a pool runs: nothing hangs.

    A running map or calls in flight, a new submit: NodeLostError; the pool's
    own shutdown returns (and leaves alone a Ray started since). Each step
    counts as hung after 60 s (the driver, tests/adapters/_ray_shutdown_driver.py,
    runs a Ray of its own).
    """
    out = run_python("-m", "tests.adapters._ray_shutdown_driver", mode, timeout=400)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["running"] == "NodeLostError", report
    assert report["submit"] == "NodeLostError", report
    assert report["shutdown"] == "returned", report
    assert report["status"] == "broken", report
    # in_flight: a Ray started after the shutdown is not the pool's to stop
    assert report["ray_after"] is (mode == "in_flight"), report
