"""The rows of a batch per branch of an ``if`` on a DataNode: masks, splits, merges.

What the scheduler does with the split and merge ops of DALI's conditional
execution (:mod:`mpexec._conditionals` builds them): a branch's samples are
its parent's where the predicate is (not) set; a split takes those rows of a
column, a merge puts two branches' rows back in the parent's order. Rows are
the arrays themselves (a dense block's rows are views): nothing is copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _arith
from ._errors import ConditionalError
from ._graph import Merged


def mask(column: Any, predicate: str, branch: bool) -> np.ndarray[Any, Any]:
    """Which samples of ``column`` (a predicate's) take ``branch``; each must be a scalar bool."""
    if isinstance(column, np.ndarray) and column.dtype == np.bool_ and column.ndim == 1:
        found = column.copy()  # a dense block of scalar bools: checked as a whole
    else:
        found = np.zeros(len(column), dtype=bool)
        for j, v in enumerate(column):
            if getattr(v, "dtype", None) != np.bool_ or getattr(v, "ndim", None) != 0:
                raise ConditionalError(
                    f"the predicate {predicate!r} of an `if` (or `and`/`or`) on a DataNode "
                    f"is {_describe(v)} in sample {j} of its batch: a predicate must be a "
                    "scalar (0-d) bool per sample, as in DALI. Compare (x > 0) or cast "
                    "(x.astype(bool) in a python_function) to make one"
                )
            found[j] = bool(v)
    return found if branch else ~found


def split(column: Any, taken: np.ndarray[Any, Any]) -> list[Any]:
    """The rows of ``column`` where ``taken`` is set."""
    return [_row(column, j) for j in np.flatnonzero(taken)]


def merge(yes: Any, no: Any, taken: np.ndarray[Any, Any], what: Merged) -> list[Any]:
    """Rows of ``yes`` where ``taken`` is set and of ``no`` elsewhere, in order."""
    if len(yes) and len(no):
        a, b = _row(yes, 0), _row(no, 0)
        if a.dtype != b.dtype or a.ndim != b.ndim:
            raise ConditionalError(
                f"{what.variable}, set in both branches of an `if` on a DataNode, is "
                f"{a.dtype} of rank {a.ndim} in the `if` branch and {b.dtype} of rank "
                f"{b.ndim} in the `else` branch; the branches' samples are merged into one "
                "batch, so they need one dtype and one rank (as in DALI)"
            )
    merged: list[Any] = []
    i = k = 0
    for m in taken:
        if m:
            merged.append(_row(yes, i))
            i += 1
        else:
            merged.append(_row(no, k))
            k += 1
    assert i == len(yes), (i, len(yes))
    assert k == len(no), (k, len(no))
    if what.logical is not None:
        for x in merged:
            _arith.check_logical(x, what.logical, "right side")
    return merged


def _row(column: Any, j: Any) -> Any:
    """Sample ``j`` of a column: a list's item, or a view of a dense block's row.

    (``block[j, ...]``: a 0-d array where ``block[j]`` would be a NumPy scalar.)
    """
    return column[j, ...] if isinstance(column, np.ndarray) else column[j]


def _describe(value: Any) -> str:
    dtype, ndim = getattr(value, "dtype", None), getattr(value, "ndim", None)
    if dtype is None:
        return f"a {type(value).__name__}"
    return f"{dtype} of shape {getattr(value, 'shape', ())}" if ndim else f"a {dtype} scalar"
