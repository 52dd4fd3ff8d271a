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

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._version import __version__

if _TYPE_CHECKING:  # the same names, imported for type checkers; at run time see __getattr__
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
    from ._iterations import OpStats, PipelineStats
    from ._pipeline import Pipeline, pipeline_def
    from ._pool import PoolStats, PoolStatus, WorkerPool
    from ._pyfunc import default_pool, numpy_function, py_func, py_function, set_default_pool
    from ._runtime import BatchInfo, SampleInfo, sample_info

#: Where each public name lives. ``import mpexec`` loads none of them: a worker
#: process (spawn, forkserver) imports only what it runs, and a script only
#: what it uses; each module loads on first access (PEP 562).
_WHERE = {
    "contrib": "contrib",
    "fn": "fn",
    "math": "math",
    "ops": "ops",
    "pipeline": "pipeline",
    "tensors": "tensors",
    "types": "types",
    "Batch": "_batch",
    "writable": "_codec",
    "DataNode": "_graph",
    "Pipeline": "_pipeline",
    "PipelineStats": "_iterations",
    "pipeline_def": "_pipeline",
    "PoolStats": "_pool",
    "PoolStatus": "_pool",
    "WorkerPool": "_pool",
    "BatchInfo": "_runtime",
    "SampleInfo": "_runtime",
    "sample_info": "_runtime",
    "OpStats": "_iterations",
    "default_pool": "_pyfunc",
    "numpy_function": "_pyfunc",
    "py_func": "_pyfunc",
    "py_function": "_pyfunc",
    "set_default_pool": "_pyfunc",
    **dict.fromkeys(
        (
            "BrokenPoolError",
            "ConditionalError",
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
            "PoolClosedError",
            "RemoteTraceback",
            "ResourceLimitError",
            "SerializationError",
            "TaskTimeoutError",
            "WorkerCrashedError",
        ),
        "_errors",
    ),
}


def __getattr__(name: str) -> _Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _importlib.import_module(f"{__name__}.{where}")
    value = module if where == name else getattr(module, name)
    globals()[name] = value  # found once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
    "math",
    "numpy_function",
    "ops",
    "pipeline",
    "pipeline_def",
    "py_func",
    "py_function",
    "sample_info",
    "set_default_pool",
    "tensors",
    "types",
    "writable",
]
