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


def _ramp(info: Any) -> np.ndarray[Any, Any]:
    return np.full((4, 4, 3), info.idx_in_epoch % 251, np.uint8)


def _ragged(info: Any) -> np.ndarray[Any, Any]:
    return np.full((info.idx_in_epoch % 3 + 1,), info.idx_in_epoch, np.float32)


def _doubling(cupy: Any, source: Any) -> Any:
    """A pipeline of batches of 8 of ``source``'s samples, doubled by a GPU op."""
    import mpexec
    from mpexec import fn

    def double(x: Any) -> Any:
        return x.astype(cupy.float32) * 2

    @mpexec.pipeline_def(batch_size=8, num_workers=2, seed=0, device_id=0)
    def pipe() -> Any:
        src = fn.external_source(source=source, batch=False)
        return fn.python_function(src, function=double, device="gpu")

    return pipe()


def test_to_torch_and_to_jax_keep_a_gpu_batch_on_the_device(cupy: Any) -> None:
    """The adapters hand a GPU op's batch over through DLPack, dense or ragged, no copy."""
    want = np.stack([np.full((4, 4, 3), i, np.float32) * 2 for i in range(8)])
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        pytest.skip("torch or JAX without CUDA")
    from mpexec.jax import to_jax
    from mpexec.torch import to_torch

    with _doubling(cupy, _ramp) as p:
        (batch,) = p.run()
        t = to_torch(batch)
        a = to_jax(batch)
        assert t.is_cuda
        assert next(iter(a.devices())).platform == "gpu"
        np.testing.assert_array_equal(t.cpu().numpy(), want)
        np.testing.assert_array_equal(np.asarray(a), want)
    with _doubling(cupy, _ragged) as p:
        (batch,) = p.run()
        parts = to_jax(batch)
        tensors = to_torch(batch)
        expected = [[2.0 * i] * (i % 3 + 1) for i in range(8)]
        assert [np.asarray(x).tolist() for x in parts] == expected
        assert [x.cpu().tolist() for x in tensors] == expected


# torch's own loader forks; where an earlier test ran JAX here, JAX warns at each fork.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_the_torch_drop_in_pins_its_batches_as_torchs_loader_does(cupy: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    import torch.utils.data as tud

    import mpexec.torch as mt

    # CUDA initialised by CuPy first, as a GPU op would: the loader must not fork
    # (found on an H200, where the drop-in asked the pool for a fork it refused).
    cupy.zeros(1).get()

    class Rows(tud.Dataset[Any]):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> Any:
            return torch.full((16,), float(i)), i

    ours = list(mt.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True))
    theirs = list(tud.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True))
    assert len(ours) == len(theirs) == 8
    for (x, i), (y, j) in zip(ours, theirs, strict=True):
        assert x.is_pinned()
        assert i.is_pinned()
        assert torch.equal(x, y)
        assert torch.equal(i, j)
