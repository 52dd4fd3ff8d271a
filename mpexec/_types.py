"""DALI's type enums and their NumPy dtypes: the leaf under ``mpexec.types``, ``fn`` and arithmetic.

The enum values are DALI's own (``int(types.UINT8) == 0`` in both), so code
that stores or compares them behaves the same. A dtype may be given as one of
these, as real DALI's enum of the same name, as anything ``numpy.dtype``
accepts, or as a TensorFlow DType: :func:`as_numpy_dtype` reads them all.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np


class DALIDataType(enum.IntEnum):
    """DALI's element types (``types.UINT8``, ``types.FLOAT``, ...), with DALI's values."""

    NO_TYPE = -1
    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    UINT64 = 3
    INT8 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    FLOAT16 = 8
    FLOAT = 9
    FLOAT64 = 10
    BOOL = 11
    STRING = 12
    FEATURE = 17
    IMAGE_TYPE = 20
    DATA_TYPE = 21
    INTERP_TYPE = 22
    TENSOR_LAYOUT = 23
    PYTHON_OBJECT = 24

    def __str__(self) -> str:  # DALI prints the qualified name, IntEnum the number
        return f"{type(self).__name__}.{self.name}"


class DALIImageType(enum.IntEnum):
    """Colour spaces of decoded images (``types.RGB``, ...), with DALI's values."""

    RGB = 0
    BGR = 1
    GRAY = 2
    YCbCr = 3
    ANY_DATA = 4

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class DALIInterpType(enum.IntEnum):
    """Interpolation methods (``types.INTERP_LINEAR``, ...), with DALI's values."""

    INTERP_NN = 0
    INTERP_LINEAR = 1
    INTERP_CUBIC = 2
    INTERP_LANCZOS3 = 3
    INTERP_TRIANGULAR = 4
    INTERP_GAUSSIAN = 5

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


_TO_NUMPY: dict[DALIDataType, np.dtype[Any]] = {
    DALIDataType.UINT8: np.dtype(np.uint8),
    DALIDataType.UINT16: np.dtype(np.uint16),
    DALIDataType.UINT32: np.dtype(np.uint32),
    DALIDataType.UINT64: np.dtype(np.uint64),
    DALIDataType.INT8: np.dtype(np.int8),
    DALIDataType.INT16: np.dtype(np.int16),
    DALIDataType.INT32: np.dtype(np.int32),
    DALIDataType.INT64: np.dtype(np.int64),
    DALIDataType.FLOAT16: np.dtype(np.float16),
    DALIDataType.FLOAT: np.dtype(np.float32),
    DALIDataType.FLOAT64: np.dtype(np.float64),
    DALIDataType.BOOL: np.dtype(np.bool_),
}
_TO_DALI = {v: k for k, v in _TO_NUMPY.items()}


def to_numpy_type(dali_type: Any) -> type[Any]:
    """The NumPy scalar type of a :class:`DALIDataType` (DALI's ``types.to_numpy_type``)."""
    found = _dali_enum(dali_type)
    if found is None or found not in _TO_NUMPY:
        raise TypeError(f"{dali_type!r} has no NumPy type (numeric DALIDataType values do)")
    return _TO_NUMPY[found].type


def to_dali_type(dtype: Any) -> DALIDataType:
    """The :class:`DALIDataType` of a NumPy dtype (or type, or name)."""
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    if np_dtype is None or np_dtype not in _TO_DALI:
        raise TypeError(f"{dtype!r} could not be converted into any known DALIDataType")
    return _TO_DALI[np_dtype]


def as_numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """A NumPy dtype from a DALI enum (ours or DALI's), a TF DType or a NumPy spelling."""
    dali = _dali_enum(dtype)
    if dali is not None:
        if dali not in _TO_NUMPY:
            raise TypeError(f"{dtype!r} has no NumPy dtype (numeric DALIDataType values do)")
        return _TO_NUMPY[dali]
    out: np.dtype[Any] = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))  # TensorFlow DTypes
    return out


def _dali_enum(value: Any) -> DALIDataType | None:
    """``value`` as our DALIDataType where it is one, ours or real DALI's (by name)."""
    if isinstance(value, DALIDataType):
        return value
    if type(value).__name__ == "DALIDataType":  # nvidia.dali's own enum
        return DALIDataType.__members__.get(str(getattr(value, "name", "")))
    return None


class ScalarConstant:
    """A scalar for arithmetic on DataNodes (DALI's ``types.ScalarConstant``).

    ``types.Constant(2)`` makes one; a bare Python number in an expression
    is one too. Its dtype takes part in type promotion as a tensor's would:
    DALI reads a Python ``int`` as INT32, a ``float`` as FLOAT, a ``bool``
    as BOOL, unless ``dtype`` says otherwise. Used as an op's input, it
    becomes a constant of one element per sample.
    """

    __slots__ = ("dtype", "value")

    def __init__(self, value: Any, dtype: Any = None) -> None:
        if dtype is not None:
            np_dtype = as_numpy_dtype(dtype)
        elif isinstance(value, (bool, np.bool_)):
            np_dtype = np.dtype(np.bool_)
        elif isinstance(value, np.generic):  # its own type (np.float64 is a float too)
            np_dtype = value.dtype
        elif isinstance(value, int):
            np_dtype = np.dtype(np.int32)
        elif isinstance(value, float):
            np_dtype = np.dtype(np.float32)
        else:
            raise TypeError(
                f"a scalar constant is a bool, int or float, not {type(value).__name__}"
            )
        self.dtype = np_dtype
        self.value = np_dtype.type(value)

    def as_array(self) -> np.ndarray[Any, Any]:
        """The value as a 0-d array of its dtype."""
        return np.array(self.value, dtype=self.dtype)

    def __repr__(self) -> str:
        return f"{self.value}:{to_dali_type(self.dtype)}"
