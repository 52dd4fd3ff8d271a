"""DALI's conditional execution: an ``if`` on a DataNode runs each branch on its own samples.

With ``enable_conditionals=True`` the pipeline function is rewritten
(:mod:`mpexec._autograph`) so that its ``if`` statements and ``and``/``or``/
``not`` call the functions here while the definition runs::

    definition                      what is built (ops of the graph)
    ----------                      --------------------------------
    if pred:                        if_stmt: branches T, F = Scope(here, pred, True/False)
        a = f(x)                    body() in T: x is split into T (a split op, made
    else:                             when an op of T first takes x); f runs in T
        a = g(x)                    orelse() in F: the same with F
    use(a)                          a = merge(a of T, a of F): back in the enclosing scope

    scheduler, per iteration        a scope's samples: its parent's where pred is (not)
                                    set, worked out once; a split selects those rows of
                                    its input, uncopied; an op in a scope is called on
                                    its samples only (Chunk.rows: their batch indices);
                                    a merge puts both branches' rows back in batch order

As in DALI, an op takes the scope that is current where it is defined, and
every input from an enclosing scope is split into it first (one split per
input and scope, reused); sources (``external_source``, readers, constants)
always run on the whole batch and are split where used. An op with no inputs
inside a branch runs on that branch's samples (DALI runs it on the whole
batch and splits its output: here its function sees only the branch's
samples). Variables a branch sets are merged after the ``if`` when they are
read later; one set in one branch only, or to different structures, is a
:class:`ConditionalError`, as DALI refuses it; Python values set in both
branches become constants and are merged too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _arith, fn
from ._errors import ConditionalError
from ._graph import DataNode, Graph, Merged, Op, Scope, current_graph
from ._modes import Device, OpKind
from ._types import ScalarConstant

#: The name of the variable a rewritten ``return`` inside an ``if`` sets (its suffix varies).
RETURN_PREFIX = "_mpexec_return"


class Undefined:
    """What a variable holds before any statement set it, while an ``if`` is traced.

    The rewritten function gives each variable a branch sets a binding
    before the ``if`` (as DALI's AutoGraph does); reading one that was never
    set gives this, and using it raises ``NameError``.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<undefined {self.name}>"

    def __getattr__(self, attr: str) -> Any:
        raise NameError(f"name {self.name!r} is not defined (it is set in no code path before)")


class _Frame:
    """One ``if`` (or ``and``/``or``) being traced: its two scopes and where it is."""

    def __init__(self, parent: Scope | None, predicate: DataNode, logical: str | None) -> None:
        self.parent = parent
        self.predicate = predicate
        self.scopes = {b: Scope(parent, predicate, b, logical) for b in (True, False)}
        self.branch: bool | None = None  # None: around the branches (the merge)

    @property
    def scope(self) -> Scope | None:
        return self.parent if self.branch is None else self.scopes[self.branch]


class Conditions:
    """The ``if`` scopes of one pipeline definition, and the splits made so far.

    The graph calls :meth:`place` for every op added: its inputs are made
    visible in the current scope, and the op takes that scope.
    """

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.frames: list[_Frame] = []
        self.splits: dict[tuple[int, int, int], DataNode] = {}  # (op, output, scope) -> split

    @property
    def scope(self) -> Scope | None:
        """Where ops defined now run: the innermost branch being traced (None: everywhere)."""
        return self.frames[-1].scope if self.frames else None

    def place(self, op: Op) -> None:
        scope = self.scope
        if scope is not None and op.device is Device.GPU:
            raise ConditionalError(
                f"{op.describe()} is a GPU op inside a branch of an `if` on a DataNode: "
                "mpexec runs conditionals on the CPU only. Run the GPU op before or after "
                "the `if`"
            )
        op.inputs = tuple(self.visible(n) for n in op.inputs)
        if not op.is_source:  # sources give whole batches: split where used, as in DALI
            op.scope = scope

    def visible(self, node: DataNode) -> DataNode:
        """``node`` as the current scope sees it: split down into it from where it was made."""
        target = self.scope
        home = node.op.scope
        path: list[Scope] = []
        s = target
        while s is not home:
            if s is None:
                raise ConditionalError(
                    f"{node!r} was made inside a branch of an `if` on a DataNode and is "
                    "used where that branch does not reach. A value made in a branch is "
                    "seen after the `if` only through a variable that both branches set "
                    "(then it is merged); DALI has the same rule"
                )
            path.append(s)
            s = s.parent
        for s in reversed(path):
            key = (id(node.op), node.index, id(s))
            split = self.splits.get(key)
            if split is None:
                if node.op.device is Device.GPU:
                    raise ConditionalError(
                        f"{node!r} is a GPU op's output used inside a branch of an `if` on "
                        "a DataNode: mpexec runs conditionals on the CPU only"
                    )
                op = Op(
                    kind=OpKind.SPLIT,
                    name=self.graph.unique_name(OpKind.SPLIT),
                    index=len(self.graph.ops),
                    inputs=(node,),
                    function=None,
                    output_layouts=(node.layout,),
                    scope=s,
                )
                split = self.graph.add(op, auto_named=True).outputs[0]
                self.splits[key] = split
            node = split
        return node

    def push(self, predicate: DataNode, logical: str | None = None) -> _Frame:
        if predicate.op.device is Device.GPU:
            raise ConditionalError(
                f"the predicate {predicate!r} is a GPU op's output: a predicate of an `if` "
                "on a DataNode is a scalar bool per sample on the CPU, as in DALI"
            )
        frame = _Frame(self.scope, self.visible(predicate), logical)
        self.frames.append(frame)
        return frame

    def pop(self, frame: _Frame) -> None:
        assert self.frames
        assert self.frames[-1] is frame
        self.frames.pop()

    def merge(self, yes: DataNode, no: DataNode, frame: _Frame, what: Merged) -> DataNode:
        """One variable's values of both branches of ``frame``, as one batch around it."""
        assert frame.branch is None
        layout = yes.layout or None
        if what.logical is None and layout != (no.layout or None):
            # Layouts are known when ops are defined here: DALI finds this when it runs.
            raise ConditionalError(
                "Divergent data found in different branches of conditional operation. All "
                "paths in conditional operation are merged into one batch which must have "
                "consistent type, number of dimensions, layout and other metadata. Found "
                f'distinct layouts: "{yes.layout or ""}" and "{no.layout or ""}" '
                f"({what.variable}: {yes!r} in the `if` branch, {no!r} in the `else` "
                "branch; give both the same layout, e.g. output_layouts=)"
            )
        op = Op(
            kind=OpKind.MERGE,
            name=self.graph.unique_name(OpKind.MERGE),
            index=len(self.graph.ops),
            inputs=(yes, no),
            function=what,
            output_layouts=(layout,),
            scope=frame.parent,
        )
        return self.graph.add(op, auto_named=True).outputs[0]

    def branch_value(self, value: Any, name: str) -> DataNode:
        """A leaf of a variable a branch set, as a DataNode of the current scope.

        Python numbers and arrays become constants (DALI promotes them the same way).
        """
        if isinstance(value, DataNode):
            return self.visible(value)
        array: np.ndarray[Any, Any] | None = None
        if isinstance(value, (bool, int, float, np.generic)):
            value = ScalarConstant(value)  # DALI's types: a Python int is INT32, ...
        if isinstance(value, ScalarConstant):
            array = value.as_array()
        elif isinstance(value, np.ndarray):
            array = value  # DALI makes float32 and int32 of float64 and int64, as below
            if array.dtype == np.float64:
                array = array.astype(np.float32)
            elif array.dtype == np.int64:
                array = array.astype(np.int32)
        if array is None or array.dtype.kind not in "biuf":
            # DALI's TypeError ("Unexpected type"), from the constant it tries to make.
            raise TypeError(
                f"{_shown(name)} is set in a branch of an `if` on a DataNode to "
                f"{type(value).__name__} {value!r}: values set in the branches are merged "
                "per sample after the `if`, so they must be DataNodes, or numbers and arrays "
                "(made constants), as in DALI"
            )
        node = fn.constant(
            fdata=array if array.dtype.kind == "f" else None,
            idata=None if array.dtype.kind == "f" else array,
            shape=array.shape,
            dtype=array.dtype,
        )
        return self.visible(node)


def _shown(name: str) -> str:
    if name in ("and", "or"):
        return f"the right side of `{name}`"
    return "the return value" if name.startswith(RETURN_PREFIX) else f"variable {name!r}"


def conditions_of(node: DataNode) -> Conditions:
    """The conditions of the definition ``node`` is used in; raises bool()'s error if none."""
    graph = current_graph()
    if graph is None or graph.conditions is None:
        bool(node)  # DataNode.__bool__: the TypeError that explains
        raise AssertionError("unreachable")  # pragma: no cover
    conditions: Conditions = graph.conditions
    return conditions


# ---------------------------------------------------------------- the rewritten statements


def if_stmt(
    test: Any,
    body: Callable[[], None],
    orelse: Callable[[], None],
    get_state: Callable[[], tuple[Any, ...]],
    set_state: Callable[[tuple[Any, ...]], None],
    names: Sequence[str],
    nouts: int,
) -> None:
    """``if test: body() else: orelse()``; on a DataNode, both, each on its own samples.

    ``names``: the variables the branches set; the first ``nouts`` are read
    after the ``if`` and are merged (the others keep their value from
    before it, as in DALI). ``get_state``/``set_state`` read and write them.
    """
    if not isinstance(test, DataNode):
        if test:
            body()
        else:
            orelse()
        return
    conditions = conditions_of(test)
    before = get_state()
    frame = conditions.push(test)
    try:
        frame.branch = True
        body()
        yes = _outputs(conditions, get_state()[:nouts], names, "if")
        set_state(before)
        frame.branch = False
        orelse()
        no = _outputs(conditions, get_state()[:nouts], names, "else")
        frame.branch = None
        merged = []
        for name, a, b in zip(names, yes, no, strict=False):
            merged.append(_merge_structure(conditions, frame, name, a, b))
    finally:
        conditions.pop(frame)
    set_state((*merged, *before[nouts:]))


def _outputs(
    conditions: Conditions, values: tuple[Any, ...], names: Sequence[str], branch: str
) -> list[Any]:
    """The values a branch leaves in the merged variables, as DataNodes of that branch."""
    out = []
    for name, value in zip(names, values, strict=False):
        if isinstance(value, Undefined):
            # DALI's words (RuntimeError there).
            what = (
                f"The `{branch}` branch must also have a return statement."
                if name.startswith(RETURN_PREFIX)
                else f"Variable '{name}' must also be initialized in the `{branch}` branch."
            )
            raise ConditionalError(
                "Encountered inconsistent outputs out of the `if/else` control flow statement. "
                f"Variables need to be initialized in every code path (both `if` branches). "
                f"{what}"
            )
        out.append(_map_leaves(value, functools.partial(_branch_value, conditions, name)))
    return out


def _branch_value(conditions: Conditions, name: str, value: Any) -> DataNode:
    return conditions.branch_value(value, name)


def _merge_structure(conditions: Conditions, frame: _Frame, name: str, a: Any, b: Any) -> Any:
    sa, sb = _structure(a), _structure(b)
    if sa != sb:
        shown = _shown(name)
        raise ConditionalError(
            "Divergent data found in different branches of `if/else` control flow statement. "
            f"{shown[0].upper()}{shown[1:]} is set to values of different nesting structure in "
            f"the two branches ('if': {_sketch(a)}, 'else': {_sketch(b)}): values are merged "
            "into common output batches, so a tuple must be a tuple of the same length in "
            "every code path, a dict must have the same keys (the contents may differ)"
        )
    leaves_b = iter(_leaves(b))
    what = Merged(_shown(name))
    return _map_leaves(a, lambda x: conditions.merge(x, next(leaves_b), frame, what))


# Structures whose leaves are merged one by one: tuples, lists, dicts (by key), None (none).


def _structure(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_structure(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _structure(value[k])) for k in sorted(value, key=repr)))
    return "*"


def _leaves(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    if isinstance(value, dict):
        return [x for k in sorted(value, key=repr) for x in _leaves(value[k])]
    return [value]


def _map_leaves(value: Any, f: Callable[[Any], Any]) -> Any:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        items = [_map_leaves(v, f) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        # In the order _leaves gives (sorted keys), built back in the dict's own order.
        mapped = {k: _map_leaves(value[k], f) for k in sorted(value, key=repr)}
        return {k: mapped[k] for k in value}
    return f(value)


def _sketch(value: Any) -> str:
    return repr(_map_leaves(value, lambda _: "*"))


def not_(value: Any) -> Any:
    """``not value``; on a DataNode, a logical not per sample (DALI's ``fn._conditional.not_``)."""
    if not isinstance(value, DataNode):
        return not value
    graph = current_graph()
    if graph is None or graph.conditions is None:
        bool(value)  # the TypeError that explains
    assert graph is not None
    op = Op(
        kind=OpKind.PYTHON_FUNCTION,
        name=graph.unique_name("not"),
        index=len(graph.ops),
        inputs=(value,),
        function=_arith.LogicalNot(),
        output_layouts=(None,),
    )
    return graph.add(op, auto_named=True).outputs[0]


def and_(left: Callable[[], Any], right: Callable[[], Any]) -> Any:
    """``left() and right()``; on a DataNode, ``right`` is computed only where ``left`` holds."""
    a = left()
    if not isinstance(a, DataNode):
        return a and right()
    return _logical(a, right, "and")


def or_(left: Callable[[], Any], right: Callable[[], Any]) -> Any:
    """``left() or right()``; on a DataNode, ``right`` is computed only where ``left`` fails."""
    a = left()
    if not isinstance(a, DataNode):
        return a or right()
    return _logical(a, right, "or")


def _logical(a: DataNode, right: Callable[[], Any], how: str) -> DataNode:
    """DALI's lazy ``and``/``or``: an ``if`` on ``a`` whose one branch computes ``right``."""
    conditions = conditions_of(a)
    frame = conditions.push(a, how)
    lazy = how == "and"  # the branch where the right side decides
    try:
        frame.branch = lazy
        b = right()
        if not isinstance(b, (DataNode, bool, np.bool_)):
            raise ConditionalError(
                f"Logical expression `{how}` is restricted to scalar (0-d tensors) inputs of "
                f"`bool` type, that are placed on CPU. Got an input of type "
                f"`{type(b).__name__}` ({b!r}) as the right argument in logical expression"
            )
        decided = conditions.branch_value(b, how)
        frame.branch = not lazy
        kept = conditions.visible(frame.predicate)
        frame.branch = None
        yes, no = (decided, kept) if lazy else (kept, decided)
        merged = conditions.merge(yes, no, frame, Merged(f"`{how}`", logical=how))
    finally:
        conditions.pop(frame)
    return merged
