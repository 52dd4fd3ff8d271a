"""Stand-in for the helpers DALI's tests import from DALI's ``test_utils``.

``get_dali_extra_path`` and ``np_type_to_dali`` (the python_function tests);
``compare_pipelines``, ``check_batch``, ``RandomDataIterator`` and
``RandomlyShapedDataIterator`` (the parallel external_source tests). Batches
are read through what both DALI's ``TensorList`` and ``mpexec.Batch`` offer:
``len()``, ``at(i)``, ``layout()``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

_NAMES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FLOAT16",
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "FLOAT64",
}


def get_dali_extra_path() -> str:
    """Where the DALI_extra data is: the runner's generated stand-in."""
    return os.environ["DALI_EXTRA_PATH"]


def np_type_to_dali(np_type: Any) -> Any:
    """The ``types.DALIDataType`` of a NumPy type, from whichever ``nvidia.dali.types`` is
    imported (DALI's, or mpexec's in the renamed run)."""
    from nvidia.dali import types

    return getattr(types, _NAMES[np.dtype(np_type)])


def _samples(batch: Any) -> list[Any]:
    """A batch's samples as NumPy arrays: a TensorList/Batch (``at``) or a list."""
    if hasattr(batch, "as_cpu") and not hasattr(batch, "at"):
        batch = batch.as_cpu()
    if hasattr(batch, "at"):
        return [np.array(batch.at(i)) for i in range(len(batch))]
    return [np.array(s) for s in batch]


def check_batch(
    batch1: Any,
    batch2: Any,
    batch_size: int | None = None,
    eps: float = 1e-07,
    max_allowed_error: float | None = None,
    expected_layout: str | None = None,
    compare_layouts: bool = True,
) -> None:
    """The two batches hold the same samples: same count and shapes, values within
    ``eps`` (or ``max_allowed_error``), and, for batches with a layout, the same
    layout (``expected_layout`` where given)."""
    layouts = [b.layout() for b in (batch1, batch2) if callable(getattr(b, "layout", None))]
    if compare_layouts and len(layouts) == 2:
        assert layouts[0] == layouts[1], f"layouts differ: {layouts[0]!r} vs {layouts[1]!r}"
    if expected_layout is not None:
        for lay in layouts:
            assert lay == expected_layout, f"layout {lay!r}, expected {expected_layout!r}"
    s1, s2 = _samples(batch1), _samples(batch2)
    if batch_size is not None:
        assert len(s1) == batch_size, f"batch of {len(s1)}, expected {batch_size}"
    assert len(s1) == len(s2), f"batch lengths differ: {len(s1)} vs {len(s2)}"
    for i, (a, b) in enumerate(zip(s1, s2, strict=True)):
        assert a.shape == b.shape, f"sample {i}: shapes differ: {a.shape} vs {b.shape}"
        if a.size == 0:
            continue
        err = np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
        bound = eps if max_allowed_error is None else max(eps, max_allowed_error)
        assert err <= bound, f"sample {i}: values differ by up to {err} (allowed {bound})"


def compare_pipelines(
    pipe1: Any,
    pipe2: Any,
    batch_size: int,
    N_iterations: int,
    eps: float = 1e-07,
    max_allowed_error: float | None = None,
    expected_layout: str | None = None,
    compare_layouts: bool = True,
) -> None:
    """Run both pipelines ``N_iterations`` times; every output batch must match."""
    for _ in range(N_iterations):
        out1, out2 = pipe1.run(), pipe2.run()
        assert len(out1) == len(out2), f"{len(out1)} outputs vs {len(out2)}"
        for b1, b2 in zip(out1, out2, strict=True):
            check_batch(
                b1, b2, batch_size, eps, max_allowed_error, expected_layout, compare_layouts
            )


class RandomDataIterator:
    """Batches of ``batch_size`` random arrays of ``shape`` and ``dtype`` (seeded)."""

    def __init__(
        self, batch_size: int, shape: Any = (10, 600, 800, 3), dtype: Any = None, seed: int = 0
    ) -> None:
        self.batch_size = batch_size
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype or np.uint8)
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> RandomDataIterator:
        return self

    def _one(self, shape: tuple[int, ...]) -> Any:
        if self.dtype.kind == "f":
            return self.rng.random(shape).astype(self.dtype)
        info = np.iinfo(self.dtype)
        return self.rng.integers(info.min, info.max, shape, dtype=self.dtype, endpoint=True)

    def __next__(self) -> list[Any]:
        return [self._one(self.shape) for _ in range(self.batch_size)]

    next = __next__


class RandomlyShapedDataIterator(RandomDataIterator):
    """As :class:`RandomDataIterator`, each sample of a random shape up to ``max_shape``."""

    def __init__(
        self,
        batch_size: int,
        min_shape: Any = None,
        max_shape: Any = (10, 600, 800, 3),
        seed: int = 0,
        dtype: Any = None,
    ) -> None:
        super().__init__(batch_size, max_shape, dtype, seed)
        self.min_shape = tuple(min_shape) if min_shape is not None else (1,) * len(self.shape)

    def __next__(self) -> list[Any]:
        out = []
        for _ in range(self.batch_size):
            shape = tuple(
                int(self.rng.integers(lo, hi, endpoint=True))
                for lo, hi in zip(self.min_shape, self.shape, strict=True)
            )
            out.append(self._one(shape))
        return out

    next = __next__
