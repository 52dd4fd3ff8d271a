"""What every pool's ``submit_call`` checks first, the same on each (WorkerPool, RayPool)."""

from __future__ import annotations

from typing import Any


def call_arguments(fn: object, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The call's keyword arguments (``{}`` for None), once ``fn`` is known callable.

    Raises TypeError, named after ``submit`` (what a user called), for anything else.
    """
    if not callable(fn):
        raise TypeError(f"submit() needs a callable, not {type(fn).__name__}")
    return {} if kwargs is None else kwargs
