"""A Ctrl-C at every point of sharing, giving back and collecting: no reference lost or
given back twice.

A pipeline's sweep of interrupts (tests/pipeline/test_ctrl_c_anywhere.py) left
references to the pool's memory that nobody would ever release: a descriptor
counted and then cut off from its caller (as ``share`` returned, or with the
rest of an encoding), and releases taken off a peer's ring and not applied.
``share``'s ``into`` books a descriptor in the step that counts it;
``unshare_last`` gives one back and drops it from the list in one step; a
collection takes records into a list in the step that takes them off the ring,
and drops each in the step that applies it. As in test_release_ctrl_c.py, a
profile function raises ``KeyboardInterrupt`` at the n-th ``call`` /
``return`` / ``c_return`` event, for n = 1, 2, ... until the call ends first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import shm
from shm._views import RELEASE
from tests.conftest import InterruptAt

pytestmark = pytest.mark.usefixtures("no_leaks")

MiB = 1 << 20


def _sweep(make: Callable[[shm.Arena, shm.Ring], Callable[[], Any]], check: Any) -> int:
    """For each target: a fresh arena and peer, ``make``'s call interrupted, ``check``."""
    landed = 0
    for target in range(1, 500):
        with shm.Arena(segment_size=MiB, name="share-ctrl-c") as arena:
            peer = arena.link()
            call = make(arena, peer)
            interrupt = InterruptAt(target)
            interrupt.run(call)
            where = interrupt.where
            if not where:
                return landed
            landed += 1
            check(arena, peer, where)
    pytest.fail("the call was interrupted at every target: the sweep never ended")


def _all_back(arena: shm.Arena, peer: shm.Ring, booked: list[Any], where: str) -> None:
    """Every reference counted is booked: given back, nothing is left exported or owed."""
    assert arena._exported == sum(d.segment is not None for d in booked), where
    while booked:
        arena.unshare_last(booked, peer)
    stats = arena.stats()
    assert (stats.exported, arena._owed[id(peer)]) == (0, {}), where


@pytest.mark.parametrize("kind", ["own", "outside", "described", "broadcast"])
def test_a_ctrl_c_anywhere_in_a_share_books_what_it_counted(kind: str) -> None:
    booked: list[Any] = []

    def make(arena: shm.Arena, peer: shm.Ring) -> Callable[[], Any]:
        booked.clear()
        own = arena.empty(1000, np.float32)
        if kind == "own":
            return lambda: arena.share_own(own, peer, booked)
        if kind == "described":
            desc = arena.describe_own(own)
            assert desc is not None
            return lambda: arena.share_described(desc, peer, booked)
        outside = (
            np.arange(1000.0) if kind == "outside" else np.broadcast_to(np.arange(8.0), (9, 8))
        )
        return lambda: arena.share(outside, "", peer, booked)

    landed = _sweep(make, lambda arena, peer, where: _all_back(arena, peer, booked, where))
    assert landed >= 5, "too few interrupts landed: the sweep tested little"


def test_a_ctrl_c_anywhere_in_giving_back_gives_each_back_once() -> None:
    booked: list[Any] = []
    kept: list[Any] = []

    def make(arena: shm.Arena, peer: shm.Ring) -> Callable[[], Any]:
        booked.clear()
        kept[:] = [own := arena.empty(1000, np.float32)]
        for _ in range(3):
            arena.share_own(own, peer, booked)
        arena.share(np.arange(1000.0), "", peer, booked)  # a copy: freed when given back

        def give_back() -> None:
            while booked:
                arena.unshare_last(booked, peer)

        return give_back

    def check(arena: shm.Arena, peer: shm.Ring, where: str) -> None:
        _all_back(arena, peer, booked, where)  # (finishing the job: never twice)
        assert arena.stats().allocations == 1, f"the copy's block was kept: {where}"
        kept.clear()

    landed = _sweep(make, check)
    assert landed >= 10, "too few interrupts landed: the sweep tested little"


def test_a_ctrl_c_anywhere_in_a_collection_applies_each_release_once() -> None:
    held: list[Any] = []

    def make(arena: shm.Arena, peer: shm.Ring) -> Callable[[], Any]:
        other = arena.link()  # a second peer, its ring collected in the same pass
        rings = (peer, peer, other, peer)
        # Copies (freed once released), the last one kept; released after every share
        # (a share collects what is waiting).
        held[:] = [arena.share(np.arange(1000.0), "", ring) for ring in rings]
        for ring, desc in zip(rings[:3], held, strict=False):
            ring.try_push(RELEASE.pack(arena.id, desc.alloc_id, 1))
        return arena.collect  # (every link ring)

    def check(arena: shm.Arena, peer: shm.Ring, where: str) -> None:
        arena.collect()  # finishes what the interrupt left
        stats = arena.stats()
        assert (stats.exported, stats.allocations) == (1, 1), where
        assert arena._owed[id(peer)] == {held[-1].alloc_id: 1}, where

    landed = _sweep(make, check)
    assert landed >= 10, "too few interrupts landed: the sweep tested little"
