"""An arena's segments and the blocks cut from them (see ``_arena.py``).

Where an allocation goes (a segment's free list, its parked block, a new
segment), how a segment's memory is committed as blocks reach it, and how a
freed block goes back: parked for the next allocation of its size, or freed
with its whole pages given back to the system (``discard_min``). :class:`Blocks`
holds this bookkeeping for :class:`~shm.Arena`, which adds the sharing, the
views and the collection of peers' releases; its methods run with the arena's
lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._allocator import FreeList
from ._errors import ArenaFullError
from ._platform import ALIGNMENT, PAGE_SIZE
from ._segment import Segment, SegmentHandle, format_bytes
from ._views import RELEASE, Anchor, ArrayDescriptor, new_descriptor

if TYPE_CHECKING:
    from ._hints import Hints
    from ._ring import Ring

MiB = 1 << 20
#: What a new segment commits at once; the rest is committed as allocations
#: reach it, doubling what is committed each time (a few system calls in a
#: segment's life). Committing zeroes pages (~0.25 ms a MiB): a pool's arenas
#: committed whole made every pool start pay ~25 ms for memory most never use.
FIRST_COMMIT = 2 * MiB


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def minus(seg: Any, a: int, b: int, cut_seg: Any, lo: int, hi: int) -> list[tuple[Any, int, int]]:
    """The parts of range ``[a, b)`` of ``seg`` outside ``[lo, hi)`` of ``cut_seg``."""
    if seg is not cut_seg or hi <= a or b <= lo:
        return [(seg, a, b)]
    return [(seg, x, y) for x, y in ((a, lo), (hi, b)) if x < y]


class Alloc:
    """An allocation in one of our segments, or a proxy (``seg`` is None).

    A proxy forwards memory of another arena: ``source`` is the anchor of a
    view of it, held while the proxy has references so that the memory's
    owner keeps it; ``handle``/``offset``/``size`` locate it in its segment.
    """

    __slots__ = ("exported", "handle", "id", "local", "offset", "seg", "size", "source", "tag")

    def __init__(
        self,
        alloc_id: int,
        seg: Seg | None,
        handle: SegmentHandle,
        offset: int,
        size: int,
        tag: str,
        source: Anchor | None = None,
    ) -> None:
        self.id = alloc_id
        self.seg = seg
        self.handle = handle
        self.offset = offset
        self.size = size
        self.tag = tag
        self.source = source
        self.local = 0
        self.exported = 0

    def describe(
        self,
        arena_id: int,
        dtype: Any,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        start: int,
        readonly: bool,
    ) -> ArrayDescriptor:
        """A descriptor of ``shape`` / ``strides`` at ``start`` in this allocation."""
        return new_descriptor(
            arena_id,
            self.id,
            self.handle,
            self.offset,
            self.size,
            dtype,
            shape,
            strides,
            start,
            readonly,
        )


class Seg:
    __slots__ = (
        "committed",
        "free",
        "holes",
        "live",
        "open",
        "parked",
        "returning",
        "ro",
        "rw",
        "taking",
    )

    def __init__(self, segment: Segment, open_to_peers: bool, committed: int) -> None:
        self.rw = segment
        self.open = open_to_peers  # peers may map it writable (not sealed)
        self.ro: Segment | None = None
        self.free = FreeList(segment.size, ALIGNMENT)
        self.live = 0
        self.holes: list[tuple[int, int]] = []  # page ranges given back (see discard_min)
        self.committed = committed  # bytes from the start committed (see FIRST_COMMIT)
        # The last block freed, kept allocated in ``free`` to be handed out
        # again as it is to the next allocation of its size (a call's argument
        # or result, call after call): merging it into the free list and
        # splitting it off again costs more than the rest of an allocation.
        self.parked: tuple[int, int] | None = None  # (offset, size)
        # Blocks no allocation holds, on their way to the free list (see give_back).
        self.returning: list[tuple[int, int]] = []
        # The block taken for an allocation not made yet (see Blocks.untake).
        self.taking: list[tuple[int, int]] = []

    def unpark(self) -> None:
        """Give the parked block back to the free list."""
        parked = self.parked
        if parked is not None:
            self.parked = None
            self.returning += (parked,)  # (no call between: see give_back)
        self.give_back()

    def give_back(self) -> None:
        """Free the blocks in :attr:`returning`.

        A block leaves its allocation (or the parked place) for this list in a
        step with no call in it, and leaves the list as it is freed
        (``FreeList.free_last``): a Ctrl-C anywhere leaves it in one of the
        three, never lost nor freed twice, and the next call finishes the job.
        """
        returning = self.returning
        while returning:
            self.free.free_last(returning)


def new_segment(size: int, backend: str | None, sealed: bool) -> Seg:
    """A segment of ``size`` bytes for an arena, its first :data:`FIRST_COMMIT` committed."""
    commit = min(size, FIRST_COMMIT)
    created = Segment.create(size, backend, tag="mpx-arena", sealed=sealed, commit=commit)
    return Seg(created, not sealed, committed=min(created.size, round_up(commit, PAGE_SIZE)))


class Blocks:
    """The segments of an arena and its allocations' blocks in them (lock held)."""

    # Set by Arena.__init__ (see there).
    name: str
    segment_size: int
    capacity: int
    backend: str | None
    discard_min: int | None
    keep_free: int
    _discard: list[tuple[Seg, int, int]]
    _segs: list[Seg]
    _allocs: dict[int, Alloc]
    _proxies: dict[int, Alloc]
    _in_use: int
    _taking: bool
    _fresh: list[Alloc]
    _collected: list[bytes]
    _collected_owed: dict[int, int]
    _checking: list[Alloc]
    _hints: Hints
    _links: list[Ring]
    _plain: list[Ring]
    _owed: dict[int, dict[int, int]]
    _exported: int
    _releases: int
    id: int

    def _commit(self, seg: Seg, offset: int, size: int) -> None:
        """Commit ``seg`` up to past ``[offset, offset + size)`` (lock held), or free
        the block and raise :class:`ReservationError`."""
        end = min(seg.rw.size, max(round_up(offset + size, PAGE_SIZE), 2 * seg.committed))
        try:
            seg.rw.reserve(seg.committed, end - seg.committed)
        except BaseException:
            seg.free.free_last(seg.taking)  # (the block being allocated)
            raise
        seg.committed = end

    def _claim(self, seg: Seg, offset: int, size: int) -> None:
        """``[offset, offset + size)`` of ``seg`` is being allocated (lock held).

        Its pages are no longer to be given back, and those given back are
        committed again; if they cannot be, the block goes back to the free list.
        """
        lo = offset // PAGE_SIZE * PAGE_SIZE
        hi = round_up(offset + size, PAGE_SIZE)
        self._discard = [
            (s, a, b) for s0, a0, b0 in self._discard for s, a, b in minus(s0, a0, b0, seg, lo, hi)
        ]
        kept: list[tuple[int, int]] = []
        try:
            for a, b in seg.holes:
                if a < hi and lo < b:
                    seg.rw.reserve(max(a, lo), min(b, hi) - max(a, lo))
                kept.extend((x, y) for _, x, y in minus(seg, a, b, seg, lo, hi))
        except BaseException:
            seg.free.free_last(seg.taking)  # (the block being allocated)
            raise
        seg.holes = kept

    def _untake(self) -> None:
        """Free what an allocation that a Ctrl-C cut short left taken (lock held).

        An allocation's block goes into its segment's ``taking`` as it is cut
        (in the free list's step with no call, or the parked block's), and from
        there to its :class:`Alloc` in the step that records it, which also
        puts it in ``_fresh``: one provisional holder (``local`` 1) until the
        anchor or the reference it was made for takes over, in one step too
        (``shm._views.on_release``'s ``settle``; ``share``'s count), before
        the lock is let go. What is in either place when the next allocation
        takes the lock was cut off from its caller by an interrupt: freed
        here, each piece in a step that a second interrupt leaves for the next
        call to finish.
        """
        if self._taking:
            for seg in self._segs:
                taking = seg.taking
                while taking:
                    seg.free.free_last(taking)
            self._taking = False
        fresh = self._fresh
        if not fresh:
            return
        alloc = fresh[0]
        home = alloc.seg
        assert home is not None
        # One step, no call: no view nor reference ever held it (the provisional
        # holder aside), so it goes straight back with its bookkeeping.
        del fresh[:]
        del self._allocs[alloc.id]
        alloc.local = 0
        home.live -= 1
        self._in_use -= alloc.size
        home.returning += ((alloc.offset, alloc.size),)
        home.give_back()

    def _export(
        self,
        alloc: Alloc,
        owed: dict[int, int] | None,
        desc: ArrayDescriptor,
        into: list[ArrayDescriptor] | None,
    ) -> None:
        """Count the reference ``desc`` carries (owed by the peer whose book is ``owed``),
        booked in ``into``: in one step with no call (see ``Arena.share``'s ``into``)."""
        held = 0 if owed is None else owed.get(alloc.id, 0)
        # From here on: no call.
        alloc.exported += 1
        self._exported += 1
        if owed is not None:
            owed[alloc.id] = held + 1
        if into is not None:
            into += (desc,)

    def _collect_locked(self, every: bool = False) -> int:
        """Apply the releases waiting in the link rings (lock held); how many.

        Run before every allocation and share (but every COLLECT_EVERY-th
        share_described): only the rings whose flag is set are looked at (see
        ``_hints.py``), and all of them with ``every`` or now and then. A ring
        with nothing new costs no system call.

        A ring's records go into ``_collected`` in the step that takes them off
        it (``Ring.pop_waiting``'s ``into``), and each leaves the list in the
        step that applies its counts, with no call in it, its allocation marked
        in ``_checking`` there and freed after if nothing holds it: a Ctrl-C
        anywhere leaves the rest to the next collection, which applies them
        first (the ``None`` pass, with the book of the ring they came from) and
        frees again the one whose free was cut short (``_maybe_free`` is
        idempotent). Popped and dropped, a release would hold its block for good.
        """
        checking = self._checking
        while checking:
            self._maybe_free(checking[-1])
            del checking[-1]
        hints = self._hints
        rings = hints.every() if every else hints.to_collect(len(self._links))
        collected, allocs, own_id = self._collected, self._allocs, self.id
        owed = self._collected_owed
        n = 0
        for ring in (None, *self._plain, *rings) if self._plain else (None, *rings):
            if ring is not None:
                owed = self._collected_owed = self._owed[id(ring)]
                # Popped until the ring's head shows nothing more (a look at it a
                # call, every record it shows taken at once), without handing
                # freed slots back on the way out (no system call when nothing
                # waits): a release ring's producer never waits for them (it
                # pushes without blocking, and gets them back every half ring). A
                # record the head does not show yet is collected the next time.
                ring.pop_waiting(collected)  # (in bulk: every 16th share_described)
            while collected:  # (in order: the last block released is the one parked)
                arena_id, alloc_id, count = RELEASE.unpack(collected[0])
                alloc = allocs.get(alloc_id)
                n += 1
                if alloc is None or arena_id != own_id:
                    del collected[0]
                    self._releases += 1
                else:
                    # One step, no call.
                    del collected[0]
                    self._releases += 1
                    if alloc_id in owed:
                        owed[alloc_id] -= count
                        if owed[alloc_id] <= 0:
                            del owed[alloc_id]
                    alloc.exported -= count
                    self._exported -= count
                    checking += (alloc,)
                    self._maybe_free(alloc)
                    del checking[-1]
                if not collected and ring is not None:
                    ring.pop_waiting(collected)
        return n

    def _give_back(self) -> None:
        """Give back the pages of the large blocks freed since the last time (lock held).

        Done after an allocation has taken what it needs, so that a block
        freed and taken again at once (a worker's next batch) stays committed;
        the newest :attr:`keep_free` bytes of them stay for the next ones.
        """
        cut, kept = len(self._discard), 0
        while (
            cut and kept + self._discard[cut - 1][2] - self._discard[cut - 1][1] <= self.keep_free
        ):
            cut -= 1
            kept += self._discard[cut][2] - self._discard[cut][1]
        pending, self._discard = self._discard[:cut], self._discard[cut:]
        for seg, a, b in pending:
            if seg.rw.discard(a, b - a):
                seg.holes.append((a, b))

    def _fit(self, nbytes: int, size: int, opened: bool) -> tuple[Seg, int] | None:
        """A block of ``nbytes`` (``size`` rounded) in a segment we have, or None."""
        if self.keep_free and self._discard and nbytes >= (self.discard_min or 0):
            # Freed pages kept warm (keep_free): the newest taken first, rather
            # than the first fit, which may be pages already given back.
            for seg, lo, _ in reversed(self._discard):
                if seg.open != opened:
                    continue
                if (offset := seg.free.allocate_near(lo, nbytes, seg.taking)) is not None:
                    return seg, offset
        for seg in self._segs:
            if seg.open != opened:
                continue
            parked = seg.parked
            if parked is not None and parked[1] == size:
                seg.parked = None
                seg.taking += (parked,)  # (no call between: see untake)
                return seg, parked[0]
            offset = seg.free.allocate(nbytes, seg.taking)
            if offset is None and parked is not None:
                seg.unpark()
                offset = seg.free.allocate(nbytes, seg.taking)
            if offset is not None:
                return seg, offset
        return None

    def _grow(self, nbytes: int, opened: bool) -> tuple[Seg, int]:
        reserved = sum(s.rw.size for s in self._segs)
        need = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        # Grow by a segment_size where the cap allows, by just enough near the cap.
        size = max(need, min(self.segment_size, self.capacity - reserved))
        if reserved + size > self.capacity:
            # Give back empty extra segments before giving up.
            for seg in [s for s in self._segs[1:] if s.live == 0]:
                self._segs.remove(seg)
                seg.rw.close()
                reserved -= seg.rw.size
            size = max(need, min(self.segment_size, self.capacity - reserved))
        if reserved + size > self.capacity:
            raise ArenaFullError(self._full_message(nbytes, reserved))
        seg = new_segment(size, self.backend, sealed=not opened)
        self._segs.append(seg)
        offset = seg.free.allocate(nbytes, seg.taking)
        assert offset is not None
        return seg, offset

    def _full_message(self, nbytes: int, reserved: int) -> str:
        by_tag: dict[str, list[int]] = {}
        remote = 0
        for a in self._allocs.values():
            if a.seg is None:
                continue  # a proxy holds no bytes here
            entry = by_tag.setdefault(a.tag or "untagged", [0, 0])
            entry[0] += a.size
            entry[1] += 1
            remote += a.exported > 0
        top = sorted(by_tag.items(), key=lambda kv: -kv[1][0])[:3]
        holders = ", ".join(f"{t!r}: {format_bytes(b)} in {n}" for t, (b, n) in top)
        return (
            f"arena {self.name!r} cannot allocate {format_bytes(nbytes)}: it is at its cap of "
            f"{format_bytes(self.capacity)} ({format_bytes(reserved)} reserved, "
            f"{format_bytes(self._in_use)} in use by {len(self._allocs)} allocations"
            + (f"; largest holders {holders}" if holders else "")
            + f"; {remote} of them referenced from descriptors or other processes). "
            "Drop arrays you no longer need, or give the arena a larger capacity"
        )

    def _maybe_free(self, alloc: Alloc) -> None:
        """Free ``alloc`` if nothing holds it any more; again, to finish one cut short.

        Its bookkeeping changes in one step with no call in it (where no
        ``KeyboardInterrupt`` can land: see ``FreeList.free_last``), its block
        then goes back through :meth:`Seg.give_back`: an interrupt anywhere
        leaves a state that a second call, with the same ``alloc``, completes.
        """
        if alloc.local > 0 or alloc.exported > 0:
            return
        seg = alloc.seg
        if self._allocs.get(alloc.id) is not alloc:
            if seg is not None:
                seg.give_back()  # freed already, perhaps its block not yet
            return
        if seg is None:
            # A proxy: let go of the source, whose finalizer returns the memory
            # to its owner. That finalizer never waits on a lock, so it may run here.
            key = id(alloc.source)
            del self._proxies[key]
            del self._allocs[alloc.id]
            alloc.source = None
            return
        block = (alloc.offset, alloc.size)
        if self.discard_min is None or alloc.size < self.discard_min:
            parked = seg.parked
            # One step, no call: parked for the next allocation of its size, the
            # block it replaces on its way back.
            del self._allocs[alloc.id]
            seg.live -= 1
            self._in_use -= alloc.size
            seg.parked = block
            if parked is not None:
                seg.returning += (parked,)
        else:
            lo = round_up(alloc.offset, PAGE_SIZE)
            hi = (alloc.offset + alloc.size) // PAGE_SIZE * PAGE_SIZE
            pages = ((seg, lo, hi),) if hi > lo else ()
            # One step, no call (as above).
            del self._allocs[alloc.id]
            seg.live -= 1
            self._in_use -= alloc.size
            seg.returning += (block,)
            self._discard += pages
        returning = seg.returning  # (Seg.give_back, inline: a release a call)
        while returning:
            seg.free.free_last(returning)
