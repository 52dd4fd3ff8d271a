"""A segment's page API: its fd, a private copy-on-write map, dropping this process's pages."""

from __future__ import annotations

import gc
import mmap
import os
import weakref

import numpy as np
import pytest

import shm

PAGE = mmap.PAGESIZE


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that holds ``address`` (Linux)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= address < hi
            elif found and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_open_fd_is_the_segment_until_its_owner_closes_it(backend: str, no_leaks: None) -> None:
    seg = shm.Segment.create(2 * PAGE, backend)
    seg.buf[:5] = b"hello"
    peer = shm.Segment.attach(seg.handle, readonly=True)
    fd = peer.open_fd()
    try:
        assert os.fstat(fd).st_ino == seg.handle.inode
        assert os.pread(fd, 5, 0) == b"hello"
        with pytest.raises(OSError):
            os.write(fd, b"x")  # opened read-only
    finally:
        os.close(fd)
    fd = peer.open_fd(writable=True)
    try:
        os.pwrite(fd, b"J", 0)
    finally:
        os.close(fd)
    assert seg.buf[:5] == b"Jello"
    seg.close()
    with pytest.raises(shm.AttachError):
        peer.open_fd()  # the owner closed it: no fd names it any more


def test_map_private_reads_the_segment_and_writes_its_own_copy(
    backend: str, no_leaks: None
) -> None:
    seg = shm.Segment.create(4 * PAGE, backend)
    seg.buf[PAGE : PAGE + 3] = b"abc"
    seg.buf[2 * PAGE : 2 * PAGE + 3] = b"xyz"

    class Kept:
        pass

    kept = Kept()
    gone = weakref.ref(kept)
    pages = seg.map_private(PAGE, 2 * PAGE, keep=kept)
    del kept
    view = np.frombuffer(pages, np.uint8)
    address = view.ctypes.data
    assert bytes(view[:3]) == b"abc"
    assert bytes(view[PAGE : PAGE + 3]) == b"xyz"
    view[0] = ord("A")  # a write copies that page: the segment is unchanged
    assert bytes(view[:3]) == b"Abc"
    assert seg.buf[PAGE : PAGE + 3] == b"abc"
    seg.buf[2 * PAGE] = ord("X")  # a page not yet written reads the segment as it is now
    assert bytes(view[PAGE : PAGE + 3]) == b"Xyz"
    assert gone() is not None  # held as long as the mapping
    del view, pages
    gc.collect()
    assert gone() is None
    assert not _mapped(address)  # unmapped with its last reference
    with pytest.raises(ValueError, match="cannot map"):
        seg.map_private(1, PAGE)  # not on a page boundary
    with pytest.raises(ValueError, match="cannot map"):
        seg.map_private(0, 5 * PAGE)  # past the segment
    seg.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_drop_pages_frees_this_process_pages_and_keeps_the_data(
    backend: str, no_leaks: None
) -> None:
    seg = shm.Segment.create(64 * PAGE, backend)
    data = np.frombuffer(seg.buf, np.uint8)
    data[:] = np.arange(data.size, dtype=np.uint64).astype(np.uint8)  # every page resident
    address = seg.address
    assert _rss_kib(address) >= 64 * PAGE // 1024
    # Offsets in the segment; start rounds down to its page, the end up: pages 1..62 go.
    seg.drop_pages(PAGE + 100, 61 * PAGE)
    assert _rss_kib(address) <= 2 * PAGE // 1024
    assert np.array_equal(data, np.arange(data.size, dtype=np.uint64).astype(np.uint8))
    del data
    seg.close()
