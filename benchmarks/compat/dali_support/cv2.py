"""Stand-in for the one OpenCV call DALI's python_function tests make (on a failure)."""

from __future__ import annotations

from typing import Any

import numpy as np


def imwrite(path: str, image: Any) -> bool:
    """Write ``image`` (HWC, BGR as OpenCV has it) to ``path``."""
    from PIL import Image

    array = np.asarray(image)
    if array.ndim == 3 and array.shape[2] == 3:
        array = array[:, :, ::-1]
    Image.fromarray(np.ascontiguousarray(array)).save(path)
    return True
