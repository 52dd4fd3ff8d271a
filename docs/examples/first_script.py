"""A first script, with no ``if __name__ == "__main__":`` guard: ``python first_script.py``.

The workers never run this file: its body runs once (the line below prints once), and
what it defines reaches them by value.
"""

from __future__ import annotations

import numpy as np

import mpexec
from mpexec import fn

print("the script's body runs once")


class Measured:
    """A class of this script: its instances go to the workers and come back as such."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


def scale(m: Measured, factor: float) -> Measured:
    return Measured(m.values * factor)


def read_sample(info: mpexec.SampleInfo) -> np.ndarray:
    if info.idx_in_epoch >= 8:
        raise StopIteration
    return np.full((4, 4), info.idx_in_epoch, np.float32)


pool = mpexec.WorkerPool(num_workers=2)
out = pool.submit(scale, Measured(np.arange(4.0)), 2.0).result(timeout=60)
assert isinstance(out, Measured)
print("pool:", out.values)
pool.shutdown()


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=0)
def squares() -> mpexec.DataNode:
    sample = fn.external_source(source=read_sample, batch=False)
    return fn.python_function(sample, function=np.square)


with squares() as pipe:
    for (batch,) in pipe:
        print("pipeline:", batch.as_array()[:, 0, 0])
