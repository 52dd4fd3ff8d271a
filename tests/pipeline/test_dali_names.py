"""DALI's names around the graph, as DALI 2.4 behaves (checked against it by hand).

``types.Constant`` as an output and its NumPy scalar types, ``DataNode`` not
iterable, arithmetic DALI refuses on bools, ``pipeline_def`` arguments,
``Batch.is_dense_tensor``/``as_tensor().shape()``, ``mpexec.tensors`` and
``mpexec.math``. All inline (``num_workers=0``): no processes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

import mpexec
import mpexec.math as dmath
from mpexec import fn, tensors, types
from mpexec._runtime import np_from_dlpack
from mpexec.pipeline import Pipeline, pipeline_def


def _batch(values: list[Any]) -> Any:
    return lambda: [np.asarray(v) for v in values]


def _one_run(outputs: Any, values: list[Any]) -> tuple[Any, ...]:
    """Run ``outputs(source_node)`` once over a batch of ``values``."""
    pipe = Pipeline(len(values), 1, None, num_workers=0, seed=1)
    with pipe:
        x = fn.external_source(_batch(values))
        out = outputs(x)
        pipe.set_outputs(*(out if isinstance(out, tuple) else (out,)))
    with pipe:
        return tuple(pipe.run())


# ================================================================ item 9


def test_a_constant_scalar_may_be_an_output_and_keeps_numpy_types() -> None:
    @pipeline_def(batch_size=2, num_threads=1, device_id=None, num_workers=0)
    def graph() -> Any:
        x = fn.external_source(_batch([np.float32(1), np.float32(2)]), dtype=types.FLOAT)
        return x * types.Constant(np.float64(2.5)), types.Constant(1)

    with graph() as pipe:
        scaled, one = pipe.run()
    assert scaled.dtype == np.float64  # DALI keeps a NumPy scalar's type
    assert scaled.as_array().tolist() == [2.5, 5.0]
    assert one.dtype == np.int32
    assert one.as_array().tolist() == [1, 1]


def test_a_data_node_is_not_iterable() -> None:
    with Pipeline(2, 1, None, num_workers=0):
        x = fn.external_source(_batch([1, 2]))
        assert not isinstance(x, Iterable)  # DALI code tells nodes from lists this way
        with pytest.raises(TypeError, match="not iterable"):
            iter(x)


@pytest.mark.parametrize("op", ["add", "sub", "truediv", "floordiv", "mod", "pow"])
def test_arithmetic_dali_refuses_on_two_bools_is_refused(op: str) -> None:
    import operator

    with pytest.raises(TypeError, match="not defined on two bool inputs"):
        _one_run(lambda x: getattr(operator, op)(x, x), [True, False])
    (prod,) = _one_run(lambda x: x * x, [True, False])  # DALI computes these
    assert prod.dtype == np.bool_


# ================================================================ item 10


def test_pipeline_def_arguments_as_dali() -> None:
    @pipeline_def(max_streams=2, batch_size=2, num_workers=0)  # type: ignore[misc]
    def takes(max_streams: int) -> Any:
        return fn.external_source(_batch([max_streams, max_streams]))

    # The definition's own parameter wins over the Pipeline option of that name.
    with takes(max_streams=7) as pipe:
        assert pipe.run()[0].as_array().tolist() == [7, 7]

    @pipeline_def(no_such_option=1)  # accepted here: DALI refuses it when called
    def unknown() -> Any:
        return fn.external_source(_batch([0]))

    with pytest.raises(TypeError, match="unknown pipeline parameters"):
        unknown(batch_size=1)


# ================================================================ item 11


def test_batch_has_dali_tensor_list_methods() -> None:
    (b,) = _one_run(lambda x: x, [[1, 2], [3, 4]])
    assert b.is_dense_tensor()
    t = b.as_tensor()
    assert t.shape() == [2, 2]
    assert np.asarray(t).tolist() == [[1, 2], [3, 4]]
    assert isinstance(t, tensors.TensorCPU)
    # np.from_dlpack (NumPy 1.22, the oldest we support, names it np._from_dlpack).
    assert np_from_dlpack(tensors.TensorCPU(np.arange(3))).tolist() == [0, 1, 2]


def test_math_functions_on_data_nodes() -> None:
    outs = _one_run(
        lambda x: (
            dmath.sqrt(x),
            dmath.abs(-x),
            dmath.clamp(x, 2, 3),
            dmath.max(x, 3),
            dmath.atan2(x, 1.0),
            dmath.fpow(x, 2),
            dmath.floor(x / 3),
        ),
        [np.int32(1), np.int32(4)],
    )
    sqrt, absolute, clamped, biggest, angle, power, floor = (o.as_array() for o in outs)
    assert sqrt.dtype == np.float32  # integer inputs: float32, as DALI
    assert sqrt.tolist() == [1.0, 2.0]
    assert absolute.dtype == np.int32
    assert absolute.tolist() == [1, 4]
    assert clamped.tolist() == [2, 3]
    assert biggest.tolist() == [3, 4]
    np.testing.assert_allclose(angle, np.arctan2([1.0, 4.0], 1.0).astype(np.float32))
    assert power.tolist() == [1.0, 16.0]
    assert floor.tolist() == [0.0, 1.0]
    assert mpexec.math is dmath


def test_pipeline_def_marks_and_refusals_as_dali() -> None:
    @pipeline_def
    def bare() -> Any:
        return fn.external_source(_batch([0]))

    @pipeline_def(max_batch_size=1, num_threads=1, device_id=0)  # not refused when decorated
    def configured() -> Any:
        return fn.external_source(_batch([0]))

    assert getattr(bare, "_is_pipeline_def", False)
    assert getattr(configured, "_is_pipeline_def", False)

    @pipeline_def(batch_size=1)
    def open_ended(a: Any, **kwargs: Any) -> Any:
        return fn.external_source(_batch([a]))

    with pytest.raises(TypeError, match=r"\*\*kwargs are not allowed"):
        open_ended(1, b=2)


def test_ops_made_outside_with_pipe_are_taken_by_set_outputs() -> None:
    """DALI 2: ``fn.*`` and arithmetic outside any definition; ``set_outputs`` (or an op
    in ``with pipe:`` that takes one as input) brings them and what they need in."""
    x = fn.external_source(_batch([1, 2]), name="outside")
    doubled = x * 2
    pipe = Pipeline(2, 1, None, num_workers=0, seed=1)
    with pipe:
        plus = doubled + fn.external_source(_batch([10, 20]))
        pipe.set_outputs(doubled, plus)
    with pipe:
        a, b = pipe.run()
    assert a.as_array().tolist() == [2, 4]
    assert b.as_array().tolist() == [12, 24]
    other = Pipeline(2, 1, None, num_workers=0)
    with other, pytest.raises(ValueError, match="belongs to another pipeline"):
        other.set_outputs(doubled)  # taken already: another pipeline's
