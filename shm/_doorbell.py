"""Doorbells: kernel counters that carry credits between two processes.

A doorbell is an ``eventfd`` on Linux and a pipe elsewhere. ``ring(n)`` adds
``n`` credits; ``take()`` removes and returns all of them without blocking;
``fileno()`` is readable while credits are waiting, so a doorbell can be
waited on together with process sentinels and other doorbells in one
``select``/``poll`` call.

Rings use doorbells not only to wake a sleeper but as their synchronisation:
the kernel takes a lock around every counter update, so everything one process
wrote before ``ring()`` is visible to the process whose ``take()`` returned
those credits, on any CPU architecture (see ``_ring.py``).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from typing import Any

from ._fdpass import fd_for_child, fd_in_child
from ._platform import eventfd_supported


def close_fds(fds: list[int]) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


class Doorbell:
    """A credit counter shared with one child process (handed over at its start)."""

    def __init__(self, initial: int = 0, *, _fds: tuple[int, int] | None = None) -> None:
        self._eventfd = eventfd_supported()
        if _fds is not None:
            self._rfd, self._wfd = _fds
        elif self._eventfd:
            self._rfd = self._wfd = os.eventfd(initial, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self._rfd, self._wfd = os.pipe()
            os.set_blocking(self._rfd, False)
            os.set_blocking(self._wfd, False)
            if initial:
                os.write(self._wfd, b"\x01" * initial)
        self._fds = sorted({self._rfd, self._wfd})
        #: The eventfd, for a ring's hot path to read and write itself (one
        #: Python call less each way); None for a pipe. Stale once closed: the
        #: ring checks that it is open first.
        self.event_fd: int | None = self._rfd if self._eventfd else None
        #: ``give(give_fd, unit * n)`` adds ``n`` credits in one C call, for a
        #: ring's steps that an interrupt must not split (``_ring.py``,
        #: "Interrupts"): no Python frame is entered before the write.
        self.give: Any = os.eventfd_write if self._eventfd else os.write
        self.give_fd = self._wfd
        self.unit: Any = 1 if self._eventfd else b"\x01"
        #: ``take_into(box)``: :meth:`take_into`, as one C call on an eventfd (a
        #: non-blocking file's ``readinto``: None, not an exception, when empty).
        self.take_into: Any = (
            open(self._rfd, "rb", buffering=0, closefd=False).readinto  # noqa: SIM115
            if self._eventfd
            else self._take_into_pipe
        )
        self._finalizer = weakref.finalize(self, close_fds, list(self._fds))

    def fileno(self) -> int:
        """Readable while credits are waiting."""
        return self._rfd

    def ring(self, n: int = 1) -> None:
        """Add ``n`` credits, waking anyone waiting on :meth:`fileno`."""
        if self._eventfd:
            os.eventfd_write(self._wfd, n)
        else:
            # A pipe holds 64 KiB of credits; callers never keep more outstanding.
            os.write(self._wfd, b"\x01" * n)

    def take(self) -> int:
        """Remove and return every waiting credit; 0 if none (never blocks)."""
        try:
            if self._eventfd:
                return int(os.eventfd_read(self._rfd))
            return len(os.read(self._rfd, 1 << 16))
        except BlockingIOError:
            return 0

    def _take_into_pipe(self, box: memoryview) -> None:
        """``take_into`` on a pipe (see the attribute).

        Every waiting credit goes to ``box[0]`` (a one-item ``"Q"`` view); never
        blocks. On an eventfd the kernel writes the count into ``box`` itself
        (which must hold 0), so an exception raised as the read returns (a
        Ctrl-C) loses no credit: the caller moves ``box[0]`` into its own count
        and zeroes it with no call between, as its next take does first. A
        pipe's count is a return value, which such an exception can still lose.
        """
        with contextlib.suppress(BlockingIOError):
            box[0] += len(os.read(self._rfd, 1 << 16))

    def close(self) -> None:
        """Close this process's fds; idempotent.

        The fd numbers are forgotten too: once closed they may name another
        file, which a stray ``ring()`` must not write to (it gets EBADF).
        """
        self._finalizer()
        self._rfd = self._wfd = self.give_fd = -1
        self.event_fd = None

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __reduce__(self) -> tuple[Any, ...]:
        if self.closed:
            raise ValueError("cannot hand a closed Doorbell to a child")
        tokens = tuple(fd_for_child(fd, "a Doorbell") for fd in self._fds)
        return (_rebuild_doorbell, (tokens, self._fds.index(self._rfd), self._fds.index(self._wfd)))


def _rebuild_doorbell(tokens: tuple[Any, ...], r: int, w: int) -> Doorbell:
    fds = [fd_in_child(t) for t in tokens]
    for fd in fds:
        os.set_blocking(fd, False)
    return Doorbell(_fds=(fds[r], fds[w]))
