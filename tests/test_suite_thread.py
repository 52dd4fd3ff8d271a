"""The suite runs its tests on the main thread, under pytest-xdist too.

Tests of what mpexec does on the main thread (a Ctrl-C's reach, who reads a
worker's answer: ``_delivery.read_call`` never reads directly there) hold only
there. pytest-xdist before 3.6 could start a worker's session off the main
thread, now and then under load (execnet's thread model): those tests then
failed at random (tox's ``oldest`` env, pinned to 3.3, in a loaded CI run).
pyproject.toml's ``test`` extra asks for 3.6.1 or later; this says at once
when a runner breaks that again.
"""

from __future__ import annotations

import threading


def test_this_test_runs_on_the_main_thread() -> None:
    assert threading.current_thread() is threading.main_thread(), (
        f"the test ran on {threading.current_thread().name}, not the main thread: "
        "pytest-xdist >= 3.6.1 runs a worker's tests on its main thread"
    )
