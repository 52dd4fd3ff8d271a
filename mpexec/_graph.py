"""The pipeline graph: ops, their outputs (DataNodes), and the graph being defined.

``fn.*`` calls made while a pipeline is being defined add an :class:`Op` to
the :class:`Graph` of that definition (one per thread) and return
:class:`DataNode` handles. At build time :meth:`Graph.plan` prunes ops that
no output needs, merges identical stateless ops and orders the rest.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _arith
from ._errors import ConditionalError, MpexecError
from ._modes import Device, OpKind, Reseed, SourceMode

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
        graph = current_graph()
        if graph is not None and graph.conditions is not None:
            raise TypeError(
                f"{self!r} is a node of a pipeline graph, not data: it has no truth value "
                "while the pipeline is being defined. With enable_conditionals=True, mpexec "
                "rewrites the `if` statements and `and`/`or`/`not` of the pipeline function "
                "and of the functions it calls, where their source can be read; this one was "
                "not rewritten (a `while`, a conditional expression `a if p else b`, a "
                "lambda, a `with pipe:` block, a function without source or marked "
                "do_not_convert, or bool() called on it)"
            )
        raise TypeError(
            f"{self!r} is a node of a pipeline graph, not data: it has no truth value "
            "while the pipeline is being defined. To run ops per sample on a condition, "
            "give pipeline_def enable_conditionals=True (DALI's conditional execution), or "
            "put the condition inside the op's function"
        )

    # Not iterable, as DALI's DataNode (code tells one output from a list of them by
    # isinstance(x, Iterable)); without this, indexing would make Python iterate it.
    __iter__ = None

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
class Scope:
    """The samples of one branch of an ``if`` on a DataNode (DALI's conditional execution).

    Those of ``parent`` (None: the whole batch) where ``predicate`` (an
    output in ``parent``: a scalar per sample, true where nonzero) is ``branch``. An op in a
    scope runs only on its samples; ``mpexec._conditionals`` builds scopes
    while the definition runs, and the scheduler works out their samples per
    iteration.
    """

    parent: Scope | None
    predicate: DataNode
    branch: bool
    logical: str | None = None  # made by `and`/`or`: the predicate must be a bool

    def lineage(self) -> Iterator[Scope]:
        """This scope, then its parent, up to the outermost."""
        s: Scope | None = self
        while s is not None:
            yield s
            s = s.parent

    def __repr__(self) -> str:
        return f"Scope({self.predicate!r} is {self.branch}, depth {sum(1 for _ in self.lineage())})"


@dataclass(frozen=True)
class Merged:
    """A merge op's function: what it merges (for messages) and what its samples must be.

    ``logical``: the merge of ``and``/``or`` on DataNodes, whose every sample
    is a scalar bool (DALI's rule).
    """

    variable: str
    logical: str | None = None


@dataclass(eq=False)
class Op:
    """One op of the graph, as defined (see ``fn.python_function``)."""

    kind: OpKind
    name: str
    index: int  # position in the definition: the op's identity for seeding
    inputs: tuple[DataNode, ...]
    function: Any
    num_outputs: int = 1
    batch_processing: bool = False
    output_layouts: tuple[str | None, ...] = ()
    preserve: bool = False
    seed: int = -1
    device: Device = Device.CPU
    bytes_per_sample_hint: int = 0
    stateful: bool = False
    output_dtypes: tuple[np.dtype[Any] | None, ...] | None = None
    output_shapes: tuple[tuple[int | None, ...] | None, ...] | None = None
    dlpack: bool = False
    reseed: Reseed = Reseed.AUTO  # "always": a call is never run twice (see fn.python_function)
    source_mode: SourceMode = SourceMode.NONE  # external_source: how it gives data
    cycle: Any = False
    parallel: bool = False  # external_source(parallel=True): DALI's Python workers asked for
    # Inside an `if` on a DataNode: the samples it runs on and its outputs hold
    # (a split's: the branch it selects); None: the whole batch.
    scope: Scope | None = None
    outputs: tuple[DataNode, ...] = field(default=(), repr=False)

    def waits(self) -> Iterator[DataNode]:
        """What must be computed before it runs: its inputs, and its scopes' predicates."""
        yield from self.inputs
        if self.scope is not None:
            for s in self.scope.lineage():
                yield s.predicate

    @property
    def is_source(self) -> bool:
        return self.kind == OpKind.EXTERNAL_SOURCE

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
            self.reseed,
            id(self.scope),  # the same op in two branches runs on different samples
        )


def callable_name(function: Any) -> str | None:
    """The name an op takes from its function: ``random_crop``, a class's name for an
    instance, the wrapped function's for a ``functools.partial``; None without one."""
    while isinstance(function, functools.partial):
        function = function.func
    if function is None:
        return None
    name = getattr(function, "__name__", None)
    if not isinstance(name, str) and callable(function):
        name = type(function).__name__
    if not isinstance(name, str) or not name.isidentifier():  # "<lambda>", "<genexpr>"
        return None
    return name


class Graph:
    """The ops of one pipeline definition, in definition order."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.outputs: tuple[DataNode, ...] = ()
        self.names: set[str] = set()
        self.auto_names: set[str] = set()  # names mpexec chose (unique_name), not the user
        self.device_id: int | None = None  # the pipeline's, for GPU ops' definition checks
        # The pipeline's, for ops that need them when defined (readers).
        self.seed: int | None = None
        self.batch_size: int | None = None
        self.frozen = False  # built: no more ops
        # enable_conditionals: the `if` scopes being defined (mpexec._conditionals),
        # which place each op added in the current branch.
        self.conditions: Any = None

    def add(self, op: Op, *, auto_named: bool = False) -> Op:
        """Add ``op``; ``auto_named``: its name came from :meth:`unique_name`."""
        if self.frozen:
            raise MpexecError(
                f"cannot add {op.describe()}: this pipeline was already built from its graph"
            )
        if not auto_named and op.name in self.auto_names:
            # A name the user gives wins over one mpexec chose: that op is renamed.
            earlier = next(o for o in self.ops if o.name == op.name)
            self.auto_names.discard(op.name)
            earlier.name = self.unique_name(earlier.kind, earlier.function)  # not op.name
            self.names.add(earlier.name)
            self.auto_names.add(earlier.name)
            self.names.discard(op.name)
        if op.name in self.names:
            raise ValueError(f"two ops are named {op.name!r}; op names must be unique")
        if self.conditions is not None and op.kind not in (OpKind.SPLIT, OpKind.MERGE):
            # Inputs from outside the current branch are split into it first.
            self.conditions.place(op)
            op.index = len(self.ops)  # after the splits placing it added
        self.names.add(op.name)
        if auto_named:
            self.auto_names.add(op.name)
        self.ops.append(op)
        op.outputs = tuple(DataNode(op, i) for i in range(op.num_outputs))
        return op

    def unique_name(self, kind: str, function: Any = None) -> str:
        """A name for an op the user left unnamed: its function's, made unique.

        ``random_crop``, then ``random_crop_1``, ...; ``kind_N`` for a function
        without a usable name (a lambda, a list as a source). Give the op to
        :meth:`add` with ``auto_named=True``: a later op the user gives that
        name takes it, and this one is renamed.
        """
        base = callable_name(function)
        if base is None:
            n = sum(1 for op in self.ops if op.kind == kind)
            while f"{kind}_{n}" in self.names:
                n += 1
            name = f"{kind}_{n}"
        else:
            name, n = base, 0
            while name in self.names:
                n += 1
                name = f"{base}_{n}"
        return name

    def adopt(self, node: DataNode) -> None:
        """Bring in ``node``'s op and those it needs, if they were made outside any
        definition (DALI 2 lets ``fn.*`` run there, and ``set_outputs`` take the result)."""
        loose = getattr(_local, "loose", None)
        if loose is None or self is loose or node.op not in loose.ops:
            return
        needed: set[int] = set()
        stack = [node.op]
        while stack:
            op = stack.pop()
            if id(op) not in needed and op in loose.ops:
                needed.add(id(op))
                stack.extend(n.op for n in op.waits())
        for op in [o for o in loose.ops if id(o) in needed]:
            loose.ops.remove(op)
            loose.names.discard(op.name)
            auto = op.name in loose.auto_names
            loose.auto_names.discard(op.name)
            if auto or op.name in self.names:
                op.name = self.unique_name(op.kind, op.function)
            op.index = len(self.ops)
            self.add(op, auto_named=auto)

    def set_outputs(self, outputs: tuple[Any, ...]) -> None:
        nodes: list[DataNode] = []
        for i, out in enumerate(outputs):
            if not isinstance(out, DataNode):
                raise TypeError(
                    f"pipeline output {i} is {type(out).__name__}; a pipeline returns the "
                    "DataNodes that fn.* calls give (or a tuple of them)"
                )
            self.adopt(out)
            if out.op not in self.ops:
                raise ValueError(f"pipeline output {i} ({out!r}) belongs to another pipeline")
            if out.op.scope is not None:
                raise ConditionalError(
                    f"pipeline output {i} ({out!r}) was made inside a branch of an `if` on a "
                    "DataNode, and holds only that branch's samples: return a variable that "
                    "every branch sets (it is merged), as in DALI"
                )
            nodes.append(out)
        self.outputs = tuple(nodes)

    def fingerprint(self) -> str:
        """A digest of the definition: ops, their wiring and parameters, function names.

        The same definition gives the same digest in any process (no ids, no
        code objects: a fixed function body still matches); a state from
        another graph (``Pipeline.state_dict``) does not. Built-in ops count
        their parameters (a reader's files and shard, an expression's
        constants, ``fn.constant``'s value: see :func:`_parameters`), data
        given as a source its contents, a ``functools.partial`` its
        arguments; a user's function counts only by its qualified name.
        Taken before :meth:`plan` rewires merged ops, and kept.
        """
        cached: str | None = getattr(self, "_fingerprint", None)
        if cached is not None:
            return cached
        h = hashlib.sha256()
        for op in self.ops:
            fields: tuple[Any, ...] = (
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
            if op.scope is not None:  # (only then: other graphs keep their digests)
                fields += (_scope_names(op.scope),)
            params = _parameters(op.function)
            if params is not None:  # (as above: a plain function's op keeps its digest)
                fields += (params,)
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
            if any(a is not b for a, b in zip(remapped, op.inputs, strict=True)):
                op.inputs = remapped  # compared by identity: == on DataNodes builds a node
            if op.scope is not None:
                for s in op.scope.lineage():
                    p = s.predicate
                    s.predicate = canon[id(p.op)].outputs[p.index]
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
            stack.extend(n.op for n in op.waits())
        ops = [op for op in self.ops if id(op) in live]  # definition order is topological
        return Plan(ops, outputs, merged=sum(1 for o in self.ops if canon[id(o)] is not o))


def _scope_names(scope: Scope | None) -> tuple[tuple[str, int, bool], ...]:
    """A scope as (predicate's op, output, branch) from the innermost out."""
    if scope is None:
        return ()
    return tuple((s.predicate.op.name, s.predicate.index, s.branch) for s in scope.lineage())


def _parameters(function: Any) -> str | None:
    """A digest of what an op's ``function`` holds beyond its name; None if nothing.

    mpexec's own callables (a reader, an expression, a constant's source, a
    decoder) by their fields, data given as a source (a list, an array) by
    its contents, and a ``functools.partial`` by its arguments, at any depth.
    A user's function, or object, is seen by its qualified name only: its
    code, closure, globals and attributes are not (they may be anything,
    and change from one process to the next).
    """
    if _plain_callable(function):
        return None
    h = hashlib.sha256()
    _feed(h, function, 0)
    return h.hexdigest()[:32]


def _plain_callable(value: Any) -> bool:
    """A user's callable, or anything else seen by its name only."""
    return callable(value) and not (
        isinstance(value, functools.partial) or type(value).__module__.startswith("mpexec.")
    )


_ATOMS = (bool, int, float, complex, str, bytes)
_MAX_FEED_DEPTH = 32


def _feed(h: Any, value: Any, depth: int) -> None:
    """Hash ``value`` into ``h``: the same bytes for equal values in any process."""

    def put(*parts: Any) -> None:
        h.update(repr(parts).encode())

    if depth > _MAX_FEED_DEPTH:
        put("deep")
    elif value is None or value is Ellipsis or type(value) in _ATOMS:
        put(type(value).__name__, value)
    elif isinstance(value, enum.Enum):
        put("enum", type(value).__qualname__, value.name)
    elif isinstance(value, (np.generic, np.dtype, slice)):
        put(type(value).__name__, str(getattr(value, "dtype", "")), repr(value))
    elif isinstance(value, np.ndarray):
        put("ndarray", value.dtype.str, value.shape)
        if value.dtype.hasobject:
            for v in value.reshape(-1):
                _feed(h, v, depth + 1)
        else:
            h.update(np.ascontiguousarray(value).tobytes())
    elif type(value) in (list, tuple):
        put(type(value).__name__, len(value))
        for v in value:
            _feed(h, v, depth + 1)
    elif type(value) is dict:
        put("dict", len(value))
        for k in sorted(value, key=repr):
            _feed(h, k, depth + 1)
            _feed(h, value[k], depth + 1)
    elif isinstance(value, functools.partial):
        put("partial")
        _feed(h, value.func, depth + 1)
        _feed(h, value.args, depth + 1)
        _feed(h, dict(value.keywords), depth + 1)
    elif type(value).__module__.startswith("mpexec."):
        put(type(value).__qualname__)
        for name, v in _fields(value):
            put(name)
            _feed(h, v, depth + 1)
    else:
        put("named", _name_of(value))


def _fields(obj: Any) -> list[tuple[str, Any]]:
    """An object's attributes, from its ``__dict__`` and its classes' ``__slots__``."""
    found = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in found and hasattr(obj, name):
                found[name] = getattr(obj, name)
    return sorted(found.items())


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
    graph = current_graph() or loose_graph()  # outside a definition: as fn.* calls (DALI 2)
    for x in inputs:
        graph.adopt(x)
        if x.op not in graph.ops:
            raise ValueError(f"{kind}: {x!r} belongs to another pipeline")
    op = Op(
        kind=OpKind.PYTHON_FUNCTION,
        name=graph.unique_name(kind),
        index=len(graph.ops),
        inputs=inputs,
        function=function,
        output_layouts=(layout,),
        device=Device.GPU if any(x.op.device == Device.GPU for x in inputs) else Device.CPU,
    )
    return graph.add(op).outputs[0]


_local = threading.local()


def current_graph() -> Graph | None:
    """The graph being defined in this thread (inside a pipeline definition), or None."""
    return getattr(_local, "graph", None)


def loose_graph() -> Graph:
    """Where ``fn.*`` calls made outside any definition go, in this thread, until a
    pipeline's :meth:`Graph.set_outputs` (or an op of one) takes them (:meth:`Graph.adopt`)."""
    graph: Graph | None = getattr(_local, "loose", None)
    if graph is None:
        graph = _local.loose = Graph()
    return graph


@contextlib.contextmanager
def defining(graph: Graph) -> Iterator[Graph]:
    """Make ``graph`` the one ``fn.*`` calls add to, in this thread."""
    outer = current_graph()
    _local.graph = graph
    try:
        yield graph
    finally:
        _local.graph = outer


def epoch_iterations(graph: Graph, batch_size: int, drop_last: bool) -> int | None:
    """Iterations in a whole epoch, when every source that ends one has a known length.

    A per-sample source (a callable taking ``SampleInfo``, or an iterable with
    ``batch=False``) with ``len()`` ends the epoch after that many samples; an
    iterable of batches, after that many batches. The first source to end
    ends the epoch. None when a source that could end it has no ``len()`` (a
    generator, a batch callable, ``feed_input``), or when none can (all cycle).
    """
    samples: list[int] = []
    batches: list[int] = []
    for op in graph.ops:
        if not op.is_source:
            continue
        if op.source_mode == "iter" and op.cycle not in (False, "raise"):
            continue  # it starts again instead of ending the epoch
        if op.source_mode not in ("sample", "iter"):
            return None
        try:
            n = len(op.function)
        except TypeError:  # no __len__ (a generator, a callable without one)
            return None
        if op.source_mode == "iter" and op.batch_processing:
            batches.append(n)
        else:
            samples.append(n)
    if not samples and not batches:
        return None
    counts = [n // batch_size if drop_last else -(-n // batch_size) for n in samples]
    return min(counts + batches)
