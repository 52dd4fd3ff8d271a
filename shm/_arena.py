"""Arenas: variable-size allocations in shared memory, freed from any process.

An arena belongs to the process that made it. It reserves one segment up
front and adds segments when full, up to ``capacity``; every allocation is
64-byte aligned and is freed when its last reference is gone:

- a *local* reference for each live view in this process (``empty``, ``put``,
  ``open_array`` of its own descriptors);
- an *exported* reference for each :class:`ArrayDescriptor` made by
  :meth:`Arena.share`, returned when the process that opened it drops its
  last view (through a ring from :meth:`Arena.link`), or taken over by a
  view if the descriptor is opened here.

::

    owner process                              peer process
    ┌──────────────────────────┐  descriptor   ┌──────────────────────────┐
    │ Arena                    │ ────────────▶ │ open_array(desc)         │
    │  segments (memfd) ◀─ ─ ─ ┼ ─ ─ mmap ─ ─ ─┤  zero-copy view          │
    │  FreeList per segment    │               │  anchor finalizer        │
    │  collect() ◀─────────────┼── link Ring ◀─┤  release(alloc id)       │
    └──────────────────────────┘               └──────────────────────────┘

Releases made by garbage collection never block: they are queued and the
queue is drained by whoever next holds the arena's lock.

*Forwarding*: sharing a view of another arena's memory (typically one this
process imported from another process) copies nothing. The arena records a
*proxy* allocation holding the view's anchor, so the real owner keeps the
memory, and hands out a descriptor naming this arena (releases come back
here) and the foreign segment (the peer maps the owner's memory directly).
When the proxy's last reference is gone it lets go of the anchor, whose own
release then goes back to the owner. A proxy has no bytes here.

The segments and the blocks cut from them (where an allocation goes, how a
freed block goes back) are kept by :class:`~shm._blocks.Blocks`, which
:class:`Arena` extends with the sharing, the views and the releases.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from ._blocks import FIRST_COMMIT, Alloc, Blocks, MiB, Seg, new_segment, round_up
from ._errors import SharedMemoryError
from ._hints import Hints
from ._platform import ALIGNMENT, PAGE_SIZE
from ._ring import Ring, RingStats
from ._segment import Segment, format_bytes
from ._views import (
    RELEASE,
    Anchor,
    ArrayDescriptor,
    build_view,
    check_shareable,
    find_anchor,
    local_arenas,
    new_descriptor,
    on_release,
    owner_gone,
)

#: :meth:`Arena.share_described` reads the releases peers sent back every this
#: many calls (a pipeline's batch blocks: ~200 bytecodes a batch less than at
#: each), so at most this many of its releases wait besides an allocation's.
COLLECT_EVERY = 16


def _forget(arena_id: int, ref: Any) -> None:
    """An arena collected without ``close()``: drop its entry (if still its own)."""
    if local_arenas.get(arena_id) is ref:
        del local_arenas[arena_id]


def _compact(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], tuple[int, ...] | None]:
    """The part of ``arr`` to copy, and the strides that rebuild ``arr`` over its copy.

    An array with broadcast axes (stride 0 over more than one element:
    ``np.broadcast_to``) holds far fewer bytes than it shows; those axes are
    taken once. ``None``: copy all of it.
    """
    broadcast = [st == 0 and n > 1 for n, st in zip(arr.shape, arr.strides, strict=True)]
    if arr.size == 0 or not any(broadcast):
        return arr, None
    core = arr[tuple(0 if b else slice(None) for b in broadcast)]
    dense, step = [], arr.itemsize
    for n in reversed(core.shape):
        dense.append(step)
        step *= n
    it = reversed(dense)
    return core, tuple(0 if b else next(it) for b in broadcast)


_NOWAIT = (False,)  # lock.acquire(False), by map (see Arena._drain_deferred)

__all__ = ["FIRST_COMMIT", "Arena", "ArenaStats"]  # FIRST_COMMIT: importable here, as before


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of an arena's memory: cheap to take, printed by benchmarks.

    ``allocations`` and ``exported`` count forwarding proxies too; ``in_use``
    and ``peak`` count only bytes in this arena's own segments.
    """

    name: str
    capacity: int
    reserved: int
    in_use: int
    peak: int
    allocations: int
    segments: int
    exported: int
    releases_received: int
    links: tuple[RingStats, ...] = ()
    #: Bytes :meth:`Arena.share` copied in (arrays from outside, or whose owner is gone).
    bytes_copied: int = 0

    def __str__(self) -> str:
        return (
            f"{self.name}: {format_bytes(self.in_use)} in use by {self.allocations} "
            f"allocations (peak {format_bytes(self.peak)}), {format_bytes(self.reserved)} "
            f"reserved in {self.segments} segments of a {format_bytes(self.capacity)} cap, "
            f"{self.exported} references held by descriptors"
        )


def _default_capacity() -> int:
    import psutil

    return max(256 * MiB, int(psutil.virtual_memory().total) // 2)


class Arena(Blocks):
    """Shared memory for arrays, owned by this process, shared by descriptor.

    ``segment_size`` is the unit of growth; a segment's memory is committed
    (reserved, so that running out is an error, not SIGBUS) as allocations
    reach it: :data:`FIRST_COMMIT` at once, then doubling;
    ``capacity`` caps the total reserved (default: half the machine's memory).
    ``sealed``: no other process can write this arena's memory, however it
    maps it (see :meth:`Segment.create`), but for allocations made
    ``peer_writable``, which get segments of their own.
    ``discard_min``: see the attribute.
    Close it with :meth:`close` (or a ``with`` block); arrays handed out stay
    valid after that for as long as they are referenced.
    """

    def __init__(
        self,
        segment_size: int = 64 * MiB,
        capacity: int | None = None,
        backend: str | None = None,
        name: str = "arena",
        sealed: bool = False,
        discard_min: int | None = None,
    ) -> None:
        if segment_size <= 0:
            raise ValueError(f"segment_size must be positive, not {segment_size}")
        self.name = name
        self.id = secrets.randbits(63)
        self.segment_size = segment_size
        self.capacity = _default_capacity() if capacity is None else capacity
        if segment_size > self.capacity:
            raise ValueError(
                f"segment_size {format_bytes(segment_size)} exceeds the arena's capacity "
                f"of {format_bytes(self.capacity)}"
            )
        self.backend = backend
        self.sealed = sealed
        #: Freed allocations of at least this many bytes give their whole pages
        #: back to the system (and are committed again when reused): memory
        #: follows what is live instead of the arena's high-water mark, for the
        #: price of zeroing those pages again (~0.7 ms a MiB). ``None`` (the
        #: default) keeps freed pages resident, so that a call's cost stays flat
        #: in array size. Unsealed segments on Linux only.
        self.discard_min = discard_min
        #: With :attr:`discard_min`: bytes of those freed pages kept resident
        #: anyway, the most recently freed first, for the next allocations to
        #: take warm (a loader's next batch); the older ones are given back.
        #: A bound, not a reservation: 0 (the default) gives every one back.
        self.keep_free = 0
        # Freed pages not given back yet, oldest first (lock held): given back
        # after the next allocation, but for the newest keep_free bytes.
        self._discard: list[tuple[Seg, int, int]] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        # Views' releases (alloc ids; an Alloc once its reference is dropped).
        self._deferred: collections.deque[int | Alloc] = collections.deque()
        self._segs: list[Seg] = []
        self._allocs: dict[int, Alloc] = {}
        self._proxies: dict[int, Alloc] = {}  # id(source anchor) -> its proxy
        self._next_id = 1
        self._in_use = 0
        self._peak = 0
        # An allocation under way that a Ctrl-C may cut off from its caller (see _untake):
        # a block taken and not recorded yet; one recorded and not yet held.
        self._taking = False
        self._fresh: list[Alloc] = []
        # Release records taken off a link ring and not applied yet, the ring's book of
        # what its peer owes (see _apply_collected); an allocation whose free was cut short.
        self._collected: list[bytes] = []
        self._collected_owed: dict[int, int] = {}
        self._checking: list[Alloc] = []
        self._exported = 0
        self._releases = 0
        self._shared_unread = 0  # share_described() calls since it read releases
        self.bytes_copied = 0  # by share(): a statistic, read without the lock
        self._links: list[Ring] = []
        # Rings made here carry a flag their producer sets (see _hints.py); the
        # others (adopted, or past the page of flags) are looked at every time.
        self._hints = Hints(backend)
        self._plain: list[Ring] = []
        self._owed: dict[int, dict[int, int]] = {}  # id(link) -> alloc id -> refs
        self._closed = False
        self._segs.append(new_segment(segment_size, backend, sealed))
        local_arenas[self.id] = weakref.ref(self, functools.partial(_forget, self.id))

    # ------------------------------------------------------------- allocating
    def empty(
        self,
        shape: int | tuple[int, ...],
        dtype: DTypeLike = np.float64,
        tag: str = "",
        peer_writable: bool = False,
    ) -> np.ndarray[Any, Any]:
        """A new, writable, uninitialised C-contiguous array in this arena.

        ``peer_writable``: other processes may open it writable. It starts on
        a page boundary and no other allocation shares its pages, so a peer
        that opens it ``alone`` (mapping just the pages it spans) can reach
        nothing else through them; in a ``sealed`` arena it lives in a segment
        left open to writing.
        """
        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if dt.hasobject:
            check_shareable(np.empty(0, dt))
        if shp and min(shp) < 0:
            raise ValueError(f"negative dimensions are not allowed: {shp}")
        nbytes = math.prod(shp) * dt.itemsize  # np.prod costs 30x more, on every allocation
        if nbytes == 0:
            return np.empty(shp, dt)
        if not peer_writable:
            anchor, _ = self._allocate(nbytes, tag, not self.sealed)
            start = 0
        else:
            span = round_up(nbytes, PAGE_SIZE)
            if not self.sealed:
                # Its segments hold packed blocks too: enough for whole pages from the
                # first page boundary of the block on. In a sealed arena they hold only
                # these whole-page blocks, so every block starts on a page boundary.
                span += PAGE_SIZE - ALIGNMENT
            anchor, offset = self._allocate(span, tag, True)
            start = -offset % PAGE_SIZE
        view = build_view(anchor, dt, shp, None, start)
        anchor.first = weakref.ref(view)
        anchor.first_start = start
        return view

    def put(self, array: Any, tag: str = "", peer_writable: bool = False) -> np.ndarray[Any, Any]:
        """Copy ``array`` into this arena once; returns the (writable) copy.

        ``peer_writable`` as for :meth:`empty`.
        """
        src = np.asarray(array)
        check_shareable(src)
        out = self.empty(src.shape, src.dtype, tag, peer_writable)
        if out.size:
            np.copyto(out, src, casting="no")
        return out

    def share(
        self,
        array: Any,
        tag: str = "",
        peer: Ring | None = None,
        into: list[ArrayDescriptor] | None = None,
    ) -> ArrayDescriptor:
        """A descriptor of ``array`` that another process can open zero-copy.

        An array (or any view of one, strides included) already in this arena
        is described in place; a view of another arena's memory, such as one
        imported with :func:`open_array`, is *forwarded* in place through a
        proxy (see the module's docstring); anything else is copied in once
        first, and so is a view of memory no other process can map any more
        (its owner exited or closed it). The descriptor carries one reference
        to the memory, and is ``readonly`` if the array is not writable. Naming the ``peer`` (its
        ring from :meth:`link`) that will open it lets :meth:`reclaim` take
        the reference back if that peer dies holding it.

        ``into``: the descriptor is also added to this list in the step that
        counts its reference (no call in it, where no ``KeyboardInterrupt``
        lands), for a sender that must give back what a message it could not
        send had shared (:meth:`unshare_last`), whatever cut it short: from then
        on, should this raise, the reference is the caller's to give back.
        """
        arr = np.asarray(array)
        if arr.dtype.hasobject:
            check_shareable(arr)
        if arr.nbytes == 0:
            return ArrayDescriptor(
                self.id, 0, None, 0, 0, arr.dtype, arr.shape, (), 0, not arr.flags.writeable
            )
        # An array that owns its bytes (a function's fresh result) is no view of an
        # arena: copied in with no look for an anchor.
        anchor = None if arr.base is None else find_anchor(arr)
        if anchor is None or not self._in_place(anchor):
            return self._share_copy(arr, tag, peer, into)
        if anchor.arena_id != self.id and owner_gone(anchor.keep.handle):
            # Its owner exited or closed it (a result kept after its worker
            # was replaced): only our mapping still reaches the bytes, so the
            # peer gets a copy of what the view holds now.
            return self._share_copy(arr, tag, peer, into)
        return self._share_in_place(arr, anchor, tag, peer, into)

    def share_own(
        self,
        array: np.ndarray[Any, Any],
        peer: Ring | None = None,
        into: list[ArrayDescriptor] | None = None,
    ) -> ArrayDescriptor | None:
        """:meth:`share` of a view of this arena's own memory; None (nothing shared) if not one.

        For an argument a peer may write to (it must live here): what
        ``owns(array)`` and then ``share(array)`` do, with one look for the
        view's allocation instead of two (a pipeline shares a batch's block
        this way each time).
        """
        anchor = find_anchor(array) if type(array) is np.ndarray else None
        if anchor is None or anchor.arena_id != self.id or os.getpid() != self._pid:
            return None
        if array.nbytes == 0 or array.dtype.hasobject or anchor.alloc_id not in self._allocs:
            return self.share(array, "", peer, into)  # the general path: its checks, its copy
        return self._share_in_place(array, anchor, "", peer, into)

    def describe_own(self, array: np.ndarray[Any, Any]) -> ArrayDescriptor | None:
        """What :meth:`share_own` would return for ``array``, with no reference exported;
        None if it is not a writable view of a live allocation of this arena's own.

        To share it later, once or many times, with :meth:`share_described`.
        """
        anchor = find_anchor(array) if type(array) is np.ndarray else None
        if (
            anchor is None
            or anchor.arena_id != self.id
            or os.getpid() != self._pid
            or anchor.readonly
            or not array.flags.writeable
            or array.nbytes == 0
            or array.dtype.hasobject
        ):
            return None
        with self._lock:
            alloc = self._allocs.get(anchor.alloc_id)
            if alloc is None:
                return None
            start = array.__array_interface__["data"][0] - anchor.address
            return alloc.describe(
                self.id,
                array.dtype,
                array.shape,
                array.strides,
                start,
                False,
            )

    def share_described(
        self,
        desc: ArrayDescriptor,
        peer: Ring | None = None,
        into: list[ArrayDescriptor] | None = None,
    ) -> bool:
        """Share again what :meth:`describe_own` described: one reference exported, as
        :meth:`share_own` exports (False, nothing done: its allocation is gone, or this
        is a fork). The caller keeps a view of it alive, as for ``share_own``;
        ``into`` as for :meth:`share`.
        """
        if desc.arena_id != self.id or os.getpid() != self._pid:
            return False
        with self._lock:
            # Releases are read here every COLLECT_EVERY shares, not at each (as
            # _share_in_place and every allocation do): a pipeline shares a block a
            # batch and gets its release back a batch later. Read in bulk, the look
            # at the flags and the rings is paid once for all of them.
            self._shared_unread += 1
            if self._shared_unread >= COLLECT_EVERY:
                self._shared_unread = 0
                self._collect_locked()
            owed = None if peer is None else self._owed.get(id(peer))
            if owed is None and peer is not None:
                self._owed_by(peer)  # raises: not a ring of ours
            alloc = self._allocs.get(desc.alloc_id)
            if alloc is None:
                return False
            self._export(alloc, owed, desc, into)
        if self._deferred:
            self._drain_deferred()
        return True

    def _share_in_place(
        self,
        arr: np.ndarray[Any, Any],
        anchor: Anchor,
        tag: str,
        peer: Ring | None,
        into: list[ArrayDescriptor] | None = None,
    ) -> ArrayDescriptor:
        """``share`` of a view described in place: ours, or forwarded through a proxy."""
        readonly = anchor.readonly or not arr.flags.writeable
        first = anchor.first
        if first is not None and first() is arr:
            start = anchor.first_start  # the view made with the allocation (no pointer to read)
        else:
            start = arr.__array_interface__["data"][0] - anchor.address
        with self._lock:
            # Releases are read here too, not only when allocating: a caller
            # that only passes arrays already shared (pool.put) allocates
            # nothing, and its peers' releases would pile up (in their rings,
            # then in the peers). Nothing new costs a look at each ring's head.
            self._collect_locked()
            owed = None if peer is None else self._owed.get(id(peer))
            if owed is None and peer is not None:
                self._owed_by(peer)  # raises: not a ring of ours
            if anchor.arena_id == self.id:
                alloc = self._allocs[anchor.alloc_id]  # ``arr`` holds it: it cannot go
            else:
                alloc = self._proxy(anchor, tag)
            # Alloc.describe and Blocks._export, inline: a share is made for every call that
            # passes a block (a unit's encoding makes 12 Python calls in shm; test_pool_calls).
            desc = new_descriptor(
                self.id,
                alloc.id,
                alloc.handle,
                alloc.offset,
                alloc.size,
                arr.dtype,
                arr.shape,
                arr.strides,
                start,
                readonly,
            )
            held = 0 if owed is None else owed.get(alloc.id, 0)
            # One step, no call (see share's ``into``).
            alloc.exported += 1
            self._exported += 1
            if owed is not None:
                owed[alloc.id] = held + 1
            if into is not None:
                into += (desc,)
        if self._deferred:
            self._drain_deferred()
        return desc

    def _share_copy(
        self,
        arr: np.ndarray[Any, Any],
        tag: str,
        peer: Ring | None,
        into: list[ArrayDescriptor] | None = None,
    ) -> ArrayDescriptor:
        """``share`` of memory from outside: a copy only the descriptor references.

        No local view of it is made (the anchor, finalizer and release that
        ``put`` would add cost more than copying a few KiB). Only what is real
        is copied: a broadcast axis (stride 0) keeps its stride over one copy
        of its data, and such a view is shared read-only, as NumPy makes it.
        The reference is counted before the copy and owed to ``peer`` after
        it: a :meth:`reclaim` meanwhile cannot free the block under the copy.
        With ``into``, a failure after the count leaves the reference to the
        caller to give back (it is in ``into``).
        """
        # A worker's every result comes this way, right after the function ran,
        # when the code and data below are out of the CPU's caches: each Python
        # call costs several times its warm cost there, so the checks are inline.
        core, strides = _compact(arr) if 0 in arr.strides else (arr, None)
        nbytes = core.nbytes
        with self._lock:
            if self._closed:
                self._check_open()  # raises
            if peer is not None and id(peer) not in self._owed:
                self._owed_by(peer)  # raises: a bad peer fails before anything is allocated
            alloc = self._allocate_locked(nbytes, tag, not self.sealed)
            seg = alloc.seg
            assert seg is not None
            buf = seg.rw.buf
            copy: np.ndarray[Any, Any] = np.ndarray(core.shape, core.dtype, buf, alloc.offset)
            shown = (
                copy
                if strides is None
                else np.ndarray(arr.shape, arr.dtype, buf, alloc.offset, strides)
            )
            desc = alloc.describe(
                self.id,
                shown.dtype,
                shown.shape,
                shown.strides,
                0,
                strides is not None,
            )
            # One step, no call: the descriptor's reference takes the provisional one's place.
            alloc.exported += 1
            self._exported += 1
            alloc.local = 0
            del self._fresh[:]
            if into is not None:
                into += (desc,)
        if self._deferred:
            self._drain_deferred()
        try:
            copy[...] = core  # the same dtype: np.copyto's casting="no" without its Python frame
        except BaseException:
            if into is None:
                with self._lock:
                    alloc.exported -= 1
                    self._exported -= 1
                    self._maybe_free(alloc)
            raise
        with self._lock:
            owed = None if peer is None else self._owed.get(id(peer))
            if owed is None and peer is not None:  # reclaimed meanwhile: nobody will release it
                if into is None:
                    alloc.exported -= 1
                    self._exported -= 1
                    self._maybe_free(alloc)
                self._owed_by(peer)  # raises
            if owed is not None:
                owed[alloc.id] = owed.get(alloc.id, 0) + 1
            self.bytes_copied += nbytes
        return desc

    def _owed_by(self, peer: Ring | None) -> dict[int, int] | None:
        """What ``peer`` holds of ours (lock held); ValueError for a foreign ring."""
        if peer is None:
            return None
        owed = self._owed.get(id(peer))
        if owed is None:
            raise ValueError("peer must be a ring made or adopted by this arena's link()")
        return owed

    def _in_place(self, anchor: Anchor) -> bool:
        """Whether views on ``anchor`` can be shared without a copy: it is a
        live allocation of ours, or a mapping of another arena's (forwarded)."""
        if anchor.arena_id == self.id:
            return anchor.alloc_id in self._allocs
        return isinstance(anchor.keep, Segment)

    def _proxy(self, anchor: Anchor, tag: str) -> Alloc:
        """The proxy forwarding ``anchor``'s memory, made on first use; lock held."""
        alloc = self._proxies.get(id(anchor))  # the proxy holds the anchor: ids are unique
        if alloc is None:
            self._check_open()  # a closed arena gets no releases back: it would hold forever
            mapping: Segment = anchor.keep
            offset = anchor.address - mapping.address + mapping.offset
            alloc = Alloc(
                self._next_id, None, mapping.handle, offset, anchor.nbytes, tag, source=anchor
            )
            self._next_id += 1
            self._allocs[alloc.id] = alloc
            self._proxies[id(anchor)] = alloc
        return alloc

    def unshare(self, desc: ArrayDescriptor, peer: Ring | None = None) -> None:
        """Take back the reference of a descriptor that will never be sent.

        For a sender whose message failed after some of its arrays were
        shared; ``peer`` must be the one given to :meth:`share`.
        """
        self.unshare_last([desc], peer)

    def unshare_last(self, descs: list[ArrayDescriptor], peer: Ring | None = None) -> None:
        """:meth:`unshare` the last of ``descs`` (booked by ``share``'s ``into``), and drop it
        from the list in the same step, with no call in it: a Ctrl-C anywhere leaves it
        booked or given back, never both, and a loop over the list finishes the job."""
        desc = descs[-1]
        if desc.segment is None:
            del descs[-1]
            return
        with self._lock:
            alloc = self._allocs.get(desc.alloc_id)
            if alloc is None or alloc.exported <= 0 or desc.arena_id != self.id:
                raise SharedMemoryError(
                    f"allocation {desc.alloc_id} of arena {self.name!r} has no shared "
                    "reference left to take back"
                )
            owed = self._owed.get(id(peer), {}) if peer is not None else {}
            held = owed.get(alloc.id, 0)
            checking = self._checking
            # One step, no call; the free after it is finished by the next collect.
            del descs[-1]
            alloc.exported -= 1
            self._exported -= 1
            if held > 1:
                owed[alloc.id] = held - 1
            elif held:
                del owed[alloc.id]
            checking += (alloc,)
            self._maybe_free(alloc)
            del checking[-1]
        self._drain_deferred()

    def owns(self, array: Any) -> bool:
        """True if ``array`` is a view of memory allocated by this arena.

        Also for a view this process opened of one of the arena's own forwarded
        descriptors: like the rest, :meth:`share` describes it in place.
        """
        anchor = find_anchor(np.asarray(array)) if isinstance(array, np.ndarray) else None
        return anchor is not None and anchor.arena_id == self.id and os.getpid() == self._pid

    def _allocate(self, nbytes: int, tag: str, opened: bool) -> tuple[Anchor, int]:
        """A new block, the anchor its views hang from (its release armed), its offset.

        The anchor is made and armed with the lock still held, so that the
        block is never without a holder where another allocation could run:
        a Ctrl-C anywhere leaves it held by the anchor, or for the next
        allocation to free (``_untake``).
        """
        with self._lock:
            alloc = self._allocate_locked(nbytes, tag, opened)
            mapping = alloc.seg.rw  # type: ignore[union-attr]
            anchor = Anchor(
                mapping.address + alloc.offset - mapping.offset,
                alloc.size,
                False,
                mapping,
                self.id,
                alloc.id,
            )
            # The provisional holder becomes the anchor's, in the step that arms its release.
            on_release(
                anchor,
                self._deferred.append,
                alloc.id,
                then=self._drain_deferred,
                settle=self._fresh,
            )
        if self._deferred:
            self._drain_deferred()
        return anchor, alloc.offset

    def _allocate_locked(self, nbytes: int, tag: str, opened: bool) -> Alloc:
        """A new block in a segment ``opened`` to peers' writes, or not (lock held).

        It comes with one provisional holder (``local`` 1), in ``_fresh``: the
        caller hands it over to what it makes the block for, in a step with no
        call, before it lets go of the lock; or the next allocation frees it
        (``_untake``).
        """
        if self._closed:
            self._check_open()  # raises
        if self._taking or self._fresh:
            self._untake()
        # Blocks released by peers meanwhile are freed first, so that the
        # block just released (the last call's result) is taken again: its
        # pages are mapped, in cache, and written already. Left for later,
        # every block would be a fresh one until the segment wraps: a
        # worker's working set becomes its whole segment, and every page
        # of it faults in once.
        self._collect_locked()
        # FreeList.round, inline: every segment's alignment is ALIGNMENT.
        size = -(-nbytes // ALIGNMENT) * ALIGNMENT or ALIGNMENT
        self._taking = True  # the block goes into its segment's ``taking`` as it is cut
        seg, offset = self._fit(nbytes, size, opened) or self._grow(nbytes, opened)
        if offset + size > seg.committed:
            self._commit(seg, offset, size)
        if self._discard or seg.holes:
            self._claim(seg, offset, size)
        alloc = Alloc(self._next_id, seg, seg.rw.handle, offset, size, tag)
        # One step, no call: from ``taking`` to the allocation and its provisional holder.
        self._next_id += 1
        alloc.local = 1
        self._allocs[alloc.id] = alloc
        self._fresh[:] = (alloc,)
        seg.live += 1
        self._in_use += size
        del seg.taking[-1]
        self._taking = False
        self._peak = max(self._peak, self._in_use)
        if self._discard:
            self._give_back()
        return alloc

    def _view(
        self,
        alloc: Alloc,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None,
        start: int,
        writable: bool,
        take_export: bool,
    ) -> np.ndarray[Any, Any]:
        seg = alloc.seg
        if seg is None:  # a proxy: over the mapping its source anchor keeps
            assert alloc.source is not None
            mapping = alloc.source.keep
            writable = writable and not alloc.source.readonly
        elif writable:
            mapping = seg.rw
        else:
            if seg.ro is None:
                seg.ro = Segment.attach(seg.rw.handle, readonly=True)
            mapping = seg.ro
        anchor = Anchor(
            mapping.address + alloc.offset - mapping.offset,
            alloc.size,
            not writable,
            mapping,
            self.id,
            alloc.id,
        )
        with self._lock:
            alloc.local += 1
            if take_export:
                alloc.exported -= 1
                self._exported -= 1
        # Queued by a C call (see on_release): an interrupt as it fires loses nothing.
        on_release(anchor, self._deferred.append, alloc.id, then=self._drain_deferred)
        view = build_view(anchor, dtype, shape, strides, start)
        anchor.first = weakref.ref(view)
        anchor.first_start = start
        return view

    def open_own(self, desc: ArrayDescriptor, writable: bool) -> np.ndarray[Any, Any] | None:
        """A view of one of this arena's own descriptors (its allocations, its proxies of
        other processes' memory), opened in place, without the importer; None in a
        process forked from the arena's, whose copy of the arena is not its own.

        What :func:`shm.open_descriptor` does first with a descriptor of an arena
        of this process: each descriptor once (it takes over its reference).
        """
        if self._pid != os.getpid():
            return None
        return self._open_local(desc, writable)

    def _open_local(self, desc: ArrayDescriptor, writable: bool) -> np.ndarray[Any, Any]:
        alloc = self._allocs.get(desc.alloc_id)
        if alloc is None or alloc.exported <= 0:
            raise SharedMemoryError(
                f"descriptor of allocation {desc.alloc_id} in arena {self.name!r} was "
                "already opened and released (a descriptor carries one reference: "
                "open it once)"
            )
        return self._view(
            alloc, desc.dtype, desc.shape, desc.strides, desc.start, writable, take_export=True
        )

    # ------------------------------------------------------------- releasing
    def _drain_deferred(self) -> None:
        """Apply the releases that views' finalizers queued, unless the lock is taken.

        Never blocks (a finalizer runs wherever the interpreter is, perhaps
        with the lock held in this thread). Each is looked at, applied, and
        only then taken off the queue; the view's reference is dropped in a
        step with no call (where no ``KeyboardInterrupt`` lands), marking it
        done by putting its allocation in place of its id. A Ctrl-C anywhere
        leaves it to the next drain, which finishes it (``_maybe_free`` can
        complete a free cut short) and never drops a reference twice.
        """
        deferred = self._deferred
        while deferred:
            # Taken by a for loop's step, not by a call: an interrupt can land as a
            # call returns, and the lock would stay taken for good.
            for taken in map(self._lock.acquire, _NOWAIT):
                try:
                    if not taken:
                        return
                    while deferred:
                        entry = deferred[0]
                        if isinstance(entry, int):
                            alloc = self._allocs.get(entry)
                            if alloc is None:
                                deferred.popleft()
                                continue
                            alloc.local -= 1
                            deferred[0] = alloc
                        else:
                            alloc = entry
                        self._maybe_free(alloc)
                        deferred.popleft()
                finally:
                    if taken:
                        self._lock.release()

    def link(self, ring: Ring | None = None, capacity: int = 4096) -> Ring:
        """A ring through which one other process returns its views' references.

        Without ``ring``, a new one is made here: hand it to the peer at its
        start. With ``ring`` (made by a peer that started this process and
        handed the ring over), the arena adopts it. Either way the peer calls
        ``shm.set_release_route(arena.id, ring)`` before opening descriptors.
        """
        made = ring is None
        if ring is None:
            ring = Ring(capacity, RELEASE.size, self.backend)
        elif ring.record_size < RELEASE.size:
            raise ValueError(f"a release ring needs records of at least {RELEASE.size} bytes")
        with self._lock:
            self._check_open()
            if not (made and self._hints.add(ring)):
                self._plain.append(ring)
            self._links.append(ring)
            self._owed[id(ring)] = {}
        return ring

    def prepare_links(self) -> None:
        """Make now what the rings :meth:`link` makes share (the page of their flags).

        Else the first ``link()`` makes it. A process that forks a child after
        each link (a pool under ``fork``) calls this first, so that the fds a
        link opens are that link's alone.
        """
        with self._lock:
            self._check_open()
            self._hints.prepare()

    def reclaim(self, ring: Ring) -> int:
        """Take back every reference shared with the peer behind ``ring``.

        For a peer that died: first apply what it did send back, then drop the
        references it still held (descriptors shared with ``peer=ring``), and
        forget the link. Returns how many references were taken back.
        """
        with self._lock:
            self._collect_locked(every=True)
            owed = self._owed.pop(id(ring), {})
            if ring in self._links:
                self._links.remove(ring)
                if ring in self._plain:
                    self._plain.remove(ring)
                else:
                    self._hints.remove(ring)
            n = 0
            for alloc_id, count in owed.items():
                alloc = self._allocs.get(alloc_id)
                if alloc is None or count <= 0:
                    continue
                alloc.exported -= count
                self._exported -= count
                n += count
                self._maybe_free(alloc)
        self._drain_deferred()
        ring.close()
        return n

    def collect(self) -> int:
        """Apply the releases that other processes sent back; returns how many.

        With :attr:`discard_min`, the pages of large blocks freed meanwhile go
        back to the system here too (an idle owner calls this), but for the
        newest :attr:`keep_free` bytes of them.
        """
        with self._lock:
            n = self._collect_locked(every=True)
            if self._discard:
                self._give_back()
        self._drain_deferred()
        return n

    # ------------------------------------------------------------- the rest
    def stats(self) -> ArenaStats:
        """Memory held now, after applying any releases already sent back."""
        self.collect()
        with self._lock:
            return ArenaStats(
                name=self.name,
                capacity=self.capacity,
                reserved=sum(s.committed for s in self._segs),
                in_use=self._in_use,
                peak=self._peak,
                allocations=len(self._allocs),
                segments=len(self._segs),
                exported=self._exported,
                releases_received=self._releases,
                links=tuple(r.stats() for r in self._links),
                bytes_copied=self.bytes_copied,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise SharedMemoryError(f"arena {self.name!r} is closed")

    def unlink(self) -> None:
        """Remove the names of named segments now; mappings and fds stay valid.

        For a process about to exit without running finalizers (``os._exit``
        from a watchdog): memfd segments need nothing, named ones would linger.
        Never blocks. Other processes can no longer attach those segments.
        """
        for seg in list(self._segs):
            seg.rw.unlink()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop allocating and give the segments' fds and names back; idempotent.

        Arrays already handed out stay valid while referenced: their mappings
        go when they do. Descriptors not yet opened can no longer be.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for seg in self._segs:
                seg.rw.close()
            for ring in self._links:
                ring.close()
            self._links.clear()
            self._plain.clear()
            self._hints.close()
            self._owed.clear()
        local_arenas.pop(self.id, None)

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Arena {self.name!r} id={self.id:#x} {'closed' if self._closed else 'open'}>"
