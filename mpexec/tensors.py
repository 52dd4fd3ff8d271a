"""DALI's ``nvidia.dali.tensors`` for mpexec: ``TensorCPU``, a sample a source may return.

DALI's sources may return its own tensor objects; code ported by renaming the
import keeps doing so. Here ``TensorCPU`` wraps a NumPy array (no copy) and
is a NumPy and DLPack producer, so ops and sources take it as the array it
holds; batches a pipeline returns are :class:`mpexec.Batch`, DALI's
``TensorListCPU``'s stand-in.
"""

from __future__ import annotations

from ._batch import TensorCPU

__all__ = ["TensorCPU"]
