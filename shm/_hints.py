"""Which of many rings has records: one shared page of flags, one byte a ring.

An arena pops the release rings of all its peers before each allocation. Looking
at each ring's ``head`` costs a few hundred nanoseconds of Python a ring: with
64 workers, most of a small call's dispatch, and nearly always for nothing. So
each ring's producer also sets its own byte of one shared page after a push
(:meth:`Ring.set_hint`), and the consumer finds the rings to pop with one
``find`` over that page: nothing to do costs the same for 2 rings or 4,096.

The consumer clears a byte *before* popping its ring, with a full barrier
between the two (:func:`fence`): a push that lands after the clear sets the byte
again, and one that landed before it is seen by the pop. Python gives no
barrier on weakly ordered CPUs, so the owner also looks at every ring now and
then (:meth:`Hints.due`), as often as keeps that look under a quarter of a ring
a collection: a record a lost flag hides waits at most that long.
"""

from __future__ import annotations

import threading

from ._ring import Ring, fence
from ._segment import Segment

#: Rings one page of flags serves; more (a pool of over 4,096 workers) are
#: looked at on every collection, as without hints.
CAPACITY = 4096
#: Collections between two looks at every ring: at least this many, and at
#: least four a ring.
_SWEEP_MIN = 64
#: A lock's atomic read-modify-write is the full barrier (see ``fence``).
_BARRIER = threading.Lock()


class Hints:
    """The flags of the rings a consumer pops (one process's side; lock held by the caller)."""

    def __init__(self, backend: str | None) -> None:
        self.backend = backend
        self.page: Segment | None = None  # made with the first ring
        self.rings: list[Ring | None] = []  # flag index -> its ring
        self.index: dict[int, int] = {}  # id(ring) -> its flag index
        self.free: list[int] = []  # indices of removed rings, for the next ones
        self.quiet = 0  # collections since every ring was looked at

    def prepare(self) -> Segment:
        """The flag page, made now if it is not yet."""
        if self.page is None:
            self.page = Segment.create(CAPACITY, self.backend, tag="mpx-hints")
            self.page.unlink()  # handed over by fd, with each ring: no name needed
        return self.page

    def add(self, ring: Ring) -> bool:
        """Give ``ring`` a flag (before it goes to its producer); False: none left."""
        self.page = self.prepare()
        if self.free:
            index = self.free.pop()
        elif len(self.rings) < CAPACITY:
            index = len(self.rings)
            self.rings.append(None)
        else:
            return False
        self.rings[index] = ring
        self.index[id(ring)] = index
        self.page.buf[index] = 0
        ring.set_hint(self.page, index)
        return True

    def remove(self, ring: Ring) -> None:
        """``ring`` is no longer popped here; its flag goes to the next ring."""
        index = self.index.pop(id(ring), None)
        if index is not None:
            self.rings[index] = None
            self.free.append(index)

    def due(self, rings: int) -> bool:
        """Whether this collection looks at every ring (see the module's docstring)."""
        self.quiet += 1
        return self.quiet >= max(_SWEEP_MIN, 4 * rings)

    def to_collect(self, rings: int) -> list[Ring]:
        """The rings this collection pops: :meth:`every` when :meth:`due`, else :meth:`flagged`.

        One call where the arena's every share and allocation made two.
        """
        self.quiet = quiet = self.quiet + 1
        if quiet >= _SWEEP_MIN and quiet >= 4 * rings:
            return self.every()
        return self.flagged()

    def flagged(self) -> list[Ring]:
        """The rings whose producers pushed since they were last taken; flags cleared."""
        page = self.page
        if page is None:
            return []
        buf, end = page.buf, len(self.rings)
        index = buf.find(b"\x01", 0, end)
        if index < 0:
            return []
        found = []
        while index >= 0:
            buf[index] = 0
            ring = self.rings[index]
            if ring is not None:
                found.append(ring)
            index = buf.find(b"\x01", index + 1, end)
        # fence(), inline: the clears are seen before the pops' loads (module docstring).
        if _BARRIER.acquire(blocking=False):
            _BARRIER.release()
        return found

    def every(self) -> list[Ring]:
        """Every ring with a flag, flags cleared (a look at them all)."""
        self.quiet = 0
        page = self.page
        if page is None:
            return []
        page.buf[: len(self.rings)] = bytes(len(self.rings))
        fence()
        return [r for r in self.rings if r is not None]

    def close(self) -> None:
        """Give the page's fd back (the rings keep their mappings of it)."""
        if self.page is not None:
            self.page.close()
        self.rings.clear()
        self.index.clear()
        self.free.clear()
