"""The GPU stage on a real GPU: ``pytest -m gpu`` (skipped without CuPy, a driver and a device).

The bodies are those the simulated device runs in test_gpu_pipeline and
test_gpu_stage; here they run on CUDA itself: outputs equal the CPU pipeline's
bit for bit, 1,000 iterations leak no device or pinned memory, and close
undoes every host registration.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from test_gpu_pipeline import check_no_leak, check_parity

import shm
from mpexec import _gpu

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cupy() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cp = pytest.importorskip("cupy")
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver
        pytest.skip(f"no usable CUDA driver ({type(exc).__name__}: {exc})")
    if count == 0:
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.parametrize("num_workers", [2, 0])
def test_gpu_pipeline_equals_cpu_pipeline_bit_for_bit(cupy: Any, num_workers: int) -> None:
    check_parity(5, num_workers=num_workers, prefetch=3)


def test_a_thousand_iterations_leak_no_device_or_pinned_memory(cupy: Any) -> None:
    pool = cupy.get_default_memory_pool()
    check_no_leak(pool.used_bytes, _gpu.pinned_live, 1000)


def test_registered_arena_copy_and_unregistration(cupy: Any) -> None:
    arena = shm.Arena(capacity=1 << 26, segment_size=1 << 24)
    try:
        rows = np.arange(16 * 4096, dtype=np.float32).reshape(16, 4096)
        block = arena.put(rows)
        stage = _gpu.GpuStage(cupy, 0)
        op = stage.stream("op")
        (dev,) = stage.to_device([[block[i] for i in range(16)]], op)
        with op:
            out = [d * 2 for d in dev]
        (host,) = stage.to_host([out], op)
        np.testing.assert_array_equal(np.stack(host), rows * 2)
        assert stage.stats().h2d_copies == 1
        (address, size), *_ = stage.registered()
        stage.close()
        assert stage.registered() == []
        # Registration was undone: the same range registers again.
        cupy.cuda.runtime.hostRegister(address, size, 0)
        cupy.cuda.runtime.hostUnregister(address)
    finally:
        arena.close()


def test_staging_fallback_on_the_device(cupy: Any) -> None:
    stage = _gpu.GpuStage(cupy, 0, register=False, staging_slots=2)
    op = stage.stream("op")
    outs = []
    for k in range(6):
        (dev,) = stage.to_device([[np.full(1 << 16, k, np.int32)] * 4], op)
        with op:
            outs.append(cupy.stack(dev).sum().get())
    stage.close()
    assert outs == [4 * (1 << 16) * k for k in range(6)]


def test_dlpack_export_to_torch_on_its_own_stream(cupy: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    producer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        samples = [cupy.full(8, i, cupy.float32) for i in range(4)]
    batch = _gpu.GpuBatch(samples, "", cupy, producer)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        t = torch.from_dlpack(batch)
        total = float(t.sum())
    assert total == 8 * (0 + 1 + 2 + 3)
