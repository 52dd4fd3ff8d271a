"""What this machine offers for shared memory: backend, limits, free memory.

Kept apart so that ``python -m mpexec doctor`` and the error messages of the
allocator report the same facts.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass

import psutil

#: Every allocation and every ring slot starts on a multiple of this.
ALIGNMENT = 64

PAGE_SIZE = mmap.PAGESIZE

#: Where named POSIX segments live on Linux (used by the ``posix`` backend).
DEV_SHM = "/dev/shm"


def memfd_supported() -> bool:
    """True where unnamed, fd-backed memory (Linux ``memfd_create``) exists."""
    return hasattr(os, "memfd_create") and sys.platform.startswith("linux")


def eventfd_supported() -> bool:
    """True where ``eventfd`` doorbells exist (Linux); pipes are used elsewhere."""
    return hasattr(os, "eventfd") and sys.platform.startswith("linux")


def default_backend() -> str:
    """``"memfd"`` on Linux, ``"posix"`` (named segments) elsewhere.

    The environment variable ``SHM_BACKEND`` overrides the choice, so the
    whole test suite can run against the fallback backend on Linux too.
    """
    forced = os.environ.get("SHM_BACKEND")
    if forced:
        if forced not in ("memfd", "posix"):
            raise ValueError(f"SHM_BACKEND must be 'memfd' or 'posix', not {forced!r}")
        return forced
    return "memfd" if memfd_supported() else "posix"


def free_bytes(backend: str) -> int:
    """Bytes that a new segment of ``backend`` can still reserve.

    memfd memory is charged to RAM (and the cgroup), not to a filesystem;
    named POSIX segments on Linux are bounded by the ``/dev/shm`` mount too.
    """
    available = int(psutil.virtual_memory().available)
    if backend == "posix" and os.path.isdir(DEV_SHM):
        st = os.statvfs(DEV_SHM)
        available = min(available, st.f_bavail * st.f_frsize)
    return available


def dev_shm_size() -> int | None:
    """Total size of the ``/dev/shm`` mount, or None where there is none."""
    if not os.path.isdir(DEV_SHM):
        return None
    st = os.statvfs(DEV_SHM)
    return int(st.f_blocks * st.f_frsize)


@dataclass(frozen=True)
class PlatformInfo:
    """A snapshot of the shared-memory facilities of this machine."""

    backend: str
    memfd: bool
    eventfd: bool
    page_size: int
    alignment: int
    free_bytes: int
    total_memory: int
    dev_shm_bytes: int | None


def platform_info() -> PlatformInfo:
    """Report the backend in use and the limits that bound it."""
    backend = default_backend()
    return PlatformInfo(
        backend=backend,
        memfd=memfd_supported(),
        eventfd=eventfd_supported(),
        page_size=PAGE_SIZE,
        alignment=ALIGNMENT,
        free_bytes=free_bytes(backend),
        total_memory=int(psutil.virtual_memory().total),
        dev_shm_bytes=dev_shm_size(),
    )
