"""Batch: what a pipeline hands out per output and iteration."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np


class Batch(Sequence[Any]):
    """An ordered sequence of per-sample arrays; shapes may differ (ragged).

    The arrays are read-only views of shared memory and stay valid for as
    long as the batch (or any array taken from it) is referenced: the memory
    behind them is reused only after that. Copy an array to modify it.
    ``as_array()`` stacks the samples into one dense array (a copy unless the
    op produced the batch dense); ``__dlpack__`` exports that dense array.
    ``layout()`` names the axes of each sample, as DALI's ``TensorList`` does.

    A dense batch (``samples`` one NumPy array whose first axis is the batch,
    as a pipeline's outputs of one shape and dtype are) is that block:
    ``as_array()`` returns it, uncopied, and ``batch[i]`` is a view of row
    ``i``, made when asked for.
    """

    __slots__ = ("_dense", "_layout", "_samples")

    def __init__(
        self, samples: Sequence[Any], layout: str | None = None, dense: Any | None = None
    ) -> None:
        # Exactly one of the two may be None: a dense batch keeps no list of rows.
        self._samples: list[Any] | None
        self._dense: Any = dense
        if isinstance(samples, np.ndarray) and samples.ndim and dense is None:
            self._samples, self._dense = None, samples
        else:
            self._samples = list(samples)
        self._layout = layout or ""

    def _list(self) -> list[Any]:
        """The samples as a list (of row views, for a dense batch)."""
        return list(self._dense) if self._samples is None else self._samples

    # ------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return len(self._dense) if self._samples is None else len(self._samples)

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Batch: ...
    def __getitem__(self, i: int | slice) -> Any:
        if self._samples is None:
            return Batch(self._dense[i], self._layout) if isinstance(i, slice) else self._dense[i]
        if isinstance(i, slice):
            dense = self._dense[i] if self._dense is not None else None
            return Batch(self._samples[i], self._layout, dense)
        return self._samples[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._dense if self._samples is None else self._samples)

    def at(self, i: int) -> Any:
        """Sample ``i`` (DALI's ``TensorList.at``)."""
        return self[i]

    # ------------------------------------------------------------ properties
    def layout(self) -> str:
        """The samples' layout (``"HWC"``, ...; ``""`` if none): a method, as DALI's
        ``TensorList.layout()``."""
        return self._layout

    @property
    def device(self) -> str:
        """Where the samples live: ``"cpu"`` (NumPy) or ``"gpu"`` (CuPy)."""
        return "cpu"

    @property
    def dtype(self) -> np.dtype[Any] | None:
        """The samples' dtype (the same for every sample), None if empty."""
        if self._samples is None:
            return self._dense.dtype  # type: ignore[no-any-return]
        return self._samples[0].dtype if self._samples else None

    @property
    def ndim(self) -> int | None:
        """Rank of each sample (the same for every sample), None if empty."""
        if self._samples is None:
            return int(self._dense.ndim) - 1
        return self._samples[0].ndim if self._samples else None

    def shape(self) -> list[tuple[int, ...]]:
        """Each sample's shape."""
        if self._samples is None:
            return [tuple(self._dense.shape[1:])] * len(self._dense)
        return [tuple(s.shape) for s in self._samples]

    def is_dense(self) -> bool:
        """True if every sample has the same shape (so ``as_array`` can stack)."""
        return self._dense is not None or len({tuple(s.shape) for s in self._list()}) <= 1

    @property
    def nbytes(self) -> int:
        if self._samples is None:
            return int(self._dense.nbytes)
        return sum(int(s.nbytes) for s in self._samples)

    # ------------------------------------------------------------ conversion
    def as_array(self) -> Any:
        """The samples stacked along a new first axis (shape ``(len, *sample)``).

        A dense batch returns its block itself, read-only, without a copy.
        """
        if self._dense is not None:
            return self._dense
        samples = self._list()
        if not self.is_dense():
            shapes = sorted({tuple(s.shape) for s in samples})
            raise ValueError(
                f"cannot stack a ragged batch into one array: sample shapes differ "
                f"({', '.join(map(str, shapes[:4]))}{', ...' if len(shapes) > 4 else ''}); "
                "pad or crop them to one shape first, or use the samples one by one"
            )
        if not samples:
            raise ValueError("cannot stack an empty batch: its sample shape is unknown")
        xp = _namespace(samples[0])
        dense = _aligned_stack(samples) if xp is np else xp.stack(samples)
        dense.flags.writeable = False if xp is np else dense.flags.writeable
        self._dense = dense
        return dense

    def as_tensor(self) -> TensorCPU:
        """DALI's ``TensorListCPU.as_tensor``: the stacked samples as one
        :class:`TensorCPU` (``shape()``, ``np.asarray``, DLPack), without a copy
        of :meth:`as_array`'s array."""
        return TensorCPU(self.as_array(), self._layout)

    def is_dense_tensor(self) -> bool:
        """DALI's name for :meth:`is_dense`: every sample has one shape."""
        return self.is_dense()

    def as_cpu(self) -> Batch:
        """This batch with NumPy samples (a no-op for CPU batches)."""
        if not self._samples or _namespace(self._samples[0]) is np:
            return self
        return Batch([s.get() for s in self._samples], self._layout)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        out = np.asarray(self.as_cpu().as_array(), dtype=dtype)
        return out.copy() if copy else out

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        dense = self.as_array()
        try:
            return dense.__dlpack__(*args, **kwargs)
        except (BufferError, TypeError):
            # NumPy before 2.1 cannot export read-only memory: export a copy.
            return dense.copy().__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.as_array().__dlpack_device__()

    def __repr__(self) -> str:
        if not len(self):
            return f"Batch([], layout={self._layout!r})"
        shapes = self.shape()
        shape = shapes[0] if len(set(shapes)) == 1 else "ragged"
        return f"Batch(len={len(self)}, dtype={self.dtype}, shape={shape}, layout={self._layout!r})"


#: DLPack consumers import memory aligned to this without a copy (JAX, XLA: 64 bytes).
_ALIGNMENT = 64


def _aligned_stack(samples: list[Any]) -> np.ndarray[Any, Any]:
    """``np.stack(samples)`` into 64-byte-aligned memory (malloc gives 16)."""
    first = np.asarray(samples[0])
    dtype = np.result_type(*samples) if len(samples) > 1 else first.dtype
    shape = (len(samples), *first.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _ALIGNMENT
    out = raw[start : start + nbytes].view(dtype).reshape(shape)
    np.stack(samples, out=out)
    return out


def _namespace(array: Any) -> Any:
    if type(array).__module__.split(".")[0] == "cupy":
        import cupy  # only where CuPy arrays already exist

        return cupy
    return np


class TensorCPU:
    """One array with a layout, as DALI's ``TensorCPU`` (``shape()``, ``layout()``,
    ``dtype``, ``np.asarray(t)``, DLPack)."""

    __slots__ = ("_array", "_layout")

    def __init__(self, array: Any, layout: str | None = None, is_pinned: bool = False) -> None:
        del is_pinned  # host memory here is shared memory, never pinned by this call
        self._array = np.asarray(array)
        self._layout = layout or ""

    def shape(self) -> list[int]:
        """Its shape, as a list (DALI's method)."""
        return list(self._array.shape)

    def layout(self) -> str:
        return self._layout

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._array.dtype

    def as_array(self) -> np.ndarray[Any, Any]:
        return self._array

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if dtype is None and not copy:
            return self._array
        return np.array(self._array, dtype=dtype, copy=bool(copy))

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        return self._array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._array.__dlpack_device__()

    def __repr__(self) -> str:
        return f"TensorCPU(shape={tuple(self._array.shape)}, dtype={self.dtype})"


def check_outputs(result: tuple[Batch, ...], checks: tuple[Any, Any]) -> None:
    """A pipeline's outputs against its ``output_dtype``/``output_ndim`` (DALI's)."""
    dtypes, ndims = checks
    for i, batch in enumerate(result):
        if not len(batch):
            continue
        want = dtypes[i if len(dtypes) > 1 else 0] if dtypes else None
        if want is not None and batch.dtype != want:
            raise TypeError(
                f"pipeline output {i} is {batch.dtype}, but the pipeline's output_dtype is {want}"
            )
        rank = ndims[i if len(ndims) > 1 else 0] if ndims else None
        if rank is not None and batch.ndim != rank:
            raise ValueError(
                f"pipeline output {i} has {batch.ndim} dimensions, but the pipeline's "
                f"output_ndim is {rank}"
            )
