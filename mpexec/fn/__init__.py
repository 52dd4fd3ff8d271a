"""The ops, DALI style: ``from mpexec import fn``.

Call them inside a pipeline definition (a function decorated with
:func:`mpexec.pipeline_def`, or a ``with pipe:`` block of an undefined
:class:`mpexec.Pipeline`); each returns the op's outputs as DataNodes.
Every misuse is reported here, at definition time, naming the op.

Besides the python_function family and ``external_source``: constants
(``ones``, ``zeros``, ``constant``), ``readers.file`` and ``decoders.image``
(CPU, Pillow), the sources DALI's python_function pipelines start with.
DALI's other ops (Flip, Rotate, Resize, ...) are not here: an attribute
error says so, and how to keep them in DALI (``mpexec.dali``).
"""

from __future__ import annotations

from typing import Any

from . import decoders, readers
from ._core import (
    constant,
    dl_tensor_python_function,
    external_source,
    ones,
    python_function,
    zeros,
)

__all__ = [
    "constant",
    "decoders",
    "dl_tensor_python_function",
    "external_source",
    "ones",
    "python_function",
    "readers",
    "zeros",
]


def __getattr__(name: str) -> Any:
    """DALI's ops that mpexec does not have: say so, and what to do instead."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'mpexec.fn' has no attribute {name!r}: mpexec runs DALI's python_function "
        "family, external_source, constants, readers.file and decoders.image, not DALI's "
        "other ops. Write the step as a python_function, or keep the op in a DALI pipeline "
        "and run your Python functions in it with mpexec.dali.python_function"
    )
