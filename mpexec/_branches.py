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


def mask(column: Any, predicate: str, branch: bool, logical: str | None) -> np.ndarray[Any, Any]:
    """Which samples of ``column`` (a predicate's) take ``branch``.

    Each sample must be a scalar: a number (true where nonzero) for an
    ``if``, a bool for the left side of ``and``/``or`` (``logical``), as in DALI.
    """
    how = logical or "if"
    if (
        isinstance(column, np.ndarray)
        and column.ndim == 1
        and column.dtype.kind in ("b" if logical else "biuf")
    ):
        found = column.astype(bool)  # a dense block of scalars: checked as a whole
    else:
        found = np.zeros(len(column), dtype=bool)
        for j, v in enumerate(column):
            try:
                found[j] = _arith.truth(v, how, "left")
            except ConditionalError as exc:
                raise ConditionalError(
                    f"{exc} (the predicate {predicate!r}, in sample {j} of its batch)"
                ) from None
    return found if branch else ~found


def split(column: Any, taken: np.ndarray[Any, Any]) -> list[Any]:
    """The rows of ``column`` where ``taken`` is set."""
    return [_row(column, j) for j in np.flatnonzero(taken)]


def merge(yes: Any, no: Any, taken: np.ndarray[Any, Any], what: Merged) -> list[Any]:
    """Rows of ``yes`` where ``taken`` is set and of ``no`` elsewhere, in order."""
    if what.logical is not None:  # `and`/`or`: one side is the left operand, checked already
        for j in range(len(yes)):
            _arith.truth(_row(yes, j), what.logical, "right")
        for j in range(len(no)):
            _arith.truth(_row(no, j), what.logical, "right")
    if len(yes) and len(no):
        a, b = _row(yes, 0), _row(no, 0)
        if a.dtype != b.dtype or a.ndim != b.ndim:
            found = (
                f"types: {a.dtype} and {b.dtype}"
                if a.dtype != b.dtype
                else f"sample dimensions: {a.ndim} and {b.ndim}"
            )
            raise ConditionalError(
                "Divergent data found in different branches of conditional operation. All "
                "paths in conditional operation are merged into one batch which must have "
                "consistent type, number of dimensions, layout and other metadata. Found "
                f"distinct {found} ({what.variable} is {a.dtype} of rank {a.ndim} in the "
                f"`if` branch, {b.dtype} of rank {b.ndim} in the `else` branch)"
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
    return merged


def _row(column: Any, j: Any) -> Any:
    """Sample ``j`` of a column: a list's item, or a view of a dense block's row.

    (``block[j, ...]``: a 0-d array where ``block[j]`` would be a NumPy scalar.)
    """
    return column[j, ...] if isinstance(column, np.ndarray) else column[j]
