"""DALI's ``nvidia.dali.math`` for mpexec: elementwise functions on DataNodes.

``import mpexec.math as dmath`` stands where ``import nvidia.dali.math as
dmath`` stood. Each call adds a per-sample op, as the arithmetic operators
do (it runs in the workers and is fused with the per-sample ops around it);
operands are DataNodes, numbers or ``types.Constant``. Floating functions of
integer inputs compute in float32, as DALI's do; ``abs``, ``min``, ``max``
and ``clamp`` keep the operands' promoted type; ``pow`` is ``**``, ``fpow``
its floating-point form.
"""

from __future__ import annotations

from typing import Any

from ._graph import DataNode, expression

__all__ = [
    "abs",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atan2",
    "atanh",
    "cbrt",
    "ceil",
    "clamp",
    "cos",
    "cosh",
    "exp",
    "fabs",
    "floor",
    "fpow",
    "log",
    "log2",
    "log10",
    "max",
    "min",
    "pow",
    "rsqrt",
    "sin",
    "sinh",
    "sqrt",
    "tan",
    "tanh",
]


def _unary(name: str) -> Any:
    def function(input: Any) -> DataNode:
        return expression(name, input)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"DALI's ``math.{name}``, per sample."
    return function


def _binary(name: str) -> Any:
    def function(left: Any, right: Any) -> DataNode:
        return expression(name, left, right)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"DALI's ``math.{name}(left, right)``, per sample."
    return function


sqrt = _unary("sqrt")
rsqrt = _unary("rsqrt")
cbrt = _unary("cbrt")
exp = _unary("exp")
log = _unary("log")
log2 = _unary("log2")
log10 = _unary("log10")
sin = _unary("sin")
cos = _unary("cos")
tan = _unary("tan")
asin = _unary("asin")
acos = _unary("acos")
atan = _unary("atan")
sinh = _unary("sinh")
cosh = _unary("cosh")
tanh = _unary("tanh")
asinh = _unary("asinh")
acosh = _unary("acosh")
atanh = _unary("atanh")
floor = _unary("floor")
ceil = _unary("ceil")
fabs = _unary("fabs")
abs = _unary("abs")
pow = _binary("pow")
fpow = _binary("fpow")
atan2 = _binary("atan2")
min = _binary("min")
max = _binary("max")


def clamp(input: Any, lo: Any, hi: Any) -> DataNode:
    """DALI's ``math.clamp``: ``input`` limited to ``[lo, hi]``, per sample."""
    return expression("clamp", input, lo, hi)
