"""JAX back-end: a pipeline's batches as JAX arrays, through DLPack, with no copy.

Importing this module imports JAX; ``mpexec`` itself never does.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

try:
    import jax
    import jax.numpy as jnp
except ImportError as _exc:  # pragma: no cover - exercised without JAX installed
    from ._extras import missing_message

    raise ImportError(missing_message("jax", _exc)) from _exc

import numpy as np

from ._batch import Batch
from ._pipeline import Pipeline

__all__ = ["iterate", "to_jax"]


def iterate(pipe: Pipeline) -> Iterator[tuple[Any, ...]]:
    """A pipeline's iterations as tuples of JAX arrays (CPU), zero-copy.

    A dense output becomes one array over the batch's shared memory (stacked
    first if its op made it sample by sample: ``Batch.as_array``); a ragged
    one, a list of per-sample arrays. JAX arrays are immutable, so the
    pipeline's read-only memory stays unwritten.
    """
    for outputs in pipe:
        yield tuple(to_jax(b) for b in outputs)


def to_jax(batch: Batch | np.ndarray[Any, Any]) -> Any:
    """One batch (or array) as a JAX array over the same memory where JAX allows it.

    A GPU op's batch stays on the device (a list of arrays if ragged).

    JAX imports through DLPack without a copy only 64-byte-aligned memory
    (mpexec's shared memory is) and speaks a DLPack version that cannot mark
    memory read-only, which NumPy then refuses to export: it is exported
    through a writable alias of the same bytes instead, which JAX, whose
    arrays are immutable, never writes.
    """
    if isinstance(batch, Batch):
        if batch.device != "cpu":
            # A GPU op's batch: DLPack on the device, no copy (the producer's stream
            # is ordered before JAX's through the DLPack stream protocol).
            if batch.is_dense() and len(batch):
                return jnp.from_dlpack(batch)
            return [jnp.from_dlpack(s) for s in batch]
        if not (batch.is_dense() and len(batch)):
            return [to_jax(s) for s in batch]
        array = np.asarray(batch.as_array())
    else:
        array = batch
    return jnp.from_dlpack(_exportable(array))


def _exportable(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if array.flags.writeable or array.nbytes == 0:
        return array
    if not array.flags.c_contiguous:
        return np.ascontiguousarray(array)  # a copy either way
    raw = (ctypes.c_char * array.nbytes).from_address(array.ctypes.data)
    # Our own tag on JAX's object: it keeps the memory mapped.
    raw._mpexec_owner = array  # type: ignore[attr-defined]  # noqa: SLF001
    alias: np.ndarray[Any, Any] = np.frombuffer(memoryview(raw).cast("B"), array.dtype).reshape(
        array.shape
    )
    return alias


_ = jax  # the package is what the extra provides; jax.numpy does the work
