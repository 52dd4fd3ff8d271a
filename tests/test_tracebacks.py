"""Tracebacks that show the user's code, with mpexec's own frames hidden (and counted)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

import mpexec
from mpexec import _tracebacks

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
