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

    @mpexec.pipeline_def(batch_size=4, num_workers=0, seed=3, last_batch="partial")
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


class Sized:
    """A per-sample source with a length: ``n`` samples of 64x64 float32."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __call__(self, info: Any) -> Any:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.full((64, 64), info.idx_in_epoch, np.float32)


def check_tf_cardinality() -> None:
    import tensorflow as tf

    from mpexec import tf as mtf

    def sized(n: int, last_batch: str = "partial") -> mpexec.Pipeline:
        @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=3, last_batch=last_batch)
        def pipe() -> Any:
            x = fn.external_source(source=Sized(n), batch=False)
            return fn.python_function(
                x,
                function=double_batch,
                batch_processing=True,
                output_dtypes=np.float32,
                output_shapes=(64, 64),
            )

        return pipe()  # type: ignore[no-any-return]

    for n, last_batch, want in ((10, "partial", 3), (10, "drop", 2), (8, "partial", 2)):
        with sized(n, last_batch) as pipe:
            ds = mtf.dataset(pipe)
            assert int(ds.cardinality()) == want, (n, last_batch, int(ds.cardinality()))
            assert mtf.epoch_length(pipe) == want
            assert [len(list(ds)) for _ in range(2)] == [want, want]
    with make() as pipe:  # a source without len(): unknown
        assert int(mtf.dataset(pipe).cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with sized(10) as pipe:  # not at the start of an epoch: the first pass is shorter
        pipe.run()
        assert int(mtf.dataset(pipe).cardinality()) == tf.data.UNKNOWN_CARDINALITY


def check_tf_keras_fit_needs_no_steps() -> None:
    """Keras reads the cardinality: no "input ran out of data" warning at any epoch."""
    import warnings

    import keras

    from mpexec import tf as mtf

    def features(info: Any) -> Any:
        if info.idx_in_epoch >= 10:
            raise StopIteration
        return np.full(8, info.idx_in_epoch, np.float32)

    features_sized = _SizedCallable(features, 10)

    @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=0, last_batch="partial")
    def pipe() -> Any:
        x = fn.external_source(source=features_sized, batch=False)
        y = fn.python_function(x, function=_target)
        return x, y

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pipe() as p, warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ran out of data.*")
        history = model.fit(mtf.dataset(p), epochs=3, verbose=0)
    assert len(history.history["loss"]) == 3


class _SizedCallable:
    def __init__(self, function: Any, n: int) -> None:
        self.function, self.n = function, n

    def __len__(self) -> int:
        return self.n

    def __call__(self, info: Any) -> Any:
        return self.function(info)


def _target(x: Any) -> Any:
    return x[:1] * 0.5


def check_tf_hand_off_aliases_the_batch(sized: str) -> None:
    """A dense output reaches tf.data with no copy: its tensor is the batch's memory."""
    import tensorflow as tf

    from mpexec import tf as mtf

    class Capsule:
        def __init__(self, capsule: Any) -> None:
            self.capsule = capsule

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self.capsule

        def __dlpack_device__(self) -> tuple[int, int]:
            return (1, 0)

    def address(t: Any) -> int:
        return int(np.from_dlpack(Capsule(tf.experimental.dlpack.to_dlpack(t))).ctypes.data)

    handed: list[np.ndarray[Any, Any]] = []
    dense_of = mtf._dense

    def recording(batch: Any, i: int) -> Any:
        out = dense_of(batch, i)
        handed.append(out)
        return out

    mtf._dense = recording  # type: ignore[attr-defined]
    # Output 0 dense from its op; output 1 stacked sample by sample.
    with make(sized=bool(sized)) as pipe:
        ds = mtf.dataset(pipe)
        assert int(ds.cardinality()) == (3 if sized else tf.data.UNKNOWN_CARDINALITY)
        got = [(a, b) for a, b in ds.map(lambda a, b: (a, b))]
        tensors = [t for pair in got for t in pair]
        arrays = handed[-len(tensors) :]  # the first iteration was also read for the spec
        assert [address(t) for t in tensors] == [a.ctypes.data for a in arrays]
        assert all(a.ctypes.data % 64 == 0 for a in arrays)
        # TensorFlow's ops make new tensors: they never write into the batch's memory,
        # even where the dataset holds the only reference to it.
        pipe.reset()
        n0 = len(handed)
        for a, b in mtf.dataset(pipe).map(lambda a, b: (a * 2.0 + 1.0, tf.nn.relu(b) - b)):
            del a, b
        second = handed[n0 + 2 :]  # less the first iteration, read again for the spec
    if sized:  # its epoch was ended by a call past the last iteration: nothing more
        assert len(second) == 6
    for (a, b), want in zip(zip(second[::2], second[1::2], strict=True), expected(), strict=True):
        np.testing.assert_array_equal(a, want * 2)
        np.testing.assert_array_equal(b, want)
    for (a, b), want in zip(got, expected(), strict=True):
        np.testing.assert_array_equal(a.numpy(), want * 2)
        np.testing.assert_array_equal(b.numpy(), want)


class Liar:
    """A source whose len() is not where its epoch ends."""

    def __init__(self, says: int, has: int) -> None:
        self.says, self.has = says, has

    def __len__(self) -> int:
        return self.says

    def __call__(self, info: Any) -> Any:
        if info.idx_in_epoch >= self.has:
            raise StopIteration
        return np.full((64, 64), info.idx_in_epoch, np.float32)


def check_tf_wrong_length() -> None:
    import tensorflow as tf

    from mpexec import tf as mtf

    for says, has, message in ((12, 8, "ended after 2 iterations"), (4, 8, "goes on past 1")):

        @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=0)
        def pipe() -> Any:
            return fn.external_source(source=Liar(says, has), batch=False)  # noqa: B023

        with pipe() as p:
            ds = mtf.dataset(p)
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                list(ds)


def check_tf_second_pass_of_a_source_read_once() -> None:
    """An iterable that does not cycle is read once: the next pass says how to read it again."""
    import tensorflow as tf

    from mpexec import tf as mtf

    items = [np.full((8,), i, np.float32) for i in range(8)]
    for cycle, passes in ((None, 1), ("raise", 3)):

        @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=0)
        def pipe() -> Any:
            return fn.external_source(source=items, batch=False, cycle=cycle)  # noqa: B023

        with pipe() as p:
            ds = mtf.dataset(p)
            for _ in range(passes):
                assert [int(a.numpy()[0, 0]) for (a,) in ds] == [0, 4]
            if cycle is None:
                with pytest.raises(tf.errors.InvalidArgumentError, match="cycle='raise'"):
                    list(ds)


def check_tf_pipeline_read_between() -> None:
    """The iteration kept for the spec is not yielded once the pipeline was read since."""
    from mpexec import tf as mtf

    for sized in (False, True):
        with make(declared=False, sized=sized) as pipe:
            ds = mtf.dataset(pipe)  # reads iteration 0 for the spec, and keeps it
            assert len(list(pipe)) == 2  # the rest of the epoch, read directly
            passes = [[a.numpy() for a, _ in ds] for _ in range(2)]
        for got in passes:
            assert len(got) == 3, (sized, len(got))
            for a, want in zip(got, expected(), strict=True):
                np.testing.assert_array_equal(a, want * 2)
