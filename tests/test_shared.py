"""Arrays shared between processes: lifetimes, releases, crashes, exhaustion."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import time
from typing import Any

import numpy as np
import pytest

import shm
from tests.conftest import memfd_count, shm_names, wait_until

MiB = 1 << 20
T = 30  # every blocking call in these tests is bounded by this


def _checksum(a: np.ndarray[Any, Any]) -> int:
    return int(np.frombuffer(np.ascontiguousarray(a).tobytes(), np.uint8).sum(dtype=np.int64))


# ------------------------------------------------------------------ children
def _consume(arena_id: int, route: shm.Ring, inbox: shm.Ring, outbox: shm.Ring) -> None:
    """Open every descriptor, check it, drop it; report checksums."""
    shm.set_release_route(arena_id, route)
    while True:
        try:
            rec = inbox.pop(timeout=T)
        except shm.RingClosedError:
            break
        desc = pickle.loads(rec)
        view = shm.open_array(desc)
        assert not view.flags.writeable
        outbox.push(_checksum(view).to_bytes(8, "little"), timeout=T)
        del view
    shm.flush_releases()
    outbox.close_producer()


def _own_and_send(route: shm.Ring, outbox: shm.Ring, inbox: shm.Ring, backend: str) -> None:
    """Own an arena, send a descriptor, then wait to be told to exit (or be killed)."""
    arena = shm.Arena(segment_size=4 * MiB, capacity=16 * MiB, backend=backend)
    arena.link(route)
    data = arena.put(np.arange(MiB // 8, dtype=np.float64))
    outbox.push(pickle.dumps(arena.share(data[::2])), timeout=T)
    del data
    inbox.pop(timeout=T)  # parent says: done, or kills us before
    deadline = time.monotonic() + T
    while arena.stats().allocations and time.monotonic() < deadline:
        shm.wait([route], timeout=0.05)  # releases arrive on the route ring
    outbox.push(arena.stats().allocations.to_bytes(8, "little"), timeout=T)
    arena.close()


def _hold_arena_and_wait(outbox: shm.Ring, inbox: shm.Ring) -> None:
    arena = shm.Arena(segment_size=8 * MiB, capacity=32 * MiB)
    keep = [arena.empty(MiB, np.uint8) for _ in range(10)]
    outbox.push(b"ready", timeout=T)
    inbox.pop(timeout=T)
    del keep


# ------------------------------------------------------------------ tests
def test_many_processes_open_and_release_concurrently(ctx: Any, no_leaks: None) -> None:
    arena = shm.Arena(segment_size=2 * MiB, capacity=64 * MiB, name="parent")
    rng = np.random.default_rng(1)
    peers = []
    for _ in range(3):
        route, inbox, outbox = arena.link(), shm.Ring(64, 1024), shm.Ring(64, 16)
        p = ctx.Process(target=_consume, args=(arena.id, route, inbox, outbox))
        p.start()
        peers.append((p, inbox, outbox))
    expected: list[list[int]] = [[] for _ in peers]
    got: list[list[int]] = [[] for _ in peers]
    for i in range(150):
        k = i % len(peers)
        n = int(rng.integers(1, 200_000))
        arr = rng.integers(0, 255, n, dtype=np.uint8).reshape(-1, 1)[:: int(rng.integers(1, 3))]
        expected[k].append(_checksum(arr))
        _, inbox, outbox = peers[k]
        inbox.push(pickle.dumps(arena.share(arr, tag=f"peer{k}")), timeout=T, watch=[peers[k][0]])
        while (rec := outbox.try_pop()) is not None:
            got[k].append(int.from_bytes(rec, "little"))
    for k, (p, inbox, outbox) in enumerate(peers):
        inbox.close_producer()
        while True:
            try:
                got[k].append(int.from_bytes(outbox.pop(timeout=T, watch=[p]), "little"))
            except shm.RingClosedError:
                break
        p.join(T)
        assert p.exitcode == 0
    assert got == expected
    wait_until(lambda: arena.stats().allocations == 0, 10, "every release to come back")
    s = arena.stats()
    assert s.in_use == 0
    assert s.exported == 0
    assert s.releases_received == 150
    for _, inbox, outbox in peers:
        inbox.close()
        outbox.close()
    arena.close()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_view_outlives_its_sender(how: str, backend: str, no_leaks: None) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    route, outbox, inbox = shm.Ring(256, shm.RELEASE_RECORD_SIZE), shm.Ring(4, 1024), shm.Ring(4, 8)
    p = ctx.Process(target=_own_and_send, args=(route, outbox, inbox, backend))
    p.start()
    desc = pickle.loads(outbox.pop(timeout=T, watch=[p]))
    shm.set_release_route(desc.arena_id, route)
    view = shm.open_array(desc)
    expected = np.arange(MiB // 8, dtype=np.float64)[::2]
    if how == "sigkill":
        os.kill(p.pid, signal.SIGKILL)
        p.join(T)
        assert p.exitcode == -signal.SIGKILL
        np.testing.assert_array_equal(view, expected)  # still mapped, still right
        if backend == "posix":
            # A killed owner cannot unlink its names; the next user reaps them.
            assert any(f"-{p.pid}-" in n for n in shm.reap_orphans())
            np.testing.assert_array_equal(view, expected)
        del view
        gc.collect()  # the release goes to a dead owner: dropped, no error
    else:
        inbox.push(b"go", timeout=T)
        np.testing.assert_array_equal(view, expected)
        del view
        gc.collect()
        shm.flush_releases()
        left = int.from_bytes(outbox.pop(timeout=T, watch=[p]), "little")
        assert left == 0, "the owner did not get the release back"
        p.join(T)
        assert p.exitcode == 0
    shm.set_release_route(desc.arena_id, None)
    for r in (route, outbox, inbox):
        r.close()


def test_sigkilled_owner_leaves_nothing(no_leaks: None) -> None:
    if not shm.platform_info().memfd:
        pytest.skip("named segments of a SIGKILLed owner are only cleaned on close")
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    outbox, inbox = shm.Ring(4, 16), shm.Ring(4, 16)
    names_before = shm_names()
    memfds_before = memfd_count()
    p = ctx.Process(target=_hold_arena_and_wait, args=(outbox, inbox))
    p.start()
    assert outbox.pop(timeout=T, watch=[p]) == b"ready"
    assert memfd_count(p.pid) >= 1  # it really holds shared memory
    os.kill(p.pid, signal.SIGKILL)
    p.join(T)
    assert p.exitcode == -signal.SIGKILL
    wait_until(lambda: not os.path.exists(f"/proc/{p.pid}"), 10, "the owner to be reaped")
    assert shm_names() == names_before
    assert memfd_count() == memfds_before
    outbox.close()
    inbox.close()


def _fill_remote(
    arena_id: int, route: shm.Ring, inbox: shm.Ring, outbox: shm.Ring, bye: shm.Ring
) -> None:
    shm.set_release_route(arena_id, route)
    held = []
    while True:
        try:
            held.append(shm.open_array(pickle.loads(inbox.pop(timeout=T))))
        except shm.RingClosedError:
            break
        outbox.push(b"k", timeout=T)
    outbox.push(b"holding", timeout=T)
    bye.pop(timeout=T)  # hold every view until told (or killed)
    del held
    shm.flush_releases()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_exhaustion_by_a_peer_is_an_error_then_recovers(how: str, no_leaks: None) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    arena = shm.Arena(segment_size=MiB, capacity=4 * MiB)
    route, inbox, outbox, bye = arena.link(), shm.Ring(16, 1024), shm.Ring(16, 16), shm.Ring(1, 1)
    p = ctx.Process(target=_fill_remote, args=(arena.id, route, inbox, outbox, bye))
    p.start()
    for _ in range(4):
        desc = arena.share(np.ones(MiB // 8), peer=route)
        inbox.push(pickle.dumps(desc), timeout=T, watch=[p])
        assert outbox.pop(timeout=T, watch=[p]) == b"k"
    inbox.close_producer()
    assert outbox.pop(timeout=T, watch=[p]) == b"holding"
    with pytest.raises(shm.ArenaFullError, match="4 of them referenced"):
        arena.empty(MiB, np.uint8)
    if how == "exit":
        bye.push(b"x", timeout=T)
        p.join(T)
        wait_until(lambda: arena.stats().allocations == 0, 10, "the peer's releases")
        assert arena.empty(MiB, np.uint8).nbytes == MiB  # recovered
    else:
        os.kill(p.pid, signal.SIGKILL)
        p.join(T)
        # A killed peer cannot return its references: the owner takes back
        # what it shared with that peer.
        assert arena.stats().exported == 4
        assert arena.reclaim(route) == 4
        assert arena.stats().allocations == 0
    assert p.exitcode == (0 if how == "exit" else -signal.SIGKILL)
    arena.close()
    for r in (inbox, outbox, bye):
        r.close()
