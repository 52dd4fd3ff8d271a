"""Stand-in for ``nose.tools``: ``nottest`` (not a test, whatever its name) and ``raises``."""

from __future__ import annotations

from typing import Any

from nose_utils import raises

__all__ = ["nottest", "raises"]


def nottest(function: Any) -> Any:
    """Mark ``function`` as not a test: pytest does not collect it."""
    function.__test__ = False
    return function
