"""The pipeline graph: ops, their outputs (DataNodes), and the graph being defined.

``fn.*`` calls made while a pipeline is being defined add an :class:`Op` to
the :class:`Graph` of that definition (one per thread) and return
:class:`DataNode` handles. At build time :meth:`Graph.plan` prunes ops that
no output needs, merges identical stateless ops and orders the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
            "while the pipeline is being defined. Put conditions inside the op's function"
        )

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(
            f"{self!r} is one output; to get several, give the op num_outputs=N and "
            "unpack its result"
        )


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

    def add(self, op: Op) -> Op:
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

    def fingerprint(self) -> str:
        """A digest of the definition: ops, their wiring and parameters, function names.

        The same definition gives the same digest in any process (no ids, no
        code objects: a fixed function body still matches); a state from
        another graph (``Pipeline.state_dict``) does not. Taken before
        :meth:`plan` rewires merged ops, and kept.
        """
        cached: str | None = getattr(self, "_fingerprint", None)
        if cached is not None:
            return cached
        h = hashlib.sha256()
        for op in self.ops:
            fields = (
                op.kind,
                op.name,
                op.index,
                tuple((n.op.name, n.index) for n in op.inputs),
                op.num_outputs,
                op.batch_processing,
                op.output_layouts,
                op.preserve,
                op.seed,
                op.device,
                op.stateful,
                op.output_dtypes,
                op.output_shapes,
                op.dlpack,
                op.source_mode,
                op.cycle,
                _name_of(op.function),
            )
            h.update(repr(fields).encode())
        h.update(repr(tuple((n.op.name, n.index) for n in self.outputs)).encode())
        self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def plan(self) -> Plan:
        """Prune, merge and order the ops for running."""
        self.fingerprint()  # before merged ops are rewired
        canon: dict[int, Op] = {}  # id(op) -> the op that runs in its place
        seen: dict[tuple[Any, ...], Op] = {}
        for op in self.ops:
            remapped = tuple(canon[id(n.op)].outputs[n.index] for n in op.inputs)
            if remapped != op.inputs:
                op.inputs = remapped
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


def _name_of(function: Any) -> str:
    """A function's qualified name; for data (a list given as a source), its type.

    Not its module's: a script's functions live in ``__main__`` when it runs,
    and in a module of its name when another process imports it.
    """
    if callable(function):
        return str(getattr(function, "__qualname__", None) or type(function).__qualname__)
    return f"<{type(function).__qualname__}>"


@dataclass
class Plan:
    """The ops to run, in an order where inputs come first, and the outputs."""

    ops: list[Op]
    outputs: tuple[DataNode, ...]
    merged: int = 0

    @property
    def sources(self) -> list[Op]:
        return [op for op in self.ops if op.is_source]


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
