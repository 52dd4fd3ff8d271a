"""The architecture holds: layers flow down, no import cycles, few private reaches.

A ratchet (docs/design.md, "Layers"): the package structure is checked from the source, with
``ast``, so that a change that adds a cycle, an upward import or a new reach into
another module's ``_private`` names fails here, not in review.

What is read: every ``.py`` file of ``mpexec/`` and ``shm/``, each a module named
by its path (``mpexec/_pool/_state.py`` is ``mpexec._pool._state``). Imports
count wherever they stand (function-level ones included), except under
``if TYPE_CHECKING:`` (by whatever name it is imported as: ``_TYPE_CHECKING``),
which never runs. The worker-side ratchet reads only module-level imports, which
importing a module runs, with the ``__init__`` of each package above it.

**Import edges.** ``import a.b`` is an edge to ``a.b``; ``from a import b`` is an
edge to ``a.b`` where that is a module of ours, else to ``a``. An edge to a
package that contains the importer (``mpexec`` from ``mpexec._pool``) is left out
when it names a submodule: that package is already being imported. Only edges
between modules of ours count.

**Private cross-module accesses** (counted by :func:`private_accesses`). In a
module M, each of these counts once per place in the source:

1. ``V._x`` (read, write or delete; ``_x`` has one leading underscore and is
   no dunder or sunder name, nor one of the few documented public ones:
   ``os._exit`` and a named tuple's ``_fields``, ``_asdict``, ``_replace``...),
   outside annotations, where ``V`` is not ``self``, ``cls`` or
   ``super()``, and either ``V`` starts with a module M imported
   (``_runtime._current``, ``np.random.mtrand._rand``), or M does not own ``_x``.
   M *owns* the names it binds itself: at module level, in a class body
   (methods, class attributes, ``__slots__``), or as an attribute it assigns on
   any object that is not an imported module (``self._x = ...``,
   ``out._tag = ...``). Ownership is by name: M's own ``_x`` on an object of
   another module goes uncounted, which is why the count is a ratchet, not a
   proof. Through a parameter or variable annotated with a class imported
   from outside mpexec and shm (``future: Future[Any]``), the access is that
   class's: foreign.
2. ``getattr``/``setattr``/``hasattr``/``delattr`` of ``V`` with a literal
   private name, on the same terms as 1.
3. ``from X import _y`` with X another module: one per private name imported.
4. An import of a private module outside the package that holds it
   (``shm._platform`` from mpexec, ``torch.utils.data._utils``); private
   modules inside one's own package (``mpexec._codec`` from ``mpexec._pool``)
   are how a package is built.

An access is *internal* when what it reaches belongs to mpexec or shm (the
name is owned by another module of ours, or the module or private module
imported is ours), else *foreign* (a framework's or the standard library's
internals, patched on purpose). Both counts are recorded below and may only go
down. Ruff's SLF001 (on in pyproject.toml) flags the attribute accesses too, and
each deliberate one carries ``# noqa: SLF001`` with its reason, on its line or in
a comment just above (:func:`test_every_marked_private_access_says_why`).
"""

from __future__ import annotations

import ast
import collections
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mpexec", "shm")

#: The recorded counts (see the module docstring): lower them as seams are
#: removed; never raise them. A new reach needs a public seam instead.
MAX_INTERNAL = 0  # 20 before the pool became a package with a public seam; 4 before
# Arena.open_own (-2) and before a stdlib Future's _state was classed foreign (-1: rule 1,
# the variable is annotated ``Future``); 1 before Pipeline.epoch_length/declared_outputs
# (tf.py read pipe._graph)
MAX_FOREIGN = 22  # 22 with that one internal (the torch adapter's 21 are in torch/_compat);
# +1: pipeline_def marks the function it returns with DALI's `_is_pipeline_def`, which
# DALI's code reads (a name DALI gives our own object, not a reach into a library);
# -2: a pool future cancels itself under its own condition (PoolFuture.cancel_unsent, a
# subclass's own fields), not cancel_now reaching into a Future's _condition and _state

#: Lines of the largest module of mpexec/ and shm/ (``mpexec/_scheduler.py``): no
#: module may grow past it. Lower it as rooms split; never raise it (1,630 when
#: ``mpexec/torch.py`` was one module).
MAX_MODULE_LINES = 995

#: Modules that run in a worker process, and the rooms they may never load at
#: import time (with the ``__init__`` of each package above them): a worker
#: started by spawn or a fork server imports what its fetch needs, not the
#: caller's machinery (46 modules of ours in a torch loader worker before
#: mpexec/torch/ was split by process; 22 after).
WORKER_SIDE = (
    "mpexec._worker",  # the worker process's loop
    "mpexec._launch",  # how a worker starts (run by spawn / the fork server)
    "mpexec._runtime",  # what a unit of work runs in a worker
    "mpexec._source_runners",  # whole-batch runners, run in a worker too
    "mpexec.torch._fetch",  # a DataLoader worker's setup, fetchers, collation
    "mpexec._dali_runner",  # what mpexec.dali.python_function runs in a worker
)
NOT_IN_WORKERS = (
    "mpexec._pool",
    "mpexec._scheduler",
    "mpexec._pipeline",
    "mpexec._executors",
    "mpexec._graph",
)

#: Layers, bottom (0) to top: a module imports only from its own layer or
#: below (docs/design.md, "Layers"). A module not listed: a public one (no leading
#: underscore, e.g. a framework adapter) is in the adapters layer; a private
#: one must be placed here.
LAYERS: dict[str, int] = {
    # 0: shared memory, host facts, errors, modes
    "shm": 0,
    "mpexec._errors": 0,
    "mpexec._host": 0,
    "mpexec._pid": 0,  # this process's id, kept after fork (no getpid a call)
    "mpexec._modes": 0,
    "mpexec._version": 0,
    "mpexec._extras": 0,  # extras' install hints and framework versions, from metadata
    "mpexec._cpuload": 0,  # other processes' CPU share (demo, benchmarks)
    "mpexec._tracebacks": 0,  # a worker's exception shown without mpexec's frames
    # 1: the wire: records, codec, the worker process, launching it, map() windows
    "mpexec._protocol": 1,
    "mpexec._codec": 1,
    "mpexec._launch": 1,
    "mpexec._worker": 1,
    "mpexec._mapping": 1,
    "mpexec._calls": 1,  # submit_call's first checks, shared by WorkerPool and RayPool
    # 2: the pool
    "mpexec._pool": 2,
    # 3: what a unit of work runs: op runners, the GPU stage, batches
    "mpexec._runtime": 3,
    "mpexec._source_runners": 3,  # runners that make a whole batch (fused source, worker source)
    "mpexec._rngseeds": 3,  # an op's per-call rng: SeedSequence's hash on what changes
    "mpexec._globalrandom": 3,  # np.random and random reseeded, and watched for draws
    "mpexec._batch": 3,
    "mpexec._gpu": 3,
    "mpexec._arith": 3,  # DataNode arithmetic: the expressions the workers run
    "mpexec._types": 3,  # DALI's type names and NumPy dtypes, for _arith and the ops
    "mpexec._dali_runner": 3,  # dali.python_function's chunks, run in workers
    # 4: the executors that run units (a pool's, the GPU's)
    "mpexec._grouping": 3,  # several iterations a unit (issue 37), for the scheduler
    "mpexec._executors": 4,
    # 5: the scheduler and the graph it walks
    "mpexec._scheduler": 5,
    "mpexec._iterations": 5,  # the scheduler's records: op state, iterations, stats
    "mpexec._graph": 5,
    "mpexec._chains": 5,  # per-sample ops fused into the call of the op they feed
    "mpexec._branches": 5,  # a batch's rows per branch of an `if` on a DataNode
    # 6: the pipeline and the ops that build it
    "mpexec._pipeline": 6,
    "mpexec._conditionals": 6,  # DALI's conditional execution: scopes, splits, merges
    "mpexec._autograph": 6,  # the rewrite of `if`/`and`/`or`/`not` it runs on
    "mpexec._pypool": 6,  # a pipeline's workers under DALI's names (Pipeline._py_pool)
    "mpexec.fn": 6,
    "mpexec._pyfunc": 6,  # TF's py_func family: rules, entry points, default pool
    "mpexec._pyfunc_tf": 6,  # the same ops inside TensorFlow graphs (imports TF)
    "mpexec.contrib": 6,
    # 7: adapters, the package's face, test doubles
    "mpexec": 7,
    "mpexec.testing": 7,
    "mpexec.torch": 7,  # the torch adapter's rooms (mpexec/torch/)
    "mpexec.ray": 7,  # RayPool's package: its rooms import from below only
    # 8: the command line
    "mpexec.__main__": 8,
    "mpexec._doctor": 8,
    "mpexec._demo": 8,
    "mpexec._demo_images": 8,  # the demo's images, codec and augmentation steps
    "mpexec._demo_plain": 8,  # the demo's control: plain processes, the host's ceiling
}
ADAPTERS = 7


def layer_of(module: str) -> int:
    """The layer of ``module``: its own entry, its package's, or the default."""
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in LAYERS and (i == len(parts) or name != "mpexec"):
            return LAYERS[name]
    if any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
        raise AssertionError(
            f"{module} has no layer: add it to LAYERS in tests/test_architecture.py "
            "(which layer may it import, which may import it?)"
        )
    return ADAPTERS


# ---------------------------------------------------------------- reading the tree


@dataclass
class Module:
    name: str
    path: pathlib.Path
    tree: ast.Module
    is_package: bool

    @property
    def package(self) -> str:
        """The package it belongs to (itself, for a package's ``__init__``)."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def read_modules(root: pathlib.Path = ROOT) -> dict[str, Module]:
    """Every module of mpexec and shm under ``root``, by dotted name."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            modules[name] = Module(name, path, ast.parse(path.read_text()), is_package)
    return modules


def _type_checking_names(tree: ast.AST) -> set[str]:
    """The names ``TYPE_CHECKING`` goes by in ``tree`` (``TYPE_CHECKING as _TYPE_CHECKING``)."""
    names = {"TYPE_CHECKING"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("typing", "typing_extensions"):
            names.update(a.asname for a in node.names if a.name == "TYPE_CHECKING" and a.asname)
    return names


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (never run), by any name it is imported as."""
    names = _type_checking_names(tree)
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name in names:
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def _function_bodies(tree: ast.AST) -> set[int]:
    """ids of the nodes inside functions (which importing the module does not run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            for child in body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def _imports(
    mod: Module, module_level: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, str, list[str]]]:
    """(node, absolute module imported from, names) for each import that runs.

    ``module_level``: only those that importing the module runs (none in a function).
    """
    skip = _type_checking_nodes(mod.tree)
    if module_level:
        skip |= _function_bodies(mod.tree)
    for node in ast.walk(mod.tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node, base, [a.name for a in node.names]


def import_edges(modules: dict[str, Module], module_level: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (see the module docstring).

    ``module_level``: only the imports that importing the module runs.
    """
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for mod in modules.values():
        for _, base, names in _imports(mod, module_level):
            targets = []
            for n in names or [""]:
                sub = f"{base}.{n}" if n else base
                if n and sub in modules:
                    targets.append(sub)
                elif base in modules:
                    contains = mod.name == base or mod.name.startswith(base + ".")
                    if not (contains and not names):
                        targets.append(base)
            edges[mod.name].update(t for t in targets if t != mod.name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def import_closure(module: str, modules: dict[str, Module]) -> set[str]:
    """The modules of ours that importing ``module`` loads: its module-level imports,
    theirs, and the ``__init__`` of every package above each (Python runs those first)."""
    edges = import_edges(modules, module_level=True)
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for n in [".".join(parts[:i]) for i in range(1, len(parts))] + [name]:
            if n in modules and n not in seen:
                seen.add(n)
                todo.extend(edges[n])
    return seen


# ---------------------------------------------------------------- private accesses


#: Names with a leading underscore that are documented as public.
PUBLIC_UNDERSCORE = frozenset(
    {"_exit", "_fields", "_asdict", "_replace", "_make", "_field_defaults"}
)


def _is_private(name: str) -> bool:
    return (
        name.startswith("_")
        and not name.startswith("__")
        and not (name.endswith("_") and len(name) > 2)  # _sunder_
        and name not in PUBLIC_UNDERSCORE
    )


def _annotation_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside annotations (which postponed evaluation never runs)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            annotations += [a.annotation for a in every if a is not None]
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for ann in annotations:
            if ann is not None:
                skip.update(id(n) for n in ast.walk(ann))
    return skip


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _module_aliases(mod: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local name -> module, for each name an import binds to a module.

    ``import a.b`` binds ``a``; ``import a.b as c`` binds ``c``; ``from a import b``
    binds ``b`` when ``a.b`` is a module of ours, or a foreign name that is not a
    class or function by the naming convention (lower case).
    """
    bound: dict[str, str] = {}
    for node, base, _ in _imports(mod):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    bound[head] = head
        else:
            ours = base.split(".")[0] in PACKAGES
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules or (not ours and alias.name.lstrip("_")[:1].islower()):
                    bound[alias.asname or alias.name] = full
    return bound


def owned_names(mod: Module, aliases: dict[str, str]) -> set[str]:
    """The names ``mod`` binds itself (see the module docstring, rule 1)."""
    owned: set[str] = set()

    def bind_target(target: ast.expr) -> None:
        if isinstance(target, ast.Name):
            owned.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                bind_target(elt)
        elif isinstance(target, ast.Attribute):
            root = _root(target.value)
            if not (isinstance(root, ast.Name) and root.id in aliases):
                owned.add(target.attr)
        elif isinstance(target, ast.Starred):
            bind_target(target.value)

    def body_names(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                owned.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    bind_target(t)
                if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in stmt.targets):
                    for const in ast.walk(stmt.value):
                        if isinstance(const, ast.Constant) and isinstance(const.value, str):
                            owned.add(const.value)
            elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
                bind_target(stmt.target)

    body_names(mod.tree.body)
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.ClassDef):
            body_names(node.body)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute):
                    bind_target(t)
                elif isinstance(t, (ast.Tuple, ast.List)):
                    for elt in t.elts:
                        if isinstance(elt, ast.Attribute):
                            bind_target(elt)
    return owned


@dataclass(frozen=True)
class Access:
    module: str
    line: int
    what: str
    internal: bool

    def __str__(self) -> str:
        kind = "internal" if self.internal else "foreign"
        return f"{self.module}:{self.line}: {self.what} ({kind})"


def _private_module_outside(importer: Module, target: str) -> bool:
    """Whether ``target`` has a private part whose package does not hold ``importer``."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if i and _is_private(part):
            parent = ".".join(parts[:i])
            if not (importer.name == parent or importer.name.startswith(parent + ".")):
                return True
    return False


def _foreign_typed(mod: Module, local: dict[str, str]) -> set[int]:
    """ids of the attribute nodes whose root is a parameter or variable annotated with a
    class imported from outside mpexec and shm (``future: Future[Any]``, stdlib's
    ``concurrent.futures.Future``): what they reach is that class's, foreign."""
    foreign_classes = set()
    for node, base, _ in _imports(mod):
        if isinstance(node, ast.ImportFrom) and base.split(".")[0] not in PACKAGES:
            foreign_classes.update(a.asname or a.name for a in node.names)

    def is_foreign(ann: ast.expr | None) -> bool:
        if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
            try:
                ann = ast.parse(ann.value, mode="eval").body
            except SyntaxError:
                return False
        if isinstance(ann, ast.Subscript):  # Future[Any]
            ann = ann.value
        if isinstance(ann, ast.Name):
            return ann.id in foreign_classes
        if isinstance(ann, ast.Attribute) and isinstance(ann.value, ast.Name):  # cf.Future
            return local.get(ann.value.id, "").split(".")[0] not in ("", *PACKAGES)
        return False

    marked: set[int] = set()
    for fn in ast.walk(mod.tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args
        typed = {
            a.arg
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
            if is_foreign(a.annotation)
        }
        typed.update(
            n.target.id
            for n in ast.walk(fn)
            if isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and is_foreign(n.annotation)
        )
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute):
                root = _root(node.value)
                if isinstance(root, ast.Name) and root.id in typed:
                    marked.add(id(node))
    return marked


def private_accesses(modules: dict[str, Module]) -> list[Access]:
    """Every private cross-module access in ``modules`` (rules in the module docstring)."""
    aliases = {name: _module_aliases(mod, modules) for name, mod in modules.items()}
    owned = {name: owned_names(mod, aliases[name]) for name, mod in modules.items()}
    owners: dict[str, set[str]] = collections.defaultdict(set)
    for name, names in owned.items():
        for n in names:
            owners[n].add(name)
    found: list[Access] = []
    for mod in modules.values():
        mine, local = owned[mod.name], aliases[mod.name]

        foreign_typed = _foreign_typed(mod, local)

        def counts(
            value: ast.expr,
            attr: str,
            line: int,
            mod: Module,
            mine: set[str],
            local: dict[str, str],
            typed_foreign: bool = False,
        ) -> None:
            root = _root(value)
            if isinstance(root, ast.Name) and root.id in ("self", "cls"):
                return
            if isinstance(root, ast.Call) and getattr(root.func, "id", None) == "super":
                return
            via_module = isinstance(root, ast.Name) and root.id in local
            if not via_module and attr in mine:
                return
            if typed_foreign:
                internal = False
            elif isinstance(root, ast.Name) and via_module:
                internal = local[root.id].split(".")[0] in PACKAGES
            else:
                internal = bool(owners.get(attr, set()) - {mod.name})
            found.append(Access(mod.name, line, f"{ast.unparse(value)}.{attr}", internal))

        skip = _type_checking_nodes(mod.tree) | _annotation_nodes(mod.tree)
        for node in ast.walk(mod.tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                typed = id(node) in foreign_typed
                counts(node.value, node.attr, node.lineno, mod, mine, local, typed)
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and _is_private(node.args[1].value)
            ):
                counts(node.args[0], node.args[1].value, node.lineno, mod, mine, local)
        for node, base, names in _imports(mod):
            ours = base.split(".")[0] in PACKAGES
            if isinstance(node, ast.ImportFrom) and base != mod.name:
                found.extend(
                    Access(mod.name, node.lineno, f"from {base} import {n}", ours)
                    for n in names
                    if _is_private(n) and f"{base}.{n}" not in modules
                )
            if _private_module_outside(mod, base):
                found.append(Access(mod.name, node.lineno, f"import {base}", ours))
    return sorted(found, key=lambda a: (a.module, a.line, a.what))


# ---------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return read_modules()


def test_no_import_cycles(modules: dict[str, Module]) -> None:
    assert cycles(import_edges(modules)) == []


def test_shm_never_imports_mpexec(modules: dict[str, Module]) -> None:
    for mod in modules.values():
        if mod.name.split(".")[0] == "shm":
            for _, base, _ in _imports(mod):
                assert base.split(".")[0] != "mpexec", f"{mod.name} imports {base}"


def test_imports_flow_down_the_layers(modules: dict[str, Module]) -> None:
    upward = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in import_edges(modules).items()
        for target in targets
        if layer_of(target) > layer_of(name)
    ]
    assert upward == []


def test_the_pool_imports_nothing_above_it(modules: dict[str, Module]) -> None:
    below = {m for m, layer in LAYERS.items() if layer < LAYERS["mpexec._pool"]}
    for name, targets in import_edges(modules).items():
        if name == "mpexec._pool" or name.startswith("mpexec._pool."):
            for target in targets:
                top = ".".join(target.split(".")[:2]) if target.startswith("mpexec.") else target
                assert top in below | {"mpexec._pool"}, f"{name} imports {target}"


def test_the_pools_rooms_never_reach_for_the_executor(modules: dict[str, Module]) -> None:
    # The manager, the factory and the sender work on the state they are given
    # (the pool only as a weak reference): none of them imports WorkerPool's room.
    importers = {
        n for n, targets in import_edges(modules).items() if "mpexec._pool._executor" in targets
    }
    assert importers <= {"mpexec._pool"}


def test_every_marked_private_access_says_why() -> None:
    # A private access marked for ruff with no reason is a seam nobody decided on.
    unexplained = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if "noqa: SLF001" not in line:
                    continue
                if line.split("noqa: SLF001", 1)[1].strip(" -"):
                    continue  # the reason follows on the line
                j = i - 1  # else a comment above it (and above the marked lines it follows)
                while j >= 0 and "noqa: SLF001" in lines[j]:
                    j -= 1
                if j < 0 or not lines[j].strip().startswith("#"):
                    unexplained.append(f"{path.relative_to(ROOT)}:{i + 1}")
    assert unexplained == []


def test_the_doctor_is_a_leaf_of_the_command_line(modules: dict[str, Module]) -> None:
    importers = {n for n, targets in import_edges(modules).items() if "mpexec._doctor" in targets}
    assert importers <= {"mpexec.__main__"}


def _forbidden_in_workers(loaded: set[str]) -> list[str]:
    return sorted(m for m in loaded if any(m == b or m.startswith(b + ".") for b in NOT_IN_WORKERS))


def test_worker_side_modules_load_no_caller_machinery(modules: dict[str, Module]) -> None:
    for name in WORKER_SIDE:
        assert name in modules, f"{name} is gone: update WORKER_SIDE"
        assert _forbidden_in_workers(import_closure(name, modules)) == [], name


def largest_module(modules: dict[str, Module]) -> tuple[int, str]:
    return max((len(m.path.read_text().splitlines()), name) for name, m in modules.items())


def test_no_module_grows_past_the_largest_recorded(modules: dict[str, Module]) -> None:
    lines, name = largest_module(modules)
    assert lines <= MAX_MODULE_LINES, (
        f"{name} has {lines} lines, past the recorded {MAX_MODULE_LINES}: split it into rooms"
    )


def test_the_design_cited_is_in_the_repository() -> None:
    # Comments, docstrings and pyproject.toml cite the invariants they keep by a section
    # of docs/design.md: each such section exists, and nothing cites a design elsewhere.
    headings = {
        line[3:].strip()
        for line in (ROOT / "docs" / "design.md").read_text().splitlines()
        if line.startswith("## ")
    }
    cited: list[tuple[str, str]] = []
    for folder in ("mpexec", "shm", "tests", "benchmarks", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".md", ".toml", ".ini") or not path.is_file():
                continue
            text = path.read_text()
            where = str(path.relative_to(ROOT))
            assert "DESIGN" + ".md" not in text, f"{where} cites a design not in the repository"
            found = re.finditer(r'docs/design\.md,\s+"([^"]+)"', text)
            cited.extend((where, " ".join(m.group(1).split())) for m in found)
    text = (ROOT / "pyproject.toml").read_text()
    cited += [("pyproject.toml", m) for m in re.findall(r'docs/design\.md, "([^"]+)"', text)]
    assert len(cited) >= 6
    assert [c for c in cited if c[1] not in headings] == []


def test_private_cross_module_accesses_only_go_down(modules: dict[str, Module]) -> None:
    found = private_accesses(modules)
    internal = [a for a in found if a.internal]
    foreign = [a for a in found if not a.internal]
    listing = "\n".join(map(str, found))
    assert len(internal) <= MAX_INTERNAL, f"new internal reaches; all of them:\n{listing}"
    assert len(foreign) <= MAX_FOREIGN, f"new foreign reaches; all of them:\n{listing}"


# ---------------------------------------------------------------- the checks can fail


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    return read_modules(tmp_path)


def test_a_function_level_import_cycle_is_found(tmp_path: pathlib.Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "mpexec/__init__.py": "",
            "mpexec/_a.py": "def f():\n    from . import _b\n",
            "mpexec/_b.py": "from ._a import f\n",
            "mpexec/_c.py": "if TYPE_CHECKING:\n    from ._a import f\n",
        },
    )
    assert cycles(import_edges(mods)) == [["mpexec._a", "mpexec._b"]]


def test_private_accesses_are_counted_by_the_rules(tmp_path: pathlib.Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "mpexec/__init__.py": "",
            "mpexec/_a.py": (
                "class A:\n"
                "    def __init__(self):\n"
                "        self._x = 1\n"
                "    def same(self, other):\n"
                "        return other._x\n"  # its own name: not counted
                "_current = None\n"
            ),
            "mpexec/_b.py": (
                "import numpy as np\n"
                "from . import _a\n"
                "from ._a import _current\n"  # rule 3, internal
                "from shm._platform import info\n"  # rule 4, internal
                "def f(a, fut):\n"
                "    _a._current = 1\n"  # rule 1 via a module, internal
                "    fut._tag = 2\n"  # its own tag: not counted
                "    getattr(a, '_x')\n"  # rule 2, internal
                "    np.random._rand\n"  # rule 1 via a module, foreign
                "    return a._x + fut._tag + fut._condition\n"  # internal, -, foreign
            ),
        },
    )
    found = private_accesses(mods)
    assert [(a.line, a.internal) for a in found if a.module == "mpexec._b"] == [
        (3, True),
        (4, True),
        (6, True),
        (8, True),
        (9, False),
        (10, True),
        (10, False),
    ]
    assert [a for a in found if a.module == "mpexec._a"] == []


def test_the_worker_ratchet_sees_imports_through_package_inits(tmp_path: pathlib.Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "mpexec/__init__.py": "",
            "mpexec/_pool/__init__.py": "",
            "mpexec/_graph.py": "",
            "mpexec/_scheduler.py": "",
            "mpexec/ad/__init__.py": "from .._pool import x\n",  # runs before ad._fetch
            "mpexec/ad/_fetch.py": (
                "from typing import TYPE_CHECKING as _TC\n"
                "if _TC:\n"
                "    from .. import _graph\n"  # never runs
                "def f():\n"
                "    from .. import _scheduler\n"  # runs later, in a call
            ),
        },
    )
    loaded = import_closure("mpexec.ad._fetch", mods)
    assert _forbidden_in_workers(loaded) == ["mpexec._pool"]
    assert "mpexec._scheduler" in import_edges(mods)["mpexec.ad._fetch"]  # but not at import
    assert "mpexec._graph" not in import_edges(mods)["mpexec.ad._fetch"]


def test_the_largest_module_is_found(tmp_path: pathlib.Path) -> None:
    mods = _tree(tmp_path, {"mpexec/__init__.py": "", "shm/_big.py": "x = 1\n" * 1_200})
    assert largest_module(mods) == (1_200, "shm._big")
    assert largest_module(mods)[0] > MAX_MODULE_LINES


def test_a_stdlib_futures_privates_are_foreign(tmp_path: pathlib.Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "mpexec/__init__.py": "",
            "mpexec/_a.py": "class A:\n    def __init__(self):\n        self._state = 1\n",
            "mpexec/_b.py": (
                "from concurrent.futures import Future\n"
                "def f(future: Future[int], a):\n"
                "    return future._state, a._state\n"  # foreign, internal (_a's)
            ),
        },
    )
    found = [(a.what, a.internal) for a in private_accesses(mods) if a.module == "mpexec._b"]
    assert found == [("a._state", True), ("future._state", False)]
