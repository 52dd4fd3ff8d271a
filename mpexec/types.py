"""DALI's ``nvidia.dali.types`` for mpexec: type enums, ``Constant``, ``SampleInfo``.

``import mpexec.types as types`` stands where ``import nvidia.dali.types as
types`` stood: ``types.UINT8``, ``types.FLOAT``, ``types.RGB``,
``types.INTERP_LINEAR``, ``types.Constant(...)``, ``types.SampleInfo`` and
``types.BatchInfo`` mean what they mean in DALI (with DALI's values), and
work wherever mpexec takes a dtype (``output_dtypes=``, ``dtype=``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _arith, fn
from ._graph import DataNode, current_graph
from ._runtime import BatchInfo, SampleInfo
from ._types import (
    DALIDataType,
    DALIImageType,
    DALIInterpType,
    ScalarConstant,
    as_numpy_dtype,
    to_dali_type,
    to_numpy_type,
)

__all__ = [
    "ANY_DATA",
    "BGR",
    "BOOL",
    "FLOAT",
    "FLOAT16",
    "FLOAT64",
    "GRAY",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "INTERP_CUBIC",
    "INTERP_GAUSSIAN",
    "INTERP_LANCZOS3",
    "INTERP_LINEAR",
    "INTERP_NN",
    "INTERP_TRIANGULAR",
    "NO_TYPE",
    "RGB",
    "STRING",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "BatchInfo",
    "Constant",
    "DALIDataType",
    "DALIImageType",
    "DALIInterpType",
    "SampleInfo",
    "ScalarConstant",
    "YCbCr",
    "to_dali_type",
    "to_numpy_type",
]

NO_TYPE = DALIDataType.NO_TYPE
UINT8 = DALIDataType.UINT8
UINT16 = DALIDataType.UINT16
UINT32 = DALIDataType.UINT32
UINT64 = DALIDataType.UINT64
INT8 = DALIDataType.INT8
INT16 = DALIDataType.INT16
INT32 = DALIDataType.INT32
INT64 = DALIDataType.INT64
FLOAT16 = DALIDataType.FLOAT16
FLOAT = DALIDataType.FLOAT
FLOAT64 = DALIDataType.FLOAT64
BOOL = DALIDataType.BOOL
STRING = DALIDataType.STRING

RGB = DALIImageType.RGB
BGR = DALIImageType.BGR
GRAY = DALIImageType.GRAY
YCbCr = DALIImageType.YCbCr
ANY_DATA = DALIImageType.ANY_DATA

INTERP_NN = DALIInterpType.INTERP_NN
INTERP_LINEAR = DALIInterpType.INTERP_LINEAR
INTERP_CUBIC = DALIInterpType.INTERP_CUBIC
INTERP_LANCZOS3 = DALIInterpType.INTERP_LANCZOS3
INTERP_TRIANGULAR = DALIInterpType.INTERP_TRIANGULAR
INTERP_GAUSSIAN = DALIInterpType.INTERP_GAUSSIAN


def Constant(
    value: Any,
    dtype: Any = None,
    shape: Sequence[int] | None = None,
    layout: str | None = None,
    device: str | None = None,
    **kwargs: Any,
) -> ScalarConstant | DataNode:
    """A constant (DALI's ``types.Constant``).

    A scalar with no ``shape``, ``layout``, ``device`` or other options is a
    :class:`ScalarConstant`: a number in arithmetic on DataNodes (with its
    DALI type), or a constant op where an op takes it as input. Anything else
    (an array, a list, a shape, ...) is a constant op's output: the same array
    for every sample, made inside the pipeline definition. As in DALI, an
    array of float64 becomes float32, and of int64 int32, unless ``dtype`` is
    given.
    """
    scalar = isinstance(value, (bool, int, float, np.generic))
    if scalar and shape is None and layout is None and device is None and not kwargs:
        return ScalarConstant(value, dtype)
    if current_graph() is None:
        raise TypeError(
            "types.Constant of an array makes a constant op: call it inside a pipeline "
            "definition (or give a scalar, which works anywhere)"
        )
    array = _arith.downcast(np.asarray(value), dtype)
    if dtype is not None:
        array = array.astype(as_numpy_dtype(dtype))
    is_float = array.dtype.kind == "f"
    out: DataNode = fn.constant(
        fdata=array if is_float else None,
        idata=None if is_float else array,
        shape=shape if shape is not None else array.shape,
        dtype=array.dtype,
        layout=layout,
        device=device,
        name=kwargs.pop("name", None),
    )
    return out
