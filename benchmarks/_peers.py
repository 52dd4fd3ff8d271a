"""One system of ``python -m benchmarks peers``, run in a process of its own.

``python -m benchmarks._peers SPEC`` (``SPEC`` a JSON object: workload,
system, workers, images) imports only what its system needs, builds it, and
answers commands, one JSON object per line, on what was its standard output
(anything a library prints there goes to standard error instead). The parent
(``benchmarks/peers_bench.py``) so measures each system's memory alone, kills
a system that hangs without harming the others, and keeps one library's
imports, threads and settings out of every other's measurements.

Each system uses its own library in that library's natural idiom, and calls
the same module-level functions of ``benchmarks/_workloads.py``. Heavy
libraries are imported inside the adapters only: the parent imports this
module for the catalogue (:data:`CATALOGUE`) without importing any of them.

Commands (a line each) and answers:

augment,   ``verify`` -> ``digests`` (one per batch); ``epoch`` -> ``seconds`` and
jpeg       ``subs`` (a digest of a strided sample of each batch, checked by the parent)
overhead   ``verify``; ``time`` with ``calls`` -> ``us`` (each call timed)
transfer   ``verify`` with ``size``; ``time`` with ``size`` and ``calls`` -> ``ms``
all        ``quit``; a failure answers ``{"ok": false, "error": traceback}``
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import _workloads as wl

CALL_S = 120.0  # one call or one batch, at most (a 256 MiB array pickled both ways included)
SUB_STRIDE = 4099  # the strided sample of a batch checked in timed epochs


# ============================================================ the catalogue
@dataclass(frozen=True)
class System:
    """A system of one workload: how to show it, and what it needs installed."""

    key: str
    label: str
    requires: str | None = None  # the module that must be importable, if any
    multiprocess: bool = True  # runs the function in other processes
    mpexec: bool = False


AUGMENT = [
    System("serial", "serial (main process)", multiprocess=False),
    System("mpexec_pipeline", "mpexec pipeline", mpexec=True),
    System("mpexec_pool", "mpexec WorkerPool.map", mpexec=True),
    System("torch", "PyTorch DataLoader", "torch"),
    System("mpexec_torch", "mpexec.torch.DataLoader", "torch", mpexec=True),
    System("mpexec_torch_warm", "mpexec.torch.DataLoader, warm_batches", "torch", mpexec=True),
    System("tf", "tf.data + numpy_function", "tensorflow", multiprocess=False),
    System("dali_pyfunc", "DALI fn.python_function", "nvidia.dali", multiprocess=False),
    System("dali_parallel", "DALI parallel external_source", "nvidia.dali"),
    System("grain", "Grain mp_prefetch", "grain"),
    System("mp_pool", "multiprocessing.Pool.imap"),
    System("loky", "loky executor map", "loky"),
    System("threads", "threads (ThreadPoolExecutor)", multiprocess=False),
]

OVERHEAD = [
    System("inline", "inline call (floor)", multiprocess=False),
    System("mpexec_pool", "mpexec WorkerPool.submit", mpexec=True),
    System("ppe", "ProcessPoolExecutor.submit"),
    System("mp_pool", "multiprocessing.Pool.apply"),
    System("loky", "loky executor submit", "loky"),
]

TRANSFER = [
    System("inline", "inline x + 1 (floor)", multiprocess=False),
    System("mpexec_put", "mpexec, input in pool memory (put)", mpexec=True),
    System("mpexec_pool", "mpexec, plain ndarray in", mpexec=True),
    System("ppe", "ProcessPoolExecutor.submit"),
    System("mp_pool", "multiprocessing.Pool.apply"),
    System("loky", "loky executor submit", "loky"),
    System("dali_pyfunc", "DALI fn.python_function (feed_input)", "nvidia.dali", False),
    System("grain", "Grain mp_prefetch, new iterator per call", "grain"),
]

LIGHT = [
    System("serial", "serial (main process)", multiprocess=False),
    System("mpexec_pipeline", "mpexec pipeline, per sample", mpexec=True),
    System("mpexec_pipeline_batch", "mpexec pipeline, batch_processing=True", mpexec=True),
    System("torch", "PyTorch DataLoader", "torch"),
    System("dali_parallel", "DALI parallel external_source", "nvidia.dali"),
    System("grain", "Grain mp_prefetch", "grain"),
]

CATALOGUE: dict[str, list[System]] = {
    "augment": AUGMENT,
    "augment4": AUGMENT,  # workload 1b: the same at 3-4 ms a sample
    "jpeg": AUGMENT,  # workload 2: the same systems, the same way
    "light": LIGHT,  # workload 6: the per-item cost
    "overhead": OVERHEAD,
    "transfer": TRANSFER,
}

# The distributions whose versions the report names, by the module they provide.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "tensorflow": ("tensorflow-cpu", "tensorflow"),
    "grain": ("grain", "grain-nightly"),
    "loky": ("loky",),
    "joblib": ("joblib",),
    "nvidia.dali": (
        "nvidia-dali-cuda130",
        "nvidia-dali-cuda120",
        "nvidia-dali-cuda110",
        "nvidia-dali-nightly-cuda130",
        "nvidia-dali-nightly-cuda120",
    ),
    "matplotlib": ("matplotlib",),
}


def installed_version(module: str) -> str | None:
    """The version of the distribution that provides ``module``, if one is installed."""
    for dist in DISTRIBUTIONS.get(module, (module,)):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def availability(module: str | None) -> str | None:
    """None if ``module`` can be imported here (without importing it), else why not."""
    if module is None:
        return None
    if module == "nvidia.dali" and not (
        sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
    ):
        return "skipped (DALI has no wheel for this platform)"
    if module == "loky" and _find("loky") is None and _find("joblib") is not None:
        return None  # joblib's copy of loky
    if _find(module) is None:
        return "skipped (not installed)"
    return None


def _find(module: str) -> Any:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _loky() -> Any:
    try:
        return importlib.import_module("loky")
    except ImportError:
        return importlib.import_module("joblib.externals.loky")


# ============================================================ shared pieces
class IndexSource:
    """A per-sample source (mpexec and DALI): ``(input, index)`` of sample ``idx_in_epoch``.

    Picklable and stateless, as parallel sources must be; the epoch ends at ``n``.
    ``workload`` names a :data:`wl.PER_SAMPLE` entry (the image, or the JPEG's bytes).
    """

    def __init__(self, n: int, whole: bool = False, workload: str = "augment") -> None:
        self.n = n
        self.whole = whole  # return the finished sample, not (input, index)
        self.workload = workload

    def __call__(self, info: Any) -> Any:
        i = int(info.idx_in_epoch)
        if i >= self.n:
            raise StopIteration
        fns = wl.PER_SAMPLE[self.workload]
        return fns.sample(i) if self.whole else fns.load(i)


class IndexDataset:
    """A map-style data set of ``n`` samples (PyTorch's protocol, and Grain's)."""

    def __init__(self, n: int, pair: bool = False, workload: str = "augment") -> None:
        self.n = n
        self.pair = pair  # (input, index) instead of the finished sample
        self.workload = workload

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        if not 0 <= i < self.n:
            raise IndexError(i)
        fns = wl.PER_SAMPLE[self.workload]
        return fns.load(i) if self.pair else fns.sample(i)


class PairTransform:
    """Grain's map step: the workload's transform of an ``(input, index)`` element."""

    def __init__(self, workload: str) -> None:
        self.workload = workload

    def __call__(self, element: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> Any:
        return wl.PER_SAMPLE[self.workload].transform(*element)


def collate(
    samples: Iterable[np.ndarray[Any, Any]], n: int, batch_size: int = wl.BATCH_SIZE
) -> Iterator[np.ndarray[Any, Any]]:
    """Stack per-sample results into batches of ``batch_size``, in order."""
    pending: list[np.ndarray[Any, Any]] = []
    for s in samples:
        pending.append(s)
        if len(pending) == batch_size:
            yield np.stack(pending)
            pending.clear()
    if pending:
        yield np.stack(pending)


def _start_method(ctx: Any) -> str:
    try:
        return str(ctx.get_start_method())
    except (AttributeError, RuntimeError):
        return "default"


# ============================================================ workloads 1 and 2
class Augment:
    """A system that produces the epoch's batches, dense (64, 224, 224, 3) float32.

    ``workload`` (``augment`` or ``jpeg``) picks the functions, :data:`wl.PER_SAMPLE`.
    """

    version: str = ""
    start_method: str = ""

    def __init__(self, n: int, workers: int, workload: str = "augment") -> None:
        self.n = n
        self.workers = workers
        self.workload = workload
        self.fns = wl.PER_SAMPLE[workload]

    def start(self) -> None:
        """Build the system and start its workers."""

    def epoch(self) -> Iterator[Any]:
        """The batches of one epoch, in order, each in the library's own type."""
        raise NotImplementedError

    @staticmethod
    def to_numpy(batch: Any) -> np.ndarray[Any, Any]:
        return np.asarray(batch)

    def close(self) -> None:
        """Stop the workers."""


class Serial(Augment):
    start_method = "-"

    def epoch(self) -> Iterator[Any]:
        for b in wl.batches_of(self.n, self.fns.batch_size):
            yield wl.process_batch(b, self.workload)


class Threads(Augment):
    start_method = "threads"

    def start(self) -> None:
        self.pool = cf.ThreadPoolExecutor(self.workers)

    def epoch(self) -> Iterator[Any]:
        return collate(
            self.pool.map(self.fns.sample, range(self.n), timeout=CALL_S),
            self.n,
            self.fns.batch_size,
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class MpPool(Augment):
    def start(self) -> None:
        ctx = mp.get_context()  # the platform's default, as users get it
        self.start_method = _start_method(ctx)
        self.pool = ctx.Pool(self.workers)

    def epoch(self) -> Iterator[Any]:
        it = self.pool.imap(self.fns.sample, range(self.n))
        return collate((it.next(CALL_S) for _ in range(self.n)), self.n, self.fns.batch_size)

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


class Loky(Augment):
    def start(self) -> None:
        loky = _loky()
        self.version = str(getattr(loky, "__version__", ""))
        self.start_method = "loky"
        self.pool = loky.get_reusable_executor(max_workers=self.workers, timeout=3600)

    def epoch(self) -> Iterator[Any]:
        return collate(
            self.pool.map(self.fns.sample, range(self.n), timeout=CALL_S),
            self.n,
            self.fns.batch_size,
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, kill_workers=True)


class MpexecPool(Augment):
    def start(self) -> None:
        import mpexec

        self.version = mpexec.__version__
        self.pool = mpexec.WorkerPool(self.workers)
        self.start_method = _start_method(getattr(self.pool, "_ctx", None))
        self.pool.submit(wl.echo, 0).result(CALL_S)  # the workers are up

    def epoch(self) -> Iterator[Any]:
        return collate(
            self.pool.map(self.fns.sample, range(self.n), timeout=CALL_S),
            self.n,
            self.fns.batch_size,
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class MpexecPipeline(Augment):
    """``fn.external_source(batch=False)`` in the workers, then ``fn.python_function``."""

    def start(self) -> None:
        import mpexec
        from mpexec import fn

        self.version = mpexec.__version__
        source = IndexSource(self.n, workload=self.workload)
        transform = self.fns.transform

        @mpexec.pipeline_def(
            batch_size=self.fns.batch_size, num_workers=self.workers, seed=1, prefetch_depth=2
        )
        def augment_pipeline() -> Any:
            data, index = fn.external_source(source=source, batch=False, num_outputs=2)
            return fn.python_function(data, index, function=transform)

        self.pipe = augment_pipeline()
        self.pipe.build()
        pool = getattr(self.pipe, "_pool", None)
        self.start_method = _start_method(getattr(pool, "_ctx", None))
        self.fresh = True

    def epoch(self) -> Iterator[Any]:
        if not self.fresh:
            self.pipe.reset()
        self.fresh = False
        while True:
            try:
                (out,) = self.pipe.run()
            except StopIteration:
                return
            yield out

    @staticmethod
    def to_numpy(batch: Any) -> np.ndarray[Any, Any]:
        return batch.as_array()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.pipe.close()


class MpexecPipelineBatch(MpexecPipeline):
    """As :class:`MpexecPipeline`, with the op in batch mode (``batch_processing=True``)."""

    def start(self) -> None:
        import mpexec
        from mpexec import fn

        self.version = mpexec.__version__
        source = IndexSource(self.n, workload=self.workload)
        transform = self.fns.batch_transform
        if transform is None:
            raise RuntimeError(f"workload {self.workload} has no batch transform")

        @mpexec.pipeline_def(
            batch_size=self.fns.batch_size, num_workers=self.workers, seed=1, prefetch_depth=2
        )
        def batch_pipeline() -> Any:
            data, index = fn.external_source(source=source, batch=False, num_outputs=2)
            return fn.python_function(data, index, function=transform, batch_processing=True)

        self.pipe = batch_pipeline()
        self.pipe.build()
        pool = getattr(self.pipe, "_pool", None)
        self.start_method = _start_method(getattr(pool, "_ctx", None))
        self.fresh = True


class TorchLoader(Augment):
    """``DataLoader(dataset, batch_size=64, num_workers=w, persistent_workers=True)``."""

    def start(self) -> None:
        import torch
        from torch.utils.data import DataLoader

        self.version = torch.__version__
        self.loader = DataLoader(
            IndexDataset(self.n, workload=self.workload),  # type: ignore[arg-type]
            batch_size=self.fns.batch_size,
            num_workers=self.workers,
            persistent_workers=True,
            timeout=CALL_S,
        )
        self.start_method = _start_method(mp.get_context())

    def epoch(self) -> Iterator[Any]:
        return iter(self.loader)

    @staticmethod
    def to_numpy(batch: Any) -> np.ndarray[Any, Any]:
        return batch.numpy()  # type: ignore[no-any-return]

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)  # persistent workers live there
        if it is not None:
            with contextlib.suppress(Exception):
                it._shutdown_workers()


class MpexecTorchLoader(TorchLoader):
    """:class:`TorchLoader` with ``mpexec.torch.DataLoader``: one import changed."""

    warm_batches = 0

    def start(self) -> None:
        import torch

        from mpexec.torch import DataLoader
        from mpexec.torch._processes import start_method

        self.version = torch.__version__
        self.loader = DataLoader(
            IndexDataset(self.n, workload=self.workload),
            batch_size=wl.BATCH_SIZE,
            num_workers=self.workers,
            persistent_workers=True,
            timeout=CALL_S,
            warm_batches=self.warm_batches,
        )
        self.start_method = start_method(self.loader.multiprocessing_context)


class MpexecTorchWarmLoader(MpexecTorchLoader):
    """:class:`MpexecTorchLoader` whose workers keep two batches' pages warm."""

    warm_batches = 2 * wl.BATCH_SIZE * wl.CROP * wl.CROP * 3 * 4  # float32 samples


class TfData(Augment):
    """``Dataset.range(n).map(numpy_function, num_parallel_calls=w).batch(64)``."""

    start_method = "threads"

    def start(self) -> None:
        import tensorflow as tf

        self.version = tf.__version__
        shape = self.fns.output_shape
        process = self.fns.sample

        def sample(i: Any) -> Any:
            y = tf.numpy_function(process, [i], tf.float32, stateful=False)
            return tf.ensure_shape(y, shape)

        self.dataset = (
            tf.data.Dataset.range(self.n)
            .map(sample, num_parallel_calls=self.workers, deterministic=True)
            .batch(self.fns.batch_size)
            .prefetch(2)
        )

    def epoch(self) -> Iterator[Any]:
        return iter(self.dataset)

    @staticmethod
    def to_numpy(batch: Any) -> np.ndarray[Any, Any]:
        return batch.numpy()  # type: ignore[no-any-return]


class DaliBase(Augment):
    def _pipeline(self, build: Callable[[], Any], **kwargs: Any) -> None:
        from nvidia import dali

        self.version = dali.__version__
        pipe = dali.Pipeline(batch_size=self.fns.batch_size, device_id=None, seed=1, **kwargs)
        with pipe:
            pipe.set_outputs(build())
        pipe.build()
        self.pipe = pipe
        self.fresh = True

    def epoch(self) -> Iterator[Any]:
        if not self.fresh:
            self.pipe.reset()
        self.fresh = False
        while True:
            try:
                (out,) = self.pipe.run()
            except StopIteration:
                return
            yield out

    @staticmethod
    def to_numpy(batch: Any) -> np.ndarray[Any, Any]:
        return batch.as_array()  # type: ignore[no-any-return]

    def close(self) -> None:
        pipe = getattr(self, "pipe", None)
        if pipe is not None:
            del self.pipe
            del pipe


class DaliPythonFunction(DaliBase):
    """A per-sample source, then ``fn.python_function``: both in the main process."""

    start_method = "main process"

    def start(self) -> None:
        import nvidia.dali.fn as dfn

        source = IndexSource(self.n, workload=self.workload)
        transform = self.fns.transform

        def build() -> Any:
            data, index = dfn.external_source(source=source, batch=False, num_outputs=2)
            return dfn.python_function(data, index, function=transform)

        # python_function runs only with the synchronous executor.
        self._pipeline(build, num_threads=self.workers, exec_async=False, exec_pipelined=False)


class DaliParallelSource(DaliBase):
    """``fn.external_source(parallel=True)``: the whole sample in DALI's Python workers."""

    def start(self) -> None:
        import nvidia.dali.fn as dfn

        source = IndexSource(self.n, whole=True, workload=self.workload)

        def build() -> Any:
            return dfn.external_source(source=source, batch=False, parallel=True)

        self.start_method = "fork"
        self._pipeline(build, num_threads=1, py_num_workers=self.workers, py_start_method="fork")


def import_grain() -> Any:
    """Grain, with absl's flags marked parsed: its workers read them (grain 0.2.18 with
    absl-py 2.5 raises ``UnparsedFlagAccessError`` in a program that is not an absl app)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    import grain

    return grain


class Grain(Augment):
    """``MapDataset.source(...).map(augment).batch(64)``, ``mp_prefetch`` with w workers."""

    def start(self) -> None:
        grain = import_grain()
        self.version = installed_version("grain") or ""
        self.start_method = "grain"
        self.dataset = (
            grain.MapDataset.source(IndexDataset(self.n, pair=True, workload=self.workload))
            .map(PairTransform(self.workload))
            .batch(self.fns.batch_size)
            .to_iter_dataset()
            .mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        )

    def epoch(self) -> Iterator[Any]:
        return iter(self.dataset)


AUGMENT_CLASSES: dict[str, type[Augment]] = {
    "serial": Serial,
    "threads": Threads,
    "mp_pool": MpPool,
    "loky": Loky,
    "mpexec_pool": MpexecPool,
    "mpexec_pipeline": MpexecPipeline,
    "mpexec_pipeline_batch": MpexecPipelineBatch,
    "torch": TorchLoader,
    "mpexec_torch": MpexecTorchLoader,
    "mpexec_torch_warm": MpexecTorchWarmLoader,
    "tf": TfData,
    "dali_pyfunc": DaliPythonFunction,
    "dali_parallel": DaliParallelSource,
    "grain": Grain,
}


def subsample(a: np.ndarray[Any, Any]) -> str:
    """The digest of a strided sample of a batch (checked in timed epochs)."""
    return wl.digest(a.reshape(-1)[::SUB_STRIDE])


def _worker_faults() -> dict[int, int]:
    """Minor page faults so far of each process this one started (itself, if none)."""
    import psutil

    me = psutil.Process()
    counts = {}
    for p in me.children(recursive=True) or [me]:
        try:
            with open(f"/proc/{p.pid}/stat", "rb") as f:
                counts[p.pid] = int(f.read().rsplit(b")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            pass  # gone meanwhile, or no /proc
    return counts


class AugmentServer:
    """Workloads 1 and 2: epochs of batches, from the workload's per-sample functions."""

    def __init__(self, spec: dict[str, Any]) -> None:
        system = AUGMENT_CLASSES[spec["system"]]
        self.system = system(spec["n"], spec["workers"], spec["workload"])

    def start(self) -> dict[str, Any]:
        self.system.start()
        return {"version": self.system.version, "start_method": self.system.start_method}

    def verify(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        digests = [wl.digest(self.system.to_numpy(b)) for b in self.system.epoch()]
        return {"digests": digests, "seconds": time.perf_counter() - t0}

    def epoch(self, msg: dict[str, Any]) -> dict[str, Any]:
        to_numpy = self.system.to_numpy
        subs = []
        faults0 = _worker_faults()
        t0 = time.perf_counter()
        for b in self.system.epoch():
            a = to_numpy(b)
            if a.shape[1:] != self.system.fns.output_shape or a.dtype != np.float32:
                raise RuntimeError(f"a batch of {a.dtype} {a.shape}")
            subs.append(a.reshape(-1)[::SUB_STRIDE].copy())
        seconds = time.perf_counter() - t0
        faults = sum(n - faults0.get(pid, 0) for pid, n in _worker_faults().items())
        return {"seconds": seconds, "subs": [wl.digest(s) for s in subs], "faults": faults}

    def close(self) -> None:
        self.system.close()


# ============================================================ workload 3: overhead
class Caller:
    """A system that calls one function with arguments and returns its result."""

    version: str = ""
    start_method: str = ""

    def __init__(self, workers: int) -> None:
        self.workers = workers

    def start(self) -> None:
        pass

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class InlineCaller(Caller):
    start_method = "-"

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


class MpexecCaller(Caller):
    def start(self) -> None:
        import mpexec

        self.version = mpexec.__version__
        self.pool = mpexec.WorkerPool(self.workers)
        self.start_method = _start_method(getattr(self.pool, "_ctx", None))
        self.pool.submit(wl.echo, 0).result(CALL_S)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.submit(fn, *args).result(CALL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class MpexecPutCaller(MpexecCaller):
    """mpexec with the input already in the pool's shared memory (``pool.put``)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.held: dict[int, Any] = {}

    def prepare(self, x: np.ndarray[Any, Any]) -> Any:
        self.held.clear()
        shared = self.pool.put(x)
        self.held[id(x)] = shared
        return shared


class ExecutorCaller(Caller):
    def start(self) -> None:
        ctx = mp.get_context()
        self.start_method = _start_method(ctx)
        self.pool: Any = cf.ProcessPoolExecutor(self.workers, mp_context=ctx)
        self.pool.submit(wl.echo, 0).result(CALL_S)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.submit(fn, *args).result(CALL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class LokyCaller(ExecutorCaller):
    def start(self) -> None:
        loky = _loky()
        self.version = str(getattr(loky, "__version__", ""))
        self.start_method = "loky"
        self.pool = loky.get_reusable_executor(max_workers=self.workers, timeout=3600)
        self.pool.submit(wl.echo, 0).result(CALL_S)

    def close(self) -> None:
        self.pool.shutdown(wait=True, kill_workers=True)


class MpPoolCaller(Caller):
    def start(self) -> None:
        ctx = mp.get_context()
        self.start_method = _start_method(ctx)
        self.pool = ctx.Pool(self.workers)
        self.pool.apply(wl.echo, (0,))

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.apply_async(fn, args).get(CALL_S)  # Pool.apply, bounded

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


class DaliCaller(Caller):
    """``feed_input`` of one sample, ``fn.python_function`` of it, the output back."""

    start_method = "main process"

    def start(self) -> None:
        import nvidia.dali.fn as dfn
        from nvidia import dali

        self.version = dali.__version__
        pipe = dali.Pipeline(
            batch_size=1,
            num_threads=1,
            device_id=None,
            exec_async=False,
            exec_pipelined=False,
            prefetch_queue_depth=1,
        )
        with pipe:
            x = dfn.external_source(name="x", batch=True, no_copy=False)
            pipe.set_outputs(dfn.python_function(x, function=wl.add_one))
        pipe.build()
        self.pipe = pipe

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if fn is not wl.add_one:
            raise NotImplementedError("the DALI adapter runs add_one only")
        self.pipe.feed_input("x", [args[0]])
        (out,) = self.pipe.run()
        return out.as_array()[0]


class GrainCaller(Caller):
    """A one-element Grain data set through one worker, iterated once per call."""

    start_method = "grain"

    def start(self) -> None:
        self.grain = import_grain()
        self.version = installed_version("grain") or ""

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        g = self.grain
        ds = (
            g.MapDataset.source([args[0]])
            .map(fn)
            .to_iter_dataset()
            .mp_prefetch(g.MultiprocessingOptions(num_workers=1))
        )
        (out,) = list(ds)
        return out


CALLER_CLASSES: dict[str, type[Caller]] = {
    "inline": InlineCaller,
    "mpexec_pool": MpexecCaller,
    "mpexec_put": MpexecPutCaller,
    "ppe": ExecutorCaller,
    "mp_pool": MpPoolCaller,
    "loky": LokyCaller,
    "dali_pyfunc": DaliCaller,
    "grain": GrainCaller,
}


class OverheadServer:
    """Workload 3: ``echo`` of 16 float64, one call at a time, each timed."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.caller = CALLER_CLASSES[spec["system"]](spec["workers"])
        self.x = np.arange(16, dtype=np.float64)

    def start(self) -> dict[str, Any]:
        self.caller.start()
        return {"version": self.caller.version, "start_method": self.caller.start_method}

    def _check(self, r: Any) -> None:
        if not (isinstance(r, np.ndarray) and np.array_equal(r, self.x)):
            raise RuntimeError(f"echo returned {r!r}, not the 16 floats")

    def verify(self, msg: dict[str, Any]) -> dict[str, Any]:
        for _ in range(int(msg.get("calls", 20))):
            self._check(self.caller.call(wl.echo, self.x))
        return {}

    def time(self, msg: dict[str, Any]) -> dict[str, Any]:
        call, x, out = self.caller.call, self.x, []
        end = time.monotonic() + float(msg.get("budget_s", math.inf))
        for _ in range(int(msg["calls"])):
            if out and time.monotonic() > end:
                break
            t0 = time.perf_counter_ns()
            r = call(wl.echo, x)
            out.append((time.perf_counter_ns() - t0) / 1e3)
            self._check(r)
        return {"us": out}

    def close(self) -> None:
        self.caller.close()


class TransferServer:
    """Workload 4: ``add_one`` of one float32 array, answered with one of the same size."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.caller = CALLER_CLASSES[spec["system"]](spec["workers"])
        self.size = -1
        self.x: Any = None
        self.arg: Any = None

    def start(self) -> dict[str, Any]:
        self.caller.start()
        return {"version": self.caller.version, "start_method": self.caller.start_method}

    def _prepare(self, size: int) -> None:
        if size == self.size:
            return
        self.x = self.arg = None
        self.x = wl.transfer_input(size)
        n = self.x.size
        self.probe = np.unique(np.array([0, 1, 1020, 1021, n // 2, n // 3 + 7, n - 2, n - 1]))
        self.probe = self.probe[self.probe < n]
        self.want = self.x[self.probe] + np.float32(1)
        prepare = getattr(self.caller, "prepare", None)
        self.arg = prepare(self.x) if prepare else self.x
        self.size = size

    def _check(self, r: Any, full: bool) -> None:
        x = self.x
        if not isinstance(r, np.ndarray) or r.shape != x.shape or r.dtype != x.dtype:
            raise RuntimeError(f"got {type(r).__name__} {getattr(r, 'shape', '')}")
        if not np.array_equal(r[self.probe], self.want):
            raise RuntimeError(f"wrong elements {r[self.probe]} (want {self.want})")
        if full and not np.array_equal(r, x + np.float32(1)):
            raise RuntimeError("wrong result")

    def verify(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._prepare(int(msg["size"]))
        t0 = time.perf_counter()
        r = self.caller.call(wl.add_one, self.arg)
        seconds = time.perf_counter() - t0
        self._check(r, full=True)
        return {"seconds": seconds}

    def time(self, msg: dict[str, Any]) -> dict[str, Any]:
        self._prepare(int(msg["size"]))
        call, arg, out = self.caller.call, self.arg, []
        end = time.monotonic() + float(msg.get("budget_s", math.inf))
        for _ in range(int(msg["calls"])):
            if out and time.monotonic() > end:
                break
            t0 = time.perf_counter_ns()
            r = call(wl.add_one, arg)
            out.append((time.perf_counter_ns() - t0) / 1e6)
            self._check(r, full=False)
            del r  # dropped before the next call
        return {"ms": out}

    def close(self) -> None:
        self.x = self.arg = None
        self.caller.close()


SERVERS: dict[str, Any] = {
    "augment": AugmentServer,
    "augment4": AugmentServer,
    "jpeg": AugmentServer,
    "light": AugmentServer,
    "overhead": OverheadServer,
    "transfer": TransferServer,
}


# ============================================================ the child's main loop
def _watch_parent(parent: int) -> None:
    """End this process group if the parent goes away (it would never say quit)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            try:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            finally:
                os._exit(1)


def serve(spec: dict[str, Any]) -> int:
    """Answer the parent's commands until ``quit`` or the end of its input."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what libraries print goes to standard error
    sys.stdout = sys.stderr

    def answer(**fields: Any) -> None:
        proto.write(json.dumps(fields) + "\n")
        proto.flush()

    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), name="watch parent", daemon=True
    ).start()
    try:
        t0 = time.perf_counter()
        server = SERVERS[spec["workload"]](spec)
        info = server.start()
        answer(ok=True, pid=os.getpid(), setup_s=time.perf_counter() - t0, **info)
    except BaseException:
        answer(ok=False, error=traceback.format_exc())
        return 1
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            cmd = msg["cmd"]
            if cmd == "quit":
                server.close()
                answer(ok=True)
                return 0
            try:
                answer(ok=True, **getattr(server, cmd)(msg))
            except Exception:
                answer(ok=False, error=traceback.format_exc())
    finally:
        proto.flush()
    server.close()
    return 0


if __name__ == "__main__":
    # Run the module's importable copy, so that what it pickles by reference
    # (sources, data sets) is named benchmarks._peers, not __main__.
    real = importlib.import_module("benchmarks._peers")
    sys.exit(real.serve(json.loads(sys.argv[1])))
