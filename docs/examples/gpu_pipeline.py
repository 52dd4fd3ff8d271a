"""CPU ops in workers feeding a GPU op: ``python docs/examples/gpu_pipeline.py``.

Needs CuPy and a CUDA GPU; without them, defining the GPU op raises
``mpexec.GpuUnavailableError`` naming the op and the cause, which this example
prints before it exits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import mpexec
from mpexec import fn


def decode(info: mpexec.SampleInfo) -> np.ndarray:
    """In a worker, once per sample: the image lands in the worker's shared memory."""
    return np.full((128, 128, 3), info.idx_in_epoch % 255, np.uint8)


def normalize(img: Any) -> Any:
    """On the GPU, on this op's own CUDA stream: ``img`` is a ``cupy.ndarray``."""
    import cupy  # only GPU ops need it

    return (img.astype(cupy.float32) - 127.5) / 127.5


def brightness(img: np.ndarray) -> np.ndarray:
    """Back in a worker: the GPU output was copied into shared memory for it."""
    return img.mean(axis=(0, 1))


@mpexec.pipeline_def(batch_size=16, num_workers=2, seed=0, prefetch_depth=2, device_id=0)
def augment() -> Any:
    img = fn.external_source(source=decode, batch=False)
    on_gpu = fn.python_function(img, function=normalize, device="gpu")
    return on_gpu, fn.python_function(on_gpu, function=brightness)


def main() -> None:
    try:
        pipe = augment()
    except mpexec.GpuUnavailableError as exc:
        print(f"no GPU here, so nothing to run:\n  {exc}")
        return
    with pipe:
        for _ in range(3):
            gpu_batch, means = pipe.run()
            dense = gpu_batch.as_array()  # one cupy array (16, 128, 128, 3) on the device
            print(gpu_batch.device, dense.shape, dense.dtype, "| means:", np.asarray(means)[:2])


if __name__ == "__main__":
    main()
