"""Segments: blocks of shared memory, reserved before use, owned by one process.

Two backends:

``memfd`` (Linux, the default)
    Unnamed memory from ``memfd_create``. Nothing exists on any filesystem, so
    nothing can leak when the owner is SIGKILLed, and the size of ``/dev/shm``
    (64 MB in a default Docker container) does not bound it. Another process of
    the same user maps it by opening ``/proc/<owner>/fd/<fd>``; the inode is
    checked so that a recycled fd number can never map the wrong memory.
    Children started by us get the fd directly instead.

``posix`` (elsewhere; selectable on Linux for testing)
    Named POSIX segments with a random, unguessable name and mode 0600, unlinked
    by the owner on close, at exit, or at once when the segment is handed over
    by fd (rings). A SIGKILLed owner can leave a named segment behind: that
    is the reason memfd is preferred wherever it exists.

Memory is reserved with ``posix_fallocate`` at creation (or, with ``commit=``,
part at creation and the rest by :meth:`Segment.reserve` before it is used), so
a shortage is a :class:`ReservationError` there, naming the size and what is
free, and never a SIGBUS in the middle of a run.

Only the creator of a segment ever unlinks it (via ``weakref.finalize``);
attachers never register it anywhere (CPython gh-82300).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import mmap
import os
import re
import resource
import secrets
import stat
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import AttachError, ReservationError
from ._fdpass import fd_for_child, fd_in_child
from ._platform import DEV_SHM as _DEV_SHM
from ._platform import PAGE_SIZE, default_backend, free_bytes

_BACKENDS = ("memfd", "posix")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: sizes in messages a person reads."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def map_fd(
    fd: int,
    length: int,
    access: int = mmap.ACCESS_WRITE,
    offset: int = 0,
    populate: bool = False,
) -> mmap.mmap:
    """Map ``length`` bytes of ``fd`` from ``offset`` (a multiple of the page size).

    From Python 3.13 on the mapping keeps no duplicate of ``fd``: each one would
    cost an open file, and a pool holds many mappings (see ``RLIMIT_NOFILE``).
    ``populate`` (a shared read-write mapping, Linux) fills its page tables at
    once: for a short-lived mapping that is about to be written, 2-3x cheaper
    than a page fault at the first touch of each page.
    """
    kw: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    try:
        if populate and access == mmap.ACCESS_WRITE and hasattr(mmap, "MAP_POPULATE"):
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            return mmap.mmap(fd, length, flags=flags, offset=offset, **kw)
        return mmap.mmap(fd, length, access=access, offset=offset, **kw)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise ReservationError(_no_address_space(length)) from exc


def _no_address_space(length: int) -> str:
    """Why a mapping of ``length`` bytes failed with ENOMEM: the memory is there,
    this process's address space is not (``ulimit -v``, or too many mappings)."""
    text = f"cannot map {format_bytes(length)} of shared memory: this process is out of "
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        return text + (
            f"address space: its RLIMIT_AS (ulimit -v) is {format_bytes(limit)}, of which "
            f"{format_bytes(_mapped_bytes())} is mapped already; raise the limit, or pass "
            "and return smaller arrays"
        )
    return text + (
        "address space (ENOMEM from mmap: vm.max_map_count or the kernel's overcommit "
        "policy); hold fewer results, or pass and return smaller arrays"
    )


def _mapped_bytes() -> int:
    """This process's mapped address space (what RLIMIT_AS counts)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):  # pragma: no cover - no /proc
        return 0


def buffer_address(buf: Any) -> int:
    """Address of the first byte of a buffer (read-only buffers included)."""
    return int(np.frombuffer(buf, np.uint8, count=1).__array_interface__["data"][0])


@dataclass(frozen=True)
class SegmentHandle:
    """Everything another process needs to map a segment: small and picklable."""

    backend: str
    owner_pid: int
    fd: int
    inode: int
    name: str
    size: int


def _reserve(fd: int, size: int, backend: str, commit: int) -> None:
    """Size ``fd`` at ``size`` bytes and commit its first ``commit`` now, or raise a
    ReservationError."""
    free = free_bytes(backend)
    where = "memory" if backend == "memfd" else "/dev/shm"
    if commit > free:
        raise ReservationError(
            f"cannot reserve {format_bytes(commit)} of shared memory: only "
            f"{format_bytes(free)} of {where} is free; ask for less, free some, "
            "or raise the limit"
        )
    if hasattr(os, "posix_fallocate"):
        try:
            if commit < size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, commit)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            raise ReservationError(
                _file_too_big(size)
                if exc.errno == errno.EFBIG
                else f"cannot reserve {format_bytes(commit)} of shared memory "
                f"({errno.errorcode.get(exc.errno or 0, exc.errno)}): "
                f"{format_bytes(free_bytes(backend))} of {where} is free"
            ) from exc
    else:  # macOS has no fallocate: the size is set but pages are not committed
        os.ftruncate(fd, size)


def _file_too_big(size: int) -> str:
    """Why reserving ``size`` bytes failed with EFBIG: a file-size limit, not memory."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return (
            f"cannot reserve {format_bytes(size)} of shared memory (EFBIG): larger than "
            "the file system allows for one file; use smaller segments (arena_size)"
        )
    return (
        f"cannot reserve {format_bytes(size)} of shared memory (EFBIG): a segment is a "
        f"file, and this process's RLIMIT_FSIZE (ulimit -f) is {format_bytes(limit)}; "
        "raise it (ulimit -f unlimited), or use smaller segments (arena_size)"
    )


def _shm_module() -> Any:
    import _posixshmem  # type: ignore[import-not-found]  # CPython's own shm_open wrapper

    return _posixshmem


_ORPHAN = re.compile(r"^(mpx(?:-[a-z]+)?)-(\d+)-[0-9a-f]{16}$")
_reaped_in: int | None = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def reap_orphans() -> list[str]:
    """Unlink named segments left by our processes that were killed.

    A SIGKILLed owner of the ``posix`` backend cannot unlink its names. Each
    name carries its creator's pid, so on Linux, where names are visible in
    ``/dev/shm``, any of this user's names whose creator is gone are removed
    (mappings that peers still hold stay valid). Runs once per process before
    its first named segment is created; returns the names removed.
    Caveat: processes in other pid namespaces that share ``/dev/shm`` look dead.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(_DEV_SHM)
    except OSError:
        return removed  # no /dev/shm to look in (macOS): nothing we can list
    uid = os.getuid()
    for entry in entries:
        m = _ORPHAN.match(entry)
        if m is None or _pid_alive(int(m.group(2))):
            continue
        try:
            if os.stat(os.path.join(_DEV_SHM, entry)).st_uid != uid:
                continue
            _shm_module().shm_unlink("/" + entry)
            removed.append(entry)
        except OSError:
            pass
    return removed


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _unlink(names: list[str], owner_pid: int) -> None:
    # A forked child inherits finalizers; only the creator may unlink. A name
    # leaves the list only once unlinked: two threads may race here (a worker's
    # lifeline watchdog and its main thread), and the one cut short by the
    # other's os._exit must not have taken the name with it.
    while names and os.getpid() == owner_pid:
        try:
            name = names[-1]
        except IndexError:
            return
        with contextlib.suppress(OSError):
            _shm_module().shm_unlink(name)
        with contextlib.suppress(ValueError):
            names.remove(name)


def _release(owner_pid: int, fd: int, names: list[str]) -> None:
    """Finalizer of an owned segment: close its fd and, if still named, unlink it."""
    if fd >= 0:
        _close_fd(fd)
    _unlink(names, owner_pid)


class Segment:
    """A reserved block of shared memory mapped into this process.

    Create one with :meth:`create` (this process becomes its owner) or map an
    existing one with :meth:`attach`. ``buf`` is the mapping; ``address`` its
    first byte. The mapping itself is never unmapped explicitly: it goes when
    the last object using it does, so views outlive :meth:`close`.
    """

    buf: mmap.mmap
    address: int
    size: int
    handle: SegmentHandle
    owner: bool

    def __init__(
        self,
        buf: mmap.mmap,
        handle: SegmentHandle,
        owner: bool,
        fd: int,
        readonly: bool,
        offset: int = 0,
    ) -> None:
        self.buf = buf
        self.handle = handle
        self.offset = offset  # where in the segment the mapping starts
        self.size = len(buf)
        self.owner = owner
        self.readonly = readonly
        self.sealed = False  # see create()
        self.address = buffer_address(buf)
        self._fd = fd
        self._names = [handle.name] if owner and handle.name else []
        self._finalizer: weakref.finalize[Any, Any] | None = None
        if owner:
            self._finalizer = weakref.finalize(self, _release, os.getpid(), fd, self._names)
        elif fd >= 0:
            self._finalizer = weakref.finalize(self, _close_fd, fd)

    @classmethod
    def create(
        cls,
        size: int,
        backend: str | None = None,
        tag: str = "mpx",
        sealed: bool = False,
        commit: int | None = None,
    ) -> Segment:
        """Reserve a new segment of at least ``size`` bytes (rounded up to a page).

        ``commit``: commit only the first ``commit`` bytes now (default: all);
        the owner commits the rest with :meth:`reserve` before handing it out.
        Committing costs the kernel's zeroing of every page (~0.25 ms a MiB),
        which a pool's 64 MiB arena would otherwise pay at start-up for memory
        it may never use.

        ``sealed``: no process but this one, through the mapping made here, can
        ever write it (memfd's ``F_SEAL_FUTURE_WRITE``, Linux 5.1+): others
        can map it read-only and nothing more, even by reopening its fd
        read-write. Where seals do not exist (the posix backend, older
        kernels) it is not sealed; :attr:`sealed` says which.
        """
        if size <= 0:
            raise ValueError(f"segment size must be positive, not {size}")
        if not re.fullmatch(r"mpx(?:-[a-z]+)?", tag):
            raise ValueError(f"tag must look like 'mpx' or 'mpx-word', not {tag!r}")
        backend = backend or default_backend()
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, not {backend!r}")
        size = _round_up(size, PAGE_SIZE)
        commit = size if commit is None else min(size, _round_up(max(commit, 1), PAGE_SIZE))
        name = ""
        if backend == "memfd":
            flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealed else 0)
            fd = os.memfd_create(f"{tag}-{os.getpid()}", flags)
        else:
            global _reaped_in
            if _reaped_in != os.getpid():
                _reaped_in = os.getpid()
                reap_orphans()
            name = f"/{tag}-{os.getpid()}-{secrets.token_hex(8)}"
            fd = _shm_module().shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            _reserve(fd, size, backend, commit)
            buf = map_fd(fd, size)
            inode = os.fstat(fd).st_ino
            # After our own writable mapping exists: that one stays writable.
            done = sealed and backend == "memfd" and _seal_future_writes(fd)
        except BaseException:
            _release(os.getpid(), fd, [name] if name else [])
            raise
        handle = SegmentHandle(backend, os.getpid(), fd, inode, name, size)
        seg = cls(buf, handle, True, fd, False)
        seg.sealed = done
        return seg

    @classmethod
    def attach(
        cls,
        handle: SegmentHandle,
        readonly: bool = False,
        start: int = 0,
        length: int = 0,
        populate: bool = False,
    ) -> Segment:
        """Map a segment created by another process (or this one) from its handle.

        ``start`` (a multiple of the page size) and ``length`` map only that
        part of it; by default the whole segment is mapped. ``populate``: see
        :func:`map_fd`.
        """
        if start % PAGE_SIZE or start < 0 or length < 0 or start + length > handle.size:
            raise ValueError(f"cannot map [{start}, +{length}) of a {handle.size}-byte segment")
        length = length or handle.size - start
        fd = _open_fd(handle, writable=not readonly)
        try:
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            buf = map_fd(fd, length, access, start, populate)
        finally:
            os.close(fd)  # the mapping keeps the memory alive on its own
        return cls(buf, handle, False, -1, readonly, start)

    # Handing a whole segment to a child at start: pass the fd, not a name.
    def __reduce__(self) -> tuple[Any, ...]:
        if self._fd < 0:
            raise TypeError("only the owner of a segment can hand it to a child process")
        token = fd_for_child(self._fd, "a Segment")
        return (_rebuild_segment, (token, self.handle))

    # ---------------------------------------------------------------- pages
    def open_fd(self, writable: bool = False) -> int:
        """A new fd of this segment, for code that maps by fd (torch's shared storage).

        The caller closes it. Raises :class:`AttachError` once the segment's
        owner has exited or closed it.
        """
        return _open_fd(self.handle, writable)

    def map_private(self, start: int, length: int, keep: Any = None) -> Any:
        """``[start, start + length)`` of the segment, mapped copy-on-write (``MAP_PRIVATE``).

        Reads share the segment's pages, uncopied; a write copies the page it
        touches into memory of this mapping's own, so it never changes the
        segment. Pages not yet written read what the segment holds *now*:
        ``keep`` (the arrays whose memory is read) is held as long as the
        mapping, so that their memory is not reused underneath. ``start`` is a
        multiple of the page size. Returns a writable buffer (a ctypes array),
        unmapped once the last reference to it goes. Raises
        :class:`AttachError` if the segment is gone, ``OSError`` if the
        mapping fails.
        """
        if start % PAGE_SIZE or start < 0 or length <= 0 or start + length > self.handle.size:
            size = self.handle.size
            raise ValueError(f"cannot map [{start}, +{length}) of a {size}-byte segment")
        fd = _open_fd(self.handle, writable=False)
        try:
            return _map_private(fd, start, length, keep)
        finally:
            os.close(fd)  # the mapping keeps the memory alive on its own

    def drop_pages(self, start: int, length: int) -> None:
        """Drop this process's mapping of the pages under ``[start, start + length)``.

        Offsets are in the segment; ``start`` is rounded down to a page, the
        end up. The data stays (``MADV_DONTNEED`` on shared memory: the pages
        are the segment's), and the next touch here maps them again; other
        processes' mappings are untouched. For memory this process will not
        read for a while: it stops counting in this process's resident set.
        """
        lo = max(start // PAGE_SIZE * PAGE_SIZE, self.offset)
        hi = min(start + length, self.offset + self.size)
        if hi > lo and _MADV_DONTNEED is not None:
            self.buf.madvise(_MADV_DONTNEED, lo - self.offset, hi - lo)

    def discard(self, start: int, length: int) -> bool:
        """Give the pages of ``[start, start + length)`` back to the system (owner only).

        They read as zeros afterwards, in every process that maps them; call
        :meth:`reserve` before using them again. ``start`` and ``length`` are
        multiples of the page size. False where this cannot be done: no
        ``MADV_REMOVE`` (not Linux), a sealed segment, a closed one.
        """
        if not (self.owner and self._fd >= 0 and not self.sealed and _MADV_REMOVE is not None):
            return False
        try:
            self.buf.madvise(_MADV_REMOVE, start, length)
        except OSError:
            return False
        return True

    def reserve(self, start: int, length: int) -> None:
        """Commit ``[start, start + length)`` (again after :meth:`discard`), or raise.

        Raises :class:`ReservationError` if the memory is not there: a clear
        error now rather than SIGBUS at the first touch.
        """
        try:
            os.posix_fallocate(self._fd, start, length)
        except OSError as exc:
            if exc.errno == errno.EFBIG:
                raise ReservationError(_file_too_big(start + length)) from exc
            raise ReservationError(
                f"cannot commit {format_bytes(length)} of shared memory again "
                f"({errno.errorcode.get(exc.errno or 0, exc.errno)}): "
                f"{format_bytes(free_bytes(self.handle.backend))} is free"
            ) from exc

    def unlink(self) -> None:
        """Remove a named segment's name now; mappings and fds stay valid."""
        if self.owner:
            _unlink(self._names, self.handle.owner_pid)

    def close(self) -> None:
        """Close the fd and unlink the name; idempotent. Mappings stay valid."""
        if self._finalizer is not None:
            self._finalizer()
        self._fd = -1

    @property
    def closed(self) -> bool:
        """True once an owner has closed its fd (an attached mapping never is)."""
        return self.owner and (self._finalizer is None or not self._finalizer.alive)

    def __repr__(self) -> str:
        role = "owner" if self.owner else "attached"
        return (
            f"<Segment {self.handle.backend} {format_bytes(self.size)} "
            f"pid={self.handle.owner_pid} {role}{' closed' if self.closed else ''}>"
        )


#: ``madvise(MADV_REMOVE)``: frees a shared mapping's pages and their backing store.
_MADV_REMOVE: int | None = getattr(mmap, "MADV_REMOVE", None)

#: ``madvise(MADV_DONTNEED)``: drops a mapping's pages (a shared mapping's data stays).
_MADV_DONTNEED: int | None = getattr(mmap, "MADV_DONTNEED", None)


def _open_fd(handle: SegmentHandle, writable: bool) -> int:
    """A new fd of the segment ``handle`` names; :class:`AttachError` once it is gone."""
    flags = os.O_RDWR if writable else os.O_RDONLY
    try:
        if handle.backend == "memfd":
            fd = os.open(f"/proc/{handle.owner_pid}/fd/{handle.fd}", flags | os.O_CLOEXEC)
        else:
            fd = _shm_module().shm_open(handle.name, flags, mode=0o600)
    except OSError as exc:
        raise AttachError(
            f"cannot map shared memory of process {handle.owner_pid} "
            f"({os.strerror(exc.errno or 0)}): its owner has exited or closed it"
            + (", or /proc is not readable here" if handle.backend == "memfd" else "")
        ) from exc
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if st.st_ino != handle.inode or st.st_size < handle.size or not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise AttachError(
            f"shared memory of process {handle.owner_pid} is gone: its owner "
            "closed it (the fd now names something else)"
        )
    return fd


def _map_private(fd: int, offset: int, length: int, keep: Any) -> Any:
    """``length`` bytes of ``fd`` mapped copy-on-write; unmapped when the buffer goes.

    libc's mmap, not Python's: Python's keeps a duplicate of the fd for each
    mapping (before 3.13), an open file per mapping.
    """
    libc = _libc()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    address = libc.mmap(None, length, prot, mmap.MAP_PRIVATE, fd, offset)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    pages = (ctypes.c_char * length).from_address(address)
    pages.shm_keep = keep  # type: ignore[attr-defined]  # held as long as the mapping
    weakref.finalize(pages, libc.munmap, address, length)
    return pages


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.munmap.restype = ctypes.c_int
    return libc


#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1), which the fcntl module may not name.
_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


def _seal_future_writes(fd: int) -> bool:
    """Forbid every later write and writable mapping of ``fd``; False if unsupported."""
    if not hasattr(fcntl, "F_ADD_SEALS"):  # not Linux
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEAL_FUTURE_WRITE)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EPERM):  # a kernel without this seal
            return False
        raise
    return True


def reachable(handle: SegmentHandle) -> bool:
    """Whether another process can still map the segment ``handle`` names.

    False once its owner has exited or closed it (a result kept after its
    worker was replaced): only mappings made before then still reach it.
    Costs one ``stat`` (tens of microseconds through ``/proc``); the owner
    may still go away right after.
    """
    if handle.backend == "memfd" and handle.owner_pid == os.getpid():
        try:
            return os.fstat(handle.fd).st_ino == handle.inode
        except OSError:
            return False
    if handle.backend == "memfd":
        path = f"/proc/{handle.owner_pid}/fd/{handle.fd}"
    elif os.path.isdir(_DEV_SHM):
        path = os.path.join(_DEV_SHM, handle.name.lstrip("/"))
    else:  # no /dev/shm to look in (macOS): the name goes when its owner does
        return _pid_alive(handle.owner_pid)
    try:
        return os.stat(path).st_ino == handle.inode
    except OSError:
        return False


def _rebuild_segment(token: Any, handle: SegmentHandle) -> Segment:
    fd = fd_in_child(token)
    try:
        buf = map_fd(fd, handle.size)
    finally:
        os.close(fd)  # the mapping is all the child needs
    return Segment(buf, handle, False, -1, False)
