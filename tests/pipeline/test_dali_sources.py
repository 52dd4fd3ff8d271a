"""DALI's ``fn.external_source``, as DALI's own code and tests use it, by renaming the import.

DALI's defaults and keywords (``cycle=None``, ``bytes_per_sample_hint``, a dtype
per output), its epoch ends (a per-sample source's partial batch is dropped; a
source that does not cycle stays exhausted after ``reset()``) and its parallel
batch mode (batch callables, iterables and generators run in the workers).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn, types
from mpexec.pipeline import Pipeline

pytestmark = pytest.mark.usefixtures("no_leaks")


def _sample(info: Any) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= 10:
        raise StopIteration
    return np.full((2,), info.idx_in_epoch, np.int32)


def _pair(info: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return np.full((2,), info.idx_in_epoch, np.uint8), np.array([info.idx_in_batch], np.int32)


def _sizes(pipe: Pipeline, runs: int) -> list[Any]:
    """Batch sizes of ``runs`` calls to run(), "Stop" where it raised StopIteration."""
    out: list[Any] = []
    for _ in range(runs):
        try:
            (b, *_) = pipe.run()
        except StopIteration:
            out.append("Stop")
            pipe.reset()
            continue
        out.append(len(b))
    return out


# ================================================================ arguments (items 1, 2, 6)


@pytest.mark.parametrize("workers", [0, 2])
def test_dali_defaults_and_keywords_are_accepted(workers: int) -> None:
    """``cycle=None`` (DALI's default, passed explicitly by its helpers),
    ``bytes_per_sample_hint``, ``prefetch_queue_depth=None``, ``batch_info=None``."""
    pipe = Pipeline(4, 1, None, num_workers=workers, seed=1)
    with pipe:
        x = fn.external_source(
            _sample,
            batch=False,
            cycle=None,
            bytes_per_sample_hint=1 << 20,
            prefetch_queue_depth=None,
            batch_info=None,
            layout="X",
        )
        pipe.set_outputs(x)
    with pipe:
        (b,) = pipe.run()
        assert [int(s[0]) for s in b] == [0, 1, 2, 3]
        assert b.layout() == "X"


def test_a_dtype_per_output() -> None:
    pipe = Pipeline(3, 1, None, num_workers=0, seed=1)
    with pipe:
        a, b = fn.external_source(
            _pair, num_outputs=2, batch=False, dtype=[types.UINT8, types.INT32], ndim=[1, 1]
        )
        pipe.set_outputs(a, b)
    with pipe:
        a_out, b_out = pipe.run()
        assert a_out.dtype == np.uint8 and b_out.dtype == np.int32
    with pytest.raises(mpexec.OpArgumentError, match="3 output_dtypes given for 2 outputs"):
        with Pipeline(3, 1, None, num_workers=0) as p2:
            fn.external_source(_pair, num_outputs=2, batch=False, dtype=[types.UINT8] * 3)
            p2.set_outputs()
