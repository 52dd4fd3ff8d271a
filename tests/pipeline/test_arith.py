"""Arithmetic on DataNodes and constants, as DALI's: operators, type promotion, layouts.

The promotion table was read off DALI 2.4 (``add``/``truediv`` of every pair of
types, and of Python scalars); ``test_interop.py`` checks samples of it against
the real package where it is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _arith, fn, types
from mpexec.pipeline import Pipeline

pytestmark = pytest.mark.usefixtures("no_leaks")


class _Source:
    """Two samples of ``values`` as ``dtype`` (sample ``j`` adds ``j``)."""

    def __init__(self, values: Any, dtype: Any) -> None:
        self.values, self.dtype = values, dtype

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        return (np.asarray(self.values) + info.idx_in_batch).astype(self.dtype)


def run(graph: Any, batch_size: int = 2, num_workers: int = 0) -> tuple[mpexec.Batch, ...]:
    pipe = Pipeline(batch_size, num_workers=num_workers, seed=1)
    with pipe:
        out = graph()
        pipe.set_outputs(*(out if isinstance(out, tuple) else (out,)))
    with pipe:
        return pipe.run()


def src(values: Any, dtype: Any = np.int32, layout: str | None = None) -> Any:
    return fn.external_source(source=_Source(values, dtype), batch=False, layout=layout)


def test_operators_run_per_sample_in_the_workers() -> None:
    def graph() -> Any:
        a, b = src([3, 6]), src([1, 2])
        return a + b, a - b, a * 2, 10 - a, a / b, a // b, a % b, a**2, -a, abs(-a)

    got = [o.as_array().tolist() for o in run(graph, num_workers=1)]
    assert got == [
        [[4, 8], [6, 10]],
        [[2, 4], [2, 4]],
        [[6, 12], [8, 14]],
        [[7, 4], [6, 3]],
        [[3.0, 3.0], [2.0, 2.3333332538604736]],
        [[3, 3], [2, 2]],
        [[0, 0], [0, 1]],
        [[9, 36], [16, 49]],
        [[-3, -6], [-4, -7]],
        [[3, 6], [4, 7]],
    ]


def test_comparisons_and_bitwise_give_dali_results() -> None:
    def graph() -> Any:
        a, b = src([3, 6]), src([3, 1])
        return a == b, a != b, a < b, a >= 4, a & 2, a | 8, a ^ b, ~a, a << 1, a >> 1

    eq, ne, lt, ge, band, bor, bxor, inv, shl, shr = run(graph)
    assert eq.dtype == np.bool_
    assert eq.as_array().tolist() == [[True, False], [True, False]]
    assert ne.as_array().tolist() == [[False, True], [False, True]]
    assert lt.as_array().tolist() == [[False, False], [False, False]]
    assert ge.as_array().tolist() == [[False, True], [True, True]]
    assert band.as_array().tolist() == [[2, 2], [0, 2]]
    assert bor.as_array().tolist() == [[11, 14], [12, 15]]
    assert bxor.as_array().tolist() == [[0, 7], [0, 5]]
    assert inv.as_array().tolist() == [[-4, -7], [-5, -8]]
    assert shl.as_array().tolist() == [[6, 12], [8, 14]]
    assert shr.as_array().tolist() == [[1, 3], [2, 3]]


@pytest.mark.parametrize(
    ("a", "b", "op", "want"),
    [
        # DALI 2.4's types (NumPy's differ where marked).
        (np.uint8, "int", "add", np.int32),  # NumPy 2: uint8
        (np.uint8, "float", "add", np.float32),  # NumPy 2: float64
        (np.int64, "float", "add", np.float32),  # NumPy: float64
        (np.float64, "int", "add", np.float64),
        (np.uint8, np.int8, "add", np.int16),
        (np.uint16, np.int8, "add", np.int32),
        (np.uint32, np.int32, "add", np.int64),
        (np.uint64, np.int64, "add", np.int64),  # NumPy: float64
        (np.int64, np.float32, "add", np.float32),  # NumPy: float64
        (np.float32, np.float64, "add", np.float64),
        (np.bool_, np.uint8, "add", np.uint8),
        (np.uint8, np.uint8, "truediv", np.float32),  # NumPy: float64
        (np.int64, np.int64, "truediv", np.float32),  # NumPy: float64
        (np.int32, np.float64, "truediv", np.float64),
        (np.uint8, np.int8, "lt", np.bool_),
    ],
)
def test_type_promotion_is_dalis(a: Any, b: Any, op: str, want: Any) -> None:
    def graph() -> Any:
        x = src([3, 1], a)
        y = {"int": 2, "float": 2.5}[b] if isinstance(b, str) else src([2, 2], b)
        return _arith_graph(op, x, y)

    (out,) = run(graph)
    assert out.dtype == np.dtype(want)
    assert _arith.promote(np.dtype(np.uint8), np.dtype(np.int8)) == np.dtype(np.int16)


def _arith_graph(op: str, x: Any, y: Any) -> Any:
    return {"add": x + y, "truediv": x / y, "lt": x < y}[op]


def test_float_scalars_compute_in_float32_as_dali() -> None:
    (out,) = run(lambda: src([3, 1], np.int16) / 2.5)
    assert out.dtype == np.float32
    assert out.as_array()[0].tolist() == [np.float32(3) / np.float32(2.5), np.float32(0.4)]


def test_constants_broadcast_and_fold_into_the_expression() -> None:
    def graph() -> Any:
        x = src([1], np.int32)
        y = types.Constant(np.full((3, 4), 2))  # int64 array: int32, as DALI does
        return x + y, y

    total, y = run(graph)
    assert (total.dtype, y.dtype) == (np.int32, np.int32)
    assert total.as_array().tolist() == [np.full((3, 4), 3).tolist(), np.full((3, 4), 4).tolist()]


def test_expression_keeps_its_inputs_layout_and_subscript_drops_indexed_axes() -> None:
    def graph() -> Any:
        x = src(np.zeros((2, 3, 4)), np.uint8, layout="HWC")
        return x + 1, x[0], x[:, 1:2], x[..., 0], (x > 0)[1]

    plus, row, cols, chan, sub = run(graph)
    assert (plus.layout(), row.layout(), cols.layout(), chan.layout()) == ("HWC", "WC", "HWC", "HW")
    assert sub.layout() == "WC"
    assert (row.shape()[0], cols.shape()[0], chan.shape()[0]) == ((3, 4), (2, 1, 4), (2, 3))


def test_a_dataNode_comparison_is_a_node_not_a_bool() -> None:
    pipe = Pipeline(2, 0)
    with pipe:
        x = src([1])
        y = x
        eq = x == y
        assert isinstance(eq, mpexec.DataNode)
        with pytest.raises(TypeError, match="enable_conditionals"):
            bool(eq)
        assert hash(x) == id(x) or isinstance(hash(x), int)  # still hashable
        pipe.set_outputs(eq)
    pipe.close()


def test_merged_ops_keep_their_consumers_with_arithmetic_defined() -> None:
    # Graph.plan compares inputs by identity: == on DataNodes now builds a node.
    def graph() -> Any:
        x = src([1, 2])
        a = fn.python_function(x, function=_inc, seed=5)
        b = fn.python_function(x, function=_inc, seed=5)  # merged with a
        return fn.python_function(b, function=_inc), a

    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        pipe.set_outputs(*graph())
    with pipe:
        c, _ = pipe.run()
        assert pipe.stats().merged_ops == 1
    assert c.as_array().tolist() == [[3, 4], [4, 5]]


def _inc(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # One of x's own type: NumPy 1.x made int64 of an int32 scalar + 1, NumPy 2 keeps int32.
    return x + x.dtype.type(1)


def test_arithmetic_outside_a_definition_on_a_defined_pipelines_node_is_an_error() -> None:
    """Outside a definition arithmetic waits for a pipeline (DALI 2), but a node of a
    pipeline already defined is that pipeline's: it cannot feed another graph."""
    pipe = Pipeline(2, 0)
    with pipe:
        x = src([1])
        pipe.set_outputs(x)
    with pytest.raises(ValueError, match="belongs to another pipeline"):
        _ = x + 1
    pipe.close()


@pytest.mark.parametrize("key", [(slice(0, 1.5),), ("a",), (None,)])
def test_subscript_takes_ints_and_slices(key: Any) -> None:
    pipe = Pipeline(2, 0)
    with pipe:
        x = src([1, 2])
        with pytest.raises(TypeError, match="indexed with ints"):
            _ = x[key]
        pipe.set_outputs(x)
    pipe.close()


# ================================================================ constants


def test_ones_zeros_constant_as_dali() -> None:
    def graph() -> Any:
        return (
            fn.ones(),
            fn.zeros(shape=[2], dtype=types.UINT8),
            fn.constant(fdata=1.5),
            fn.constant(idata=[1, 2, 3]),
            fn.constant(idata=[1, 2, 3, 4], shape=[2, 2], layout="HW"),
            fn.constant(fdata=2.0, shape=[2, 3]),
            fn.ones(shape=[1, 1, 1], dtype=types.BOOL),
        )

    got = run(graph, num_workers=1)
    want = [
        (np.int32, (), 1),
        (np.uint8, (2,), [0, 0]),
        (np.float32, (1,), [1.5]),
        (np.int32, (3,), [1, 2, 3]),
        (np.int32, (2, 2), [[1, 2], [3, 4]]),
        (np.float32, (2, 3), [[2.0] * 3] * 2),
        (np.bool_, (1, 1, 1), [[[True]]]),
    ]
    for batch, (dtype, shape, value) in zip(got, want, strict=True):
        assert batch.dtype == np.dtype(dtype)
        assert batch.shape() == [shape, shape]
        assert batch.as_array()[1].tolist() == value
    assert got[4].layout() == "HW"


def test_types_constant_scalar_and_array() -> None:
    c = types.Constant(3)
    assert isinstance(c, types.ScalarConstant)
    assert c.dtype == np.int32
    assert types.Constant(2.5).dtype == np.float32
    assert types.Constant(1, dtype=types.UINT8).dtype == np.uint8
    with pytest.raises(TypeError, match="pipeline definition"):
        types.Constant(np.zeros(3))

    def graph() -> Any:
        return (
            fn.python_function(types.Constant(0), function=_inc),
            types.Constant(np.array([1.0, 2.0])),
            types.Constant(np.array(0), device="cpu", dtype=types.INT64),
            types.Constant(7, dtype=types.UINT8, shape=[2]),
        )

    a, b, c2, d = run(graph)
    assert (a.dtype, a.shape()[0], a.as_array().tolist()) == (np.int32, (), [1, 1])
    assert (b.dtype, b.as_array()[0].tolist()) == (np.float32, [1.0, 2.0])
    assert (c2.dtype, c2.shape()[0]) == (np.int64, ())
    assert (d.dtype, d.as_array()[0].tolist()) == (np.uint8, [7, 7])


def _gpu_source(info: Any) -> np.ndarray[Any, Any]:
    return np.arange(6, dtype=np.float32) + info.idx_in_epoch


def _on_device(x: Any) -> Any:
    return x * 1


def test_arithmetic_on_gpu_outputs_runs_on_the_device() -> None:
    from mpexec.testing import SEEDS, simulated

    with simulated(*SEEDS[0]):
        pipe = Pipeline(2, 0, None, 1)
        with pipe:
            x = fn.external_source(source=_gpu_source, batch=False)
            g = fn.python_function(x, function=_on_device, device="gpu")
            pipe.set_outputs(g * 2 + 1, g > 3.0, -g)
        with pipe:
            a, b, c = pipe.run()
            assert a.device == "gpu"
            got = [np.asarray(o.as_cpu().as_array()) for o in (a, b, c)]
    base = np.stack([np.arange(6, dtype=np.float32) + i for i in range(2)])
    assert got[0].dtype == np.float32
    assert np.array_equal(got[0], base * 2 + 1)
    assert np.array_equal(got[1], base > 3)
    assert np.array_equal(got[2], -base)
