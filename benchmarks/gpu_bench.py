"""``python -m benchmarks gpu``: the GPU stage's copies and overlap, on a real GPU.

Sections (each side by side in one run, reported as ratios):

- **h2d**: host-to-device copies of pipeline batches (a batch of samples in one
  shared-memory block, as a worker writes it) through the GPU stage from a
  page-locked (registered) arena, through the pinned staging ring, and from
  pageable memory, against one raw ``cudaMemcpyAsync`` of the same bytes from
  pinned memory. Target: registered at least 85% of raw pinned.
- **overlap**: a pipeline CPU op -> GPU op with ``prefetch_depth=3``; an
  iteration's wall time against its slowest stage measured alone. Target: at
  most 1.1x.

Without CuPy, a driver or a device it prints that it was skipped, and why.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
import shm
from benchmarks._common import RESULTS, cli, log, table, targets_text, write
from mpexec import _gpu, fn

NAME = "gpu"


def bench_h2d(xp: Any, quick: bool) -> list[dict[str, Any]]:
    """GB/s of each path for a few batch sizes; best of N, with the spread."""
    sizes = (
        [(64, 64 << 10), (32, 1 << 20)] if quick else [(64, 64 << 10), (32, 1 << 20), (8, 16 << 20)]
    )
    repeat = 5 if quick else 20
    rows = []
    arena = shm.Arena(capacity=2 << 30, segment_size=1 << 29)
    try:
        for batch, sample in sizes:
            nbytes = batch * sample
            block = arena.put(np.ones((batch, sample), np.uint8))
            samples = [block[i] for i in range(batch)]
            pageable = [np.ones(sample, np.uint8) for _ in range(batch)]
            pinned = _gpu.pinned_array(xp, nbytes)
            pinned[:] = 1
            results: dict[str, list[float]] = {}
            for kind in ("raw pinned", "registered", "staged", "pageable"):
                stage = _gpu.GpuStage(xp, 0, register=kind == "registered")
                stream = stage.stream("bench")
                times = []
                dev = xp.empty(nbytes, np.uint8)
                rt = xp.cuda.runtime
                for _ in range(repeat + 1):
                    t0 = time.perf_counter()
                    if kind == "raw pinned":
                        rt.memcpyAsync(
                            int(dev.data.ptr), int(pinned.ctypes.data), nbytes,
                            rt.memcpyHostToDevice, stage.h2d.ptr,
                        )  # fmt: skip
                        stage.h2d.synchronize()
                    else:
                        columns = [pageable if kind == "pageable" else samples]
                        stage.to_device(columns, stream)
                        stream.synchronize()
                    times.append(time.perf_counter() - t0)
                stage.close()
                results[kind] = [nbytes / t / 1e9 for t in times[1:]]  # first: warm-up
            raw = max(results["raw pinned"])
            rows.append(
                {
                    "batch": batch,
                    "sample_bytes": sample,
                    "gbps": {k: max(v) for k, v in results.items()},
                    "spread": {k: statistics.pstdev(v) for k, v in results.items()},
                    "vs_raw_pinned": {k: max(v) / raw for k, v in results.items()},
                }
            )
    finally:
        arena.close()
    return rows


def _cpu_work(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    y = x.astype(np.float32)
    for _ in range(20):
        y = np.sqrt(y * y + 1.0)
    return y


def bench_overlap(xp: Any, quick: bool) -> dict[str, Any]:
    """An iteration's wall time against its slowest stage measured alone."""
    batch, shape, iters = 32, (256, 256), 20 if quick else 100

    def gpu_work(x: Any) -> Any:
        for _ in range(50):
            x = xp.sqrt(x * x + 1.0)
        return x

    def source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        return np.full(shape, info.idx_in_epoch % 251, np.uint8)

    def run(gpu: bool, cpu: bool) -> float:
        @mpexec.pipeline_def(batch_size=batch, num_workers=2, seed=0, prefetch_depth=3)
        def pipe() -> Any:
            x = fn.external_source(source=source, batch=False)
            if cpu:
                x = fn.python_function(x, function=_cpu_work)
            else:
                x = fn.python_function(x, function=lambda a: a.astype(np.float32))
            if gpu:
                x = fn.python_function(x, function=gpu_work, device="gpu")
            return x

        with pipe() as p:
            for _ in range(3):
                p.run()
            t0 = time.perf_counter()
            for _ in range(iters):
                (out,) = p.run()
                if gpu:
                    out.as_array()
                    out.stream.synchronize()
            return (time.perf_counter() - t0) / iters

    cpu_alone = run(gpu=False, cpu=True)
    gpu_alone = run(gpu=True, cpu=False)
    both = run(gpu=True, cpu=True)
    slowest = max(cpu_alone, gpu_alone)
    return {
        "cpu_stage_s": cpu_alone,
        "gpu_stage_s": gpu_alone,
        "iteration_s": both,
        "ratio": both / slowest,
    }


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run the benchmark, print its tables, write ``gpu.json`` and ``gpu.md``."""
    result: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "errors": [],
    }
    try:
        xp = _gpu.require("python -m benchmarks gpu", 0)
    except mpexec.GpuUnavailableError as exc:
        print(f"gpu: skipped: {exc}")
        result["skipped"] = str(exc)
        return result
    props = xp.cuda.runtime.getDeviceProperties(0)
    result["device"] = props.get("name", b"?").decode(errors="replace")
    result["cupy"] = xp.__version__
    log(f"[gpu] device {result['device']}, CuPy {result['cupy']}")
    h2d = bench_h2d(xp, quick)
    overlap = bench_overlap(xp, quick)
    result.update(h2d=h2d, overlap=overlap)
    rows = [
        [
            f"{r['batch']} x {r['sample_bytes'] >> 10} KiB",
            *(
                f"{r['gbps'][k]:.1f} ({r['vs_raw_pinned'][k]:.2f}x)"
                for k in ("raw pinned", "registered", "staged", "pageable")
            ),
        ]
        for r in h2d
    ]
    text = "H2D GB/s (ratio to raw pinned cudaMemcpyAsync)\n\n"
    text += table(["batch", "raw pinned", "registered", "staged", "pageable"], rows) + "\n\n"
    text += (
        f"overlap: CPU stage {overlap['cpu_stage_s'] * 1e3:.1f} ms, GPU stage "
        f"{overlap['gpu_stage_s'] * 1e3:.1f} ms, iteration {overlap['iteration_s'] * 1e3:.1f} ms "
        f"= {overlap['ratio']:.2f}x the slowest stage\n\n"
    )
    worst = min(r["vs_raw_pinned"]["registered"] for r in h2d)
    targets = [
        {
            "target": "registered H2D vs raw pinned",
            "value": worst,
            "op": ">=",
            "threshold": 0.85,
            "pass": worst >= 0.85,
            "note": "worst batch size",
        },
        {
            "target": "iteration vs slowest stage",
            "value": overlap["ratio"],
            "op": "<=",
            "threshold": 1.1,
            "pass": overlap["ratio"] <= 1.1,
            "note": "prefetch_depth=3",
        },
    ]
    result["targets"] = targets
    text += targets_text(targets) + "\n"
    print(text)
    write(NAME, result, text, out_dir, "copy paths and pipeline stages")
    return result


if __name__ == "__main__":
    sys.exit(cli(NAME, run, None))
