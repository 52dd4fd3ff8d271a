"""JAX and tf.data checks, each run in a fresh interpreter by tests/adapters/test_frameworks.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from tests.adapters.test_frameworks import double_batch, expected, image, make


def check_jax() -> None:
    import jax

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


def check_tf_dataset(declared: str) -> None:
    import tensorflow as tf

    from mpexec import tf as mtf

    with make(declared=bool(declared)) as pipe:
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


def check_tf_declared_spec() -> None:
    import tensorflow as tf

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


def check_tf_ragged() -> None:
    import tensorflow  # noqa: F401

    from mpexec import tf as mtf

    with make(with_ragged=True) as pipe, pytest.raises(ValueError, match="ragged"):
        mtf.dataset(pipe)
