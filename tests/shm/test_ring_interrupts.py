"""A Ctrl-C storm over a ring's end on the main thread loses no credit.

A KeyboardInterrupt lands wherever the interpreter checks for signals (see
shm/_ring.py, "Interrupts"). Before the ring read its doorbells into a buffer
and published by one trailing call, a credit read as the interrupt landed was
lost, and a record written as it landed was never rung: the ring shrank until a
push waited for good (a pipeline hung after a storm of Ctrl-C, once in ~5 runs).
"""

from __future__ import annotations

import pytest

from tests.conftest import SIGINT_STORM, run_python

_CHILD = (
    SIGINT_STORM
    + """
import sys
import shm

CAP = 8
END = (1 << 63).to_bytes(8, "little")

def produce_here(seconds):
    # This thread pushes (where the SIGINTs land); a thread pops.
    ring = shm.Ring(capacity=CAP, record_size=16)
    got = []
    def consume():
        while True:
            rec = ring.pop(timeout=30)
            if rec == END:
                assert ring.try_pop() is None  # (finding none, it gives every freed slot back)
                return
            got.append(int.from_bytes(rec, "little"))
    t = threading.Thread(target=consume)
    t.start()
    sent = interrupted = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = ring.pushed
        try:
            armed[0] = True
            ring.push(sent.to_bytes(8, "little"), timeout=10)
            armed[0] = False
        except KeyboardInterrupt:
            interrupted += 1
        if ring.pushed > before:
            sent += 1
    armed[0] = False
    ring.push(END, timeout=30)
    t.join(30)
    assert not t.is_alive(), "the consumer hung: a record pushed was never rung"
    assert got == list(range(sent)), (len(got), sent)
    # Every space credit came back: a whole ring's worth goes in without a wait.
    for i in range(CAP):
        ring.push(b"x", timeout=5)
    return interrupted, sent

def consume_here(seconds):
    # A thread pushes; this thread pops (records popped as an interrupt lands may
    # be lost to it, never the ring's credits: nothing stalls, order holds).
    ring = shm.Ring(capacity=CAP, record_size=16)
    done = threading.Event()
    def produce():
        i = 0
        while not done.is_set():
            try:
                ring.push(i.to_bytes(8, "little"), timeout=0.05)
                i += 1
            except shm.RingTimeoutError:
                pass
        ring.push(END, timeout=30)
    t = threading.Thread(target=produce)
    t.start()
    last, interrupted, popped = -1, 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            armed[0] = True
            rec = ring.pop(timeout=30)
            armed[0] = False
        except KeyboardInterrupt:
            interrupted += 1
            continue
        v = int.from_bytes(rec, "little")
        assert v > last, (v, last)
        last, popped = v, popped + 1
    armed[0] = False
    done.set()
    while True:
        rec = ring.pop(timeout=10)
        if rec == END:
            break
        v = int.from_bytes(rec, "little")
        assert v > last, (v, last)
        last = v
    t.join(30)
    return interrupted, popped


if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupter, args=(0.0005,))
    sender.start()
    try:
        out = (produce_here if sys.argv[1] == "produce" else consume_here)(1.0)
    finally:
        stop.set()
        sender.join(30)
    print(*out)
"""
)


@pytest.mark.parametrize("end", ["produce", "consume"])
def test_a_storm_of_ctrl_c_on_one_end_of_a_ring_loses_no_credit(end: str) -> None:
    # The end on the main thread takes the SIGINTs (every 0.5 ms for 1 s); the
    # other end is a thread. The child checks order, nothing lost or stuck, and
    # (pushing here) that a whole ring's worth of slots is free again after.
    interrupted, moved = map(int, run_python("-c", _CHILD, end, timeout=120).split())
    assert interrupted > 0, "no interrupt landed: the test tested nothing"
    assert moved > 0
