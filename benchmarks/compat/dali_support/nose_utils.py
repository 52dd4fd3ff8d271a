"""Stand-in for ``raises`` and ``with_setup`` of DALI's ``nose_utils``."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable
from typing import Any


def _pattern(glob: str | None, regex: str | None, match_case: bool | None) -> re.Pattern[str]:
    if glob is not None:
        text = fnmatch.translate(glob)
        text = text.removesuffix(r"\Z")  # searched anywhere in the message, as DALI does
    else:
        assert regex is not None
        text = regex
    return re.compile(text, 0 if match_case else re.IGNORECASE)


def raises(
    exception: type[BaseException] | tuple[type[BaseException], ...],
    glob: str | None = None,
    regex: str | None = None,
    match_case: bool | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The test passes only if it raises ``exception`` whose ``str()`` matches the pattern
    (a glob by default, case-insensitive, anywhere in the message)."""

    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(test)
        def run(*args: Any, **kwargs: Any) -> None:
            try:
                test(*args, **kwargs)
            except exception as exc:
                if glob is None and regex is None:
                    return
                if not _pattern(glob, regex, match_case).search(str(exc)):
                    raise AssertionError(
                        f"{type(exc).__name__} raised, but its message does not match "
                        f"{glob or regex!r}: {exc}"
                    ) from exc
                return
            raise AssertionError(f"{test.__name__} did not raise {exception}")

        return run

    return decorate


def with_setup(
    setup: Callable[[], Any] | None = None, teardown: Callable[[], Any] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """nose's ``with_setup``: ``setup`` before the test and ``teardown`` after it (also
    around each case a test generator yields: the runner's plugin calls them)."""

    def decorate(test: Callable[..., Any]) -> Callable[..., Any]:
        if setup is not None:
            test.setup = setup  # type: ignore[attr-defined]
        if teardown is not None:
            test.teardown = teardown  # type: ignore[attr-defined]
        return test

    return decorate
