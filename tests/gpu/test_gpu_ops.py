"""GPU ops, batches and errors on the simulated device (no GPU needed)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import _gpu, fn
from mpexec._doctor import GpuReport, format_report
from mpexec._runtime import Chunk, np_from_dlpack
from mpexec.testing import GARBAGE, SEEDS, SimCuPy, simulated


@pytest.fixture(params=SEEDS, ids=lambda p: f"seed{p[0]}-progress{p[1]}")
def sim(request: pytest.FixtureRequest) -> Iterator[SimCuPy]:
    with simulated(*request.param) as device:
        yield device


def _chunk(count: int, iteration: int = 0) -> Chunk:
    return Chunk(0, iteration, 0, count, iteration * count)


def _runner(function: Any, *, batch: bool = False, n: int = 1, **kw: Any) -> _gpu.GpuOpRunner:
    return _gpu.GpuOpRunner("gpu_op", function, batch, n, 1234, kw.pop("dlpack", False), **kw)


# ---------------------------------------------------------------- the executor


def test_executor_runs_ops_on_their_streams_and_chains_by_events(sim: SimCuPy) -> None:
    arena = shm.Arena(capacity=1 << 24, segment_size=1 << 22)
    ex = _gpu.GpuExecutor(sim, 0)
    try:
        first = _runner(lambda x: x * 2)
        first.name = "first"
        second = _runner(lambda x: x + 1, producers=("first",))
        second.name = "second"
        third = _runner(lambda x: -x, producers=("source",))  # independent of the others
        third.name = "third"
        for it in range(4):
            block = arena.put(np.arange(3 * 5, dtype=np.float32).reshape(3, 5) + it)
            host = [block[i] for i in range(3)]
            r1 = ex.submit(first, _chunk(3, it), [host]).result(timeout=30)
            (dev,) = r1.outputs
            r2 = ex.submit(second, _chunk(3, it), [dev]).result(timeout=30)
            r3 = ex.submit(third, _chunk(3, it), [host]).result(timeout=30)
            (out2,) = ex.to_host([r2.outputs[0]], "second")
            (out3,) = ex.to_host([r3.outputs[0]], "third")
            np.testing.assert_array_equal(np.stack(out2), np.stack(host) * 2 + 1)
            np.testing.assert_array_equal(np.stack(out3), -np.stack(host))
        streams = {ex.stage.stream(n).ptr for n in ("first", "second", "third")}
        assert len(streams) == 3  # each op its own stream
        assert ex.stage.h2d.ptr not in streams
    finally:
        ex.shutdown()
        arena.close()
    assert sim.registered == {}


def test_executor_batch_mode_and_sample_info(sim: SimCuPy) -> None:
    seen: list[Any] = []

    def batch_fn(xs: list[Any]) -> Any:
        seen.append(mpexec.sample_info())
        return sim.stack(xs) * 10

    ex = _gpu.GpuExecutor(sim, 0)
    try:
        res = ex.submit(_runner(batch_fn, batch=True), _chunk(2, 5), [[np.ones(3), np.zeros(3)]])
        (col,) = res.result(timeout=30).outputs
        (host,) = ex.to_host([col], "gpu_op")
    finally:
        ex.shutdown()
    np.testing.assert_array_equal(np.stack(host), [[10.0] * 3, [0.0] * 3])
    assert seen[0].iteration == 5


def test_gpu_user_errors_come_back_typed_with_op_and_sample(sim: SimCuPy) -> None:
    def oom_on_second(x: Any) -> Any:
        if float(x.sum().get()) > 0:
            raise sim.cuda.memory.OutOfMemoryError(1 << 40, 0)
        return x

    ex = _gpu.GpuExecutor(sim, 0)
    try:
        fut = ex.submit(_runner(oom_on_second), _chunk(2), [[np.zeros(4), np.ones(4)]])
        with pytest.raises(sim.cuda.memory.OutOfMemoryError) as info:
            fut.result(timeout=30)
        assert info.value.mpexec_op == "gpu_op"  # type: ignore[attr-defined]
        assert info.value.mpexec_sample == 1  # type: ignore[attr-defined]

        def cuda_error(x: Any) -> Any:
            raise sim.cuda.runtime.CUDARuntimeError(700)  # an illegal address, say

        fut = ex.submit(_runner(cuda_error), _chunk(1), [[np.zeros(4)]])
        with pytest.raises(sim.cuda.runtime.CUDARuntimeError):
            fut.result(timeout=30)
    finally:
        ex.shutdown()  # still closes cleanly
    assert ex.stage.closed


@pytest.mark.parametrize(
    ("n", "result", "match"),
    [
        (1, lambda x: np.zeros(3), "ndarray; a GPU op returns CuPy arrays"),
        (1, lambda x: (x, x), "tuple; a GPU op returns CuPy arrays"),
        (2, lambda x: x, "num_outputs=2"),
    ],
)
def test_gpu_op_outputs_are_checked(sim: SimCuPy, n: int, result: Any, match: str) -> None:
    runner = _runner(result, n=n)
    ex = _gpu.GpuExecutor(sim, 0)
    try:
        fut = ex.submit(runner, _chunk(1), [[np.zeros(3)]])
        with pytest.raises(
            mpexec.OpOutputError, match=match.split(";", maxsplit=1)[0].replace("(", r"\(")
        ):
            fut.result(timeout=30)
    finally:
        ex.shutdown()


def test_dl_tensor_variant_gets_dlpack_capsules(sim: SimCuPy) -> None:
    kinds = []

    def f(capsule: Any) -> Any:
        kinds.append(type(capsule).__name__)
        return sim.from_dlpack(capsule) + 1

    ex = _gpu.GpuExecutor(sim, 0)
    try:
        res = ex.submit(_runner(f, dlpack=True), _chunk(1), [[np.arange(4.0)]]).result(30)
        (host,) = ex.to_host([[res.outputs[0][0]]], "gpu_op")
    finally:
        ex.shutdown()
    assert kinds == ["PyCapsule"]
    np.testing.assert_array_equal(host[0], np.arange(4.0) + 1)


def test_shutdown_cancels_queued_calls_and_refuses_new_ones(sim: SimCuPy) -> None:
    ex = _gpu.GpuExecutor(sim, 0)
    ex.shutdown()
    ex.shutdown()
    with pytest.raises(mpexec.GpuError, match="closed"):
        ex.submit(_runner(lambda x: x), _chunk(1), [[np.zeros(1)]])


# ---------------------------------------------------------------- batches


def test_gpu_batch_is_dense_on_the_device_and_exports_dlpack_on_the_consumers_stream(
    sim: SimCuPy,
) -> None:
    producer = sim.cuda.Stream(non_blocking=True)
    consumer = sim.cuda.Stream(non_blocking=True)
    with producer:
        samples = [sim.asarray(np.full(4, float(i))) for i in range(3)]
    batch = _gpu.GpuBatch(samples, "C", sim, producer)
    assert batch.device == "gpu"
    dense = batch.as_array()
    assert isinstance(dense, sim.ndarray)
    assert dense.shape == (3, 4)
    assert batch.as_array() is dense
    assert isinstance(batch[1:], _gpu.GpuBatch)
    np.testing.assert_array_equal(
        np.asarray(batch.as_cpu()), np.repeat(np.arange(3.0), 4).reshape(3, 4)
    )

    capsule = batch.__dlpack__(stream=consumer.ptr)
    assert sim.dlpack_streams[-1] == consumer.ptr
    assert sim.waits[-1] == (consumer, producer), "the consumer must wait on the producer"
    consumer.synchronize()
    np.testing.assert_array_equal(
        np_from_dlpack(_Caps(capsule)), np.repeat(np.arange(3.0), 4).reshape(3, 4)
    )
    assert batch.__dlpack_device__() == (2, 0)


class _Caps:
    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kw: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def test_cpu_batches_say_they_are_on_the_cpu() -> None:
    assert mpexec.Batch([np.zeros(2)]).device == "cpu"


# ---------------------------------------------------------------- errors at definition


def _define(device_id: int | None = None) -> None:
    kw = {} if device_id is None else {"device_id": device_id}

    @mpexec.pipeline_def(batch_size=2, num_workers=0, **kw)
    def pipe() -> Any:
        a = fn.external_source(source=[[np.zeros(2)] * 2])
        return fn.python_function(a, function=lambda x: x, device="gpu", name="on_gpu")

    pipe()


def test_no_cupy_is_one_clear_error_naming_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(mpexec.GpuUnavailableError) as info:
        _define()
    msg = str(info.value)
    assert "on_gpu" in msg
    assert "CuPy" in msg
    assert "device='cpu'" in msg


def test_no_driver_is_one_clear_error_naming_the_op() -> None:
    with (
        _gpu.use_backend(SimCuPy(0, driver=False)),
        pytest.raises(mpexec.GpuUnavailableError) as info,
    ):
        _define()
    assert "on_gpu" in str(info.value)
    assert "driver" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_no_device_is_one_clear_error_naming_the_op() -> None:
    with _gpu.use_backend(SimCuPy(0, devices=0)), pytest.raises(mpexec.GpuUnavailableError) as info:
        _define()
    assert "on_gpu" in str(info.value)
    assert "no usable device" in str(info.value)
    with _gpu.use_backend(SimCuPy(0, devices=1)), pytest.raises(mpexec.GpuUnavailableError) as info:
        _gpu.require("fn.python_function 'x'", 3)
    assert "device 3" in str(info.value)
    assert "1 device" in str(info.value)


def test_gpu_sources_are_refused_clearly(sim: SimCuPy) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def pipe() -> Any:
        return fn.external_source(source=[[np.zeros(2)] * 2], device="gpu", name="gsrc")

    with pytest.raises(ValueError, match="gsrc"):
        pipe()


# ---------------------------------------------------------------- doctor


def test_doctor_probes_on_the_simulated_device() -> None:
    sim = SimCuPy(0)
    assert _gpu.probe_host_register(sim) == (True, None)
    assert sim.registered == {}
    rates = _gpu.measure_h2d(sim, nbytes=1 << 16, repeat=2)
    assert set(rates) == {"registered", "pinned", "pageable"}
    assert all(r > 0 for r in rates.values())
    assert sim.registered == {}
    failing = SimCuPy(0, register_fails=True)
    ok, why = _gpu.probe_host_register(failing)
    assert not ok
    assert why is not None
    assert "801" in why
    assert set(_gpu.measure_h2d(failing, nbytes=1 << 12, repeat=1)) == {"pinned", "pageable"}


def test_doctor_prints_the_gpu_facts() -> None:
    gpu = GpuReport(
        "14.0", None, 1, ("H100",), None, 12040, 12090, True, None,
        (("registered", 24.5), ("pinned", 25.1), ("pageable", 9.8)),
    )  # fmt: skip
    from mpexec._doctor import collect

    report = collect(measure=False)
    import dataclasses

    text = format_report(dataclasses.replace(report, gpu=gpu))
    assert "driver 12.4, runtime 12.9" in text
    assert "host register yes" in text
    assert "registered 24.5, pinned 25.1, pageable 9.8" in text


def test_garbage_is_what_unwritten_device_memory_holds() -> None:
    sim = SimCuPy(0)
    assert (sim.empty(8, np.uint8).get() == GARBAGE).all()
