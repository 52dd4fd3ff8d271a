"""Tensors over shared memory, both ways: a batch's tensors on the wire, and mapped by torch.

A worker's batch leaves as :class:`WireTensor` objects, each an ndarray of
its arena that the pool sends by descriptor (no copy, no pickle of the
data); the caller turns each back into a tensor over the same pages, one
that torch knows is shared (``is_shared()``: an fd-backed storage, as torch's
own batches are) while the open-files budget allows. A pipeline's batches
become copy-on-write tensors (:func:`private_tensor`). Runs in the caller
and in the workers.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import mmap
import os
import resource
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import shm

from . import _compat

__all__ = [
    "NUMPY_DTYPES",
    "STACKED_NUMPY",
    "TORCH_DTYPES",
    "WireTensor",
    "discard_pages",
    "extent",
    "fds_held",
    "from_wire",
    "private_tensor",
    "shared_array",
    "tag",
    "to_wire",
    "walk",
]

NUMPY_DTYPES = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}

STACKED_NUMPY = {np.dtype(t) for t in NUMPY_DTYPES.values()}
TORCH_DTYPES = {np.dtype(n): t for t, n in NUMPY_DTYPES.items()}


# ------------------------------------------------------------------ tensors on the wire
class WireTensor:
    """A tensor on its way to the caller: its memory as an ndarray (sent by descriptor)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (WireTensor, (self.array,))


def to_wire(data: Any) -> Any:
    """``data`` with each CPU tensor that NumPy can view as a :class:`WireTensor`."""
    return walk(data, torch.Tensor, _tensor_out)


def from_wire(data: Any) -> Any:
    """``data`` with each :class:`WireTensor` a tensor over its memory again."""
    if type(data) is WireTensor:  # a batch of one tensor: no walk, _tensor_in inline
        array = data.array
        tensor = _shared_tensor(array)
        return tensor if tensor is not None else tag(torch.from_numpy(array), array)
    return walk(data, WireTensor, _tensor_in)


def tag(tensor: torch.Tensor, array: np.ndarray[Any, Any]) -> torch.Tensor:
    """Mark ``tensor`` as a view of ``array``, shared memory: it travels back by descriptor.

    ``tensor.numpy()`` would be a view whose base is the tensor, not the
    arena's array: the array is kept with the tensor instead.
    """
    tensor._mpexec_array = array  # noqa: SLF001 - our tag on torch's tensor, read by shared_array
    return tensor


def _tensor_out(t: torch.Tensor) -> Any:
    if t.dtype not in NUMPY_DTYPES or t.layout != torch.strided or t.device.type != "cpu":
        return t  # pickled by torch (a copy): no NumPy view of it exists
    if t.is_nested:  # strided layout, but no NumPy view either; torch's queue copies it too
        return t
    if t.is_conj() or t.is_neg() or t.requires_grad:
        return t
    array = shared_array(t)
    return WireTensor(array if array is not None else t.numpy())


def shared_array(t: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """The array of shared memory a loader's tensor is (None if not, or if resized since)."""
    array = getattr(t, "_mpexec_array", None)
    if (
        array is None
        or t.data_ptr() != array.ctypes.data
        or tuple(t.shape) != array.shape
        or tuple(s * t.element_size() for s in t.stride()) != array.strides
    ):
        return None
    return array  # type: ignore[no-any-return]


def _tensor_in(t: WireTensor) -> torch.Tensor:
    tensor = _shared_tensor(t.array)
    if tensor is None:
        tensor = tag(torch.from_numpy(t.array), t.array)
    return tensor


# ------------------------------------------------------------------ tensors over shared memory
#: Live batch tensors that hold an fd (see _shared_tensor), and their budget.
_fds_held = 0
_fds_budget: int | None = None


def fds_held() -> int:
    """How many live batch tensors of this process hold an fd (for tests and diagnostics)."""
    return _fds_held


#: One writable fd of each mapped segment a batch tensor was made from, by the
#: segment's ``id``: opened at its first batch, closed when the segment object
#: goes (with its mapping). A worker's batches come from the same segment, which
#: stays mapped while the worker lives; opening it again through
#: ``/proc/<pid>/fd/<n>`` (open, fstat, inode check) cost 50-70 µs a batch.
_segment_fds: dict[int, int] = {}
_segment_fds_lock = threading.Lock()


def _forget_fd(key: int, fd: int) -> None:
    """The segment went: close its fd (unless a fork's child already let go of it)."""
    with _segment_fds_lock:
        if _segment_fds.get(key) != fd:
            return
        del _segment_fds[key]
    os.close(fd)


def _segment_fds_in_child() -> None:
    """A forked child keeps none of its parent's segment fds (which would keep the
    segments of workers that have since gone alive for as long as it lives)."""
    global _segment_fds, _segment_fds_lock
    for fd in _segment_fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _segment_fds, _segment_fds_lock = {}, threading.Lock()


os.register_at_fork(after_in_child=_segment_fds_in_child)


def _segment_fd(array: np.ndarray[Any, Any]) -> tuple[int, int] | None:
    """A writable fd of the shared-memory segment ``array`` is a view of, and where its data starts.

    The fd is the segment's own (:data:`_segment_fds`): the caller does not
    close it. None if ``array`` is in no segment, or the segment can no
    longer be opened (its owner has exited).
    """
    seg = shm.segment_of(array)
    if seg is None:
        return None
    key = id(seg)
    fd = _segment_fds.get(key)
    if fd is None:
        try:
            fd = seg.open_fd(writable=True)
        except shm.AttachError:
            return None
        with _segment_fds_lock:
            held = _segment_fds.setdefault(key, fd)
        if held != fd:  # another thread opened it first
            os.close(fd)
            fd = held
        else:
            weakref.finalize(seg, _forget_fd, key, fd)
    # The data's address: ``array.ctypes.data`` is two Python calls of NumPy's.
    address: int = array.__array_interface__["data"][0]
    return fd, seg.offset + (address - seg.address)


def _shared_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A tensor over ``array``'s shared pages that torch knows are shared (``is_shared()``).

    torch's own batches are in a shared-memory mapping of torch's (one fd
    each), which torch.multiprocessing sends on by fd, uncopied. This maps the
    worker's segment the same way, so a batch goes on to other processes
    without a copy too, and holds ``array`` (so its memory) for as long as
    the storage lives. Each such tensor holds an fd, as torch's do: past a
    quarter of the open-files limit, batches come as plain tensors over the
    same memory instead (None here), rather than leaving the process
    without fds ("Too many open files", torch's well-known failure).
    """
    global _fds_held, _fds_budget
    dtype = TORCH_DTYPES.get(array.dtype)
    size = array.itemsize
    flags = array.flags
    # A collated batch is C-contiguous: its strides need no look, and torch's
    # default strides are its own (NumPy's flag ignores the stride of a length-1
    # axis, which the tensor keeps: those take the general path). Three
    # generators fewer a batch.
    contiguous = flags.c_contiguous and 1 not in array.shape
    if (
        dtype is None
        or not flags.writeable
        or array.nbytes == 0
        or (not contiguous and any(st < 0 or st % size for st in array.strides))
    ):
        return None
    if _fds_budget is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        _fds_budget = (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 4
    if _fds_held >= _fds_budget:
        return None
    found = _segment_fd(array)
    if found is None:
        return None
    fd, start = found
    if start % size:
        return None
    try:
        end = start + (array.nbytes if contiguous else extent(array))
        storage = _compat.shared_fd_storage(fd, end)  # a dup of fd
    except RuntimeError:  # out of fds, or of address space: the plain tensor will do
        return None
    _fds_held += 1
    # The storage's Python object lives as long as the storage (torch keeps it):
    # so does what it holds, the array (the memory) and the fd's count.
    storage._mpexec_keep = _Held(array)  # noqa: SLF001 - our tag: keeps the memory mapped
    out = torch.empty(0, dtype=dtype)
    if contiguous:  # torch's default strides: C-contiguous
        out.set_(storage, start // size, array.shape)
    else:
        out.set_(storage, start // size, array.shape, tuple(st // size for st in array.strides))
    return out


class _Held:
    """What a shared batch tensor's storage holds: its array, and one fd of the budget."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __del__(self) -> None:
        global _fds_held
        _fds_held -= 1


def private_tensor(
    first: np.ndarray[Any, Any], shape: tuple[int, ...], strides: tuple[int, ...], keep: Any
) -> torch.Tensor | None:
    """A writable tensor of ``shape`` and byte ``strides`` from ``first``'s data, copy-on-write.

    Reads share the pages of the segment ``first`` is in, uncopied; a write
    copies the page it touches into memory of this tensor's own
    (``MAP_PRIVATE``), so it changes this tensor only, never the shared memory
    that other batches, consumers or the pipeline read. ``keep`` (the arrays
    the tensor spans) is held as long as the tensor. None if ``first`` is in
    no segment that can be opened.
    """
    dtype = TORCH_DTYPES.get(first.dtype)
    if dtype is None or any(st < 0 for st in strides) or 0 in shape:
        return None
    seg = shm.segment_of(first)
    if seg is None:
        return None
    start = seg.offset + (first.ctypes.data - seg.address)
    end = start + first.itemsize + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    base = start // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        # The shared memory stays allocated while the copy reads it: keep holds it.
        pages = seg.map_private(base, end - base, keep)
    except (OSError, ValueError, shm.AttachError):  # gone, or out of address space: a copy
        return None
    view: np.ndarray[Any, Any] = np.ndarray(
        shape, first.dtype, buffer=pages, offset=start - base, strides=strides
    )
    return torch.from_numpy(view)


def extent(array: np.ndarray[Any, Any]) -> int:
    """Bytes from an array's first element to the end of its last (strides >= 0)."""
    last = sum((n - 1) * st for n, st in zip(array.shape, array.strides, strict=True))
    return int(array.itemsize + last)


def discard_pages(array: np.ndarray[Any, Any]) -> None:
    """Drop this process's mapping of the pages ``array`` spans (the segment keeps the data)."""
    seg = shm.segment_of(array)
    if seg is not None:
        seg.drop_pages(seg.offset + (array.ctypes.data - seg.address), extent(array))


def walk(data: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """``data`` with each ``kind`` inside replaced by ``fn(it)``, containers kept."""
    if isinstance(data, kind):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: walk(v, kind, fn) for k, v in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            try:
                clone = copy.copy(data)
                clone.update(items)
                return clone
            except TypeError:
                return items
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        parts = [walk(v, kind, fn) for v in data]
        if hasattr(data, "_fields"):  # a named tuple
            return type(data)(*parts)
        return tuple(parts) if type(data) is tuple else type(data)(parts)
    if isinstance(data, list):
        parts = [walk(v, kind, fn) for v in data]
        if type(data) is list:
            return parts
        try:
            seq: list[Any] = copy.copy(data)
            seq[:] = parts
            return seq
        except TypeError:
            return parts
    return data
