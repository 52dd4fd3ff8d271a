"""DALI code ports by renaming ``nvidia.dali`` to ``mpexec``: the names around python_function.

``mpexec.pipeline``, ``mpexec.types``, ``mpexec.ops``; ``Pipeline`` in DALI's
positional order with DALI's keywords; ``define_graph`` subclasses; ``run()``
inside the ``with pipe:`` that defines it; ``Batch.layout()``; per-output dtype
lists; DALI's words in the errors its code (and its tests) look for. None of
this needs DALI installed; what checks against the real package is in
``test_interop.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn, ops, types
from mpexec.pipeline import Pipeline, pipeline_def
from tests.conftest import run_python

pytestmark = pytest.mark.usefixtures("no_leaks")


def _ramp(info: Any) -> np.ndarray[Any, Any]:
    return np.full((2, 3), info.idx_in_epoch, np.uint8)


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _pair(x: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return x.astype(np.uint8), x.astype(np.int32)


def _three(x: np.ndarray[Any, Any]) -> tuple[Any, Any, Any]:
    return x, x, x


def _rows(x: np.ndarray[Any, Any]) -> list[Any]:
    return list(np.zeros((5, 2)))  # a list, of 5: not the op's 2 outputs


# ================================================================ modules


def test_dali_module_names_exist() -> None:
    import mpexec.pipeline

    assert mpexec.pipeline.Pipeline is mpexec.Pipeline
    assert mpexec.pipeline.pipeline_def is mpexec.pipeline_def
    assert mpexec.pipeline.DataNode is mpexec.DataNode
    assert ops._DataNode is mpexec.DataNode  # DALI exports it there; its code checks it
    assert mpexec.fn.readers.file is fn.readers.file
    assert mpexec.fn.decoders.image is fn.decoders.image


def test_types_have_dali_values() -> None:
    # DALI 2.4's own values: code that stores or compares them behaves the same.
    assert (int(types.UINT8), int(types.INT32), int(types.FLOAT), int(types.BOOL)) == (0, 6, 9, 11)
    assert (int(types.FLOAT16), int(types.FLOAT64), int(types.INT64)) == (8, 10, 7)
    assert (int(types.RGB), int(types.BGR), int(types.GRAY), int(types.YCbCr)) == (0, 1, 2, 3)
    assert (int(types.INTERP_NN), int(types.INTERP_LINEAR), int(types.INTERP_CUBIC)) == (0, 1, 2)
    assert str(types.FLOAT) == "DALIDataType.FLOAT"
    assert types.DALIDataType.UINT8 is types.UINT8
    assert types.to_numpy_type(types.FLOAT) is np.float32
    assert types.to_dali_type(np.int16) is types.INT16
    assert types.SampleInfo is mpexec.SampleInfo
    assert types.BatchInfo is mpexec.BatchInfo


def test_missing_dali_ops_say_what_to_do() -> None:
    with pytest.raises(AttributeError, match=r"Flip.*mpexec\.dali\.python_function"):
        _ = ops.Flip
    with pytest.raises(AttributeError, match=r"resize.*mpexec\.dali\.python_function"):
        _ = fn.resize


# ================================================================ Pipeline


def test_pipeline_takes_dalis_positional_order() -> None:
    # Pipeline(batch_size, num_threads, device_id, seed, ...): Pipeline(8, 4, 0)
    # once set seed=0 and dropped the device id.
    pipe = Pipeline(8, 1, 0)
    assert (pipe.batch_size, pipe.num_workers, pipe.device_id) == (8, 1, 0)
    assert pipe.seed != 0 or Pipeline(8, 1, 0).seed != 0  # random unless given
    pipe = Pipeline(8, 1, 3, 42)
    assert (pipe.device_id, pipe.seed) == (3, 42)
    assert Pipeline(4, 1, None, -1).seed >= 0  # DALI's -1: pick one


def test_pipeline_maps_dalis_keywords_and_accepts_the_rest() -> None:
    pipe = Pipeline(
        2,
        1,
        None,
        5,
        exec_pipelined=True,
        prefetch_queue_depth=3,
        exec_async=False,
        bytes_per_sample=1 << 20,
        set_affinity=True,
        max_streams=4,
        default_cuda_stream_priority=0,
        enable_memory_stats=True,
        enable_checkpointing=True,
        checkpoint=None,
        py_num_workers=1,
        py_start_method="spawn",
        py_callback_pickler=None,
        output_dtype=None,
        output_ndim=None,
        exec_dynamic=True,
        experimental_exec_dynamic=None,
        stream_policy=None,
        concurrency=None,
    )
    assert (pipe.num_workers, pipe.prefetch_depth, pipe.start_method) == (1, 3, "spawn")
    assert (pipe.max_batch_size, pipe.num_threads) == (2, 1)
    assert Pipeline(2, 1, exec_pipelined=False).prefetch_depth == 1
    assert Pipeline(2, 1, prefetch_queue_depth={"cpu_size": 2, "gpu_size": 4}).prefetch_depth == 4
    # num_threads is DALI's thread count: as workers, capped at the CPUs here.
    assert Pipeline(2, 10_000).num_workers == mpexec.Pipeline(2).num_workers
    # mpexec's own keywords still win.
    explicit = Pipeline(2, 1, num_workers=0, prefetch_depth=5, start_method="forkserver")
    assert (explicit.num_workers, explicit.prefetch_depth) == (0, 5)


def test_pipeline_def_takes_dalis_keywords() -> None:
    @pipeline_def(batch_size=2, num_threads=1, device_id=0, exec_async=False, exec_pipelined=False)
    def graph() -> Any:
        return fn.external_source(source=_ramp, batch=False)

    pipe = graph(enable_conditionals=True, seed=1, num_workers=0)
    with pipe:
        (out,) = pipe.run()
    assert out.as_array()[:, 0, 0].tolist() == [0, 1]
    assert pipe.prefetch_depth == 1


def test_pipeline_checks_dalis_output_dtype_and_ndim() -> None:
    def graph() -> Any:
        return fn.external_source(source=_ramp, batch=False)

    with pipeline_def(graph, batch_size=2, num_workers=0, output_dtype=types.UINT8)() as pipe:
        pipe.run()
    pipe = pipeline_def(graph, batch_size=2, num_workers=0, output_dtype=types.FLOAT)()
    with pipe, pytest.raises(TypeError, match="output_dtype"):
        pipe.run()
    pipe = pipeline_def(graph, batch_size=2, num_workers=0, output_ndim=3)()
    with pipe, pytest.raises(ValueError, match="output_ndim"):
        pipe.run()


class _Legacy(Pipeline):
    """DALI's legacy form: ops made in __init__, the graph in define_graph."""

    def __init__(self, batch_size: int, num_threads: int, device_id: Any, seed: int) -> None:
        super().__init__(batch_size, num_threads, device_id, seed=seed, prefetch_queue_depth=2)
        self.source = ops.ExternalSource(source=_ramp, batch=False)
        self.double = ops.PythonFunction(function=_double, output_layouts="HW")

    def define_graph(self) -> Any:
        x = self.source()
        return x, self.double(x)


def test_define_graph_subclass_builds_and_runs() -> None:
    pipe = _Legacy(2, 1, 0, 7)
    pipe.build()
    try:
        x, y = pipe.run()
        assert x.as_array()[:, 0, 0].tolist() == [0, 1]
        assert y.as_array()[:, 0, 0].tolist() == [0, 2]
        assert y.layout() == "HW"
        x, y = pipe.run()  # without build(): run() builds
        assert x.as_array()[:, 0, 0].tolist() == [2, 3]
    finally:
        pipe.close()


def test_a_pipeline_without_a_graph_says_how_to_give_one() -> None:
    with pytest.raises(mpexec.MpexecError, match="define_graph"):
        Pipeline(2, 1).build()


def test_run_inside_the_with_block_that_defines_it() -> None:
    pipe = Pipeline(batch_size=2, num_threads=1, device_id=None, seed=3)
    try:
        with pipe:
            pipe.set_outputs(fn.python_function(types.Constant(5), function=_double))
            (out,) = pipe.run()
            assert out.as_array().tolist() == [10, 10]
            with pytest.raises(mpexec.MpexecError, match="already built"):
                fn.python_function(types.Constant(1), function=_double)
        (out,) = pipe.run()  # as in DALI, still usable after the block
        assert out.as_array().tolist() == [10, 10]
    finally:
        pipe.close()


def test_run_inside_the_with_block_before_set_outputs_is_an_error() -> None:
    pipe = Pipeline(2, 1)
    with pipe:
        fn.external_source(source=_ramp, batch=False)
        with pytest.raises(mpexec.MpexecError, match="set_outputs"):
            pipe.run()


# ================================================================ ops


def test_legacy_ops_call_convention() -> None:
    pipe = Pipeline(2, 0, None, 1)
    two = ops.PythonFunction(function=_pair, num_outputs=2)
    with pipe:
        x = ops.ExternalSource()(source=_ramp, batch=False)
        a, b = two(x)
        c, d = two(x)  # each call is an op of its own, as in DALI
        assert isinstance(a, ops._DataNode)
        pipe.set_outputs(a, b, c, d)
    with pipe:
        a, b, c, d = pipe.run()
    assert (a.dtype, b.dtype) == (np.uint8, np.int32)
    assert np.array_equal(a.as_array(), c.as_array())


def test_legacy_op_argument_given_twice_is_an_error() -> None:
    op = ops.PythonFunction(function=_double, batch_processing=False)
    with Pipeline(2, 0), pytest.raises(ValueError, match="batch_processing"):
        op(types.Constant(1), batch_processing=True)


def test_dl_tensor_python_function_op_processes_batches_by_default() -> None:
    # As in DALI: ops.DLTensorPythonFunction's batch_processing defaults to True.
    seen: list[Any] = []
    op = ops.DLTensorPythonFunction(function=_rows_of_batch)
    pipe = Pipeline(3, 0, None, 1)
    with pipe:
        pipe.set_outputs(op(fn.external_source(source=_ramp, batch=False)))
    with pipe:
        (out,) = pipe.run()
    assert out.as_array()[:, 0, 0].tolist() == [0, 1, 2]
    del seen


def _rows_of_batch(batch: list[Any]) -> list[Any]:
    assert isinstance(batch, list), "a batch op gets a list"
    return [ops._dlpack_from_array(ops._dlpack_to_array(x)) for x in batch]


def test_python_operators_do_not_support_input_sets() -> None:
    op = ops.PythonFunction(function=_double)
    with Pipeline(2, 0) as pipe:
        x = fn.external_source(source=_ramp, batch=False)
        with pytest.raises(TypeError, match="do not support multiple input sets"):
            op([x, x])
        pipe.set_outputs(x)


def test_dlpack_helpers_round_trip() -> None:
    a = np.arange(0, 10, 0.5).reshape((2, 10, 1))[:, 2:5, :]
    back = ops._dlpack_to_array(ops._dlpack_from_array(a))
    assert back.shape == a.shape
    assert np.array_equal(back, a)
    assert np.array_equal(ops._dlpack_to_array(a.copy().__dlpack__()), a)  # a bare capsule


# ================================================================ outputs


@pytest.mark.parametrize("dtypes", [[types.UINT8, types.INT32], [np.uint8, "int32"]])
def test_output_dtypes_list_with_two_outputs(dtypes: list[Any]) -> None:
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        x = fn.external_source(source=_ramp, batch=False)
        a, b = fn.python_function(x, function=_pair, num_outputs=2, output_dtypes=dtypes)
        pipe.set_outputs(a, b)
    with pipe:
        a, b = pipe.run()
    assert (a.dtype, b.dtype) == (np.uint8, np.int32)


def test_output_dtypes_of_dali_types_are_checked() -> None:
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        x = fn.external_source(source=_ramp, batch=False)
        a, b = fn.python_function(
            x, function=_pair, num_outputs=2, output_dtypes=[types.UINT8, types.FLOAT]
        )
        pipe.set_outputs(a, b)
    with pipe, pytest.raises(mpexec.OpOutputError, match="float32"):
        pipe.run()


class _RealDaliEnum:
    """Stands for nvidia.dali's own DALIDataType (a pybind11 enum): a name is all it shares."""

    def __init__(self, name: str) -> None:
        self.name = name


_RealDaliEnum.__name__ = "DALIDataType"


def test_output_dtypes_of_real_dalis_enum_are_read_by_name() -> None:
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        x = fn.external_source(source=_ramp, batch=False)
        a, b = fn.python_function(
            x,
            function=_pair,
            num_outputs=2,
            output_dtypes=[_RealDaliEnum("UINT8"), _RealDaliEnum("INT32")],
        )
        pipe.set_outputs(a, b)
    with pipe:
        a, b = pipe.run()
    assert (a.dtype, b.dtype) == (np.uint8, np.int32)


def test_batch_layout_is_a_method() -> None:
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        x = fn.external_source(source=_ramp, batch=False, layout="HW")
        pipe.set_outputs(x, fn.python_function(x, function=_double))
    with pipe:
        x, y = pipe.run()
    assert (x.layout(), y.layout()) == ("HW", "")
    assert x[:1].layout() == "HW"


@pytest.mark.parametrize(
    ("function", "words"),
    [
        (_three, ["Unexpected number of outputs", "got 3", "expected 2", "returned 3 outputs"]),
        (_rows, ["must be a tuple"]),
        (_double, ["must be a tuple"]),
    ],
)
def test_output_count_errors_use_dalis_words(function: Any, words: list[str]) -> None:
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        x = fn.external_source(source=_ramp, batch=False)
        a, b = fn.python_function(x, function=function, num_outputs=2)
        pipe.set_outputs(a, b)
    with pipe, pytest.raises(mpexec.OpOutputError) as info:
        pipe.run()
    for w in words:
        assert w in str(info.value)


def test_too_many_layouts_uses_dalis_words() -> None:
    with Pipeline(1, 0) as pipe, pytest.raises(ValueError, match="length of output_layouts"):
        fn.python_function(
            types.Constant(1), function=_double, output_layouts=["HW", "HWC"], name="lay"
        )
    del pipe


@pytest.mark.parametrize(
    "bad",
    [
        {"output_layouts": ["HW", "HWC"]},
        {"output_dtypes": [types.UINT8, types.INT32]},
        {"output_shapes": [(1,), (2,)]},
    ],
)
def test_argument_counts_dali_refuses_are_also_its_runtime_error(bad: dict[str, Any]) -> None:
    # DALI reports these from its backend as RuntimeError (DALI's own
    # test_invalid_layouts_arg catches that type); ValueError is kept for mpexec's users.
    with Pipeline(1, 0) as pipe, pytest.raises(mpexec.OpArgumentError) as info:
        fn.python_function(types.Constant(1), function=_double, **bad)
    del pipe
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, ValueError)


# ================================================================ epoch_size


def test_epoch_size_of_sized_sources() -> None:
    samples = [np.zeros(2)] * 5
    batches = [[np.zeros(2)] * 3, [np.zeros(2)] * 2]
    pipe = Pipeline(3, 0, None, 1)
    with pipe:
        a = fn.external_source(source=samples, batch=False, name="samples")
        b = fn.external_source(source=batches, name="batches")
        c = fn.external_source(source=_ramp, batch=False, name="callable")
        pipe.set_outputs(a, b, c)
    assert pipe.epoch_size("samples") == 5
    assert pipe.epoch_size("batches") == 5
    assert pipe.epoch_size() == {"samples": 5, "batches": 5}
    with pytest.raises(KeyError, match="callable"):
        pipe.epoch_size("callable")
    pipe.close()


def test_epoch_length_and_declared_outputs() -> None:
    """What mpexec.tf sizes a dataset by and builds its element_spec from, public."""
    samples = [np.zeros(2)] * 10
    for last_batch, want in (("partial", 3), ("drop", 2)):
        pipe = mpexec.Pipeline(batch_size=4, num_workers=0, last_batch=last_batch)
        with pipe:
            x = fn.external_source(source=samples, batch=False)
            y = fn.python_function(
                x,
                function=lambda a: (a, a),
                num_outputs=2,
                output_dtypes=(np.float32, None),
                output_shapes=((2, None), (2,)),
            )
            pipe.set_outputs(*y, x)
        assert pipe.epoch_length() == want
        assert pipe.declared_outputs() == (
            (np.dtype(np.float32), (2, None)),
            (None, (2,)),
            (None, None),
        )
        pipe.close()
    pipe = mpexec.Pipeline(batch_size=4, num_workers=0)
    with pipe:
        pipe.set_outputs(fn.external_source(source=_ramp, batch=False))  # no len(): unknown
    assert pipe.epoch_length() is None
    pipe.close()


def test_dali_names_import_neither_dali_nor_pillow() -> None:
    # The optional packages are imported only where used: DALI by
    # mpexec.dali.external_source, Pillow by the decoder when it decodes.
    code = (
        "import sys, mpexec, mpexec.dali, mpexec.fn, mpexec.ops, mpexec.types, mpexec.pipeline\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('nvidia', 'PIL')))"
    )
    assert run_python("-c", code).strip() == "[]"
