"""FreeList: alignment, no overlap, best fit, coalescing, bad frees, and a model check."""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest

from shm._allocator import FreeList

A = 64  # the arena's alignment; FreeList itself takes any


def _free_runs(used: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs of free units in a bitmap, as ``(start, length)`` in units."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, u in enumerate([*used, True]):
        if not u and start is None:
            start = i
        elif u and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def _check_against_model(fl: FreeList, used: list[bool], unit: int) -> None:
    runs = _free_runs(used)
    # Coalescing: the free blocks are exactly the maximal free runs, indexed consistently.
    blocks = sorted((off // unit, size // unit) for off, size in fl._start.items())
    assert blocks == runs
    assert sorted(fl._by_size) == sorted((n * unit, s * unit) for s, n in runs)
    assert fl._by_size == sorted(fl._by_size)
    assert fl._end == {off + size: off for off, size in fl._start.items()}
    assert fl.free_bytes == used.count(False) * unit
    assert fl.largest_free == max((n for _, n in runs), default=0) * unit
    assert fl.empty == (not any(used))


# ---------------------------------------------------------------- basics


@pytest.mark.parametrize(("size", "alignment"), [(0, 64), (-64, 64), (100, 64), (65, 64)])
def test_bad_construction(size: int, alignment: int) -> None:
    with pytest.raises(ValueError, match="positive multiple"):
        FreeList(size, alignment)


def test_round() -> None:
    fl = FreeList(A * 8, A)
    assert [fl.round(n) for n in (0, 1, A - 1, A, A + 1, 3 * A)] == [A, A, A, A, 2 * A, 3 * A]


def test_fresh_list_is_one_free_block() -> None:
    fl = FreeList(A * 16, A)
    assert fl.empty
    assert fl.free_bytes == fl.largest_free == A * 16
    _check_against_model(fl, [False] * 16, A)


@pytest.mark.parametrize("alignment", [8, 64, 4096])
def test_offsets_aligned_and_disjoint(alignment: int) -> None:
    size = alignment * 200
    fl = FreeList(size, alignment)
    rng = random.Random(1234 + alignment)
    live: list[tuple[int, int]] = []
    while True:
        nbytes = rng.randrange(0, alignment * 5)
        off = fl.allocate(nbytes)
        if off is None:
            break
        assert off % alignment == 0
        assert off >= 0
        assert off + fl.round(nbytes) <= size
        live.append((off, fl.round(nbytes)))
    live.sort()
    for (a_off, a_size), (b_off, _) in itertools.pairwise(live):
        assert a_off + a_size <= b_off, "live blocks overlap"
    assert sum(s for _, s in live) + fl.free_bytes == size
    assert not fl.empty


def test_allocate_whole_region_then_none() -> None:
    fl = FreeList(A * 4, A)
    assert fl.allocate(A * 4) == 0
    assert fl.free_bytes == 0
    assert fl.largest_free == 0
    assert fl.allocate(0) is None  # even the smallest unit no longer fits
    assert fl.allocate(1) is None
    fl.free(0, A * 4)
    assert fl.empty


def test_allocate_returns_none_when_nothing_fits() -> None:
    fl = FreeList(A * 8, A)
    assert fl.allocate(A * 8 + 1) is None  # larger than the region
    offs = [fl.allocate(A) for _ in range(8)]
    assert offs == [i * A for i in range(8)]
    for off in offs[::2]:  # four free units, but no two adjacent
        fl.free(off, A)
    assert fl.free_bytes == 4 * A
    assert fl.largest_free == A
    assert fl.allocate(A + 1) is None
    assert fl.allocate(2 * A) is None
    assert fl.free_bytes == 4 * A  # a failed allocation changes nothing
    assert fl.allocate(A) == 0


# ---------------------------------------------------------------- best fit


def test_best_fit_picks_smallest_block_that_fits() -> None:
    fl = FreeList(A * 16, A)
    # Layout (units): [0,2) hole | [2,3) used | [3,6) hole | [6,7) used | [7,8) hole
    #                 | [8,9) used | [9,16) tail
    blocks = [fl.allocate(n * A) for n in (2, 1, 3, 1, 1, 1)]
    assert blocks == [0, 2 * A, 3 * A, 6 * A, 7 * A, 8 * A]
    for off, n in ((0, 2), (3 * A, 3), (7 * A, 1)):
        fl.free(off, n * A)
    assert sorted(fl._by_size) == [(A, 7 * A), (2 * A, 0), (3 * A, 3 * A), (7 * A, 9 * A)]
    assert fl.allocate(A) == 7 * A  # the 1-unit hole, not the first or the largest
    assert fl.allocate(A + 1) == 0  # rounds to 2 units: the 2-unit hole exactly
    assert fl.allocate(A) == 3 * A  # only holes of 3 and 7 left: split the 3
    assert fl.allocate(2 * A) == 4 * A  # the rest of that hole (2 units) fits exactly
    assert fl.allocate(3 * A) == 9 * A  # now only the tail fits
    assert fl.largest_free == 4 * A
    assert fl.free_bytes == 4 * A


def test_best_fit_tie_goes_to_lowest_offset() -> None:
    fl = FreeList(A * 8, A)
    offs = [fl.allocate(A) for _ in range(8)]
    for off in (offs[5], offs[1], offs[3]):  # three 1-unit holes, freed out of order
        fl.free(off, A)
    assert fl.allocate(A) == offs[1]
    assert fl.allocate(A) == offs[3]
    assert fl.allocate(A) == offs[5]
    assert fl.allocate(A) is None


def test_split_leaves_remainder_free() -> None:
    fl = FreeList(A * 10, A)
    assert fl.allocate(3 * A) == 0
    assert sorted(fl._start.items()) == [(3 * A, 7 * A)]
    assert fl.largest_free == 7 * A
    assert fl.free_bytes == 7 * A


# ---------------------------------------------------------------- coalescing


@pytest.mark.parametrize(
    "order",
    [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1)],
)
def test_coalescing_in_every_order(order: tuple[int, ...]) -> None:
    fl = FreeList(A * 6, A)
    blocks = [(fl.allocate(2 * A), 2 * A) for _ in range(3)]
    assert [off for off, _ in blocks] == [0, 2 * A, 4 * A]
    assert fl.free_bytes == 0
    for i in order:
        fl.free(*blocks[i])
    assert fl.empty
    assert fl.largest_free == fl.size
    assert fl._by_size == [(fl.size, 0)]
    assert fl._start == {0: fl.size}
    assert fl._end == {fl.size: 0}
    assert fl.allocate(fl.size) == 0  # the whole region is one block again


def test_free_merges_with_both_neighbours() -> None:
    fl = FreeList(A * 5, A)
    offs = [fl.allocate(A) for _ in range(5)]
    fl.free(offs[1], A)
    fl.free(offs[3], A)
    assert fl.largest_free == A
    fl.free(offs[2], A)  # bridges the two holes
    assert sorted(fl._start.items()) == [(A, 3 * A)]
    assert fl.largest_free == 3 * A
    fl.free(offs[0], A)
    fl.free(offs[4], A)
    assert fl.empty
    assert fl._by_size == [(5 * A, 0)]


def test_free_everything_in_random_order_coalesces() -> None:
    rng = random.Random(99)
    fl = FreeList(A * 512, A)
    live = []
    while (off := fl.allocate(n := rng.randrange(1, 6 * A))) is not None:
        live.append((off, n))
    rng.shuffle(live)
    for off, n in live:
        fl.free(off, n)
    assert fl.empty
    assert fl.largest_free == fl.size == fl.free_bytes
    assert fl._by_size == [(fl.size, 0)]


# ---------------------------------------------------------------- bad frees


def test_double_free_raises() -> None:
    fl = FreeList(A * 4, A)
    off = fl.allocate(A)
    fl.free(off, A)
    with pytest.raises(ValueError, match="double or bad free"):
        fl.free(off, A)
    assert fl.empty  # the failed free changed nothing
    assert fl._by_size == [(4 * A, 0)]


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(-A, A), (4 * A, A), (3 * A, 2 * A), (0, 5 * A)],
    ids=["negative", "at-end", "runs-past-end", "larger-than-region"],
)
def test_out_of_range_free_raises(offset: int, nbytes: int) -> None:
    fl = FreeList(A * 4, A)
    assert fl.allocate(4 * A) == 0
    with pytest.raises(ValueError, match="double or bad free"):
        fl.free(offset, nbytes)
    assert fl.free_bytes == 0


def test_double_free_after_coalescing_is_detected() -> None:
    # b is freed, merges into the free block that starts at a, then is freed again.
    fl = FreeList(A * 4, A)
    a, b = fl.allocate(A), fl.allocate(A)
    fl.free(a, A)
    fl.free(b, A)
    assert fl.empty
    with contextlib.suppress(ValueError):
        fl.free(b, A)
    assert (fl.free_bytes, fl._by_size) == (fl.size, [(fl.size, 0)]), (
        "shm bug: a double free of a block that coalesced with its free predecessor "
        f"is accepted: free_bytes={fl.free_bytes} > size={fl.size}, free blocks "
        f"{fl._by_size}; allocate() then hands out overlapping blocks"
    )


@pytest.mark.parametrize(
    ("offset", "nbytes"),
    [(A // 2, A), (2 * A, A)],
    ids=["misaligned", "never-allocated"],
)
def test_free_of_unallocated_range_raises(offset: int, nbytes: int) -> None:
    fl = FreeList(A * 4, A)
    assert fl.allocate(A) == 0  # [A, 4A) is free
    with contextlib.suppress(ValueError):
        fl.free(offset, nbytes)
    assert (fl.free_bytes, sorted(fl._start.items())) == (3 * A, [(A, 3 * A)]), (
        f"shm bug: free({offset}, {nbytes}) of a range that is not an allocated block "
        f"is accepted: free_bytes={fl.free_bytes} (expected {3 * A}), free blocks "
        f"{sorted(fl._start.items())}"
    )


# ---------------------------------------------------------------- model check


@pytest.mark.parametrize(
    ("alignment", "units", "seed"),
    [(64, 128, 0), (64, 257, 1), (8, 64, 2), (4096, 96, 3)],
)
def test_random_ops_match_bitmap_model(alignment: int, units: int, seed: int) -> None:
    rng = random.Random(seed)
    fl = FreeList(units * alignment, alignment)
    used = [False] * units
    live: list[tuple[int, int]] = []  # (offset, nbytes as requested)
    allocated = failed = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off, nbytes = live.pop(rng.randrange(len(live)))
            fl.free(off, nbytes)
            u0, n = off // alignment, fl.round(nbytes) // alignment
            assert all(used[u0 : u0 + n])
            used[u0 : u0 + n] = [False] * n
        else:
            nbytes = rng.choice([0, 1, alignment, rng.randrange(1, alignment * units // 6)])
            need = fl.round(nbytes) // alignment
            runs = _free_runs(used)
            fitting = [(n, s) for s, n in runs if n >= need]
            off = fl.allocate(nbytes)
            if off is None:
                failed += 1
                assert not fitting, f"allocate({nbytes}) failed but free runs {runs} fit it"
            else:
                allocated += 1
                assert off % alignment == 0
                # Best fit: the start of the smallest free run that fits, lowest first.
                assert (off // alignment) == min(fitting)[1]
                u0 = off // alignment
                assert not any(used[u0 : u0 + need]), "allocation overlaps a live block"
                used[u0 : u0 + need] = [True] * need
                live.append((off, nbytes))
        _check_against_model(fl, used, alignment)
    # The run exercised both outcomes.
    assert allocated > 500
    assert failed > 0
    rng.shuffle(live)
    for off, nbytes in live:
        fl.free(off, nbytes)
    assert fl.empty
    assert fl.largest_free == fl.size
    assert fl._by_size == [(fl.size, 0)]


def test_allocate_near_cuts_the_block_from_the_free_block_holding_the_offset() -> None:
    fl = FreeList(64 * A, A)
    a = fl.allocate(8 * A)
    b = fl.allocate(8 * A)
    c = fl.allocate(8 * A)
    assert (a, b, c) == (0, 8 * A, 16 * A)
    fl.free(b, 8 * A)
    # Inside b's free block, where it fits: there; too near its end: as close as fits.
    assert fl.allocate_near(8 * A + 5, 4 * A) == 8 * A
    assert fl.allocate_near(15 * A, 3 * A) == 13 * A
    assert fl.free_bytes == (64 - 8 - 8 - 4 - 3) * A
    # Too big for the free block holding the offset, or an offset in use: None.
    assert fl.allocate_near(12 * A, 2 * A) is None
    assert fl.allocate_near(0, A) is None
    assert fl.allocate_near(30 * A, 41 * A) is None  # its free block, [24, 64), holds 40
    fl.free(8 * A, 4 * A)
    fl.free(13 * A, 3 * A)
    fl.free(a, 8 * A)
    fl.free(c, 8 * A)
    assert fl.empty
    assert fl.largest_free == 64 * A


def test_allocate_near_keeps_the_lists_consistent_with_a_model() -> None:
    rng = random.Random(3)
    units = 256
    fl = FreeList(units * A, A)
    used = [False] * units
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            n = live.pop(off)
            fl.free(off, n * A)
            for i in range(off // A, off // A + n):
                used[i] = False
            _check_against_model(fl, used, A)
            continue
        n = rng.randint(1, 12)
        off = fl.allocate_near(rng.randrange(units * A), n * A - rng.randrange(A))
        if off is None:
            continue
        assert off % A == 0
        assert not any(used[off // A : off // A + n]), "overlaps a live block"
        for i in range(off // A, off // A + n):
            used[i] = True
        live[off] = n
    _check_against_model(fl, used, A)
