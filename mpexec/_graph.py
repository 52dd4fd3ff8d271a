"""The pipeline graph: ops, their outputs (DataNodes), and the graph being defined.

``fn.*`` calls made while a pipeline is being defined add an :class:`Op` to
the :class:`Graph` of that definition (one per thread) and return
:class:`DataNode` handles. At build time :meth:`Graph.plan` prunes ops that
no output needs, merges identical stateless ops and orders the rest.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _arith
from ._errors import MpexecError

#: DALI's limit on the inputs of one python_function.
MAX_INPUTS = 256


class DataNode:
    """One output of an op in a pipeline definition (what ``fn.*`` calls return)."""

    __slots__ = ("index", "op")

    def __init__(self, op: Op, index: int) -> None:
        self.op = op
        self.index = index

    @property
    def name(self) -> str:
        return self.op.name if self.op.num_outputs == 1 else f"{self.op.name}[{self.index}]"

    def __repr__(self) -> str:
        return f"DataNode({self.name!r})"

    def __bool__(self) -> bool:
        raise TypeError(
            f"{self!r} is a node of a pipeline graph, not data: it has no truth value "
            "while the pipeline is being defined (mpexec does not rewrite `if` statements "
            "as DALI's enable_conditionals does). Put conditions inside the op's function"
        )

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            f"{self!r} is one output; to get several, give the op num_outputs=N and "
            "unpack its result"
        )

    # ------------------------------------------------------------ arithmetic
    # DALI's arithmetic operators: each adds a per-sample op (mpexec._arith).
    __hash__ = object.__hash__  # == builds a node; identity stays the hash

    def __add__(self, other: Any) -> DataNode:
        return expression("add", self, other)

    def __radd__(self, other: Any) -> DataNode:
        return expression("add", other, self)

    def __sub__(self, other: Any) -> DataNode:
        return expression("sub", self, other)

    def __rsub__(self, other: Any) -> DataNode:
        return expression("sub", other, self)

    def __mul__(self, other: Any) -> DataNode:
        return expression("mul", self, other)

    def __rmul__(self, other: Any) -> DataNode:
        return expression("mul", other, self)

    def __truediv__(self, other: Any) -> DataNode:
        return expression("truediv", self, other)

    def __rtruediv__(self, other: Any) -> DataNode:
        return expression("truediv", other, self)

    def __floordiv__(self, other: Any) -> DataNode:
        return expression("floordiv", self, other)

    def __rfloordiv__(self, other: Any) -> DataNode:
        return expression("floordiv", other, self)

    def __mod__(self, other: Any) -> DataNode:
        return expression("mod", self, other)

    def __rmod__(self, other: Any) -> DataNode:
        return expression("mod", other, self)

    def __pow__(self, other: Any) -> DataNode:
        return expression("pow", self, other)

    def __rpow__(self, other: Any) -> DataNode:
        return expression("pow", other, self)

    def __and__(self, other: Any) -> DataNode:
        return expression("and", self, other)

    def __rand__(self, other: Any) -> DataNode:
        return expression("and", other, self)

    def __or__(self, other: Any) -> DataNode:
        return expression("or", self, other)

    def __ror__(self, other: Any) -> DataNode:
        return expression("or", other, self)

    def __xor__(self, other: Any) -> DataNode:
        return expression("xor", self, other)

    def __rxor__(self, other: Any) -> DataNode:
        return expression("xor", other, self)

    def __lshift__(self, other: Any) -> DataNode:
        return expression("lshift", self, other)

    def __rlshift__(self, other: Any) -> DataNode:
        return expression("lshift", other, self)

    def __rshift__(self, other: Any) -> DataNode:
        return expression("rshift", self, other)

    def __rrshift__(self, other: Any) -> DataNode:
        return expression("rshift", other, self)

    def __eq__(self, other: object) -> DataNode:  # type: ignore[override]
        return expression("eq", self, other)

    def __ne__(self, other: object) -> DataNode:  # type: ignore[override]
        return expression("ne", self, other)

    def __lt__(self, other: Any) -> DataNode:
        return expression("lt", self, other)

    def __le__(self, other: Any) -> DataNode:
        return expression("le", self, other)

    def __gt__(self, other: Any) -> DataNode:
        return expression("gt", self, other)

    def __ge__(self, other: Any) -> DataNode:
        return expression("ge", self, other)

    def __neg__(self) -> DataNode:
        return expression("neg", self)

    def __pos__(self) -> DataNode:
        return expression("pos", self)

    def __abs__(self) -> DataNode:
        return expression("abs", self)

    def __invert__(self) -> DataNode:
        return expression("invert", self)

    def __getitem__(self, key: Any) -> DataNode:
        parts = _arith.check_key(key)
        layout = _arith.subscript_layout(self.layout, parts)
        return _add_op("subscript", (self,), _arith.Subscript(parts), layout)

    @property
    def layout(self) -> str | None:
        """The layout its op declares for it (``output_layouts``), or None."""
        layouts = self.op.output_layouts
        return layouts[self.index] if self.index < len(layouts) else None


@dataclass(eq=False)
class Op:
    """One op of the graph, as defined (see ``fn.python_function``)."""

    kind: str  # "python_function" | "external_source"
    name: str
    index: int  # position in the definition: the op's identity for seeding
    inputs: tuple[DataNode, ...]
    function: Any
    num_outputs: int = 1
    batch_processing: bool = False
    output_layouts: tuple[str | None, ...] = ()
    preserve: bool = False
    seed: int = -1
    device: str = "cpu"
    bytes_per_sample_hint: int = 0
    stateful: bool = False
    output_dtypes: tuple[np.dtype[Any] | None, ...] | None = None
    output_shapes: tuple[tuple[int | None, ...] | None, ...] | None = None
    dlpack: bool = False
    # external_source: "sample" (callable in workers), "batch" (callable here),
    # "iter" (iterable or generator here), "feed" (pipe.feed_input)
    source_mode: str = ""
    cycle: Any = False
    outputs: tuple[DataNode, ...] = field(default=(), repr=False)

    @property
    def is_source(self) -> bool:
        return self.kind == "external_source"

    def describe(self) -> str:
        return f"{self.kind} '{self.name}'"

    def key(self) -> tuple[Any, ...] | None:
        """What makes two ops interchangeable, or None if this one never is.

        Stateful ops, sources and sinks are never merged, nor are ops with a
        derived seed: two random ops stay independent unless they share a seed.
        """
        if self.stateful or self.is_source or self.preserve or self.num_outputs == 0:
            return None
        if self.seed == -1:
            return None
        return (
            self.kind,
            id(self.function),
            tuple((id(n.op), n.index) for n in self.inputs),
            self.num_outputs,
            self.batch_processing,
            self.output_layouts,
            self.seed,
            self.device,
            self.output_dtypes,
            self.output_shapes,
            self.dlpack,
        )


class Graph:
    """The ops of one pipeline definition, in definition order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.outputs: tuple[DataNode, ...] = ()
        self.names: set[str] = set()
        self.device_id: int | None = None  # the pipeline's, for GPU ops' definition checks
        # The pipeline's, for ops that need them when defined (readers).
        self.seed: int | None = None
        self.batch_size: int | None = None
        self.frozen = False  # built: no more ops

    def add(self, op: Op) -> Op:
        if self.frozen:
            raise MpexecError(
                f"cannot add {op.describe()}: this pipeline was already built from its graph"
            )
        if op.name in self.names:
            raise ValueError(f"two ops are named {op.name!r}; op names must be unique")
        self.names.add(op.name)
        self.ops.append(op)
        op.outputs = tuple(DataNode(op, i) for i in range(op.num_outputs))
        return op

    def unique_name(self, kind: str) -> str:
        n = sum(1 for op in self.ops if op.kind == kind)
        while f"{kind}_{n}" in self.names:
            n += 1
        return f"{kind}_{n}"

    def set_outputs(self, outputs: tuple[Any, ...]) -> None:
        nodes: list[DataNode] = []
        for i, out in enumerate(outputs):
            if not isinstance(out, DataNode):
                raise TypeError(
                    f"pipeline output {i} is {type(out).__name__}; a pipeline returns the "
                    "DataNodes that fn.* calls give (or a tuple of them)"
                )
            if out.op not in self.ops:
                raise ValueError(f"pipeline output {i} ({out!r}) belongs to another pipeline")
            nodes.append(out)
        self.outputs = tuple(nodes)

    def plan(self) -> Plan:
        """Prune, merge and order the ops for running."""
        canon: dict[int, Op] = {}  # id(op) -> the op that runs in its place
        seen: dict[tuple[Any, ...], Op] = {}
        for op in self.ops:
            remapped = tuple(canon[id(n.op)].outputs[n.index] for n in op.inputs)
            if any(a is not b for a, b in zip(remapped, op.inputs, strict=True)):
                op.inputs = remapped  # compared by identity: == on DataNodes builds a node
            k = op.key()
            if k is not None and k in seen:
                canon[id(op)] = seen[k]
                continue
            if k is not None:
                seen[k] = op
            canon[id(op)] = op
        outputs = tuple(canon[id(n.op)].outputs[n.index] for n in self.outputs)
        kept = {
            id(op)
            for op in self.ops
            if canon[id(op)] is op
            and (op.stateful or op.preserve or op.num_outputs == 0 or op.is_source)
        }
        stack = [n.op for n in outputs] + [op for op in self.ops if id(op) in kept]
        live: set[int] = set()
        while stack:
            op = stack.pop()
            if id(op) in live:
                continue
            live.add(id(op))
            stack.extend(n.op for n in op.inputs)
        ops = [op for op in self.ops if id(op) in live]  # definition order is topological
        return Plan(ops, outputs, merged=sum(1 for o in self.ops if canon[id(o)] is not o))


@dataclass
class Plan:
    """The ops to run, in an order where inputs come first, and the outputs."""

    ops: list[Op]
    outputs: tuple[DataNode, ...]
    merged: int = 0

    @property
    def sources(self) -> list[Op]:
        return [op for op in self.ops if op.is_source]


def expression(name: str, *operands: Any) -> DataNode:
    """``operands[0] (name) operands[1]`` (or a unary ``name``) as an op of the current graph.

    A constant op's value goes into the function, as a number would (no
    copy of it per sample), unless the expression has no other DataNode.
    """
    fold = any(
        isinstance(x, DataNode) and not isinstance(x.op.function, _arith.ConstantSource)
        for x in operands
    )
    nodes: list[DataNode] = []
    consts: list[Any] = []
    for x in operands:
        if not isinstance(x, DataNode):
            consts.append(_arith.constant(x))
        elif fold and isinstance(x.op.function, _arith.ConstantSource):
            consts.append(x.op.function.value)
        else:
            nodes.append(x)
            consts.append(None)
    # The result keeps its inputs' layout, as in DALI.
    layout = next((n.layout for n in nodes if n.layout), None)
    return _add_op("arithmetic", tuple(nodes), _arith.Expression(name, tuple(consts)), layout)


def _add_op(kind: str, inputs: tuple[DataNode, ...], function: Any, layout: str | None) -> DataNode:
    graph = current_graph()
    if graph is None:
        raise MpexecError(
            "arithmetic on DataNodes belongs inside a pipeline definition, like the fn.* calls"
        )
    for x in inputs:
        if x.op not in graph.ops:
            raise ValueError(f"{kind}: {x!r} belongs to another pipeline")
    op = Op(
        kind="python_function",
        name=graph.unique_name(kind),
        index=len(graph.ops),
        inputs=inputs,
        function=function,
        output_layouts=(layout,),
        device="gpu" if any(x.op.device == "gpu" for x in inputs) else "cpu",
    )
    return graph.add(op).outputs[0]


_local = threading.local()


def current_graph() -> Graph | None:
    """The graph being defined in this thread (inside a pipeline definition), or None."""
    return getattr(_local, "graph", None)


@contextlib.contextmanager
def defining(graph: Graph) -> Iterator[Graph]:
    """Make ``graph`` the one ``fn.*`` calls add to, in this thread."""
    outer = current_graph()
    _local.graph = graph
    try:
        yield graph
    finally:
        _local.graph = outer
