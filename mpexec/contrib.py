"""TF 1.x's ``tf.contrib.framework.py_func``: nested structures in and out, shapes checked.

``mpexec.contrib.py_func`` is :func:`mpexec.py_func` for functions that take
and return nested tuples, lists and dicts. Like the rest of mpexec's TensorFlow
entry points it runs eagerly on a worker pool outside a pipeline definition,
and adds a per-sample op inside one; on TF tensors (or while TensorFlow builds
a graph) it adds a TensorFlow op, as the other entry points do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import _pyfunc
from ._graph import DataNode, current_graph

__all__ = ["py_func"]


def py_func(
    func: Callable[..., Any],
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    output_types: Any = None,
    output_shapes: Any = None,
    stateful: bool = True,
    name: str | None = None,
) -> Any:
    """Call ``func(*args, **kwargs)`` on arrays; check its output's structure, dtypes, shapes.

    - ``args`` (a list or tuple) and ``kwargs`` (a dict) may nest tuples,
      lists and dicts; each leaf reaches ``func`` as :func:`mpexec.py_func`
      gives inputs (arrays, 0-d ones as NumPy scalars, strings as ``bytes``),
      in the same nesting.
    - ``output_types``: a dtype, or a nested structure of dtypes, that the
      return must follow (same nesting, dict keys and lengths); each leaf's
      dtype is checked with no casting. ``None``: ``func`` returns nothing
      (``None``), and so does this call.
    - ``output_shapes``: None, or shapes nested as ``output_types`` is (tuples
      of ints, None for an unknown dimension; None for an unknown rank).
      A returned array of another shape raises ``ValueError`` naming where it
      sits (``output[1]['mask']``).
    - Either may be a callable, called with ``*args, **kwargs`` to get it.

    Returns the outputs nested as ``output_types`` is (arrays eagerly; DataNodes in
    a pipeline definition, where leaves of ``args``/``kwargs`` may be DataNodes;
    TF tensors, with ``output_shapes`` set on them, where leaves are TF tensors or
    TensorFlow builds a graph).
    """
    _pyfunc.check_callable(func)
    if kwargs is None:
        kwargs = {}
    if not isinstance(args, (list, tuple)):
        raise TypeError(f"args must be list and not {type(args)}. args: {args}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be dict and not {type(kwargs)}. args: {kwargs}")
    if _is_function(output_types):
        output_types = output_types(*args, **kwargs)
    if _is_function(output_shapes):
        output_shapes = output_shapes(*args, **kwargs)
    structure = _pyfunc.OutputStructure.build(output_types, output_shapes)
    if current_graph() is None and _pyfunc.in_tensorflow([args, dict(kwargs)], output_types):
        return _tf_op(func, args, kwargs, structure, stateful, name)
    if current_graph() is None:
        if _pyfunc.contains_node(args) or _pyfunc.contains_node(dict(kwargs)):
            raise TypeError(
                "a DataNode was given outside a pipeline definition; eager calls take arrays"
            )
        wrapper = _pyfunc.eager_wrapper(func, structure.dtypes, name, False, structure)
        out = _pyfunc.run_eager(wrapper, tuple(args), dict(kwargs))
        return structure.pack(_flat(out, len(structure.dtypes)))
    nodes: list[DataNode] = []
    bound_args = tuple(_pyfunc.bind(a, nodes, nested=True) for a in args)
    bound_kwargs = {k: _pyfunc.bind(v, nodes, nested=True) for k, v in kwargs.items()}
    wrapper = _pyfunc.PyFuncCall(
        func,
        structure.dtypes,
        _pyfunc.op_name(name),
        False,
        (bound_args, bound_kwargs),
        structure,
    )
    return structure.pack(_pyfunc.add_op(wrapper, nodes, stateful, name))


def _tf_op(
    func: Callable[..., Any],
    args: Any,
    kwargs: Mapping[str, Any],
    structure: _pyfunc.OutputStructure,
    stateful: bool,
    name: str | None,
) -> Any:
    """As a TF op: tensors anywhere in ``args``/``kwargs``; outputs nested, shapes set."""
    from . import _pyfunc_tf

    tensors: list[Any] = []
    is_tensor = _pyfunc_tf.is_tensor
    bound_args = tuple(_pyfunc.bind(a, tensors, True, is_tensor) for a in args)
    bound_kwargs = {k: _pyfunc.bind(v, tensors, True, is_tensor) for k, v in kwargs.items()}
    _pyfunc_tf.refuse_composites(tensors)
    call = _pyfunc.PyFuncCall(
        _pyfunc_tf.shippable(func),
        structure.dtypes,
        _pyfunc.op_name(name),
        False,
        (bound_args, bound_kwargs),
        structure,
    )
    touts = [_pyfunc_tf.tf_dtype(d, _pyfunc.as_dtype) for d in structure.dtypes]
    out = _pyfunc_tf.add_op(call, _pyfunc.default_pool, tensors, touts, True, stateful, name)
    if not touts:
        return None
    flat = list(out) if isinstance(out, (list, tuple)) else [out]  # eager: one is a Tensor
    if structure.shapes is not None:
        for tensor, shape in zip(flat, structure.shapes, strict=True):
            if shape is not None:
                tensor.set_shape(shape)
    return structure.pack(flat)


vars(py_func)["autograph_info__"] = frozenset()  # autograph calls it as it is (see _pyfunc)


def _is_function(value: Any) -> bool:
    """Callable, and not a dtype: ``np.float32`` and ``float`` are types, hence callable."""
    return (
        callable(value)
        and not isinstance(value, (type, np.dtype))
        and not hasattr(value, "as_numpy_dtype")
    )


def _flat(out: Any, n: int) -> list[Any]:
    """A :class:`~mpexec._pyfunc.PyFuncCall` result (None, one array, a tuple) as a list."""
    if n == 0:
        return []
    return [out] if n == 1 else list(out)
