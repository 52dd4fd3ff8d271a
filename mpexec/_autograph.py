"""The rewrite behind ``enable_conditionals``: ``if`` and ``and``/``or``/``not`` on DataNodes.

DALI rewrites the pipeline function with a fork of TensorFlow's AutoGraph;
this is a rewrite of our own, on the function's source (``ast``), with the
same effect on the statements DALI converts::

    if pred:                          try: a                       (for each variable
        a = f(x)                      except NameError: a = Undefined('a')  the branches set)
    else:                 ----->      def _mpexec_if_body_0(): nonlocal a; a = f(x)
        a = g(x)                      def _mpexec_if_else_0(): nonlocal a; a = g(x)
                                      def _mpexec_get_0(): return (a,)
                                      def _mpexec_set_0(v): nonlocal a; (a,) = v
                                      if_stmt(pred, body, else, get, set, ('a',), 1)

    a and b     ----->  and_(lambda: a, lambda: b)        not a  ----->  not_(a)
    f(x)        ----->  call(f)(x)   (f converted too, where it is the user's function)

``if_stmt`` and the others (:mod:`mpexec._conditionals`) keep Python's
meaning for Python values and trace both branches for a DataNode. The
variables merged after an ``if`` are those it sets that are read later
(liveness, as AutoGraph has it). A ``return`` ending both branches becomes
a variable merged like the others. Functions the pipeline function calls
are converted when called, if they are the user's (not from mpexec, the
standard library or an installed package) and their source can be read;
functions defined inside it are converted only when called there, so a
callback handed to ``fn.python_function`` runs as written (in DALI it is
converted too, and so loses its picklability). ``do_not_convert`` opts a
function out. Lines keep their numbers: tracebacks point at the user's code.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import os
import sysconfig
import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ._conditionals import RETURN_PREFIX, Undefined, and_, if_stmt, not_, or_
from ._errors import ConditionalError
from ._graph import DataNode

__all__ = ["Undefined", "and_", "call", "convert", "do_not_convert", "if_stmt", "not_", "or_"]

#: The name the converted code reaches this module by (a closure cell: the user's
#: globals are left alone).
HELPER = "_mpexec_ag"

_F = TypeVar("_F", bound=Callable[..., Any])

# Calls left as they are: they look at the frame that calls them.
_FRAME_BOUND = frozenset({"super", "locals", "vars", "globals", "eval", "exec", "dir"})
_NOT_CONVERTED = ("mpexec", "shm", "numpy", "nvidia", "torch", "tensorflow", "jax", "cupy")
_SYSTEM_PATHS = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_NO_CODE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_FUTURE_FLAGS = tuple(
    getattr(__future__, name).compiler_flag for name in __future__.all_feature_names
)

_cache: dict[types.CodeType, types.CodeType | None] = {}


def do_not_convert(function: _F) -> _F:
    """Leave ``function`` as written when a pipeline with conditionals calls it (DALI's name)."""
    function.mpexec_do_not_convert = True  # type: ignore[attr-defined]
    return function


def convert(function: Any) -> Any:
    """``function`` with its ``if``/``and``/``or``/``not`` rewritten; itself where it cannot be.

    It cannot be where its source is not at hand (a lambda, the REPL, a
    builtin) or it is a generator; an ``if`` on a DataNode there raises the
    TypeError that says so.
    """
    if isinstance(function, types.MethodType):
        inner = convert(function.__func__)
        return (
            function if inner is function.__func__ else types.MethodType(inner, function.__self__)
        )
    if not isinstance(function, types.FunctionType):
        return function
    if getattr(function, "mpexec_do_not_convert", False):
        return function
    code = _converted(function.__code__)
    if code is None:
        return function
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or (), strict=True))
    cells[HELPER] = _HELPER_CELL
    new = types.FunctionType(
        code,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        tuple(cells[name] for name in code.co_freevars),
    )
    new.__kwdefaults__ = function.__kwdefaults__
    new.__qualname__ = function.__qualname__
    new.__module__ = function.__module__
    new.__doc__ = function.__doc__
    new.__dict__.update(function.__dict__)
    return new


def call(function: Any) -> Any:
    """What the converted code calls in place of ``function``: the user's functions converted."""
    target = function.__func__ if isinstance(function, types.MethodType) else function
    if type(target) is not types.FunctionType:
        return function
    module = str(getattr(target, "__module__", None) or "")
    if module.split(".", 1)[0] in _NOT_CONVERTED:
        return function
    if os.path.realpath(target.__code__.co_filename).startswith(_SYSTEM_PATHS):
        return function
    return convert(function)


def python_test(test: Any, reason: str) -> Any:
    """The test of an ``if`` that cannot be traced per sample: fine on a Python value."""
    if isinstance(test, DataNode):
        raise ConditionalError(f"an `if` on {test!r} cannot be run per sample: {reason}")
    return test


def _module() -> Any:
    import sys

    return sys.modules[__name__]


_HELPER_CELL = types.CellType(_module())


# ---------------------------------------------------------------- the rewrite


def _converted(code: types.CodeType) -> types.CodeType | None:
    if code in _cache:
        return _cache[code]
    try:
        new = _rewrite(code)
    except (OSError, TypeError, SyntaxError, ValueError, IndexError):
        new = None  # no source at hand, or not one function: run as written
    _cache[code] = new
    return new


def _rewrite(code: types.CodeType) -> types.CodeType | None:
    if code.co_flags & _NO_CODE or code.co_name == "<lambda>":
        return None
    lines, first = inspect.getsourcelines(code)
    source = "".join(lines)
    if source[:1].isspace():
        # Indented (a method, a nested function): parsed where it stands, under an
        # `if`, so columns stay those of the file (tracebacks point at the right place).
        holder = ast.parse("if 1:\n" + source).body[0]
        assert isinstance(holder, ast.If)
        body, first = holder.body, first - 1
    else:
        body = ast.parse(source).body
    fdef = body[0] if body else None
    if not isinstance(fdef, ast.FunctionDef) or fdef.name != code.co_name:
        return None
    if any(_private(n) for n in ast.walk(fdef)):
        return None  # `__x` in a class is mangled: compiled outside it, it would not be
    fdef.decorator_list = []
    fdef.body = _hoist_returns(fdef.body)
    declared = _declared(fdef.body)
    live: dict[int, set[str]] = {}
    _live_block(fdef.body, set(declared), live)
    fdef.body = _Rewriter(live, declared).block(fdef.body)
    params = ", ".join([*code.co_freevars, HELPER])
    factory = _fresh(ast.parse(f"def _mpexec_factory({params}):\n  pass"))
    outer = factory.body[0]
    assert isinstance(outer, ast.FunctionDef)
    outer.body = [fdef, ast.Return(ast.Name(fdef.name, ast.Load()))]
    ast.fix_missing_locations(factory)
    ast.increment_lineno(factory, first - 1)
    flags = 0
    for flag in _FUTURE_FLAGS:
        if code.co_flags & flag:
            flags |= flag
    compiled = compile(factory, code.co_filename, "exec", flags=flags, dont_inherit=True)
    made = _const_code(_const_code(compiled, "_mpexec_factory"), code.co_name)
    if not set(made.co_freevars) <= {*code.co_freevars, HELPER}:
        return None  # pragma: no cover - names the rewrite cannot give it
    return made


def _private(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    return isinstance(name, str) and name.startswith("__") and not name.endswith("__")


def _const_code(code: types.CodeType, name: str) -> types.CodeType:
    return next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)


def _helper(name: str) -> ast.expr:
    return ast.Attribute(ast.Name(HELPER, ast.Load()), name, ast.Load())


def _lambda(body: ast.expr) -> ast.Lambda:
    args = ast.arguments(
        posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]
    )
    return ast.Lambda(args, body)


_N = TypeVar("_N", bound=ast.AST)


def _fresh(node: _N) -> _N:
    """``node`` (made from a template) without positions: it takes those of where it goes."""
    for n in ast.walk(node):
        for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            if hasattr(n, attr):
                delattr(n, attr)
    return node


def _binding(name: str) -> ast.stmt:
    """``name``, or ``Undefined(name)`` where it is not bound yet."""
    code = f"try:\n  {name}\nexcept NameError:\n  {name} = {HELPER}.Undefined({name!r})"
    return _fresh(ast.parse(code).body[0])


def _def(name: str, params: str, decls: list[ast.stmt], body: list[ast.stmt]) -> ast.FunctionDef:
    fdef = _fresh(ast.parse(f"def {name}({params}):\n  pass").body[0])
    assert isinstance(fdef, ast.FunctionDef)
    fdef.body = decls + (body or [ast.Pass()])
    return fdef


_LOCATED = (ast.stmt, ast.expr, ast.excepthandler, ast.arg, ast.keyword)
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _walk(node: ast.AST) -> Iterable[ast.AST]:
    """``node`` and what it holds, not descending into nested functions and classes."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        if n is not node and isinstance(n, _NESTED):
            continue
        todo.extend(ast.iter_child_nodes(n))


def _walk_block(stmts: list[ast.stmt]) -> Iterable[ast.AST]:
    for s in stmts:
        yield from _walk(s)


class _Rewriter(ast.NodeTransformer):
    """Rewrites one function's body (not the functions defined in it)."""

    def __init__(self, live: dict[int, set[str]], declared: dict[str, str]) -> None:
        self.live = live
        self.declared = declared  # name -> "global" / "nonlocal", as the function declares it
        self.count = 0
        self.returns: set[str] = set()  # variables that stand for a `return`: always merged

    def block(self, stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for s in stmts:
            got = self.visit(s)
            if isinstance(got, list):
                out.extend(got)
            elif got is not None:
                out.append(got)
        return out

    # Nested functions and classes are left as written: a function is converted when called.
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> ast.AST:
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return node

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in _FRAME_BOUND:
            return node
        node.func = ast.Call(_helper("call"), [node.func], [])
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        if any(
            isinstance(n, (ast.NamedExpr, ast.Yield, ast.YieldFrom, ast.Await)) for n in _walk(node)
        ):
            self.generic_visit(node)
            return node  # a lambda would change where `:=` binds
        self.generic_visit(node)
        name = "and_" if isinstance(node.op, ast.And) else "or_"
        result = node.values[-1]
        for value in reversed(node.values[:-1]):
            result = ast.Call(_helper(name), [_lambda(value), _lambda(result)], [])
        return ast.copy_location(result, node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not):
            return ast.copy_location(ast.Call(_helper("not_"), [node.operand], []), node)
        return node

    def visit_If(self, node: ast.If) -> Any:
        live_out = self.live.get(id(node), set())
        k = self.count  # names its helpers (the `if`s inside take the next ones)
        self.count += 1
        reason = _unconvertible(node)
        ret: str | None = None
        if reason is None and _terminal(node) and _returns(node) == _tails(node):
            ret = f"{RETURN_PREFIX}_{k}"
            _returns_to(node.body, ret)
            _returns_to(node.orelse, ret)
            self.returns.add(ret)
        elif reason is None and _has_return(node):
            reason = (
                "a `return` inside it must end both branches, and nothing but the end of "
                "a branch may return (DALI's rule: the `else` branch must also have a "
                "return statement)"
            )
        assigned = sorted(_assigned(node.body) | _assigned(node.orelse))
        node.test = self.visit(node.test)
        node.body = self.block(node.body) or [ast.Pass()]
        node.orelse = self.block(node.orelse)
        if reason is not None:
            node.test = ast.Call(_helper("python_test"), [node.test, ast.Constant(reason)], [])
            return node
        if ret is not None:
            outs = [ret]
        else:
            keep = live_out | set(self.declared) | self.returns
            outs = [n for n in assigned if n in keep]
        names = outs + [n for n in assigned if n not in outs]
        nonlocals = [n for n in names if self.declared.get(n) != "global"]
        globals_ = [n for n in names if self.declared.get(n) == "global"]
        decls: list[ast.stmt] = []
        if nonlocals:
            decls.append(ast.Nonlocal(nonlocals))
        if globals_:
            decls.append(ast.Global(globals_))
        # A binding before the `if` for each variable (the branches' functions share it).
        out: list[ast.stmt] = [_binding(n) for n in nonlocals]
        body, orelse = f"_mpexec_if_body_{k}", f"_mpexec_if_else_{k}"
        get, set_ = f"_mpexec_get_{k}", f"_mpexec_set_{k}"
        state = ast.Tuple([ast.Name(n, ast.Load()) for n in names], ast.Load())
        target = ast.Tuple([ast.Name(n, ast.Store()) for n in names], ast.Store())
        out += [
            _def(body, "", list(decls), node.body),
            _def(orelse, "", list(decls), node.orelse),
            _def(get, "", [], [ast.Return(state)]),
            _def(
                set_,
                "_mpexec_values",
                list(decls),
                [ast.Assign([target], ast.Name("_mpexec_values", ast.Load()))] if names else [],
            ),
            ast.Expr(
                ast.Call(
                    _helper("if_stmt"),
                    [
                        node.test,
                        ast.Name(body, ast.Load()),
                        ast.Name(orelse, ast.Load()),
                        ast.Name(get, ast.Load()),
                        ast.Name(set_, ast.Load()),
                        ast.Tuple([ast.Constant(n) for n in names], ast.Load()),
                        ast.Constant(len(outs)),
                    ],
                    [],
                )
            ),
        ]
        if ret is not None:
            out.append(ast.Return(ast.Name(ret, ast.Load())))
        # The `if` line (to the end of its test) stands for what is made of it: a
        # traceback through if_stmt shows `if x > 1:`.
        head = ast.If(node.test, [], [])
        ast.copy_location(head, node)
        head.end_lineno = getattr(node.test, "end_lineno", node.lineno)
        head.end_col_offset = getattr(node.test, "end_col_offset", node.col_offset)
        for s in out:
            ast.copy_location(s, head)
            for n in ast.walk(s):
                if not hasattr(n, "lineno") and isinstance(n, _LOCATED):
                    ast.copy_location(n, head)
        return out


# ---------------------------------------------------------------- returns


def _has_return(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Return) for n in _walk(node))


def _returns(node: ast.AST) -> int:
    return sum(isinstance(n, ast.Return) for n in _walk(node))


def _tails(node: ast.If) -> int:
    """The ``return`` statements that end a path through ``node`` (see :func:`_returns_to`)."""
    count = 0
    for block in (node.body, node.orelse):
        last = block[-1] if block else None
        if isinstance(last, ast.Return):
            count += 1
        elif isinstance(last, ast.If):
            count += _tails(last)
    return count


def _terminal(node: ast.stmt | None) -> bool:
    """Every path through ``node`` ends in a ``return`` or ``raise``."""
    if isinstance(node, (ast.Return, ast.Raise)):
        return True
    if isinstance(node, ast.If):
        return bool(node.orelse) and _ends(node.body) and _ends(node.orelse)
    return False


def _ends(block: list[ast.stmt]) -> bool:
    return bool(block) and _terminal(block[-1])


def _returns_to(block: list[ast.stmt], name: str) -> None:
    """Tail ``return x`` of ``block`` (and of its tail ``if``s) as ``name = x``."""
    last = block[-1]
    if isinstance(last, ast.Return):
        value = last.value if last.value is not None else ast.Constant(None)
        block[-1] = ast.copy_location(ast.Assign([ast.Name(name, ast.Store())], value), last)
    elif isinstance(last, ast.If):
        _returns_to(last.body, name)
        _returns_to(last.orelse, name)


def _hoist_returns(block: list[ast.stmt]) -> list[ast.stmt]:
    """``if p: ...; return a`` followed by more: the rest becomes the ``else`` (same meaning).

    So a ``return`` in one branch with the code after the ``if`` as the
    other path is a ``return`` ending both branches, which can be traced.
    """
    out: list[ast.stmt] = []
    for i, s in enumerate(block):
        for field in ("body", "orelse", "finalbody"):
            inner = getattr(s, field, None)
            if isinstance(inner, list) and inner and not isinstance(s, _NESTED):
                setattr(s, field, _hoist_returns(inner))
        for handler in getattr(s, "handlers", ()):
            handler.body = _hoist_returns(handler.body)
        out.append(s)
        rest = block[i + 1 :]
        if isinstance(s, ast.If) and rest and _has_return(s) and not _terminal(s):
            if _ends(s.body) and not _ends(s.orelse):
                s.orelse = _hoist_returns([*s.orelse, *rest])
                return out
            if _ends(s.orelse) and s.orelse and not _ends(s.body):
                s.body = _hoist_returns([*s.body, *rest])
                return out
    return out


def _unconvertible(node: ast.If) -> str | None:
    """Why an ``if`` cannot be traced per sample, or None."""
    for n in _walk_block([*node.body, *node.orelse]):
        if isinstance(n, (ast.Yield, ast.YieldFrom, ast.Await)):
            return "it holds a `yield` or an `await`"
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            return "it holds a `global` or `nonlocal` statement"
    if _loop_exits(node.body) or _loop_exits(node.orelse):
        return "a `break` or `continue` in it would stop a loop per sample"
    return None


def _loop_exits(block: list[ast.stmt]) -> bool:
    """A ``break``/``continue`` of ``block`` that leaves it (not one of a loop inside)."""
    todo: list[ast.AST] = list(block)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Break, ast.Continue)):
            return True
        if isinstance(n, (*_NESTED, ast.For, ast.AsyncFor, ast.While)):
            if isinstance(n, (ast.For, ast.AsyncFor, ast.While)):
                todo.extend(n.orelse)  # a loop's else belongs to the enclosing one
            continue
        todo.extend(ast.iter_child_nodes(n))
    return False


# ---------------------------------------------------------------- names


def _declared(body: list[ast.stmt]) -> dict[str, str]:
    """The names the function declares ``global`` or ``nonlocal``."""
    found: dict[str, str] = {}
    for n in _walk_block(body):
        if isinstance(n, ast.Global):
            found.update(dict.fromkeys(n.names, "global"))
        elif isinstance(n, ast.Nonlocal):
            found.update(dict.fromkeys(n.names, "nonlocal"))
    return found


def _assigned(block: list[ast.stmt]) -> set[str]:
    """The names ``block`` binds in its function's scope."""
    names: set[str] = set()
    todo: list[ast.AST] = list(block)
    while todo:
        n = todo.pop()
        if isinstance(n, ast.Name):
            if isinstance(n.ctx, (ast.Store, ast.Del)):
                names.add(n.id)
            continue
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
            continue
        if isinstance(n, ast.Lambda):
            continue
        if isinstance(n, _COMPREHENSIONS):
            # Their targets are their own; a `:=` inside binds here.
            names.update(
                x.target.id
                for x in ast.walk(n)
                if isinstance(x, ast.NamedExpr) and isinstance(x.target, ast.Name)
            )
            continue
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names if a.name != "*")
        elif (isinstance(n, ast.ExceptHandler) and n.name) or (
            isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name
        ):
            names.add(n.name)
        elif isinstance(n, ast.MatchMapping) and n.rest:
            names.add(n.rest)
        todo.extend(ast.iter_child_nodes(n))
    return names


def _reads(node: ast.AST) -> set[str]:
    """Every name ``node`` may read (nested functions' too: an over-estimate)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
    return out


def _live_block(block: list[ast.stmt], live_out: set[str], found: dict[int, set[str]]) -> set[str]:
    """Names live at the start of ``block``; records each ``if``'s live names after it.

    A backward liveness pass, exact for straight code and ``if``, an
    over-estimate for loops and ``try`` (anything they read stays live): a
    variable merged for nothing costs a merge op, never a wrong result.
    """
    live = set(live_out)
    for s in reversed(block):
        live = _live_stmt(s, live, found)
    return live


def _live_stmt(s: ast.stmt, live_out: set[str], found: dict[int, set[str]]) -> set[str]:
    if isinstance(s, ast.If):
        found[id(s)] = set(live_out)
        return (
            _reads(s.test)
            | _live_block(s.body, live_out, found)
            | _live_block(s.orelse, live_out, found)
        )
    if isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
        loop = live_out | _reads(s)
        _live_block(s.body, loop, found)
        _live_block(s.orelse, live_out, found)
        return loop
    if isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try), ast.Match)):
        every = live_out | _reads(s)
        blocks = [getattr(s, f, []) for f in ("body", "orelse", "finalbody")]
        blocks += [h.body for h in getattr(s, "handlers", [])]
        blocks += [c.body for c in getattr(s, "cases", [])]
        for b in blocks:
            _live_block(b, every, found)
        return every
    if isinstance(s, (ast.With, ast.AsyncWith)):
        return _reads(ast.Tuple([i.context_expr for i in s.items], ast.Load())) | _live_block(
            s.body, live_out, found
        )
    if isinstance(s, (ast.Return, ast.Raise)):
        return _reads(s)
    if isinstance(s, (ast.Break, ast.Continue)):
        return set(live_out)
    kills = (
        _assigned([s])
        if isinstance(
            s,
            (
                ast.Assign,
                ast.AnnAssign,
                ast.Import,
                ast.ImportFrom,
                ast.FunctionDef,
                ast.AsyncFunctionDef,
                ast.ClassDef,
            ),
        )
        else set()
    )
    return (live_out - kills) | _reads(s)
