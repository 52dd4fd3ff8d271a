"""Stand-in for the two helpers DALI's python_function tests import from DALI's ``test_utils``."""

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
