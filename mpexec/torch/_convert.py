"""A pipeline's batches as torch tensors: :func:`iterate`, :func:`to_torch`.

Runs in the caller, over an mpexec ``Pipeline``'s outputs: the tensors map
the batches' shared memory copy-on-write (``_tensors.private_tensor``), or
come through DLPack for GPU batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import shm

from ._tensors import private_tensor

if TYPE_CHECKING:
    from .._batch import Batch
    from .._pipeline import Pipeline

__all__ = ["iterate", "to_torch"]


def iterate(pipe: Pipeline) -> Iterator[tuple[Any, ...]]:
    """A pipeline's iterations as tuples of torch tensors over the batches' memory, no copy.

    A dense output becomes one tensor (stacked first if its op made it sample
    by sample: ``Batch.as_array``); a ragged one, a list of per-sample
    tensors. See :func:`to_torch` for what writing to them does.
    """
    for outputs in pipe:
        yield tuple(to_torch(b) for b in outputs)


def to_torch(batch: Batch) -> Any:
    """One batch as a tensor over its memory (a list of per-sample tensors if ragged).

    The pipeline's memory is read-only (other outputs, later consumers may
    share it). The tensors are writable, as torch's are, and copy-on-write:
    reading shares the pages, a write copies the pages it touches first, so
    it changes that tensor alone, never the batch or anything else. GPU
    batches come through DLPack, on the consumer's stream.
    """
    if batch.device != "cpu":
        if batch.is_dense() and len(batch):
            return torch.from_dlpack(batch)
        return [torch.from_dlpack(s) for s in batch]
    samples = list(batch)
    if not (batch.is_dense() and samples):
        return [_sample_tensor(s) for s in samples]
    first = samples[0]
    step = samples[1].ctypes.data - first.ctypes.data if len(samples) > 1 else first.nbytes
    seg = shm.segment_of(first)
    if seg is not None and all(
        s.ctypes.data == first.ctypes.data + i * step
        and s.strides == first.strides
        and s.dtype == first.dtype
        and shm.segment_of(s) is seg
        for i, s in enumerate(samples)
    ):
        # Rows of one block (the op made the batch dense, or its samples lie
        # end to end): that memory, copy-on-write.
        shape = (len(samples), *first.shape)
        tensor = private_tensor(first, shape, (step, *first.strides), samples)
        if tensor is not None:
            return tensor
    # Separate samples, or memory that is not shared: stacked, into a block of the tensor's own.
    return torch.from_numpy(np.stack(samples))


def _sample_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    tensor = private_tensor(array, array.shape, array.strides, array)
    if tensor is None:  # not in shared memory (a small array rides in its record): a copy
        tensor = torch.from_numpy(np.array(array))
    return tensor


# Shown and pickled under the public path (torch's test runner checks that a
# process's DataLoader is mpexec.torch's).
iterate.__module__ = "mpexec.torch"
to_torch.__module__ = "mpexec.torch"
