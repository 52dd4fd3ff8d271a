"""This process's id, kept up to date after ``os.fork()``: a value to read, not a system call.

A pool checks on every call that it runs in the process that made it (a
forked child must be refused, never hang on its parent's workers), and a TF
op's body asks for the default pool on every call. ``os.getpid()`` is a system
call each time (glibc no longer caches it); :data:`pid` is one attribute read.
It is updated by an ``os.register_at_fork`` hook in the child, which runs for
every ``os.fork()`` (``multiprocessing``'s fork and forkserver starts too), and
before mpexec's other fork hooks, which are registered later (hooks run in
order): the modules that register one import this first. A child made by a
raw ``fork(2)`` that no Python hook sees (a C extension's) would read its
parent's id; it runs no Python code of ours unless it calls into Python, which
an extension that forks without telling Python does not support anyway.

Read it as ``_pid.pid`` (the module's attribute), never ``from ._pid import pid``:
that copy would keep the parent's id in a child.
"""

from __future__ import annotations

import os

__all__ = ["pid"]

pid = os.getpid()


def _forked() -> None:
    global pid
    pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
