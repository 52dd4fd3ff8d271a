"""Single-producer/single-consumer rings of fixed-size records in shared memory.

One ring per direction per peer: a process that pushes and a process that pops.
No lock is ever shared between the two, so a producer that dies mid-push can
block nobody, and no lock is held while user code runs.

Layout (one segment; every field on its own 64-byte line so the two sides
never write the same cache line)::

    0    magic, capacity, record_size, slot_stride     (written once)
    64   head    records pushed so far                 (producer writes)
    128  tail    records popped so far                 (consumer writes)
    192  flags   producer_closed, consumer_closed      (each side its own byte)
    256  peak, producer_waits, consumer_waits          (statistics only)
         progress                                      (producer writes, read racily)
    320  slots   (capacity + 1) x slot_stride; a slot is [u32 length][payload]

The slot beyond ``capacity`` is never covered by a space credit, so when the
producer holds no credit the slot at ``head`` is still free: that is where
:meth:`Ring.close_producer` writes the end marker, which therefore never waits
and always reaches the consumer, however full the ring is.

Publication protocol
--------------------
Ownership of slots moves between the two processes only through two
doorbells (``_doorbell.py``), kernel counters that carry *credits*:

- ``items``: the producer writes a record into slot ``head % capacity``, then
  rings ``items`` once per record. The consumer reads a slot only after it has
  taken a credit for it from ``items``.
- ``spaces``: starts with ``capacity`` credits. The producer writes a slot
  only after taking a credit for it from ``spaces``; the consumer rings
  ``spaces`` after it has copied records out of their slots.

Why this is correct on x86 *and* ARM: Python gives no access to memory
fences, and on a weakly ordered CPU (ARM, POWER) plain stores to shared memory
may become visible in another order than they were made, so a protocol that
trusts a shared ``head`` index alone could read a slot before its bytes arrive
(and the classic "set a waiting flag, then check" sleep protocol can lose a
wake-up even on x86, whose store buffer reorders a store with a later load).
Here no shared index is trusted: a doorbell update is made by the kernel under
a lock (release on the writer's side, acquire on the reader's), so every byte
the producer wrote before ``ring()`` happens-before the consumer's reads after
the ``take()`` that returned that credit, and every read the consumer made
before ringing ``spaces`` happens-before the producer's overwrite of that slot.
``head`` and ``tail`` in the header are statistics, read racily.

Interrupts
----------
A signal handler's exception (a Ctrl-C's KeyboardInterrupt) is raised in the
main thread wherever the interpreter checks for it: on CPython, as a Python
function starts, after a call returns, and at a loop's jump back (3.10 also
at any taken conditional jump); never between two stores or subscripts.
Credits lost between a doorbell and this end's own count would shrink the
ring for good, and a record written but never rung would stall it, so:

- a credit count read from a doorbell lands in a buffer of this end
  (``Doorbell.take_into``), not in a return value, and moves into the
  end's count by two statements with no call or branch between;
- every step that publishes (``head``, ``tail``, the credits kept) is made
  by statements with no call or branch between them and the doorbell's
  write, itself one C call (``Doorbell.give``), the last: an interrupt
  lands before all of them or after all of them.

A record popped can still be lost to an interrupt between the pop and the
caller's use of it: a consumer on a thread that takes signals must allow
for that. ``pop_waiting(into)`` adds the records to the caller's list in the
step that takes them (an arena's collection of releases goes so).

Cost: one syscall per push (``eventfd_write``) and, on the consumer side, one
per wait; space credits go back in batches of half the ring (or whenever the
consumer is about to sleep), which is enough: a producer can only be out of
credits when the consumer holds at least half a ring of them.
"""

from __future__ import annotations

import select
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ._doorbell import Doorbell
from ._errors import PeerDiedError, RingClosedError, RingTimeoutError
from ._platform import ALIGNMENT
from ._segment import Segment

_MAGIC = 0x6D70_7872_696E_6731  # "mpxring1"
_HEAD, _TAIL, _FLAGS, _STATS, _SLOTS = 64, 128, 192, 256, 320
_PRODUCER_CLOSED, _CONSUMER_CLOSED = _FLAGS, _FLAGS + 1
_PEAK, _PRODUCER_WAITS, _CONSUMER_WAITS = _STATS, _STATS + 8, _STATS + 16
_PROGRESS = _STATS + 24
_FENCE = threading.Lock()
_EOF = 0xFFFF_FFFF  # slot length that marks "the producer closed the ring"
_U64 = struct.Struct("=Q")  # native: the fields are also read as "Q" views
_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<QQQQ")


#: What a wait can watch besides the ring: fds (a ``Process.sentinel``),
#: objects with ``fileno()``, or ``multiprocessing.Process`` objects.
Watchable = Any


@dataclass(frozen=True)
class RingStats:
    """Occupancy and traffic of a ring, read without locking (a snapshot)."""

    capacity: int
    record_size: int
    occupancy: int
    peak: int
    pushed: int
    popped: int
    producer_waits: int
    consumer_waits: int


def _fd_of(obj: Watchable) -> int:
    if isinstance(obj, int):
        return obj
    if hasattr(obj, "sentinel"):  # multiprocessing.Process
        return int(obj.sentinel)
    return int(obj.fileno())


def _describe(obj: Watchable) -> str:
    pid = getattr(obj, "pid", None)
    if pid is not None:
        code = getattr(obj, "exitcode", None)
        return f"process {pid} exited (exit code {code})"
    return f"a watched process exited (sentinel fd {_fd_of(obj)})"


def wait(objects: Iterable[Watchable], timeout: float | None = None) -> list[Watchable]:
    """Block until any of ``objects`` is ready or ``timeout`` seconds pass.

    ``objects`` may mix rings (ready: the consumer has records waiting),
    doorbells, fds, objects with ``fileno()`` and ``multiprocessing.Process``
    objects (ready: exited). Returns the ready ones, in the order given;
    an empty list on timeout. One ``poll`` call: a dead peer is seen at once.
    """
    objs = list(objects)
    # A consumer takes every credit at once, so records it holds credits for
    # no longer show on the doorbell's fd: such a ring is ready already (the
    # ring's own count, read by this module's wait()).
    held = {id(o) for o in objs if isinstance(o, Ring) and o._holds_items()}  # noqa: SLF001
    if held:
        timeout = 0
    poller = select.poll()
    by_fd: dict[int, list[Watchable]] = {}
    for obj in objs:
        fd = _fd_of(obj)
        if fd not in by_fd:
            poller.register(fd, select.POLLIN)
        by_fd.setdefault(fd, []).append(obj)
    ms = None if timeout is None else max(0, int(timeout * 1000 + 0.999))
    while True:
        try:
            events = poller.poll(ms)
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue
    ready = {fd for fd, _ in events}
    return [o for o in objs if id(o) in held or _fd_of(o) in ready]


class Ring:
    """A bounded SPSC queue of records of at most ``record_size`` bytes.

    Create it in one process and hand it to the other as an argument of
    ``multiprocessing.Process`` (its fds travel with it); each process then
    uses one end: ``push*`` on one side, ``pop*`` on the other. Every blocking
    call takes ``timeout`` (seconds, ``None`` = no limit) and ``watch``: a
    process (or sentinel fd) whose exit raises :class:`PeerDiedError` instead
    of waiting on.
    """

    def __init__(
        self, capacity: int = 1024, record_size: int = 120, backend: str | None = None
    ) -> None:
        if capacity < 1 or capacity > 1 << 20:
            raise ValueError(f"capacity must be in 1..{1 << 20}, not {capacity}")
        if record_size < 1 or record_size > 1 << 20:
            raise ValueError(f"record_size must be in 1..{1 << 20}, not {record_size}")
        stride = -(-(_U32.size + record_size) // ALIGNMENT) * ALIGNMENT
        seg = Segment.create(_SLOTS + (capacity + 1) * stride, backend, tag="mpx-ring")
        # Handed over by fd, so a named segment needs no name from now on.
        seg.unlink()
        _HEADER.pack_into(seg.buf, 0, _MAGIC, capacity, record_size, stride)
        self._setup(seg, Doorbell(0), Doorbell(capacity))

    def _setup(self, seg: Segment, items: Doorbell, spaces: Doorbell) -> None:
        magic, self.capacity, self.record_size, self._stride = _HEADER.unpack_from(seg.buf, 0)
        if magic != _MAGIC:
            raise ValueError("not a ring segment")
        self._seg = seg
        self._buf = seg.buf
        self._nslots = self.capacity + 1
        self._closed = False
        self._items = items
        self._spaces = spaces
        # The items eventfd (None: a pipe), written and read here directly on
        # the hot paths (push, try_pop); only while the ring is open.
        self._items_fd = items.event_fd
        self._items_rfd = items.fileno()  # for fileno(), asked on a pool's every direct read
        # See "Interrupts" above: the header's counters written by subscript (no
        # call), credits read into boxes, and given by one C call each.
        view = memoryview(self._buf)
        self._head_at = view[_HEAD : _HEAD + 8].cast("Q")
        self._tail_at = view[_TAIL : _TAIL + 8].cast("Q")
        self._items_box = memoryview(bytearray(8)).cast("Q")
        self._spaces_box = memoryview(bytearray(8)).cast("Q")
        self._give_items, self._items_wfd, self._items_unit = items.give, items.give_fd, items.unit
        self._give_spaces, self._spaces_wfd, self._spaces_unit = (
            spaces.give,
            spaces.give_fd,
            spaces.unit,
        )
        self._take_items_into, self._take_spaces_into = items.take_into, spaces.take_into
        # Local to the process using each end; see the module docstring.
        self._head = _U64.unpack_from(self._buf, _HEAD)[0]
        self._tail = _U64.unpack_from(self._buf, _TAIL)[0]
        self._space_credits = 0
        self._item_credits = 0
        self._taken = self._tail  # items credits taken so far (consumer)
        self._returned = self._tail  # space credits given back so far (consumer)
        self._flush_at = max(1, self.capacity // 2)
        self._eof_sent = bool(self._buf[_PRODUCER_CLOSED])
        self._eof_seen = False
        # Each end's last wait, (its fds, a poll object over them), by its doorbell's fd:
        # one object for both ends, used by two threads, must not share a poll object.
        self._pollers: dict[int, tuple[tuple[int, ...], Any]] = {}
        self._hint: Segment | None = None  # see set_hint()
        self._hint_buf: Any = None
        self._hint_at = 0

    def __reduce__(self) -> tuple[Any, ...]:
        hint = (self._hint, self._hint_at) if self._hint is not None else None
        return (_rebuild_ring, (self._seg, self._items, self._spaces, hint))

    def set_hint(self, segment: Segment, offset: int) -> None:
        """Have the producer set byte ``offset`` of ``segment`` to 1 after each push.

        For a consumer of many rings (an arena's release rings): it looks at
        one shared page to learn which rings have something, instead of at
        every ring; it clears a byte before popping that ring (see
        :meth:`shm.Arena.collect`). Set it before the ring goes to the
        producer's process: the hint travels with the ring.
        """
        self._hint, self._hint_buf, self._hint_at = segment, segment.buf, offset

    def _signal(self) -> None:
        if self._hint_buf is not None:
            self._hint_buf[self._hint_at] = 1

    # ---------------------------------------------------------------- producer
    def fileno(self) -> int:
        """Readable while records wait to be popped (for :func:`wait`)."""
        if self._closed:
            self._check_usable()  # raises
        return self._items_rfd

    def try_push(self, data: bytes | bytearray | memoryview) -> bool:
        """Push one record if a slot is free now; False otherwise."""
        # push()'s one-call path (a view's release pushes this way, from its
        # finalizer); a full ring, rare, pays for the exception.
        try:
            self.push(data, 0.0)
        except RingTimeoutError:
            return False
        return True

    def push(
        self,
        data: bytes | bytearray | memoryview,
        timeout: float | None = None,
        watch: Sequence[Watchable] = (),
    ) -> None:
        """Push one record, waiting up to ``timeout`` seconds for a free slot."""
        # One Python call when the ring is open, the record fits and a space
        # credit is held (nearly always): a pool pushes a call this way each
        # time, run cold after a wait. The checks and steps are those of
        # _check_size, _acquire_space, _put, _commit and _signal.
        buf = self._buf
        n = len(data)
        if self._eof_sent or buf[_CONSUMER_CLOSED] or n > self.record_size:
            self._check_size(data)  # raises what is wrong
        if self._space_credits < 1 and not self._acquire_space(1, timeout, watch):
            raise RingTimeoutError(f"no free slot in the ring within {timeout} s")
        off = _SLOTS + (self._head % self._nslots) * self._stride
        _U32.pack_into(buf, off, n)  # (an interrupt from here on to the next
        buf[off + 4 : off + 4 + n] = data  # comment published nothing yet)
        # No call nor branch from here to the doorbell: see "Interrupts" above.
        self._head = head = self._head + 1
        self._space_credits -= 1
        self._head_at[0] = head
        self._give_items(self._items_wfd, self._items_unit)
        if self._hint_buf is not None:
            self._hint_buf[self._hint_at] = 1
        occupancy = head - self._tail_at[0]  # (statistics: an interrupt may skip them)
        if occupancy > _U64.unpack_from(buf, _PEAK)[0]:
            _U64.pack_into(buf, _PEAK, occupancy)

    @property
    def pushed(self) -> int:
        """Records this producer has pushed so far (a push that raised after its
        record went in counts it: a caller interrupted there can tell)."""
        return int(self._head)

    def push_many(
        self,
        records: Sequence[bytes | bytearray | memoryview],
        timeout: float | None = None,
        watch: Sequence[Watchable] = (),
    ) -> None:
        """Push records in order, ringing once per batch of free slots."""
        for rec in records:
            self._check_size(rec)
        i, n = 0, len(records)
        deadline = None if timeout is None else time.monotonic() + timeout
        while i < n:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._acquire_space(1, left, watch):
                raise RingTimeoutError(
                    f"no free slot in the ring within {timeout} s ({i} of {n} pushed)"
                )
            k = min(n - i, self._space_credits)
            for j, rec in enumerate(records[i : i + k]):
                self._put(j, rec)
            self._commit(k, k)
            i += k

    def _holds_items(self) -> bool:
        """Whether this end holds item credits (a box an interrupt left counts)."""
        return bool(self._item_credits or self._items_box[0])

    def _check_size(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_sent:
            self._check_usable()
            raise RingClosedError("this ring's producer end is closed")
        # Read on every push, not only when credits run out: records pushed
        # after the consumer left would be lost without a word.
        self._check_open(self._buf[_CONSUMER_CLOSED], "consumer")
        if len(data) > self.record_size:
            raise ValueError(f"record of {len(data)} bytes exceeds record_size {self.record_size}")

    def _put(self, j: int, data: bytes | bytearray | memoryview, length: int | None = None) -> None:
        """Write a record into the ``j``-th credited slot past ``head``; unpublished."""
        n = len(data)
        off = _SLOTS + ((self._head + j) % self._nslots) * self._stride
        _U32.pack_into(self._buf, off, n if length is None else length)
        self._buf[off + 4 : off + 4 + n] = data

    def _commit(self, k: int, spent: int) -> None:
        """Publish the ``k`` records :meth:`_put` wrote, which took ``spent``
        credits (a call: interrupted as it starts, nothing is published; its body
        is one step, see "Interrupts")."""
        self._head = head = self._head + k
        self._space_credits -= spent
        self._head_at[0] = head
        self._give_items(self._items_wfd, self._items_unit * k)
        self._signal()
        occupancy = head - self._tail_at[0]
        if occupancy > _U64.unpack_from(self._buf, _PEAK)[0]:
            _U64.pack_into(self._buf, _PEAK, occupancy)

    def _take_spaces(self) -> None:
        """Move the spaces doorbell's credits into ours (see "Interrupts").

        Not one helper with :meth:`_take_items`: a count returned from a call
        could be lost to an interrupt before the caller adds it.
        """
        box = self._spaces_box
        if not box[0]:  # (else: what an interrupted take left; the rest waits)
            self._take_spaces_into(box)
        got = box[0]  # (no call nor branch from here to the last store)
        box[0] = 0
        self._space_credits += got

    def _take_items(self) -> int:
        """Move the items doorbell's credits into ours (see "Interrupts"); how many."""
        box = self._items_box
        if not box[0]:  # (else: what an interrupted take left; the rest waits)
            self._take_items_into(box)
        got = box[0]  # (no call nor branch from here to the last store)
        box[0] = 0
        self._item_credits += got
        self._taken += got
        return got

    def _acquire_space(self, need: int, timeout: float | None, watch: Sequence[Watchable]) -> bool:
        if self._space_credits >= need:
            return True
        self._take_spaces()
        self._check_open(self._buf[_CONSUMER_CLOSED], "consumer")
        if self._space_credits >= need:
            return True
        if timeout == 0:
            return False
        self._bump(_PRODUCER_WAITS)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._space_credits < need:
            if not self._block(self._spaces, deadline, watch):
                return False
            self._take_spaces()
            self._check_open(self._buf[_CONSUMER_CLOSED], "consumer")
        return True

    # ---------------------------------------------------------------- consumer
    def may_have_records(self) -> bool:
        """Whether a pop might find a record now: a cheap hint, no system call.

        For spinning consumers: it reads the producer's ``head`` (racy, see
        above), so it can say "no" a moment after a push; a pop is what counts.
        """
        return bool(self._item_credits) or self._head_at[0] != self._taken

    def try_pop(self, *, give_back: bool = True) -> bytes | None:
        """Pop one record if one is waiting now; None otherwise.

        ``give_back=False``: finding none, keep the freed slots (no system call
        when the producer's ``head`` shows nothing new) rather than hand them
        back, as a sleeping consumer must, and return None for a ring closed
        or ended with nothing new: for a consumer that pops many rings until
        empty often, whose producers never wait for space (they get freed
        slots back every half ring anyway).
        """
        # One Python call when a record waits (the manager pops each result
        # this way): the steps of _acquire_items(0) and _read, inlined.
        if not self._item_credits:
            quiet = self._head_at[0] == self._taken
            if quiet and not give_back:
                # Nothing new, whatever became of the ring (closed, ended): as
                # may_have_records() says, for a consumer that looks at many.
                return None
            if self._closed or self._eof_seen:
                self._acquire_items(0.0, ())  # raises what is wrong
            got = 0
            if not quiet:  # (else nothing new, see _acquire_items: no system call)
                box = self._items_box  # _take_items, inline
                if not box[0]:
                    self._take_items_into(box)
                got = box[0]  # (no call nor branch from here to the last store)
                box[0] = 0
                self._item_credits += got
                self._taken += got
            if not got:
                if give_back and self._tail != self._returned:
                    self._return_spaces()  # as _acquire_items does before it would sleep
                return None
        buf = self._buf
        off = _SLOTS + (self._tail % self._nslots) * self._stride
        n = _U32.unpack_from(buf, off)[0]
        if n == _EOF:
            self._consumed(1)
            self._eof_seen = True
            raise RingClosedError("the ring's producer closed it")
        rec = bytes(buf[off + 4 : off + 4 + n])
        self._tail = tail = self._tail + 1  # (no call nor branch to the store: "Interrupts")
        self._item_credits -= 1
        self._tail_at[0] = tail
        if self._taken - self._returned >= self._flush_at:
            self._return_spaces()
        return rec

    def pop_waiting(self, into: list[bytes] | None = None) -> list[bytes]:
        """Every record waiting now, in one call: ``try_pop(give_back=False)`` until None.

        For a consumer of many rings that never sleeps on this one (an arena's
        release rings, popped before each share and allocation): the ring's
        head and its credits are read once, not again for a last, empty pop. An
        empty list when nothing is new, whatever became of the ring. The end
        marker raises :class:`RingClosedError` as ``try_pop`` does, once the
        records before it are returned. ``into``: the records are also added to
        it in the step that takes them off the ring, so that an interrupt as
        this returns cannot lose them (see "Interrupts").
        """
        if self._head_at[0] != self._taken:
            if self._closed or self._eof_seen:
                self._acquire_items(0.0, ())  # raises what is wrong
            self._take_items()
        credits = self._item_credits
        if not credits:
            return []
        buf, nslots, stride = self._buf, self._nslots, self._stride
        tail = start = self._tail
        out = []
        for _ in range(credits):
            off = _SLOTS + tail % nslots * stride
            n = _U32.unpack_from(buf, off)[0]
            if n == _EOF:
                break
            off += 4
            out.append(bytes(buf[off : off + n]))
            tail += 1
        if not out:  # the end marker first: as try_pop
            self._consumed(1)
            self._eof_seen = True
            raise RingClosedError("the ring's producer closed it")
        if into is not None:
            into += out  # (from here to the stores: no call nor branch)
        self._item_credits = credits - (tail - start)  # (no call nor branch to the
        self._tail = tail  # store: see "Interrupts")
        self._tail_at[0] = tail
        if self._taken - self._returned >= self._flush_at:
            self._return_spaces()
        return out

    def pop(self, timeout: float | None = None, watch: Sequence[Watchable] = ()) -> bytes:
        """Pop one record, waiting up to ``timeout`` seconds for one."""
        if not self._acquire_items(timeout, watch):
            raise RingTimeoutError(f"no record arrived within {timeout} s")
        return self._read_one()

    def pop_many(
        self,
        max_records: int | None = None,
        timeout: float | None = None,
        watch: Sequence[Watchable] = (),
    ) -> list[bytes]:
        """Pop every waiting record (at most ``max_records``), waiting for the first."""
        if not self._acquire_items(timeout, watch):
            raise RingTimeoutError(f"no record arrived within {timeout} s")
        self._take_items()
        k = self._item_credits if max_records is None else min(max_records, self._item_credits)
        out: list[bytes] = []
        for _ in range(k):
            rec = self._read()
            if rec is None:
                break
            out.append(rec)
        if not out:
            raise RingClosedError("the ring's producer closed it")
        return out

    def _read(self) -> bytes | None:
        """Copy out the record at ``tail`` and free its slot; None at the end marker."""
        off = _SLOTS + (self._tail % self._nslots) * self._stride
        n = _U32.unpack_from(self._buf, off)[0]
        rec = None if n == _EOF else bytes(self._buf[off + 4 : off + 4 + n])
        self._consumed(1)
        if rec is None:
            self._eof_seen = True
        return rec

    def _read_one(self) -> bytes:
        rec = self._read()
        if rec is None:
            raise RingClosedError("the ring's producer closed it")
        return rec

    def _consumed(self, k: int) -> None:
        self._tail = tail = self._tail + k  # (no call nor branch to the store: "Interrupts")
        self._item_credits -= k
        self._tail_at[0] = tail
        if self._taken - self._returned >= self._flush_at:
            self._return_spaces()

    def _return_spaces(self) -> None:
        freed = self._tail - self._returned
        if freed:  # (no call nor branch from here to the doorbell's: "Interrupts")
            self._returned = self._tail
            self._give_spaces(self._spaces_wfd, self._spaces_unit * freed)

    def _acquire_items(self, timeout: float | None, watch: Sequence[Watchable]) -> bool:
        if self._item_credits:
            return True
        self._check_usable()
        if self._eof_seen:
            raise RingClosedError("the ring's producer closed it")
        # ``head`` is only a hint (see above), but when it shows nothing new
        # there is nothing to take: the producer moves ``head`` before it rings,
        # so a blocking pop goes straight to sleep (poll() returns at once if a
        # credit did arrive) and a non-blocking one saves the empty read (an
        # exception, as costly as a small record's whole pop).
        quiet = self._head_at[0] == self._taken
        got = 0 if quiet else self._take_items()
        if not got:
            # About to sleep: give back every freed slot first, so that a
            # producer waiting for space can never wait on us.
            self._return_spaces()
            if timeout == 0:
                return False
            self._bump(_CONSUMER_WAITS)
            deadline = None if timeout is None else time.monotonic() + timeout
            while not got:
                if not self._block(self._items, deadline, watch):
                    return False
                got = self._take_items()
        return True

    # ------------------------------------------------------------------ common
    def _block(self, bell: Doorbell, deadline: float | None, watch: Sequence[Watchable]) -> bool:
        """Sleep until ``bell`` may have credits; False on timeout."""
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        fds = (bell.fileno(), *map(_fd_of, watch))
        # A poll object per end (one may sleep in poll() while the other end's thread
        # comes to wait), read into a local: another thread's wait never swaps it.
        cached = self._pollers.get(fds[0])
        if cached is not None and cached[0] == fds:  # the same wait as last time, nearly always
            poller = cached[1]
        else:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            self._pollers[fds[0]] = (fds, poller)
        ms = None if left is None else max(0, int(left * 1000 + 0.999))
        ready = {fd for fd, _ in poller.poll(ms)}
        if not ready:
            return False
        # Credits may have arrived together with an exit: let the caller take them.
        if fds[0] in ready:
            return True
        for obj, fd in zip(watch, fds[1:], strict=True):
            if fd in ready:
                raise PeerDiedError(_describe(obj))
        return True  # pragma: no cover - poll() reports only registered fds

    @staticmethod
    def _check_open(flag: int, side: str) -> None:
        if flag:
            raise RingClosedError(f"the ring's {side} closed it")

    def _check_usable(self) -> None:
        # The doorbells' fd numbers may belong to other files by now.
        if self._closed:
            raise ValueError("operation on a closed Ring")

    def _bump(self, field: int) -> None:
        _U64.pack_into(self._buf, field, _U64.unpack_from(self._buf, field)[0] + 1)

    def publish_progress(self, value: int) -> None:
        """Publish a number for the consumer to read with :meth:`progress`.

        Meant for "how far the producer got" (say, the calls a worker has
        started). The store is followed by a full memory barrier (a lock's
        atomic read-modify-write), so that a load made after this call cannot
        be ordered before the store: a Dekker-style handshake, this store then
        a look at the ring, against the peer's push then ``progress()``, has
        at least one side see the other on x86. Weakly ordered CPUs give no
        such guarantee from Python (see the publication protocol above).
        """
        _U64.pack_into(self._buf, _PROGRESS, value)
        fence()

    def progress(self) -> int:
        """The number the producer last published (0 before any); read racily."""
        return int(_U64.unpack_from(self._buf, _PROGRESS)[0])

    def close_producer(self) -> None:
        """Tell the consumer that no record will follow those already pushed.

        Never blocks: the end marker goes into the spare slot if no credited
        one is free. The consumer raises :class:`RingClosedError` once it has
        popped every record before the marker. Idempotent.
        """
        if self._eof_sent:
            return
        self._check_usable()
        self._buf[_PRODUCER_CLOSED] = 1
        self._put(0, b"", length=_EOF)
        self._commit(1, spent=0)  # the spare slot: no credit covers it
        self._eof_sent = True

    def close_consumer(self) -> None:
        """Tell the producer its records will no longer be read."""
        self._check_usable()
        self._buf[_CONSUMER_CLOSED] = 1
        self._spaces.ring(1)  # wakes a producer waiting for space, to see the flag

    def handed_over(self) -> None:
        """Close the segment's fd: the other process has the ring now (it is started).

        The mapping stays, and with it the ring; only the ring can no longer be
        handed to another process. One open file fewer per ring, which counts
        under ``RLIMIT_NOFILE`` with many peers.
        """
        self._seg.close()

    def close(self) -> None:
        """Release this process's fds for the ring; idempotent. The mapping stays.

        Any later call on this end raises ``ValueError``.
        """
        self._closed = True
        self._eof_sent = True  # every push path checks this flag first
        self._items.close()
        self._spaces.close()
        self._seg.close()

    def stats(self) -> RingStats:
        """A snapshot of occupancy and traffic (racy by design: for monitoring)."""
        head = _U64.unpack_from(self._buf, _HEAD)[0]
        tail = _U64.unpack_from(self._buf, _TAIL)[0]
        return RingStats(
            capacity=self.capacity,
            record_size=self.record_size,
            occupancy=max(0, head - tail),
            peak=_U64.unpack_from(self._buf, _PEAK)[0],
            pushed=head,
            popped=tail,
            producer_waits=_U64.unpack_from(self._buf, _PRODUCER_WAITS)[0],
            consumer_waits=_U64.unpack_from(self._buf, _CONSUMER_WAITS)[0],
        )

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"<Ring {s.occupancy}/{s.capacity} records of {s.record_size} B, "
            f"pushed={s.pushed} peak={s.peak}>"
        )


def _rebuild_ring(
    seg: Segment, items: Doorbell, spaces: Doorbell, hint: tuple[Segment, int] | None = None
) -> Ring:
    ring = Ring.__new__(Ring)
    ring._setup(seg, items, spaces)  # noqa: SLF001 - unpickling: the ring's own set-up
    if hint is not None:
        ring.set_hint(*hint)
    return ring


def fence() -> None:
    """A full memory barrier (a lock's atomic read-modify-write; never waits).

    See :meth:`Ring.publish_progress`: a store before it is seen by other
    processes before any load after it (x86; see the module's docstring).
    """
    if _FENCE.acquire(blocking=False):
        _FENCE.release()
