"""Rings: records, FIFO order, timeouts, closing, waiting, stats, and peers in processes.

Single-process tests keep in mind that popped slots go back to the producer
lazily (in batches, or when the consumer is about to block): a producer is only
guaranteed to refill the ring after the consumer has drained it and found it
empty (``try_pop() is None``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import wait_until

import shm

LONG = 30.0  # the bound on every wait that should succeed (never reached when all is well)
PROMPT = 5.0  # how soon a dead peer must be noticed, far below LONG


def _u64(i: int) -> bytes:
    return i.to_bytes(8, "little")


def _counters(lo: int, hi: int) -> bytes:
    return np.arange(lo, hi, dtype="<u8").tobytes()


def _drain(ring: shm.Ring) -> list[bytes]:
    """Pop until the ring is empty (which also hands every slot back to the producer)."""
    out = []
    while (rec := ring.try_pop()) is not None:
        out.append(rec)
    return out


@contextlib.contextmanager
def _rings(*rings: shm.Ring) -> Iterator[None]:
    try:
        yield
    finally:
        for r in rings:
            r.close()


@contextlib.contextmanager
def _child(ctx: Any, target: Callable[..., None], *args: Any) -> Iterator[Any]:
    """Run ``target(*args)`` in a child; always reap it (tests join it on success)."""
    proc = ctx.Process(target=target, args=args, daemon=True)
    proc.start()
    try:
        yield proc
    finally:
        if proc.is_alive():  # a failed test: do not wait for the child's own timeouts
            proc.kill()
        proc.join(LONG)
        proc.close()


def _kill_when(proc: Any, predicate: Callable[[], bool]) -> threading.Thread:
    """SIGKILL ``proc`` from a thread as soon as ``predicate()`` (or after LONG anyway)."""

    def run() -> None:
        deadline = time.monotonic() + LONG
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.001)
        with contextlib.suppress(ValueError):  # already closed by a failing test
            proc.kill()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------ child processes
# Module-level, so that spawn can import them.


def _produce_counters(ring: shm.Ring, n: int, batch: int) -> None:
    blob = _counters(0, n)
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        ring.push_many([blob[8 * i : 8 * i + 8] for i in range(lo, hi)], timeout=LONG)
    ring.close_producer()
    ring.close()


def _echo(requests: shm.Ring, replies: shm.Ring, n: int) -> None:
    for _ in range(n):
        replies.push(requests.pop(timeout=LONG), timeout=LONG)
    replies.close_producer()
    requests.close()
    replies.close()


def _produce_then_exit(ring: shm.Ring, k: int) -> None:
    for i in range(k):
        ring.push(_u64(i), timeout=LONG)
    raise SystemExit(3)  # without closing the ring


def _produce_then_hang(ring: shm.Ring, k: int) -> None:
    for i in range(k):
        ring.push(_u64(i), timeout=LONG)
    time.sleep(LONG)  # until SIGKILLed


def _consume_then_exit(ring: shm.Ring, k: int) -> None:
    for _ in range(k):
        ring.pop(timeout=LONG)
    raise SystemExit(3)


def _consume_then_hang(ring: shm.Ring, k: int) -> None:
    for _ in range(k):
        ring.pop(timeout=LONG)
    time.sleep(LONG)


# ------------------------------------------------------------ construction


@pytest.mark.parametrize(
    ("capacity", "record_size"), [(0, 8), ((1 << 20) + 1, 8), (4, 0), (4, (1 << 20) + 1)]
)
def test_bad_arguments(capacity: int, record_size: int) -> None:
    with pytest.raises(ValueError, match="must be in"):
        shm.Ring(capacity, record_size)


def test_fresh_ring(no_leaks: None) -> None:
    ring = shm.Ring(8, 24)
    with _rings(ring):
        assert ring.capacity == 8
        assert ring.record_size == 24
        assert isinstance(ring.fileno(), int)
        assert ring.stats() == shm.RingStats(8, 24, 0, 0, 0, 0, 0, 0)
        assert "0/8 records of 24 B" in repr(ring)
        assert ring.try_pop() is None
    ring.close()  # idempotent


def test_may_have_records_hint(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        assert not ring.may_have_records()
        ring.push(b"a")
        ring.push(b"b")
        assert ring.may_have_records()
        assert ring.try_pop() == b"a"
        assert ring.may_have_records()  # one credit taken, not yet popped
        assert ring.try_pop() == b"b"
        assert not ring.may_have_records()
        assert ring.try_pop() is None
        ring.close_producer()
        assert ring.may_have_records()  # the end marker is there to be seen
        with pytest.raises(shm.RingClosedError):
            ring.try_pop()


# ------------------------------------------------------------ records


def test_record_sizes(no_leaks: None) -> None:
    ring = shm.Ring(4, 16)
    with _rings(ring):
        ring.push(b"", timeout=LONG)
        ring.push(b"x" * 16, timeout=LONG)
        with pytest.raises(ValueError, match="17 bytes exceeds record_size 16"):
            ring.push(b"y" * 17, timeout=LONG)
        with pytest.raises(ValueError, match="exceeds record_size"):
            ring.try_push(bytearray(100))
        with pytest.raises(ValueError, match="exceeds record_size"):
            ring.push_many([b"ok", b"z" * 17], timeout=LONG)  # checked before any push
        assert ring.stats().pushed == 2
        assert ring.pop(timeout=LONG) == b""
        assert ring.pop(timeout=LONG) == b"x" * 16
        assert ring.try_pop() is None
        ring.push(b"still works", timeout=LONG)
        assert ring.pop(timeout=LONG) == b"still works"


def test_input_types(no_leaks: None) -> None:
    ring = shm.Ring(8, 8)
    with _rings(ring):
        backing = bytearray(b"0123456789")
        inputs: list[Any] = [
            b"bytes",
            bytearray(b"barray"),
            memoryview(b"mview"),
            memoryview(backing)[2:9],  # a slice of a larger buffer
            memoryview(b""),
        ]
        for data in inputs:
            ring.push(data, timeout=LONG)
        backing[:] = b"##########"  # the ring copied the bytes at push time
        got = [ring.pop(timeout=LONG) for _ in inputs]
        assert got == [b"bytes", b"barray", b"mview", b"2345678", b""]
        assert all(type(r) is bytes for r in got)


def test_fifo_order_with_every_pop_flavour(no_leaks: None) -> None:
    ring = shm.Ring(16, 8)
    with _rings(ring):
        assert all(ring.try_push(_u64(i)) for i in range(6))
        ring.push_many([_u64(i) for i in range(6, 16)], timeout=LONG)
        assert not ring.try_push(b"full")
        got = [ring.pop(timeout=LONG), ring.try_pop()]
        got += ring.pop_many(3, timeout=LONG)
        got += ring.pop_many(timeout=LONG)
        assert got == [_u64(i) for i in range(16)]
        assert ring.try_pop() is None


def test_capacity_one(no_leaks: None) -> None:
    ring = shm.Ring(1, 8)
    with _rings(ring):
        for i in range(200):
            ring.push(_u64(i), timeout=LONG)
            assert not ring.try_push(b"no room")
            assert ring.pop(timeout=LONG) == _u64(i)
        assert ring.try_pop() is None
        assert ring.stats().peak == 1


@pytest.mark.parametrize("capacity", [2, 3, 7])
def test_wraparound_many_times(capacity: int, no_leaks: None) -> None:
    ring = shm.Ring(capacity, 12)
    rng = random.Random(capacity)
    with _rings(ring):
        n = 0
        for _ in range(150):  # each round refills the ring and drains it
            batch = [
                rng.randbytes(rng.randrange(13)) for _ in range(rng.randrange(1, capacity + 1))
            ]
            ring.push_many(batch, timeout=LONG)
            assert _drain(ring) == batch
            n += len(batch)
        s = ring.stats()
        assert s.pushed == s.popped == n > 20 * capacity
        assert s.occupancy == 0
        assert s.peak == capacity


def test_random_try_push_try_pop_against_model(no_leaks: None) -> None:
    """try_* never lose, duplicate or reorder records; a drained ring refills completely."""
    capacity = 5
    ring = shm.Ring(capacity, 8)
    rng = random.Random(7)
    model: deque[bytes] = deque()
    seq = 0
    with _rings(ring):
        for _ in range(3000):
            if rng.random() < 0.5:
                if ring.try_push(_u64(seq)):
                    model.append(_u64(seq))
                    seq += 1
                assert len(model) <= capacity
            else:
                got = ring.try_pop()
                if model:
                    assert got == model.popleft()
                else:
                    assert got is None
                    # Empty and flushed: every slot is free again.
                    for _ in range(capacity):
                        assert ring.try_push(_u64(seq))
                        model.append(_u64(seq))
                        seq += 1
                    assert not ring.try_push(b"full")
            assert ring.stats().occupancy == len(model)
        assert _drain(ring) == list(model)
        assert seq > 1000


# ------------------------------------------------------------ timeouts


def test_pop_timeout_on_empty_ring(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        t0 = time.monotonic()
        with pytest.raises(shm.RingTimeoutError, match="no record arrived") as info:
            ring.pop(timeout=0.05)
        elapsed = time.monotonic() - t0
        assert 0.04 <= elapsed < PROMPT
        assert isinstance(info.value, TimeoutError)
        assert not isinstance(info.value, shm.RingClosedError)
        with pytest.raises(shm.RingTimeoutError):
            ring.pop_many(10, timeout=0.01)
        with pytest.raises(shm.RingTimeoutError):
            ring.pop(timeout=0)
        assert ring.try_pop() is None
        assert ring.stats().consumer_waits == 2  # try_pop and timeout=0 never wait


def test_push_timeout_on_full_ring(no_leaks: None) -> None:
    ring = shm.Ring(3, 8)
    with _rings(ring):
        for i in range(3):
            ring.push(_u64(i), timeout=LONG)
        assert not ring.try_push(b"x")
        t0 = time.monotonic()
        with pytest.raises(shm.RingTimeoutError, match="no free slot") as info:
            ring.push(b"x", timeout=0.05)
        assert 0.04 <= time.monotonic() - t0 < PROMPT
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(shm.RingTimeoutError):
            ring.push(b"x", timeout=0)
        assert ring.stats().producer_waits == 1
        assert ring.stats().pushed == 3
        assert _drain(ring) == [_u64(i) for i in range(3)]


def test_push_many_timeout_reports_progress(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        ring.push_many([b"a", b"b"], timeout=LONG)
        with pytest.raises(shm.RingTimeoutError, match=r"\(2 of 5 pushed\)"):
            ring.push_many([b"c", b"d", b"e", b"f", b"g"], timeout=0.05)
        assert _drain(ring) == [b"a", b"b", b"c", b"d"]  # the two that fitted are in


# ------------------------------------------------------------ closing


def test_close_producer_delivers_everything_then_closed(no_leaks: None) -> None:
    ring = shm.Ring(8, 8)
    with _rings(ring):
        ring.push_many([b"a", b"b", b"c"], timeout=LONG)
        ring.close_producer()
        ring.close_producer()  # idempotent
        with pytest.raises(shm.RingClosedError, match="producer end is closed"):
            ring.push(b"d", timeout=LONG)
        with pytest.raises(shm.RingClosedError):
            ring.try_push(b"d")
        with pytest.raises(shm.RingClosedError):
            ring.push_many([b"d"], timeout=LONG)
        assert ring.pop(timeout=LONG) == b"a"
        assert ring.pop_many(timeout=LONG) == [b"b", b"c"]
        for pop in (
            lambda: ring.pop(timeout=LONG),
            lambda: ring.pop_many(timeout=LONG),
            ring.try_pop,
            lambda: ring.pop(timeout=LONG),  # sticky
        ):
            t0 = time.monotonic()
            with pytest.raises(shm.RingClosedError, match="producer closed it") as info:
                pop()
            assert time.monotonic() - t0 < PROMPT  # at once, not after a timeout
            assert not isinstance(info.value, shm.PeerDiedError)


def test_close_producer_on_empty_ring(no_leaks: None) -> None:
    ring = shm.Ring(2, 8)
    with _rings(ring):
        ring.close_producer()
        with pytest.raises(shm.RingClosedError):
            ring.pop_many(timeout=LONG)


def test_close_producer_on_full_ring_reaches_consumer(no_leaks: None) -> None:
    # The ring is full: the end marker must still get through (it has a spare slot).
    ring = shm.Ring(2, 8)
    with _rings(ring):
        ring.push_many([b"a", b"b"], timeout=LONG)
        ring.close_producer()
        assert [ring.pop(timeout=LONG), ring.pop(timeout=LONG)] == [b"a", b"b"]
        try:
            ring.pop(timeout=0.05)
            outcome = "a record"
        except shm.RingClosedError:
            outcome = "RingClosedError"
        except shm.RingTimeoutError:
            outcome = "RingTimeoutError"
        assert outcome == "RingClosedError", (
            "shm bug: close_producer() on a full ring returned without error, but the "
            f"consumer never learns that the ring is closed (pop gave {outcome}): the "
            "producer_closed flag is set yet never read, and no end marker was written"
        )


def test_close_consumer_makes_push_fail(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        ring.push(b"a", timeout=LONG)
        ring.close_consumer()
        with pytest.raises(shm.RingClosedError, match="consumer closed it"):  # noqa: PT012
            for _ in range(ring.capacity + 1):  # credits already held may still be used
                ring.push(b"x", timeout=1.0)


def test_push_keeps_failing_after_consumer_closed(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        ring.close_consumer()
        with pytest.raises(shm.RingClosedError):
            ring.push(b"x", timeout=0.05)
        accepted = 0
        for _ in range(3):
            try:
                ring.push(b"x", timeout=0.05)
                accepted += 1
            except shm.RingClosedError:
                pass
        assert accepted == 0, (
            f"shm bug: after close_consumer() and a first RingClosedError, {accepted} of 3 "
            "further pushes succeeded silently (the credits taken along with the "
            "close, including close_consumer's extra one, are spent without re-checking "
            "the flag)"
        )


def test_fileno_is_the_items_doorbell_in_one_call_and_refused_once_closed(
    no_leaks: None,
) -> None:
    """A pool's direct read asks fileno() three times a call: no further Python call.
    Closed, the fd number may belong to another file by now: it raises, as before."""
    ring = shm.Ring(4, 8)
    calls = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    fd = ring.fileno()
    ring.push(b"x")
    assert shm.wait([ring], timeout=0) == [ring]  # readable through that fd
    sys.setprofile(profile)
    try:
        assert ring.fileno() == fd
    finally:
        sys.setprofile(None)
    assert calls == ["fileno"], calls  # fileno, _check_usable, Doorbell.fileno before
    ring.close()
    with pytest.raises(ValueError, match="closed Ring"):
        ring.fileno()


def _eventfd_count(fd: int) -> int:
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="uses eventfds to reuse fd numbers")
def test_use_after_close_does_not_touch_reused_fds(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    stale = [ring.fileno(), ring._spaces.fileno()]
    ring.close()
    # Whatever the process opens next may get the freed fd numbers: here, eventfds.
    mine: list[int] = []
    try:
        while not set(stale) <= set(mine) and len(mine) < 256:
            mine.append(os.eventfd(7, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        assert set(stale) <= set(mine)
        try:
            ring.push(b"x", timeout=0)
            outcome = "push succeeded"
        except (ValueError, shm.SharedMemoryError):
            outcome = "raised"
        except OSError as exc:
            outcome = f"OSError {exc}"
        counts = [_eventfd_count(fd) for fd in stale]
    finally:
        for fd in mine:
            os.close(fd)
    assert (outcome, counts) == ("raised", [7, 7]), (
        f"shm bug: push() on a closed ring ({outcome}) used the stale fd numbers of its "
        f"doorbells, now other files: their counters went from [7, 7] to {counts}"
    )


# ------------------------------------------------------------ waiting


def test_wait_returns_ready_rings_and_sentinel(no_leaks: None) -> None:
    rings = [shm.Ring(4, 8) for _ in range(3)]
    r_fd, w_fd = os.pipe()
    try:
        with _rings(*rings):
            objs = [*rings, r_fd]
            t0 = time.monotonic()
            assert shm.wait(objs, timeout=0.05) == []
            assert 0.04 <= time.monotonic() - t0 < PROMPT
            assert shm.wait(objs, timeout=0) == []
            rings[2].push(b"c", timeout=LONG)
            assert shm.wait(objs, timeout=LONG) == [rings[2]]
            rings[0].push(b"a", timeout=LONG)
            os.write(w_fd, b"!")
            assert shm.wait(objs, timeout=LONG) == [rings[0], rings[2], r_fd]  # given order
            assert shm.wait([rings[2], rings[2]], timeout=0) == [rings[2], rings[2]]
            assert rings[0].pop(timeout=LONG) == b"a"
            assert shm.wait(objs, timeout=LONG) == [rings[2], r_fd]
            os.read(r_fd, 1)
            assert rings[2].pop(timeout=LONG) == b"c"
            assert shm.wait(objs, timeout=0.01) == []
    finally:
        os.close(r_fd)
        os.close(w_fd)


def test_wait_sees_records_already_credited_to_consumer(no_leaks: None) -> None:
    ring = shm.Ring(8, 8)
    with _rings(ring):
        ring.push_many([b"a", b"b", b"c"], timeout=LONG)
        assert ring.pop(timeout=LONG) == b"a"  # takes the credits of all three
        ready = shm.wait([ring], timeout=0.05)
        assert _drain(ring) == [b"b", b"c"]
        assert ready == [ring], (
            "shm bug: shm.wait([ring]) timed out although 2 records were waiting: a ring "
            "is 'ready' only while its items doorbell holds credits, and pop() takes every "
            "credit at once, so a consumer that waits on several rings between pops stalls"
        )


# ------------------------------------------------------------ stats


def test_stats_after_known_operations(no_leaks: None) -> None:
    ring = shm.Ring(8, 16)
    with _rings(ring):
        ring.push_many([b"r"] * 5, timeout=LONG)
        s = ring.stats()
        assert (s.pushed, s.popped, s.occupancy, s.peak) == (5, 0, 5, 5)
        ring.pop(timeout=LONG)
        ring.pop(timeout=LONG)
        s = ring.stats()
        assert (s.pushed, s.popped, s.occupancy, s.peak) == (5, 2, 3, 5)
        ring.push(b"r", timeout=LONG)
        s = ring.stats()
        assert (s.pushed, s.popped, s.occupancy, s.peak) == (6, 2, 4, 5)
        assert len(_drain(ring)) == 4
        ring.push_many([b"r"] * 8, timeout=LONG)  # a full ring sets a new peak
        s = ring.stats()
        assert (s.pushed, s.popped, s.occupancy, s.peak) == (14, 6, 8, 8)
        assert (s.capacity, s.record_size) == (8, 16)
        assert (s.producer_waits, s.consumer_waits) == (0, 0)
        assert "8/8 records of 16 B" in repr(ring)
        assert "pushed=14 peak=8" in repr(ring)
        assert len(_drain(ring)) == 8
        assert ring.stats().occupancy == 0


# ------------------------------------------------------------ handing over


def test_ring_handed_over_only_at_process_start(no_leaks: None) -> None:
    ring = shm.Ring(4, 8)
    with _rings(ring):
        with pytest.raises(TypeError, match="only to a child process while it starts"):
            pickle.dumps(ring)
        ring.push(b"ok", timeout=LONG)  # a failed hand-over leaves the ring usable
        assert ring.pop(timeout=LONG) == b"ok"


# ------------------------------------------------------------ across processes


def _pop_counters(ring: shm.Ring, proc: Any, n: int, max_records: int) -> None:
    """Pop until the producer closes the ring; every record must be the next counter."""
    expected = 0
    while True:
        try:
            batch = ring.pop_many(max_records, timeout=LONG, watch=[proc])
        except shm.RingClosedError as exc:
            if isinstance(exc, shm.PeerDiedError):  # died before closing the ring
                raise
            break
        if len(set(map(len, batch))) != 1 or len(batch[0]) != 8:
            pytest.fail(f"record lengths {sorted(set(map(len, batch)))} after #{expected}")
        blob = b"".join(batch)
        want = _counters(expected, expected + len(batch))
        if blob != want:
            got = np.frombuffer(blob, "<u8")
            bad = int(np.flatnonzero(got != np.frombuffer(want, "<u8"))[0])
            pytest.fail(f"record #{expected + bad} is {int(got[bad])}")
        expected += len(batch)
    assert expected == n


@pytest.mark.parametrize("ctx", ["forkserver"], indirect=True)
def test_million_records_in_order(ctx: Any, no_leaks: None) -> None:
    n = 10**6
    ring = shm.Ring(1024, 8)
    with _rings(ring), _child(ctx, _produce_counters, ring, n, 256) as proc:
        _pop_counters(ring, proc, n, 1024)
        proc.join(LONG)
        assert proc.exitcode == 0
        assert ring.stats().occupancy == 0


def test_ping_pong(ctx: Any, no_leaks: None) -> None:
    n = 2000
    requests, replies = shm.Ring(4, 8), shm.Ring(4, 8)
    with _rings(requests, replies), _child(ctx, _echo, requests, replies, n) as proc:
        for i in range(n):
            requests.push(_u64(i), timeout=LONG, watch=[proc])
            assert replies.pop(timeout=LONG, watch=[proc]) == _u64(i)
        with pytest.raises(shm.RingClosedError, match="producer closed it") as info:
            replies.pop(timeout=LONG, watch=[proc])
        assert not isinstance(info.value, shm.PeerDiedError)
        proc.join(LONG)
        assert proc.exitcode == 0
        assert requests.stats().popped == n
        assert replies.stats().popped >= n


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_consumer_sees_producer_die(ctx: Any, how: str, no_leaks: None) -> None:
    k = 5
    ring = shm.Ring(8, 8)
    target = _produce_then_exit if how == "exits" else _produce_then_hang
    with _rings(ring), _child(ctx, target, ring, k) as proc:
        # The records pushed before the death are all delivered.
        assert [ring.pop(timeout=LONG, watch=[proc]) for _ in range(k)] == [
            _u64(i) for i in range(k)
        ]
        if how == "killed":
            waits = ring.stats().consumer_waits
            killer = _kill_when(proc, lambda: ring.stats().consumer_waits > waits)
        t0 = time.monotonic()
        with pytest.raises(shm.PeerDiedError, match=f"process {proc.pid} exited"):
            ring.pop(timeout=LONG, watch=[proc])
        assert time.monotonic() - t0 < PROMPT
        if how == "killed":
            killer.join(LONG)
        proc.join(LONG)
        assert proc.exitcode == (3 if how == "exits" else -9)


def _push_until_error(
    ring: shm.Ring, proc: Any, first: int, limit: int
) -> tuple[BaseException, float]:
    """Push counters ``first, first + 1, ...`` until a push fails; by ``limit`` it must.

    Returns the error and how long the failing push took.
    """
    for i in range(first, limit + 1):
        t0 = time.monotonic()
        try:
            ring.push(_u64(i), timeout=LONG, watch=[proc])
        except shm.SharedMemoryError as exc:
            return exc, time.monotonic() - t0
    pytest.fail(f"{limit - first + 1} pushes succeeded into a ring of a dead consumer")


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_producer_sees_consumer_die(ctx: Any, how: str, no_leaks: None) -> None:
    k, capacity = 3, 8
    ring = shm.Ring(capacity, 8)
    target = _consume_then_exit if how == "exits" else _consume_then_hang
    with _rings(ring), _child(ctx, target, ring, k) as proc:
        ring.push_many([_u64(i) for i in range(k)], timeout=LONG, watch=[proc])
        wait_until(lambda: ring.stats().popped == k, LONG, "the child to pop its records")
        if how == "killed":
            waits = ring.stats().producer_waits
            killer = _kill_when(proc, lambda: ring.stats().producer_waits > waits)
        # Fills the ring, then blocks until the child is gone.
        exc, elapsed = _push_until_error(ring, proc, k, capacity + k)
        assert isinstance(exc, shm.PeerDiedError), repr(exc)
        assert f"process {proc.pid} exited" in str(exc)
        assert elapsed < PROMPT
        if how == "killed":
            killer.join(LONG)
        proc.join(LONG)
        assert proc.exitcode == (3 if how == "exits" else -9)


def test_cross_process_both_backends(ctx: Any, backend: str, no_leaks: None) -> None:
    n = 500
    ring = shm.Ring(16, 8, backend=backend)
    with _rings(ring), _child(ctx, _produce_counters, ring, n, 64) as proc:
        _pop_counters(ring, proc, n, 32)
        proc.join(LONG)
        assert proc.exitcode == 0
        # A process, or its sentinel, is ready once it has exited; the drained ring is not.
        assert shm.wait([ring, proc, proc.sentinel], timeout=LONG) == [proc, proc.sentinel]


def test_a_producer_in_another_process_sets_the_rings_hint(ctx: Any, no_leaks: None) -> None:
    # The hint (set_hint) travels with the ring: a child's pushes set the byte
    # the parent reads, and only that byte.
    page = shm.Segment.create(4096)
    ring = shm.Ring(8, 8)
    ring.set_hint(page, 7)
    with _rings(ring):
        with _child(ctx, _produce_then_exit, ring, 2) as proc:
            proc.join(LONG)
        assert page.buf[7] == 1
        assert bytes(page.buf[:7]) == bytes(7)
        assert page.buf[8] == 0
        assert _drain(ring) == [_u64(0), _u64(1)]
    page.close()


def test_the_two_ends_of_one_ring_object_wait_in_two_threads_at_once(
    monkeypatch: pytest.MonkeyPatch, no_leaks: None
) -> None:
    """A ring between two threads of one process: each end's wait has a poll object of its own.

    Both ends shared one, swapped by whichever came to wait. A consumer between its
    look at the cached one and its ``poll()`` could take the producer's, asleep in it:
    "RuntimeError: concurrent poll() invocation", or a wait on the wrong doorbell
    (seen in CI, tests/shm/test_ring_interrupts.py on 3.13). Here the producer comes
    to wait at exactly that point of the consumer's wait.
    """
    ring = shm.Ring(4, 8)
    ring.push(_u64(1))  # the producer took every space credit: its wait sleeps
    real_poll = select.poll  # (what shm._ring calls)
    producer_asleep = threading.Event()

    class TellingPoll:  # says when the producer's thread is about to sleep in poll()
        def __init__(self) -> None:
            self.inner = real_poll()

        def register(self, fd: int, mask: int) -> None:
            self.inner.register(fd, mask)

        def poll(self, ms: int | None = None) -> Any:
            if threading.current_thread() is producer:
                producer_asleep.set()
            return self.inner.poll(ms)

    monkeypatch.setattr(select, "poll", TellingPoll)
    producer = threading.Thread(target=ring._block, args=(ring._spaces, time.monotonic() + 0.5, ()))
    maxes = 0

    def between_the_look_and_the_poll(frame: Any, event: str, arg: Any) -> None:
        nonlocal maxes
        if event == "c_call" and arg is max and frame.f_code.co_name == "_block":
            maxes += 1
            if maxes == 2:  # the timeout in ms, after the poll object was chosen
                producer.start()
                assert producer_asleep.wait(LONG)
                # From the flag to the C poll() is a few bytecodes. (Were the producer
                # slower, the consumer would poll first: the old code would pass too.)
                time.sleep(0.05)

    deadline = time.monotonic() + LONG
    assert ring._block(ring._items, deadline, ())  # this end's wait, as last time
    sys.setprofile(between_the_look_and_the_poll)
    try:
        assert ring._block(ring._items, deadline, ())  # a record is there: at once
    finally:
        sys.setprofile(None)
        if producer.ident is not None:
            producer.join(LONG)
    assert maxes == 2
    assert ring.pop(timeout=0) == _u64(1)
    ring.close()
