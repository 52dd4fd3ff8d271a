"""DALI's conditional execution, ``if`` on a DataNode: ``python docs/examples/conditionals.py``."""

from __future__ import annotations

import os

import numpy as np

import mpexec
from mpexec import fn


def read_sample(info: mpexec.SampleInfo) -> np.ndarray:
    return np.full((4, 4), info.idx_in_batch, np.uint8)


def read_label(info: mpexec.SampleInfo) -> np.ndarray:
    return np.array(info.idx_in_batch % 3, np.int32)


def heavy(img: np.ndarray) -> np.ndarray:
    """Called only for samples whose label is 0: the other branches' never reach it."""
    assert img[0, 0] % 3 == 0, "a sample of another branch"
    return 255 - img


def light(img: np.ndarray) -> np.ndarray:
    return img // 2


def worker_pid(img: np.ndarray) -> np.ndarray:
    return np.array(os.getpid())


@mpexec.pipeline_def(batch_size=6, num_workers=2, seed=1, enable_conditionals=True)
def augment() -> tuple[mpexec.DataNode, ...]:
    img = fn.external_source(source=read_sample, batch=False)
    label = fn.external_source(source=read_label, batch=False)
    if label == 0:
        img = fn.python_function(img, function=heavy)
        branch = 0
    elif label == 1 and img[0, 0] > 2:  # `and`/`or`/`not` work per sample too
        img = fn.python_function(img, function=light)
        branch = 1
    else:
        branch = 2  # Python values set in every branch become constants, merged too
    pid = fn.python_function(img, function=worker_pid)
    return img, branch, pid


if __name__ == "__main__":
    with augment() as pipe:
        img, branch, pid = pipe.run()
        # Each sample comes from its branch, in the batch's order.
        print("first pixels:", [int(a[0, 0]) for a in img])  # [255, 1, 2, 252, 2, 5]
        print("branches:    ", [int(b) for b in branch])  # [0, 2, 2, 0, 1, 2]
        assert [int(a[0, 0]) for a in img] == [255, 1, 2, 252, 2, 5]
        assert os.getpid() not in {int(p) for p in pid}, "the functions ran in the workers"
