"""Pipeline parity suite: DALI's documented ``fn.python_function``,
``fn.external_source`` and ``Pipeline`` behaviour, and the contract's invariants
(zero-copy, no aliasing surprises, stateful order, loud failures, serialization).

Most graphs are checked in both definition styles: ``@mpexec.pipeline_def`` and
``pipe = mpexec.Pipeline(...); with pipe: ...; pipe.set_outputs(...)``.
``num_workers=0`` is used wherever worker processes are not the point.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import hashlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn

T = 30  # bound of every wait in this file
KiB = 1 << 10
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("no_leaks")

STYLES = ["decorator", "with"]


# ================================================================ helpers
@pytest.fixture(params=STYLES)
def style(request: pytest.FixtureRequest) -> str:
    """The two ways to define a pipeline (DALI's): decorator, or ``with pipe:``."""
    return str(request.param)


def make(style: str, graph_fn: Callable[[], Any], **params: Any) -> mpexec.Pipeline:
    """A defined (not yet built) pipeline whose graph ``graph_fn`` builds."""
    if style == "decorator":
        return mpexec.pipeline_def(graph_fn, **params)()
    pipe = mpexec.Pipeline(**params)
    with pipe:
        out = graph_fn()
        if out is None:
            out = ()
        elif not isinstance(out, (tuple, list)):
            out = (out,)
        pipe.set_outputs(*out)
    return pipe


def define(style: str, graph_fn: Callable[[], Any], **params: Any) -> None:
    """Define a pipeline only (for definition-time errors)."""
    params.setdefault("batch_size", 2)
    params.setdefault("num_workers", 0)
    make(style, graph_fn, **params)


def values(batch: mpexec.Batch) -> list[Any]:
    """The samples of ``batch`` as nested Python lists (for readable comparisons)."""
    return [np.asarray(s).tolist() for s in batch]


def ramp(n: int = 4, width: int = 3, stop: int | None = None) -> Callable[[int], Any]:
    """A batch source: iteration ``i`` gives ``n`` samples ``[i, j, 0, 1, ...]``."""

    def source(iteration: int) -> list[np.ndarray[Any, Any]]:
        if stop is not None and iteration >= stop:
            raise StopIteration
        return [np.array([iteration, j, *range(width - 2)], dtype=np.int64) for j in range(n)]

    return source


def digest(pipe: mpexec.Pipeline) -> str:
    """A hash of every output of every iteration of one epoch."""
    h = hashlib.sha256()
    for outs in pipe:
        for batch in outs:
            for a in batch:
                h.update(a.dtype.str.encode())
                h.update(repr(a.shape).encode())
                h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@pytest.fixture
def killed() -> Iterator[list[int]]:
    """Pids of workers a test kills on purpose: their named segments go afterwards.

    A SIGKILLed process cannot unlink what it named (posix backend); no_leaks
    then checks everything else.
    """
    pids: list[int] = []
    yield pids
    for name in os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []:
        if name.startswith("mpx") and any(f"-{pid}-" in name for pid in pids):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


# ================================================================ functions (module level)
def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _plus_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + 1


def _double_same(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # x * x.dtype.type(2): NumPy < 2 promotes 0-d float32 * int to float64.
    return x * x.dtype.type(2)


def _identity(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x


def _copy(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x.copy()


def _split3(x: np.ndarray[Any, Any]) -> tuple[Any, Any, Any]:
    return x, x + 1, x * 10


def _three_outputs(x: np.ndarray[Any, Any]) -> tuple[Any, Any, Any]:
    return x, x, x


def _not_a_tuple(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x


def _strided(x: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    """Views of the (read-only, shared) input with odd strides, and of a new array."""
    y = x + 0
    return x[::-1], x.T, x[:, ::2], x[::-1, ::-2].T, y[::-1], y.T, y[:, ::2]


def _pid_of(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array(os.getpid(), dtype=np.int64)


def _writeable(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array(x.flags.writeable)


def _write_input(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    x[...] = 0
    return x


_MUTATION_BLOCKED: list[str] = []


def _mutate(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Writes to its input the hard way: debug mode must name this function."""
    try:
        x.setflags(write=True)
    except ValueError as exc:
        _MUTATION_BLOCKED.append(str(exc))
        return x.copy()
    x[...] = 0
    return x.copy()


_SIDE_EFFECTS: list[tuple[str, int]] = []


def _record_kept(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    _SIDE_EFFECTS.append(("kept", int(x[1])))
    return x.copy()


def _record_pruned(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    _SIDE_EFFECTS.append(("pruned", int(x[1])))
    return x.copy()


def _record_stateful(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    _SIDE_EFFECTS.append(("stateful", int(x[1])))
    return x.copy()


def _sink(x: np.ndarray[Any, Any]) -> None:
    _SIDE_EFFECTS.append(("sink", int(x[1])))


def _batch_add(xs: list[Any], ys: list[Any]) -> list[Any]:
    assert isinstance(xs, list)
    assert isinstance(ys, list)
    return [x + y for x, y in zip(xs, ys, strict=True)]


def _batch_dense(xs: list[Any]) -> np.ndarray[Any, Any]:
    assert isinstance(xs, list)
    return np.stack(xs) * 3


def _batch_two(xs: list[Any]) -> tuple[list[Any], np.ndarray[Any, Any]]:
    return [x + 1 for x in xs], np.stack(xs) - 1


def _batch_wrong_size(xs: list[Any]) -> list[Any]:
    return xs[:-1]


def _as_float64(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x.astype(np.float64)


def _as_float32_rows(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.zeros((int(x[1]) + 1, 3), dtype=np.float32)


def _sample_info_here(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    info = mpexec.sample_info()
    assert isinstance(info, mpexec.SampleInfo)
    return np.array(list(info), dtype=np.int64)


def _batch_info_here(xs: list[Any]) -> list[Any]:
    info = mpexec.sample_info()
    assert isinstance(info, mpexec.BatchInfo)
    return [np.array(list(info), dtype=np.int64) for _ in xs]


class _Boom(ValueError):
    """A user's own exception type."""


def _boom_at(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if int(x[0]) == 1 and int(x[1]) == 3:
        raise _Boom(f"no sample {x.tolist()} today")
    return x + 1


def _kill_at(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if int(x[0]) == 1 and int(x[1]) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(T)  # the signal may take a moment to land
    return np.array(os.getpid(), dtype=np.int64)


class _Counter:
    """A stateful op: its n-th call returns ``[n, pid]``."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        n = self.n
        self.n += 1
        return np.array([n, os.getpid()], dtype=np.int64)


EPOCH = 12  # samples in the epoch of _info_source


def _info_source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    """A per-sample source (runs in the workers): its SampleInfo and pid."""
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    return np.array(
        [info.idx_in_epoch, info.idx_in_batch, info.iteration, info.epoch_idx, os.getpid()],
        dtype=np.int64,
    )


def _index_source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    """A per-sample source of an epoch of EPOCH samples: its SampleInfo, nothing else."""
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    return np.array(list(info), dtype=np.int64)


def _big_source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    """64 KiB per sample, its value the sample's index in the epoch (endless)."""
    return np.full(8 * KiB, info.idx_in_epoch, dtype=np.float64)


def _pid_source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    return np.array([info.iteration, info.idx_in_batch, os.getpid()], dtype=np.int64)


# ================================================================ 1. outputs
def test_single_output(style: str) -> None:
    def graph() -> Any:
        return fn.python_function(fn.external_source(source=ramp()), function=_double)

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        for i in range(3):
            out = pipe.run()
            assert isinstance(out, tuple)
            assert len(out) == 1
            assert isinstance(out[0], mpexec.Batch)
            assert values(out[0]) == [[2 * i, 2 * j, 0] for j in range(4)]


def test_multiple_outputs(style: str) -> None:
    def graph() -> Any:
        a, b, c = fn.python_function(
            fn.external_source(source=ramp()), function=_split3, num_outputs=3
        )
        return c, a, b

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        c, a, b = pipe.run()
        assert values(a) == [[0, j, 0] for j in range(4)]
        assert values(b) == [[1, j + 1, 1] for j in range(4)]
        assert values(c) == [[0, 10 * j, 0] for j in range(4)]


@pytest.mark.parametrize(
    ("num_workers", "function", "num_outputs", "text"),
    [
        pytest.param(0, _three_outputs, 2, "returned 3 outputs", id="too-many"),
        pytest.param(1, _three_outputs, 2, "returned 3 outputs", id="too-many-in-a-worker"),
        pytest.param(0, _split3, 4, "returned 3 outputs", id="too-few"),
        pytest.param(0, _not_a_tuple, 2, "tuple", id="not-a-tuple"),
    ],
)
def test_wrong_number_of_outputs(
    num_workers: int, function: Any, num_outputs: int, text: str
) -> None:
    def graph() -> Any:
        src = fn.external_source(source=ramp())
        return fn.python_function(src, function=function, num_outputs=num_outputs, name="splitter")

    style = "with" if num_workers else "decorator"
    with make(style, graph, batch_size=4, num_workers=num_workers) as pipe:
        with pytest.raises(mpexec.OpOutputError) as info:
            pipe.run()
        assert "splitter" in str(info.value)
        assert text in str(info.value)
        assert isinstance(info.value, ValueError)


def _pair_as_list(x: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    return [x, x + 1]


def _one_in_a_list(x: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    return [x * 2]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_one_output_returned_as_a_list_of_two_is_an_error(num_workers: int) -> None:
    # DALI reads a returned tuple or list as the op's outputs: two values for
    # num_outputs=1 is a mistake to report, not an array to stack.
    def graph() -> Any:
        src = fn.external_source(source=ramp())
        return fn.python_function(src, function=_pair_as_list, name="lister")

    style = "with" if num_workers else "decorator"
    pipe = make(style, graph, batch_size=4, num_workers=num_workers)
    with pipe, pytest.raises(mpexec.OpOutputError) as info:
        pipe.run()
    _must_mention(info.value, "lister", "num_outputs=1", "list of 2", "num_outputs=2")


def test_one_output_returned_in_a_list_of_one_is_that_output(style: str) -> None:
    def graph() -> Any:
        return fn.python_function(fn.external_source(source=ramp()), function=_one_in_a_list)

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        (out,) = pipe.run()
        assert values(out) == [[0, 2 * j, 0] for j in range(4)]


def test_num_outputs_zero_sink_runs(style: str) -> None:
    _SIDE_EFFECTS.clear()

    def graph() -> Any:
        src = fn.external_source(source=ramp(stop=3))  # an epoch of 3: nothing runs ahead
        assert fn.python_function(src, function=_sink, num_outputs=0, name="sink") is None
        return fn.python_function(src, function=_double)

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        assert len(list(pipe)) == 3
        assert _SIDE_EFFECTS.count(("sink", 2)) == 3
        assert len([e for e in _SIDE_EFFECTS if e[0] == "sink"]) == 12
        assert pipe.stats().pruned_ops == 0
        assert "sink" in [op.name for op in pipe.stats().ops]


def test_preserve_keeps_unused_op_and_unused_op_is_pruned(style: str) -> None:
    _SIDE_EFFECTS.clear()

    def graph() -> Any:
        src = fn.external_source(source=ramp(stop=2))
        fn.python_function(src, function=_record_kept, preserve=True, name="kept")
        fn.python_function(src, function=_record_pruned, name="pruned")
        fn.python_function(src, function=_record_stateful, stateful=True, name="stateful")
        return fn.python_function(src, function=_double, name="used")

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        assert len(list(pipe)) == 2
        stats = pipe.stats()
    tags = collections.Counter(tag for tag, _ in _SIDE_EFFECTS)
    assert tags["kept"] == 8, "preserve=True keeps an unused op running"
    assert tags["stateful"] == 8, "a stateful op is never pruned"
    assert tags["pruned"] == 0, "an unused op without preserve is pruned"
    assert stats.pruned_ops == 1
    names = [op.name for op in stats.ops]
    assert "pruned" not in names
    assert {"kept", "stateful", "used"} <= set(names)


def test_stateful_ops_are_never_merged() -> None:
    """Two stateful ops with one function and one input both run (serially: twice)."""
    _SIDE_EFFECTS.clear()

    @mpexec.pipeline_def(batch_size=3, num_workers=0)
    def graph() -> Any:
        src = fn.external_source(source=ramp(3, stop=1))
        a = fn.python_function(src, function=_record_stateful, stateful=True)
        b = fn.python_function(src, function=_record_stateful, stateful=True)
        return a, b

    with graph() as pipe:
        a, b = pipe.run()
        assert pipe.stats().merged_ops == 0
    assert values(a) == values(b)
    assert len(_SIDE_EFFECTS) == 6


def test_output_layouts(style: str) -> None:
    def graph() -> Any:
        src = fn.external_source(source=ramp(2))
        a, b = fn.python_function(src, function=_split3_2, num_outputs=2, output_layouts="HW")
        c, d, e = fn.python_function(src, function=_split3, num_outputs=3, output_layouts=["C"])
        f = fn.python_function(src, function=_double)
        return a, b, c, d, e, f

    with make(style, graph, batch_size=2, num_workers=0) as pipe:
        a, b, c, d, e, f = pipe.run()
        assert (a.layout(), b.layout()) == ("HW", "HW"), "one string applies to every output"
        assert (c.layout(), d.layout(), e.layout()) == ("C", "", ""), "a short list leaves the rest"
        assert f.layout() == ""


def _split3_2(x: np.ndarray[Any, Any]) -> tuple[Any, Any]:
    return x, x + 1


def test_too_many_output_layouts_is_a_definition_error(style: str) -> None:
    def graph() -> Any:
        src = fn.external_source(source=ramp())
        return fn.python_function(
            src, function=_double, output_layouts=["A", "B"], name="layouts_op"
        )

    with pytest.raises(ValueError, match="layouts_op") as info:
        define(style, graph)
    assert "output_layouts" in str(info.value)


def test_batch_processing_lists_in_lists_or_arrays_out(style: str) -> None:
    def graph() -> Any:
        x = fn.external_source(source=ramp())
        y = fn.python_function(x, function=_double)
        added = fn.python_function(x, y, function=_batch_add, batch_processing=True)
        dense = fn.python_function(x, function=_batch_dense, batch_processing=True)
        p, m = fn.python_function(x, function=_batch_two, batch_processing=True, num_outputs=2)
        return added, dense, p, m

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        for i in range(2):
            added, dense, p, m = pipe.run()
            assert values(added) == [[3 * i, 3 * j, 0] for j in range(4)]
            assert values(dense) == [[3 * i, 3 * j, 0] for j in range(4)]
            assert dense.as_array().shape == (4, 3)
            assert values(p) == [[i + 1, j + 1, 1] for j in range(4)]
            assert values(m) == [[i - 1, j - 1, -1] for j in range(4)]


@pytest.mark.parametrize("num_workers", [0, 1])
def test_batch_processing_wrong_batch_size(num_workers: int) -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=num_workers)
    def graph() -> Any:
        x = fn.external_source(source=ramp())
        return fn.python_function(
            x, function=_batch_wrong_size, batch_processing=True, name="shrinker"
        )

    with graph() as pipe, pytest.raises(mpexec.OpOutputError, match="shrinker"):
        pipe.run()


def test_ragged_batch(style: str) -> None:
    def source() -> list[np.ndarray[Any, Any]]:
        return [np.arange(j + 1, dtype=np.int32) for j in range(4)]

    def graph() -> Any:
        return fn.python_function(fn.external_source(source=source), function=_double)

    with make(style, graph, batch_size=4, num_workers=0) as pipe:
        (out,) = pipe.run()
        assert not out.is_dense()
        assert out.shape() == [(1,), (2,), (3,), (4,)]
        assert values(out) == [list(range(0, 2 * (j + 1), 2)) for j in range(4)]
        with pytest.raises(ValueError, match="ragged"):
            out.as_array()
        assert out[1:2].is_dense()


def test_output_dtypes_and_shapes_accepted(style: str) -> None:
    def graph() -> Any:
        x = fn.external_source(source=ramp(3))
        return fn.python_function(
            x,
            function=_as_float32_rows,
            output_dtypes=np.float32,
            output_shapes=(None, 3),
        )

    with make(style, graph, batch_size=3, num_workers=0) as pipe:
        (out,) = pipe.run()
        assert out.dtype == np.float32
        assert out.shape() == [(1, 3), (2, 3), (3, 3)]


@pytest.mark.parametrize(
    ("num_workers", "kwargs", "words"),
    [
        pytest.param(1, {"output_dtypes": np.float32}, ["float64", "float32"], id="dtype"),
        pytest.param(0, {"output_dtypes": [np.int64]}, ["float64", "int64"], id="dtype-list"),
        pytest.param(0, {"output_shapes": (2,)}, ["(3,)", "(2,)"], id="shape"),
        pytest.param(0, {"output_shapes": [(3, None)]}, ["(3,)", "(3, None)"], id="rank"),
    ],
)
def test_output_dtypes_and_shapes_checked(
    num_workers: int, kwargs: dict[str, Any], words: list[str]
) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=num_workers)
    def graph() -> Any:
        x = fn.external_source(source=ramp(2))
        return fn.python_function(x, function=_as_float64, name="checked_op", **kwargs)

    with graph() as pipe, pytest.raises(mpexec.OpOutputError, match="checked_op") as info:
        pipe.run()
    for word in words:
        assert word in str(info.value)


def test_output_dtypes_count_is_checked_at_definition(style: str) -> None:
    def graph() -> Any:
        x = fn.external_source(source=ramp())
        return fn.python_function(
            x, function=_split3_2, num_outputs=2, output_dtypes=[np.int64] * 3, name="dt_op"
        )

    with pytest.raises(ValueError, match="dt_op"):
        define(style, graph)


# ================================================================ 2. arrays
@pytest.mark.parametrize("num_workers", [0, 2])
def test_strided_and_negative_stride_returns(num_workers: int) -> None:
    """Views with odd strides, of inputs and of new arrays, small and 64 KiB, come back right."""
    small = np.arange(4 * 6, dtype=np.float64).reshape(4, 6)
    big = np.arange(128 * 64, dtype=np.float64).reshape(128, 64)

    def source(iteration: int) -> list[np.ndarray[Any, Any]]:
        return [small + iteration, big + iteration, small - iteration, big - iteration]

    @mpexec.pipeline_def(batch_size=4, num_workers=num_workers)
    def graph() -> Any:
        return tuple(
            fn.python_function(fn.external_source(source=source), function=_strided, num_outputs=7)
        )

    with graph() as pipe:
        for i in range(3):
            outs = pipe.run()
            for k, x in enumerate(source(i)):
                expected = _strided(x)
                for o, (got, want) in enumerate(zip(outs, expected, strict=True)):
                    np.testing.assert_array_equal(
                        got[k], want, err_msg=f"iteration {i}, sample {k}, output {o}"
                    )
                    assert got[k].dtype == want.dtype


def test_dtypes_round_trip() -> None:
    samples = {
        "uint8": [np.array([0, 1, 255], np.uint8), np.array([7, 8, 9], np.uint8)],
        "int64": [np.array([-(2**62), 0, 2**62], np.int64), np.array([1, 2, 3], np.int64)],
        "float16": [np.array([0.5, -1.5, 65504], np.float16), np.array([1, 2, 3], np.float16)],
        "bool": [np.array([True, False, True]), np.array([False, False, True])],
        "complex64": [np.array([1 + 2j, -3j, 0], np.complex64), np.array([1, 2, 3j], np.complex64)],
    }

    def source_of(dtype: str) -> Callable[[], Any]:
        return lambda: samples[dtype]

    @mpexec.pipeline_def(batch_size=2, num_workers=1)
    def graph() -> Any:
        outs = []
        for dtype in samples:
            src = fn.external_source(source=source_of(dtype), name=f"src_{dtype}")
            outs.append(fn.python_function(src, function=_copy, name=f"copy_{dtype}"))
            outs.append(fn.python_function(src, function=_identity, name=f"same_{dtype}"))
        return tuple(outs)

    with graph() as pipe:
        for _ in range(2):
            outs = pipe.run()
            for n, dtype in enumerate(samples):
                for batch in outs[2 * n : 2 * n + 2]:
                    assert batch.dtype == np.dtype(dtype)
                    for got, want in zip(batch, samples[dtype], strict=True):
                        assert got.dtype == np.dtype(dtype)
                        np.testing.assert_array_equal(got, want)


def test_zero_d_and_four_d_samples(style: str) -> None:
    def scalars() -> list[Any]:
        return [np.float32(j + 0.5) for j in range(3)]

    def volumes() -> list[Any]:
        return [np.arange(120, dtype=np.int16).reshape(2, 3, 4, 5) + j for j in range(3)]

    def graph() -> Any:
        s = fn.python_function(fn.external_source(source=scalars), function=_double_same)
        v = fn.python_function(
            fn.external_source(source=volumes), function=_double, output_layouts="FHWC"
        )
        return s, v

    with make(style, graph, batch_size=3, num_workers=int(style == "decorator")) as pipe:
        s, v = pipe.run()
        assert s.shape() == [(), (), ()]
        assert s.ndim == 0
        assert s.dtype == np.float32
        np.testing.assert_array_equal(s.as_array(), [1.0, 3.0, 5.0])
        assert v.shape() == [(2, 3, 4, 5)] * 3
        assert v.layout() == "FHWC"
        np.testing.assert_array_equal(v.as_array(), np.stack(volumes()) * 2)


# ================================================================ 3. stateful
def test_stateful_counters_count_in_serial_order() -> None:
    bs, iterations = 4, 8

    @mpexec.pipeline_def(batch_size=bs, num_workers=2, prefetch_depth=3, seed=3)
    def graph() -> Any:
        src = fn.external_source(source=_pid_source, batch=False)
        first = fn.python_function(src, function=_Counter(), stateful=True, name="first")
        mid = fn.python_function(src, function=_double)  # stateless, fanned out
        second = fn.python_function(mid, function=_Counter(), stateful=True, name="second")
        return src, first, second

    with graph() as pipe:
        pids: dict[str, set[int]] = {"first": set(), "second": set()}
        for i in range(iterations):
            src, first, second = pipe.run()
            for j in range(bs):
                assert src[j].tolist()[:2] == [i, j]
                assert int(first[j][0]) == i * bs + j, f"first: iteration {i}, sample {j}"
                assert int(second[j][0]) == i * bs + j, f"second: iteration {i}, sample {j}"
                pids["first"].add(int(first[j][1]))
                pids["second"].add(int(second[j][1]))
        assert len(pids["first"]) == 1, "a stateful op runs on one worker"
        assert len(pids["second"]) == 1, "a stateful op runs on one worker"
        assert os.getpid() not in pids["first"] | pids["second"]


# ================================================================ 4. definition-time errors
def _must_mention(exc: BaseException, *words: str) -> None:
    text = str(exc)
    for word in words:
        assert word in text, f"{word!r} not in the message: {text}"


def _outside_definitions_again() -> None:
    """After a failed definition, fn.* is back to 'outside a definition': its op waits
    for a pipeline to take it (DALI 2's rule), not in the failed pipeline's graph."""
    node = fn.python_function(fn.external_source(source=ramp()), function=_double)
    pipe = mpexec.Pipeline(batch_size=2, num_workers=0)
    with pipe:
        pipe.set_outputs(node)  # "belongs to another pipeline" were it the failed one's
    assert pipe.num_outputs == 1
    pipe.close()


def test_list_given_as_input(style: str) -> None:
    def graph() -> Any:
        a = fn.external_source(source=ramp())
        b = fn.external_source(source=ramp())
        return fn.python_function([a, b], function=_batch_add, name="listed")

    with pytest.raises(TypeError) as info:
        define(style, graph)
    _must_mention(info.value, "listed", "input 0", "separate positional")
    _outside_definitions_again()


def test_more_than_256_inputs(style: str) -> None:
    def graph() -> Any:
        a = fn.external_source(source=ramp())
        return fn.python_function(*([a] * 257), function=_count_inputs, name="wide")

    with pytest.raises(ValueError) as info:
        define(style, graph)
    _must_mention(info.value, "wide", "257", "256")
    _outside_definitions_again()


def _count_inputs(*xs: Any) -> np.ndarray[Any, Any]:
    return np.array(len(xs), dtype=np.int64)


def test_256_inputs_are_allowed() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def graph() -> Any:
        a = fn.external_source(source=ramp(2))
        return fn.python_function(*([a] * 256), function=_count_inputs)

    with graph() as pipe:
        (out,) = pipe.run()
        assert values(out) == [256, 256]


@pytest.mark.parametrize("bad", [np.zeros(3), 3, "x", None], ids=["ndarray", "int", "str", "None"])
def test_non_datanode_input(style: str, bad: Any) -> None:
    def graph() -> Any:
        a = fn.external_source(source=ramp())
        return fn.python_function(a, bad, function=_batch_add, name="mixed")

    with pytest.raises(TypeError) as info:
        define(style, graph)
    _must_mention(info.value, "mixed", "input 1", "DataNode")
    _outside_definitions_again()


def test_unpicklable_function(style: str) -> None:
    lock = threading.Lock()

    def graph() -> Any:
        a = fn.external_source(source=ramp())
        return fn.python_function(a, function=lambda x: (lock, x)[1], name="locked")

    with pytest.raises(mpexec.SerializationError) as info:
        define(style, graph)
    assert isinstance(info.value, TypeError)
    _must_mention(info.value, "locked", "lock")
    _outside_definitions_again()


def test_unpicklable_sample_source(style: str) -> None:
    lock = threading.Lock()

    def source(info: Any) -> Any:
        with lock:
            return np.zeros(1)

    def graph() -> Any:
        return fn.external_source(source=source, batch=False, name="locked_src")

    with pytest.raises(mpexec.SerializationError) as info:
        define(style, graph)
    _must_mention(info.value, "locked_src", "lock")


def test_gpu_device_without_cupy(style: str) -> None:
    try:
        import cupy  # noqa: F401
    except Exception:  # any import failure means "no CuPy"
        pass
    else:
        pytest.skip("CuPy imports here")

    def graph() -> Any:
        a = fn.external_source(source=ramp())
        return fn.python_function(a, function=_double, device="gpu", name="on_gpu")

    with pytest.raises(mpexec.MpexecError) as info:
        define(style, graph)
    _must_mention(info.value, "on_gpu", "CuPy", "device='cpu'")
    _outside_definitions_again()


@pytest.mark.parametrize("num_outputs", [-1, 1.5, "2", True, None])
def test_bad_num_outputs(style: str, num_outputs: Any) -> None:
    def graph() -> Any:
        a = fn.external_source(source=ramp())
        return fn.python_function(a, function=_double, num_outputs=num_outputs, name="bad_n")

    with pytest.raises((ValueError, TypeError)) as info:
        define(style, graph)
    _must_mention(info.value, "bad_n", "num_outputs")
    _outside_definitions_again()


def test_fn_outside_a_definition_waits_for_a_pipeline() -> None:
    """DALI 2: fn.* outside a definition makes nodes that a pipeline's set_outputs takes."""
    x = fn.external_source(source=ramp())
    y = fn.python_function(x, function=_double)
    z = fn.dl_tensor_python_function(x, function=_double)
    assert isinstance(y, mpexec.DataNode)
    pipe = mpexec.Pipeline(batch_size=4, num_workers=0)
    with pipe:
        pipe.set_outputs(y, z)
    with pipe:
        a, b = pipe.run()
    assert a.as_array()[:, 1].tolist() == b.as_array()[:, 1].tolist() == [0, 2, 4, 6]


def test_external_source_without_source_needs_a_name(style: str) -> None:
    def graph() -> Any:
        return fn.external_source()

    with pytest.raises(ValueError, match="name="):
        define(style, graph)


def test_node_of_another_pipeline_is_refused() -> None:
    nodes: list[Any] = []

    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def first() -> Any:
        nodes.append(fn.external_source(source=ramp()))
        return nodes[0]

    first()

    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def second() -> Any:
        return fn.python_function(nodes[0], function=_double, name="borrower")

    with pytest.raises(ValueError, match="borrower"):
        second()


# ================================================================ 5. user exceptions
@pytest.mark.parametrize("num_workers", [0, 2])
def test_user_exception_reraised_with_cause_and_note(style: str, num_workers: int) -> None:
    if num_workers and style == "with":
        num_workers = 1

    def graph() -> Any:
        return fn.python_function(
            fn.external_source(source=ramp()), function=_boom_at, name="exploder"
        )

    with make(style, graph, batch_size=4, num_workers=num_workers, prefetch_depth=2) as pipe:
        (first,) = pipe.run()
        assert values(first)[0] == [1, 1, 1]
        with pytest.raises(_Boom) as info:
            pipe.run()
        exc = info.value
        assert type(exc) is _Boom, "re-raised as its own type"
        assert "no sample [1, 3, 0] today" in str(exc)
        notes = " ".join(getattr(exc, "__notes__", []))
        for word in ("exploder", "iteration 1", "sample 3"):
            assert word in notes, f"{word!r} not in the notes: {notes!r}"
        if num_workers:
            assert isinstance(exc.__cause__, mpexec.RemoteTraceback)
            assert "_boom_at" in str(exc.__cause__)
        for i in (2, 3):  # the pipeline goes on
            (out,) = pipe.run()
            assert values(out) == [[i + 1, j + 1, 1] for j in range(4)]


# ================================================================ 6. external_source
def _epoch(pipe: mpexec.Pipeline) -> list[np.ndarray[Any, Any]]:
    """One epoch's (only) output, as dense arrays per iteration."""
    return [outs[0].as_array().copy() for outs in pipe]


def test_sample_source_in_workers(style: str) -> None:
    def graph() -> Any:
        return fn.external_source(source=_info_source, batch=False)

    with make(
        style, graph, batch_size=5, num_workers=2, prefetch_depth=2, last_batch="partial"
    ) as pipe:
        epoch0 = _epoch(pipe)
        assert [len(b) for b in epoch0] == [5, 5, 2], "short last batch returned as it is"
        for i, b in enumerate(epoch0):
            for j, row in enumerate(b.tolist()):
                assert row[:4] == [5 * i + j, j, i, 0], f"SampleInfo of iteration {i}, sample {j}"
                assert row[4] != os.getpid(), "a per-sample source runs in the workers"
        with pytest.raises(StopIteration):
            pipe.run()
        with pytest.warns(UserWarning, match=r"pipe\.reset\(\)"):  # said, not silent
            assert list(pipe) == [], "an ended epoch stays ended until reset()"
        pipe.reset()
        epoch1 = _epoch(pipe)
        assert [len(b) for b in epoch1] == [5, 5, 2]
        for b0, b1 in zip(epoch0, epoch1, strict=True):
            np.testing.assert_array_equal(b0[:, :3], b1[:, :3])
            assert set(b1[:, 3].tolist()) == {1}, "epoch_idx is 1 after reset()"


def test_last_batch_drop(style: str) -> None:
    def graph() -> Any:
        return fn.external_source(source=_info_source, batch=False)

    num_workers = 1 if style == "decorator" else 0
    with make(
        style, graph, batch_size=5, num_workers=num_workers, prefetch_depth=3, last_batch="drop"
    ) as pipe:
        for _ in range(2):
            assert [len(b) for b in _epoch(pipe)] == [5, 5]
            pipe.reset()


def test_sample_source_epoch_of_whole_batches() -> None:
    """An epoch that ends on a batch boundary yields no empty batch."""

    def source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= 10:
            raise StopIteration
        return np.array(info.idx_in_epoch)

    @mpexec.pipeline_def(batch_size=5, num_workers=0)
    def graph() -> Any:
        return fn.external_source(source=source, batch=False)

    with graph() as pipe:
        assert [b.tolist() for b in _epoch(pipe)] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


def test_iterable_of_batches(style: str) -> None:
    data = [[np.full(2, 10 * i + j) for j in range(n)] for i, n in enumerate([3, 3, 1])]

    def graph() -> Any:
        return fn.external_source(source=data, cycle="raise")  # reset() starts it again

    with make(style, graph, batch_size=3, num_workers=0) as pipe:
        for _ in range(2):
            got = _epoch(pipe)
            assert [g.tolist() for g in got] == [[a.tolist() for a in b] for b in data]
            pipe.reset()


def test_generator_function_per_sample(style: str) -> None:
    calls: list[int] = []

    def gen() -> Iterator[np.ndarray[Any, Any]]:
        calls.append(1)
        for k in range(7):
            yield np.array([k, k * k])

    def graph() -> Any:
        # cycle="raise": reset() calls it again (DALI's rule: without, one pass).
        src = fn.external_source(source=gen, batch=False, cycle="raise")
        return fn.python_function(src, function=_plus_one)

    with make(style, graph, batch_size=3, num_workers=0, last_batch="partial") as pipe:
        for _ in range(2):
            got = _epoch(pipe)
            assert [g[:, 0].tolist() for g in got] == [[1, 2, 3], [4, 5, 6], [7]]
            pipe.reset()
    assert len(calls) == 2, "reset() calls the generator function again"


def test_batch_callable_with_iteration_argument(style: str) -> None:
    def graph() -> Any:
        return fn.external_source(source=ramp(2, stop=3))

    with make(style, graph, batch_size=2, num_workers=0) as pipe:
        for _ in range(2):
            assert [g[:, 0].tolist() for g in _epoch(pipe)] == [[0, 0], [1, 1], [2, 2]]
            pipe.reset()


def test_batch_callable_without_argument(style: str) -> None:
    state = {"n": 0}

    def source() -> list[np.ndarray[Any, Any]]:
        state["n"] += 1
        if state["n"] > 2:
            raise StopIteration
        return [np.array(state["n"]), np.array(-state["n"])]

    def graph() -> Any:
        return fn.external_source(source=source)

    with make(style, graph, batch_size=2, num_workers=0) as pipe:
        assert [g.tolist() for g in _epoch(pipe)] == [[1, -1], [2, -2]]


def test_batch_callable_with_batch_info(style: str) -> None:
    seen: list[mpexec.BatchInfo] = []

    def source(info: mpexec.BatchInfo) -> np.ndarray[Any, Any]:
        assert isinstance(info, mpexec.BatchInfo)
        seen.append(info)
        if info.iteration >= 2:
            raise StopIteration
        return np.full((2, 2), 10 * info.epoch_idx + info.iteration)

    def graph() -> Any:
        return fn.external_source(source=source, batch_info=True)

    with make(style, graph, batch_size=2, num_workers=0, prefetch_depth=1) as pipe:
        assert [g[:, 0].tolist() for g in _epoch(pipe)] == [[0, 0], [1, 1]]
        pipe.reset()
        assert [g[:, 0].tolist() for g in _epoch(pipe)] == [[10, 10], [11, 11]]
    assert [tuple(i) for i in seen] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_cycle(style: str) -> None:
    data = [np.zeros((2, 1)), np.ones((2, 1))]

    def graph() -> Any:
        return fn.external_source(source=data, cycle=True)

    with make(style, graph, batch_size=2, num_workers=0) as pipe:
        got = [int(pipe.run()[0][0][0]) for _ in range(5)]
    assert got == [0, 1, 0, 1, 0]


def test_external_source_num_outputs(style: str) -> None:
    def source(iteration: int) -> tuple[list[Any], list[Any]]:
        return [np.array(iteration)] * 2, [np.array(10 * iteration)] * 2

    def graph() -> Any:
        a, b = fn.external_source(source=source, num_outputs=2)
        return fn.python_function(a, b, function=_batch_add, batch_processing=True)

    with make(style, graph, batch_size=2, num_workers=0) as pipe:
        assert values(pipe.run()[0]) == [0, 0]
        assert values(pipe.run()[0]) == [11, 11]


def test_feed_input(style: str) -> None:
    def graph() -> Any:
        return fn.python_function(fn.external_source(name="fed"), function=_double)

    with make(style, graph, batch_size=3, num_workers=0) as pipe:
        pipe.feed_input("fed", [np.array([1]), np.array([2]), np.array([3])])
        pipe.feed_input("fed", np.arange(6).reshape(3, 2))
        assert values(pipe.run()[0]) == [[2], [4], [6]]
        assert values(pipe.run()[0]) == [[0, 2], [4, 6], [8, 10]]
        with pytest.raises(mpexec.MpexecError) as info:
            pipe.run()
        _must_mention(info.value, "fed", "feed_input")
        with pytest.raises(KeyError, match="nope"):
            pipe.feed_input("nope", [np.array([1])])
        pipe.feed_input("fed", [np.array([5])] * 3)
        assert values(pipe.run()[0]) == [[10]] * 3


# ================================================================ 7. Batch API
def test_batch_api() -> None:
    def source() -> np.ndarray[Any, Any]:
        return np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)

    @mpexec.pipeline_def(batch_size=4, num_workers=1)
    def graph() -> Any:
        return fn.python_function(
            fn.external_source(source=source), function=_plus_one, output_layouts="HW"
        )

    want = source() + 1
    with graph() as pipe:
        (b,) = pipe.run()
        assert isinstance(b, mpexec.Batch)
        assert isinstance(b, collections.abc.Sequence)
        assert len(b) == 4
        np.testing.assert_array_equal(b[0], want[0])
        np.testing.assert_array_equal(b[-1], want[3])
        np.testing.assert_array_equal(b.at(2), want[2])
        part = b[1:3]
        assert isinstance(part, mpexec.Batch)
        assert len(part) == 2
        assert part.layout() == "HW"
        np.testing.assert_array_equal(part.as_array(), want[1:3])
        assert [s.tolist() for s in b] == want.tolist()
        assert b.layout() == "HW"
        assert b.dtype == np.int32
        assert b.ndim == 2
        assert b.shape() == [(2, 3)] * 4
        assert b.is_dense()
        assert b.nbytes == want.nbytes
        dense = b.as_array()
        assert dense.shape == (4, 2, 3)
        np.testing.assert_array_equal(dense, want)
        from_dlpack = getattr(np, "from_dlpack", None) or np._from_dlpack  # NumPy 1.22
        np.testing.assert_array_equal(from_dlpack(b), want)
        np.testing.assert_array_equal(np.asarray(b), want)
        assert "Batch" in repr(b)


# ================================================================ 8. aliasing
def test_held_outputs_are_not_overwritten() -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, prefetch_depth=2, seed=1)
    def graph() -> Any:
        src = fn.external_source(source=_big_source, batch=False)
        return src, fn.python_function(src, function=_plus_one)

    with graph() as pipe:
        held = pipe.run()
        copies = [[np.array(s, copy=True) for s in b] for b in held]
        lone = pipe.run()[1][2]  # one sample, its batch dropped at once
        lone_copy = np.array(lone, copy=True)
        for _ in range(50):
            pipe.run()
        for b, c in zip(held, copies, strict=True):
            for got, want in zip(b, c, strict=True):
                np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(lone, lone_copy)
        np.testing.assert_array_equal(lone, np.full(8 * KiB, 4 + 2 + 1.0))
    np.testing.assert_array_equal(held[1][3], np.full(8 * KiB, 4.0))  # after close, too


def _every_source_kind() -> dict[str, dict[str, Any]]:
    """external_source arguments, one per kind of source (two samples per batch)."""
    return {
        "batch callable": {"source": lambda: [np.zeros(3), np.zeros(3)]},
        "dense batch callable": {"source": lambda: np.zeros((2, 3))},
        "iterable": {"source": [[np.zeros(3), np.zeros(3)]] * 5},
        "per-sample iterable": {"source": [np.zeros(3)] * 10, "batch": False},
        "per-sample callable": {"source": _big_source, "batch": False},
        "fed": {"name": "fed"},
    }


def _feed(pipe: mpexec.Pipeline) -> None:
    pipe.feed_input("fed", [np.zeros(3), np.zeros(3)])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_outputs_are_read_only(num_workers: int) -> None:
    kinds = _every_source_kind()

    @mpexec.pipeline_def(batch_size=2, num_workers=num_workers)
    def graph() -> Any:
        outs = []
        for kwargs in kinds.values():
            src = fn.external_source(**kwargs)
            outs += [src, fn.python_function(src, function=_plus_one)]
        return tuple(outs)

    names = [f"{w} {k}" for k in kinds for w in ("source", "op after")]
    writeable = set()
    with graph() as pipe:
        _feed(pipe)
        for name, b in zip(names, pipe.run(), strict=True):
            for s in [*b, b.as_array()]:
                try:
                    s[...] = 7
                except ValueError as exc:
                    if "read-only" not in str(exc):
                        writeable.add(f"{name} ({exc})")
                else:
                    writeable.add(name)
    # (asserted here, where no array of the pipeline is referenced any more)
    assert not writeable, f"writeable outputs: {sorted(writeable)}"


@pytest.mark.parametrize("num_workers", [0, 1])
def test_functions_get_read_only_inputs(num_workers: int) -> None:
    kinds = _every_source_kind()

    @mpexec.pipeline_def(batch_size=2, num_workers=num_workers)
    def graph() -> Any:
        outs = []
        for kind, kwargs in kinds.items():
            src = fn.external_source(**kwargs)
            outs.append(fn.python_function(src, function=_writeable, name=f"of {kind}"))
            mid = fn.python_function(src, function=_copy)
            outs.append(fn.python_function(mid, function=_writeable, name=f"after {kind}"))
        return tuple(outs)

    with graph() as pipe:
        _feed(pipe)
        outs = pipe.run()
        names = [f"{w} {k}" for k in kinds for w in ("of", "after")]
        writeable = {n: values(b) for n, b in zip(names, outs, strict=True)}
        assert writeable == {n: [False, False] for n in names}


@pytest.mark.parametrize("num_workers", [0, 1])
def test_sources_and_feeders_may_reuse_their_buffers(num_workers: int) -> None:
    """What a source gave, or feed_input was given, is the pipeline's copy (DALI's
    default ``no_copy=False``): a source refilling one buffer, or a caller reusing
    the array it fed, changes no result, held or to come.
    """
    small, big = np.zeros((4, 3)), np.zeros((4, 8 * KiB))
    fed = np.zeros((4, 3))

    def refill(iteration: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        small[...] = iteration
        big[...] = iteration
        return small, big  # the same two buffers every time

    @mpexec.pipeline_def(batch_size=4, num_workers=num_workers, prefetch_depth=2)
    def graph() -> Any:
        a, b = fn.external_source(source=refill, num_outputs=2)
        c = fn.external_source(name="fed")
        ops = [fn.python_function(x, function=_plus_one) for x in (a, b, c)]
        return a, b, c, *ops

    names = ["small", "big", "fed", "small + 1", "big + 1", "fed + 1"]
    wrong = []
    with graph() as pipe:
        held = []
        for i in range(4):
            fed[...] = 10 * i
            pipe.feed_input("fed", fed)
            fed[...] = -1  # the caller reuses its array at once
            held.append(pipe.run())
        for i, outs in enumerate(held):
            wants = [i, i, 10 * i, i + 1, i + 1, 10 * i + 1]
            for name, batch, want in zip(names, outs, wants, strict=True):
                got = np.unique(batch.as_array()).tolist()
                if got != [want]:
                    wrong.append(f"iteration {i}, {name}: {got} instead of {want}")
        del held, outs, batch
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_function_writing_its_input_fails(num_workers: int) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=num_workers)
    def graph() -> Any:
        src = fn.external_source(source=_big_source, batch=False)
        return fn.python_function(fn.python_function(src, function=_copy), function=_write_input)

    with graph() as pipe, pytest.raises(ValueError, match="read-only"):
        pipe.run()


def test_zero_copy_through_a_chain() -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, prefetch_depth=2, seed=2)
    def graph() -> Any:
        src = fn.external_source(source=_big_source, batch=False, name="src")
        a = fn.python_function(src, function=_plus_one, name="a")
        b = fn.python_function(a, function=_double, name="b")
        return fn.python_function(b, function=_plus_one, name="c")

    with graph() as pipe:
        for i in range(5):
            (out,) = pipe.run()
            np.testing.assert_array_equal(out[1], np.full(8 * KiB, (4 * i + 1 + 1) * 2 + 1.0))
        stats = pipe.stats()
    assert [s.name for s in stats.ops] == ["src", "a", "b", "c"]
    for s in stats.ops:
        assert s.bytes_copied == 0, f"op {s.name} copied {s.bytes_copied} bytes"
    for s in stats.ops[1:]:
        assert s.bytes_in >= 5 * 4 * 64 * KiB
        assert s.bytes_out >= 5 * 4 * 64 * KiB


@pytest.mark.parametrize("num_workers", [0, 1])
def test_debug_names_the_function_that_mutates_its_input(num_workers: int) -> None:
    _MUTATION_BLOCKED.clear()

    def source() -> list[np.ndarray[Any, Any]]:
        return [np.arange(4.0), np.arange(4.0)]

    @mpexec.pipeline_def(batch_size=2, num_workers=num_workers, debug=True)
    def graph() -> Any:
        src = fn.external_source(source=source)
        mid = fn.python_function(src, function=_plus_one)
        return fn.python_function(src, function=_mutate, name="mutator"), mid

    with graph() as pipe:
        try:
            mutated, mid = pipe.run()
        except mpexec.InputMutatedError as exc:
            _must_mention(exc, "_mutate", "mutator")
        else:
            # setflags(write=True) was refused in the function: then nothing changed.
            assert _MUTATION_BLOCKED or num_workers, "the write went through undetected"
            assert values(mutated) == [[0.0, 1.0, 2.0, 3.0]] * 2
            assert values(mid) == [[1.0, 2.0, 3.0, 4.0]] * 2


# ================================================================ 9. lifecycle
def test_close_is_idempotent_and_held_batches_survive() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=1)
    def graph() -> Any:
        return fn.python_function(
            fn.external_source(source=_big_source, batch=False), function=_plus_one
        )

    pipe = graph()
    pipe.build()
    (held,) = pipe.run()
    pipe.close()
    assert pipe.closed
    pipe.close()
    np.testing.assert_array_equal(held[1], np.full(8 * KiB, 2.0))
    with pytest.raises(mpexec.MpexecError):
        pipe.run()


def _mark_then_sleep(x: np.ndarray[Any, Any], marker: str = "") -> np.ndarray[Any, Any]:
    Path(marker).touch()
    time.sleep(1.0)
    return x


def test_close_from_another_thread_fails_a_waiting_run_not_ends_the_epoch(
    tmp_path: Path,
) -> None:
    """A run() waiting when the pipeline is closed raises PoolClosedError: a StopIteration
    would end the caller's ``for batch in pipe`` loop as if the epoch had ended."""
    marker = tmp_path / "started"

    @mpexec.pipeline_def(batch_size=2, num_workers=2, prefetch_depth=1)
    def graph() -> Any:
        x = fn.external_source(source=_big_source, batch=False)
        return fn.python_function(
            x, function=functools.partial(_mark_then_sleep, marker=str(marker))
        )

    pipe = graph()
    pipe.build()
    raised: list[BaseException] = []

    def consume() -> None:
        try:
            pipe.run()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    deadline = time.monotonic() + 30
    while not marker.exists():  # the iteration is in a worker: run() waits for it
        assert time.monotonic() < deadline, "the op never started"
        time.sleep(0.01)
    pipe.close()
    thread.join(30)
    assert not thread.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], mpexec.PoolClosedError), repr(raised[0])


def test_close_without_build() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=2)
    def graph() -> Any:
        return fn.external_source(source=ramp())

    pipe = graph()
    pipe.close()
    pipe.close()


_SERIALIZED_CHILD = """
import hashlib, sys
import numpy as np
import mpexec
pipe = mpexec.Pipeline.deserialize(open(sys.argv[1], "rb").read())
h = hashlib.sha256()
with pipe:
    for outs in pipe:
        for batch in outs:
            for a in batch:
                h.update(a.dtype.str.encode())
                h.update(repr(a.shape).encode())
                h.update(np.ascontiguousarray(a).tobytes())
print(h.hexdigest())
"""


def _noisy(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return x + rng.standard_normal(x.shape)


def test_serialize_and_rebuild_in_a_fresh_process(tmp_path: Path) -> None:
    scale = 3.5

    def scaled(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return x * scale

    @mpexec.pipeline_def(batch_size=3, num_workers=1, seed=123, prefetch_depth=2)
    def graph() -> Any:
        src = fn.external_source(source=_index_source, batch=False)
        first = fn.python_function(src, function=_as_float64)
        noisy = fn.python_function(first, function=_noisy)
        return fn.python_function(noisy, function=scaled), noisy

    pipe = graph()
    data = pipe.serialize()
    assert isinstance(data, bytes)
    with pipe:
        want = digest(pipe)
    # rebuilt here, with other parameters: the same outputs
    with mpexec.Pipeline.deserialize(data, num_workers=0) as again:
        assert digest(again) == want
    path = tmp_path / "pipe.bin"
    path.write_bytes(data)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    child = subprocess.run(
        [sys.executable, "-c", _SERIALIZED_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == want


_RAN: list[str] = []


class _Trap:
    """Unpickling it runs code: what crafted data does."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_RAN.append, ("code ran",))


def test_deserialize_checks_the_header_before_unpickling_anything() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=5)
    def graph() -> Any:
        src = fn.external_source(source=_index_source, batch=False)
        return fn.python_function(src, function=_as_float64)

    data = graph().serialize()
    header = 8 + 4 + 8 + 32
    trap = pickle.dumps({"format": 2, "params": {}, "graph": _Trap()})
    crafted = [
        trap,  # plain pickle, no header
        data[:header] + trap,  # a real header over other bytes
        data[:-1],  # truncated
        data[:-1] + bytes([data[-1] ^ 1]),  # one bit flipped
        data[:8] + (1).to_bytes(4, "little") + data[12:],  # another format
        b"",
    ]
    for bad in crafted:
        with pytest.raises(mpexec.MpexecError, match="serialized mpexec pipeline"):
            mpexec.Pipeline.deserialize(bad)
    assert _RAN == [], "crafted bytes ran code before the format check"
    with mpexec.Pipeline.deserialize(data) as pipe:
        assert len(pipe.run()[0]) == 2


def test_worker_killed_during_run(killed: list[int]) -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, prefetch_depth=1)
    def graph() -> Any:
        return fn.python_function(fn.external_source(source=ramp()), function=_kill_at)

    with graph() as pipe:
        (first,) = pipe.run()
        killed.extend(int(p) for p in first)
        t0 = time.monotonic()
        with pytest.raises(mpexec.WorkerCrashedError) as info:
            pipe.run()
        assert time.monotonic() - t0 < 5, "a crash is reported within a few seconds"
        err = info.value
        assert err.pid in killed, "the crashed worker is one of the pipeline's"
        assert err.signal_name == "SIGKILL"
        assert str(err.pid) in str(err)
        t0 = time.monotonic()
        assert pipe._scheduler is not None
        # No hang: the pipeline cannot go on. (Iterations the other worker finished
        # before the crash may come out first: up to a window of them, prefetched.)
        with pytest.raises(mpexec.BrokenPoolError):  # noqa: PT012
            for _ in range(pipe._scheduler.window + 1):
                pipe.run()
        assert time.monotonic() - t0 < 5


def test_stats_fields_and_str() -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, prefetch_depth=2)
    def graph() -> Any:
        src = fn.external_source(source=_info_source, batch=False, name="src")
        pids = fn.python_function(src, function=_pid_of, name="pids")
        fn.python_function(src, function=_double, name="unused")
        batched = fn.python_function(
            src, function=_batch_dense, batch_processing=True, name="batched"
        )
        return pids, batched

    with graph() as pipe:
        assert pipe.stats().iterations == 0
        seen: set[int] = set()
        for pids, _batched in pipe:  # the whole epoch: 3 iterations, then nothing in flight
            seen.update(int(p) for p in pids)
        stats = pipe.stats()
    assert isinstance(stats, mpexec.PipelineStats)
    assert stats.iterations == 3
    assert stats.wall_s > 0
    assert stats.pruned_ops == 1
    assert stats.merged_ops == 0
    by_name = {s.name: s for s in stats.ops}
    assert list(by_name) == ["src", "pids", "batched"]
    for s in stats.ops:
        assert isinstance(s, mpexec.OpStats)
        assert s.function_s >= 0
        assert s.waiting_s >= 0
        assert s.bytes_copied == 0
    assert by_name["pids"].calls == 12
    assert by_name["pids"].samples == 12
    assert by_name["batched"].calls == 3
    assert by_name["batched"].samples == 12
    assert by_name["pids"].bytes_in == 12 * 5 * 8
    assert by_name["pids"].bytes_out == 12 * 8
    busy = dict(stats.busy)
    # Every worker that ran a chunk of `pids` was busy; the others may have run
    # only the source or the batch op (chunks go to whichever worker is free).
    assert seen <= set(busy)
    assert len(busy) <= 2
    assert os.getpid() not in busy
    assert all(0 <= f <= 1 for f in busy.values())
    text = str(stats)
    for word in ("3 iterations", "1 pruned", "src", "pids", "batched"):
        assert word in text
    assert "unused" not in text


def test_sample_info_inside_and_outside_calls(style: str) -> None:
    def graph() -> Any:
        src = fn.external_source(source=ramp(3))
        return (
            fn.python_function(src, function=_sample_info_here),
            fn.python_function(src, function=_batch_info_here, batch_processing=True),
        )

    assert mpexec.sample_info() is None
    with make(style, graph, batch_size=3, num_workers=0) as pipe:
        for i in range(2):
            per_sample, per_batch = pipe.run()
            assert values(per_sample) == [[3 * i + j, j, i, 0] for j in range(3)]
            assert values(per_batch) == [[i, 0]] * 3
    assert mpexec.sample_info() is None


def _fail_on_three(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if mpexec.sample_info().idx_in_epoch == 3:  # type: ignore[union-attr]
        raise KeyError("three")
    return x


def test_chained_ops_run_in_one_call_and_keep_their_identity() -> None:
    """A per-sample source and the ops feeding only each other run as one call per chunk."""

    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=3)
    def graph() -> Any:
        src = fn.external_source(source=_big_source, batch=False, name="src")
        a = fn.python_function(src, function=_plus_one, name="a")
        b = fn.python_function(a, function=_fail_on_three, name="b")
        return fn.python_function(b, function=_double, name="c")

    with graph() as pipe:
        with pytest.raises(KeyError, match="three") as info:
            pipe.run()
        notes = list(info.value.__notes__)
        del info
        assert any("'b'" in note and "sample 3" in note for note in notes)
        (out,) = pipe.run()
        np.testing.assert_array_equal(out[0], np.full(8 * KiB, (4 + 1) * 2.0))
        del out
        stats = {s.name: s for s in pipe.stats().ops}
        assert pipe._scheduler is not None
        absorbed = [s.absorbed for s in pipe._scheduler.ops]
        members = [m.op.name for m in pipe._scheduler.ops[3].members]
    # The per-sample source heads the chain: one round trip per chunk in all.
    assert absorbed == [True, True, True, False]
    assert members == ["src", "a", "b", "c"]
    calls = stats["a"].calls
    assert calls >= 6
    for name in "abc":
        assert stats[name].calls == calls
        assert stats[name].bytes_in == stats[name].bytes_out == calls * 64 * KiB
        assert stats[name].function_s > 0
