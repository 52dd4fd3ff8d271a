"""mpexec: GIL-free, zero-copy ``python_function`` ops for data pipelines.

User Python functions over NumPy arrays run in worker processes, fed through
shared-memory ring buffers (the ``shm`` package) so that no array is pickled or
copied on the way; GPU ops run in the main process on CUDA streams.

- :func:`pipeline_def`, :class:`Pipeline` and the ops in :mod:`mpexec.fn`
  (DALI style); :class:`Batch` is what a pipeline returns. DALI's module
  names are here too (:mod:`mpexec.pipeline`, :mod:`mpexec.types`,
  :mod:`mpexec.ops`), so DALI code ports by changing its imports;
  :mod:`mpexec.dali` runs mpexec inside a real DALI pipeline.
- :func:`py_func`, :func:`numpy_function`, :func:`py_function` and
  :func:`contrib.py_func`: TensorFlow's entry points, in a pipeline or eagerly.
- :class:`WorkerPool`: a ``concurrent.futures.Executor`` over those workers.

Run ``python -m mpexec demo`` to see it work, ``python -m mpexec doctor`` to
see what this machine offers.
"""

from . import contrib, fn, ops, pipeline, types
from ._batch import Batch
from ._codec import writable
from ._errors import (
    BrokenPoolError,
    ConditionalError,
    ForkedPoolError,
    GpuError,
    GpuUnavailableError,
    InputMutatedError,
    LoaderTimeoutError,
    MainModuleError,
    MpexecError,
    NodeLostError,
    OpArgumentError,
    OpOutputError,
    PoolClosedError,
    RemoteTraceback,
    ResourceLimitError,
    SerializationError,
    TaskTimeoutError,
    WorkerCrashedError,
)
from ._graph import DataNode
from ._pipeline import Pipeline, PipelineStats, pipeline_def
from ._pool import PoolStats, PoolStatus, WorkerPool
from ._runtime import BatchInfo, SampleInfo, sample_info
from ._scheduler import OpStats
from ._tf import default_pool, numpy_function, py_func, py_function, set_default_pool
from ._version import __version__

__all__ = [
    "Batch",
    "BatchInfo",
    "BrokenPoolError",
    "ConditionalError",
    "DataNode",
    "ForkedPoolError",
    "GpuError",
    "GpuUnavailableError",
    "InputMutatedError",
    "LoaderTimeoutError",
    "MainModuleError",
    "MpexecError",
    "NodeLostError",
    "OpArgumentError",
    "OpOutputError",
    "OpStats",
    "Pipeline",
    "PipelineStats",
    "PoolClosedError",
    "PoolStats",
    "PoolStatus",
    "RemoteTraceback",
    "ResourceLimitError",
    "SampleInfo",
    "SerializationError",
    "TaskTimeoutError",
    "WorkerCrashedError",
    "WorkerPool",
    "__version__",
    "contrib",
    "default_pool",
    "fn",
    "numpy_function",
    "ops",
    "pipeline",
    "pipeline_def",
    "py_func",
    "py_function",
    "sample_info",
    "set_default_pool",
    "types",
    "writable",
]
