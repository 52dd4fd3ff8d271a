"""The loader's pool: started as torch starts its workers, stopped as torch stops them.

Runs in the caller. :func:`start_pool` starts an epoch's (or the persistent
workers') ``WorkerPool`` with the worker setup of ``_fetch``; :func:`close_pool`
ends it, in a thread of its own when an iterator is dropped; and
:class:`WorkerProcess` is what torch's ``it._workers`` lists.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
import threading
import time
import weakref
from multiprocessing import connection as _mp_connection
from typing import Any

import torch

from .. import _launch
from .._host import cuda_initialised, default_start_method
from .._pool import WorkerPool
from . import _compat, _fetch

__all__ = ["WorkerProcess", "close_pool", "processes", "signal_text", "start_method", "start_pool"]

#: The pool's own arena carries only the batches' indices to the workers:
#: reserved (committed) memory the default 64 MiB would waste (it grows if needed).
_ARGS_ARENA = 1 << 20
#: Each worker's arena starts this size (committed at once) and grows by a
#: segment per batch that does not fit: batches of a few MiB fit; larger
#: ones (the ones that matter) get segments their size.
_WORKER_ARENA = 8 << 20
#: Seconds a worker gets to finish its batch when an epoch is stopped (torch's 5).
_STOP_GRACE = 5.0
#: A worker's exit code after a SIGTERM (its handler unlinks its segments, then
#: exits so: ``mpexec._worker.main``).
_SIGTERM_EXIT = 128 + signal.SIGTERM
#: Each pool's "the loader is stopping it" flag, shared with its WorkerProcess
#: objects (which outlive the pool): a SIGTERM its workers get then is the loader's.
_stop_flags: weakref.WeakKeyDictionary[WorkerPool, list[bool]] = weakref.WeakKeyDictionary()


def _stop_flag(pool: WorkerPool) -> list[bool]:
    return _stop_flags.setdefault(pool, [False])


def start_pool(config: _fetch.WorkerConfig, start_method: str) -> WorkerPool:
    """Workers set up as torch's: under fork they inherit the config, else it travels with them.

    Forked workers take the config (the dataset above all) from the memory
    they inherit, as torch's do: nothing is pickled, pages stay shared. Spawned
    and fork-server workers get it pickled as multiprocessing pickles a
    Process's arguments (so a ``multiprocessing.Value`` or ``Semaphore`` in
    the dataset works, as in torch), with functions and classes by value.
    """
    _preload_torch(start_method)
    fork = start_method == "fork"
    handoff: contextlib.AbstractContextManager[Any] = (
        _fetch.registered(config)
        if fork
        else _launch.sending(config, "the DataLoader's dataset and worker setup")
    )
    with handoff as key:
        return WorkerPool(
            config.num_workers,
            start_method=start_method,
            worker_init=_fetch.start_worker,
            worker_init_args=(key,),
            arena_size=_ARGS_ARENA,
            worker_arena_size=_WORKER_ARENA,
            # Forked, the first batch goes to the first worker up, as torch's does, not
            # once the last has started (each fork of a process with torch in it takes
            # ~5 ms). Every worker has forked when this returns.
            ready="first" if fork else "all",
        )


def start_method(context: Any) -> str:
    """How the workers start: the ``multiprocessing_context``'s way, else torch's default.

    torch starts a DataLoader's workers with multiprocessing's default method
    (``fork`` on Linux before Python 3.14), from the caller: they share the
    caller's pages (torch, the dataset) instead of holding copies. Once CUDA
    is initialised here, by any library (torch, CuPy, JAX), the default is
    mpexec's (a fork server) instead: a forked child cannot use CUDA.
    """
    if context is not None:
        return str(context.get_start_method())
    method = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
    if method == "fork" and (torch.cuda.is_initialized() or cuda_initialised()):
        return default_start_method()
    return method


def _preload_torch(start_method: str | None) -> None:
    """Have mpexec's fork server import torch once, so that workers start in milliseconds.

    A worker forked from the server inherits its modules; without this, each
    worker of each epoch imports torch itself (seconds on a busy machine).
    The user's own (standard) fork server is left alone.
    """
    if (start_method or default_start_method()) == "forkserver":
        _launch.preload("torch")


def close_pool(pool: WorkerPool, tasks: dict[int, Any], background: bool) -> None:
    """An epoch's end: batches not started are cancelled, prefetched ones dropped, workers stopped.

    As torch's iterator does, a worker gets a grace (5 s) to finish the batch
    it is making and exit by itself (exit code 0), and is terminated after.
    Called as the iterator's finalizer (``background``), the waiting happens
    in a thread of its own: dropping an iterator never blocks.
    """
    tasks.clear()
    if background:
        threading.Thread(
            target=_stop_pool, args=(pool,), name="mpexec-loader-stop", daemon=True
        ).start()
    else:
        _stop_pool(pool)


def _stop_pool(pool: WorkerPool) -> None:
    # Calls not started are cancelled; the ones running get the grace, then
    # their workers are terminated (and the calls fail, unread).
    _stop_flag(pool)[0] = True
    pool.shutdown(wait=True, cancel_futures=True, grace=_STOP_GRACE)


def processes(pool: WorkerPool) -> list[WorkerProcess]:
    """The pool's worker processes, by worker index (what torch's ``it._workers`` lists)."""
    stopped = _stop_flag(pool)
    return [WorkerProcess(process, stopped) for process in pool.processes]


class WorkerProcess:
    """A worker's ``multiprocessing.Process``, still readable once the pool has closed it.

    The pool joins and closes its processes when it shuts down; torch's
    ``it._workers`` are Process objects that code reads afterwards (``pid``,
    ``exitcode``, ``join()``, ``is_alive()``, ``terminate()``).

    A worker stopped by its parent exits 0, as torch's do: torch's worker
    exits 0 on a SIGTERM from its parent (its C handler), which is what a
    worker past the stop's grace gets, and what ``terminate()`` here sends.
    Ours exits ``128 + SIGTERM`` on any SIGTERM (a Python handler cannot see
    the sender): read as 0 when this loader stopped its pool (``stopped[0]``)
    or this object terminated it.
    """

    def __init__(self, process: Any, stopped: list[bool] | None = None) -> None:
        self._process = process
        self.pid: int = process.pid
        self.name: str = process.name
        # multiprocessing's: it keeps the exit code after the pool's Process.close().
        self._handle = _compat.process_popen(process)
        self._stopped = stopped or [False]
        self._terminated = False

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(ValueError):  # closed: joined already
            self._process.join(timeout)
        self._settle()

    @property
    def exitcode(self) -> int | None:
        code = self._poll()
        if code is None and self._exited():
            code = self._settle()
        return self._as_torchs(code)

    def _as_torchs(self, code: int | None) -> int | None:
        """``code``, with a SIGTERM this loader sent read as torch's worker exits on one, 0."""
        if code == _SIGTERM_EXIT and (self._terminated or self._stopped[0]):
            return 0
        return code

    def _poll(self) -> int | None:
        try:
            return self._process.exitcode  # type: ignore[no-any-return]
        except ValueError:  # closed after it exited
            return self._handle.returncode  # type: ignore[no-any-return]

    def _exited(self) -> bool:
        """Its sentinel says it is gone (or the pool closed it, having reaped it)."""
        try:
            return bool(_mp_connection.wait([self._process.sentinel], 0))
        except (ValueError, OSError):
            return True

    def _settle(self) -> int | None:
        """The exit code of a process that is gone, once whoever reaps it has stored it.

        The pool's stop thread may be reaping it at this very moment: then
        multiprocessing's ``poll()`` here gets ECHILD from ``waitpid`` and
        says "still running" until that thread stores the exit code (it waits
        for the GIL to). Bounded: after 5 s, whatever ``poll()`` says.
        """
        deadline = time.monotonic() + 5.0
        code = self._poll()
        while code is None and self._exited() and time.monotonic() < deadline:
            time.sleep(0.001)  # lets the reaping thread run
            code = self._poll()
        return code

    def terminate(self) -> None:
        self._terminated = True
        with contextlib.suppress(ValueError):  # closed: nothing left to stop
            self._process.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ValueError):
            self._process.kill()

    def __repr__(self) -> str:
        return f"<DataLoader worker {self.name} pid={self.pid} exitcode={self.exitcode}>"


def signal_text(signum: int) -> str:
    """A signal's name for a person (``Segmentation fault``), or its number."""
    try:
        return signal.strsignal(signum) or f"signal {signum}"
    except ValueError:
        return f"signal {signum}"
