"""Segments: reservation, privacy, attaching, and the clear errors."""

from __future__ import annotations

import os
import pickle
import stat

import numpy as np
import pytest

import shm
from shm._segment import format_bytes

MiB = 1 << 20


def test_create_attach_roundtrip(backend: str, no_leaks: None) -> None:
    seg = shm.Segment.create(10_000, backend)
    assert seg.size % os.sysconf("SC_PAGE_SIZE") == 0
    assert seg.size >= 10_000
    seg.buf[:5] = b"hello"
    peer = shm.Segment.attach(seg.handle, readonly=True)
    assert peer.buf[:5] == b"hello"
    with pytest.raises(TypeError):
        peer.buf[0] = 1  # read-only mapping
    seg.close()
    seg.close()  # idempotent
    assert seg.closed
    assert peer.buf[:5] == b"hello"  # mappings outlive the owner's close


def test_memfd_is_unnamed_and_private(no_leaks: None) -> None:
    if not shm.platform_info().memfd:
        pytest.skip("memfd is Linux-only")
    seg = shm.Segment.create(4096, "memfd")
    assert not seg.handle.name
    target = os.readlink(f"/proc/self/fd/{seg.handle.fd}")
    assert target.startswith("/memfd:")
    assert target.endswith("(deleted)")
    seg.close()


def test_posix_segment_is_private_and_unlinked(no_leaks: None) -> None:
    seg = shm.Segment.create(4096, "posix")
    path = "/dev/shm" + seg.handle.name
    if os.path.exists(path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    seg.unlink()
    assert not os.path.exists(path)
    seg.buf[0] = 7  # still usable through its fd and mapping
    seg.close()


def test_attach_after_close_is_a_clear_error(backend: str, no_leaks: None) -> None:
    seg = shm.Segment.create(4096, backend)
    handle = seg.handle
    seg.close()
    with pytest.raises(shm.AttachError, match="owner has exited or closed it"):
        shm.Segment.attach(handle)


def test_recycled_fd_number_is_detected(no_leaks: None) -> None:
    if not shm.platform_info().memfd:
        pytest.skip("memfd is Linux-only")
    first = shm.Segment.create(4096, "memfd")
    handle = first.handle
    first.close()
    second = shm.Segment.create(4096, "memfd")  # very likely reuses the fd number
    try:
        if second.handle.fd == handle.fd:
            with pytest.raises(shm.AttachError, match="gone"):
                shm.Segment.attach(handle)
    finally:
        second.close()


def test_reservation_failure_names_sizes(backend: str) -> None:
    with pytest.raises(shm.ReservationError, match=r"cannot reserve 1024\.0 TiB") as info:
        shm.Segment.create(1 << 50, backend)
    assert "free" in str(info.value)
    assert isinstance(info.value, MemoryError)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive"):
        shm.Segment.create(0)
    with pytest.raises(ValueError, match="backend"):
        shm.Segment.create(10, "sysv")


def test_segment_handed_over_only_at_process_start(no_leaks: None) -> None:
    seg = shm.Segment.create(4096)
    with pytest.raises(TypeError, match="only to a child process while it starts"):
        pickle.dumps(seg)
    handle = pickle.loads(pickle.dumps(seg.handle))  # the handle itself is plain data
    assert handle == seg.handle
    seg.close()


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"


def test_reap_orphans_spares_the_living(no_leaks: None) -> None:
    seg = shm.Segment.create(4096, "posix")
    assert seg.handle.name.lstrip("/") not in shm.reap_orphans()
    seg.close()


def test_tag_is_validated() -> None:
    with pytest.raises(ValueError, match="tag"):
        shm.Segment.create(10, tag="../../etc")


def test_a_segment_can_commit_part_of_itself_now_and_the_rest_later(
    backend: str, no_leaks: None
) -> None:
    seg = shm.Segment.create(8 * MiB, backend, commit=MiB)
    try:
        assert seg.size == 8 * MiB
        assert os.fstat(seg._fd).st_blocks * 512 == MiB
        seg.reserve(MiB, 7 * MiB)
        assert os.fstat(seg._fd).st_blocks * 512 == 8 * MiB
        np.frombuffer(seg.buf, np.uint8)[:] = 3
    finally:
        seg.close()
