"""The exceptions mpexec raises, in one tree.

::

    MpexecError
    ├── BrokenPoolError            (also concurrent.futures.BrokenExecutor); a worker
    │   │                          whose worker_init raised: also an instance of what it
    │   │                          raised (``except ValueError`` catches it, as in torch)
    │   ├── WorkerCrashedError     a worker died: pid, signal, likely cause
    │   └── NodeLostError          a RayPool lost every node it ran on
    ├── PoolClosedError            you shut the pool down, then used it
    │   └── ForkedPoolError        a pool or pipeline inherited through os.fork()
    ├── MainModuleError            (also RuntimeError) a pool created while multiprocessing
    │                              re-ran a parent's main module: the guard is needed there
    ├── TaskTimeoutError           (also TimeoutError) a call ran past its limit
    ├── LoaderTimeoutError         (also TimeoutError, RuntimeError) a loader's timeout passed
    ├── SerializationError         a function, argument or result cannot be pickled
    ├── OpOutputError              (also ValueError) an op returned what it may not
    ├── OpArgumentError            (also ValueError, RuntimeError) an op's arguments disagree
    │                              (more output_layouts than outputs, ...): DALI's RuntimeError
    ├── ConditionalError           (also ValueError, RuntimeError) an `if` on a DataNode that
    │                              DALI's conditional execution refuses too
    ├── GpuUnavailableError        (also RuntimeError) device='gpu' without CuPy, driver or device
    ├── GpuError                   (also RuntimeError) the GPU stage itself failed (copy, close)
    ├── ResourceLimitError         (also OSError) a limit of this process is too low
    └── InputMutatedError          (also RuntimeError) debug mode: a function wrote to an input

"Something outside broke it" (:class:`BrokenPoolError`) is kept apart from "you
closed it" (:class:`PoolClosedError`). A user's own exception is never wrapped:
it is re-raised as its own type, with the worker's traceback attached as
``__cause__`` (a :class:`RemoteTraceback`).

Every class reports ``__module__ = "mpexec"`` so that it prints and pickles
under its public name, which matters because exceptions cross processes.
"""

from __future__ import annotations

import copy
import os
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


class NodeLostError(BrokenPoolError):
    """Every agent of a :class:`mpexec.ray.RayPool` died; ``nodes`` lists their node ids.

    A pool that loses some of its nodes runs their calls again on the others;
    this is raised only when none is left.
    """

    def __init__(self, message: str, nodes: list[str] | None = None) -> None:
        super().__init__(message)
        self.nodes = list(nodes or ())

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.nodes))


class PoolClosedError(MpexecError, RuntimeError):
    """The pool was shut down; it accepts no more work."""


class MainModuleError(MpexecError, RuntimeError):
    """Workers were asked for while multiprocessing re-ran a parent's main module.

    mpexec's own workers never import the caller's ``__main__``; processes
    started by other code with ``spawn`` or ``forkserver`` do, and a pool
    created at import time would be created again in each of them.
    """


class ForkedPoolError(PoolClosedError):
    """A pool (or pipeline) was used in a process forked from the one that made it.

    Its workers, rings and memory belong to the parent; a child that touched
    them would corrupt the parent's pool. Make a new pool in the child.
    """


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


class OpArgumentError(MpexecError, ValueError, RuntimeError):
    """An op's arguments disagree with each other (more ``output_layouts`` than outputs).

    Raised when the op is defined. Also a ``RuntimeError``: what DALI raises for
    the same arguments (from its backend), so ported ``except`` clauses still hold.
    """


class ConditionalError(MpexecError, ValueError, RuntimeError):
    """An ``if`` (or ``and``/``or``/``not``) on a DataNode that cannot be run per sample.

    With ``enable_conditionals=True``: a variable set in one branch only and
    used after the ``if``, branches that set a variable to different
    structures or dtypes, a predicate that is not a scalar bool per sample, a
    ``return`` in one branch only. DALI refuses the same, with a
    ``RuntimeError`` or a ``ValueError`` (by case): this is both, so ported
    ``except`` clauses still hold.
    """


class GpuUnavailableError(MpexecError, RuntimeError):
    """A GPU op was defined where CuPy, a CUDA driver or the device is missing."""


class GpuError(MpexecError, RuntimeError):
    """The GPU stage failed outside a user function (a copy, a registration, close).

    A CUDA error or device out-of-memory raised *inside* a user function is
    re-raised as its own type (CuPy's), with the op and sample attached, as any
    user exception is.
    """


class InputMutatedError(MpexecError, RuntimeError):
    """``debug=True`` found an input whose bytes a function changed in place."""


class ResourceLimitError(MpexecError, OSError):
    """A limit of this process (open files) is too low for what was asked.

    Raised before anything starts; ``errno`` is the one the limit would have
    caused (``EMFILE``), and the message names the limit and how to raise it.
    """


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def forked_error(owner_pid: int, what: str) -> ForkedPoolError:
    """The error for using, in a forked child, ``what`` made by process ``owner_pid``."""
    return ForkedPoolError(
        f"{what} belongs to process {owner_pid}; this process ({os.getpid()}) inherited "
        "it through os.fork() and cannot use it: its workers, rings and shared memory "
        "are the parent's, which goes on using them. Make a new WorkerPool (or "
        "pipeline) in the child, or start children with the 'spawn' or 'forkserver' "
        "method (a prefork server: create the pool after the fork, e.g. in gunicorn's "
        "post_fork hook)"
    )


#: Per type a worker_init raised: the BrokenPoolError that is one of those too.
_start_errors: dict[type[BaseException], type[BrokenPoolError]] = {}


def start_error(message: str, exc: BaseException) -> BrokenPoolError:
    """A worker could not start because its ``worker_init`` raised ``exc``.

    A :class:`BrokenPoolError` (the pool is broken) that is also an instance of
    ``exc``'s type, so that code written for torch's loader, which re-raises
    the original exception, still catches it (``except ValueError:``). It prints
    and pickles as ``mpexec.BrokenPoolError``. A type that cannot be combined
    (an exception of mpexec's own, a layout conflict, ``BaseException``
    subclasses such as ``KeyboardInterrupt``) gives a plain BrokenPoolError.
    """
    return _combined(type(exc))(message)


def _combined(kind: type[BaseException]) -> type[BrokenPoolError]:
    cls = _start_errors.get(kind)
    if cls is None:
        cls = BrokenPoolError
        if issubclass(kind, Exception) and not issubclass(kind, MpexecError):
            try:
                cls = type(
                    "BrokenPoolError",
                    (BrokenPoolError, kind),
                    {
                        "__module__": "mpexec",
                        "__qualname__": "BrokenPoolError",
                        # Neither the user's __init__ nor __str__: just the message.
                        "__init__": _message_init,
                        "__str__": BaseException.__str__,
                        "__reduce__": _start_error_reduce,
                    },
                )
            except TypeError:  # instance lay-out conflict, or a final class
                cls = BrokenPoolError
        _start_errors[kind] = cls
    return cls


def _message_init(self: BaseException, message: str) -> None:
    BaseException.__init__(self, message)


def _start_error_reduce(self: BaseException) -> tuple[object, ...]:
    kind = type(self).__bases__[1]
    return (_start_error_again, (kind, str(self)))


def _start_error_again(kind: type[BaseException], message: str) -> BrokenPoolError:
    """Unpickling :func:`start_error`'s exception: the same combined type again."""
    return _combined(kind)(message)


def raised_again(stored: BaseException) -> BaseException:
    """A new exception like ``stored`` (a broken pool's error), which is its ``__cause__``.

    What a broken pool (WorkerPool or RayPool) raises on every later call:
    raising the stored object itself would add the caller's frames to its
    ``__traceback__`` each time, keeping every failed caller's frames (and
    their arrays) alive for as long as the pool lives (``ProcessPoolExecutor``
    raises a new ``BrokenProcessPool`` each time too).
    """
    try:
        err = copy.copy(stored)  # its type, message and fields (pid, exit code, nodes)
    except Exception:  # pragma: no cover - our errors all copy; a stranger might not
        err = BrokenPoolError(str(stored))
    err.__traceback__ = None
    err.__context__ = None
    err.__cause__ = stored
    return err


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
    NodeLostError,
    PoolClosedError,
    MainModuleError,
    ForkedPoolError,
    TaskTimeoutError,
    LoaderTimeoutError,
    SerializationError,
    OpOutputError,
    OpArgumentError,
    ConditionalError,
    InputMutatedError,
    GpuUnavailableError,
    GpuError,
    ResourceLimitError,
    RemoteTraceback,
):
    _cls.__module__ = "mpexec"
