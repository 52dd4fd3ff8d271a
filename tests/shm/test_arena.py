"""Arena allocations and array views inside one process."""

from __future__ import annotations

import gc
import itertools
import mmap
import os
import pickle
import threading
from typing import Any

import numpy as np
import pytest

import shm
from shm._arena import FIRST_COMMIT

KiB, MiB = 1 << 10, 1 << 20

DTYPES = [
    np.bool_,
    np.int8,
    np.uint16,
    np.int32,
    np.int64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    "M8[ns]",
    "m8[s]",
    "S7",
    "U5",
    ">i4",
    np.dtype([("a", "<i4"), ("b", "<f8", (2,))]),
]


@pytest.fixture
def arena(backend: str) -> Any:
    with shm.Arena(segment_size=1 * MiB, capacity=8 * MiB, backend=backend, name="test") as a:
        yield a


def _fill(shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.random.default_rng(0).integers(0, 255, n * dt.itemsize, dtype=np.uint8)
    arr = raw.view(dt).reshape(shape) if n else np.empty(shape, dt)
    if dt.kind in {"f", "c"}:
        arr = np.nan_to_num(arr)
    return arr


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (4, 5), (2, 3, 4, 5, 1)], ids=str)
def test_share_open_roundtrip_is_exact(arena: shm.Arena, dtype: Any, shape: Any) -> None:
    src = _fill(shape, dtype)
    desc = pickle.loads(pickle.dumps(arena.share(src)))
    out = shm.open_array(desc)
    assert out.dtype == src.dtype
    assert out.shape == src.shape
    assert out.tobytes() == src.tobytes()
    assert not out.flags.writeable
    del out
    gc.collect()
    assert arena.stats().in_use == 0


def test_views_are_zero_copy_and_readonly(arena: shm.Arena) -> None:
    a = arena.empty((100, 100), np.float32)
    a[:] = 1.0
    v = shm.open_array(arena.share(a))
    a[3, 4] = 42.0  # the owner writes; the view sees the same bytes
    assert v[3, 4] == 42.0
    with pytest.raises(ValueError, match="read-only"):
        v[0, 0] = 2
    with pytest.raises(ValueError, match="WRITEABLE"):
        v.setflags(write=True)
    w = shm.open_array(arena.share(a), writable=True)
    w[0, 0] = 5.0
    assert a[0, 0] == 5.0


def test_non_contiguous_input_is_made_contiguous_once(arena: shm.Arena) -> None:
    src = np.arange(60, dtype=np.int16).reshape(6, 10)[::2, ::-3]
    out = shm.open_array(arena.share(src))
    assert out.flags.c_contiguous
    np.testing.assert_array_equal(out, src)


def test_strided_view_of_arena_memory_is_shared_in_place(arena: shm.Arena) -> None:
    a = arena.put(np.arange(100, dtype=np.int64).reshape(10, 10))
    before = arena.stats().allocations
    view = a[1::3, ::-2]
    out = shm.open_array(arena.share(view))
    np.testing.assert_array_equal(out, view)
    assert arena.stats().allocations == before  # no copy was made
    assert out.strides == view.strides


def test_object_arrays_are_refused(arena: shm.Arena) -> None:
    with pytest.raises(TypeError, match="dtype object"):
        arena.share(np.array([1, "a"], dtype=object))
    with pytest.raises(TypeError, match="dtype object"):
        arena.empty(3, object)


def test_empty_refuses_negative_dimensions(arena: shm.Arena) -> None:
    with pytest.raises(ValueError, match="negative dimensions"):
        arena.empty((4, -1), np.float32)
    assert arena.stats().in_use == 0
    assert arena.empty((0, 3)).shape == (0, 3)
    big = arena.empty((3, 1000), np.int16)  # math.prod, not np.prod: exact sizes
    assert big.nbytes == 6000


def test_share_on_a_closed_arena_says_so() -> None:
    arena = shm.Arena(1 << 20)
    peer = arena.link()
    arena.close()
    try:
        for p in (None, peer):
            with pytest.raises(shm.SharedMemoryError, match="closed"):
                arena.share(np.ones(8), peer=p)
    finally:
        peer.close()


def test_dtype_codes_round_trip_and_bound_descriptors(arena: shm.Arena) -> None:
    dtypes = [
        np.dtype("<f8"),
        np.dtype(">i2"),
        np.dtype("U7"),
        np.dtype("datetime64[ms]"),
        np.dtype([("x", "<f4"), ("v", "<i2", (2,))]),
    ]
    for dt in dtypes:
        code = shm.dtype_code(dt)
        assert shm.dtype_code(dt) is code  # cached
        back = shm.dtype_from_code(code)
        assert back == dt
        assert back.names == dt.names
    # Any size of code for the caller; a descriptor has 16 bits for it.
    huge = np.dtype([(f"field_{i:04d}_{'x' * 30}", "u1") for i in range(1500)])
    assert shm.dtype_from_code(shm.dtype_code(huge)) == huge
    desc = arena.share(np.zeros(2, huge))
    try:
        with pytest.raises(ValueError, match="too complex"):
            desc.pack()
    finally:
        arena.unshare(desc)


def test_allocation_lives_while_any_view_lives(arena: shm.Arena) -> None:
    a = arena.put(np.arange(1000, dtype=np.float64))
    tail = a[500:].reshape(10, 50).T  # derived views keep the memory
    del a
    gc.collect()
    assert arena.stats().allocations == 1
    assert tail[0, 0] == 500.0
    mv = memoryview(tail)
    del tail
    gc.collect()
    assert arena.stats().allocations == 1  # a memoryview export holds it too
    del mv
    gc.collect()
    assert arena.stats().allocations == 0


def test_descriptor_holds_a_reference_until_opened(arena: shm.Arena) -> None:
    desc = arena.share(np.ones(10))
    gc.collect()
    s = arena.stats()
    assert s.allocations == 1
    assert s.exported == 1
    out = shm.open_array(desc)
    assert arena.stats().exported == 0
    del out
    gc.collect()
    assert arena.stats().allocations == 0
    with pytest.raises(shm.SharedMemoryError, match="open it once"):
        shm.open_array(desc)


def test_open_own_opens_the_arenas_descriptors_in_this_process_only(
    arena: shm.Arena, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam shm.open_array uses for an arena's own memory: in place here, None in a
    forked child (whose copy of the arena is not its own: the importer opens it there)."""
    desc = arena.share(np.arange(6.0))
    view = arena.open_own(desc, writable=False)
    assert view is not None
    assert view.tolist() == list(range(6))
    assert not view.flags.writeable
    assert arena.owns(view)
    assert arena.stats().exported == 0  # it took over the descriptor's reference
    other = arena.share(np.ones(1))
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: -1)  # as a forked child sees it: another pid
        assert arena.open_own(other, writable=False) is None
    assert shm.open_array(other).tolist() == [1.0]


def test_alignment_and_no_overlap(arena: shm.Arena) -> None:
    arrays = [arena.empty(n, np.uint8) for n in (1, 63, 64, 65, 1000, 4097)]
    spans = []
    for i, arr in enumerate(arrays):
        addr = arr.__array_interface__["data"][0]
        assert addr % 64 == 0
        arr[:] = i
        spans.append((addr, addr + arr.nbytes))
    spans.sort()
    assert all(e <= s for (_, e), (s, _) in itertools.pairwise(spans))
    for i, arr in enumerate(arrays):
        assert (arr == i).all()


def test_grows_by_segments_up_to_the_cap(arena: shm.Arena) -> None:
    held = [arena.empty(MiB, np.uint8, tag="frames") for _ in range(7)]
    s = arena.stats()
    assert s.segments >= 2
    assert s.reserved <= s.capacity
    with pytest.raises(shm.ArenaFullError) as info:
        arena.empty(2 * MiB, np.uint8)
    msg = str(info.value)
    assert "cannot allocate 2.0 MiB" in msg
    assert "cap of 8.0 MiB" in msg
    assert "'frames'" in msg
    del held
    gc.collect()
    big = arena.empty(6 * MiB, np.uint8)  # empty extra segments are given back first
    assert big.nbytes == 6 * MiB


def test_freed_memory_is_reused(arena: shm.Arena) -> None:
    for _ in range(200):
        a = arena.empty(256 * KiB, np.uint8)
        a[-1] = 1
        del a
    s = arena.stats()
    assert s.segments == 1
    assert s.in_use == 0
    assert s.peak == 256 * KiB


def test_stats_are_frozen_and_printable(arena: shm.Arena) -> None:
    keep = arena.empty(1000, np.uint8)
    s = arena.stats()
    with pytest.raises(AttributeError):
        s.in_use = 0  # type: ignore[misc]
    assert s.allocations == 1
    assert s.in_use == 1024
    assert s.peak >= 1024
    assert "1 allocations" in str(s)
    del keep


def test_close_keeps_views_valid(backend: str) -> None:
    a = shm.Arena(segment_size=MiB, capacity=4 * MiB, backend=backend)
    x = a.put(np.arange(10.0))
    a.close()
    a.close()
    assert a.closed
    assert x[9] == 9.0
    with pytest.raises(shm.SharedMemoryError, match="closed"):
        a.empty(10)


def test_gc_release_never_blocks_while_arena_is_busy(arena: shm.Arena) -> None:
    """A finalizer firing while another thread holds the arena lock must not wait."""
    victim = arena.empty(100, np.uint8)
    ran = threading.Event()

    def drop() -> None:
        nonlocal victim
        del victim  # finalizer runs here, with the lock held by the main thread
        ran.set()

    with arena._lock:
        t = threading.Thread(target=drop)
        t.start()
        assert ran.wait(5), "release blocked on the arena lock"
        t.join(5)
        assert arena._allocs  # not freed yet: queued
    arena.collect()
    assert arena.stats().allocations == 0


def test_threads_allocate_and_free_concurrently(arena: shm.Arena) -> None:
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                a = arena.empty(int(rng.integers(1, 20_000)), np.uint8)
                a[:] = seed
                assert (a == seed).all()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    gc.collect()
    assert arena.stats().allocations == 0


@pytest.mark.parametrize(
    "dtype", [*DTYPES, np.dtype([("x", "u1"), ("y", "<f4")], align=True)], ids=str
)
def test_descriptor_packs_compactly_and_exactly(arena: shm.Arena, dtype: Any) -> None:
    base = arena.put(_fill((4, 6, 3), dtype))
    for view in (base, base[::-1, ::2], base.transpose(2, 0, 1), base[1, 2, 0]):
        desc = arena.share(view)
        packed = desc.pack()
        assert shm.ArrayDescriptor.unpack(packed) == desc
        if view.dtype.fields is None:
            assert len(packed) <= 200  # rides in a ring record next to a task
        out = shm.open_array(desc)
        # By field: the padding bytes of an aligned struct are undefined.
        for name in view.dtype.names or ():
            assert np.array_equal(out[name], view[name])
        if not view.dtype.names:
            assert np.array_equal(out, view)
        del out
    del base, view
    gc.collect()
    assert arena.stats().in_use == 0


def test_unshare_takes_back_an_unsent_descriptor(arena: shm.Arena) -> None:
    peer = arena.link()
    x = arena.empty(1000, np.uint8)
    desc = arena.share(x, peer=peer)
    del x
    gc.collect()
    assert arena.stats().in_use > 0  # the descriptor holds it
    arena.unshare(desc, peer)
    assert arena.stats().in_use == 0
    assert arena.reclaim(peer) == 0  # nothing owed by the peer any more
    with pytest.raises(shm.SharedMemoryError, match="no shared reference"):
        arena.unshare(desc)


def test_share_with_an_unknown_peer_takes_no_reference(arena: shm.Arena) -> None:
    x = arena.empty(100, np.uint8)
    stranger = shm.Ring(4, 64)
    with pytest.raises(ValueError, match="link"):
        arena.share(x, peer=stranger)
    assert arena.stats().exported == 0
    stranger.close()


def test_readonly_descriptors(arena: shm.Arena) -> None:
    x = arena.put(np.arange(12.0).reshape(3, 4))
    ro = x[::-1, 1:]
    ro.flags.writeable = False
    for array, readonly in ((x, False), (ro, True), (np.empty((0, 2)), False)):
        desc = arena.share(array)
        assert desc.readonly is readonly
        assert shm.ArrayDescriptor.unpack(desc.pack()) == desc
        assert pickle.loads(pickle.dumps(desc)) == desc
        assert len(desc.pack()) == len(desc._replace(readonly=not readonly).pack())
        out = shm.open_array(desc, writable=True)  # never writable where the sender was not
        assert out.flags.writeable is not readonly
        if readonly:
            with pytest.raises(ValueError, match="read-only"):
                out[0, 0] = 1.0
            with pytest.raises(ValueError):
                out.setflags(write=True)
        np.testing.assert_array_equal(out, array)
        del out
    # A read-only view of the arena's memory shares as read-only too.
    view = shm.open_array(arena.share(x))
    desc = arena.share(view[1:])
    assert desc.readonly
    arena.unshare(desc)
    del x, ro, view
    gc.collect()
    assert arena.stats().in_use == 0


def test_in_shared_memory(arena: shm.Arena) -> None:
    x = arena.empty((4, 4), np.int16)
    assert shm.in_shared_memory(x)
    assert shm.in_shared_memory(x[1:, ::-2].T)
    assert shm.in_shared_memory(shm.open_array(arena.share(x)))
    assert not shm.in_shared_memory(np.zeros(4))
    assert not shm.in_shared_memory(np.asarray(memoryview(x)))  # no longer an arena view
    assert not shm.in_shared_memory(b"bytes")
    assert not shm.in_shared_memory([1, 2])


def test_forwarding_between_arenas_copies_nothing(backend: str) -> None:
    """A view of another arena's memory is forwarded through a proxy, never copied.

    In one process a second arena stands for another process: views imported
    from one are forwarded the same way (test_shared.py).
    """
    owner, mid, last = (
        shm.Arena(segment_size=MiB, capacity=4 * MiB, backend=backend, name=n)
        for n in ("owner", "mid", "last")
    )
    x = owner.put(np.arange(100, dtype=np.int64).reshape(10, 10))
    expected = x.copy()
    peer = mid.link()
    d1 = mid.share(x[2:, ::-3], peer=peer)
    d2 = mid.share(x[1])  # the same source anchor: the same proxy
    s = mid.stats()
    assert (s.in_use, s.peak, s.allocations, s.exported) == (0, 0, 1, 2)
    assert (d1.arena_id, d1.alloc_id) == (mid.id, d2.alloc_id)
    assert d1.segment == owner._segs[0].rw.handle
    mid.unshare(d2)
    # Opening one's own proxy descriptor gives a view of the owner's memory.
    v1 = shm.open_array(d1, writable=True)
    np.testing.assert_array_equal(v1, expected[2:, ::-3])
    x[9, 0] = expected[9, 0] = -1
    assert v1[-1, -1] == -1  # the same bytes
    assert shm.in_shared_memory(v1)
    d3 = mid.share(v1[1:])  # in place, through the same proxy
    assert (d3.alloc_id, mid.stats().allocations) == (d1.alloc_id, 1)
    d4 = last.share(v1[::2])  # forwarded twice: a proxy of a proxy
    assert d4.segment == d1.segment
    v4 = shm.open_array(d4, writable=True)
    np.testing.assert_array_equal(v4, expected[2::2, ::-3])
    del x, v1
    gc.collect()
    assert owner.stats().allocations == 1  # held for d3 and v4, through the proxies
    np.testing.assert_array_equal(shm.open_array(d3), expected[3:, ::-3])
    del v4
    gc.collect()
    for arena in (owner, mid, last):
        s = arena.stats()
        assert (s.in_use, s.allocations, s.exported) == (0, 0, 0), arena
    assert mid.reclaim(peer) == 0
    mid.close()
    y = owner.empty(3)
    with pytest.raises(shm.SharedMemoryError, match="closed"):
        mid.share(y)  # a closed arena would hold a proxy forever: none is made
    del y
    gc.collect()
    assert owner.stats().allocations == 0
    owner.close()
    last.close()


# ---------------------------------------------------------------- sealing, broadcasts, owners gone
@pytest.mark.skipif(shm.platform_info().backend != "memfd", reason="seals are memfd's")
def test_a_sealed_arena_is_writable_only_here_but_for_peer_writable_blocks() -> None:
    with shm.Arena(1 * MiB, sealed=True) as arena:
        kept = arena.empty(100, np.uint8)
        kept[:] = 3  # the owner's own mapping stays writable
        d1 = arena.share(kept)
        assert d1.segment is not None
        with pytest.raises(PermissionError):
            shm.Segment.attach(d1.segment, readonly=False)
        assert shm.Segment.attach(d1.segment, readonly=True).buf[d1.offset] == 3
        buf = arena.empty(100, np.uint8, peer_writable=True)
        assert buf.ctypes.data % shm.platform_info().page_size == 0
        d2 = arena.share(buf)
        assert d2.segment is not None
        assert d2.segment.inode != d1.segment.inode
        peer = shm.Segment.attach(d2.segment, readonly=False)  # not sealed: may be written
        peer.buf[d2.offset + d2.start] = 1
        assert buf[0] == 1
        arena.unshare(d1)
        arena.unshare(d2)


def test_peer_writable_blocks_of_whole_pages_pack_in_a_sealed_arena() -> None:
    # Issue 23: with 16 MiB segments, each 8 MiB pool.put() took a segment of its own
    # (padded for a page boundary that a sealed arena's open segments always have).
    page = shm.platform_info().page_size
    with shm.Arena(16 * MiB, sealed=True) as arena:
        before = arena.stats().segments
        blocks = [arena.put(np.ones(8 * MiB, np.uint8), peer_writable=True) for _ in range(2)]
        assert arena.stats().segments == before + 1
        assert all(b.ctypes.data % page == 0 for b in blocks)
        odd = arena.empty(page + 1, np.uint8, peer_writable=True)  # pages to itself
        assert odd.ctypes.data % page == 0
        del blocks, odd


def test_a_broadcast_is_shared_with_its_real_bytes_only(backend: str) -> None:
    with shm.Arena(1 * MiB, backend=backend) as arena:
        huge = np.broadcast_to(np.arange(3.0), (1 << 28, 4, 3))  # 24 GiB shown, 24 B real
        desc = arena.share(huge)
        assert desc.nbytes == 64  # one aligned block
        assert arena.stats().bytes_copied == 24
        assert desc.readonly  # as NumPy gives a broadcast
        view = shm.open_array(desc)
        assert view.shape == huge.shape
        assert view.strides == (0, 0, 8)
        assert np.array_equal(view[-1, -1], np.arange(3.0))


def test_a_view_of_memory_nobody_can_map_any_more_is_copied(backend: str) -> None:
    gone = shm.Arena(1 * MiB, backend=backend)
    a = gone.put(np.arange(1000.0))
    handle = gone.share(a).segment
    assert handle is not None
    assert shm._segment.reachable(handle)
    gone.close()  # its fds are closed: no other process could map it now
    assert not shm._segment.reachable(handle)
    with shm.Arena(1 * MiB, backend=backend) as arena:
        desc = arena.share(a[::2])
        assert desc.segment is not None
        assert desc.segment.inode != handle.inode
        assert arena.stats().bytes_copied == a[::2].nbytes
        assert np.array_equal(shm.open_array(desc), a[::2])


# ------------------------------------------------------------------ discard_min
def _committed(arena: shm.Arena) -> int:
    """Bytes of the arena's first segment backed by memory now."""
    return int(os.fstat(arena._segs[0].rw._fd).st_blocks) * 512


needs_discard = pytest.mark.skipif(
    not hasattr(mmap, "MADV_REMOVE"), reason="MADV_REMOVE is Linux's"
)


@needs_discard
def test_discard_min_gives_freed_pages_back_and_commits_them_again(backend: str) -> None:
    with shm.Arena(8 * MiB, backend=backend, discard_min=1 * MiB) as arena:
        before = arena.empty(5000, np.uint8)  # neighbours sharing its edge pages
        big = arena.empty(3 * MiB + 100, np.uint8)
        after = arena.empty(5000, np.uint8)
        small = arena.empty(MiB - 64, np.uint8)  # under discard_min: kept
        before[:], big[:], after[:], small[:] = 1, 2, 3, 4
        start = big.ctypes.data - arena._segs[0].rw.address
        page = mmap.PAGESIZE
        inside = (start + big.nbytes) // page * page - -(-start // page) * page
        full = _committed(arena)
        assert full == 8 * MiB  # committed as far as the blocks reach: here, all of it
        del big, small
        gc.collect()
        arena.collect()  # an idle owner gives back what was freed
        assert full - _committed(arena) == inside  # the big block's own whole pages only
        assert (before == 1).all()
        assert (after == 3).all()
        again = arena.empty(3 * MiB, np.uint8)  # reuses the hole: committed again
        assert _committed(arena) == full
        assert not arena._segs[0].holes
        again[:] = 5
        assert (before == 1).all()
        assert (after == 3).all()
        assert (again == 5).all()


def test_without_discard_min_freed_pages_stay_committed(backend: str) -> None:
    with shm.Arena(8 * MiB, backend=backend) as arena:
        big = arena.empty(3 * MiB, np.uint8)
        big[:] = 2
        full = _committed(arena)
        del big
        gc.collect()
        arena.collect()
        assert _committed(arena) == full


@needs_discard
def test_a_block_freed_and_taken_again_at_once_is_not_given_back(backend: str) -> None:
    # The worker's steady state: the last batch's block is freed by the time
    # the next is allocated. Only the surplus goes back; the reused one stays hot.
    with shm.Arena(16 * MiB, backend=backend, discard_min=1 * MiB) as arena:
        a = arena.empty(4 * MiB, np.uint8)
        b = arena.empty(4 * MiB, np.uint8)
        a[:], b[:] = 1, 2
        full = _committed(arena)
        del a, b
        gc.collect()
        c = arena.empty(4 * MiB, np.uint8)  # takes one freed block, gives the other back
        seg = arena._segs[0]
        assert len(seg.holes) == 1
        assert full - _committed(arena) == 4 * MiB
        assert (c == 1).all()  # the same pages, never zeroed
        del c


@needs_discard
def test_keep_free_keeps_the_newest_freed_pages_and_the_next_block_takes_them(
    backend: str,
) -> None:
    # A loader's worker: batches freed in turn; the newest stay warm for the
    # next one, within the bound, and the older ones go back.
    with shm.Arena(16 * MiB, backend=backend, discard_min=1 * MiB) as arena:
        arena.keep_free = 4 * MiB
        blocks = [arena.empty(3 * MiB, np.uint8) for _ in range(3)]
        for i in range(3):
            blocks[i][:] = i + 1
        full = _committed(arena)
        for _ in range(3):
            del blocks[0]  # freed oldest first: the third is the newest
            gc.collect()
        arena.collect()
        assert full - _committed(arena) == 6 * MiB  # two given back; 3 MiB <= 4 kept
        again = arena.empty(3 * MiB, np.uint8)
        assert (again == 3).all()  # the newest's pages, never zeroed (first fit: the first's)
        assert full - _committed(arena) == 6 * MiB
        del again
        gc.collect()
        arena.keep_free = 2 * MiB  # below a block: nothing is kept
        arena.collect()
        assert full - _committed(arena) == 9 * MiB


@needs_discard
def test_a_hole_that_cannot_be_committed_again_is_an_error(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with shm.Arena(8 * MiB, backend=backend, discard_min=1 * MiB) as arena:
        big = arena.empty(4 * MiB, np.uint8)
        del big
        gc.collect()
        arena.collect()
        assert arena._segs[0].holes

        def refuse(self: Any, start: int, length: int) -> None:
            raise shm.ReservationError("no memory (test)")

        monkeypatch.setattr(shm.Segment, "reserve", refuse)
        with pytest.raises(shm.ReservationError, match="no memory"):
            arena.empty(4 * MiB, np.uint8)
        assert arena.stats().in_use == 0  # the block went back to the free list
        monkeypatch.undo()
        again = arena.empty(4 * MiB, np.uint8)
        again[:] = 9
        assert (again == 9).all()


# ------------------------------------------------------------------ committing as it grows
def test_a_segment_commits_its_memory_as_allocations_reach_it(backend: str) -> None:
    # A pool's start-up zeroed 64 MiB of arena in the main process and 32 MiB in each
    # worker, most of it never used: ~25 ms of a 33 ms start.
    with shm.Arena(64 * MiB, backend=backend) as arena:
        first = FIRST_COMMIT
        assert _committed(arena) == first
        assert arena.stats().reserved == first
        a = arena.empty(first + MiB, np.uint8)  # past what is committed
        a[:] = 7  # every page is there: no SIGBUS
        assert _committed(arena) == 2 * first  # doubled, not a page at a time
        assert arena.stats().reserved == 2 * first
        b = arena.empty(40 * MiB, np.uint8)
        b[:] = 8
        assert _committed(arena) >= a.nbytes + b.nbytes
        assert arena.stats().reserved == _committed(arena)
        c = arena.empty(30 * MiB, np.uint8)  # does not fit: a second segment, also lazy
        assert arena.stats().segments == 2
        second = arena.stats().reserved - _committed(arena)
        assert c.nbytes <= second < 64 * MiB  # a 64 MiB segment, only what c needs
        assert (a == 7).all()
        assert (b == 8).all()
        del a, b, c


def test_memory_that_cannot_be_committed_is_an_error_and_the_block_is_not_lost(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with shm.Arena(16 * MiB, backend=backend) as arena:

        def refuse(self: Any, start: int, length: int) -> None:
            raise shm.ReservationError("no memory (test)")

        monkeypatch.setattr(shm.Segment, "reserve", refuse)
        small = arena.empty(1000, np.uint8)  # inside what is committed: no call
        in_use = arena.stats().in_use
        with pytest.raises(shm.ReservationError, match="no memory"):
            arena.empty(4 * MiB, np.uint8)
        assert arena.stats().in_use == in_use  # the block went back to the free list
        monkeypatch.undo()
        again = arena.empty(4 * MiB, np.uint8)
        again[:] = 9
        assert (again == 9).all()
        del small, again


def test_a_freed_block_is_taken_again_by_the_next_allocation_of_its_size(
    arena: shm.Arena,
) -> None:
    """A call's argument or result, block after block: the same block, warm, every time."""
    a = arena.empty(64 * KiB, np.uint8)
    where = a.__array_interface__["data"][0]
    del a
    for _ in range(3):
        b = arena.empty(64 * KiB, np.uint8)
        assert b.__array_interface__["data"][0] == where
        del b
    # Kept aside for its size, the block still serves any allocation that needs it.
    rest = arena.stats().reserved // MiB * MiB
    whole = arena.empty(rest - 64, np.uint8)
    assert whole.__array_interface__["data"][0] <= where
    del whole
    gc.collect()
    assert arena.stats().in_use == 0


def test_a_release_runs_once_when_its_anchor_goes_and_at_exit_for_those_alive() -> None:
    """The views' lean finalizer keeps ``weakref.finalize``'s contract."""
    import subprocess
    import sys

    script = (
        "import gc, numpy as np, shm\n"
        "from shm._views import Anchor, on_release\n"
        "a, b = Anchor(0, 0, True, None, 0, 0), Anchor(0, 0, True, None, 0, 1)\n"
        "on_release(a, print, 'a released')\n"
        "on_release(b, print, 'b released')\n"
        "on_release(a, print, 'a released again')\n"  # two on one anchor: both run
        "del a; gc.collect(); print('a gone')\n"
        "arena = shm.Arena(1 << 20)\n"
        "kept = arena.empty(1000, np.uint8)\n"
        "import atexit; atexit.register(lambda: print('in use', arena.stats().in_use))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    lines = out.stdout.splitlines()
    assert sorted(lines[:2]) == ["a released", "a released again"]
    assert lines[2:] == ["a gone", "in use 1024", "b released"]
    assert out.stderr == ""


class _CountingRing:
    """Counts the looks an arena takes at its link rings (``may_have_records``, ``try_pop``,
    ``pop_waiting``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.looks = 0
        may_have_records, try_pop = shm.Ring.may_have_records, shm.Ring.try_pop
        pop_waiting = shm.Ring.pop_waiting

        def counted_waiting(ring: shm.Ring, *args: Any) -> list[bytes]:
            self.looks += 1
            return pop_waiting(ring, *args)

        def counted(ring: shm.Ring) -> bool:
            self.looks += 1
            return may_have_records(ring)

        def counted_pop(ring: shm.Ring, **kwargs: Any) -> bytes | None:
            self.looks += 1
            return try_pop(ring, **kwargs)

        monkeypatch.setattr(shm.Ring, "may_have_records", counted)
        monkeypatch.setattr(shm.Ring, "try_pop", counted_pop)
        monkeypatch.setattr(shm.Ring, "pop_waiting", counted_waiting)


def test_allocating_looks_only_at_the_link_rings_that_have_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pool's arena has a link ring per worker and reads releases before every
    # allocation: with 64 idle rings that must not cost 64 looks an allocation.
    from shm._views import RELEASE

    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="many-links") as arena:
        rings = [arena.link() for _ in range(64)]
        descs = [arena.share(np.arange(8.0), peer=rings[k]) for k in (3, 40)]
        counter = _CountingRing(monkeypatch)
        for _ in range(200):
            arena.empty(16, np.float32)
        # One look at all 64 now and then (< a quarter of a ring a collection).
        assert counter.looks <= 200 // 4 + 1, counter.looks
        # A release pushed into one ring is applied by the next allocation,
        # looking at that ring alone (its flag), not at the 63 others.
        assert arena.stats().exported == 2
        rings[40].try_push(RELEASE.pack(arena.id, descs[1].alloc_id, 1))
        counter.looks = 0
        arena.empty(16, np.float32)
        assert arena._exported == 1
        assert 1 <= counter.looks <= 3, counter.looks
        rings[3].try_push(RELEASE.pack(arena.id, descs[0].alloc_id, 1))
        arena.share(np.asarray(arena.empty(4)))  # share() collects too
        assert arena._exported == 1


def test_collecting_passes_over_link_rings_closed_or_ended() -> None:
    # A link ring its producer ended (its end marker read once, raised once, as
    # always) or that this side closed (a pool's shutdown closes its workers'
    # rings before the arena): later collections pass over them, as they did
    # when each ring was looked at before it was popped.
    from shm._views import RELEASE

    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="ended") as arena:
        ended, closed, live = arena.link(), arena.link(), arena.link()
        descs = [arena.share(np.arange(8.0), peer=ring) for ring in (ended, closed, live)]
        ended.try_push(RELEASE.pack(arena.id, descs[0].alloc_id, 1))
        ended.close_producer()
        with pytest.raises(shm.RingClosedError):
            arena.collect()  # the release, then the end marker
        closed.close()
        live.try_push(RELEASE.pack(arena.id, descs[2].alloc_id, 1))
        assert arena.collect() == 1  # the live ring's release; the others passed over
        arena.empty(4)  # allocating collects too
        arena.share(np.asarray(arena.empty(4)))  # and so does sharing
        assert (
            arena.stats().exported == 2
        )  # the closed ring's (nobody returns it), the last share's


def test_a_release_whose_flag_was_lost_is_still_collected(monkeypatch: pytest.MonkeyPatch) -> None:
    # Weakly ordered CPUs can hide a flag: collect() and a periodic look at
    # every ring still apply the release.
    from shm._views import RELEASE

    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="lost-flag") as arena:
        rings = [arena.link() for _ in range(8)]
        descs = [arena.share(np.arange(8.0), peer=rings[5]) for _ in range(2)]
        hints = arena._hints
        assert hints.page is not None
        for desc in descs:
            rings[5].try_push(RELEASE.pack(arena.id, desc.alloc_id, 1))
            hints.page.buf[:] = bytes(len(hints.page.buf))  # the flag "lost"
        arena.empty(4)
        assert arena._exported == 2
        for _ in range(64):  # the periodic look at every ring
            arena.empty(4)
        assert arena._exported == 0
        arena.share(np.arange(3.0), peer=rings[5])
        rings[5].try_push(RELEASE.pack(arena.id, descs[0].alloc_id + 2, 1))
        hints.page.buf[:] = bytes(len(hints.page.buf))
        assert arena.collect() == 1  # an explicit collect() looks at every ring


def test_link_rings_reuse_a_freed_flag_and_adopted_rings_have_none() -> None:
    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="flags") as arena:
        a, b = arena.link(), arena.link()
        arena.reclaim(a)
        c = arena.link()  # takes a's flag
        hints = arena._hints
        assert hints.index[id(c)] == 0
        assert hints.index[id(b)] == 1
        adopted = arena.link(shm.Ring(16, shm.RELEASE_RECORD_SIZE))
        assert id(adopted) not in hints.index  # made elsewhere: looked at every time


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds through /proc")
def test_prepare_links_leaves_each_link_only_its_own_fds() -> None:
    # A pool under fork tells each worker's fds by what its link() opened: the
    # flag page all links share must not count as the first one's.
    def opened() -> int:
        return len(os.listdir("/proc/self/fd"))

    with shm.Arena(1 * MiB) as arena:
        arena.prepare_links()
        n0 = opened()
        first = arena.link()
        n1 = opened()
        second = arena.link()
        n2 = opened()
        assert n1 - n0 == n2 - n1 > 0
        for ring in (first, second):
            arena.reclaim(ring)
            ring.close()


def test_shares_of_a_described_block_read_releases_in_bulk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A pipeline shares its batch's block with share_described() each batch and
    # gets the block's release back a batch later: the releases are read every
    # COLLECT_EVERY shares, all at once, not at each share (the look at the flags
    # and the ring was ~250 bytecodes a batch); what waits stays bounded.
    from shm._arena import COLLECT_EVERY
    from shm._views import RELEASE

    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="bulk") as arena:
        ring = arena.link()
        block = arena.empty((64, 16), np.float32, peer_writable=True)
        desc = arena.describe_own(block)
        assert desc is not None
        collect = arena._collect_locked
        reads = 0

        def counted(every: bool = False) -> int:
            nonlocal reads
            reads += 1
            return collect(every)

        monkeypatch.setattr(arena, "_collect_locked", counted)
        shares = 4 * COLLECT_EVERY
        for _ in range(shares):
            assert arena.share_described(desc, peer=ring)
            # the peer opened it, used it, and let go of it
            assert ring.try_push(RELEASE.pack(arena.id, desc.alloc_id, 1))
            assert arena._exported <= COLLECT_EVERY
        assert reads == shares // COLLECT_EVERY, reads
        monkeypatch.undo()
        assert arena.stats().exported == 0
        assert arena.stats().releases_received == shares


def test_a_collection_takes_a_rings_waiting_releases_in_one_pop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Releases read in bulk (share_described's every 16th share): every record the
    # ring's head shows comes out of one Ring call, and one more finds nothing (a
    # try_pop a record and an empty one at the end before: 17 looks for 16).
    from shm._views import RELEASE

    with shm.Arena(segment_size=MiB, capacity=8 * MiB, name="bulk-pop") as arena:
        ring = arena.link()
        descs = [arena.share(np.arange(8.0), peer=ring) for _ in range(16)]
        for desc in descs:
            assert ring.try_push(RELEASE.pack(arena.id, desc.alloc_id, 1))
        counter = _CountingRing(monkeypatch)
        assert arena.collect() == 16
        assert counter.looks <= 2, counter.looks
        assert arena.stats().exported == 0
        # A ring ended after its last releases: those are applied, then its end
        # marker raises on the next look, once, as before.
        more = [arena.share(np.arange(8.0), peer=ring) for _ in range(3)]
        for desc in more:
            assert ring.try_push(RELEASE.pack(arena.id, desc.alloc_id, 1))
        ring.close_producer()
        with pytest.raises(shm.RingClosedError):
            arena.collect()
        assert arena.stats().exported == 0
