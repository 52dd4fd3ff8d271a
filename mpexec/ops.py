"""DALI's legacy operator classes (``nvidia.dali.ops``) for what mpexec has.

An op object is made with its arguments (``ops.PythonFunction(function=f)``),
usually in a pipeline's ``__init__``, and called with its inputs inside the
definition (``define_graph``, ``pipeline_def``, ``with pipe:``): each call
adds one op to the graph, as ``fn.*`` does, and returns its outputs. Keyword
arguments given to the call are added to those given to the constructor
(giving one in both places is an error, as in DALI).

Here: :class:`PythonFunction`, :class:`DLTensorPythonFunction`,
:class:`ExternalSource`, :class:`Constant`, :class:`Ones`, :class:`Zeros`,
``readers.File`` and ``decoders.Image`` (and DALI's older spellings
``FileReader``, ``ImageDecoder``). DALI's other ops are absent: an attribute
error says so.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from . import fn
from ._graph import DataNode
from ._runtime import np_from_dlpack

__all__ = [
    "Constant",
    "DLTensorPythonFunction",
    "ExternalSource",
    "FileReader",
    "ImageDecoder",
    "Ones",
    "PythonFunction",
    "Zeros",
    "decoders",
    "readers",
]

#: DALI exports its DataNode class here under this name; code checks against it.
_DataNode = DataNode


class _Operator:
    """An op made once and called in a definition, DALI's legacy way."""

    _function: Callable[..., Any]

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs

    @property
    def device(self) -> str:
        return str(self._kwargs.get("device") or "cpu")

    def _arguments(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        twice = sorted(set(kwargs) & set(self._kwargs))
        if twice:
            raise ValueError(
                f"{type(self).__name__}: {', '.join(twice)} given both when the op was made "
                "and when it was called; give each once"
            )
        return {**self._kwargs, **kwargs}

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        return self._function(*inputs, **self._arguments(kwargs))

    def __repr__(self) -> str:
        return f"ops.{type(self).__name__}({', '.join(map(str, self._kwargs))})"


class PythonFunction(_Operator):
    """DALI's ``ops.PythonFunction``: ``fn.python_function`` made once, called per use."""

    _function = staticmethod(fn.python_function)

    def __init__(
        self,
        function: Callable[..., Any],
        num_outputs: int = 1,
        device: str = "cpu",
        batch_processing: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            function=function,
            num_outputs=num_outputs,
            device=device,
            batch_processing=batch_processing,
            **kwargs,
        )
        self.function = function
        self.num_outputs = num_outputs


class DLTensorPythonFunction(PythonFunction):
    """DALI's ``ops.DLTensorPythonFunction`` (``batch_processing`` is True by default, as there)."""

    _function = staticmethod(fn.dl_tensor_python_function)

    def __init__(
        self,
        function: Callable[..., Any],
        num_outputs: int = 1,
        device: str = "cpu",
        synchronize_stream: bool = True,
        batch_processing: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            function,
            num_outputs,
            device,
            batch_processing,
            synchronize_stream=synchronize_stream,
            **kwargs,
        )


class ExternalSource(_Operator):
    """DALI's ``ops.ExternalSource``: ``fn.external_source`` made once (``source`` may
    also be given to the call)."""

    _function = staticmethod(fn.external_source)

    def __init__(self, source: Any = None, num_outputs: int | None = None, **kwargs: Any) -> None:
        if source is not None:
            kwargs["source"] = source
        if num_outputs is not None:
            kwargs["num_outputs"] = num_outputs
        super().__init__(**kwargs)

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        if inputs:
            raise TypeError("ExternalSource takes no inputs: it is where data enters")
        if kwargs.get("batch") is None:
            kwargs.pop("batch", None)
        return fn.external_source(**self._arguments(kwargs))


class Constant(_Operator):
    """DALI's ``ops.Constant`` (``fdata``/``idata``, ``shape``, ``dtype``)."""

    _function = staticmethod(fn.constant)


class Ones(_Operator):
    """DALI's ``ops.Ones``."""

    _function = staticmethod(fn.ones)


class Zeros(_Operator):
    """DALI's ``ops.Zeros``."""

    _function = staticmethod(fn.zeros)


class File(_Operator):
    """DALI's ``ops.readers.File``: ``fn.readers.file``, returning ``[data, labels]``."""

    _function = staticmethod(fn.readers.file)


class Image(_Operator):
    """DALI's ``ops.decoders.Image``: ``fn.decoders.image`` (CPU, with Pillow)."""

    _function = staticmethod(fn.decoders.image)


FileReader = File
ImageDecoder = Image
readers = SimpleNamespace(File=File)
decoders = SimpleNamespace(Image=Image)


def _dlpack_to_array(dlpack: Any) -> np.ndarray[Any, Any]:
    """A NumPy array over a DLPack producer or capsule (DALI's helper of this name).

    DALI's DLTensorPythonFunction hands a function capsules, which code
    written for it converts with this; here the function gets NumPy arrays,
    which this returns as they are. Bare capsules (from other libraries) still
    convert.
    """
    if isinstance(dlpack, np.ndarray):
        return dlpack
    if hasattr(dlpack, "__dlpack__"):
        return np_from_dlpack(dlpack)  # type: ignore[no-any-return]
    return np_from_dlpack(_Capsule(dlpack))  # type: ignore[no-any-return]


def _dlpack_from_array(array: Any) -> Any:
    """A DLPack producer of ``array`` (DALI's helper of this name returns a capsule).

    Here it is the array itself: a function of a dl_tensor_python_function op
    may return any DLPack producer, and torch's and CuPy's ``from_dlpack`` take
    it as they take a capsule.
    """
    return np.asarray(array)


class _Capsule:
    """A bare DLPack capsule dressed as a producer, for ``np.from_dlpack`` (CPU memory)."""

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU


def __getattr__(name: str) -> Any:
    """DALI's ops that mpexec does not have: say so, and what to do instead."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"module 'mpexec.ops' has no attribute {name!r}: mpexec has DALI's PythonFunction "
        "family, ExternalSource, Constant/Ones/Zeros, readers.File and decoders.Image, not "
        "DALI's other ops. Write the step as a PythonFunction, or keep the op in a DALI "
        "pipeline and run your Python functions in it with mpexec.dali.python_function"
    )
