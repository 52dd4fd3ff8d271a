"""Facts about this host that the pool, the loaders and the doctor share.

One copy of each: the CPUs this process may use (and a cgroup's CPU quota),
the default start method, whether CUDA is initialised here (``fork`` is then
refused), and the open files a pool needs.

Open files: each worker costs the caller about :data:`FDS_PER_WORKER` open
files: two doorbells (eventfds) for each of its four rings, the rings' mappings
(Python before 3.13 keeps a duplicate fd for every ``mmap``), its process
sentinel, and mappings of its arena's segments. A soft ``RLIMIT_NOFILE`` of
1,024, still the default in many shells and containers, then stops near 50
workers, in the middle of starting them, with a bare ``EMFILE``. So before any
worker starts, the soft limit is raised toward the hard one when it is too low
(as any process may do), and where even the hard limit is too low the pool
refuses at once, naming the limit and the fix.

Warm memory: glibc's malloc hands large freed blocks back to the kernel (its mmap
threshold, and trimming the heap's top past a threshold), so a function that
allocates a few hundred KiB of temporaries faults every page in again on every
call: ~150 minor faults for one 224x224x3 float32 image, a fifth of a 4 ms call.
:func:`keep_memory_warm` raises both thresholds in a worker, bounded.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

from ._errors import ResourceLimitError


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else ``os.cpu_count()``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def cgroup_cpu_quota() -> float | None:
    """CPUs' worth of time a Linux cgroup quota allows, or None when unlimited.

    Containers often cap CPU time without narrowing the affinity mask, so a
    pool sized by affinity alone would oversubscribe.
    """
    v2 = Path("/sys/fs/cgroup/cpu.max")
    v1_quota = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
    v1_period = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            if quota == "max":
                return None
            return int(quota) / int(period)
        if v1_quota.is_file() and v1_period.is_file():
            quota_us = int(v1_quota.read_text())
            if quota_us <= 0:
                return None
            return quota_us / int(v1_period.read_text())
    except (OSError, ValueError):
        return None
    return None


def default_start_method() -> str:
    """``"forkserver"`` on Linux, ``"spawn"`` elsewhere.

    ``fork`` is never the default: forking after threads or CUDA exist can
    deadlock or corrupt the child.
    """
    if sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


def cuda_initialised() -> bool:
    """Whether this process holds a CUDA context, made by any library (CuPy, torch,
    JAX, ...): a child forked from here would inherit one it cannot use.

    Asked of CUDA's driver itself, only if some library has loaded it (this never
    loads or initialises it). Importing CuPy or torch does not count, nor does
    ``cuInit`` alone (``torch.cuda.is_available()``: torch's own loader still forks
    after it, its workers never touching CUDA); a device's primary context in use
    (``model.cuda()``, a CuPy array, ``jax.devices()``) or a context current on this
    thread does.
    """
    try:
        driver = ctypes.CDLL(_CUDA_DRIVER, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded here (or no dlopen flags: not POSIX)
        return False
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return False  # CUDA_ERROR_NOT_INITIALIZED: nobody called cuInit
    try:
        device, flags, active = ctypes.c_int(0), ctypes.c_uint(0), ctypes.c_int(0)
        for ordinal in range(count.value):
            if (
                driver.cuDeviceGet(ctypes.byref(device), ordinal) == 0
                and driver.cuDevicePrimaryCtxGetState(
                    device, ctypes.byref(flags), ctypes.byref(active)
                )
                == 0
                and active.value
            ):
                return True
        context = ctypes.c_void_p(None)
        return bool(driver.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value)
    except AttributeError:  # a driver without these entry points: initialised is enough
        return True


#: The CUDA driver's library, as CUDA's runtime and every framework load it on Linux.
_CUDA_DRIVER = "libcuda.so.1"


# ---------------------------------------------------------------- open files

#: Open files a worker costs the pool's process, results it holds mapped included
#: (measured: 14-16 with Python 3.11, of which 4 are duplicates kept by ``mmap``).
FDS_PER_WORKER = 16 if sys.version_info < (3, 13) else 12
#: Open files kept free for everything else the process does meanwhile.
HEADROOM = 64


def open_fds() -> int:
    """How many files this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir used
    except OSError:
        import psutil

        try:
            return int(psutil.Process().num_fds())
        except (AttributeError, psutil.Error):  # no such count here (Windows)
            return 0


def ensure_open_files(num_workers: int) -> None:
    """Make room for ``num_workers`` workers under ``RLIMIT_NOFILE``, or refuse.

    Raises the soft limit (to the hard limit where that is finite and higher)
    if it is too low; :class:`ResourceLimitError` if the hard limit is too low.
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows: no such limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = open_fds()
    need = in_use + num_workers * FDS_PER_WORKER + HEADROOM
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or need <= soft:
        return
    if hard == unlimited or need <= hard:
        for target in (hard, need) if hard != unlimited else (max(need, 4 * soft), need):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):  # macOS refuses more than OPEN_MAX
                continue
            return
    most = max(0, (min(soft, hard) if hard != unlimited else soft) - in_use - HEADROOM)
    raise ResourceLimitError(
        errno.EMFILE,
        f"WorkerPool({num_workers}) needs about {need} open files in this process "
        f"({FDS_PER_WORKER} per worker, {in_use} open already), but its open-file limit "
        f"(RLIMIT_NOFILE) is {soft}, and its hard limit of {hard} only an administrator can "
        f"raise. Raise it before Python starts (`ulimit -n {need}` in the shell, "
        f"LimitNOFILE= in a systemd unit, `--ulimit nofile={need}` for docker run), or "
        f"use at most {most // FDS_PER_WORKER} workers",
    )


#: glibc's ``mallopt`` parameters (malloc.h) and its largest mmap threshold on
#: 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``: larger values are refused).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD_MAX = 32 << 20


_MALLINFO_FIELDS = [
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
]


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): the heap's totals, in bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO_FIELDS]


class _MallInfo(ctypes.Structure):
    """glibc's older ``struct mallinfo``: the same totals as ``int`` (they wrap past 2 GiB)."""

    _fields_ = [(name, ctypes.c_int) for name in _MALLINFO_FIELDS]


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None)
    except OSError:  # pragma: no cover - no C library to load
        return None


@functools.cache
def glibc_malloc() -> bool:
    """Whether this process's ``malloc`` is glibc's own.

    ML images often preload another allocator (jemalloc, tcmalloc: ``LD_PRELOAD``),
    which keeps freed memory by itself; glibc's ``mallopt`` and ``mallinfo2`` are
    still there, and still answer, but for a heap nobody allocates from.
    """
    libc = _libc()
    malloc = getattr(libc, "malloc", None)
    if malloc is None or sys.platform != "linux":
        return False
    try:
        own = ctypes.CDLL("libc.so.6").malloc  # looked up in glibc itself
    except (OSError, AttributeError):
        return False  # no glibc here (musl, say)
    address = ctypes.cast(malloc, ctypes.c_void_p).value  # the process's: the first found
    return address is not None and address == ctypes.cast(own, ctypes.c_void_p).value


def keep_memory_warm(limit: int) -> bool:
    """Let this process's malloc keep up to ``limit`` bytes of freed memory mapped.

    Blocks under ``min(limit, 32 MiB)`` come from the heap instead of fresh
    mappings, and the heap's free top is handed back only past ``limit``: a
    worker's temporaries stay in pages it already touched, call after call.
    A ``limit`` over 32 MiB (glibc's largest mmap threshold) turns malloc's
    own mappings off, so that larger blocks (the result of ``x * 2`` on a
    64 MiB array) come from the heap and stay warm too; a fresh mapping of
    them costs more than computing into warm pages (the kernel zeroes every
    page, then the mapping is torn down at ``free``). What the heap keeps past
    ``limit`` is handed back by :func:`trim_warm_memory`. ``limit <= 0``
    leaves glibc's defaults. Returns whether the settings took (False off
    glibc, e.g. musl or macOS, and where another malloc is preloaded).
    """
    if limit <= 0 or not glibc_malloc():
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:  # pragma: no cover - not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    limit = min(limit, 2**31 - 1)
    done = bool(
        mallopt(_M_MMAP_THRESHOLD, min(limit, _MMAP_THRESHOLD_MAX))
        and mallopt(_M_TRIM_THRESHOLD, limit)
    )
    if done and limit > _MMAP_THRESHOLD_MAX:
        # No limit above 32 MiB is accepted as a threshold: no mappings at all,
        # then. (glibc still maps when the heap cannot grow.)
        done = bool(mallopt(_M_MMAP_MAX, 0))
    return done


def resolve_malloc_controls() -> None:
    """Look up here, before workers are forked, what their malloc settings call.

    ``dlopen`` and ``dlsym`` take the dynamic loader's lock; a thread of this process
    (TensorFlow's, JAX's) may hold it as a worker forks, and the child, with that
    thread gone, would then wait on it for good at its first look-up. A child
    inherits what was looked up here.
    """
    if glibc_malloc():
        libc = _libc()
        for name in ("mallopt", "malloc_trim"):
            getattr(libc, name, None)  # ctypes keeps each function it finds on the library
        _mallinfo()


def heap_free_bytes() -> int | None:
    """Bytes free inside this process's malloc heap (glibc), None where unknown."""
    info = _mallinfo() if glibc_malloc() else None
    if info is None:
        return None
    free = int(info().fordblks)
    # The old struct's int wraps past 2 GiB: read unsigned, it is right modulo 4 GiB
    # (a free heap just past a multiple of 4 GiB reads small; mallinfo2 has no such gap).
    return free if free >= 0 else free + (1 << 32)


@functools.cache
def _mallinfo() -> Any:
    """glibc's ``mallinfo2`` (2.33+), else its older ``mallinfo``; None off glibc."""
    libc = _libc() if sys.platform == "linux" else None
    for name, struct in (("mallinfo2", _MallInfo2), ("mallinfo", _MallInfo)):
        info = getattr(libc, name, None)
        if info is not None:
            info.argtypes = ()
            info.restype = struct
            return info
    return None


def trim_warm_memory(limit: int) -> bool:
    """Hand the heap's free memory back to the kernel if over ``limit`` bytes.

    :func:`keep_memory_warm` bounds only the heap's free top; free blocks
    under a block still in use (a large temporary freed below a small object
    that stays) are kept however many there are. Past ``limit`` they all go
    back (``malloc_trim``: their whole pages, and the top). Returns whether it
    trimmed. Cheap (~1 µs) when under the limit. Free bytes handed back once
    still count (malloc does not tell them apart), so while they pass the
    limit every look trims again: ~5 µs when nothing is left to give back.
    """
    free = heap_free_bytes()
    if free is None or free <= limit:
        return False
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:  # pragma: no cover - not glibc
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim(0)
    return True


def minor_faults(pid: int) -> int | None:
    """Minor page faults of process ``pid`` so far (Linux ``/proc``), None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return None
