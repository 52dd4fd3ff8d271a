"""Arithmetic on DataNodes (``a + b``, ``a * 2``, ``a > b``, ``x[1:3]``), as DALI's arithmetic ops.

An expression on DataNodes adds one per-sample op to the graph (built in
:mod:`mpexec._graph`); its function is an :class:`Expression` defined here,
which runs in the workers like any python_function (and is fused with the
per-sample ops around it). Constants in the expression travel inside the
function, not as inputs.

The result's type follows DALI's promotion rules, not NumPy's (checked
against DALI 2.4, which differ from NumPy's where marked):

- a Python ``int`` is an INT32 constant, a ``float`` a FLOAT (float32) one,
  a ``bool`` a BOOL one (NumPy 2 would keep the tensor's type);
- integers of one signedness give the wider; a signed and an unsigned give a
  signed type twice the unsigned one's width (capped at 64 bits), or the
  signed one's if wider (NumPy: ``uint64 + int64`` is float64; DALI int64);
- an integer and a float give the float (NumPy: ``int64 + float32`` is
  float64; DALI float32); two floats give the wider;
- ``/`` of two integers is float32 (NumPy: float64); comparisons are bool.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ._errors import ConditionalError
from ._types import ScalarConstant

BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "pow": operator.pow,
    "and": operator.and_,
    "or": operator.or_,
    "xor": operator.xor,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
}
UNARY: dict[str, Callable[[Any], Any]] = {
    "neg": operator.neg,
    "pos": operator.pos,
    "abs": operator.abs,
    "invert": operator.invert,
}
#: ``mpexec.math``'s functions (DALI's ``nvidia.dali.math``): computed in floating
#: point, float32 for integer inputs (DALI's rule), the input's float type otherwise.
MATH_UNARY: dict[str, Callable[[Any], Any]] = {
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x),
    "cbrt": np.cbrt,
    "exp": np.exp,
    "log": np.log,
    "log2": np.log2,
    "log10": np.log10,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "tanh": np.tanh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "floor": np.floor,
    "ceil": np.ceil,
    "fabs": np.fabs,
}
#: Two operands: ``fpow`` and ``atan2`` in floating point; ``min``/``max`` in the
#: operands' promoted type (as the operators).
MATH_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "fpow": np.power,
    "atan2": np.arctan2,
    "min": np.minimum,
    "max": np.maximum,
}
_FLOATING = frozenset({"fpow", "atan2"})

_COMPARISONS = frozenset({"eq", "ne", "lt", "le", "gt", "ge"})
#: What DALI 2.4 refuses on two bools (``*`` and the bitwise operators it computes).
_NOT_ON_BOOLS = frozenset({"add", "sub", "truediv", "floordiv", "mod", "pow"})
_BOOL = np.dtype(np.bool_)


def promote(a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """DALI's type of ``a (op) b`` for the arithmetic operators (see the module doc)."""
    if a == b:
        return a
    if a == _BOOL:
        return b
    if b == _BOOL:
        return a
    a_float, b_float = a.kind == "f", b.kind == "f"
    if a_float or b_float:
        if a_float and b_float:
            return a if a.itemsize >= b.itemsize else b
        return a if a_float else b
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    signed, unsigned = (a, b) if a.kind == "i" else (b, a)
    size = max(signed.itemsize, min(2 * unsigned.itemsize, 8))
    return np.dtype(f"int{8 * size}")


def result_type(name: str, a: np.dtype[Any], b: np.dtype[Any]) -> np.dtype[Any]:
    """The type both operands are cast to before ``name`` is applied."""
    t = promote(a, b)
    if name == "truediv" and t.kind != "f":
        return np.dtype(np.float32)
    return t


def floating(t: np.dtype[Any]) -> np.dtype[Any]:
    """The type a math function computes in: ``t`` if a float, else float32 (DALI's)."""
    return t if t.kind == "f" else np.dtype(np.float32)


def constant(value: Any) -> ScalarConstant | np.ndarray[Any, Any]:
    """An operand that is not a DataNode, as DALI reads it: a scalar or an array."""
    if isinstance(value, ScalarConstant):
        return value
    if isinstance(value, (bool, int, float, np.generic)):
        return ScalarConstant(value)
    if isinstance(value, (list, tuple, np.ndarray)):
        return downcast(np.asarray(value), None)
    raise TypeError(
        f"an expression on DataNodes takes DataNodes, numbers and arrays, not "
        f"{type(value).__name__}"
    )


def downcast(array: np.ndarray[Any, Any], dtype: Any) -> np.ndarray[Any, Any]:
    """DALI's constant arrays: float64 becomes float32, and int64 int32 unless asked for
    (0-d arrays keep their type, as in DALI 2.4)."""
    if dtype is not None or array.ndim == 0:
        return array
    if array.dtype == np.float64:
        return array.astype(np.float32)
    if array.dtype == np.int64:
        return array.astype(np.int32)
    return array


class Expression:
    """One operator applied per sample: the function of an arithmetic op.

    ``operands`` holds, per operand, a constant (a :class:`ScalarConstant`
    or an array) or None where the next input array goes.
    """

    def __init__(self, name: str, operands: tuple[Any, ...]) -> None:
        self.name = name
        self.operands = operands

    def __call__(self, *arrays: Any) -> Any:
        it = iter(arrays)
        # A scalar goes as a NumPy scalar of its type, which device arrays take too.
        values = [
            next(it) if c is None else c.value if isinstance(c, ScalarConstant) else c
            for c in self.operands
        ]
        if len(values) == 1:
            if self.name in UNARY:
                return UNARY[self.name](values[0])
            x = values[0]
            return MATH_UNARY[self.name](x.astype(floating(x.dtype), copy=False))
        if len(values) == 3:  # clamp(x, lo, hi), in the three's promoted type
            x, lo, hi = values
            t = promote(promote(x.dtype, lo.dtype), hi.dtype)
            return np.clip(x.astype(t, copy=False), lo.astype(t), hi.astype(t))
        a, b = values
        if self.name in MATH_BINARY:
            t = promote(a.dtype, b.dtype)
            if self.name in _FLOATING:
                t = floating(t)
            return MATH_BINARY[self.name](a.astype(t, copy=False), b.astype(t, copy=False))
        # (NumPy's bool dtype is one object: an identity test costs a light op nothing.)
        if a.dtype is _BOOL and b.dtype is _BOOL and self.name in _NOT_ON_BOOLS:
            raise TypeError(
                f"arithmetic `{self.name}` is not defined on two bool inputs (as in DALI): "
                "cast one first, or use `|`, `&`, `^` or `*` on bools"
            )
        t = result_type(self.name, a.dtype, b.dtype)
        return BINARY[self.name](a.astype(t, copy=False), b.astype(t, copy=False))

    def __repr__(self) -> str:
        return f"Expression({self.name!r})"


def truth(value: Any, how: str, side: str = "") -> bool:
    """The truth of one sample in DALI's conditionals, checked as DALI checks it.

    ``how``: ``"if"`` (a predicate) or ``"not"``: a scalar (0-d) number, true
    where nonzero; ``"and"``/``"or"`` (``side``: ``"left"``/``"right"``): a
    scalar bool. DALI's words, with a hint.
    """
    dtype = getattr(value, "dtype", None)
    ndim = getattr(value, "ndim", None)
    numeric = dtype is not None and dtype.kind in "biuf"
    if how in ("and", "or"):
        if ndim == 0 and dtype == _BOOL:
            return bool(value)
        got = f"a {ndim}-d input" if numeric and ndim else f"an input of type `{dtype}`"
        raise ConditionalError(
            f"Logical expression `{how}` is restricted to scalar (0-d tensors) inputs of "
            f"`bool` type, that are placed on CPU. Got {got} as the {side} argument in "
            "logical expression. (Compare, x > 0, to make a bool)"
        )
    if ndim == 0 and numeric:
        return bool(value)
    got = f"a {ndim}-d input" if numeric else f"an input of type `{dtype or type(value).__name__}`"
    if how == "not":
        raise ConditionalError(
            "Logical expression `not` is restricted to scalar (0-d tensors) inputs, that are "
            f"placed on CPU. Got {got} in logical expression"
        )
    raise ConditionalError(
        "Conditions inside `if` statements are restricted to scalar (0-d tensors) inputs, "
        f"that are placed on CPU. Got {got} as a condition of the `if` statement"
    )


class LogicalNot:
    """``not x`` per sample, for a DataNode: DALI's ``fn._conditional.not_``."""

    def __call__(self, x: Any) -> Any:
        return np.array(not truth(x, "not"))

    def __repr__(self) -> str:
        return "LogicalNot()"


class ConstantSource:
    """The source of a constant op: the same array for every sample.

    An expression folds a constant op's value into its function instead of
    taking the op's samples as input (no copy per sample).
    """

    def __init__(self, value: np.ndarray[Any, Any]) -> None:
        self.value = value

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        return self.value

    def __repr__(self) -> str:
        return f"ConstantSource(shape={self.value.shape}, dtype={self.value.dtype})"


class Subscript:
    """``x[key]`` per sample, for a key of ints, slices and Ellipsis."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __call__(self, x: Any) -> Any:
        return x[self.key]

    def __repr__(self) -> str:
        return f"Subscript({self.key!r})"


def check_key(key: Any) -> tuple[Any, ...]:
    """A subscript's key, as a tuple; TypeError for what cannot index a sample here."""
    parts = key if isinstance(key, tuple) else (key,)
    for p in parts:
        if p is Ellipsis or (isinstance(p, (int, np.integer)) and not isinstance(p, bool)):
            continue
        if isinstance(p, slice) and all(
            v is None or isinstance(v, (int, np.integer)) for v in (p.start, p.stop, p.step)
        ):
            continue
        raise TypeError(
            f"a DataNode is indexed with ints, slices of ints and ... here, not {p!r} "
            "(index with data in a python_function instead)"
        )
    return tuple(parts)


def subscript_layout(layout: str | None, parts: tuple[Any, ...]) -> str | None:
    """The layout of ``x[parts]``: ``x``'s, less the axes an integer index removes."""
    if not layout:
        return None
    explicit = sum(1 for p in parts if p is not Ellipsis)
    if explicit > len(layout) or sum(1 for p in parts if p is Ellipsis) > 1:
        return None  # an error when it runs; no layout to guess
    axes: list[Any] = []
    for p in parts:
        axes += [slice(None)] * (len(layout) - explicit) if p is Ellipsis else [p]
    axes += [slice(None)] * (len(layout) - len(axes))
    return "".join(c for c, p in zip(layout, axes, strict=True) if isinstance(p, slice)) or None
