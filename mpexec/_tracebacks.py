"""Tracebacks that show the user's code: mpexec's own frames hidden, and said so.

A user function's exception crosses a process boundary as text (the worker's
traceback, the ``__cause__`` of the exception re-raised in the caller). Its
frames between the worker's loop and the user's function are mpexec's own
and tell a user nothing, so they are left out, and one line says how many,
as pytest cuts its own frames from a failure's report. Where the exception
was raised in mpexec itself, every frame is kept: then they are the story.
``MPEXEC_FULL_TRACEBACK=1`` keeps every frame everywhere.

In the caller, the functions that re-raise a user's exception set
``__tracebackhide__`` (pytest and IPython leave such frames out too) and
raise it from their own frame, not from deep in the scheduler.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from pathlib import Path

__all__ = ["FULL_TRACEBACK_ENV", "format_exception", "is_internal"]

#: Set to 1 to see mpexec's own frames in every traceback.
FULL_TRACEBACK_ENV = "MPEXEC_FULL_TRACEBACK"

#: The folders of mpexec's own code: the policy package and the shm mechanism.
_HERE = Path(__file__).resolve().parent
_OURS = tuple(str(p) + os.sep for p in (_HERE, _HERE.parent / "shm"))


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

    def format(self) -> list[str]:
        lines = super().format()
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


def format_exception(exc: BaseException) -> str:
    """``exc`` with its traceback (and chained exceptions), mpexec's frames hidden."""
    te = traceback.TracebackException.from_exception(exc)
    if os.environ.get(FULL_TRACEBACK_ENV, "") not in ("", "0"):
        return "".join(te.format())
    for t in _chain(te):
        _trim(t)
    return "".join(te.format())
