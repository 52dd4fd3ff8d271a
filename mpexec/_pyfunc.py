"""TensorFlow's Python-function ops on NumPy arrays, without TensorFlow.

:func:`py_func` (``tf.compat.v1.py_func``), :func:`numpy_function` and
:func:`py_function` take TensorFlow's arguments and keep its rules; the nested
``tf.contrib.framework.py_func`` lives in :mod:`mpexec.contrib` and is built
from the same parts. TensorFlow is never imported: a TF ``DType`` is
recognised by its ``as_numpy_dtype``.

- Outside a pipeline definition a call runs *eagerly*: the function and the
  checks on what it returns run in a worker of :func:`default_pool`, and the
  result comes back as NumPy arrays.
- Inside one (``_graph.current_graph()`` is set) a call adds a per-sample
  ``fn.python_function`` op, like a ``tf.data`` map, and returns its DataNodes.

Either way the user's function travels inside a :class:`PyFuncCall`: a
picklable callable holding the function, the expected output dtypes, the op's
name and, in a pipeline, the constant inputs bound at their positions. It
converts the inputs as TF's kernel does (strings become ``bytes``) and checks
the outputs as TF's kernel does: first their count, then each dtype::

    pyfunc_0 returns 1 values, but expects to see 2 values.        (ValueError)
    0-th value returned by pyfunc_0 is float64, but expects float32 (TypeError)

TF raises ``InvalidArgumentError`` for both; here a count is a ``ValueError``
and a dtype a ``TypeError``, and dtypes are spelt as NumPy spells them
(``float32``; TF says ``float``), with ``string`` for strings.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from . import _pid
from ._graph import DataNode, current_graph
from ._pool import WorkerPool

__all__ = [
    "PyFuncCall",
    "as_dtype",
    "default_pool",
    "numpy_function",
    "py_func",
    "py_function",
    "set_default_pool",
]

DType = np.dtype[Any]
#: A shape as ``output_shapes`` gives it: None for an unknown rank, None for an unknown dim.
Shape = tuple[int | None, ...] | None

#: TensorFlow's ``tf.string``: an object array whose items are ``bytes``.
STRING: DType = np.dtype(object)
_STRING_TYPES: tuple[Any, ...] = (str, bytes, object, np.bytes_, np.str_, np.object_)


# ---------------------------------------------------------------------------- dtypes
def as_dtype(spec: Any) -> DType:
    """A ``Tout`` entry as a NumPy dtype; every spelling of a string as ``object``.

    Takes NumPy dtypes and anything ``np.dtype()`` accepts, TensorFlow DTypes
    (anything with ``as_numpy_dtype``), and for strings ``str``, ``bytes``,
    ``object``, ``np.bytes_``, ``np.str_`` or ``"string"``. Python types follow
    NumPy: ``float`` is float64 (TF makes it float32).
    """
    if spec is None:
        raise TypeError("None is not a dtype: use Tout=[] for a function that returns nothing")
    if isinstance(spec, (Mapping, list, tuple)):  # NumPy would read a structured dtype
        raise TypeError(
            f"Cannot convert {spec!r} to a TensorFlow DType: {spec!r} is not a dtype; Tout "
            "takes NumPy dtypes (anything np.dtype() accepts), TensorFlow DTypes, or 'string'"
        )
    as_numpy = getattr(spec, "as_numpy_dtype", None)
    if as_numpy is not None and not isinstance(spec, np.dtype):
        spec = as_numpy  # a tf.DType; tf.string gives `object`
    if (isinstance(spec, str) and spec == "string") or any(spec is t for t in _STRING_TYPES):
        return STRING
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"Cannot convert {spec!r} to a TensorFlow DType: {spec!r} is not a dtype; Tout "
            "takes NumPy dtypes (anything np.dtype() accepts), TensorFlow DTypes, or 'string'"
        ) from exc
    if dtype.kind in "SUO":
        return STRING
    return _native(dtype)


def dtype_name(dtype: DType) -> str:
    """``float32``; ``string`` for the string dtype."""
    return "string" if dtype.kind == "O" else dtype.name


# ---------------------------------------------------------------------------- values
def _to_bytes(item: bytes | str) -> bytes:
    if isinstance(item, bytes):
        return item if type(item) is bytes else bytes(item)
    return item.encode("utf-8")


def _string_array(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any] | None:
    """``arr`` as an object array of ``bytes`` if it holds strings, else None.

    ``S`` and ``U`` arrays and object arrays of ``str``/``bytes`` qualify (an
    empty object array too, as in TF); ``str`` is encoded as UTF-8.
    """
    kind = arr.dtype.kind
    if kind not in "SUO":
        return None
    items = arr.ravel().tolist()
    if kind == "O":
        if not all(isinstance(x, (bytes, str)) for x in items):
            return None
        if all(type(x) is bytes for x in items):
            return arr
    out: np.ndarray[Any, Any] = np.empty(len(items), dtype=object)
    out[:] = [_to_bytes(x) for x in items]
    shaped: np.ndarray[Any, Any] = out.reshape(arr.shape)
    return shaped


def _as_input(value: Any, scalar: bool) -> Any:
    """What the function receives for one input: an array (strings as bytes).

    With ``scalar`` a 0-d input is handed over as a NumPy scalar (``bytes`` for
    a string), as TF's ``py_func`` kernel does (``PyArray_Return``).
    """
    if type(value) is np.ndarray and value.dtype.kind not in "SUO":  # the usual input
        return value[()] if scalar and value.ndim == 0 else value
    if isinstance(value, (bytes, str)):
        data = _to_bytes(value)
        return data if scalar else _object_scalar(data)
    arr = _asarray(value)
    strings = _string_array(arr)
    if strings is not None:
        arr = strings
    if scalar and arr.ndim == 0:
        return arr[()]
    return arr


def _as_output(value: Any) -> tuple[np.ndarray[Any, Any], bool]:
    """One returned value as an array, and whether it is a string array."""
    if isinstance(value, (bytes, str)):
        return _object_scalar(_to_bytes(value)), True
    arr = _asarray(value)
    strings = _string_array(arr)
    if strings is not None:
        return strings, True
    return arr, False


def _asarray(value: Any) -> np.ndarray[Any, Any]:
    """``np.asarray``, but strings nested in lists keep their trailing NULs (as TF's _convert)."""
    if isinstance(value, np.ndarray):
        return value
    arr: np.ndarray[Any, Any] = np.asarray(value)
    if arr.dtype.kind in "SU" and not isinstance(value, np.generic):
        arr = np.asarray(value, dtype=object)  # numpy's S/U would drop trailing NULs
    return arr


def _object_scalar(item: Any) -> np.ndarray[Any, Any]:
    arr: np.ndarray[Any, Any] = np.empty((), dtype=object)
    arr[()] = item
    return arr


def _is_single_none(value: Any) -> bool:
    return (
        isinstance(value, np.ndarray)
        and value.ndim == 0
        and value.dtype.kind == "O"
        and value[()] is None
    )


def _returned_values(ret: Any) -> list[Any]:
    """TF's reading of a return: a list/tuple is several values, None is none."""
    if isinstance(ret, (tuple, list)):
        return list(ret)
    if ret is None or _is_single_none(ret):
        return []
    return [ret]


def _check_outputs(
    values: Sequence[Any],
    dtypes: Sequence[DType],
    name: str,
    cast: bool,
    paths: Sequence[str] | None = None,
) -> list[np.ndarray[Any, Any]]:
    """The count first, then each dtype (cast with ``same_kind`` if ``cast``)."""
    if len(values) != len(dtypes):
        raise ValueError(
            f"{name} returns {len(values)} values, but expects to see {len(dtypes)} values."
        )
    out = []
    for i, (value, want) in enumerate(zip(values, dtypes, strict=True)):
        if type(value) is np.ndarray and value.dtype == want and want.kind != "O":
            out.append(value)  # the usual output: a numeric array of the declared dtype
            continue
        arr, is_string = _as_output(value)
        if want.kind == "O":
            ok = is_string
        else:
            ok = not is_string and arr.dtype.kind != "O" and _native(arr.dtype) == want
        if not ok:
            got = "string" if is_string else arr.dtype.name
            where = f" (at {paths[i]})" if paths is not None else ""
            castable = (
                cast
                and want.kind != "O"
                and arr.dtype.kind != "O"
                and not is_string
                and np.can_cast(arr.dtype, want, casting="same_kind")
            )
            if not castable:
                if cast:
                    raise TypeError(
                        f"{i}-th value returned by {name} is {got}, which cannot be cast "
                        f"to {dtype_name(want)}{where}"
                    )
                raise TypeError(
                    f"{i}-th value returned by {name} is {got}, but expects "
                    f"{dtype_name(want)}{where}"
                )
        if not is_string and arr.dtype != want:
            arr = arr.astype(want)  # a cast, or native byte order
        out.append(arr)
    return out


def _native(dtype: DType) -> DType:
    if dtype.isnative:
        return dtype
    native: DType = dtype.newbyteorder("=")
    return native


# ---------------------------------------------------------------------------- structures
def _convert_tree(value: Any) -> Any:
    """Nested tuples, lists and dicts with every leaf made an input (contrib)."""
    if isinstance(value, tuple):
        items = [_convert_tree(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [_convert_tree(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _convert_tree(v) for k, v in value.items()}
    return _as_input(value, scalar=True)


def flatten_all(value: Any, out: list[Any]) -> None:
    """Every leaf of ``value`` (dicts in sorted key order where keys sort), like nest."""
    if isinstance(value, (tuple, list)):
        for v in value:
            flatten_all(v, out)
    elif isinstance(value, Mapping):
        try:
            keys = sorted(value)
        except TypeError:
            keys = list(value)
        for k in keys:
            flatten_all(value[k], out)
    else:
        out.append(value)


def _is_node(value: Any) -> bool:
    return isinstance(value, DataNode)


def contains_node(value: Any, is_input: Callable[[Any], bool] = _is_node) -> bool:
    """Whether ``value`` is, or nests, an input (a DataNode; a TF tensor for the TF op)."""
    if is_input(value):
        return True
    if isinstance(value, (tuple, list)):
        return any(contains_node(v, is_input) for v in value)
    if isinstance(value, Mapping):
        return any(contains_node(v, is_input) for v in value.values())
    return False


class _Slot:
    """In a bound template: where the ``index``-th DataNode input goes."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Slot, (self.index,))


class _Node:
    """In a bound template: a tuple, list or dict with a DataNode somewhere inside."""

    __slots__ = ("items", "kind")

    def __init__(self, kind: Any, items: list[tuple[Any, Any]]) -> None:
        self.kind = kind  # "list", "dict", or a tuple type
        self.items = items

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Node, (self.kind, self.items))


def bind(
    value: Any, nodes: list[Any], nested: bool, is_input: Callable[[Any], bool] = _is_node
) -> Any:
    """``value`` with each input (a DataNode; ``is_input``) made a :class:`_Slot` (appended
    to ``nodes``).

    Containers without an input stay as they are, so filling the template in
    does not walk constants.
    """
    if is_input(value):
        nodes.append(value)
        return _Slot(len(nodes) - 1)
    if not nested or not contains_node(value, is_input):
        return value
    if isinstance(value, Mapping):
        return _Node("dict", [(k, bind(v, nodes, nested, is_input)) for k, v in value.items()])
    kind: Any = "list" if isinstance(value, list) else type(value)
    return _Node(kind, [(i, bind(v, nodes, nested, is_input)) for i, v in enumerate(value)])


def _fill(value: Any, inputs: Sequence[Any]) -> Any:
    if isinstance(value, _Slot):
        return inputs[value.index]
    if not isinstance(value, _Node):
        return value
    items = [(k, _fill(v, inputs)) for k, v in value.items]
    if value.kind == "dict":
        return dict(items)
    if value.kind == "list":
        return [v for _, v in items]
    if hasattr(value.kind, "_fields"):
        return value.kind(*[v for _, v in items])
    return tuple(v for _, v in items)


class OutputStructure:
    """contrib's nested ``output_types`` (and ``output_shapes``), flattened once.

    ``types`` keeps the user's nesting with each leaf a dtype (None: the
    function returns nothing); ``dtypes``, ``paths`` (``output[1]['mask']``)
    and ``shapes`` list the leaves in order.
    """

    __slots__ = ("dtypes", "paths", "shapes", "types")

    def __init__(self, types: Any, shapes: Sequence[Shape] | None) -> None:
        self.types = types
        dtypes: list[DType] = []
        paths: list[str] = []
        if types is not None:
            _leaves(types, "output", dtypes, paths)
        self.dtypes = tuple(dtypes)
        self.paths = tuple(paths)
        self.shapes = tuple(shapes) if shapes is not None else None

    @classmethod
    def build(cls, output_types: Any, output_shapes: Any) -> OutputStructure:
        types = None if output_types is None else _normalize_types(output_types)
        if output_shapes is None or types is None:
            return cls(types, None)
        shapes: list[Shape] = []
        _normalize_shapes(types, output_shapes, "output_shapes", shapes)
        return cls(types, shapes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (OutputStructure, (self.types, self.shapes))

    def key(self) -> Any:
        """A hashable summary for the eager wrapper cache."""
        return (_freeze(self.types), self.shapes)

    def flatten(self, ret: Any, name: str) -> list[Any]:
        """The function's return, checked against the structure and flattened."""
        if ret is None or self.types is None:
            return _returned_values(ret)
        _assert_structure(self.types, ret, "output", name)
        out: list[Any] = []
        _flatten_as(self.types, ret, out)
        return out

    def check_shapes(self, arrays: Sequence[np.ndarray[Any, Any]], name: str) -> None:
        if self.shapes is None:
            return
        for arr, shape, path in zip(arrays, self.shapes, self.paths, strict=True):
            if shape is None:
                continue
            if len(arr.shape) != len(shape) or any(
                d is not None and d != n for d, n in zip(shape, arr.shape, strict=True)
            ):
                raise ValueError(
                    f"{name}: {path} has shape {tuple(arr.shape)}, but output_shapes says "
                    f"{_shape_str(shape)}"
                )

    def pack(self, flat: Sequence[Any]) -> Any:
        """The flat outputs nested as ``output_types`` is."""
        if self.types is None:
            return None
        it = iter(flat)
        return _pack(self.types, it)


def _normalize_types(types: Any) -> Any:
    if isinstance(types, Mapping):
        return {k: _normalize_types(v) for k, v in types.items()}
    if isinstance(types, list):
        return [_normalize_types(v) for v in types]
    if isinstance(types, tuple):
        items = [_normalize_types(v) for v in types]
        return type(types)(*items) if hasattr(types, "_fields") else tuple(items)
    return as_dtype(types)


def _leaves(types: Any, path: str, dtypes: list[DType], paths: list[str]) -> None:
    if isinstance(types, Mapping):
        for k, v in types.items():
            _leaves(v, f"{path}[{k!r}]", dtypes, paths)
    elif isinstance(types, (list, tuple)):
        for i, v in enumerate(types):
            _leaves(v, f"{path}[{i}]", dtypes, paths)
    else:
        dtypes.append(types)
        paths.append(path)


def _normalize_shapes(types: Any, shapes: Any, path: str, out: list[Shape]) -> None:
    """``output_shapes`` read up to the structure of ``output_types``."""
    if isinstance(types, Mapping):
        if not isinstance(shapes, Mapping) or set(shapes) != set(types):
            raise ValueError(
                f"{path} should be a dict with keys {list(types)} like output_types, not {shapes!r}"
            )
        for k, v in types.items():
            _normalize_shapes(v, shapes[k], f"{path}[{k!r}]", out)
    elif isinstance(types, (list, tuple)):
        if not isinstance(shapes, (list, tuple)) or len(shapes) != len(types):
            raise ValueError(
                f"{path} should be a sequence of {len(types)} shapes like output_types, "
                f"not {shapes!r}"
            )
        for i, (t, s) in enumerate(zip(types, shapes, strict=True)):
            _normalize_shapes(t, s, f"{path}[{i}]", out)
    else:
        out.append(as_shape(shapes, path))


def as_shape(spec: Any, what: str = "shape") -> Shape:
    """A shape: None (unknown rank) or a tuple of ints and None (unknown dims).

    Takes tuples and lists, and TensorShape-like objects (``rank``, ``as_list()``).
    """
    if spec is None:
        return None
    if not isinstance(spec, (list, tuple)) and hasattr(spec, "as_list"):
        if getattr(spec, "rank", 0) is None:
            return None
        spec = spec.as_list()
    if not isinstance(spec, (list, tuple)):
        raise TypeError(f"{what}: {spec!r} is not a shape (a tuple of ints and None)")
    dims: list[int | None] = []
    for dim in spec:
        d = getattr(dim, "value", dim)  # a TF1 Dimension
        if d is None:
            dims.append(None)
        elif isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0:
            dims.append(int(d))
        else:
            raise ValueError(
                f"{what}: {dim!r} in {spec!r} is not a dimension (an int >= 0, or None "
                "for an unknown one)"
            )
    return tuple(dims)


def _shape_str(shape: tuple[int | None, ...]) -> str:
    return str(tuple(shape))


def _assert_structure(types: Any, ret: Any, path: str, name: str) -> None:
    """``ret`` nests as ``output_types`` does: dicts with its keys, sequences of its lengths."""
    kind: Any
    shown: Callable[[Any], Any]  # what a message shows of a container
    key: Callable[[Any], Any]  # what must be equal
    items: Iterable[tuple[Any, Any]]
    if isinstance(types, Mapping):
        kind, noun, unit, shown, key = Mapping, "a dict with", "keys {}", list, set
        items = types.items()
    elif isinstance(types, (list, tuple)):
        kind, noun, unit, shown, key = (list, tuple), "a sequence of", "{} values", len, len
        items = enumerate(types)
    else:
        return
    if not isinstance(ret, kind):
        raise TypeError(
            f"{name}: {path} should be {noun} {unit.format(shown(types))}, as in "
            f"output_types, but the function returned a {type(ret).__name__}"
        )
    if key(ret) != key(types):
        raise ValueError(
            f"{name}: {path} has {unit.format(shown(ret))}, but output_types has {shown(types)}"
        )
    for k, t in items:
        _assert_structure(t, ret[k], f"{path}[{k!r}]", name)


def _flatten_as(types: Any, ret: Any, out: list[Any]) -> None:
    if isinstance(types, Mapping):
        for k, t in types.items():
            _flatten_as(t, ret[k], out)
    elif isinstance(types, (list, tuple)):
        for t, r in zip(types, ret, strict=True):
            _flatten_as(t, r, out)
    else:
        flatten_all(ret, out)  # as nest.flatten: a leaf's value is flattened whole


def _pack(types: Any, it: Any) -> Any:
    if isinstance(types, Mapping):
        return {k: _pack(t, it) for k, t in types.items()}
    if isinstance(types, list):
        return [_pack(t, it) for t in types]
    if isinstance(types, tuple):
        items = [_pack(t, it) for t in types]
        return type(types)(*items) if hasattr(types, "_fields") else tuple(items)
    return next(it)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return ("d", tuple((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_freeze(v) for v in value))
    return value


# ---------------------------------------------------------------------------- the call
class PyFuncCall:
    """The user's function with TF's checks around it: what a worker runs.

    ``func`` is called with the inputs converted as TF converts them;
    what it returns is checked against ``dtypes`` (``cast``: py_function's
    casting) and returned as None (no outputs), one array, or a tuple of
    arrays. ``template`` binds the constant inputs of a pipeline op around
    its DataNode inputs; ``structure`` holds contrib's nested output_types.
    ``tensors`` (py_function inside a TensorFlow graph): ``func`` gets
    EagerTensors, as TF's py_function hands them, and may return them; the
    worker imports TensorFlow for it. Objects are compared by identity, so
    that a pool ships each one once.
    """

    __slots__ = ("cast", "dtypes", "func", "name", "structure", "template", "tensors")

    def __init__(
        self,
        func: Callable[..., Any],
        dtypes: tuple[DType, ...],
        name: str,
        cast: bool = False,
        template: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
        structure: OutputStructure | None = None,
        tensors: bool = False,
    ) -> None:
        self.func = func
        self.dtypes = dtypes
        self.name = name
        self.cast = cast
        self.template = template
        self.structure = structure
        self.tensors = tensors

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            PyFuncCall,
            (
                self.func,
                self.dtypes,
                self.name,
                self.cast,
                self.template,
                self.structure,
                self.tensors,
            ),
        )

    def __repr__(self) -> str:
        func = getattr(self.func, "__qualname__", repr(self.func))
        outs = ", ".join(dtype_name(d) for d in self.dtypes)
        return f"<PyFuncCall {self.name}: {func} -> [{outs}]>"

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        args: tuple[Any, ...] = inputs
        if self.template is not None:
            bound_args, bound_kwargs = self.template
            args = tuple(_fill(a, inputs) for a in bound_args)
            kwargs = {**{k: _fill(v, inputs) for k, v in bound_kwargs.items()}, **kwargs}
        structure = self.structure
        if self.tensors:
            ret = self.func(*_eager_tensors([_as_input(a, scalar=False) for a in args]))
            values = _from_tensors(_returned_values(ret))
            paths = None
        elif structure is None:
            ret = self.func(*[_as_input(a, scalar=not self.cast) for a in args])
            values = _returned_values(ret)
            paths = None
        else:
            ret = self.func(*_convert_tree(args), **_convert_tree(kwargs))
            values = structure.flatten(ret, self.name)
            paths = structure.paths
        arrays = _check_outputs(values, self.dtypes, self.name, self.cast, paths)
        if structure is not None:
            structure.check_shapes(arrays, self.name)
        if not arrays:
            return None
        return arrays[0] if len(arrays) == 1 else tuple(arrays)


def _eager_tensors(arrays: list[Any]) -> list[Any]:
    """The inputs as TF's py_function hands them: EagerTensors (TF imported here, in the worker)."""
    import tensorflow as tf

    return [tf.convert_to_tensor(a) for a in arrays]


def _from_tensors(values: list[Any]) -> list[Any]:
    """What a py_function returned, tensors as arrays; a variable is refused, as in TF."""
    import tensorflow as tf

    out = []
    for value in values:
        if isinstance(value, tf.Variable):
            raise RuntimeError(  # noqa: TRY004 - TF's type and words (an UnknownError in TF)
                "Attempting to return a variable from an eagerly executed py_func. Only "
                "numeric data structures like Tensors or NumPy arrays should be returned; "
                "to return the value of a variable, make sure to obtain the Tensor backing "
                f"it by calling `.read_value()` on the variable in question: {value}"
            )
        out.append(value.numpy() if isinstance(value, tf.Tensor) else value)
    return out


_tokens = itertools.count()
_token_lock = threading.Lock()


def op_name(name: str | None) -> str:
    """``name``, or the next ``pyfunc_{k}`` (one counter for the whole process, as TF)."""
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name must be a str or None, not {type(name).__name__}")
        return name
    with _token_lock:
        return f"pyfunc_{next(_tokens)}"


def check_callable(func: Any) -> None:
    if not callable(func):
        raise ValueError(  # noqa: TRY004 (TF's exception)
            f"Expected func to be callable. Received func={func!r} of type {type(func)}."
        )


#: Eager wrappers, reused so that the pool ships a function once; a bounded LRU.
#: The key holds id(func): the wrapper holds func, so the id is not reused meanwhile.
_WRAPPER_CACHE = 256
_wrappers: collections.OrderedDict[Any, PyFuncCall] = collections.OrderedDict()
_wrappers_lock = threading.Lock()


def eager_wrapper(
    func: Callable[..., Any],
    dtypes: tuple[DType, ...],
    name: str | None,
    cast: bool,
    structure: OutputStructure | None = None,
) -> PyFuncCall:
    """The one :class:`PyFuncCall` for eager calls of ``func`` with these outputs."""
    try:
        key: Any = (
            id(func),
            dtypes,
            name,
            cast,
            None if structure is None else structure.key(),
        )
        hash(key)
    except TypeError:  # an unhashable leaf somewhere: no reuse
        return PyFuncCall(func, dtypes, op_name(name), cast, None, structure)
    with _wrappers_lock:
        wrapper = _wrappers.get(key)
        if wrapper is not None and wrapper.func is func:
            _wrappers.move_to_end(key)
            return wrapper
        wrapper = PyFuncCall(func, dtypes, op_name(name), cast, None, structure)
        _wrappers[key] = wrapper
        if len(_wrappers) > _WRAPPER_CACHE:
            _wrappers.popitem(last=False)
        return wrapper


def run_eager(wrapper: PyFuncCall, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``wrapper(*args, **kwargs)`` in a worker of the default pool; its result."""
    return default_pool().submit(wrapper, *args, **kwargs).result()


def add_op(
    wrapper: PyFuncCall, nodes: Sequence[DataNode], stateful: bool, name: str | None
) -> list[DataNode]:
    """A per-sample ``fn.python_function`` op running ``wrapper``; its outputs as a list."""
    from . import fn

    n = len(wrapper.dtypes)
    # TensorFlow's `stateful` forbids merging and pruning the op, not running it
    # in parallel (tf.data maps stateful py_funcs with num_parallel_calls too).
    out = fn.python_function(
        *nodes, function=wrapper, num_outputs=n, preserve=stateful, name=name or wrapper.name
    )
    if n == 0:
        return []
    if n == 1:
        return [out]
    return list(out)


def in_tensorflow(inputs: Sequence[Any], tout: Any) -> bool:
    """Whether a call belongs inside TensorFlow (:mod:`mpexec._pyfunc_tf`): never before
    TensorFlow is imported.

    It does when TensorFlow is building a graph (``tf.function``, a ``tf.data`` map,
    a v1 graph), when an input is a TF tensor, and when no input is an array and
    ``Tout`` names a TF DType; else it runs on arrays, as always.
    """
    if "tensorflow" not in sys.modules:
        return False
    from . import _pyfunc_tf

    leaves: list[Any] = []
    flatten_all(list(inputs), leaves)
    touts: list[Any] = []
    flatten_all(tout if isinstance(tout, (list, tuple, Mapping)) else [tout], touts)
    return _pyfunc_tf.wanted(leaves, touts)


def _tf_script_op(
    func: Callable[..., Any],
    inputs: list[Any],
    Tout: Any,
    stateful: bool,
    name: str | None,
    cast: bool,
) -> Any:
    """``py_func``/``numpy_function`` (``cast``: ``py_function``) as a TF op; TF tensors out."""
    from . import _pyfunc_tf

    is_list = isinstance(Tout, (list, tuple))
    specs = list(Tout) if is_list else [Tout]
    _pyfunc_tf.refuse_composites(inputs, specs)
    touts = [_pyfunc_tf.tf_dtype(t, as_dtype) for t in specs]
    dtypes = tuple(as_dtype(t.as_numpy_dtype) for t in touts)
    # py_function's function gets EagerTensors in the worker, as TF's gets them.
    call = PyFuncCall(_pyfunc_tf.shippable(func), dtypes, op_name(name), cast, tensors=cast)
    return _pyfunc_tf.add_op(call, default_pool, inputs, touts, is_list, stateful, name, cast)


def _inputs(inp: Any) -> list[Any]:
    tensor_like = hasattr(inp, "dtype") and hasattr(inp, "shape")  # an array, a TF tensor
    if tensor_like or isinstance(inp, (str, bytes, DataNode)) or not isinstance(inp, Iterable):
        raise TypeError(
            f"inp must be a list of inputs, not {type(inp).__name__}; for one input write [x]"
        )
    return list(inp)


def _script_op(
    func: Callable[..., Any],
    inp: Any,
    Tout: Any,
    stateful: bool,
    name: str | None,
    cast: bool,
) -> Any:
    check_callable(func)
    inputs = _inputs(inp)
    if current_graph() is None and in_tensorflow(inputs, Tout):
        return _tf_script_op(func, inputs, Tout, stateful, name, cast)
    is_list = isinstance(Tout, (list, tuple))
    dtypes = tuple(as_dtype(t) for t in (Tout if is_list else [Tout]))
    if current_graph() is None:
        if any(isinstance(x, DataNode) for x in inputs):
            raise TypeError(
                "a DataNode was given outside a pipeline definition; eager calls take arrays"
            )
        out = run_eager(eager_wrapper(func, dtypes, name, cast), inputs, {})
        if not is_list:
            return out
        if not dtypes:
            return []
        return [out] if len(dtypes) == 1 else list(out)
    nodes: list[DataNode] = []
    bound = tuple(bind(x, nodes, nested=False) for x in inputs)
    if any(not isinstance(b, _Slot) and contains_node(b) for b in bound):
        raise TypeError("a DataNode inside a nested input: pass DataNodes directly in inp")
    wrapper = PyFuncCall(func, dtypes, op_name(name), cast, (bound, {}))
    outs = add_op(wrapper, nodes, stateful, name)
    return outs if is_list else outs[0]


# ---------------------------------------------------------------------------- public ops
def py_func(
    func: Callable[..., Any],
    inp: Iterable[Any],
    Tout: Any,
    stateful: bool = True,
    name: str | None = None,
) -> Any:
    """TF's ``tf.compat.v1.py_func``: call ``func`` on arrays, check what it returns.

    ``func(*inp)`` receives NumPy arrays (0-d inputs as NumPy scalars, strings
    as ``bytes``: object arrays of bytes) and returns one value, or a list or
    tuple of values, that must match ``Tout`` exactly: no casting.

    ``Tout`` is a dtype, or a list/tuple of dtypes (see :func:`as_dtype`). The
    count is checked first (``ValueError``), then each dtype (``TypeError``);
    ``None`` is returned by a function with ``Tout=[]`` only. Returns an array
    for a single ``Tout``, a list of arrays for a list; string outputs are
    object arrays of ``bytes``.

    Eagerly it runs in a worker of :func:`default_pool`; a stateful function's
    state stays in that worker. In a pipeline definition ``inp`` may hold
    DataNodes (the rest are constants) and the result is DataNodes.
    """
    return _script_op(func, inp, Tout, stateful, name, cast=False)


def numpy_function(
    func: Callable[..., Any],
    inp: Iterable[Any],
    Tout: Any,
    stateful: bool = True,
    name: str | None = None,
) -> Any:
    """TF's ``tf.numpy_function``: the same as :func:`py_func`."""
    return _script_op(func, inp, Tout, stateful, name, cast=False)


def py_function(
    func: Callable[..., Any],
    inp: Iterable[Any],
    Tout: Any,
    name: str | None = None,
) -> Any:
    """TF's ``tf.py_function``, on NumPy arrays instead of EagerTensors.

    As :func:`py_func`, except that inputs stay arrays (0-d too) and each
    returned value is cast to its ``Tout`` where NumPy allows it with
    ``same_kind`` casting (float64 to float32, int to float); other values
    raise ``TypeError``. The op counts as stateful, as TF's does.
    """
    return _script_op(func, inp, Tout, True, name, cast=True)


# TensorFlow's autograph calls a function carrying this attribute as it is, instead of
# converting its source (as it converts a tf.data map's or a tf.function's code):
# these entry points run in Python, TensorFlow need not be imported to mark them.
for _entry in (py_func, numpy_function, py_function):
    vars(_entry)["autograph_info__"] = frozenset()


# ---------------------------------------------------------------------------- default pool
_pool_lock = threading.Lock()
_default: WorkerPool | None = None
_owned = False  # _default was made here (not given to set_default_pool)
_owner_pid = 0
_atexit_registered = False


def default_pool() -> WorkerPool:
    """The pool that eager calls run on, made on first use (``WorkerPool()``).

    A pool given to :func:`set_default_pool` is used as it is. One made here
    is replaced if it broke or was shut down, and in a forked child; it is
    shut down at interpreter exit.
    """
    global _default, _owned, _owner_pid, _atexit_registered
    pool = _default  # read without the lock: set_default_pool's last word, or the one before
    if pool is not None and _owner_pid == _pid.pid and not (_owned and _unusable(pool)):
        return pool
    with _pool_lock:
        pool = _default
        if pool is not None and _owner_pid != _pid.pid:
            pool = None  # inherited through fork: the parent's, unusable here
        elif pool is not None and _owned and _unusable(pool):
            pool.shutdown(wait=False, cancel_futures=True)
            pool = None
        if pool is None:
            pool = WorkerPool()
            _default, _owned, _owner_pid = pool, True, _pid.pid
            if not _atexit_registered:
                atexit.register(_shutdown_default)
                _atexit_registered = True
        return pool


def set_default_pool(pool: WorkerPool | None) -> None:
    """Run eager calls on ``pool`` (you keep it, and shut it down); None: on one made here.

    A pool that :func:`default_pool` made is shut down when it is replaced.
    """
    global _default, _owned, _owner_pid
    if pool is not None and not isinstance(pool, WorkerPool):
        raise TypeError(f"expected a WorkerPool or None, not {type(pool).__name__}")
    with _pool_lock:
        old, old_owned, old_pid = _default, _owned, _owner_pid
        _default, _owned, _owner_pid = pool, False, _pid.pid
    if old is not None and old_owned and old is not pool and old_pid == _pid.pid:
        old.shutdown(wait=True)


def _unusable(pool: WorkerPool) -> bool:
    return pool.status.state in ("broken", "closed")


def _shutdown_default() -> None:
    global _default
    with _pool_lock:
        pool = _default if _owned and _owner_pid == _pid.pid else None
        if pool is not None:
            _default = None
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
