"""The Ctrl-C sweeps' profile function never lands an interrupt on its own arming.

``InterruptAt`` counts the events after ``sys.setprofile(interrupt)``. On CPython
3.12+, once a thread has ended with a profile function set, the profile events
stay on, and the next ``sys.setprofile(f)`` reports its own return to ``f``.
Counted, that return was event 1: the sweep's interrupt landed in the test's own
frame, outside the code under test, and pytest-xdist lost the whole worker (the
release sweep, run after tests/pool/test_pool_calls.py, on 3.13 in CI).
"""

from __future__ import annotations

import sys
import threading

from tests.conftest import InterruptAt


def _armed_call(interrupt: InterruptAt) -> None:
    # A function of its own, entered after the thread ended: its code is
    # instrumented for the events left on (the case of a test's first sweep).
    sys.setprofile(interrupt)
    try:
        len(())  # the first event the sweep may count: this C call's return
    finally:
        sys.setprofile(None)


def test_the_first_event_counted_is_the_code_under_tests() -> None:
    thread = threading.Thread(target=sys.setprofile, args=(lambda *a: None,))
    thread.start()
    thread.join()  # it ends with a profile function set
    interrupt = InterruptAt(1)
    try:
        _armed_call(interrupt)
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)  # (turns the events left on off, for the tests after)
    assert interrupt.where.startswith("c_return _armed_call len"), interrupt.where
