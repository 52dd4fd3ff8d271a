# ruff: noqa: PT017, PT018  (plain asserts: these run outside pytest, in a fresh interpreter)
"""mpexec's py_func family inside TensorFlow graphs: checks run in a fresh interpreter each.

Run by tests/adapters/test_tf.py (TensorFlow starts threads of its own and keeps
files open, so it is never imported in the test process). Each check runs its
calls on a ``WorkerPool(2)`` set as the default pool, and ends by shutting it
down and proving that no process or shared-memory segment is left.
"""

from __future__ import annotations

import gc
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
from tests.conftest import _children, shm_names, wait_until

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf


@contextmanager
def pool() -> Iterator[mpexec.WorkerPool]:
    names = shm_names()
    p = mpexec.WorkerPool(2)
    mpexec.set_default_pool(p)
    try:
        yield p
    finally:
        mpexec.set_default_pool(None)
        p.shutdown()
        gc.collect()
        wait_until(lambda: not _children(), 20, "the pool's workers to exit")
        assert shm_names() - names == set()


def _double(x: Any) -> Any:
    return x * 2


def _pair(x: Any) -> Any:
    return x + 1, (x * 2).astype(np.int64)


def _describe(x: Any) -> Any:
    return f"{type(x).__name__}:{x!r}"


def check_tensors_out_everywhere() -> None:
    """Eager, tf.function, v1 Session, tf.data: TF tensors of Tout, TF's shapes and names."""
    with pool():
        x = tf.constant([1.0, 2.0])
        y = mpexec.numpy_function(_double, [x], tf.float32)
        assert isinstance(y, tf.Tensor) and y.dtype == tf.float32
        np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])
        a, b = mpexec.py_func(_pair, [x], [tf.float32, tf.int64])
        assert (a.dtype, b.dtype) == (tf.float32, tf.int64)
        np.testing.assert_array_equal(b.numpy(), [2, 4])
        assert mpexec.numpy_function(lambda v: None, [x], []) is None  # as tf.numpy_function
        assert mpexec.py_function(lambda v: None, [x], []) is None
        (one,) = mpexec.py_function(_double, [x], [tf.float32])  # a list Tout: a list
        assert isinstance(one, tf.Tensor)
        # Strings and scalars, as TF's kernel hands them over.
        s = mpexec.numpy_function(_describe, [tf.constant(b"ab")], tf.string)
        assert s.numpy() == b"bytes:b'ab'", s
        s = mpexec.numpy_function(_describe, [tf.constant(2.5)], tf.string)
        assert s.numpy() == b"float32:np.float32(2.5)", s
        s = mpexec.py_function(lambda t: t.dtype.name, [tf.constant("x")], tf.string)
        assert s.numpy() == b"string", s  # py_function's function gets EagerTensors

        @tf.function
        def graph(v: Any) -> Any:
            out = mpexec.numpy_function(_double, [v], tf.float32, name="doubled")
            assert not isinstance(out, np.ndarray) and out.shape.rank is None  # TF's: unknown
            assert "doubled" in out.op.name
            return out

        np.testing.assert_array_equal(graph(x).numpy(), [2.0, 4.0])
        g = tf.Graph()
        with g.as_default():
            p = tf.compat.v1.placeholder(tf.float32)
            out = mpexec.py_func(_double, [p], tf.float32)
            with tf.compat.v1.Session(graph=g) as sess:
                assert sess.run(out, {p: 3.0}) == 6.0
        ds = tf.data.Dataset.range(5).map(
            lambda i: mpexec.numpy_function(_double, [i], tf.int64), num_parallel_calls=2
        )
        assert list(ds.as_numpy_iterator()) == [0, 2, 4, 6, 8]
        # A lambda written inside the map's lambda reaches us autograph-converted.
        ds = tf.data.Dataset.range(3).map(
            lambda i: mpexec.numpy_function(lambda j: j + 10, [i], tf.int64)
        )
        assert list(ds.as_numpy_iterator()) == [10, 11, 12]
        nested = mpexec.contrib.py_func(
            lambda a, b: {"s": a + b["k"]},
            [x, {"k": x}],
            output_types={"s": tf.float32},
            output_shapes={"s": (2,)},
        )
        np.testing.assert_array_equal(nested["s"].numpy(), [2.0, 4.0])


def _meet(i: Any, folder: str) -> Any:
    """Element i waits (bounded) for element 1 - i to arrive: they must run at once."""
    folder = folder.decode() if isinstance(folder, bytes) else folder  # a tf.string input
    Path(folder, f"arrived-{int(i)}").touch()
    other = Path(folder, f"arrived-{1 - int(i)}")
    deadline = time.monotonic() + 60
    while not other.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"element {int(i)} waited 60 s for the other: calls ran serially")
        time.sleep(0.005)
    return np.int64(os.getpid())


def check_parallel_calls_in_two_workers(folder: str) -> None:
    """num_parallel_calls=2: two calls in two workers at once (the GIL is not held)."""
    with pool() as p:
        ds = tf.data.Dataset.range(2).map(
            lambda i: mpexec.numpy_function(_meet, [i, folder], tf.int64),
            num_parallel_calls=2,
        )
        pids = set(ds.as_numpy_iterator())
        assert pids <= set(p.pids) and len(pids) == 2, (pids, p.pids)


def _fail_on_two(i: Any) -> Any:
    if i == 2:
        raise KeyError(f"no sample {int(i)}")
    return i


def _die_on_two(i: Any) -> Any:
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def _iterate(ds: Any) -> list[Any]:
    """Every element, or the error raised in its place (tf.data goes on past a failed map)."""
    out: list[Any] = []
    it = iter(ds)
    while True:
        try:
            out.append(int(next(it)))
        except StopIteration:
            return out
        except tf.errors.OpError as exc:
            out.append(exc)


def check_bad_input() -> None:
    """A raising function, a killed worker, a wrong Tout, a non-tensor argument."""
    with pool():
        ds = tf.data.Dataset.range(4).map(
            lambda i: mpexec.numpy_function(_fail_on_two, [i], tf.int64)
        )
        got = _iterate(ds)
        assert got[:2] == [0, 1] and got[3:] == [3], got
        assert isinstance(got[2], tf.errors.UnknownError), got[2]  # TF's code for KeyError
        assert "KeyError: 'no sample 2'" in str(got[2]) and "_fail_on_two" in str(got[2])
        # Eagerly, TF re-raises the function's own exception; ours keeps its worker traceback.
        try:
            mpexec.numpy_function(_fail_on_two, [tf.constant(2)], tf.int64)
        except KeyError as exc:
            assert isinstance(exc.__cause__, mpexec.RemoteTraceback), exc.__cause__
        else:
            raise AssertionError("no KeyError")
        try:
            mpexec.py_function(_fail_on_two, [tf.constant(2)], tf.int64)
        except tf.errors.UnknownError as exc:  # TF's py_function raises TF's error
            assert isinstance(exc.__cause__, KeyError), exc.__cause__
        else:
            raise AssertionError("no UnknownError")
        # A wrong Tout: the returned dtype is checked, TF's words, at run time.
        try:
            mpexec.numpy_function(lambda v: v.astype(np.float64), [tf.constant(1.0)], tf.float32)
        except TypeError as exc:
            assert "0-th value returned by" in str(exc) and "float64" in str(exc), exc
        else:
            raise AssertionError("no TypeError")
        ds = tf.data.Dataset.range(1).map(
            lambda i: mpexec.numpy_function(lambda v: [v, v], [i], tf.int64)
        )
        (err,) = _iterate(ds)
        assert isinstance(err, tf.errors.InvalidArgumentError), err
        assert "returns 2 values, but expects to see 1 values" in str(err), err
        for bad in ({}, "no-such-type"):
            try:
                mpexec.numpy_function(_double, [tf.constant(1.0)], bad)
            except TypeError as exc:
                assert "Cannot convert" in str(exc), exc
            else:
                raise AssertionError(f"Tout={bad!r} accepted")
        # A tensor where the list of inputs goes: refused when the op is built.
        try:
            mpexec.numpy_function(_double, tf.constant([1.0]), tf.float32)
        except TypeError as exc:
            assert "inp must be a list of inputs" in str(exc), exc
        else:
            raise AssertionError("a bare tensor was taken as inp")
        try:
            mpexec.py_function(_double, [tf.ragged.constant([[1], [2, 3]])], tf.int32)
        except TypeError as exc:
            assert "RaggedTensor inputs are not supported" in str(exc), exc
        else:
            raise AssertionError("a RaggedTensor was accepted")
    # A worker killed mid-call inside tf.data: a TF error naming the crash, then more
    # elements (the default pool made here is replaced), and nothing left behind.
    names = shm_names()
    ds = tf.data.Dataset.range(4).map(lambda i: mpexec.numpy_function(_die_on_two, [i], tf.int64))
    started = time.monotonic()
    got = _iterate(ds)
    assert time.monotonic() - started < 120
    assert got[:2] == [0, 1] and got[3:] == [3], got
    assert isinstance(got[2], tf.errors.UnknownError), got[2]
    assert "SIGKILL" in str(got[2]) and "WorkerCrashedError" in str(got[2]), got[2]
    mpexec.set_default_pool(None)  # shuts the one made on first use down
    gc.collect()
    wait_until(lambda: not _children(), 20, "the workers to exit")
    assert shm_names() - names == set()


def check_gradients_are_a_clear_error() -> None:
    """py_function: asking for a gradient raises, eagerly and in a tf.function."""
    with pool():
        x = tf.constant(3.0)
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = mpexec.py_function(lambda v: v * v, [x], tf.float32)
        try:
            tape.gradient(y, x)
        except LookupError as exc:
            assert "No gradient defined for" in str(exc) and "worker process" in str(exc)
        else:
            raise AssertionError("no LookupError")

        @tf.function
        def grad(v: Any) -> Any:
            with tf.GradientTape() as t:
                t.watch(v)
                out = mpexec.py_function(lambda u: u * u, [v], tf.float32)
            return t.gradient(out, v)

        try:
            grad(x)
        except Exception as exc:  # autograph wraps it in its StagingError
            assert "LookupError: No gradient defined for" in str(exc), exc
        else:
            raise AssertionError("no LookupError in a tf.function")


def check_saved_model_fails_clearly(folder: str) -> None:
    """A SavedModel with the op saves; loaded in another process, its call fails clearly."""
    import subprocess
    import sys

    with pool():
        module = tf.Module()
        module.f = tf.function(
            lambda v: mpexec.numpy_function(_double, [v], tf.float32),
            input_signature=[tf.TensorSpec([None], tf.float32)],
        )
        np.testing.assert_array_equal(module.f(tf.constant([1.0])).numpy(), [2.0])
        tf.saved_model.save(module, folder)
    code = (
        "import os, tensorflow as tf\n"
        f"m = tf.saved_model.load({folder!r})\n"
        "try:\n    m.f(tf.constant([1.0]))\n"
        "except tf.errors.OpError as e:\n    print(type(e).__name__, str(e)[:400])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    ).stdout
    assert out.startswith("InvalidArgumentError") and "Could not find callback" in out, out


def _fit(op: Callable[..., Any]) -> tuple[list[float], list[str]]:
    tf.keras.utils.set_random_seed(7)

    def features(i: Any) -> Any:
        rng = np.random.default_rng(int(i))
        return rng.normal(size=8).astype(np.float32)

    ds = (
        tf.data.Dataset.range(256)
        .map(lambda i: (op(features, [i], tf.float32), tf.cast(i % 2, tf.float32)))
        .map(lambda x, y: (tf.ensure_shape(x, [8]), y))
        .batch(32)
    )
    model = tf.keras.Sequential(
        [
            tf.keras.Input((8,)),
            tf.keras.layers.Dense(4, activation="relu"),
            tf.keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(ds, epochs=2, verbose=0)
    return history.history["loss"], [str(w.message) for w in caught]


def check_keras_fit_same_loss() -> None:
    """model.fit over a map of mpexec.numpy_function: TF's losses, no warning added."""
    with pool():
        want, tf_warnings = _fit(tf.numpy_function)
        got, our_warnings = _fit(mpexec.numpy_function)
    assert len(got) == 2 and got == want, (got, want)
    assert our_warnings == tf_warnings, (our_warnings, tf_warnings)


def check_op_body_sleeps_while_its_call_runs() -> None:
    """The op's body sleeps until its worker's result comes, polling never.

    N TF threads wait at once in a ``tf.data`` map with ``num_parallel_calls=N``;
    each polling (yielding the CPU in a loop, the GIL taken each time) would take
    the CPUs and the GIL from the workers and the manager thread that delivers.
    """
    yields = 0
    real_yield = os.sched_yield

    def counted() -> None:
        nonlocal yields
        yields += 1
        real_yield()

    with pool():
        x = tf.constant(np.arange(4, dtype=np.float32))
        for _ in range(5):  # warm: the function shipped, the pool's latency known
            mpexec.numpy_function(_double, [x], tf.float32)
        os.sched_yield = counted
        try:
            ds = tf.data.Dataset.range(64).map(
                lambda i: mpexec.numpy_function(_double, [i], tf.int64), num_parallel_calls=2
            )
            assert [int(v) for v in ds] == [2 * i for i in range(64)]
            for _ in range(20):
                assert mpexec.numpy_function(_double, [x], tf.float32).numpy().tolist() == [
                    0,
                    2,
                    4,
                    6,
                ]
        finally:
            os.sched_yield = real_yield
    assert yields == 0, f"the op's body polled: {yields} sched_yield calls"


def _describe_all(*xs: Any) -> Any:
    return " ".join(f"{type(x).__name__}:{x!r}" for x in xs)


def check_scalar_inputs_go_to_the_worker_as_arrays() -> None:
    """TF hands a 0-d tensor to the body as a NumPy scalar; the body ships it as a 0-d
    array (inline: one object for the pickler, not a scalar's and its dtype's reduce),
    and the function still gets the NumPy scalar TF's own op gives it."""
    with pool() as p:
        sent: list[tuple[Any, ...]] = []
        real = p.run_call

        def recording(fn: Any, args: Any = (), **kw: Any) -> Any:
            sent.append(args)
            return real(fn, args, **kw)

        p.run_call = recording  # type: ignore[method-assign]
        inputs = (tf.constant(True), tf.constant(2.5, tf.float64), tf.constant([1, 2]))
        got, want = (
            [
                v.numpy().decode()
                for v in tf.data.Dataset.range(3).map(
                    lambda i, op=op: op(_describe_all, [i, *inputs], tf.string),
                    num_parallel_calls=2,
                )
            ]
            for op in (mpexec.numpy_function, tf.numpy_function)
        )
        assert got == want, (got, want)
        assert want[0].startswith("int64:np.int64(0) bool:np.True_ float64:"), want
        assert len(sent) == 3, sent
        for args in sent:
            assert [type(a) for a in args] == [np.ndarray] * 4, args
            assert [a.ndim for a in args] == [0, 0, 0, 1], args


def check_the_op_body_makes_no_future() -> None:
    """The op's body waits through ``WorkerPool.run_call``: a hooked call, no ``Future``
    (whose condition, RLock, ``set_result`` and ``notify_all`` cost ~40 Python calls
    a call on TF's thread), in a ``tf.data`` map and eagerly; results as before."""
    made = 0
    real_init = Future.__init__

    def counted(self: Any) -> None:
        nonlocal made
        made += 1
        real_init(self)

    with pool():
        x = tf.constant(np.arange(4, dtype=np.float32))
        mpexec.numpy_function(_double, [x], tf.float32)  # warm: the function shipped
        Future.__init__ = counted  # type: ignore[method-assign]
        try:
            ds = tf.data.Dataset.range(64).map(
                lambda i: mpexec.numpy_function(_double, [i], tf.int64), num_parallel_calls=2
            )
            assert [int(v) for v in ds] == [2 * i for i in range(64)]
            for _ in range(8):
                got = mpexec.numpy_function(_double, [x], tf.float32).numpy().tolist()
                assert got == [0, 2, 4, 6]
        finally:
            Future.__init__ = real_init  # type: ignore[method-assign]
    assert made == 0, f"the op's body made {made} Futures for 72 calls"
