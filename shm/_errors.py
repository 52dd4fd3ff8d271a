"""The exceptions of ``shm``.

::

    SharedMemoryError            anything that goes wrong with shared memory
    ├── ReservationError         a segment could not be reserved (also MemoryError)
    │   └── ArenaFullError       an arena reached its cap (also MemoryError)
    ├── AttachError              another process's segment could not be mapped
    ├── RingClosedError          the other end of a ring went away
    │   └── PeerDiedError        ... because the process behind it died
    └── RingTimeoutError         a bounded wait on a ring expired (also TimeoutError)

Each message names the sizes involved and what to try, because these errors
usually surface far from the code that caused them.
"""

from __future__ import annotations


class SharedMemoryError(Exception):
    """Base class of every error raised by ``shm``."""


class ReservationError(SharedMemoryError, MemoryError):
    """Memory for a segment could not be reserved at creation."""


class ArenaFullError(ReservationError):
    """An arena is at its cap and cannot grow to satisfy an allocation."""


class AttachError(SharedMemoryError):
    """A segment owned by another process could not be mapped here."""


class RingClosedError(SharedMemoryError):
    """The other end of a ring is closed."""


class PeerDiedError(RingClosedError):
    """A process this wait depended on exited."""


class RingTimeoutError(SharedMemoryError, TimeoutError):
    """A bounded wait on a ring expired."""


for _cls in (
    SharedMemoryError,
    ReservationError,
    ArenaFullError,
    AttachError,
    RingClosedError,
    PeerDiedError,
    RingTimeoutError,
):
    # Errors cross process boundaries: print and pickle them under the public path.
    _cls.__module__ = "shm"
