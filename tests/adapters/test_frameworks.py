"""Pipelines into frameworks: torch tensors and JAX arrays by DLPack (no copy), tf.data."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
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


class SizedImages:
    """``image`` with a length: the epoch's length is known."""

    def __len__(self) -> int:
        return 10

    def __call__(self, info: Any) -> Any:
        return image(info)


def make(declared: bool = True, with_ragged: bool = False, sized: bool = False) -> mpexec.Pipeline:
    # last_batch="partial": the short last batch (10 samples in 4s) is checked too.
    @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=3, last_batch="partial")
    def pipe() -> Any:
        x = fn.external_source(source=SizedImages() if sized else image, batch=False)
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
    from tests.adapters.test_torch import mapping_of

    with make() as pipe:
        batch = pipe.run()[0]
        # The op produced the batch dense: the tensor maps that memory, copy-on-write.
        tensor = mt.to_torch(batch)
        assert mapping_of(tensor.data_ptr()) == ("rw-p", True)
        np.testing.assert_array_equal(tensor.numpy(), batch.as_array())


def test_ragged_outputs_become_lists() -> None:
    pytest.importorskip("torch")
    from mpexec import torch as mt

    with make(with_ragged=True) as pipe:
        _, rag = next(mt.iterate(pipe))
        assert isinstance(rag, list)
        assert [r.shape[0] for r in rag] == [1, 2, 3, 1]


# JAX and TensorFlow start threads of their own once imported (JAX then warns at
# every os.fork(), which torch's DataLoader does) and keep files open: their checks
# run in a fresh interpreter each (tests/adapters/_framework_checks.py), not in this one.
def run_check(module: str, check: str, *args: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (tox -e frameworks installs it)")
    code = f"from tests.adapters._framework_checks import {check}; {check}(*{args!r})"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_jax_iterate_no_copy_and_values() -> None:
    run_check("jax", "check_jax")


@pytest.mark.parametrize("declared", ["yes", ""])  # one output declared, or none
def test_tf_dataset_element_spec_and_epochs(declared: str) -> None:
    run_check("tensorflow", "check_tf_dataset", declared)


def test_tf_declared_spec_needs_no_iteration() -> None:
    run_check("tensorflow", "check_tf_declared_spec")


def test_tf_ragged_output_is_a_clear_error() -> None:
    run_check("tensorflow", "check_tf_ragged")


def test_tf_dataset_cardinality_from_sized_sources() -> None:
    run_check("tensorflow", "check_tf_cardinality")


def test_tf_keras_fit_does_not_run_out_of_data() -> None:
    run_check("keras", "check_tf_keras_fit_needs_no_steps")


@pytest.mark.parametrize("sized", ["yes", ""])  # a known length (range), or not (generator)
def test_tf_hand_off_aliases_the_batch_memory(sized: str) -> None:
    run_check("tensorflow", "check_tf_hand_off_aliases_the_batch", sized)


def test_tf_epoch_not_as_long_as_said_is_an_error() -> None:
    run_check("tensorflow", "check_tf_wrong_length")


def test_tf_dataset_after_the_pipeline_was_read() -> None:
    run_check("tensorflow", "check_tf_pipeline_read_between")


def test_tf_second_pass_over_a_source_read_once_says_how_to_cycle() -> None:
    run_check("tensorflow", "check_tf_second_pass_of_a_source_read_once")
