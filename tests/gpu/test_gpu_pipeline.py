"""GPU ops in pipelines, on the simulated device; the same bodies run on a GPU in test_gpu_real.

The simulator's streams run deferred work only when waited on (under one seed,
never on their own), so a GPU op that does not wait for its input copy, a CPU
op that reads a GPU output before its copy landed, or host memory released
before a copy read it, gives wrong numbers here or a recorded violation.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _gpu, _rngseeds, fn
from mpexec.testing import SEEDS, SimCuPy, simulated


@pytest.fixture(params=SEEDS, ids=lambda p: f"seed{p[0]}-progress{p[1]}")
def sim(request: pytest.FixtureRequest) -> Iterator[SimCuPy]:
    with simulated(*request.param) as device:
        yield device
    assert device.registered == {}, "a closed pipeline left host memory registered"
    assert device.pending() == 0


# ---------------------------------------------------------------- shared bodies


def _source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    return np.arange(6 * 5, dtype=np.float32).reshape(6, 5) + info.idx_in_epoch


def _one_op(function: Any, device: str, batch_size: int, seed: int) -> mpexec.Pipeline:
    """A per-sample source and one ``function`` op on ``device``: CPU and GPU side by side."""

    @mpexec.pipeline_def(batch_size=batch_size, num_workers=0, seed=seed)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        return fn.python_function(a, function=function, device=device)

    return pipe()


def _noisy(x: Any, rng: np.random.Generator) -> Any:
    noise = rng.standard_normal(x.shape).astype(np.float32)
    return x * 2 + (noise if isinstance(x, np.ndarray) else _xp_of(x).asarray(noise))


def _xp_of(x: Any) -> Any:
    return _gpu.backend()


def _split(x: Any) -> tuple[Any, Any]:
    return x[:3] + 1, x[3:] * 3


def _batch_norm(xs: list[Any]) -> Any:
    xp = np if isinstance(xs[0], np.ndarray) else _xp_of(xs[0])
    stacked = xp.stack(xs)
    return stacked - stacked[0]  # exact in IEEE arithmetic on any device (a mean would not be)


def _cpu_after(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    assert isinstance(x, np.ndarray)
    return x.sum(axis=0, keepdims=True)


def parity_pipeline(device: str, num_workers: int = 2, prefetch: int = 2) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=4, num_workers=num_workers, seed=7, prefetch_depth=prefetch)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        b = fn.python_function(a, function=_noisy, device=device, name="noisy")
        c, d = fn.python_function(b, function=_split, num_outputs=2, device=device, name="split")
        e = fn.python_function(c, function=_batch_norm, batch_processing=True, device=device)
        f = fn.python_function(d, function=_cpu_after, name="cpu_after")
        return e, f

    return pipe()


def host(batch: mpexec.Batch) -> np.ndarray[Any, Any]:
    return np.asarray(batch.as_cpu().as_array())


def check_parity(iterations: int, num_workers: int = 2, prefetch: int = 2) -> None:
    """GPU ops give the CPU ops' outputs bit for bit (CPU -> GPU -> GPU -> CPU edges)."""
    results = {}
    for device in ("cpu", "gpu"):
        with parity_pipeline(device, num_workers, prefetch) as pipe:
            results[device] = [tuple(host(b) for b in pipe.run()) for _ in range(iterations)]
            if device == "gpu":
                e, f = pipe.run()
                assert e.device == "gpu"
                assert f.device == "cpu"
    for it, (cpu, gpu) in enumerate(zip(results["cpu"], results["gpu"], strict=True)):
        for k, (a, b) in enumerate(zip(cpu, gpu, strict=True)):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b, err_msg=f"iteration {it}, output {k}")


def check_no_leak(xp_used_bytes: Any, pinned_live: Any, iterations: int) -> None:
    """Device and pinned memory stay flat over many iterations; nothing stays registered."""
    with parity_pipeline("gpu") as pipe:
        for _ in range(10):
            pipe.run()
        device0, pinned0 = xp_used_bytes(), pinned_live()
        for _ in range(iterations):
            e, f = pipe.run()
            del e, f
        device1, pinned1 = xp_used_bytes(), pinned_live()
        gpu = pipe._gpu
    assert device1 <= device0 * 1.5 + (1 << 20), (device0, device1)
    assert pinned1 <= pinned0 + 2, (pinned0, pinned1)
    assert gpu.stage.closed
    assert gpu.stage.registered() == []


# ---------------------------------------------------------------- on the simulator


@pytest.mark.parametrize("num_workers", [2, 0])
def test_gpu_ops_give_the_cpu_ops_outputs_bit_for_bit(sim: SimCuPy, num_workers: int) -> None:
    check_parity(3, num_workers=num_workers)


def test_many_iterations_leak_no_device_or_pinned_memory(sim: SimCuPy) -> None:
    check_no_leak(lambda: sim.device_bytes, lambda: sim.pinned_live, 100)


def _big_source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    return np.full((128, 64), info.idx_in_epoch, np.float32)  # past the inline size: shared


def test_cpu_to_gpu_copies_from_the_workers_memory_in_place(sim: SimCuPy) -> None:
    @mpexec.pipeline_def(batch_size=8, num_workers=2, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_big_source, batch=False)
        b = fn.python_function(a, function=lambda x: x + 1)  # in the workers
        return fn.python_function(b, function=lambda x: x * 2, device="gpu")

    with pipe() as p:
        for _ in range(3):
            (out,) = p.run()
        stats = p._gpu.stage.stats()
        assert stats.h2d_registered_bytes > 0
        assert stats.h2d_staged_bytes == 0
        assert stats.registered_segments >= 1
        np.testing.assert_array_equal(host(out)[0], (_big_source(_info(16)) + 1) * 2)


def _info(i: int) -> mpexec.SampleInfo:
    return mpexec.SampleInfo(i, i % 8, i // 8, 0)


def test_gpu_to_cpu_lands_in_shared_memory_with_no_further_copy(sim: SimCuPy) -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_big_source, batch=False)
        b = fn.python_function(a, function=lambda x: x * 2, device="gpu")
        return fn.python_function(b, function=_cpu_after, name="cpu_after")

    with pipe() as p:
        (out,) = p.run()
        want = (_big_source(_info(1)) * 2).sum(axis=0, keepdims=True)
        np.testing.assert_array_equal(out[1], want)
        assert p._gpu.stage.stats().d2h_bytes >= 4 * 128 * 64 * 4  # prefetched iterations too
        cpu_op = next(s for s in p.stats().ops if s.name == "cpu_after")
        assert cpu_op.bytes_copied == 0


def test_the_copy_to_the_host_runs_with_the_scheduler_free(sim: SimCuPy) -> None:
    """A GPU op's output for a CPU op is copied off the scheduler's lock.

    (It used to be copied, and waited for, in the thread that completed the
    GPU op's chunk, under the scheduler's lock: every other completion waited.)
    """

    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_big_source, batch=False)
        b = fn.python_function(a, function=lambda x: x * 2, device="gpu")
        return fn.python_function(b, function=_cpu_after, name="cpu_after")

    held: list[bool] = []
    with pipe() as p:
        lock = p._scheduler._lock  # an RLock: it knows whether this thread holds it
        stage = p._gpu.stage
        to_host = stage.to_host

        def spy(*args: Any, **kwargs: Any) -> Any:
            held.append(lock._is_owned())
            return to_host(*args, **kwargs)

        stage.to_host = spy
        (out,) = p.run()
        np.testing.assert_array_equal(out[1], (_big_source(_info(1)) * 2).sum(axis=0)[None])
    assert held
    assert not any(held)


def test_independent_gpu_ops_share_no_stream_and_wait_only_on_their_producers(
    sim: SimCuPy,
) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        b = fn.python_function(a, function=lambda x: x + 1, device="gpu", name="left")
        c = fn.python_function(a, function=lambda x: x - 1, device="gpu", name="right")
        d = fn.python_function(b, function=lambda x: x * 2, device="gpu", name="after_left")
        return c, d

    with pipe() as p:
        p.run()
        stage = p._gpu.stage
        left, right, after = (stage.stream(n) for n in ("left", "right", "after_left"))
        assert len({left.ptr, right.ptr, after.ptr}) == 3
        waited_on = {(w, s) for w, s in sim.waits}
        assert (right, left) not in waited_on
        assert (right, after) not in waited_on
        assert (left, right) not in waited_on


def test_dl_tensor_gpu_op_gets_capsules_and_may_return_them(sim: SimCuPy) -> None:
    def f(capsule: Any) -> Any:
        assert type(capsule).__name__ == "PyCapsule"
        return (sim.from_dlpack(capsule) * 10).__dlpack__()

    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        return fn.dl_tensor_python_function(a, function=f, device="gpu")

    with pipe() as p:
        (out,) = p.run()
    np.testing.assert_array_equal(host(out)[1], _source(_info(1)) * 10)


def test_a_device_out_of_memory_in_a_user_function_comes_back_typed(sim: SimCuPy) -> None:
    def greedy(x: Any) -> Any:
        info = mpexec.sample_info()
        if info.iteration == 0 and info.idx_in_batch == 2:
            return sim.empty((1 << 40,), np.uint8)
        return x

    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=0)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        return fn.python_function(a, function=greedy, device="gpu", name="greedy")

    with pipe() as p:
        with pytest.raises(sim.cuda.memory.OutOfMemoryError) as info:
            p.run()
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "greedy" in notes
        assert "sample 2" in notes
        p.run()  # the next iteration is fine
    assert p._gpu is None


def test_device_id_is_checked_where_the_op_is_defined(sim: SimCuPy) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0, device_id=3)
    def pipe() -> Any:
        a = fn.external_source(source=_source, batch=False)
        return fn.python_function(a, function=lambda x: x, device="gpu", name="far")

    with pytest.raises(mpexec.GpuUnavailableError) as info:
        pipe()
    assert "far" in str(info.value)
    assert "device 3" in str(info.value)


def test_gpu_outputs_are_dense_device_arrays(sim: SimCuPy) -> None:
    with parity_pipeline("gpu", num_workers=0) as p:
        e, _ = p.run()
    dense = e.as_array()
    assert isinstance(dense, sim.ndarray)
    assert dense.shape == (4, 3, 5)
    with contextlib.suppress(TypeError):
        np.asarray(dense)
        pytest.fail("a device array must not convert to NumPy implicitly")


def test_a_pipeline_dropped_without_close_stops_its_gpu_stage(sim: SimCuPy) -> None:
    """Its finalizer stops the GPU thread and unregisters the arena before the pool unmaps it."""
    pipe = parity_pipeline("gpu")
    for _ in range(3):
        pipe.run()
    gpu = pipe._gpu
    assert gpu.stage.registered(), "the test needs host memory registered"
    del pipe
    gc.collect()
    assert gpu.stage.closed
    assert gpu._thread is not None
    assert not gpu._thread.is_alive()


def _global_noise(x: Any) -> Any:
    # np.random and random's global state: reseeded before each call as on the CPU.
    shift = np.float32(np.random.random() + random.random() + random.gauss(0, 1))
    return x + shift


def test_gpu_ops_reseed_global_random_state_as_cpu_ops_do(sim: SimCuPy) -> None:
    results = {}
    for device in ("cpu", "gpu"):
        with _one_op(_global_noise, device, batch_size=4, seed=11) as pipe:
            results[device] = [host(pipe.run()[0]) for _ in range(2)]
    for cpu, gpu in zip(results["cpu"], results["gpu"], strict=True):
        np.testing.assert_array_equal(cpu, gpu)


def _draws(x: Any, rng: np.random.Generator) -> Any:
    xp = np if isinstance(x, np.ndarray) else _xp_of(x)
    return x * 0 + xp.asarray(rng.integers(0, 2**31, x.shape).astype(np.float32))


def test_a_gpu_ops_rng_builds_no_seed_sequence_a_call_and_draws_the_cpu_ops_words(
    sim: SimCuPy, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[object] = []
    real = np.random.SeedSequence

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(kwargs.get("spawn_key"))
            super().__init__(*args, **kwargs)

    results = {}
    for device in ("cpu", "gpu"):
        with _one_op(_draws, device, batch_size=4, seed=5) as pipe:
            pipe.run()  # built and warm before counting
            monkeypatch.setattr(np.random, "SeedSequence", Counted)
            results[device] = [host(pipe.run()[0]) for _ in range(2)]
            monkeypatch.undo()
    assert made == []  # none for the 8 calls of either device's op
    assert len({float(v) for v in results["gpu"][0].ravel()}) > 100  # real draws
    for cpu, gpu in zip(results["cpu"], results["gpu"], strict=True):
        np.testing.assert_array_equal(cpu, gpu)


def test_a_gpu_ops_batch_hashes_its_rngs_at_once(
    sim: SimCuPy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 16 hashes its calls' PCG64 words in one pass, as a CPU op's chunk does
    (none one by one), and draws what the CPU op draws."""
    one_by_one: list[int] = []
    real = _rngseeds._generate_constants

    def counting(n: int) -> list[tuple[int, int]]:
        one_by_one.append(n)
        return real(n)

    results = {}
    for device in ("cpu", "gpu"):
        with _one_op(_draws, device, batch_size=16, seed=5) as pipe:
            pipe.run()
            monkeypatch.setattr(_rngseeds, "_generate_constants", counting)
            # Three: iterations run ahead of run(), so at least one is computed in here.
            results[device] = [host(pipe.run()[0]) for _ in range(3)]
            monkeypatch.undo()
    assert one_by_one == []
    for cpu, gpu in zip(results["cpu"], results["gpu"], strict=True):
        np.testing.assert_array_equal(cpu, gpu)
