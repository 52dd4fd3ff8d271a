"""A pipeline of python_function ops, DALI style: ``python docs/examples/pipeline_basics.py``."""

from __future__ import annotations

import numpy as np

import mpexec
from mpexec import fn

N_IMAGES = 10


def read_sample(info: mpexec.SampleInfo) -> np.ndarray:
    """Runs in a worker, once per sample; StopIteration ends the epoch."""
    if info.idx_in_epoch >= N_IMAGES:
        raise StopIteration
    return np.full((48, 64, 3), info.idx_in_epoch, np.uint8)


def random_crop(img: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``rng`` is seeded from (seed, op, iteration, sample): reproducible anywhere."""
    y, x = rng.integers(0, 16), rng.integers(0, 16)
    return img[y : y + 32, x : x + 48]


def split(batch: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A batch op: lists in, one list per output back."""
    return [im[:, :24] for im in batch], [im[:, 24:] for im in batch]


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=42, prefetch_depth=2)
def augment() -> tuple[mpexec.DataNode, ...]:
    img = fn.external_source(source=read_sample, batch=False)
    out = fn.python_function(img, function=random_crop, output_layouts="HWC")
    left, right = fn.python_function(
        out, function=split, num_outputs=2, batch_processing=True, output_layouts="HWC"
    )
    return left, right


if __name__ == "__main__":
    with augment() as pipe:
        for epoch in range(2):
            for left, right in pipe:  # one epoch: 4 + 4 + a short batch of 2
                print(epoch, len(left), left.layout(), left.as_array().shape, right[0].shape)
            pipe.reset()
        print(pipe.stats())
