"""Starting worker processes that never run the caller's ``__main__``.

multiprocessing's spawn and forkserver start a child by sending it
*preparation data*, then the pickled ``Process``. The preparation data names
the parent's main module (``init_main_from_path`` for ``python script.py``,
``init_main_from_name`` for ``python -m pkg.mod``) and the child runs that
module as ``__mp_main__`` before anything else, so that objects pickled by
reference to ``__main__`` can be found there; the standard fork server runs it
once more, as a preload. A script that creates a pool at module level thus
creates one again in every child, which multiprocessing refuses ("...before the
current process has finished its bootstrapping phase"): hence the
``if __name__ == "__main__":`` guard that multiprocessing, DALI and PyTorch's
DataLoader ask for.

mpexec's workers need nothing from ``__main__``: functions, and the classes of
arguments and results defined there, travel by value (cloudpickle). So:

- the preparation data we send leaves the main module out (``sys.path``, the
  working directory, ``sys.argv`` and the authkey still go);
- under forkserver, workers fork from mpexec's own fork server, which preloads
  mpexec instead of ``__main__`` (the standard server stays the user's);
- the ``Process`` a child unpickles is a standard-library one whose target is
  a few lines of standard-library code (:data:`_BOOTSTRAP`). Importing mpexec
  and loading the worker's arguments happen inside it, so their failure (a
  broken environment, a module missing on the workers' ``sys.path``) is
  caught and its traceback sent back through a pipe, to be raised by the pool
  instead of being printed behind an exit code.

A value can travel with the workers being started (:func:`sending`): it is
pickled, like a ``Process``'s own arguments, while the child-to-be is exposed,
so that multiprocessing's objects in it (a ``Value``, a ``Lock``, a
``Semaphore``: what PyTorch's DataLoader workers receive in their dataset) go
as they go to a Process of multiprocessing's, by name or by a passed fd;
functions and classes go by value (cloudpickle).

``fork`` copies the parent, runs no main module, and needs none of this. What
still needs the guard: the *user's own* spawn or forkserver children (their
multiprocessing, a PyTorch DataLoader...) run the main module, and a pool
created there is refused with :class:`MainModuleError`.
"""

from __future__ import annotations

import collections
import contextlib
import copyreg
import io
import itertools
import multiprocessing as mp
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from multiprocessing import (
    forkserver,
    popen_forkserver,
    popen_spawn_posix,
    process,
    reduction,
    spawn,
    util,
)
from typing import Any, ClassVar

import cloudpickle

from ._codec import describe_unpicklable
from ._errors import BrokenPoolError, MainModuleError, RemoteTraceback, SerializationError

#: The main-module entries of multiprocessing's preparation data.
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")

#: What a spawn or forkserver child runs: the names ``payload`` (the pickled
#: target, args and kwargs) and ``report`` (an fd stand-in) are given. Standard
#: library only, so that it runs whatever state the environment is in.
_BOOTSTRAP = """\
import os, pickle, sys, traceback
fd = report.detach()
try:
    target, args, kwargs = pickle.loads(payload)
except BaseException:
    with open(fd, "w", encoding="utf-8", errors="replace") as f:
        f.write(traceback.format_exc())
    sys.exit(1)
os.close(fd)
del payload, report, fd
target(*args, **kwargs)
"""

#: Bytes of a start-up traceback the pool reads back at most.
_REPORT_MAX = 1 << 20


def preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a child, without the main module."""
    data: dict[str, Any] = spawn.get_preparation_data(name)
    for key in _MAIN_KEYS:
        data.pop(key, None)
    return data


def _process_data(popen: Any, process_obj: Any) -> io.BytesIO:
    """What a spawned or fork-server child reads first: preparation data, then the process."""
    buf = io.BytesIO()
    mp_context.set_spawning_popen(popen)
    try:
        reduction.dump(preparation_data(process_obj.name), buf)
        reduction.dump(process_obj, buf)
    finally:
        mp_context.set_spawning_popen(None)
    return buf


def check_not_bootstrapping() -> None:
    """Refuse to start workers while multiprocessing re-runs a parent's main module.

    mpexec's workers never do that; the user's own spawn or forkserver
    children do, and a pool created at import time would then be created again
    in each of them.
    """
    if not getattr(process.current_process(), "_inheriting", False):
        return
    main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main module"
    raise MainModuleError(
        f"a WorkerPool (or a pipeline) was created while this process, started by "
        f"multiprocessing, was importing {main} of its parent: that module creates "
        "one at import time. mpexec's own workers never import your main module, but "
        "processes your code starts with the 'spawn' or 'forkserver' method do "
        "(multiprocessing, concurrent.futures.ProcessPoolExecutor, a PyTorch "
        "DataLoader with workers...). Create the pool under "
        'if __name__ == "__main__": in that module, or start those other processes '
        "with the 'fork' method"
    )


class _StartupReport:
    """The read end of the pipe a starting worker writes its failure to."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self._close = weakref.finalize(self, _close_fds, [self.read_fd, self.write_fd])

    def sent(self) -> None:
        """The child has its copy: ours of the write end must go, or EOF never comes."""
        with contextlib.suppress(OSError):
            os.close(self.write_fd)
        self._close.detach()
        self._close = weakref.finalize(self, _close_fds, [self.read_fd])

    def read(self) -> str:
        """What the child wrote (it has exited); closes the pipe."""
        if not self._close.alive:
            return ""
        os.set_blocking(self.read_fd, False)
        chunks: list[bytes] = []
        size = 0
        with contextlib.suppress(OSError):
            while size < _REPORT_MAX:
                chunk = os.read(self.read_fd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        self.close()
        return b"".join(chunks).decode("utf-8", errors="replace")

    def close(self) -> None:
        self._close()


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class _ClosedStaysJoinable:
    """A worker's Process that multiprocessing's exit may still join after the pool closed it.

    The pool closes a worker's Process once it has exited (its fds go). A
    process that multiprocessing started itself (a user's spawn child, a DDP
    rank of ``torch.multiprocessing.spawn``) joins, as it exits, every child
    it listed a moment before, and terminates the daemonic ones: one the
    pool's stop thread closed meanwhile made that raise (``ValueError``,
    ``AttributeError``) and the child exit with code 1. Closed, it keeps its
    (closed) popen, whose exit code makes ``terminate()`` a no-op, and
    ``join()`` returns at once.
    """

    def join(self, timeout: float | None = None) -> None:
        if self._closed:  # type: ignore[attr-defined]  # BaseProcess's
            return
        super().join(timeout)  # type: ignore[misc]

    def close(self) -> None:
        popen = self._popen  # type: ignore[attr-defined]  # BaseProcess's
        super().close()  # type: ignore[misc]
        # Put back in the instance's dict: BaseProcess's attribute, not one of ours.
        vars(self)["_popen"] = popen


class _ForkProcess(_ClosedStaysJoinable, mp_context.ForkProcess):
    pass


class _Bootstrapped(_ClosedStaysJoinable):
    """A Process whose child unpickles only the standard library (see the module doc)."""

    _base: type[process.BaseProcess]
    _report: _StartupReport | None = None
    _target: Any
    _args: Any
    _kwargs: Any

    def start(self) -> None:
        self._report = _StartupReport()
        try:
            super().start()  # type: ignore[misc]
        except BaseException:
            self._report.close()
            raise
        self._report.sent()

    def startup_failure(self) -> str:
        """The traceback of a child that failed to load its target, or ``""``.

        Read once the child has exited; afterwards the pipe is closed.
        """
        return self._report.read() if self._report is not None else ""

    def started(self) -> None:
        """The worker is up: its start-up report will never come."""
        if self._report is not None:
            self._report.close()

    def close(self) -> None:
        super().close()
        self.started()

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Called by multiprocessing while it pickles us for the child, with the
        # child-to-be exposed: fds (ours and those in the args) go to it.
        popen = mp_context.get_spawning_popen()
        if popen is None or self._report is None:
            raise TypeError("a worker process is pickled only to start it")
        state = {k: v for k, v in self.__dict__.items() if k not in ("_report", "_target", "_args")}
        call = (self._target, self._args, self._kwargs)
        values = getattr(_sending, "values", None)
        if values:
            sent = {key: _dump_for_child(value, what) for key, (value, what) in values.items()}
            call = (_run_with, (sent, *call), {})
        payload = bytes(reduction.ForkingPickler.dumps(call))
        report = popen.DupFd(popen.duplicate_for_child(self._report.write_fd))
        state.update(_target=exec, _args=(_BOOTSTRAP, {"payload": payload, "report": report}))
        state["_kwargs"] = {}
        # copyreg's reconstructor (what pickle protocols 0 and 1 use) builds the
        # standard class, which the child can load before mpexec is importable.
        rebuild = copyreg._reconstructor  # type: ignore[attr-defined]  # noqa: SLF001 - see above
        return (rebuild, (self._base, object, None), state)


# ------------------------------------------------------------------ values sent with workers
_sending = threading.local()  # .values: key -> (value, what), for processes this thread starts
_sent_keys = itertools.count()
_received: dict[int, bytes] = {}  # in a worker: what came with it, by key


class Sent:
    """A stand-in for a value sent with the workers being started (see :func:`sending`)."""

    def __init__(self, key: int) -> None:
        self.key = key

    def receive(self) -> Any:
        """In the worker: the value itself, unpickled here (each call, a new copy)."""
        data = _received.get(self.key)
        if data is None:
            raise RuntimeError(
                "this process was not started with the value it expects (mpexec._launch.sending)"
            )
        return cloudpickle.loads(data)


@contextlib.contextmanager
def sending(value: Any, what: str) -> Iterator[Sent]:
    """Send ``value`` with every spawn or fork-server worker this thread starts in the block.

    It is pickled as each process starts, as multiprocessing pickles a
    Process's arguments (see the module docstring); the worker gets it from
    the :class:`Sent` yielded here. A value that cannot be pickled is a
    :class:`SerializationError` naming ``what``, raised by the start.
    """
    values = _sending.__dict__.setdefault("values", {})
    key = next(_sent_keys)
    values[key] = (value, what)
    try:
        yield Sent(key)
    finally:
        del values[key]


class _ChildPickler(cloudpickle.Pickler):  # type: ignore[misc]
    # multiprocessing's own reducers (a SemLock's name, a shared heap's fd) first.
    dispatch_table: ClassVar[collections.ChainMap[Any, Any]] = collections.ChainMap(
        # multiprocessing's reducer registry, which has no public face.
        reduction.ForkingPickler._extra_reducers,  # type: ignore[attr-defined]  # noqa: SLF001
        cloudpickle.Pickler.dispatch_table,
    )


def _dump_for_child(value: Any, what: str) -> bytes:
    buf = io.BytesIO()
    try:
        _ChildPickler(buf, protocol=5).dump(value)
    except Exception as exc:
        raise SerializationError(describe_unpicklable(value, what, exc)) from exc
    return buf.getvalue()


def _run_with(sent: dict[int, bytes], target: Any, args: Any, kwargs: Any) -> None:
    """In a worker: keep what was sent with it, then run the process's target."""
    _received.update(sent)
    target(*args, **kwargs)


class _SpawnPopen(popen_spawn_posix.Popen):
    """The standard spawn Popen, sending preparation data without the main module."""

    _fds: list[int]

    def _launch(self, process_obj: Any) -> None:
        # As multiprocessing.popen_spawn_posix.Popen._launch (3.10 - 3.13), but
        # for the preparation data.
        from multiprocessing import resource_tracker

        tracker_fd: int = resource_tracker.getfd()  # type: ignore[assignment]
        self._fds.append(tracker_fd)
        fp = _process_data(self, process_obj)
        parent_r = child_w = child_r = parent_w = None
        try:
            parent_r, child_w = os.pipe()
            child_r, parent_w = os.pipe()
            cmd = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self._fds.extend([child_r, child_w])
            self.pid = util.spawnv_passfds(spawn.get_executable(), cmd, self._fds)  # type: ignore[arg-type]
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as f:
                f.write(fp.getbuffer())
        finally:
            self.finalizer = util.Finalize(
                self,
                util.close_fds,  # type: ignore[attr-defined]
                [fd for fd in (parent_r, parent_w) if fd is not None],
            )
            for fd in (child_r, child_w):
                if fd is not None:
                    os.close(fd)


_pipelining = threading.local()  # .on: this thread's fork-server starts do not wait


@contextlib.contextmanager
def pipelined_starts() -> Iterator[None]:
    """Fork-server starts in this block return before the server has forked the child.

    multiprocessing waits for each child's pid before ``start()`` returns: a
    round trip per process, during which the fork server forks and the caller
    waits. In the block the pid is read on first use (``process.pid``), so the
    caller prepares the next worker while the server forks this one. Read each
    started process's ``pid`` before waiting on its ``sentinel``: until then the
    pid's bytes make the sentinel readable.
    """
    _pipelining.on = True
    try:
        yield
    finally:
        _pipelining.on = False


class _ForkServerPopen(popen_forkserver.Popen):
    """The standard forkserver Popen, talking to mpexec's fork server."""

    _fds: list[int]

    def __init__(self, process_obj: Any) -> None:
        self._reading = threading.Lock()  # before the base class launches
        self._pid: int | None = None
        self._name = process_obj.name
        super().__init__(process_obj)

    @property  # an attribute of multiprocessing's Popen
    def pid(self) -> int:
        """The child's pid: the server's first word on the sentinel, read once."""
        if self._pid is None:
            with self._reading:
                if self._pid is None:
                    try:
                        self._pid = forkserver.read_signed(self.sentinel)
                    except (OSError, EOFError) as exc:
                        raise _server_gone(self._name, exc) from exc
        return self._pid

    @pid.setter
    def pid(self, value: int) -> None:
        self._pid = value

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The exit code once the server has sent it: read once, whoever asks.

        multiprocessing's reads it unlocked: a second thread polling at the same
        moment (the pool's stop thread, a user's ``join()`` or ``exitcode``) read
        EOF, or a sentinel the first had closed, and replaced the code with 255.
        Waiting for the sentinel stays outside the lock (a blocking ``join()``
        must not hold up another thread's ``is_alive()``).
        """
        if self.returncode is None:
            if self._pid is None:  # a pipelined start: the pid comes first
                if flag == os.WNOHANG and not self._readable():
                    return None  # not even forked yet
                try:
                    self.pid  # noqa: B018 - read (and kept) now
                except BrokenPoolError:  # the server died before it forked the child
                    self.returncode = 255
                    return self.returncode
            ready = self._readable(None if flag != os.WNOHANG else 0)
            if not ready:
                return None
            with self._reading:
                if self.returncode is None:
                    try:
                        self.returncode = forkserver.read_signed(self.sentinel)
                    except (OSError, EOFError):
                        # The server itself died without a word (multiprocessing's 255).
                        self.returncode = 255
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        # The base class's wait sees the sentinel readable while the pid is unread.
        if self.returncode is None and self._pid is None:
            with contextlib.suppress(BrokenPoolError):
                self.pid  # noqa: B018 - the server's first word, right after the fork
        return super().wait(timeout)

    def _readable(self, timeout: float | None = 0) -> bool:
        try:
            return bool(mp_connection.wait([self.sentinel], timeout))
        except (OSError, ValueError):  # closed by a thread that read the code
            return True

    def _launch(self, process_obj: Any) -> None:
        # As multiprocessing.popen_forkserver.Popen._launch (3.10 - 3.13), but
        # for the preparation data and the server.
        buf = _process_data(self, process_obj)
        try:
            self.sentinel, w = _fork_server().connect_to_new_process(self._fds)
            # The child watches a duplicate of the data pipe's write end to see us die.
            parent_w = os.dup(w)
            self.finalizer = util.Finalize(
                self,
                util.close_fds,  # type: ignore[attr-defined]
                (parent_w, self.sentinel),
            )
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
        except (OSError, EOFError) as exc:
            raise _server_gone(process_obj.name, exc) from exc
        if not getattr(_pipelining, "on", False):
            self.pid  # noqa: B018 - multiprocessing's way: wait for it now


def _server_gone(name: str, exc: BaseException) -> BrokenPoolError:
    # The server went away without a word to us: most likely it died
    # importing mpexec, with its traceback on stderr (it has no other).
    return BrokenPoolError(
        f"mpexec's fork server could not start {name}: "
        f"{type(exc).__name__}: {exc}. It most likely died preloading mpexec in "
        "a broken environment (its traceback is on stderr): a package missing "
        "or shadowed on sys.path, or a bad PYTHONPATH. Fix that, or pass "
        "start_method='spawn', whose workers report their own traceback"
    )


_server: forkserver.ForkServer | None = None
_server_lock = threading.Lock()
#: What mpexec's fork server imports before forking workers: the worker's loop,
#: and the multiprocessing modules a forked child's bootstrap reads (imported
#: once there rather than after every fork).
_preload = ["mpexec._launch", "mpexec._worker"]


def preload(module: str) -> None:
    """Have mpexec's fork server import ``module`` too, so workers inherit it.

    For heavy imports every worker needs (torch, for the DataLoader). Only a
    server that has not started takes it; a running one is left as it is.
    """
    with _server_lock:
        if module in _preload:
            return
        if _server is not None and getattr(_server, "_forkserver_pid", None) is not None:
            return
        _preload.append(module)
        if _server is not None:
            _server.set_forkserver_preload(list(_preload))


def _fork_server() -> forkserver.ForkServer:
    """mpexec's fork server: it preloads mpexec, never the caller's ``__main__``."""
    global _server
    with _server_lock:
        if _server is None:
            server = forkserver.ForkServer()
            server.set_forkserver_preload(list(_preload))
            _server = server
        return _server


def _forget_server() -> None:
    """In a child forked by ``os.fork()``: start a fork server of its own when needed.

    The parent's server is not this process's child (``ForkServer.ensure_running``
    would fail in ``waitpid``) and its lock may have been held at the fork; the
    child's copy of the server's liveness fd is closed so that the parent's
    server still ends with the parent.
    """
    global _server, _server_lock
    server, _server, _server_lock = _server, None, threading.Lock()
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


os.register_at_fork(after_in_child=_forget_server)


class _SpawnProcess(_Bootstrapped, mp_context.SpawnProcess):
    _base = mp_context.SpawnProcess

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _SpawnPopen(process_obj)


class _ForkServerProcess(_Bootstrapped, mp_context.ForkServerProcess):
    _base = mp_context.ForkServerProcess

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ForkServerPopen(process_obj)


class _Context:
    """What the pool needs of a multiprocessing context: ``Process``."""

    def __init__(self, method: str, process_class: type[Any]) -> None:
        self.method = method
        self.Process = process_class


def context(method: str) -> Any:
    """A context whose processes never import the caller's ``__main__``.

    ``method`` is a start method available here; ``fork`` is the standard one.
    Raises :class:`MainModuleError` if this process is still importing the
    main module of the process that started it.
    """
    check_not_bootstrapping()
    if method == "spawn":
        return _Context(method, _SpawnProcess)
    if method == "forkserver":
        return _Context(method, _ForkServerProcess)
    if method == "fork":
        return _Context(method, _ForkProcess)
    return mp.get_context(method)


def startup_failure(proc: Any) -> str:
    """The traceback a worker that died while starting reported, or ``""``."""
    read = getattr(proc, "startup_failure", None)
    return read() if read is not None else ""


def started(proc: Any) -> None:
    """Tell a worker process that it is up: its start-up report is closed."""
    done = getattr(proc, "started", None)
    if done is not None:
        done()


def start_failure(who: str, proc: Any, exit_status: str) -> BrokenPoolError:
    """The error for a worker that died before it said hello, with its traceback."""
    tb = startup_failure(proc)
    if not tb:
        return BrokenPoolError(
            f"{who} died while starting ({exit_status}) without reporting an error: "
            "something ended it outright (os._exit() or a crash in worker_init or a "
            "library it loads, the OOM killer, a signal), or Python itself could not "
            "start (see the process's stderr)"
        )
    last = tb.strip().splitlines()[-1]
    err = BrokenPoolError(
        f"{who} failed to start ({exit_status}) while loading mpexec and its start-up "
        f"arguments: {last}. Workers run {sys.executable} with this process's sys.path "
        "and environment; a package missing or broken there is the likely cause (the "
        "worker's traceback follows)"
    )
    err.__cause__ = RemoteTraceback(tb)
    return err
