"""TensorFlow's python-function entry points (py_func, numpy_function, py_function, contrib).

Eager calls run on one module-wide ``WorkerPool(2)`` set as the default pool; the
module fixture proves that it leaves nothing behind. The pipeline path is checked
twice: against a stand-in ``fn.python_function`` (the glue: bound constants,
``num_outputs``, packing) and end to end once ``mpexec.fn`` exists.
"""

from __future__ import annotations

import gc
import importlib
import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest

import mpexec
from mpexec import _pid, contrib
from mpexec import _pyfunc as _tf
from mpexec._graph import DataNode
from mpexec._pyfunc import numpy_function, py_func, py_function
from tests.conftest import _children, shm_names, wait_until

TOKEN = r"pyfunc_\d+"


@pytest.fixture(scope="module", autouse=True)
def pool() -> Iterator[mpexec.WorkerPool]:
    """Two workers for every eager call here; afterwards no process or segment is left."""
    gc.collect()
    names_before = shm_names()
    p = mpexec.WorkerPool(2)
    _tf.set_default_pool(p)
    try:
        yield p
    finally:
        _tf.set_default_pool(None)
        p.shutdown()
        gc.collect()
        wait_until(lambda: not _children(), 10, "the pool's workers to exit")
        assert shm_names() - names_before == set()


# ---------------------------------------------------------------- worker functions
def _double(x: np.ndarray) -> np.ndarray:
    return x * 2


def _sum_and_max(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x + y, np.maximum(x, y)


def _as_float64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def _python_float(*_: Any) -> float:
    return 1.5


def _nothing(*_: Any) -> None:
    return None


def _describe(x: Any) -> str:
    """What the function was given, as text (returned as a string output)."""
    if isinstance(x, np.ndarray):
        items = {type(v).__name__ for v in x.ravel().tolist()}
        return f"ndarray {x.dtype.kind} {x.shape} {sorted(items)}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, bytes) else f"{type(x).__name__} {x}"


def _raise_key_error(x: Any) -> None:
    raise KeyError("missing")


def _same(*args: Any) -> Any:
    return args[0] if len(args) == 1 else args


def _nested(pair: tuple[Any, Any], items: list[Any], *, opts: dict[str, Any]) -> Any:
    assert isinstance(pair, tuple)
    assert isinstance(items, list)
    assert isinstance(opts, dict)
    img, label = pair
    return (img * opts["gain"], {"mask": img > 0, "label": label + len(items)})


class _FakeDType:
    """What a TensorFlow DType looks like to mpexec: ``as_numpy_dtype`` and a name."""

    def __init__(self, np_type: Any, name: str) -> None:
        self._np_type = np_type
        self.name = name

    @property
    def as_numpy_dtype(self) -> Any:
        return self._np_type

    def __repr__(self) -> str:
        return f"tf.{self.name}"


tf_float32 = _FakeDType(np.float32, "float32")
tf_int64 = _FakeDType(np.int64, "int64")
tf_string = _FakeDType(object, "string")


class _FakeShape:
    """A TensorShape look-alike: ``rank`` and ``as_list()``."""

    def __init__(self, dims: list[int | None] | None) -> None:
        self._dims = dims

    @property
    def rank(self) -> int | None:
        return None if self._dims is None else len(self._dims)

    def as_list(self) -> list[int | None]:
        assert self._dims is not None
        return list(self._dims)


class _Counter:
    """A stateful function: its count lives in whichever worker runs it."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        return np.asarray(self.calls, dtype=np.int64)


# ================================================================ py_func / numpy_function
@pytest.mark.parametrize("op", [py_func, numpy_function])
def test_single_output_is_an_array(op: Any) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = op(_double, [x], np.float32)
    assert isinstance(out, np.ndarray)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x * 2)


@pytest.mark.parametrize("Tout", [[np.int64, np.int64], (np.int64, np.int64)])
def test_several_outputs_are_a_list(Tout: Any) -> None:
    a, b = np.array([1, 5, 3]), np.array([4, 2, 6])
    out = py_func(_sum_and_max, [a, b], Tout)
    assert isinstance(out, list)
    assert len(out) == 2
    np.testing.assert_array_equal(out[0], a + b)
    np.testing.assert_array_equal(out[1], np.maximum(a, b))


def test_a_list_tout_of_one_takes_a_single_value_and_returns_a_list() -> None:
    x = np.ones(3, np.float32)
    out = numpy_function(_double, [x], [np.float32])
    assert isinstance(out, list)
    assert len(out) == 1
    np.testing.assert_array_equal(out[0], x * 2)


def test_count_error_message_is_tfs() -> None:
    x = np.ones(2, np.int64)
    with pytest.raises(ValueError) as info:
        py_func(_double, [x], [np.int64, np.int64], name="split_op")
    assert str(info.value) == "split_op returns 1 values, but expects to see 2 values."
    with pytest.raises(
        ValueError, match=rf"^{TOKEN} returns 2 values, but expects to see 1 values\.$"
    ):
        py_func(_sum_and_max, [x, x], np.int64)


def test_dtype_error_message_is_tfs() -> None:
    x = np.ones(2, np.float32)
    with pytest.raises(TypeError) as info:
        py_func(_as_float64, [x], np.float32)
    assert re.fullmatch(
        rf"0-th value returned by {TOKEN} is float64, but expects float32", str(info.value)
    )
    with pytest.raises(TypeError) as info:
        numpy_function(_same, [x, np.int64(3)], [np.float32, np.int32], name="op")
    assert str(info.value) == "1-th value returned by op is int64, but expects int32"


def test_the_count_is_checked_before_the_dtypes() -> None:
    with pytest.raises(ValueError, match="returns 1 values, but expects to see 2 values"):
        py_func(_as_float64, [np.ones(2, np.float32)], [np.float32, np.float32])


@pytest.mark.parametrize("op", [py_func, numpy_function])
def test_no_casting(op: Any) -> None:
    # A Python float becomes float64, which is not float32 (as in TensorFlow).
    with pytest.raises(TypeError, match="is float64, but expects float32"):
        op(_python_float, [], np.float32)
    with pytest.raises(TypeError, match="is int32, but expects int64"):
        op(_same, [np.ones(2, np.int32)], np.int64)
    out = op(_python_float, [], np.float64)
    assert out.dtype == np.float64
    assert out.shape == ()
    assert out == 1.5


def test_none_only_with_an_empty_tout() -> None:
    assert py_func(_nothing, [np.ones(2)], []) == []
    assert numpy_function(_nothing, [], ()) == []
    with pytest.raises(
        ValueError, match=rf"^{TOKEN} returns 0 values, but expects to see 1 values\.$"
    ):
        py_func(_nothing, [], np.float32)
    with pytest.raises(ValueError, match="returns 0 values, but expects to see 2 values"):
        py_func(_nothing, [], [np.float32, np.float32])
    with pytest.raises(ValueError, match="returns 1 values, but expects to see 0 values"):
        py_func(_double, [np.ones(2)], [])


def test_zero_d_inputs_are_numpy_scalars_for_py_func_and_arrays_for_py_function() -> None:
    x = np.float32(2.5)
    assert py_func(_describe, [x], str)[()] == b"float32 2.5"
    assert py_function(_describe, [x], str)[()] == b"ndarray f () ['float']"


def test_user_exceptions_keep_their_type_and_remote_traceback() -> None:
    with pytest.raises(KeyError, match="missing") as info:
        py_func(_raise_key_error, [np.ones(1)], [])
    assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
    assert "_raise_key_error" in str(info.value.__cause__)
    with pytest.raises(ZeroDivisionError):
        py_function(lambda x: 1 / 0, [1], np.float64)


def test_results_are_writable_arrays_of_the_caller() -> None:
    big = np.ones((256, 256), np.float32)  # above the inline limit: through shared memory
    out = py_func(_double, [big], np.float32)
    out[0, 0] = -1
    assert out[0, 0] == -1
    assert out[1, 1] == 2


# ================================================================ py_function: casting
def test_py_function_casts_compatible_values() -> None:
    out = py_function(_as_float64, [np.arange(3, dtype=np.float32)], np.float32)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [0, 1, 2])
    a, b = py_function(lambda: (3, True), [], [np.float32, np.int8])
    assert a.dtype == np.float32
    assert a == 3
    assert b.dtype == np.int8
    assert b == 1


def test_py_function_refuses_incompatible_values() -> None:
    with pytest.raises(TypeError) as info:
        py_function(_python_float, [], [np.int32], name="to_int")
    assert (
        str(info.value) == "0-th value returned by to_int is float64, which cannot be cast to int32"
    )
    with pytest.raises(TypeError, match="is string, which cannot be cast to float32"):
        py_function(lambda: "1.5", [], np.float32)
    with pytest.raises(TypeError, match="is int64, which cannot be cast to string"):
        py_function(lambda: 1, [], str)
    with pytest.raises(ValueError, match="returns 2 values, but expects to see 1 values"):
        py_function(lambda: (1, 2), [], np.int64)


# ================================================================ strings
STRING_SPELLINGS = [
    str,
    bytes,
    object,
    np.bytes_,
    np.str_,
    "string",
    np.dtype("S"),
    np.dtype("U5"),
    tf_string,
]


@pytest.mark.parametrize("spelling", STRING_SPELLINGS, ids=repr)
def test_every_string_spelling_means_bytes(spelling: Any) -> None:
    out = py_func(_same, ["héllo"], spelling)
    assert out.dtype == object
    assert out.shape == ()
    assert out[()] == "héllo".encode()


@pytest.mark.parametrize(
    ("value", "seen"),
    [
        ("text", "bytes b'text'"),
        (b"raw\x00\xff", "bytes b'raw\\x00\\xff'"),
        (np.array(["a", "bcd"]), "ndarray O (2,) ['bytes']"),
        (np.array([b"a", b"bcd"]), "ndarray O (2,) ['bytes']"),
        (np.array(["a", b"b"], dtype=object), "ndarray O (2,) ['bytes']"),
        (["x", "yz"], "ndarray O (2,) ['bytes']"),
    ],
)
def test_string_inputs_arrive_as_bytes(value: Any, seen: str) -> None:
    assert py_func(_describe, [value], str)[()] == seen.encode()


@pytest.mark.parametrize(
    "returned",
    [
        np.array(["é", "bc"]),
        np.array([b"\xc3\xa9", b"bc"]),
        np.array(["é", b"bc"], dtype=object),
    ],
    ids=["unicode", "bytes", "object"],
)
def test_string_outputs_are_object_arrays_of_bytes(returned: np.ndarray) -> None:
    out = py_func(lambda: returned, [], bytes)
    assert out.dtype == object
    assert out.tolist() == ["é".encode(), b"bc"]
    assert all(type(v) is bytes for v in out.tolist())


def test_strings_mixed_with_numbers() -> None:
    names, lengths = numpy_function(
        lambda s: (s, np.array([len(v) for v in s], np.int64)),
        [np.array(["ab", "c"], dtype=object)],
        [tf_string, tf_int64],
    )
    assert names.tolist() == [b"ab", b"c"]
    assert lengths.tolist() == [2, 1]


def test_string_dtype_mismatches() -> None:
    with pytest.raises(
        TypeError, match=rf"^0-th value returned by {TOKEN} is string, but expects float32$"
    ):
        py_func(lambda: "x", [], np.float32)
    with pytest.raises(TypeError, match="is int64, but expects string"):
        py_func(lambda: np.arange(2), [], str)
    with pytest.raises(TypeError, match="is object, but expects string"):
        py_func(lambda: np.array([1, None], dtype=object), [], str)


# ================================================================ dtypes, names, arguments
def test_tensorflow_dtype_like_objects() -> None:
    out = py_func(_double, [np.ones(2, np.float32)], tf_float32)
    assert out.dtype == np.float32
    a, b = py_func(_same, [np.ones(2, np.float32), np.int64(1)], [tf_float32, tf_int64])
    assert a.dtype == np.float32
    assert b.dtype == np.int64
    with pytest.raises(TypeError, match="is int64, but expects float32"):
        py_func(_same, [np.int64(1)], tf_float32)


def test_dtype_spellings_resolve_as_numpy_does() -> None:
    assert _tf.as_dtype(float) == np.float64
    assert _tf.as_dtype("int16") == np.int16
    assert _tf.as_dtype(np.dtype(">f4")) == np.float32  # native byte order
    for spelling in STRING_SPELLINGS:
        assert _tf.as_dtype(spelling) == _tf.STRING
    with pytest.raises(TypeError, match="Tout=\\[\\]"):
        _tf.as_dtype(None)
    with pytest.raises(TypeError, match="is not a dtype"):
        _tf.as_dtype("no-such-type")


def test_default_names_count_up_and_a_given_name_is_used() -> None:
    def fail(*_: Any) -> float:
        return 1.0

    def other(*_: Any) -> float:
        return 1.0

    tokens = []
    for f in (fail, other):
        with pytest.raises(TypeError) as info:
            py_func(f, [], np.float32)
        m = re.match(r"0-th value returned by pyfunc_(\d+) is", str(info.value))
        assert m is not None
        tokens.append(int(m.group(1)))
    assert tokens[1] > tokens[0]
    with pytest.raises(TypeError, match=r"^0-th value returned by my_op is"):
        py_func(fail, [], np.float32, name="my_op")


def test_eager_wrapper_is_reused_and_keeps_its_name() -> None:
    def fail(*_: Any) -> float:
        return 1.0

    messages = set()
    for _ in range(3):
        with pytest.raises(TypeError) as info:
            py_func(fail, [], np.float32)
        messages.add(str(info.value))
    assert len(messages) == 1  # one wrapper, one token, shipped once

    f32 = (np.dtype(np.float32),)
    w = _tf.eager_wrapper(_double, f32, None, False)
    assert _tf.eager_wrapper(_double, f32, None, False) is w
    assert _tf.eager_wrapper(_double, f32, None, True) is not w  # py_function casts
    assert _tf.eager_wrapper(_double, (np.dtype(np.int64),), None, False) is not w
    assert _tf.eager_wrapper(_double, f32, "named", False).name == "named"


def test_the_wrapper_pickles_and_runs_anywhere() -> None:
    offset = np.float32(0.5)
    w = _tf.eager_wrapper(lambda x: x + offset, (np.dtype(np.float32),), "add", False)
    clone = cloudpickle.loads(cloudpickle.dumps(w))
    assert isinstance(clone, _tf.PyFuncCall)
    assert clone.name == "add"
    np.testing.assert_array_equal(clone(np.zeros(2, np.float32)), [0.5, 0.5])
    with pytest.raises(TypeError, match="0-th value returned by add is float64"):
        clone(np.zeros(2))
    # A pipeline wrapper: constants bound around the DataNode inputs.
    structure = _tf.OutputStructure.build({"y": np.float64}, {"y": (2,)})
    bound = _tf.PyFuncCall(
        lambda a, k, b=None: {"y": a * k + b},
        structure.dtypes,
        "bound",
        False,
        ((_tf._Slot(0), 3.0), {"b": _tf._Slot(1)}),
        structure,
    )
    clone = cloudpickle.loads(cloudpickle.dumps(bound))
    np.testing.assert_array_equal(clone(np.ones(2), np.full(2, 2.0)), [5.0, 5.0])


def test_argument_errors_are_tfs() -> None:
    with pytest.raises(ValueError, match="Expected func to be callable"):
        py_func(42, [], np.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="inp must be a list"):
        py_func(_double, np.ones(3), np.float64)
    with pytest.raises(TypeError, match="is not a dtype"):
        py_func(_double, [np.ones(3)], "nope")
    with pytest.raises(TypeError, match="outside a pipeline definition"):
        py_func(_double, [object.__new__(DataNode)], np.float64)


def test_eager_state_stays_in_the_worker() -> None:
    counter = _Counter()
    for _ in range(3):
        assert py_func(counter, [np.ones(1)], np.int64) >= 1
    assert counter.calls == 0  # the calls ran on copies in the workers


# ================================================================ contrib.py_func
def test_contrib_nested_args_kwargs_and_outputs() -> None:
    img = np.arange(-2, 4, dtype=np.float32).reshape(2, 3)
    out = contrib.py_func(
        _nested,
        args=((img, np.int64(5)), [1, 2, 3]),
        kwargs={"opts": {"gain": np.float32(2)}},
        output_types=[np.float32, {"label": np.int64, "mask": bool}],
        output_shapes=[(2, None), {"label": (), "mask": _FakeShape([2, 3])}],
    )
    assert isinstance(out, list)
    assert isinstance(out[1], dict)
    np.testing.assert_array_equal(out[0], img * 2)
    assert out[1]["label"] == 8
    assert out[1]["label"].dtype == np.int64
    np.testing.assert_array_equal(out[1]["mask"], img > 0)


def test_contrib_single_type_none_and_callables() -> None:
    x = np.ones(3)
    out = contrib.py_func(_double, args=[x], output_types=np.float64)
    np.testing.assert_array_equal(out, x * 2)
    assert contrib.py_func(_nothing, args=[x]) is None
    with pytest.raises(ValueError, match="returns 1 values, but expects to see 0 values"):
        contrib.py_func(_double, args=[x])
    out = contrib.py_func(
        _same,
        args=[x],
        output_types=lambda a: tf_float32 if a.dtype == np.float32 else np.float64,
        output_shapes=lambda a: a.shape,
    )
    np.testing.assert_array_equal(out, x)


def test_contrib_shape_mismatch_names_the_path() -> None:
    def f() -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return np.ones(2), {"mask": np.ones((3, 4), bool)}

    kinds = (np.float64, {"mask": bool})
    with pytest.raises(ValueError) as info:
        contrib.py_func(f, output_types=kinds, output_shapes=((2,), {"mask": (None, 5)}), name="m")
    assert (
        str(info.value) == "m: output[1]['mask'] has shape (3, 4), but output_shapes says (None, 5)"
    )
    with pytest.raises(
        ValueError, match=r"output\[0\] has shape \(2,\), but output_shapes says \(2, 1\)"
    ):
        contrib.py_func(f, output_types=kinds, output_shapes=((2, 1), {"mask": None}))
    out = contrib.py_func(f, output_types=kinds, output_shapes=(None, {"mask": _FakeShape(None)}))
    assert out[1]["mask"].shape == (3, 4)


def test_contrib_structure_and_dtype_errors() -> None:
    def f() -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return np.ones(2), {"mask": np.ones(3, bool)}

    with pytest.raises(
        ValueError, match=r"output\[1\] has keys \['mask'\], but output_types has \['m'\]"
    ):
        contrib.py_func(f, output_types=(np.float64, {"m": bool}))
    with pytest.raises(TypeError, match=r"output\[1\] should be a sequence of 1 values"):
        contrib.py_func(f, output_types=(np.float64, [bool]))
    with pytest.raises(ValueError, match=r"output has 2 values, but output_types has 3"):
        contrib.py_func(f, output_types=(np.float64, bool, bool))
    with pytest.raises(
        TypeError,
        match=r"^1-th value returned by c is bool, but expects int8 \(at output\[1\]\['mask'\]\)$",
    ):
        contrib.py_func(f, output_types=(np.float64, {"mask": np.int8}), name="c")
    with pytest.raises(TypeError, match="args must be list and not"):
        contrib.py_func(f, args=np.ones(2))
    with pytest.raises(TypeError, match="kwargs must be dict and not"):
        contrib.py_func(f, kwargs=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"output_shapes\[1\] should be a dict"):
        contrib.py_func(f, output_types=(np.float64, {"mask": bool}), output_shapes=((2,), (3,)))
    with pytest.raises(ValueError, match="is not a dimension"):
        contrib.py_func(f, output_types=np.float64, output_shapes=(-1,))


def test_contrib_strings_in_nested_arguments() -> None:
    out = contrib.py_func(
        lambda d: {"joined": b"-".join(d["words"]), "n": np.int64(len(d["words"]))},
        args=[{"words": ["a", "bc"]}],
        output_types={"joined": tf_string, "n": tf_int64},
    )
    assert out["joined"][()] == b"a-bc"
    assert out["n"] == 2


# ================================================================ pipeline glue (stand-in fn)
class _FakeFn:
    """Records ``fn.python_function`` calls; returns ("out", k) markers as DataNodes."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def python_function(self, *inputs: Any, function: Any, num_outputs: int = 1, **kw: Any) -> Any:
        self.calls.append(
            {"inputs": inputs, "function": function, "num_outputs": num_outputs, **kw}
        )
        outs = [("out", len(self.calls) - 1, i) for i in range(num_outputs)]
        if num_outputs == 0:
            return None
        return outs[0] if num_outputs == 1 else outs


@pytest.fixture
def graph(monkeypatch: pytest.MonkeyPatch) -> _FakeFn:
    """Inside a pipeline definition, with ``mpexec.fn`` replaced by a recorder."""
    # The real module is loaded first, so that undoing the patches puts it back (else a
    # later test's `from mpexec import fn` finds neither: the end-to-end tests failed so).
    importlib.import_module("mpexec.fn")
    fake = _FakeFn()
    module = types.ModuleType("mpexec.fn")
    module.python_function = fake.python_function  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpexec.fn", module)
    monkeypatch.setattr(mpexec, "fn", module, raising=False)
    monkeypatch.setattr(_tf, "current_graph", object)
    monkeypatch.setattr(contrib, "current_graph", object)
    return fake


def _node() -> DataNode:
    return object.__new__(DataNode)  # only its type matters here


def test_pipeline_py_func_binds_constants_around_data_nodes(graph: _FakeFn) -> None:
    a, b = _node(), _node()
    out = py_func(lambda x, k, y: x * k + y, [a, np.float32(3), b], np.float32, stateful=False)
    assert out == ("out", 0, 0)
    call = graph.calls[0]
    assert call["inputs"] == (a, b)
    assert call["num_outputs"] == 1
    # TF's stateful means "never merge or prune", not "run serially".
    assert call["preserve"] is False
    assert "stateful" not in call
    assert call["name"] == call["function"].name
    wrapper = call["function"]
    assert isinstance(wrapper, _tf.PyFuncCall)
    assert re.fullmatch(TOKEN, wrapper.name)
    np.testing.assert_array_equal(wrapper(np.ones(2, np.float32), np.ones(2, np.float32)), [4, 4])


def test_pipeline_output_counts(graph: _FakeFn) -> None:
    a = _node()
    assert numpy_function(_sum_and_max, [a, a], [np.int64, np.int64], name="s") == [
        ("out", 0, 0),
        ("out", 0, 1),
    ]
    assert graph.calls[0]["num_outputs"] == 2
    assert graph.calls[0]["name"] == "s"
    assert py_func(_double, [a], [np.int64]) == [("out", 1, 0)]
    assert py_func(_nothing, [a], []) == []
    assert graph.calls[2]["num_outputs"] == 0
    assert py_function(_double, [a], np.float32) == ("out", 3, 0)
    assert graph.calls[3]["preserve"] is True
    assert graph.calls[3]["function"].cast
    wrapper = graph.calls[0]["function"]
    s, m = wrapper(np.array([1, 5]), np.array([4, 2]))
    assert s.tolist() == [5, 7]
    assert m.tolist() == [4, 5]


def test_pipeline_contrib_nested_nodes(graph: _FakeFn) -> None:
    img, label = _node(), _node()
    out = contrib.py_func(
        _nested,
        args=((img, label), [1, 2]),
        kwargs={"opts": {"gain": 3.0}},
        output_types=(np.float64, {"label": np.int64, "mask": bool}),
        output_shapes=((None,), {"label": (), "mask": (None,)}),
    )
    assert out == (("out", 0, 0), {"label": ("out", 0, 1), "mask": ("out", 0, 2)})
    call = graph.calls[0]
    assert call["inputs"] == (img, label)
    assert call["num_outputs"] == 3
    y, lab, mask = call["function"](np.array([-1.0, 2.0]), np.int64(4))
    assert y.tolist() == [-3.0, 6.0]
    assert lab == 6
    assert mask.tolist() == [False, True]


def test_pipeline_refuses_nodes_nested_in_py_func_inputs(graph: _FakeFn) -> None:
    with pytest.raises(TypeError, match="pass DataNodes directly"):
        py_func(_same, [[_node(), 1]], np.float32)


# ================================================================ pipeline, end to end
def _sample(info: Any) -> np.ndarray:
    return np.arange(4, dtype=np.float32)


def _scale(x: np.ndarray, k: np.float32) -> np.ndarray:
    return x * k


def _halves(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x[:2].copy(), x[2:].copy()


def test_pipeline_end_to_end() -> None:
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=3, num_workers=2, seed=0)  # type: ignore[attr-defined]
    def define() -> Any:
        x = fn.external_source(source=_sample, batch=False)
        y = py_func(_scale, [x, np.float32(2)], np.float32, stateful=False)
        a, b = numpy_function(_halves, [y], [np.float32, np.float32])
        c = py_function(_as_float64, [a], np.float32)
        nested = contrib.py_func(
            lambda d: {"s": d["v"].sum(dtype=np.float32)},
            args=[{"v": b}],
            output_types={"s": np.float32},
            output_shapes={"s": ()},
        )
        return y, a, b, c, nested["s"]

    with define() as pipe:
        y, a, b, c, s = pipe.run()
    expected = np.arange(4, dtype=np.float32) * 2
    for i in range(3):
        np.testing.assert_array_equal(y[i], expected)
        np.testing.assert_array_equal(a[i], expected[:2])
        np.testing.assert_array_equal(b[i], expected[2:])
        assert c[i].dtype == np.float32
        assert s[i] == expected[2:].sum()


def test_pipeline_end_to_end_reports_tfs_errors() -> None:
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=2, num_workers=2, seed=0)  # type: ignore[attr-defined]
    def define() -> Any:
        x = fn.external_source(source=_sample, batch=False)
        return py_func(_as_float64, [x], np.float32, name="bad")

    with (
        define() as pipe,
        pytest.raises(
            TypeError, match="0-th value returned by bad is float64, but expects float32"
        ),
    ):
        pipe.run()


def _greet(name: Any) -> Any:
    text = name.decode() if isinstance(name, bytes) else str(name.item())
    return np.array([f"hello {text}".encode()], dtype=object)


def _name_of(info: Any) -> Any:
    return np.array(f"n{info.idx_in_epoch}".encode(), dtype=object)


def test_pipeline_strings_in_and_out() -> None:
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=3, num_workers=2, seed=0)  # type: ignore[attr-defined]
    def define() -> Any:
        name = fn.external_source(source=_name_of, batch=False)
        return numpy_function(_greet, [name], str)

    with define() as pipe:
        (out,) = pipe.run()
        (again,) = pipe.run()
    assert [list(s) for s in out] == [[b"hello n0"], [b"hello n1"], [b"hello n2"]]
    assert again[0][0] == b"hello n3"
    assert out.dtype == object


# ================================================================ default pool, exports
def test_default_pool_is_made_on_first_use_and_stopped_at_exit() -> None:
    code = textwrap.dedent(
        """
        import os, numpy as np
        from mpexec import WorkerPool, _pyfunc
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
        out = _pyfunc.py_func(lambda x: x + 1, [np.zeros(2)], np.float64)
        first = _pyfunc.default_pool()
        assert first is _pyfunc.default_pool() and first.num_workers <= 2
        assert list(out) == [1.0, 1.0]
        first.shutdown()                      # one made here is replaced when closed
        second = _pyfunc.default_pool()
        assert second is not first
        mine = WorkerPool(1)
        _pyfunc.set_default_pool(mine)            # shuts `second` down
        assert _pyfunc.default_pool() is mine and "closed" in repr(second)
        assert _pyfunc.py_function(lambda: 2, [], np.int8) == 2
        _pyfunc.set_default_pool(None)
        mine.shutdown()
        assert _pyfunc.numpy_function(lambda: 3, [], np.int64) == 3   # a fresh one, left for atexit
        print("ok", os.getpid())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout
    assert "Traceback" not in done.stderr
    pid = done.stdout.split()[1]
    assert not [n for n in os.listdir("/dev/shm") if f"-{pid}-" in n]


def test_default_pool_set_is_returned_without_a_system_call(
    pool: mpexec.WorkerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TF op's body asks for the default pool on every call: no ``getpid`` there."""
    asked: list[int] = []
    real = os.getpid
    monkeypatch.setattr(os, "getpid", lambda: asked.append(1) or real())
    assert _tf.default_pool() is pool
    assert asked == []


def test_a_forked_child_knows_its_own_pid_for_the_default_pool(pool: mpexec.WorkerPool) -> None:
    """The pid the default pool's fast path compares is the child's after a fork."""
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit code
        code = 1
        try:
            code = 0 if _pid.pid == os.getpid() != _tf._owner_pid else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_set_default_pool_checks_its_argument() -> None:
    with pytest.raises(TypeError, match="expected a WorkerPool or None"):
        _tf.set_default_pool(object())  # type: ignore[arg-type]


def test_public_names() -> None:
    assert mpexec.py_func is py_func
    assert mpexec.numpy_function is numpy_function
    assert mpexec.py_function is py_function
    assert mpexec.contrib.py_func is contrib.py_func
    assert {"py_func", "numpy_function", "py_function", "contrib"} <= set(mpexec.__all__)


# ---------------------------------------------------------------- inside TensorFlow graphs
def test_tensorflow_is_never_imported_for_arrays() -> None:
    """Eager calls on arrays, pipelines and contrib never import TensorFlow."""
    code = textwrap.dedent(
        """
        import sys
        import numpy as np
        import mpexec
        from mpexec import contrib
        with mpexec.WorkerPool(1) as pool:
            mpexec.set_default_pool(pool)
            assert mpexec.numpy_function(np.negative, [np.ones(2)], np.float64)[0] == -1
            assert mpexec.py_function(np.negative, [np.ones(2)], [np.float32])[0][0] == -1
            assert contrib.py_func(lambda a: a, [np.ones(1)], output_types=np.float64)[0] == 1
            mpexec.set_default_pool(None)
        print(sorted(m for m in sys.modules if m.split(".")[0] == "tensorflow"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tout_that_numpy_reads_as_a_structure_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Cannot convert \{\} to a TensorFlow DType"):
        py_function(_double, [np.ones(1)], [{}])


def run_tf_check(check: str, *args: str) -> None:
    """A check of tests/adapters/_tf_graph_checks.py, in a fresh interpreter (TF's threads)."""
    pytest.importorskip("tensorflow")  # tox -e frameworks installs it
    code = f"from tests.adapters._tf_graph_checks import {check}; {check}(*{args!r})"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]


def test_tf_tensors_out_in_eager_tf_function_session_and_tf_data() -> None:
    run_tf_check("check_tensors_out_everywhere")


def test_tf_data_parallel_calls_run_in_two_workers_at_once(tmp_path: Any) -> None:
    run_tf_check("check_parallel_calls_in_two_workers", str(tmp_path))


def test_tf_bad_input_raising_killed_worker_wrong_tout_non_tensor() -> None:
    run_tf_check("check_bad_input")


def test_tf_py_function_gradient_is_a_clear_error() -> None:
    run_tf_check("check_gradients_are_a_clear_error")


def test_tf_saved_model_with_the_op_fails_clearly_when_loaded_elsewhere(tmp_path: Any) -> None:
    run_tf_check("check_saved_model_fails_clearly", str(tmp_path / "model"))


def test_tf_keras_fit_over_mpexec_numpy_function_matches_tf() -> None:
    run_tf_check("check_keras_fit_same_loss")


def test_compat_runner_swaps_tfs_three_names() -> None:
    """``python -m benchmarks compat tf``: the port a user makes, nothing more."""
    from benchmarks.compat import SUITES
    from benchmarks.compat.tf_suite import swapped

    assert SUITES["tf"] == "benchmarks.compat.tf_suite"
    text = (
        "import gc\nfrom tensorflow.python.ops import script_ops\n"
        "a = script_ops.py_func(f, [x], t)\nb = script_ops.eager_py_func(f, [x], t)\n"
        "c = script_ops.numpy_function(f, [x], t)\nn = script_ops._py_funcs.size()\n"
    )
    out = swapped(text)
    assert "import gc\n\nimport mpexec\n" in out
    assert "a = mpexec.py_func(f, [x], t)" in out
    assert "b = mpexec.py_function(f, [x], t)" in out
    assert "c = mpexec.numpy_function(f, [x], t)" in out
    assert "script_ops._py_funcs.size()" in out  # TF's internals stay TF's


def test_tf_benchmark_times_a_pass_apart_from_its_iterators_release() -> None:
    """``python -m benchmarks tf``: releasing a tf.data iterator can wait out the
    autotuning thread's sleep (seconds, whatever the op); it is timed apart."""
    from benchmarks.tf_bench import read_epoch

    now = [0.0]

    class Iterator:
        def __init__(self) -> None:
            self.left = 3

        def __iter__(self) -> Iterator:
            return self

        def __next__(self) -> int:
            if not self.left:
                raise StopIteration
            self.left -= 1
            now[0] += 0.5  # each element: half a second
            return self.left

        def __del__(self) -> None:
            now[0] += 2.0  # the release waits two seconds

    class Dataset:
        def __iter__(self) -> Iterator:
            return Iterator()

    assert read_epoch(Dataset(), clock=lambda: now[0]) == (3, 1.5, 2.0)


def test_tf_op_body_sleeps_while_its_call_runs() -> None:
    run_tf_check("check_op_body_sleeps_while_its_call_runs")


def test_tf_op_ships_scalar_inputs_as_arrays() -> None:
    run_tf_check("check_scalar_inputs_go_to_the_worker_as_arrays")


def test_tf_op_body_makes_no_future() -> None:
    run_tf_check("check_the_op_body_makes_no_future")
