"""Tracebacks that show the user's code, with mpexec's own frames hidden (and counted)."""

from __future__ import annotations

import os
import re
import textwrap
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _tracebacks, fn

#: A file name inside mpexec: frames compiled with it count as mpexec's own.
INSIDE = str(Path(mpexec.__file__).resolve().parent / "_stand_in_for_the_worker_loop.py")


def _internal(source: str) -> dict[str, Any]:
    """Functions defined as if they were mpexec's code (their frames name INSIDE)."""
    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(source), INSIDE, "exec"), namespace)
    return namespace


LOOP = _internal(
    """
    def run_call(fn, *args):
        return dispatch(fn, args)

    def dispatch(fn, args):
        return fn(*args)

    def check(value):
        raise ValueError(f"an op returned {value!r}")
    """
)


def user_function(x: int) -> int:
    return helper(x)


def helper(x: int) -> int:
    raise KeyError(f"no key {x}")


def _caught(fn: Any, *args: Any) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:
        return exc
    raise AssertionError("no exception")


def test_is_internal() -> None:
    assert _tracebacks.is_internal(mpexec.__file__)
    assert _tracebacks.is_internal(INSIDE)
    assert not _tracebacks.is_internal(__file__)
    assert not _tracebacks.is_internal("<string>")


def test_mpexec_frames_are_hidden_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)
    exc = _caught(LOOP["run_call"], user_function, 3)
    text = _tracebacks.format_exception(exc)
    assert INSIDE not in text
    assert "[2 frames of mpexec hidden; MPEXEC_FULL_TRACEBACK=1 shows them]" in text
    assert "in user_function" in text
    assert "in helper" in text
    assert text.rstrip().endswith("KeyError: 'no key 3'")


def test_the_environment_variable_shows_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_tracebacks.FULL_TRACEBACK_ENV, "1")
    text = _tracebacks.format_exception(_caught(LOOP["run_call"], user_function, 3))
    assert text.count(INSIDE) == 2
    assert "hidden" not in text


def test_an_error_raised_by_mpexec_keeps_its_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)
    text = _tracebacks.format_exception(_caught(LOOP["run_call"], LOOP["check"], 5))
    assert text.count(INSIDE) == 3
    assert "hidden" not in text


def test_chained_exceptions_are_trimmed_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)

    def wrapping(x: int) -> int:
        try:
            return LOOP["run_call"](user_function, x)
        except KeyError as exc:
            raise RuntimeError("while augmenting") from exc

    text = _tracebacks.format_exception(_caught(LOOP["run_call"], wrapping, 1))
    assert INSIDE not in text
    assert text.count("frames of mpexec hidden") == 2
    assert "The above exception was the direct cause" in text


# ---------------------------------------------------------------- where the caller meets them
# A call's error, re-raised in the caller by a pool future, map() or a pipeline's
# run(): its traceback there is the caller's own frames, one line of mpexec (the
# re-raise), then where it was raised; the worker's traceback (the __cause__)
# shows the user's frames with mpexec's hidden and counted.

T = 60  # every wait here is bounded by this


def _mpexec_frames(exc: BaseException) -> list[str]:
    return [
        f"{Path(f.filename).name}:{f.name}"
        for f in traceback.extract_tb(exc.__traceback__)
        if _tracebacks.is_internal(f.filename)
    ]


def _futures_frames(exc: BaseException) -> list[str]:
    return [
        f.name
        for f in traceback.extract_tb(exc.__traceback__)
        if f"concurrent{os.sep}futures" in f.filename
    ]


def _user_frames(exc: BaseException) -> list[str]:
    return [f.name for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__]


def _assert_worker_text(exc: BaseException, *user: str) -> None:
    """The worker's traceback: the user's frames, mpexec's hidden and counted."""
    assert isinstance(exc.__cause__, mpexec.RemoteTraceback)
    text = exc.__cause__.tb
    assert "_worker.py" not in text, text
    assert "_runtime.py" not in text, text
    hidden = r"\[\d+ frames? of mpexec hidden; MPEXEC_FULL_TRACEBACK=1 shows them\]"
    assert re.search(hidden, text), text
    for name in user:
        assert f"in {name}\n" in text, text


def _op(sample: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.asarray(helper(int(sample[0])))


def _pipe(workers: int) -> Any:
    @mpexec.pipeline_def(batch_size=2, num_workers=workers, seed=1)
    def pipe() -> Any:
        src = fn.external_source(source=lambda info: np.zeros(3, np.float32), batch=False)
        return fn.python_function(src, function=_op)

    return pipe()


@pytest.fixture
def default_tracebacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)


pool_test = pytest.mark.usefixtures("no_leaks", "default_tracebacks")


@pool_test
def test_a_worker_error_in_result_shows_the_users_frames() -> None:
    with mpexec.WorkerPool(1) as pool:
        exc = _caught(pool.submit(user_function, 3).result, T)
    assert isinstance(exc, KeyError)
    _assert_worker_text(exc, "user_function", "helper")
    assert _mpexec_frames(exc) == ["_future.py:result"]  # the re-raise, one line
    assert _futures_frames(exc) == []
    assert _user_frames(exc) == ["_caught"]


@pool_test
@pytest.mark.parametrize("chunksize", [None, 1, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_a_worker_error_in_map_shows_the_users_frames(chunksize: int | None, ordered: bool) -> None:
    with mpexec.WorkerPool(2) as pool:
        results = pool.map(user_function, [3], chunksize=chunksize, ordered=ordered, timeout=T)
        exc = _caught(list, results)
    assert isinstance(exc, KeyError)
    _assert_worker_text(exc, "user_function", "helper")
    assert len(_mpexec_frames(exc)) == 1, _mpexec_frames(exc)
    assert _futures_frames(exc) == []


@pool_test
def test_an_inline_pool_keeps_the_users_frames_and_drops_its_own() -> None:
    with mpexec.WorkerPool(0) as pool:
        exc = _caught(pool.submit(user_function, 3).result, T)
        mapped = _caught(list, pool.map(user_function, [3]))
    assert _user_frames(exc) == ["_caught", "user_function", "helper"]
    assert _mpexec_frames(exc) == []  # a plain Future: concurrent.futures' frames stay
    assert _user_frames(mapped) == ["_caught", "user_function", "helper"]
    assert _mpexec_frames(mapped) == ["_mapping.py:map_results"]


@pool_test
def test_raising_the_same_error_again_does_not_grow_its_traceback() -> None:
    with mpexec.WorkerPool(1) as pool:
        future = pool.submit(user_function, 3)
        sizes = [len(traceback.extract_tb(_caught(future.result, T).__traceback__)) for _ in "abc"]
    assert sizes == [2, 2, 2]  # _caught and the re-raise, each time


@pool_test
@pytest.mark.parametrize("workers", [0, 1])
def test_a_pipeline_op_error_shows_the_users_frames(workers: int) -> None:
    pipe = _pipe(workers)
    try:
        exc = _caught(pipe.run)
        iterated = _caught(lambda: next(iter(pipe)))
    finally:
        pipe.close()
    for e in (exc, iterated):
        assert isinstance(e, KeyError)
        assert _futures_frames(e) == []
        if workers:
            _assert_worker_text(e, "_op", "helper")
        else:
            assert _user_frames(e)[-2:] == ["_op", "helper"]
    assert _mpexec_frames(exc) == ["_pipeline.py:run"]
    assert _mpexec_frames(iterated) == ["_pipeline.py:__iter__"]


def _two_outputs(sample: np.ndarray[Any, Any]) -> Any:
    return sample


@pool_test
def test_an_error_mpexec_raises_keeps_mpexecs_frames() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=1, seed=1)
    def pipe() -> Any:
        src = fn.external_source(source=lambda info: np.zeros(3, np.float32), batch=False)
        return fn.python_function(src, function=_two_outputs, num_outputs=2)

    p = pipe()
    try:
        exc = _caught(p.run)
    finally:
        p.close()
    assert isinstance(exc, mpexec.OpOutputError)
    assert isinstance(exc.__cause__, mpexec.RemoteTraceback)
    text = exc.__cause__.tb
    assert "_runtime.py" in text, text
    assert "hidden" not in text, text


@pytest.mark.usefixtures("no_leaks")
def test_the_environment_variable_reaches_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_tracebacks.FULL_TRACEBACK_ENV, "1")
    with mpexec.WorkerPool(1) as pool:
        exc = _caught(pool.submit(user_function, 3).result, T)
    assert isinstance(exc.__cause__, mpexec.RemoteTraceback)
    assert "_worker.py" in exc.__cause__.tb
    assert "hidden" not in exc.__cause__.tb
