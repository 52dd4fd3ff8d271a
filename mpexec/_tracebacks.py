"""Tracebacks that show the user's code: mpexec's own frames hidden, and said so.

A user function's exception crosses a process boundary as text (the worker's
traceback, the ``__cause__`` of the exception re-raised in the caller). Its
frames between the worker's loop and the user's function are mpexec's own
and tell a user nothing, so they are left out, and one line says how many,
as pytest cuts its own frames from a failure's report. Where the exception
was raised in mpexec itself, every frame is kept: then they are the story.
``MPEXEC_FULL_TRACEBACK=1`` keeps every frame everywhere.

In the caller, the functions that re-raise a user's exception (a pool
future's ``result()``, ``map()``, a pipeline's ``run()``, the torch
``DataLoader``'s ``next()`` and ``iter()``) set
``__tracebackhide__`` (pytest leaves such frames out too) and raise it with
:func:`for_caller`: from their own frame, with the traceback of where it was
raised below (less mpexec's frames), not the path it took through the pool
or the scheduler. The same exception raised again (a broken pool's stored
error) gets that traceback again, not one that grows with every raise.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import pickle
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypeVar

import cloudpickle

from ._errors import RemoteTraceback, SerializationError

__all__ = [
    "FULL_TRACEBACK_ENV",
    "for_caller",
    "format_exception",
    "full_tracebacks",
    "is_internal",
    "pack_error",
    "reraise",
    "unpack_error",
]

E = TypeVar("E", bound=BaseException)

#: Set to 1 to see mpexec's own frames in every traceback.
FULL_TRACEBACK_ENV = "MPEXEC_FULL_TRACEBACK"

#: The folders of mpexec's own code: the policy package and the shm mechanism.
_HERE = Path(__file__).resolve().parent
_OURS = tuple(str(p) + os.sep for p in (_HERE, _HERE.parent / "shm"))


#: The marker of a frame that re-raises (pytest's name for it).
_HIDE = "__tracebackhide__"
#: concurrent.futures' ``Future.result`` raises the stored exception from here.
_FUTURES = str(Path(concurrent.futures.__file__).resolve().parent) + os.sep


@functools.lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    """Whether ``filename`` is a file of mpexec (or of its ``shm`` package)."""
    try:
        path = str(Path(filename).resolve())
    except (OSError, RuntimeError):
        return False
    return path.startswith(_OURS)


class _Trimmed(traceback.StackSummary):
    """A stack less mpexec's frames, whose formatting says how many were left out."""

    hidden = 0

    def format(self, **kwargs: Any) -> list[str]:  # 3.13 passes colorize=
        lines = super().format(**kwargs)
        if self.hidden:
            s = "" if self.hidden == 1 else "s"
            lines.insert(
                0,
                f"  [{self.hidden} frame{s} of mpexec hidden; {FULL_TRACEBACK_ENV}=1 shows them]\n",
            )
        return lines


def _trim(te: traceback.TracebackException) -> None:
    stack = list(te.stack)
    if not stack or is_internal(stack[-1].filename):
        return  # raised in mpexec itself: its frames are the story
    kept = [f for f in stack if not is_internal(f.filename)]
    trimmed = _Trimmed(kept)  # (from_list would make a plain StackSummary)
    trimmed.hidden = len(stack) - len(kept)
    te.stack = trimmed


def _chain(te: traceback.TracebackException) -> Iterator[traceback.TracebackException]:
    """``te`` and every exception chained to it (causes, contexts, group members)."""
    seen: set[int] = set()
    todo = [te]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        yield t
        todo += [c for c in (t.__cause__, t.__context__) if c is not None]
        todo += list(getattr(t, "exceptions", None) or ())


def full_tracebacks() -> bool:
    """Whether ``MPEXEC_FULL_TRACEBACK`` asks for every frame (read each time)."""
    return os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0")


def for_caller(exc: E) -> E:
    """``exc``, its traceback cut to where it was raised, less mpexec's frames.

    For a site that re-raises a call's exception in the caller (it sets
    ``__tracebackhide__``): the frames above the deepest such site are the
    path of an earlier raise of the same exception, and the frames of
    ``concurrent.futures`` just below it are ``Future.result()`` raising the
    stored exception; both are dropped. Of the rest, mpexec's own frames go
    unless mpexec itself raised the exception (its last frame is mpexec's),
    or ``MPEXEC_FULL_TRACEBACK=1``. A worker's exception has no frames left:
    its traceback is the ``__cause__``.
    """
    entries: list[TracebackType] = []
    tb = exc.__traceback__
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    start = 0
    for i, entry in enumerate(entries):
        if _HIDE in entry.tb_frame.f_code.co_varnames:
            start = i + 1
    if start:
        while start < len(entries) and _in_futures(entries[start]):
            start += 1
    origin = entries[start:]
    if origin and not full_tracebacks() and not is_internal(_filename(origin[-1])):
        origin = [e for e in origin if not is_internal(_filename(e))]
    if len(origin) == len(entries) - start:  # nothing dropped in between: reuse the tail
        return exc.with_traceback(entries[start] if origin else None)
    linked: TracebackType | None = None
    for e in reversed(origin):
        linked = TracebackType(linked, e.tb_frame, e.tb_lasti, e.tb_lineno)
    return exc.with_traceback(linked)


def reraise(exc: BaseException) -> NoReturn:
    """Raise a stored exception (a call's, kept for later) as a re-raise site.

    The frames above this one are the path it is raised along now, not where
    it was raised first: :func:`for_caller` leaves them out.
    """
    __tracebackhide__ = True
    raise exc


def _filename(entry: TracebackType) -> str:
    return entry.tb_frame.f_code.co_filename


@functools.lru_cache(maxsize=4096)
def _in_futures_file(filename: str) -> bool:
    try:
        return str(Path(filename).resolve()).startswith(_FUTURES)
    except (OSError, RuntimeError):
        return False


def _in_futures(entry: TracebackType) -> bool:
    return _in_futures_file(_filename(entry))


def format_exception(exc: BaseException) -> str:
    """``exc`` with its traceback (and chained exceptions), mpexec's frames hidden."""
    te = traceback.TracebackException.from_exception(exc)
    if full_tracebacks():
        return "".join(te.format())
    for t in _chain(te):
        _trim(t)
    return "".join(te.format())


def pack_error(exc: BaseException) -> bytes:
    """A worker's exception and its traceback as text; a stand-in if it does not pickle.

    :func:`unpack_error` makes the exception the caller sees from it.
    """
    tb = format_exception(exc)  # mpexec's own frames left out (and counted)
    exc.__traceback__ = None
    try:
        try:
            data = pickle.dumps((exc, tb), protocol=5)
        except Exception:
            # A class defined in the caller's __main__ (which workers never
            # import) goes by value; cloudpickle brings back the caller's own.
            data = cloudpickle.dumps((exc, tb), protocol=5)
        pickle.loads(data)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        name = f"{type(exc).__module__}.{type(exc).__qualname__}"
        stand_in = SerializationError(
            f"the function raised {name}: {exc}; that exception cannot be pickled, so it "
            "is reported as this error (the worker's traceback is the __cause__)"
        )
        data = pickle.dumps((stand_in, tb), protocol=5)
    return bytes(data)


def unpack_error(data: bytes | memoryview) -> BaseException:
    """The exception :func:`pack_error` packed, the worker's traceback its ``__cause__``."""
    exc, tb = pickle.loads(data)
    exc.__cause__ = RemoteTraceback(tb)
    return exc  # type: ignore[no-any-return]
