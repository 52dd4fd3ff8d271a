"""A best-fit free-list allocator over one segment's byte range.

Pure bookkeeping (offsets and sizes, no memory): the arena puts one in front of
each segment. Free blocks are indexed three ways so that every operation is a
dictionary lookup or a binary search:

- ``_by_size``: sorted ``(size, offset)`` for best-fit search;
- ``_start``: offset -> size, and ``_end``: end offset -> offset, so that a
  freed block merges with both neighbours in O(1).

The exception is :meth:`FreeList.allocate_near`, a linear search over the free
blocks, asked only by an arena that keeps freed pages warm (``keep_free``).

Allocated blocks are kept too (``_used``), so a double free or a free of a range
that was never handed out raises instead of corrupting the lists.
"""

from __future__ import annotations

import bisect


class FreeList:
    """Hands out ``[offset, offset + size)`` ranges of a region of ``size`` bytes."""

    def __init__(self, size: int, alignment: int) -> None:
        if size <= 0 or size % alignment:
            raise ValueError(f"size {size} must be a positive multiple of {alignment}")
        self.size = size
        self.alignment = alignment
        self.free_bytes = size
        self._by_size: list[tuple[int, int]] = [(size, 0)]
        self._start: dict[int, int] = {0: size}
        self._end: dict[int, int] = {size: 0}
        self._used: dict[int, int] = {}

    def round(self, nbytes: int) -> int:
        """The size an allocation of ``nbytes`` really takes (at least one unit)."""
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def allocate(self, nbytes: int, taking: list[tuple[int, int]] | None = None) -> int | None:
        """Offset of a new block of ``round(nbytes)`` bytes, or None if none fits.

        As in :meth:`free_last`, looked up first, then changed with no call in
        between: a Ctrl-C anywhere leaves the lists whole (the block then taken
        or not, never half). ``taking``: ``(offset, size)`` of the block is
        added to it in that step, for a caller that must find a block it took
        when an interrupt cut it off from the return value.
        """
        need = self.round(nbytes)
        by_size = self._by_size
        i = bisect.bisect_left(by_size, (need, -1))
        if i == len(by_size):
            return None
        size, offset = by_size[i]
        rest = offset + need  # where what is left of the block starts
        # What is left is smaller than the block: its place is at or before the block's.
        j = bisect.bisect_left(by_size, (size - need, rest)) if size > need else -1
        # From here to the return: no call.
        del by_size[i]
        del self._start[offset]
        if j >= 0:
            by_size[j:j] = ((size - need, rest),)
            self._start[rest] = size - need
            self._end[offset + size] = rest
        else:
            del self._end[offset + size]
        self.free_bytes -= need
        self._used[offset] = need
        if taking is not None:
            taking += ((offset, need),)
        return offset

    def allocate_near(
        self, offset: int, nbytes: int, taking: list[tuple[int, int]] | None = None
    ) -> int | None:
        """Offset of a new block of ``round(nbytes)`` bytes over ``offset``, or None.

        The block is cut from the free block holding ``offset``, as close to
        starting there as it fits: for a caller that knows which free pages
        are warm. A linear search, for the few large blocks that ask; the
        lists change as in :meth:`allocate`, in one step with no call
        (``taking`` too).
        """
        need = self.round(nbytes)
        for start, size in self._start.items():
            if start <= offset < start + size:
                break
        else:
            return None
        if size < need:
            return None
        at = max(start, min(offset // self.alignment * self.alignment, start + size - need))
        by_size = self._by_size
        i = bisect.bisect_left(by_size, (size, start))
        # The pieces left on either side, ``lo`` sorting first; each smaller than the
        # block, so their places (in the list as it is) are at or before the block's.
        left, right = (at - start, start), (start + size - at - need, at + need)
        pieces = sorted(p for p in (left, right) if p[0])
        lo = pieces[0] if pieces else None
        hi = pieces[1] if len(pieces) == 2 else None
        j_lo = bisect.bisect_left(by_size, lo) if lo is not None else -1
        j_hi = bisect.bisect_left(by_size, hi) if hi is not None else -1
        # From here to the return: no call.
        del by_size[i]
        del self._start[start]
        del self._end[start + size]
        if hi is not None:  # the later place first: the earlier keeps its index
            by_size[j_hi:j_hi] = (hi,)
            self._start[hi[1]] = hi[0]
            self._end[hi[1] + hi[0]] = hi[1]
        if lo is not None:
            by_size[j_lo:j_lo] = (lo,)
            self._start[lo[1]] = lo[0]
            self._end[lo[1] + lo[0]] = lo[1]
        self.free_bytes -= need
        self._used[at] = need
        if taking is not None:
            taking += ((at, need),)
        return at

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block given by :meth:`allocate`, merging it with free neighbours."""
        self.free_last([(offset, nbytes)])

    def free_last(self, blocks: list[tuple[int, int]]) -> None:
        """Free the last ``(offset, nbytes)`` of ``blocks`` and drop it from ``blocks``,
        as one step: an interrupt leaves it either there or freed, never half.

        Everything is looked up first, then changed with no call in between
        (CPython raises a ``KeyboardInterrupt`` only as a call starts or returns,
        or at a loop's jump back; 3.10 at a taken jump too): a release that a
        Ctrl-C cut short is finished by freeing what is left in ``blocks``.
        """
        offset, nbytes = blocks[-1]
        size = self.round(nbytes)
        if self._used.get(offset) != size:
            raise ValueError(f"double or bad free of [{offset}, {offset + size})")
        by_size = self._by_size
        end = offset + size
        before = self._end.get(offset)  # the start of a free block ending at offset
        after = self._start.get(end)  # the size of a free block starting at end
        start = offset if before is None else before
        stop = end if after is None else end + after
        # Both neighbours sort before the merged block (same start, or smaller size).
        at = bisect.bisect_left(by_size, (stop - start, start))
        if before is None:
            i = -1
        else:
            i = bisect.bisect_left(by_size, (offset - before, before))
            at -= 1
        if after is None:
            j = -1
        else:
            j = bisect.bisect_left(by_size, (after, end))
            at -= 1
        # From here to the end: no call.
        del self._used[offset]
        self.free_bytes += size
        if i > j:  # the later one first: the earlier keeps its index
            del by_size[i]
            if j >= 0:
                del by_size[j]
        elif j >= 0:
            del by_size[j]
            if i >= 0:
                del by_size[i]
        if before is not None:
            del self._start[before]
            del self._end[offset]
        if after is not None:
            del self._start[end]
            del self._end[stop]
        by_size[at:at] = ((stop - start, start),)
        self._start[start] = stop - start
        self._end[stop] = start
        del blocks[-1]

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def empty(self) -> bool:
        """True when nothing is allocated."""
        return self.free_bytes == self.size
