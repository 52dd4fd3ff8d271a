"""mpexec: GIL-free, zero-copy ``python_function`` ops for data pipelines.

User Python functions over NumPy arrays run in worker processes, fed through
shared-memory ring buffers (the ``shm`` package) so that no array is pickled or
copied on the way; GPU ops run in the main process on CUDA streams.

- :class:`WorkerPool`: a ``concurrent.futures.Executor`` over those workers.

Run ``python -m mpexec doctor`` to see what this machine offers.
"""

from ._errors import (
    BrokenPoolError,
    MpexecError,
    PoolClosedError,
    RemoteTraceback,
    SerializationError,
    TaskTimeoutError,
    WorkerCrashedError,
)
from ._pool import PoolStats, WorkerPool
from ._version import __version__

__all__ = [
    "BrokenPoolError",
    "MpexecError",
    "PoolClosedError",
    "PoolStats",
    "RemoteTraceback",
    "SerializationError",
    "TaskTimeoutError",
    "WorkerCrashedError",
    "WorkerPool",
    "__version__",
]
