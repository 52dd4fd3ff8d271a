"""Pipelines into frameworks: torch tensors and JAX arrays by DLPack (no copy), tf.data."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn

pytestmark = pytest.mark.usefixtures("no_leaks")


def image(info: Any) -> Any:
    # 16 KiB a sample: batches travel through the arena (64-byte aligned), not inline.
    if info.idx_in_epoch >= 10:
        raise StopIteration
    return np.full((64, 64), info.idx_in_epoch, np.float32)


def double_batch(xs: list[Any]) -> Any:
    return np.stack(xs) * 2


def ragged(x: Any) -> Any:
    return x[: 1 + int(x[0, 0]) % 3]


def make(declared: bool = True, with_ragged: bool = False) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=3)
    def pipe() -> Any:
        x = fn.external_source(source=image, batch=False)
        kw: dict[str, Any] = (
            {"output_dtypes": np.float32, "output_shapes": (64, 64)} if declared else {}
        )
        dense = fn.python_function(x, function=double_batch, batch_processing=True, **kw)
        if with_ragged:
            return dense, fn.python_function(x, function=ragged)
        return dense, x

    return pipe()  # type: ignore[no-any-return]


def expected() -> list[np.ndarray[Any, Any]]:
    idx = np.arange(10, dtype=np.float32)
    return [
        np.broadcast_to(idx[i : i + 4, None, None], (len(idx[i : i + 4]), 64, 64))
        for i in range(0, 10, 4)
    ]


def test_torch_iterate_shares_the_batch_memory() -> None:
    torch = pytest.importorskip("torch")
    from mpexec import torch as mt

    with make() as pipe:
        got = []
        for dense, per_sample in mt.iterate(pipe):
            assert isinstance(dense, torch.Tensor)
            got.append((dense, per_sample))
    for (dense, per_sample), want in zip(got, expected(), strict=True):
        np.testing.assert_array_equal(dense.numpy(), want * 2)
        np.testing.assert_array_equal(per_sample.numpy(), want)


def test_torch_iterate_no_copy_pointer() -> None:
    pytest.importorskip("torch")
    from mpexec import torch as mt

    with make() as pipe:
        batch = pipe.run()[0]
        # The op produced the batch dense: the tensor is that memory.
        assert mt.to_torch(batch).data_ptr() == batch.as_array().ctypes.data


def test_jax_iterate_no_copy_and_values() -> None:
    jax = pytest.importorskip("jax")
    from mpexec import jax as mj

    with make() as pipe:
        got = list(mj.iterate(pipe))
        pipe.reset()
        batch = pipe.run()[0]
        j = mj.to_jax(batch)
        assert j.unsafe_buffer_pointer() == batch.as_array().ctypes.data  # no copy
    assert all(isinstance(d, jax.Array) for d, _ in got)
    for (dense, per_sample), want in zip(got, expected(), strict=True):
        np.testing.assert_array_equal(np.asarray(dense), want * 2)
        np.testing.assert_array_equal(np.asarray(per_sample), want)


def test_ragged_outputs_become_lists() -> None:
    pytest.importorskip("torch")
    from mpexec import torch as mt

    with make(with_ragged=True) as pipe:
        _, rag = next(mt.iterate(pipe))
        assert isinstance(rag, list)
        assert [r.shape[0] for r in rag] == [1, 2, 3, 1]


@pytest.mark.parametrize("declared", [True, False])  # one output declared, or none
def test_tf_dataset_element_spec_and_epochs(declared: bool) -> None:
    tf = pytest.importorskip("tensorflow")
    from mpexec import tf as mtf

    with make(declared=declared) as pipe:
        spec = mtf.element_spec(pipe)
        assert spec is None  # the second output (a source) declares nothing: iteration 0 tells
        ds = mtf.dataset(pipe)
        assert ds.element_spec == (
            tf.TensorSpec([None, 64, 64], tf.float32),
            tf.TensorSpec([None, 64, 64], tf.float32),
        )
        epochs = [[(a.numpy(), b.numpy()) for a, b in ds] for _ in range(2)]
    for epoch in epochs:
        for (a, b), want in zip(epoch, expected(), strict=True):
            np.testing.assert_array_equal(a, want * 2)
            np.testing.assert_array_equal(b, want)


def test_tf_declared_spec_needs_no_iteration() -> None:
    tf = pytest.importorskip("tensorflow")
    from mpexec import tf as mtf

    @mpexec.pipeline_def(batch_size=4, num_workers=0, seed=3)
    def pipe() -> Any:
        x = fn.external_source(source=image, batch=False)
        return fn.python_function(
            x,
            function=double_batch,
            batch_processing=True,
            output_dtypes=np.float32,
            output_shapes=(64, -1),
        )

    with pipe() as p:
        assert mtf.element_spec(p) == (tf.TensorSpec([None, 64, None], tf.float32),)
        assert p.stats().iterations == 0


def test_tf_ragged_output_is_a_clear_error() -> None:
    pytest.importorskip("tensorflow")
    from mpexec import tf as mtf

    with make(with_ragged=True) as pipe, pytest.raises(ValueError, match="ragged"):
        mtf.dataset(pipe)


@pytest.mark.parametrize(("module", "extra"), [("jax", "jax"), ("tf", "tf"), ("torch", "torch")])
def test_missing_framework_names_the_extra(module: str, extra: str) -> None:
    real = {"jax": "jax", "tf": "tensorflow", "torch": "torch"}[module]
    code = textwrap.dedent(
        f"""
        import sys
        import mpexec
        assert {real!r} not in sys.modules, "import mpexec imported {real}"
        sys.modules[{real!r}] = None
        try:
            import mpexec.{module}
        except ImportError as exc:
            assert "mpexec[{extra}]" in str(exc), exc
        else:
            raise SystemExit("no ImportError")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
