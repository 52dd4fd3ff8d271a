"""The wire between the pool and a worker: records, their kinds, framing, waiting.

Each ring slot holds one record, which starts with a 16-byte header::

    kind u8 | flags u8 | pad u16 | fn_id u32 | task_id u64 | body ...

main -> worker (task ring):   FUNC    body = a cloudpickled function for fn_id
                              CALL    body = encoded (args, kwargs) for fn_id
                              FORGET  body = fn ids (u32) to drop from the cache
                              CANCEL  task_id = the call's number n (see below)
                              VERDICT task_id = n, body = 1 byte: 1 cancel, 0 run
worker -> main (done ring):   HELLO   body = pickled (pid, arena id)
                              FAILED  body = pickled start failure
                              OK      body = encoded result
                              ERROR   body = pickled (exception, traceback text)
                              SKIPPED the call was cancelled before it started

Cancellation: calls are numbered 1, 2, ... in the order their CALL records
enter a worker's ring. Before the n-th call, the worker publishes n as its
done ring's progress, then looks at its task ring. The pool, to cancel call
n, pushes CANCEL n, reads the progress, and pushes its VERDICT: cancel if the
worker had not reached n. A worker that finds CANCEL n before starting call n
waits for the verdict: so the pool's ``cancel()`` answer and the worker's
skipping always agree (``Ring.publish_progress`` says when the handshake holds).

A body too large for a slot is *spilled*: put into the sender's arena as bytes,
and the record carries that array's packed descriptor (flag ``SPILLED``).

Nothing here starts a process: the format is checked without one
(``tests/pool/test_protocol.py``).
"""

from __future__ import annotations

import enum
import os
import struct
import time
from collections.abc import Callable

import numpy as np

import shm

HEADER = struct.Struct("<BBxxIQ")


class Kind(enum.IntEnum):
    """What a record is: its first byte."""

    # main -> worker, on the task ring
    FUNC = 1
    CALL = 2
    FORGET = 3
    CANCEL = 4
    VERDICT = 5
    # worker -> main, on the done ring
    HELLO = 10
    FAILED = 11
    OK = 12
    ERROR = 13
    SKIPPED = 14


# The kinds as module constants too, for the loops that look at every record:
# reading a member off the enum class costs several times a global in CPython.
FUNC, CALL, FORGET, CANCEL, VERDICT = Kind.FUNC, Kind.CALL, Kind.FORGET, Kind.CANCEL, Kind.VERDICT
HELLO, FAILED, OK, ERROR, SKIPPED = Kind.HELLO, Kind.FAILED, Kind.OK, Kind.ERROR, Kind.SKIPPED

#: Flag: the body is a packed descriptor of the bytes, in the sender's arena.
SPILLED = 1

#: Ring record size: a call with arrays up to the inline limit (16 KiB) fits in
#: one slot. A record that does not is spilled through the arena, which costs
#: 40-100 us at each end (allocation, descriptor, mapping, release), several
#: times what the bytes cost to copy through a slot.
RECORD_SIZE = 20 * 1024 - 4 - 60  # slot stride 20 KiB with the ring's length word


def record(kind: int, body: bytes, task_id: int = 0, fn_id: int = 0, flags: int = 0) -> bytes:
    """One record: the header, then ``body`` (which must fit; see :func:`spill`)."""
    return HEADER.pack(kind, flags, fn_id, task_id) + body


def spill(
    kind: int,
    body: bytes,
    arena: shm.Arena,
    peer: shm.Ring | None,
    task_id: int = 0,
    fn_id: int = 0,
    booked: list[shm.ArrayDescriptor] | None = None,
) -> bytes:
    """A record for ``body``, through the arena if it does not fit a slot (its descriptor
    ``booked`` as ``encode_call`` books them)."""
    if HEADER.size + len(body) <= RECORD_SIZE:
        return HEADER.pack(kind, 0, fn_id, task_id) + body  # record(), inline
    desc = arena.share(np.frombuffer(body, np.uint8), "", peer, booked)
    return record(kind, desc.pack(), task_id, fn_id, SPILLED)


def body_of(rec: bytes, flags: int) -> bytes | memoryview:
    """The body of a record, mapped from the sender's arena if it was spilled."""
    if not flags & SPILLED:
        return memoryview(rec)[HEADER.size :]
    view = shm.open_array(shm.ArrayDescriptor.unpack(memoryview(rec)[HEADER.size :]))
    return view.data  # keeps the view, and so the memory, alive while used


#: How long an idle worker polls its ring before it sleeps. A sleeping process
#: takes 10-50 us to wake, as much as a small call costs altogether; polling
#: (yielding the CPU to anything runnable) for a moment after each call keeps a
#: caller that submits call after call from paying that every time.
SPIN_SECONDS = 200e-6


def spin_until(ready: Callable[[], bool], seconds: float) -> bool:
    """Poll ``ready()`` for up to ``seconds``, yielding the CPU between polls."""
    if ready():
        return True
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        os.sched_yield()
        if ready():
            return True
    return False
