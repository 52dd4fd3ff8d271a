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
weak reference's callback on it (:func:`on_release`, a lean
``weakref.finalize``) reports the release:

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

import atexit
import collections
import contextlib
import ctypes
import math
import mmap
import os
import pickle
import struct
import sys
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np

from ._errors import AttachError, RingClosedError
from ._platform import PAGE_SIZE
from ._ring import Ring
from ._segment import Segment, SegmentHandle, reachable

#: A release record: arena id, allocation id, references returned.
RELEASE = struct.Struct("<QQI")
#: Record size for rings made to carry releases (``Arena.link``).
RELEASE_RECORD_SIZE = RELEASE.size
#: How many segments of other processes stay mapped here after their last view died
#: (besides each live peer's last one: see ``_Importer.segment``).
KEEP_MAPPED = 4
#: How many idle windows (writable mappings of other processes' segments) stay mapped.
KEEP_WINDOWS = 8


class ArrayDescriptor(NamedTuple):
    """A picklable description of an array living in an arena.

    ``offset`` is where the allocation starts in its segment, ``start`` where
    the array's first element is relative to it; ``strides`` may describe a
    non-contiguous view of the allocation. ``segment`` may belong to another
    process than the arena's owner (a forwarded view, see :meth:`Arena.share`).
    A ``readonly`` descriptor only ever opens as a read-only view.

    A named tuple, not a dataclass: one is made and read at each end of every
    call that passes an array by descriptor, and a frozen dataclass costs
    several times as much to build.
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
        generic pickle of a tuple holding a dtype is 3x larger and 10x slower.
        Only the first 41 bytes change from one allocation to the next; the
        rest (segment, dtype, shape, strides) is made once and cached.
        """
        flags = _READONLY if self.readonly else 0
        head = _DESC_HEAD.pack(
            self.arena_id, self.alloc_id, self.offset, self.nbytes, self.start, flags
        )
        # The tail whole, cached by segment and geometry: no Python call when it recurs.
        seg = self.segment
        key = (id(seg), self.dtype, self.shape, self.strides)
        hit = _tail_codes.get(key)
        if hit is None or hit[0] is not seg:
            tail = _segment_code(seg) + _geometry_code(self.dtype, self.shape, self.strides)
            if len(_tail_codes) >= _CACHE_MAX:
                _tail_codes.clear()
            hit = _tail_codes[key] = (seg, tail)
        return head + hit[1]

    def at(self, start: int, packed: bytes) -> tuple[ArrayDescriptor, bytes]:
        """This descriptor and its :meth:`pack` (``packed``) for the same array at ``start``
        instead: only the packed head's ``start`` changes (a slab's blocks)."""
        return (
            new_descriptor(*self[:8], start, self.readonly),
            packed[:_START_AT] + _START.pack(start) + packed[_START_AT + 8 :],
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> ArrayDescriptor:
        """The descriptor that :meth:`pack` encoded."""
        return unpack_descriptor(data, len(data))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack_bytes, (self.pack(),))


def unpack_descriptor(data: bytes | bytearray | memoryview, end: int) -> ArrayDescriptor:
    """The descriptor packed in ``data[:end]`` (:meth:`ArrayDescriptor.unpack`)."""
    arena_id, alloc_id, offset, nbytes, start, flags = _DESC_HEAD.unpack_from(data, 0)
    tail = bytes(data[_DESC_HEAD.size : end])
    parsed = _tails.get(tail)
    if parsed is None:
        parsed = _parse_tail(tail)
        if len(_tails) >= _CACHE_MAX:
            _tails.clear()
        _tails[tail] = parsed
    segment, dtype, shape, strides = parsed
    return _new_tuple(
        ArrayDescriptor,
        (arena_id, alloc_id, segment, offset, nbytes, dtype, shape, strides, start, flags & 1 == 1),
    )


def _unpack_bytes(data: bytes) -> ArrayDescriptor:
    return unpack_descriptor(data, len(data))


def new_descriptor(
    arena_id: int,
    alloc_id: int,
    segment: SegmentHandle | None,
    offset: int,
    nbytes: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    start: int,
    readonly: bool,
) -> ArrayDescriptor:
    """``ArrayDescriptor(...)`` with every field given, without the keyword parsing."""
    return _new_tuple(
        ArrayDescriptor,
        (arena_id, alloc_id, segment, offset, nbytes, dtype, shape, strides, start, readonly),
    )


_new_tuple = tuple.__new__
# A packed descriptor: this head (what changes from one allocation to the
# next: arena, allocation, offset, size, start, flags), then the segment's
# code and the geometry's (each cached: they recur call after call).
_DESC_HEAD = struct.Struct("<QQQQqB")
_START = struct.Struct("<q")  # a packed head's ``start``, at _START_AT
_START_AT = 32
_SEG_CODE = struct.Struct("<qiQQBH")  # owner pid, fd, inode, size, backend, name length
_GEO_CODE = struct.Struct("<BBH")  # ndim, len(strides), dtype code length
_BACKENDS = ("memfd", "posix")
_NO_SEGMENT = 0xFF
_READONLY = 1
_CACHE_MAX = 1024
# id(handle) -> (handle, code): the handle is kept, so its id is not reused meanwhile.
_segment_codes: dict[int, tuple[SegmentHandle | None, bytes]] = {}
_geometry_codes: dict[tuple[np.dtype[Any], tuple[int, ...], tuple[int, ...]], bytes] = {}
# (id(handle), dtype, shape, strides) -> (handle, the two codes): kept as _segment_codes.
_tail_codes: dict[
    tuple[int, np.dtype[Any], tuple[int, ...], tuple[int, ...]], tuple[SegmentHandle | None, bytes]
] = {}
_Tail = tuple[SegmentHandle | None, np.dtype[Any], tuple[int, ...], tuple[int, ...]]
_tails: dict[bytes, _Tail] = {}


def _segment_code(seg: SegmentHandle | None) -> bytes:
    hit = _segment_codes.get(id(seg))
    if hit is not None and hit[0] is seg:
        return hit[1]
    if seg is None:
        code = _SEG_CODE.pack(0, -1, 0, 0, _NO_SEGMENT, 0)
    else:
        name = seg.name.encode() if seg.name else b""
        backend = _BACKENDS.index(seg.backend)
        code = _SEG_CODE.pack(seg.owner_pid, seg.fd, seg.inode, seg.size, backend, len(name))
        code += name
    if len(_segment_codes) >= _CACHE_MAX:
        _segment_codes.clear()
    _segment_codes[id(seg)] = (seg, code)
    return code


def _geometry_code(dtype: np.dtype[Any], shape: tuple[int, ...], strides: tuple[int, ...]) -> bytes:
    key = (dtype, shape, strides)
    code = _geometry_codes.get(key)
    if code is None:
        dt = dtype_code(dtype)
        if len(dt) > 0xFFFF:
            raise ValueError(f"dtype {dtype} is too complex to describe in a descriptor")
        nd, ns = len(shape), len(strides)
        code = _GEO_CODE.pack(nd, ns, len(dt)) + struct.pack(f"<{nd + ns}q", *shape, *strides)
        code += dt
        if len(_geometry_codes) >= _CACHE_MAX:
            _geometry_codes.clear()
        _geometry_codes[key] = code
    return code


def _parse_tail(tail: bytes) -> _Tail:
    pid, fd, inode, size, backend, nn = _SEG_CODE.unpack_from(tail, 0)
    pos = _SEG_CODE.size
    segment = None
    if backend != _NO_SEGMENT:
        name = tail[pos : pos + nn].decode()
        segment = SegmentHandle(_BACKENDS[backend], pid, fd, inode, name, size)
    pos += nn
    nd, ns, nt = _GEO_CODE.unpack_from(tail, pos)
    pos += _GEO_CODE.size
    dims = struct.unpack_from(f"<{nd + ns}q", tail, pos)
    pos += 8 * (nd + ns)
    dtype = dtype_from_code(tail[pos : pos + nt])
    if pos + nt != len(tail):
        raise ValueError("not a packed array descriptor")
    return segment, dtype, dims[:nd], dims[nd:]


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

    __slots__ = (
        "__array_interface__",
        "__weakref__",
        "address",
        "alloc_id",
        "arena_id",
        "first",
        "first_start",
        "keep",
        "nbytes",
        "readonly",
        "span",
    )

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
        self.address = address
        self.nbytes = nbytes
        self.readonly = readonly
        self.keep = keep  # the mapping: it must outlive every view
        self.arena_id = arena_id
        self.alloc_id = alloc_id
        # The view made with an allocation, and its start: sharing it needs no
        # pointer read (``__array_interface__`` costs a microsecond).
        self.first: weakref.ref[np.ndarray[Any, Any]] | None = None
        self.first_start = 0
        # A writable view opened ``alone``: the release that closes its pages (see revoke).
        self.span: _Release | None = None


class _Release(weakref.ref):  # type: ignore[type-arg]
    """Calls ``fn(*args)``, then ``then()``, once its anchor is gone: a lean ``weakref.finalize``.

    Every view opened or made costs one, so it does only what a release needs
    (``weakref.finalize`` costs 3x as much to make and fire). As with
    ``finalize``, the pending ones run at interpreter exit (before modules are
    torn down), and never after.
    """

    __slots__ = ("args", "fn", "then")
    fn: Any
    args: tuple[Any, ...]
    then: Any


# Made, not fired yet: the refs must stay alive to fire. By id: weak references
# to one live object compare (and hash) equal, and a window's view has two.
_pending: dict[int, _Release] = {}
_exit_hooked = False
_exited = False


def on_release(
    anchor: Anchor,
    fn: Any,
    *args: Any,
    then: Any = None,
    settle: list[Any] | None = None,
) -> _Release:
    """Call ``fn(*args)``, then ``then()``, when ``anchor`` (the last view of its bytes) is gone.

    A Ctrl-C can land as ``fn`` starts (a Python function's first line) and is
    then printed and forgotten (a finalizer's): a release that must not be
    lost makes ``fn`` a C function that records it (a queue's ``append``, done
    before any interrupt can land) and ``then`` what acts on the record.

    The release is armed in one step with no call (where no ``KeyboardInterrupt``
    lands): an interrupt before it leaves none (the anchor's going does nothing),
    one after it leaves it whole. ``settle``: a list emptied in that step, for
    a caller that must know whether the release was armed.
    """
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        atexit.register(_fire_all)
    ref = _Release(anchor, _fire)
    ref.fn = None  # not armed: should the anchor go first, its release does nothing
    key = id(ref)
    if settle is None:
        ref.args = args
        ref.then = then
        _pending[key] = ref
        ref.fn = fn
    else:
        ref.args = args
        ref.then = then
        _pending[key] = ref
        ref.fn = fn
        del settle[:]
    return ref


def _fire(ref: _Release) -> None:
    if _exited:
        return
    # Claimed by taking its function, with no call between the claim and the
    # call (where an interrupt could land): it runs once, here or at exit.
    fn, ref.fn = ref.fn, None
    try:
        if fn is not None:
            fn(*ref.args)
            if ref.then is not None:
                ref.then()
    finally:
        _pending.pop(id(ref), None)


def _fire_all() -> None:
    """At exit: run the pending releases now, as ``weakref.finalize`` does."""
    global _exited
    for ref in list(_pending.values()):
        try:
            _fire(ref)
        except Exception:
            sys.excepthook(*sys.exc_info())
    _exited = True


def build_view(
    anchor: Anchor,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    start: int,
) -> np.ndarray[Any, Any]:
    """An ndarray over an anchor's bytes; its ``.base`` chain ends at the anchor."""
    # Positional: numpy parses keywords several times slower.
    view: np.ndarray[Any, Any] = np.ndarray(shape, dtype, np.asarray(anchor), start, strides)
    return view


def revoke(array: np.ndarray[Any, Any]) -> bool:
    """Make a writable view opened ``alone`` inaccessible now, however many hold it.

    Its pages fault from here on, through any view of them (see
    ``_Importer.alone``), as they would once its last view were gone: for
    code that lends a writable view for a while and must know that nothing
    writes through it afterwards. False where ``array`` is no such view (or
    ``mprotect`` is missing): nothing was done.
    """
    anchor = find_anchor(array)
    ref = anchor.span if anchor is not None else None
    if ref is None:
        return False
    anchor.span = None  # type: ignore[union-attr]
    _fire(ref)  # once: the release finds nothing left to do when the view goes
    return True


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
        # (owner pid, readonly) -> the segment of that owner's last view opened
        self.latest: dict[tuple[int, bool], Segment] = {}
        # arena id -> pids owning the segments opened through it (more than the
        # arena's owner when it forwarded views of other processes' memory)
        self.owners: dict[int, set[int]] = {}
        self.deferred = _Deferred()
        self.dropped = 0  # releases for arenas with no route (their owner is gone)
        # Owners of arenas whose route was removed: gone, or done with us.
        self.retired: set[int] = set()
        # Read-write mappings of whole segments for views opened ``alone``:
        # inaccessible (PROT_NONE) but for the pages of live views. See alone().
        self.windows: collections.OrderedDict[tuple[int, int], _Window] = collections.OrderedDict()
        # Spans of windows whose views died, closed by whoever gets the lock first.
        self.dead_spans: collections.deque[tuple[_Window, int, int]] = collections.deque()
        self.window_lock = threading.Lock()

    def segment(self, handle: SegmentHandle, readonly: bool) -> Segment:
        recent = self.recent
        if recent:
            # The segment of the last view opened, nearly always: descriptors
            # of one segment share one handle object (see unpack_descriptor).
            last = recent[-1]
            if last.handle is handle and last.readonly == readonly:
                return last
        latest = self.latest.get((handle.owner_pid, readonly))
        if latest is not None and latest.handle.inode == handle.inode:
            seg = latest
        else:
            key = (handle.owner_pid, handle.inode, readonly)
            found = self.mappings.get(key)
            if found is None:
                found = Segment.attach(handle, readonly=readonly)
                self.mappings[key] = found
            seg = found
            if handle.owner_pid not in self.retired:
                self.latest[handle.owner_pid, readonly] = seg
        # Keep the last few mapped after their views die, and each live peer's
        # last one: mapping a segment costs an open, an fstat and an mmap (and
        # its munmap), far more than the rest of open_array, and results come
        # from W workers in turn (a DataLoader's batches): with only the last
        # few kept, every batch past 4 workers mapped its segment anew. The
        # bounds limit the memory a peer can keep alive after its owner freed
        # it: one segment per live peer (dropped with its route), a few more.
        if recent and recent[-1] is not seg and seg in recent:  # not contextlib.suppress:
            recent.remove(seg)  # its three calls, on most results from W workers in turn
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
        if self is not _importer:
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


def _forked() -> None:
    global _importer
    _importer = _Importer()


# A child gets a fresh importer: its parent's routes are the parent's to use.
os.register_at_fork(after_in_child=_forked)


def importer() -> _Importer:
    """This process's importer (a fresh one after ``fork``)."""
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
        for gone in [k for k in imp.latest if k[0] in owners]:
            del imp.latest[gone]
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


# The arena registers itself here so that opening one's own descriptor stays
# local. Weak references in a plain dict: a WeakValueDictionary's miss (every
# descriptor of another process's arena) costs a caught KeyError.
local_arenas: dict[int, weakref.ref[Any]] = {}


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
    handle = desc.segment
    if handle is None:  # no bytes: nothing was allocated
        out: np.ndarray[Any, Any] = np.ndarray(desc.shape, desc.dtype, strides=desc.strides or None)
        out.flags.writeable = writable
        return out
    ref = local_arenas.get(desc.arena_id)
    arena = ref() if ref is not None else None
    # Our own arena (not a forked copy of our parent's): its allocations, and
    # its proxies of other processes' memory, are its to open, without the importer.
    if arena is not None:
        view: np.ndarray[Any, Any] | None = arena.open_own(desc, writable)
        if view is not None:
            return view
    imp = _importer
    if desc.arena_id not in imp.routes:
        raise AttachError(
            f"no release route to arena {desc.arena_id:#x} (the descriptor maps memory "
            f"of process {handle.owner_pid}) in this process: call "
            "shm.set_release_route(arena_id, ring) with a ring from Arena.link() first, "
            "so that the memory can be given back when the view is gone"
        )
    if imp.deferred.items:
        imp.flush()
    owners = imp.owners.get(desc.arena_id)
    if owners is None:
        owners = imp.owners[desc.arena_id] = set()
    owners.add(handle.owner_pid)
    if imp.retired:
        imp.retired.discard(handle.owner_pid)  # alive: a recycled pid, say
    keep: Any
    win = None
    if writable and alone:
        lo, hi = byte_extent(desc)
        first = (desc.offset + lo) // PAGE_SIZE * PAGE_SIZE
        end = min(-(-(desc.offset + hi) // PAGE_SIZE) * PAGE_SIZE, handle.size)
        win = imp.alone(handle, first, end - first)
        # The window itself, not its Segment, keeps the view's memory: a
        # consumer asking for the whole mapping (segment_of) must not get pages
        # that are inaccessible here.
        keep = win if win is not None else Segment.attach(handle, False, first, end - first)
        address = (win.seg.address if win is not None else keep.address - first) + desc.offset
    else:
        keep = imp.segment(handle, not writable)
        address = keep.address + desc.offset - keep.offset
    anchor = Anchor(address, desc.nbytes, not writable, keep, desc.arena_id, desc.alloc_id)
    if win is not None:
        anchor.span = on_release(anchor, imp.close_span, win, first, end)
    on_release(anchor, imp.released, desc.arena_id, desc.alloc_id)
    # build_view, inline (a result's every array opens here)
    opened: np.ndarray[Any, Any] = np.ndarray(
        desc.shape, desc.dtype, np.asarray(anchor), desc.start, desc.strides
    )
    return opened


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
