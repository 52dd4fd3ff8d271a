"""A Ctrl-C at every point of a view's release: the block is freed all the same.

A view's release is a finalizer: Python prints an interrupt that lands in it
and goes on. The release used to take the view off a queue, then apply it: an
interrupt in between lost it, and its block stayed in use until the arena
closed (and one as the arena's lock was taken left the lock taken for good).
As in tests/pipeline/test_ctrl_c_anywhere.py, a profile function raises
``KeyboardInterrupt`` at the n-th ``call`` / ``return`` / ``c_return`` event
of the release (where CPython can raise a real one), for n = 1, 2, ... until a
release ends before its n-th event; then every block must be free, the free
lists whole (each segment one free block again), and the arena usable.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import shm
from tests.conftest import InterruptAt

pytestmark = pytest.mark.usefixtures("no_leaks")

MiB = 1 << 20


def _check_all_free(arena: shm.Arena, where: str) -> None:
    # A lock left taken would hang what follows: a bounded look first.
    if not arena._lock.acquire(timeout=5):
        arena._lock.release()  # (a plain lock: so that the arena can close)
        pytest.fail(f"the arena's lock was left taken at {where}")
    arena._lock.release()
    stats = arena.stats()  # applies what an interrupted release left queued
    assert (stats.allocations, stats.in_use) == (0, 0), f"a block stayed in use: {where}"
    for seg in arena._segs:
        seg.unpark()
        assert not seg.returning, where
        assert seg.free.largest_free == seg.free.size, f"a free list left broken at {where}"


@pytest.mark.parametrize("discard", [False, True], ids=["parked", "discarded"])
def test_a_ctrl_c_anywhere_in_a_views_release_frees_its_block(
    monkeypatch: pytest.MonkeyPatch, discard: bool
) -> None:
    printed: list[type[BaseException] | None] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: printed.append(u.exc_type))
    # discard_min: a block of a page or more is freed (its pages given back), not parked.
    with shm.Arena(segment_size=MiB, discard_min=4096 if discard else None) as arena:
        landed = 0
        for target in range(1, 1000):
            below = arena.empty(3000, np.uint8)  # free neighbours to merge with
            parked = arena.empty(5000, np.uint8)
            view = arena.empty(9000, np.uint8)
            above = arena.empty(3000, np.uint8)
            view[:] = 1
            del below, above
            del parked  # parked: the next release sends it back to the free list
            interrupt = InterruptAt(target)
            sys.setprofile(interrupt)
            try:
                del view  # its finalizer runs here
            finally:
                sys.setprofile(None)
            if not interrupt.where:
                break  # the release ended before its target-th event: all swept
            landed += 1
            assert printed.pop() is KeyboardInterrupt, interrupt.where  # printed, gone on
            _check_all_free(arena, interrupt.where)
            again = arena.empty(9000, np.uint8)  # still usable
            again[:] = 2
            del again
        else:
            pytest.fail("a release was interrupted at every target: the sweep never ended")
        _check_all_free(arena, "the end")
    assert landed >= 10, "too few interrupts landed: the sweep tested little"
