"""mpexec's py_func family inside TensorFlow graphs: TF's own op, its body waiting on a worker.

:mod:`mpexec._pyfunc` hands a call here when it belongs to TensorFlow (see
``_pyfunc.in_tensorflow``): TF is building a graph (``tf.function``, a ``tf.data`` map, a
Keras layer, a v1 graph), or an input is a TF tensor. The op added is
TensorFlow's own ``numpy_function`` (kernels ``PyFunc`` / ``PyFuncStateless``),
so TF's rules hold as they are: ``Tout``, names, control dependencies,
placement, Python errors mapped to TF's error codes. Its Python body only
hands the arrays to a worker and waits::

    TF kernel thread (holds the GIL)            mpexec worker (a GIL of its own)
    _Body(*arrays)   (views of TF's tensors)
      pool.run_call(call, arrays)  ---------->  PyFuncCall: the user's function,
        inputs copied once into shared memory     TF's checks on what it returns
        waits, the GIL released (no Future) <---  outputs in the worker's arena
    return read-only views of them   (a 64-byte aligned one becomes TF's tensor uncopied)

A blocking wait releases the GIL, so N TF threads (``num_parallel_calls=N``,
inter-op threads) keep N workers busy at once; under the GIL each call costs
only the submit and the input copy. This module imports TensorFlow; it is
imported only once TensorFlow has been (by the user), and imports nothing of
mpexec: :mod:`mpexec._pyfunc` and :mod:`mpexec.contrib` build the call (a
``PyFuncCall``) and hand it here with the pool to run it on.
"""

from __future__ import annotations

import itertools
import threading
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["add_op", "is_tensor", "refuse_composites", "shippable", "tf_dtype", "wanted"]

#: Python exceptions as TF's py_func kernel maps them (py_func.cc); the rest are UnknownError.
_TF_ERRORS: tuple[tuple[type[BaseException], type[Exception]], ...] = (
    (ValueError, tf.errors.InvalidArgumentError),
    (TypeError, tf.errors.InvalidArgumentError),
    (StopIteration, tf.errors.OutOfRangeError),
    (MemoryError, tf.errors.ResourceExhaustedError),
    (NotImplementedError, tf.errors.UnimplementedError),
)

_homes = itertools.count()
#: The NumPy scalars TF hands a 0-d numeric tensor over as (strings come as ``bytes``).
_SCALARS = (np.number, np.bool_)
#: On a thread running an eager call (``watching``): the exception its body raised.
_failed = threading.local()


def is_tensor(value: Any) -> bool:
    """A TF tensor, variable or composite tensor (ragged, sparse): TF's, not an array."""
    return bool(tf.is_tensor(value)) or isinstance(value, tf.Variable)


def wanted(leaves: Sequence[Any], touts: Sequence[Any]) -> bool:
    """Whether a call is a TF op: TF builds a graph, a leaf of its inputs is a TF tensor,
    or none is an array and a ``Tout`` leaf is a ``tf.DType``."""
    if not tf.executing_eagerly():
        return True  # building a graph: tf.function, tf.data, Keras, v1
    if any(is_tensor(x) for x in leaves):
        return True
    if any(isinstance(x, (np.ndarray, np.generic)) for x in leaves):
        return False
    return any(isinstance(t, tf.DType) for t in touts)


def tf_dtype(spec: Any, fallback: Callable[[Any], Any]) -> Any:
    """A ``Tout`` entry as a ``tf.DType``: TF's reading first (``float`` is float32), then
    ``fallback``'s NumPy dtype (which raises TF's "Cannot convert" for a non-dtype)."""
    if isinstance(spec, tf.TensorSpec):
        spec = spec.dtype
    try:
        return tf.as_dtype(spec)
    except TypeError:
        pass
    dtype = fallback(spec)
    return tf.string if dtype.kind == "O" else tf.as_dtype(dtype)


class _Autograph:
    """TF's autograph runtime (``ag__``) for a function autograph converted.

    A lambda written inside a function that TensorFlow converts (a ``tf.data``
    map's, a ``tf.function``'s) reaches us converted, calling ``ag__``: a module
    TF builds at run time, which pickles under a name that lacks most of it.
    This stands in for it: here it is TF's, in a worker it is rebuilt there
    (which imports TensorFlow in that worker).
    """

    def __init__(self, module: Any = None) -> None:
        self._module = module

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Autograph, ())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if self._module is None:
            from tensorflow.python.autograph.impl import api  # TF's own runtime, in the worker

            self._module = api.PyToTF().get_extra_locals()["ag__"]
        return getattr(self._module, name)


def shippable(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func``, or a copy of an autograph-converted one whose ``ag__`` pickles."""
    if not isinstance(func, types.FunctionType) or not hasattr(func, "autograph_info__"):
        return func
    names = func.__code__.co_freevars
    if "ag__" not in names or func.__closure__ is None:
        return func
    cells = list(func.__closure__)
    i = names.index("ag__")
    if isinstance(cells[i].cell_contents, _Autograph):
        return func
    cells[i] = types.CellType(_Autograph(cells[i].cell_contents))
    clone = types.FunctionType(
        func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(cells)
    )
    clone.__kwdefaults__ = func.__kwdefaults__
    return clone


class _Body:
    """The op's Python body, run by TF's kernel: hands the arrays to a worker, waits.

    Calls made one after another go to the op's home worker, so state the
    function keeps (an iterator, a counter) advances as it does in TF; calls
    made while one is in flight spread over the pool's least busy workers.
    The pool is the default pool at the time of the call.
    """

    __slots__ = ("__weakref__", "busy", "call", "home", "lock", "pool")

    def __init__(self, call: Any, pool: Callable[[], Any]) -> None:
        self.call = call
        self.pool = pool
        self.home = next(_homes)  # taken modulo the pool's workers
        self.busy = 0
        self.lock = threading.Lock()

    def __call__(self, *arrays: Any) -> Any:
        with self.lock:
            worker = self.home if self.busy == 0 else None
            self.busy += 1
        try:
            # TF hands a 0-d tensor over as a NumPy scalar, which pickles through its
            # reduce (its dtype's too: ~25 objects, each a persistent_id call of ours);
            # as a 0-d array it goes inline, one object. The worker hands the function
            # the scalar again (_pyfunc._as_input), as TF does.
            # One input (a map's usual) is converted inline: no comprehension's call.
            if len(arrays) == 1:
                if isinstance(arrays[0], _SCALARS):
                    arrays = (np.asarray(arrays[0]),)
            else:
                arrays = tuple([np.asarray(x) if isinstance(x, _SCALARS) else x for x in arrays])
            # Sleep until it is done, the GIL released, never polling: N TF threads
            # wait at once (num_parallel_calls=N), and pollers would take the GIL and
            # the CPUs from the thread that delivers their results and from the
            # workers (measured: slower, more of the main process's CPU). No Future:
            # run_call's hooked call costs ~40 Python calls less than submit_call's.
            return self.pool().run_call(self.call, arrays, worker=worker)
        except BaseException as exc:
            if getattr(_failed, "watching", False):  # an eager call of this thread: see _run
                _failed.error = (exc, exc.__cause__)
            raise
        finally:
            with self.lock:
                self.busy -= 1

    def __repr__(self) -> str:
        return f"<mpexec op body {self.call!r}>"


def _no_gradient_text(name: str) -> str:
    return (
        f"No gradient defined for {name}: mpexec.py_function runs its function in a worker "
        "process, outside TensorFlow's gradient tape, so it has no gradient. Use "
        "tf.py_function where the gradient is needed (docs/tensorflow.md)"
    )


@tf.RegisterGradient("MpexecPyFunction")  # type: ignore[untyped-decorator]
def _refuse_gradient(op: Any, *grads: Any) -> Any:
    """A graph's gradient of an ``mpexec.py_function`` op: a clear error when it is built."""
    raise LookupError(_no_gradient_text(op.name))


def _op(
    body: _Body,
    inputs: Sequence[Any],
    touts: list[Any],
    is_list: bool,
    stateful: bool,
    name: str | None,
    differentiable: bool,
) -> Any:
    """TF's numpy_function over ``body``; py_function's gradient is a clear error.

    TF's own py_function has a gradient (its function runs on TF's tape); ours
    cannot, so asking for one raises: in a v1 graph (``tf.gradients``) the op's
    gradient is :func:`_refuse_gradient`; eagerly and in a ``tf.function`` (whose
    tape looks gradients up by op type), a ``tf.custom_gradient`` whose gradient
    raises (not in v1 graphs: TF's gradient registry would keep each alive).
    """
    tout: Any = touts if is_list else touts[0]

    def build(*xs: Any) -> Any:
        return tf.numpy_function(body, list(xs), tout, stateful=stateful, name=name)

    if not differentiable or not touts or not inputs:
        return build(*inputs)
    if not tf.executing_eagerly() and not tf.inside_function():  # a v1 graph
        graph = tf.compat.v1.get_default_graph()
        with graph.gradient_override_map(
            {"PyFunc": "MpexecPyFunction", "PyFuncStateless": "MpexecPyFunction"}
        ):
            return build(*inputs)
    text = _no_gradient_text(body.call.name)

    def refuse(*_: Any, **__: Any) -> Any:
        raise LookupError(text)

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def with_gradient_error(*xs: Any) -> Any:
        return build(*xs), refuse

    return with_gradient_error(*inputs)


def _run(make: Callable[[], Any], tf_errors: bool) -> Any:
    """``make()``; run eagerly, a failed call keeps its worker traceback as the cause.

    TensorFlow re-raises an eager numpy_function's exception ``from None``; its
    worker traceback is put back. ``tf_errors`` (py_function): raised as TF's
    error class for it instead, as TF's py_function does, the original as cause.
    """
    if not tf.executing_eagerly():
        return make()
    _failed.error, _failed.watching = None, True
    try:
        return make()
    except Exception as exc:
        raised = _failed.error
        if raised is None or raised[0] is not exc:
            raise
        cause = raised[1]
        if tf_errors:
            kind = next((e for p, e in _TF_ERRORS if isinstance(exc, p)), tf.errors.UnknownError)
            text = "".join(traceback.format_exception(exc))
            raise kind(None, None, f"{type(exc).__name__}: {exc}\n{text}") from exc
        raise exc.with_traceback(exc.__traceback__) from cause
    finally:
        _failed.error, _failed.watching = None, False


def refuse_composites(leaves: Sequence[Any], touts: Sequence[Any] = ()) -> None:
    """Ragged and sparse tensors, and their TypeSpecs in ``Tout``: a clear TypeError."""
    for x in leaves:
        if is_tensor(x) and not isinstance(x, (tf.Tensor, tf.Variable)):
            raise TypeError(
                f"{type(x).__name__} inputs are not supported by mpexec's py_func family: "
                "pass its dense parts (for a RaggedTensor: .flat_values and .row_splits)"
            )
    if any(isinstance(t, tf.TypeSpec) and not isinstance(t, tf.TensorSpec) for t in touts):
        raise TypeError(
            "composite TypeSpecs (RaggedTensorSpec, SparseTensorSpec) in Tout are not "
            "supported by mpexec's py_func family: return dense tensors"
        )


def add_op(
    call: Any,
    pool: Callable[[], Any],
    inputs: Sequence[Any],
    touts: list[Any],
    is_list: bool,
    stateful: bool,
    name: str | None,
    py_function: bool = False,
) -> Any:
    """TF's numpy_function op running ``call`` (its ``.name`` for messages) on ``pool()``.

    Returns what TF's op returns (tensors). ``py_function``: as TF's py_function —
    stateful, a list for a list ``Tout``, TF's error classes when run eagerly —
    and its gradient a clear error.
    """
    body = _Body(call, pool)
    stateful = stateful or py_function
    out = _run(lambda: _op(body, inputs, touts, is_list, stateful, name, py_function), py_function)
    if py_function and is_list and touts and not isinstance(out, (list, tuple)):
        return [out]  # TF's py_function gives a list for a list Tout; eager numpy_function not
    return out
