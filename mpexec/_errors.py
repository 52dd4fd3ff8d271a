"""The exceptions mpexec raises, in one tree.

::

    MpexecError
    ├── BrokenPoolError            (also concurrent.futures.BrokenExecutor)
    │   └── WorkerCrashedError     a worker died: pid, signal, likely cause
    ├── PoolClosedError            you shut the pool down, then used it
    ├── TaskTimeoutError           (also TimeoutError) a call ran past its limit
    ├── LoaderTimeoutError         (also TimeoutError, RuntimeError) a loader's timeout passed
    ├── SerializationError         a function, argument or result cannot be pickled
    ├── OpOutputError              (also ValueError) an op returned what it may not
    └── InputMutatedError          (also RuntimeError) debug mode: a function wrote to an input

"Something outside broke it" (:class:`BrokenPoolError`) is kept apart from "you
closed it" (:class:`PoolClosedError`). A user's own exception is never wrapped:
it is re-raised as its own type, with the worker's traceback attached as
``__cause__`` (a :class:`RemoteTraceback`).

Every class reports ``__module__ = "mpexec"`` so that it prints and pickles
under its public name, which matters because exceptions cross processes.
"""

from __future__ import annotations

import signal
from concurrent.futures import BrokenExecutor


class MpexecError(Exception):
    """Base class of every exception mpexec defines."""


class BrokenPoolError(MpexecError, BrokenExecutor):
    """The pool can run nothing more: a worker died, or failed to start."""


class WorkerCrashedError(BrokenPoolError):
    """A worker process died while it held tasks.

    ``pid`` and ``exitcode`` name the process and how it ended (a negative
    exit code is a signal); ``signal_name`` decodes it (``"SIGSEGV"``), and
    ``cause`` is a sentence on what probably happened.
    """

    def __init__(
        self, message: str, pid: int = 0, exitcode: int | None = None, cause: str = ""
    ) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.cause = cause

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        return signal_name(-self.exitcode)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.pid, self.exitcode, self.cause))


class PoolClosedError(MpexecError, RuntimeError):
    """The pool was shut down; it accepts no more work."""


class TaskTimeoutError(MpexecError, TimeoutError):
    """A call ran longer than the pool's ``timeout``; its worker was replaced."""


class LoaderTimeoutError(MpexecError, TimeoutError, RuntimeError):
    """A loader waited longer than its ``timeout`` for a batch.

    Also a ``RuntimeError``: what ``torch.utils.data.DataLoader`` raises then.
    """


class SerializationError(MpexecError, TypeError):
    """An object cannot be pickled (or unpickled); the message says where it sits."""


class OpOutputError(MpexecError, ValueError):
    """An op's function returned something its declaration does not allow."""


class InputMutatedError(MpexecError, RuntimeError):
    """``debug=True`` found an input whose bytes a function changed in place."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def signal_name(signum: int) -> str:
    """``"SIGSEGV"`` for 11; ``"signal 99"`` for a number with no name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


for _cls in (
    MpexecError,
    BrokenPoolError,
    WorkerCrashedError,
    PoolClosedError,
    TaskTimeoutError,
    LoaderTimeoutError,
    SerializationError,
    OpOutputError,
    InputMutatedError,
    RemoteTraceback,
):
    _cls.__module__ = "mpexec"
