"""A Ctrl-C at every point of an allocation: the free lists stay whole, no block is lost.

``FreeList.allocate`` used to take a block off its size list, then off its
dictionaries, then put the rest back through calls: an interrupt in between
left a block listed by size but not by offset, and a later allocation raised
``KeyError`` inside a pipeline's ``run()`` (CI found it through
tests/pipeline/test_ctrl_c_anywhere.py, once in many runs). And an interrupt
after an arena had taken a block, before the view or descriptor it was for
held it, left that block in use until the arena closed. As in
tests/shm/test_release_ctrl_c.py, a profile function raises
``KeyboardInterrupt`` at the n-th ``call`` / ``return`` / ``c_return`` event
(where CPython can raise a real one), for n = 1, 2, ... until the call ends
before its n-th event; each time the lists must be whole, the allocation made
or not (never half), and after the next allocation no block may stay taken
that nothing holds.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import shm
from shm._allocator import FreeList
from tests.conftest import InterruptAt

A = 64  # the free list's unit


def _check_whole(fl: FreeList, where: str) -> None:
    """The three indexes agree, and free and used blocks tile the region."""
    free = sorted(fl._start.items())
    assert fl._by_size == sorted((size, off) for off, size in free), where
    assert fl._end == {off + size: off for off, size in free}, where
    assert fl.free_bytes == sum(size for _, size in free), where
    at, last = 0, ""
    for off, size, kind in sorted(
        [(o, s, "free") for o, s in free] + [(o, s, "used") for o, s in fl._used.items()]
    ):
        assert off == at, f"a gap or an overlap at {off}: {where}"
        assert not kind == last == "free", f"two free neighbours at {off}: {where}"
        at, last = off + size, kind
    assert at == fl.size, where


def _fragmented() -> FreeList:
    """Free blocks of 1, 3, 5 and 7 units (at units 0, 3, 8 and 15) between used
    ones, and the free tail from unit 24."""
    fl = FreeList(64 * A, A)
    holes = [fl.allocate(n * A) for n in (1, 2, 3, 2, 5, 2, 7, 2)]
    for off in holes[::2]:
        assert off is not None
        fl.free(off, fl._used[off])
    return fl


def _sweep(call: Callable[[FreeList], int | None], need: int) -> int:
    """Interrupt ``call`` on a fresh fragmented list at each of its events."""
    for target in range(1, 500):
        fl = _fragmented()
        used = dict(fl._used)
        interrupt = InterruptAt(target)
        interrupt.run(lambda: call(fl))  # noqa: B023 - run at once
        if not interrupt.where:
            return target - 1
        _check_whole(fl, interrupt.where)
        taken = {off: size for off, size in fl._used.items() if off not in used}
        assert fl._used.keys() >= used.keys(), interrupt.where
        assert list(taken.values()) in ([], [need]), f"half an allocation at {interrupt.where}"
        for off, size in list(fl._used.items()):  # still usable: all of it back, one block
            fl.free(off, size)
        assert fl._by_size == [(fl.size, 0)], interrupt.where
    pytest.fail("the call was interrupted at every target: the sweep never ended")


@pytest.mark.parametrize("units", [3, 2, 6, 50], ids=["exact", "split", "split-7", "none"])
def test_a_ctrl_c_anywhere_in_allocate_leaves_the_lists_whole(units: int) -> None:
    # 3 units: a free block of its size (no rest); 2 and 6: cut from the 3- and the
    # 7-unit blocks, their rest listed again (one unit, beside the 1-unit block); 50:
    # nothing fits.
    landed = _sweep(lambda fl: fl.allocate(units * A), units * A)
    assert landed >= 3, "too few interrupts landed: the sweep tested little"


@pytest.mark.parametrize(
    ("near", "units"),
    [(8, 1), (8, 5), (12, 2), (17, 2), (17, 3), (30, 2)],
    ids=["start", "whole", "end", "inside", "inside-even", "tail"],
)
def test_a_ctrl_c_anywhere_in_allocate_near_leaves_the_lists_whole(near: int, units: int) -> None:
    # The 5-unit free block spans units 8-12, the 7-unit one 15-21, the tail 24-63:
    # pieces left after, before, on both sides (of two sizes, or one), or none.
    landed = _sweep(lambda fl: fl.allocate_near(near * A, units * A), units * A)
    assert landed >= 5, "too few interrupts landed: the sweep tested little"


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("peer_writable", [False, True], ids=["packed", "whole-pages"])
@pytest.mark.parametrize("nbytes", [4000, 9000, 30000], ids=["cut", "parked", "tail"])
def test_a_ctrl_c_anywhere_in_an_arenas_allocation_leaves_it_whole(
    nbytes: int, peer_writable: bool
) -> None:
    # 4000 bytes: cut from a free block of 5000; 9000: the parked block, of its size
    # (a packed one); 30000: from the free rest of the segment.
    landed = 0
    for target in range(1, 500):
        with shm.Arena(segment_size=1 << 20) as arena:
            keep = [arena.empty(n, np.uint8) for n in (3000, 5000, 3000, 9000, 3000)]
            del keep[1], keep[2]  # the 5000 freed, the 9000 parked
            interrupt = InterruptAt(target)
            got = interrupt.run(lambda: arena.empty(nbytes, np.uint8, peer_writable=peer_writable))
            if not interrupt.where:
                break
            landed += 1
            for seg in arena._segs:
                _check_whole(seg.free, interrupt.where)
            del got
            again = arena.empty(nbytes, np.uint8, peer_writable=peer_writable)  # usable
            again[:] = 1
            del again, keep
            arena.stats()  # applies the releases queued
            taken = []
            for seg in arena._segs:
                seg.unpark()
                _check_whole(seg.free, interrupt.where)
                taken += seg.free._used.values()
            # One cut off from its caller (taken, not yet held by its view) went back
            # at the next allocation (``again``).
            assert not taken, f"{taken} left taken by an interrupt at {interrupt.where}"
    else:
        pytest.fail("an allocation was interrupted at every target: the sweep never ended")
    assert landed >= 10, "too few interrupts landed: the sweep tested little"


@pytest.mark.usefixtures("no_leaks")
def test_a_ctrl_c_anywhere_in_a_share_leaves_the_arena_whole() -> None:
    # ``share`` of an outside array copies it into a block its descriptor holds: cut
    # off before the descriptor's reference is counted, the block goes back at the
    # next allocation; after, the descriptor is what is lost (as any return value).
    landed = 0
    outside = np.arange(1000, dtype=np.float32)
    for target in range(1, 500):
        with shm.Arena(segment_size=1 << 20) as arena:
            keep = [arena.empty(n, np.uint8) for n in (3000, 5000, 3000)]
            del keep[1]
            interrupt = InterruptAt(target)
            interrupt.run(lambda: arena.share(outside))
            if not interrupt.where:
                break
            landed += 1
            del keep
            arena.empty(10, np.uint8)  # the next allocation
            arena.stats()
            counted = arena._exported
            taken = []
            for seg in arena._segs:
                seg.unpark()
                _check_whole(seg.free, interrupt.where)
                taken += seg.free._used.values()
            assert len(taken) == counted <= 1, f"{taken} taken at {interrupt.where}"
    else:
        pytest.fail("a share was interrupted at every target: the sweep never ended")
    assert landed >= 10, "too few interrupts landed: the sweep tested little"
