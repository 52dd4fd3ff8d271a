"""Passing file descriptors to a child process while it is being started.

``multiprocessing`` pickles a ``Process`` object for ``spawn`` and
``forkserver``; during that pickling it exposes the child-to-be so that fds can
be duplicated into it (``duplicate_for_child``). Outside that window there is
no child to give an fd to, and we refuse rather than fall back to
``multiprocessing.resource_sharer``, which starts a listening socket.
"""

from __future__ import annotations

import os
from multiprocessing import context
from typing import Any


def fd_for_child(fd: int, what: str) -> Any:
    """Return a picklable stand-in for ``fd`` valid in the child being started."""
    popen = context.get_spawning_popen()
    if popen is None:
        raise TypeError(
            f"{what} can be handed only to a child process while it starts "
            "(as an argument of multiprocessing.Process or a pool's initializer); "
            "create it before starting the process that needs it"
        )
    # spawn passes the fd number through; forkserver sends the fd over its
    # socket and hands back an index, which the popen's DupFd resolves.
    return popen.DupFd(popen.duplicate_for_child(fd))


def fd_in_child(token: Any) -> int:
    """Turn the stand-in made by :func:`fd_for_child` back into an fd."""
    fd = int(token.detach())
    os.set_inheritable(fd, False)
    return fd
