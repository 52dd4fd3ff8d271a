"""Zero-copy array views of arena memory, and how their lifetimes are counted.

An array in an arena is described by an :class:`ArrayDescriptor`: a few
integers, a dtype and a segment handle, small enough to ride in a ring record
when pickled. :func:`open_array` maps the segment (once per process) and
returns an ndarray over the same bytes: no copy, read-only unless asked (and
always read-only for a descriptor marked ``readonly``).

Lifetimes. Every view is built on an *anchor*: a tiny object that exports the
bytes through ``__array_interface__``. numpy keeps the anchor alive as the
base of the view and of every view derived from it (slices, reshapes, DLPack
exports), so the anchor dies exactly when the last of them does, and a
``weakref.finalize`` on it reports the release:

- in the arena's own process, to the arena (a local reference);
- in any other process, through the *release route* for that arena: a
  :class:`~shm.Ring` back to the owner, installed with
  :func:`set_release_route`. A descriptor carries one reference; opening it in
  another process takes that reference over, and the owner frees the
  allocation when the last reference anywhere is returned.

A descriptor made by forwarding (:meth:`Arena.share` of a view imported from
another arena) names the forwarder's arena but the foreign segment: the
opener maps the real owner's memory and returns its reference to the
forwarder, which holds the owner's memory until then.

Finalizers run inside garbage collection, at any point of any thread, so they
only append to a deque and then *try* a lock; whoever holds it flushes the
deque before letting go (CPython ``multiprocessing/heap.py``, bpo-12352).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import mmap
import os
import pickle
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import AttachError, RingClosedError
from ._platform import PAGE_SIZE
from ._ring import Ring
from ._segment import Segment, SegmentHandle, reachable

#: A release record: arena id, allocation id, references returned.
RELEASE = struct.Struct("<QQI")
#: Record size for rings made to carry releases (``Arena.link``).
RELEASE_RECORD_SIZE = RELEASE.size
#: How many segments of other processes stay mapped here after their last view died.
KEEP_MAPPED = 4
#: How many idle windows (writable mappings of other processes' segments) stay mapped.
KEEP_WINDOWS = 8


@dataclass(frozen=True)
class ArrayDescriptor:
    """A picklable description of an array living in an arena.

    ``offset`` is where the allocation starts in its segment, ``start`` where
    the array's first element is relative to it; ``strides`` may describe a
    non-contiguous view of the allocation. ``segment`` may belong to another
    process than the arena's owner (a forwarded view, see :meth:`Arena.share`).
    A ``readonly`` descriptor only ever opens as a read-only view.
    """

    arena_id: int
    alloc_id: int
    segment: SegmentHandle | None
    offset: int
    nbytes: int
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    start: int = 0
    readonly: bool = False

    @property
    def size_bytes(self) -> int:
        """Bytes of the array's data (not of the whole allocation)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def pack(self) -> bytes:
        """A compact encoding (about 100 bytes) for ring records; see :meth:`unpack`.

        Pickling uses it too: a descriptor travels with every task, and the
        generic pickle of a dataclass holding a dtype is 3x larger and 10x slower.
        """
        seg = self.segment
        name = seg.name.encode() if seg is not None and seg.name else b""
        dt = dtype_code(self.dtype)
        if len(dt) > 0xFFFF:
            raise ValueError(f"dtype {self.dtype} is too complex to describe in a descriptor")
        nd = len(self.shape)
        head = _DESC_HEAD.pack(
            self.arena_id,
            self.alloc_id,
            self.offset,
            self.nbytes,
            self.start,
            0 if seg is None else seg.owner_pid,
            -1 if seg is None else seg.fd,
            0 if seg is None else seg.inode,
            0 if seg is None else seg.size,
            (_NO_SEGMENT if seg is None else _BACKENDS.index(seg.backend))
            | (_READONLY if self.readonly else 0),
            nd,
            len(self.strides),
            len(dt),
            len(name),
        )
        dims = struct.pack(f"<{nd + len(self.strides)}q", *self.shape, *self.strides)
        return head + dims + dt + name

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> ArrayDescriptor:
        """The descriptor that :meth:`pack` encoded."""
        fields = _DESC_HEAD.unpack_from(data, 0)
        arena_id, alloc_id, offset, nbytes, start, pid, fd, inode, size = fields[:9]
        flags, nd, ns, nt, nn = fields[9:]
        backend = flags & ~_READONLY
        pos = _DESC_HEAD.size
        dims = struct.unpack_from(f"<{nd + ns}q", data, pos)
        pos += 8 * (nd + ns)
        dtype = dtype_from_code(bytes(data[pos : pos + nt]))
        pos += nt
        segment = None
        if backend != _NO_SEGMENT:
            name = bytes(data[pos : pos + nn]).decode()
            segment = SegmentHandle(_BACKENDS[backend], pid, fd, inode, name, size)
        shape, strides, ro = dims[:nd], dims[nd:], bool(flags & _READONLY)
        return cls(arena_id, alloc_id, segment, offset, nbytes, dtype, shape, strides, start, ro)

    def __reduce__(self) -> tuple[Any, ...]:
        return (ArrayDescriptor.unpack, (self.pack(),))


_DESC_HEAD = struct.Struct("<QQQQqqiQQBBBHB")
_BACKENDS = ("memfd", "posix")
# The backend byte: the backend's index (or _NO_SEGMENT), high bit set if read-only.
_NO_SEGMENT = 0x7F
_READONLY = 0x80
_dtype_codes: dict[np.dtype[Any], bytes] = {}
_code_dtypes: dict[bytes, np.dtype[Any]] = {}


def dtype_code(dtype: np.dtype[Any]) -> bytes:
    """A compact bytes code for ``dtype`` (cached): its type string, or its pickle.

    :func:`dtype_from_code` turns it back. Descriptors carry dtypes this way;
    so can anything else that ships arrays between processes.
    """
    code = _dtype_codes.get(dtype)
    if code is None:
        # ``dtype.str`` loses field names, offsets and sub-array shapes: pickle those.
        simple = dtype.fields is None and dtype.subdtype is None and np.dtype(dtype.str) == dtype
        code = b"s" + dtype.str.encode() if simple else b"p" + pickle.dumps(dtype)
        if len(_dtype_codes) < 1024:
            _dtype_codes[dtype] = code
    return code


def dtype_from_code(code: bytes) -> np.dtype[Any]:
    """The dtype :func:`dtype_code` encoded (cached)."""
    dtype = _code_dtypes.get(code)
    if dtype is None:
        dtype = np.dtype(code[1:].decode()) if code[:1] == b"s" else pickle.loads(code[1:])
        if len(_code_dtypes) < 1024:
            _code_dtypes[code] = dtype
    return dtype


class Anchor:
    """Exports ``nbytes`` bytes at ``address``; lives as long as any view of them."""

    __slots__ = ("__array_interface__", "__weakref__", "alloc_id", "arena_id", "keep")

    __array_interface__: dict[str, Any]

    def __init__(
        self, address: int, nbytes: int, readonly: bool, keep: Any, arena_id: int, alloc_id: int
    ) -> None:
        self.__array_interface__ = {  # numpy reads this; it keeps us as the base
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, readonly),
            "version": 3,
        }
        self.keep = keep  # the mapping: it must outlive every view
        self.arena_id = arena_id
        self.alloc_id = alloc_id

    @property
    def address(self) -> int:
        return int(self.__array_interface__["data"][0])

    @property
    def nbytes(self) -> int:
        return int(self.__array_interface__["shape"][0])

    @property
    def readonly(self) -> bool:
        return bool(self.__array_interface__["data"][1])


def build_view(
    anchor: Anchor,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    start: int,
) -> np.ndarray[Any, Any]:
    """An ndarray over an anchor's bytes; its ``.base`` chain ends at the anchor."""
    raw = np.asarray(anchor)
    view: np.ndarray[Any, Any] = np.ndarray(shape, dtype, buffer=raw, offset=start, strides=strides)
    return view


def find_anchor(array: np.ndarray[Any, Any]) -> Anchor | None:
    """The anchor under ``array``, if it is a view of arena memory."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    return base if isinstance(base, Anchor) else None


def in_shared_memory(array: Any) -> bool:
    """True if ``array`` is a view of arena memory, this process's or imported.

    Such an array crosses to another process without a copy: :meth:`Arena.share`
    describes it in place or forwards it; any other array is copied in first.
    """
    return isinstance(array, np.ndarray) and find_anchor(array) is not None


def segment_of(array: Any) -> Segment | None:
    """The mapped segment under an arena view; None for any other array.

    The whole mapping, so that a consumer can act on it once (a GPU stage
    page-locks it in place with ``cudaHostRegister``); it stays mapped for as
    long as the caller holds it or any view of it.
    """
    if not isinstance(array, np.ndarray):
        return None
    anchor = find_anchor(array)
    keep = anchor.keep if anchor is not None else None
    return keep if isinstance(keep, Segment) else None


def check_shareable(array: np.ndarray[Any, Any]) -> None:
    if array.dtype.hasobject:
        raise TypeError(
            f"arrays of dtype {array.dtype} hold pointers into one process and cannot "
            "be shared; convert them to a fixed-width dtype (e.g. 'U' or 'S') first"
        )


class _Deferred:
    """Work queued by finalizers, done by whoever gets the lock first."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[int, int, int]] = collections.deque()
        self.lock = threading.Lock()


class _Window:
    """A read-write mapping of a whole segment of another process; see ``_Importer.alone``."""

    __slots__ = ("seg", "spans")

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.spans: list[tuple[int, int]] = []  # byte ranges of live views, writable


def _uncovered(start: int, end: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[start, end)`` that no span covers."""
    parts = [(start, end)]
    for lo, hi in spans:
        if hi <= start or lo >= end:
            continue
        parts = [p for a, b in parts for p in ((a, min(b, lo)), (max(a, hi), b)) if p[0] < p[1]]
    return parts


class _Importer:
    """Per-process state for views of arenas owned by other processes."""

    def __init__(self) -> None:
        self.routes: dict[int, Ring] = {}
        self.mappings: weakref.WeakValueDictionary[tuple[int, int, bool], Segment] = (
            weakref.WeakValueDictionary()
        )
        self.recent: collections.deque[Segment] = collections.deque(maxlen=KEEP_MAPPED)
        # arena id -> pids owning the segments opened through it (more than the
        # arena's owner when it forwarded views of other processes' memory)
        self.owners: dict[int, set[int]] = {}
        self.deferred = _Deferred()
        self.dropped = 0  # releases for arenas with no route (their owner is gone)
        self.pid = os.getpid()
        # Owners of arenas whose route was removed: gone, or done with us.
        self.retired: set[int] = set()
        # Read-write mappings of whole segments for views opened ``alone``:
        # inaccessible (PROT_NONE) but for the pages of live views. See alone().
        self.windows: collections.OrderedDict[tuple[int, int], _Window] = collections.OrderedDict()
        # Spans of windows whose views died, closed by whoever gets the lock first.
        self.dead_spans: collections.deque[tuple[_Window, int, int]] = collections.deque()
        self.window_lock = threading.Lock()

    def segment(self, handle: SegmentHandle, readonly: bool) -> Segment:
        key = (handle.owner_pid, handle.inode, readonly)
        seg = self.mappings.get(key)
        if seg is None:
            seg = Segment.attach(handle, readonly=readonly)
            self.mappings[key] = seg
        # Keep the last few mapped after their views die: mapping a segment
        # costs an open and an mmap, far more than the rest of open_array. The
        # bound limits the memory a peer can keep alive after its owner freed it.
        recent = self.recent
        if recent and recent[-1] is not seg:
            with contextlib.suppress(ValueError):
                recent.remove(seg)
        if not recent or recent[-1] is not seg:
            recent.append(seg)
        return seg

    def alone(self, handle: SegmentHandle, start: int, length: int) -> _Window | None:
        """Make ``[start, start + length)`` of a segment writable here, alone; None if we cannot.

        Writable views of other processes' memory live in one read-write
        mapping of their whole segment (a *window*) that is inaccessible
        (PROT_NONE) except for the pages of live writable views: code that
        writes past its array reaches nothing (it faults). When a view's last
        reference goes, its pages are made inaccessible again but stay mapped,
        so the next call that writes them (a pipeline's output blocks, a
        buffer written call after call) finds their page tables warm: a fresh
        mapping would fault in every page again, most of a call's cost for
        arrays of a few hundred KiB. None where ``mprotect`` is missing: the
        caller then maps the span on its own.
        """
        with self.window_lock:
            self._close_spans()
            key = (handle.owner_pid, handle.inode)
            win = self.windows.get(key)
            if win is None:
                seg = Segment.attach(handle, readonly=False)
                if not _protect(seg.address, seg.size, _PROT_NONE):
                    return None
                win = self.windows[key] = _Window(seg)
                idle = [k for k, w in self.windows.items() if not w.spans and w is not win]
                for k in idle[: max(0, len(self.windows) - KEEP_WINDOWS)]:
                    del self.windows[k]  # unmapped with its Segment, once no view holds it
            else:
                self.windows.move_to_end(key)
            if not _protect(win.seg.address + start, length, mmap.PROT_READ | mmap.PROT_WRITE):
                return None
            win.spans.append((start, start + length))
        return win

    def close_span(self, win: _Window, start: int, end: int) -> None:
        """Finalizer of the views of a window's span: never blocks, never raises."""
        self.dead_spans.append((win, start, end))
        while self.dead_spans and self.window_lock.acquire(blocking=False):
            try:
                self._close_spans()
            finally:
                self.window_lock.release()

    def _close_spans(self) -> None:
        """Make the pages of dead views inaccessible, but those a live view spans (lock held)."""
        while self.dead_spans:
            win, start, end = self.dead_spans.popleft()
            win.spans.remove((start, end))
            for lo, hi in _uncovered(start, end, win.spans):
                _protect(win.seg.address + lo, hi - lo, _PROT_NONE)

    def released(self, arena_id: int, alloc_id: int) -> None:
        """Finalizer of an imported view: never blocks, never raises."""
        if self.pid != os.getpid():
            # A view inherited through fork: the route rings are the parent's
            # (one producer each); the parent releases its own views.
            return
        self.deferred.items.append((arena_id, alloc_id, 1))
        self.flush()

    def flush(self) -> None:
        d = self.deferred
        # Loop: a finalizer may append after our drain but before our release.
        while d.items and d.lock.acquire(blocking=False):
            try:
                done = self._drain(d.items)
            finally:
                d.lock.release()
            if not done:
                return

    def _drain(self, items: collections.deque[tuple[int, int, int]]) -> bool:
        """Push queued releases; False if a route ring is full."""
        while items:
            arena_id, alloc_id, n = items[0]
            route = self.routes.get(arena_id)
            if route is None:
                self.dropped += 1
            else:
                try:
                    if not route.try_push(RELEASE.pack(arena_id, alloc_id, n)):
                        return False  # ring full: retried at the next flush
                except (RingClosedError, OSError):
                    self.dropped += 1  # the owner is gone, and its memory with it
            items.popleft()
        return True


_importer = _Importer()
_importer_pid = os.getpid()


def importer() -> _Importer:
    """This process's importer (a fresh one after ``fork``)."""
    global _importer, _importer_pid
    if _importer_pid != os.getpid():
        _importer, _importer_pid = _Importer(), os.getpid()
    return _importer


def set_release_route(arena_id: int, ring: Ring | None) -> None:
    """Send releases of views of arena ``arena_id`` through ``ring`` (or stop).

    Call it in a process that will open descriptors of an arena owned by
    another process, with the ring made by that arena's :meth:`Arena.link`.
    """
    imp = importer()
    if ring is None:
        imp.routes.pop(arena_id, None)
        # Its owner is done with us: keep none of its segments mapped for reuse.
        owners = imp.owners.pop(arena_id, set())
        imp.retired |= owners
        for seg in [s for s in imp.recent if s.handle.owner_pid in owners]:
            imp.recent.remove(seg)
        for key in [k for k in imp.windows if k[0] in owners]:
            del imp.windows[key]
    else:
        imp.routes[arena_id] = ring
        imp.flush()


def owner_gone(handle: SegmentHandle) -> bool:
    """Whether no other process can map ``handle``'s segment any more; cheap.

    For our own segments: their fd is closed. For another process's: the
    release route of an arena we opened its memory through was removed
    (:func:`set_release_route` with ``None``), which a peer does once that
    owner is gone. Between the owner's death and that, this says it is not.
    """
    if handle.owner_pid == os.getpid():
        return not reachable(handle)
    return handle.owner_pid in importer().retired


def flush_releases() -> None:
    """Push releases that found their route ring full; cheap when none wait."""
    importer().flush()


# The arena registers itself here so that opening one's own descriptor stays local.
local_arenas: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def open_array(
    desc: ArrayDescriptor, writable: bool = False, alone: bool = False
) -> np.ndarray[Any, Any]:
    """Open a descriptor as a zero-copy ndarray (read-only unless ``writable``).

    Takes over the reference the descriptor carries: open each descriptor once.
    A ``readonly`` descriptor gives a read-only view even if ``writable``.

    Memory of another process is mapped read-only, a segment once for all
    its views. A writable view shares one read-write mapping of its segment
    with other writable views, or, ``alone``, gets a mapping of its own of
    just the pages it spans, inaccessible once it goes (see
    ``_Importer.alone``): code that writes past the array then reaches
    nothing but those pages (or faults).
    """
    writable = writable and not desc.readonly
    if desc.segment is None:  # no bytes: nothing was allocated
        out: np.ndarray[Any, Any] = np.ndarray(desc.shape, desc.dtype, strides=desc.strides or None)
        out.flags.writeable = writable
        return out
    arena = local_arenas.get(desc.arena_id)
    # Our own arena (not a forked copy of our parent's): its allocations, and
    # its proxies of other processes' memory, are opened without the importer.
    # A deliberate seam inside shm: views of an arena's own memory are its to open.
    if arena is not None and arena._pid == os.getpid():  # noqa: SLF001
        view: np.ndarray[Any, Any] = arena._open_local(desc, writable)  # noqa: SLF001
        return view
    imp = importer()
    if desc.arena_id not in imp.routes:
        raise AttachError(
            f"no release route to arena {desc.arena_id:#x} (the descriptor maps memory "
            f"of process {desc.segment.owner_pid}) in this process: call "
            "shm.set_release_route(arena_id, ring) with a ring from Arena.link() first, "
            "so that the memory can be given back when the view is gone"
        )
    imp.flush()
    imp.owners.setdefault(desc.arena_id, set()).add(desc.segment.owner_pid)
    imp.retired.discard(desc.segment.owner_pid)  # alive: a recycled pid, say
    keep: Any
    win = None
    if writable and alone:
        lo, hi = byte_extent(desc)
        first = (desc.offset + lo) // PAGE_SIZE * PAGE_SIZE
        end = min(-(-(desc.offset + hi) // PAGE_SIZE) * PAGE_SIZE, desc.segment.size)
        win = imp.alone(desc.segment, first, end - first)
        # The window itself, not its Segment, keeps the view's memory: a
        # consumer asking for the whole mapping (segment_of) must not get pages
        # that are inaccessible here.
        keep = win if win is not None else Segment.attach(desc.segment, False, first, end - first)
        address = (win.seg.address if win is not None else keep.address - first) + desc.offset
    else:
        keep = imp.segment(desc.segment, readonly=not writable)
        address = keep.address + desc.offset - keep.offset
    anchor = Anchor(address, desc.nbytes, not writable, keep, desc.arena_id, desc.alloc_id)
    if win is not None:
        weakref.finalize(anchor, imp.close_span, win, first, end)
    weakref.finalize(anchor, imp.released, desc.arena_id, desc.alloc_id)
    return build_view(anchor, desc.dtype, desc.shape, desc.strides, desc.start)


_PROT_NONE = 0
_mprotect: Any = None


def _protect(address: int, length: int, prot: int) -> bool:
    """Set the access of mapped pages (``mprotect``); False where it cannot."""
    global _mprotect
    if _mprotect is None:
        fn: Any = False
        with contextlib.suppress(OSError, AttributeError):  # no libc mprotect: False
            fn = ctypes.CDLL(None, use_errno=True).mprotect
            fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            fn.restype = ctypes.c_int
        _mprotect = fn
    return bool(_mprotect) and _mprotect(address, length, prot) == 0


def byte_extent(desc: ArrayDescriptor) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of its allocation that a descriptor's array touches."""
    lo = hi = desc.start
    for n, step in zip(desc.shape, desc.strides or _c_strides(desc), strict=True):
        if n == 0:
            return desc.start, desc.start
        if step < 0:
            lo += (n - 1) * step
        else:
            hi += (n - 1) * step
    return lo, hi + desc.dtype.itemsize


def _c_strides(desc: ArrayDescriptor) -> tuple[int, ...]:
    strides, step = [], desc.dtype.itemsize
    for n in reversed(desc.shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
