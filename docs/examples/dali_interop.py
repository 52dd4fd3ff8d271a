"""mpexec inside a real DALI pipeline, both ways (docs/dali.md).

1. DALI's python_function, spread over mpexec's worker processes.
2. An mpexec pipeline as the source of a DALI pipeline, epoch by epoch.

Needs NVIDIA DALI (``pip install 'mpexec[dali]'``, Linux x86_64; CPU-only
pipelines need no GPU). Without it, this says so and exits.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import mpexec
import mpexec.dali
from mpexec import fn as mfn

try:
    from nvidia.dali import fn, pipeline_def
except ImportError:
    print("NVIDIA DALI is not installed (pip install 'mpexec[dali]'): nothing to show here")
    sys.exit(0)


def blur(image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Some Python per image (~5 ms): many passes of a small box blur."""
    out = image.astype(np.float32)
    for _ in range(150):
        out = (out + np.roll(out, 1, axis=0) + np.roll(out, 1, axis=1)) / 3
    return out.astype(np.uint8)


def images(info: Any) -> list[np.ndarray[Any, Any]]:
    return [np.full((96, 96, 3), (info.iteration * 8 + j) % 256, np.uint8) for j in range(8)]


def dali_pipeline(function: Any) -> Any:
    @pipeline_def(batch_size=8, num_threads=1, device_id=None)
    def graph() -> Any:
        x = fn.external_source(source=images, batch=True, batch_info=True)
        return fn.python_function(x, function=function, batch_processing=True)

    pipe = graph()
    pipe.build()
    return pipe


def per_batch(batch: list[Any]) -> list[Any]:
    return [blur(x) for x in batch]


def throughput(pipe: Any, iterations: int = 10) -> float:
    pipe.run()  # warm up
    t0 = time.perf_counter()
    for _ in range(iterations):
        pipe.run()
    return iterations * 8 / (time.perf_counter() - t0)


def source_pipeline() -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=7)
    def graph() -> Any:
        x = mfn.external_source(
            source=[np.full((2, 2), i, np.float32) for i in range(8)], batch=False
        )
        noisy = mfn.python_function(x, function=add_noise)
        return noisy, x

    return graph()


def add_noise(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return x + rng.normal(0, 0.01, x.shape).astype(np.float32)


def main() -> None:
    # 1. The same DALI pipeline, its python_function alone, and spread over 2 workers.
    with mpexec.dali.python_function(blur, num_workers=2) as spread:
        alone = throughput(dali_pipeline(per_batch))
        spread_rate = throughput(dali_pipeline(spread))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"DALI alone:         {alone:7.1f} images/s")
    print(
        f"DALI + mpexec.dali: {spread_rate:7.1f} images/s ({spread_rate / alone:.2f}x, {cpus} CPUs)"
    )

    # 2. mpexec feeding DALI: two DALI epochs, each one epoch of the mpexec pipeline.
    with source_pipeline() as mp:

        @pipeline_def(batch_size=4, num_threads=1, device_id=None)
        def consumer() -> Any:
            noisy, clean = mpexec.dali.external_source(mp)
            return noisy - clean

        pipe = consumer()
        pipe.build()
        for epoch in range(2):
            batches = 0
            try:
                while True:
                    (diff,) = pipe.run()
                    assert np.abs(np.array(diff.as_tensor())).max() < 0.1
                    batches += 1
            except StopIteration:
                pipe.reset()
            print(f"epoch {epoch}: {batches} batches from the mpexec pipeline")
        del pipe


if __name__ == "__main__":
    main()
