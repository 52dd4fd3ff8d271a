"""A lifeline: how a child learns, at once and without polling, that its parent died.

The parent keeps the write end of a pipe and never hands it to anyone; the
child gets the read end at its start. The kernel closes the write end when the
parent exits, however it exits (SIGKILL included), and the read end then polls
readable (end of file). A child can wait on it together with its rings in one
:func:`shm.wait`, or block a watchdog thread on it.
"""

from __future__ import annotations

import contextlib
import os
import select
import weakref
from typing import Any

from ._doorbell import close_fds
from ._fdpass import fd_for_child, fd_in_child


class Lifeline:
    """Made in the parent; handed to one or more children as a start argument."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()  # both close-on-exec: no stray holder of the write end
        self._fds = [self._r, self._w]
        self._finalizer = weakref.finalize(self, close_fds, self._fds)
        global _fork_hook
        if not _fork_hook:  # registered on first use: no work at import
            os.register_at_fork(after_in_child=Lifeline._drop_write_ends)
            _fork_hook = True
        _parents.add(self)

    def fileno(self) -> int:
        """Readable once the parent is gone (in a child), never before."""
        return self._r

    def parent_alive(self) -> bool:
        """False once the parent has exited (never blocks)."""
        return not _readable(self._r, 0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the parent is gone (True) or ``timeout`` passes (False)."""
        return _readable(self._r, timeout)

    def close(self) -> None:
        """Close this process's ends; idempotent. In the parent: children see it as death."""
        self._finalizer()

    def __reduce__(self) -> tuple[Any, ...]:
        return (Lifeline._rebuild, (fd_for_child(self._r, "a Lifeline"),))

    @classmethod
    def _rebuild(cls, token: Any) -> Lifeline:
        """In a child: the read end it was handed (it never gets the write end)."""
        life: Lifeline = cls.__new__(cls)
        life._r = fd_in_child(token)
        life._w = -1
        life._fds = [life._r]
        life._finalizer = weakref.finalize(life, close_fds, life._fds)
        return life

    @classmethod
    def _drop_write_ends(cls) -> None:
        """In a forked child: close the inherited write ends.

        Only the process that made a lifeline may hold its write end: a forked
        child holding it would keep the children alive after the parent died.
        """
        for life in list(_parents):
            cls._drop_write_end(life)
        _parents.clear()

    def _drop_write_end(self) -> None:
        # Only if still open here: after close() its number may belong to
        # another file by now (the pipe of the very fork being made).
        if self._w >= 0 and self._w in self._fds:
            with contextlib.suppress(OSError):
                os.close(self._w)
            with contextlib.suppress(ValueError):
                self._fds.remove(self._w)
            self._w = -1


_parents: weakref.WeakSet[Lifeline] = weakref.WeakSet()
_fork_hook = False


def _readable(fd: int, timeout: float | None) -> bool:
    # poll, not select: select() refuses fds past 1,023, which a process with
    # a raised RLIMIT_NOFILE may well hand out.
    if not hasattr(select, "poll"):  # pragma: no cover - Windows
        return bool(select.select([fd], [], [], timeout)[0])
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000 + 0.999))))
