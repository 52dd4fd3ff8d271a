"""Shared memory that cannot leak and never copies.

The mechanism under mpexec, usable on its own (it never imports mpexec):

- :class:`Segment`: a block of shared memory reserved before use (memfd on
  Linux: unnamed, so nothing is left behind by a killed process).
- :class:`Arena`: variable-size, 64-byte-aligned allocations in segments
  that grow up to a cap; arrays live in it and are shared by descriptor.
- :class:`Ring`: a single-producer/single-consumer ring of fixed-size records
  with kernel doorbells, waitable together with process sentinels.
- :class:`Lifeline`: a child's prompt, poll-free view of its parent's death.
- :class:`ArrayDescriptor` / :func:`open_array`: a small picklable description
  of an array in an arena, opened elsewhere as a zero-copy, read-only ndarray;
  :func:`in_shared_memory` tells whether an array can be shared without a copy.
"""

from ._arena import Arena, ArenaStats
from ._errors import (
    ArenaFullError,
    AttachError,
    PeerDiedError,
    ReservationError,
    RingClosedError,
    RingTimeoutError,
    SharedMemoryError,
)
from ._lifeline import Lifeline
from ._platform import PlatformInfo, platform_info
from ._ring import Ring, RingStats, wait
from ._segment import Segment, SegmentHandle, reap_orphans
from ._views import (
    RELEASE_RECORD_SIZE,
    ArrayDescriptor,
    dtype_code,
    dtype_from_code,
    flush_releases,
    in_shared_memory,
    open_array,
    revoke,
    segment_of,
    set_release_route,
)

__all__ = [
    "RELEASE_RECORD_SIZE",
    "Arena",
    "ArenaFullError",
    "ArenaStats",
    "ArrayDescriptor",
    "AttachError",
    "Lifeline",
    "PeerDiedError",
    "PlatformInfo",
    "ReservationError",
    "Ring",
    "RingClosedError",
    "RingStats",
    "RingTimeoutError",
    "Segment",
    "SegmentHandle",
    "SharedMemoryError",
    "dtype_code",
    "dtype_from_code",
    "flush_releases",
    "in_shared_memory",
    "open_array",
    "platform_info",
    "reap_orphans",
    "revoke",
    "segment_of",
    "set_release_route",
    "wait",
]
