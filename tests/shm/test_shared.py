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
from tests.conftest import memfd_count, run_python, shm_names, wait_until

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


def _views_of(a: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    """What the owner shares: the whole array, a negative-strided view, an offset slice."""
    return [a, a[::-2, 1::3], a[5:9]]


def _owner(route: shm.Ring, inbox: shm.Ring, outbox: shm.Ring, backend: str) -> None:
    """Share views of one array; then on each command ("add" one to it, "drop"
    it, anything else) report the bytes in use, releases applied."""
    arena = shm.Arena(segment_size=MiB, capacity=4 * MiB, backend=backend, name="owner")
    arena.link(route)
    held = [arena.put(np.arange(600, dtype=np.int32).reshape(20, 30))]
    for desc in [arena.share(v, peer=route) for v in _views_of(held[0])]:
        outbox.push(desc.pack(), timeout=T)
    while True:
        try:
            cmd = inbox.pop(timeout=T)
        except shm.RingClosedError:
            break
        if cmd == b"add":
            held[0] += 1
        elif cmd == b"drop":
            held.clear()
        outbox.push(arena.stats().in_use.to_bytes(8, "little"), timeout=T)
    arena.close()


def _relay(up: shm.Ring, down: shm.Ring, inbox: shm.Ring, outbox: shm.Ring, backend: str) -> None:
    """Forward each descriptor received, keeping nothing but the proxy; on
    "collect", apply the releases that came back and report the allocations left."""
    arena = shm.Arena(segment_size=MiB, capacity=4 * MiB, backend=backend, name="relay")
    arena.link(down)
    while True:
        try:
            rec = inbox.pop(timeout=T)
        except shm.RingClosedError:
            break
        if rec == b"collect":
            n = arena.stats().allocations
            shm.flush_releases()
            outbox.push(n.to_bytes(8, "little"), timeout=T)
            continue
        desc = shm.ArrayDescriptor.unpack(rec)
        shm.set_release_route(desc.arena_id, up)
        fwd = arena.share(shm.open_array(desc, writable=True), peer=down)
        assert arena.stats().in_use == 0  # forwarded, not copied
        outbox.push(fwd.pack(), timeout=T)
    arena.close()


def _reader(route: shm.Ring, inbox: shm.Ring, outbox: shm.Ring) -> None:
    """Open each descriptor writable and hold it; "read" reports the views and
    whether they are writable, "drop" lets go of them."""
    held = []
    while True:
        try:
            rec = inbox.pop(timeout=T)
        except shm.RingClosedError:
            break
        if rec == b"read":
            outbox.push(pickle.dumps([(v.copy(), v.flags.writeable) for v in held]), timeout=T)
        elif rec == b"drop":
            held.clear()
            gc.collect()
            shm.flush_releases()
            outbox.push(b"dropped", timeout=T)
        else:
            desc = shm.ArrayDescriptor.unpack(rec)
            shm.set_release_route(desc.arena_id, route)  # releases go to the forwarder
            held.append(shm.open_array(desc, writable=True))
            outbox.push(b"k", timeout=T)
    shm.flush_releases()


class _Chain:
    """Owner A -> this process, the middle one -> [relay R ->] reader B."""

    def __init__(self, backend: str, relay: bool) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("forkserver")
        self.arena = shm.Arena(segment_size=MiB, capacity=4 * MiB, backend=backend, name="middle")
        self.rings: list[shm.Ring] = []
        self.a_route, self.a_in, self.a_out = self._ring(), self._ring(), self._ring()
        self.down = self.arena.link()  # releases of what this process forwards
        self.a = ctx.Process(target=_owner, args=(self.a_route, self.a_in, self.a_out, backend))
        self.r = None
        b_route = self.down
        if relay:  # the relay adopts the reader's route
            self.r_in, self.r_out, b_route = self._ring(), self._ring(), self._ring()
            args = (self.down, b_route, self.r_in, self.r_out, backend)
            self.r = ctx.Process(target=_relay, args=args)
        self.b_in, self.b_out = self._ring(), self._ring(16 << 10)
        self.b = ctx.Process(target=_reader, args=(b_route, self.b_in, self.b_out))
        self.procs = [p for p in (self.a, self.r, self.b) if p is not None]
        for p in self.procs:
            p.start()
        recs = [self.a_out.pop(timeout=T, watch=[self.a]) for _ in range(3)]
        self.descs = [shm.ArrayDescriptor.unpack(r) for r in recs]
        shm.set_release_route(self.descs[0].arena_id, self.a_route)

    def _ring(self, record_size: int = 512) -> shm.Ring:
        ring = shm.Ring(16, record_size)
        self.rings.append(ring)
        return ring

    def owner_in_use(self, cmd: bytes = b"?") -> int:
        self.a_in.push(cmd, timeout=T, watch=[self.a])
        return int.from_bytes(self.a_out.pop(timeout=T, watch=[self.a]), "little")

    def send(self, desc: shm.ArrayDescriptor) -> None:
        """Send a descriptor to the reader, through the relay if there is one."""
        rec = desc.pack()
        if self.r is not None:
            self.r_in.push(rec, timeout=T, watch=[self.r])
            rec = self.r_out.pop(timeout=T, watch=[self.r])
        self.b_in.push(rec, timeout=T, watch=[self.b])
        assert self.b_out.pop(timeout=T, watch=[self.b]) == b"k"

    def ask_reader(self, cmd: bytes) -> bytes:
        self.b_in.push(cmd, timeout=T, watch=[self.b])
        return self.b_out.pop(timeout=T, watch=[self.b])

    def relay_allocations(self) -> int:
        assert self.r is not None
        self.r_in.push(b"collect", timeout=T, watch=[self.r])
        return int.from_bytes(self.r_out.pop(timeout=T, watch=[self.r]), "little")

    def close(self) -> None:
        for ring in (self.a_in, self.b_in, *([self.r_in] if self.r else [])):
            ring.close_producer()
        for p in self.procs:
            p.join(T)
        shm.set_release_route(self.descs[0].arena_id, None)
        self.arena.close()
        for ring in self.rings:
            ring.close()


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
            # A killed owner cannot unlink its names; the next user reaps them
            # (this one, or any process making its first named segment: other
            # tests running at the same time do, so whoever reaped, none is left).
            shm.reap_orphans()
            if os.path.isdir("/dev/shm"):  # where Linux lists POSIX names
                assert not [n for n in os.listdir("/dev/shm") if f"-{p.pid}-" in n]
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


@pytest.mark.parametrize("relay", [False, True], ids=["A-M-B", "A-M-R-B"])
def test_forwarding_is_zero_copy_and_memory_goes_back_to_its_owner(
    relay: bool, backend: str, no_leaks: None
) -> None:
    chain = _Chain(backend, relay)
    arena = chain.arena
    # The first view is imported writable, the others read-only.
    views = [shm.open_array(d, writable=i == 0) for i, d in enumerate(chain.descs)]
    assert all(shm.in_shared_memory(v) and not arena.owns(v) for v in views)
    fwd = [arena.share(v, peer=chain.down) for v in views]
    s = arena.stats()
    assert (s.in_use, s.allocations, s.exported) == (0, 3, 3)  # three proxies, no copy
    for f, d in zip(fwd, chain.descs, strict=True):
        assert (f.arena_id, f.segment) == (arena.id, d.segment)  # our releases, A's memory
        assert (f.offset, f.nbytes, f.start, f.strides) == (d.offset, d.nbytes, d.start, d.strides)
    assert [f.readonly for f in fwd] == [False, True, True]
    for f in fwd:
        chain.send(f)
    expected = _views_of(np.arange(600, dtype=np.int32).reshape(20, 30))
    for bump in (0, 1):
        got = pickle.loads(chain.ask_reader(b"read"))
        for (arr, _), exp in zip(got, expected, strict=True):
            np.testing.assert_array_equal(arr, exp + bump)
        assert [w for _, w in got] == [True, False, False]
        chain.owner_in_use(b"add")  # the reader sees the owner's writes: the same bytes

    assert chain.ask_reader(b"drop") == b"dropped"
    if relay:
        wait_until(lambda: chain.relay_allocations() == 0, 10, "the relay's proxies to go")
    wait_until(lambda: arena.stats().allocations == 0, 10, "this process's proxies to go")
    assert arena.stats().exported == 0
    assert chain.owner_in_use(b"drop") > 0  # this process still holds its own views
    del views
    gc.collect()
    shm.flush_releases()
    wait_until(lambda: chain.owner_in_use() == 0, 10, "the owner to get its memory back")
    chain.close()
    assert [p.exitcode for p in chain.procs] == [0] * len(chain.procs)


def test_forwarded_view_of_a_killed_peer_is_reclaimed(backend: str, no_leaks: None) -> None:
    chain = _Chain(backend, relay=False)
    views = [shm.open_array(d) for d in chain.descs]
    for desc in [chain.arena.share(v, peer=chain.down) for v in views]:
        chain.send(desc)
    del views
    gc.collect()
    assert chain.owner_in_use(b"drop") > 0  # the proxies hold the owner's memory for B
    os.kill(chain.b.pid, signal.SIGKILL)
    chain.b.join(T)
    assert chain.arena.stats().exported == 3
    assert chain.arena.reclaim(chain.down) == 3
    assert chain.arena.stats().allocations == 0
    shm.flush_releases()
    wait_until(lambda: chain.owner_in_use() == 0, 10, "the owner to get its memory back")
    chain.close()
    assert chain.a.exitcode == 0
    assert chain.b.exitcode == -signal.SIGKILL


_CLOSED_LIFELINE_SCRIPT = """
import os
import shm

life = shm.Lifeline()
w = life._w
life.close()  # kept alive, closed: its numbers are free again
r2, w2 = os.pipe()  # takes them, as the pipes of a forked Process do
assert w in (r2, w2), (w, r2, w2)
pid = os.fork()
if pid == 0:
    try:
        os.fstat(w)  # the after-fork hook must not have closed the new pipe's end
    except OSError:
        os._exit(1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_fork_after_a_lifeline_closed_keeps_reused_fds() -> None:
    # A closed lifeline still alive (a closed pool's) once made every later
    # forked child close whatever file now had its write end's number: the
    # pipes of a fork-started Process, which then exited with status 1.
    assert run_python("-c", _CLOSED_LIFELINE_SCRIPT).strip() == "0"
