"""Stand-in for ``nose2.tools.params``: one test per value, as pytest parameters."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest


def params(*values: Any) -> Callable[[Callable[..., Any]], Any]:
    """Run the test once per value, given as its first argument."""

    def decorate(test: Callable[..., Any]) -> Any:
        first = next(iter(inspect.signature(test).parameters))
        ids = [f"{i}-{getattr(v, '__name__', v)}" for i, v in enumerate(values)]
        return pytest.mark.parametrize(first, values, ids=ids)(test)

    return decorate
