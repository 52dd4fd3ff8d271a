"""The GPU stage's mechanics on the simulated device (no GPU needed).

Each test runs under several seeds of the simulator, including one whose
streams never progress on their own: work then runs only when something waits
for it, so a missing wait or an early reuse shows up as garbage (``0xA5``
bytes) or a recorded violation, whatever the interleaving.
"""

from __future__ import annotations

import ast
import ctypes
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import _gpu
from mpexec.testing import GARBAGE, SEEDS, SimCuPy


@pytest.fixture(params=SEEDS, ids=lambda p: f"seed{p[0]}-progress{p[1]}")
def sim(request: pytest.FixtureRequest) -> Iterator[SimCuPy]:
    seed, progress = request.param
    device = SimCuPy(seed, progress=progress)
    yield device
    assert device.violations == [], device.violations


@pytest.fixture
def arena() -> Iterator[shm.Arena]:
    a = shm.Arena(capacity=1 << 24, segment_size=1 << 22)
    yield a
    a.close()


def _block(arena: shm.Arena, rows: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """Samples that are rows of one arena block: contiguous, as a worker writes them."""
    block = arena.put(rows)
    return [block[i] for i in range(len(block))]


# ---------------------------------------------------------------- host -> device


def test_registered_segment_is_copied_in_place_one_copy_per_contiguous_run(
    sim: SimCuPy, arena: shm.Arena
) -> None:
    rows = np.arange(8 * 100, dtype=np.float32).reshape(8, 100)
    samples = _block(arena, rows)
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    (dev,) = stage.to_device([samples], op)
    with op:
        got = [(d * 2).get() for d in dev]
    np.testing.assert_array_equal(np.stack(got), rows * 2)
    stats = stage.stats()
    assert stats.h2d_copies == 1  # eight samples, one run, one cudaMemcpyAsync
    assert stats.h2d_registered_bytes == rows.nbytes
    assert stats.h2d_staged_bytes == 0
    assert stats.registered_segments == 1
    assert len(sim.registered) == 1
    stage.close()
    assert sim.registered == {}  # registration undone at close
    assert sim.pending() == 0


def test_each_segment_is_registered_once(sim: SimCuPy, arena: shm.Arena) -> None:
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    for i in range(5):
        rows = np.full((4, 16), i, np.int32)
        (dev,) = stage.to_device([_block(arena, rows)], op)
        with op:
            np.testing.assert_array_equal(dev[3].get(), rows[3])
    assert stage.stats().registered_segments == 1
    stage.close()
    assert sim.registered == {}


def test_non_contiguous_runs_are_separate_copies(sim: SimCuPy, arena: shm.Arena) -> None:
    a = arena.put(np.arange(10, dtype=np.int16))  # 64-byte aligned: not adjacent to b
    b = arena.put(np.arange(10, 20, dtype=np.int16))
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    (dev,) = stage.to_device([[a, b]], op)
    with op:
        np.testing.assert_array_equal((dev[0] + dev[1]).get(), np.arange(10) * 2 + 10)
    assert stage.stats().h2d_copies == 2
    stage.close()


@pytest.mark.parametrize("how", ["registration-fails", "registration-off", "not-shared"])
def test_staging_ring_is_the_fallback(how: str, arena: shm.Arena) -> None:
    for seed, progress in SEEDS:
        sim = SimCuPy(seed, progress=progress, register_fails=how == "registration-fails")
        stage = _gpu.GpuStage(sim, 0, register=how != "registration-off", staging_slots=2)
        op = stage.stream("op")
        rows = np.arange(6 * 7, dtype=np.float64).reshape(6, 7)
        outs = []
        for k in range(5):  # more batches than slots: slots are reused
            batch = rows + k
            samples = list(batch) if how == "not-shared" else _block(arena, batch)
            (dev,) = stage.to_device([samples], op)
            with op:
                outs.append(sim.stack(dev).get())
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(out, rows + k)
        stats = stage.stats()
        assert stats.h2d_registered_bytes == 0
        assert stats.h2d_staged_bytes == 5 * rows.nbytes
        assert stats.registration_failures == (1 if how == "registration-fails" else 0)
        stage.close()
        assert sim.violations == [], (seed, sim.violations)
        assert sim.registered == {}


def test_a_staging_slot_is_reused_only_after_its_copy_completed(sim: SimCuPy) -> None:
    """Two batches through one slot before anything waits: the second waits on the first."""
    stage = _gpu.GpuStage(sim, 0, staging_slots=1)
    op1, op2 = stage.stream("a"), stage.stream("b")
    first = [np.full(32, 1.0), np.full(32, 2.0)]
    second = [np.full(32, 7.0), np.full(32, 8.0)]
    (d1,) = stage.to_device([first], op1)
    (d2,) = stage.to_device([second], op2)
    with op2:
        np.testing.assert_array_equal(d2[1].get(), second[1])
    with op1:
        np.testing.assert_array_equal(d1[0].get(), first[0])
    stage.close()


def test_host_memory_is_released_only_after_the_copy_event(sim: SimCuPy, arena: shm.Arena) -> None:
    """The release callback may recycle the bytes at once (here: it overwrites them)."""
    rows = np.arange(4 * 64, dtype=np.uint16).reshape(4, 64)
    samples = _block(arena, rows)
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    released: list[bool] = []

    def recycle() -> None:  # what an arena does with a released slot: the next batch's bytes
        ctypes.memset(samples[0].__array_interface__["data"][0], 0xFF, rows.nbytes)
        released.append(True)

    (dev,) = stage.to_device([samples], op, on_release=recycle)
    stage.reap()  # releases only what completed; the copy may not have run yet
    with op:
        got = sim.stack(dev).get()
    np.testing.assert_array_equal(got, rows)
    stage.close()
    assert released == [True]


def test_a_kernel_on_a_stream_that_did_not_wait_reads_garbage() -> None:
    """The simulator itself: without the wait, device memory is still garbage."""
    sim = SimCuPy(0, progress=0.0)
    stream = sim.cuda.Stream(non_blocking=True)
    copy = sim.cuda.Stream(non_blocking=True)
    host = _gpu.pinned_array(sim, 16)
    host[:] = 3
    dev = sim.empty(16, np.uint8)
    rt = sim.cuda.runtime
    rt.memcpyAsync(dev.data.ptr, host.ctypes.data, 16, rt.memcpyHostToDevice, copy.ptr)
    with stream:
        assert (dev.get() == GARBAGE).all()
    stream.wait_event(copy.record())
    with stream:
        assert (dev.get() == 3).all()


def test_the_simulator_poisons_a_copy_whose_source_changed_or_was_unregistered() -> None:
    sim = SimCuPy(0, progress=0.0)
    copy = sim.cuda.Stream(non_blocking=True)
    rt = sim.cuda.runtime
    host = _gpu.pinned_array(sim, 8)
    host[:] = 1
    dev = sim.empty(8, np.uint8)
    rt.memcpyAsync(dev.data.ptr, host.ctypes.data, 8, rt.memcpyHostToDevice, copy.ptr)
    host[:] = 2  # changed before the copy ran
    copy.synchronize()
    assert (dev.get() == GARBAGE).all()
    assert "changed" in sim.violations[0]

    buf = np.zeros(4096, np.uint8)
    rt.hostRegister(buf.ctypes.data, buf.nbytes, 0)
    rt.memcpyAsync(dev.data.ptr, buf.ctypes.data, 8, rt.memcpyHostToDevice, copy.ptr)
    rt.hostUnregister(buf.ctypes.data)
    copy.synchronize()
    assert "unregistered" in sim.violations[1]
    with pytest.raises(rt.CUDARuntimeError):
        rt.hostUnregister(buf.ctypes.data)


# ---------------------------------------------------------------- device -> host


def test_device_to_host_lands_in_pinned_memory_before_anyone_reads_it(sim: SimCuPy) -> None:
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    (dev,) = stage.to_device([[np.arange(12, dtype=np.int32).reshape(3, 4)]], op)
    with op:
        out = [dev[0] * 3, (dev[0] + 1)[1:]]  # one sample a view (not contiguous from 0)
    (host,) = stage.to_host([out], op)
    np.testing.assert_array_equal(host[0], np.arange(12).reshape(3, 4) * 3)
    np.testing.assert_array_equal(host[1], np.arange(12).reshape(3, 4)[1:] + 1)
    assert not host[0].flags.writeable
    assert stage.stats().d2h_bytes == 48 + 32
    stage.close()


# ---------------------------------------------------------------- lifetimes


def test_close_waits_releases_unregisters_and_is_idempotent(sim: SimCuPy, arena: shm.Arena) -> None:
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    released = []
    stage.to_device([_block(arena, np.ones((2, 8)))], op, on_release=lambda: released.append(1))
    stage.close()
    stage.close()
    assert released == [1]
    assert sim.registered == {}
    assert stage.stats().pending_releases == 0
    with pytest.raises(mpexec.GpuError, match="closed"):
        stage.to_device([[np.ones(3)]], op)


def test_pinned_memory_is_freed_when_the_stage_is_gone(arena: shm.Arena) -> None:
    sim = SimCuPy(0)
    stage = _gpu.GpuStage(sim, 0, register=False, staging_slots=2)
    op = stage.stream("op")
    for _ in range(20):
        (dev,) = stage.to_device([[np.ones(100)]], op)
        with op:
            (stage.to_host([[dev[0] + 1]], op))
    assert sim.pinned_live == 2  # the staging ring's slots; D2H buffers are not kept
    stage.close()
    del stage, dev
    assert sim.pinned_live == 0


# ---------------------------------------------------------------- the names used


def _names_used_in(path: pathlib.Path) -> set[str]:
    """``xp.a.b`` / ``self.xp.a.b`` / ``rt.x`` attribute paths in a module's source."""
    source = path.read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):  # inner nodes give prefixes, which are fine
            chain = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            chain.reverse()
            if isinstance(cur, ast.Name) and cur.id == "xp":
                names.add(".".join(chain))
            elif isinstance(cur, ast.Name) and cur.id == "rt":
                names.add("cuda.runtime." + ".".join(chain))
            elif (
                isinstance(cur, ast.Name) and cur.id == "self" and chain[:1] == ["xp"] and chain[1:]
            ):
                names.add(".".join(chain[1:]))
    return names


def test_cupy_names_lists_every_name_the_gpu_module_uses() -> None:
    # The stage and runners in _gpu, the GPU executor in _executors.
    used = _names_used_in(pathlib.Path(_gpu.__file__))
    used |= _names_used_in(pathlib.Path(_gpu.__file__).with_name("_executors.py"))
    listed = set(_gpu.CUPY_NAMES)
    # A longer chain (xp.cuda.runtime.memcpyAsync) implies its prefixes are used too.
    prefixes = {".".join(n.split(".")[:k]) for n in listed for k in range(1, n.count(".") + 1)}
    missing = {n for n in used if n not in listed and n not in prefixes}
    assert not missing, f"add to _gpu.CUPY_NAMES: {sorted(missing)}"
    assert re.search(r"\bimport cupy\b", pathlib.Path(_gpu.__file__).read_text())


def test_the_simulator_has_every_name_the_gpu_module_uses() -> None:
    sim = SimCuPy(0)
    for name in _gpu.CUPY_NAMES:
        obj: Any = sim
        for part in name.split("."):
            assert hasattr(obj, part), f"the simulator lacks {name}"
            obj = getattr(obj, part)


def test_device_to_host_into_shared_memory_page_locks_it_in_place(
    sim: SimCuPy, arena: shm.Arena
) -> None:
    """A pool's arena as the destination: CPU ops in workers then read it with no copy."""
    stage = _gpu.GpuStage(sim, 0)
    op = stage.stream("op")
    (dev,) = stage.to_device([[np.arange(6.0), np.arange(6.0, 12.0)]], op)
    with op:
        out = [d * d for d in dev]
    (host,) = stage.to_host([out], op, alloc=lambda n: arena.empty(n, np.uint8))
    np.testing.assert_array_equal(np.concatenate(host), np.arange(12.0) ** 2)
    assert all(shm.in_shared_memory(h) for h in host)
    assert stage.stats().registered_segments == 1
    stage.close()
    assert sim.registered == {}


def test_device_memory_stays_findable_while_another_thread_frees() -> None:
    """A free (a finalizer, on any thread) never loses another thread's new allocation.

    The simulator once rebuilt its list of allocations in the free's finalizer: an
    allocation appended meanwhile by another thread was dropped, and a later copy from
    it failed with a simulated CUDA error (seen once in CI, in a GPU pipeline's test).
    """
    import threading
    import time

    device = SimCuPy(0)
    kept = [device.empty(64, np.uint8) for _ in range(2000)]  # a long list: a wide window
    deadline = time.monotonic() + 1.5
    done = threading.Event()

    def churn() -> None:
        while not done.is_set() and time.monotonic() < deadline:
            device.empty(64, np.uint8)  # dropped at once: its finalizer runs here

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        while time.monotonic() < deadline:
            kept.append(device.empty(64, np.uint8))
    finally:
        done.set()
        thread.join(10)
    assert not thread.is_alive()
    lost = 0
    for arr in kept:
        try:
            device._device_at(arr.data.ptr, 64)  # the simulator's own lookup
        except Exception:
            lost += 1
    assert lost == 0, f"{lost} of {len(kept)} live allocations no longer found"
