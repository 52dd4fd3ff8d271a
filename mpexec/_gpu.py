"""The GPU stage: CUDA streams, copies straight from shared memory, events that gate reuse.

::

    worker arenas (shared memory)     main process, GpuStage                   device
    ------------------------------    ----------------------                   ------
    segment, page-locked in place --- cudaHostRegister (once per segment,
      (registered at first use,         undone at close)
       unregistered at close)         one cudaMemcpyAsync per contiguous run -> input buffer
    not registrable (or turned off)     on the copy stream                       (one per
      -> staging ring slot (pinned,   ring slot reused only after its           column)
         cupy alloc_pinned_memory)      copy's event completed
                                      copy event recorded; the op's stream
                                        waits on it (no device-wide sync)
    host arrays the copy reads        held until the copy event completed,
                                        then released (their slots recycle)
                                      the op's function runs in `with stream:`  kernels on
                                        on its own non-blocking stream          the op stream
    pinned host buffer  <------------ D2H stream waits on the op's event;      output arrays
      (a CPU op or the user reads it    cudaMemcpyAsync D2H; the event is
       only after the event synced)     synchronized before anyone reads

The pipeline's GPU thread that drives the stage, and queues each GPU op's calls and
the host copies CPU ops need, is ``_executors.GpuExecutor``.

Who owns what: the arenas belong to the workers (the stage only registers
their segments and holds views until copies complete); the staging ring, the
streams, the events and the registrations belong to the stage, and
:meth:`GpuStage.close` waits for its copies and undoes every registration.

CuPy is imported only here and only when a GPU op is defined; every name the
stage uses is listed in :data:`CUPY_NAMES` (a test checks the list is complete,
and the API-conformance tox environment checks each name against real CuPy).
Without a GPU the stage runs on ``mpexec.testing.SimCuPy``, a simulated device whose
streams run deferred work only when waited on.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import shm

from ._batch import Batch
from ._errors import GpuError, GpuUnavailableError, OpOutputError
from ._extras import INSTALL_DOC, install_command
from ._rngseeds import RngSeeds
from ._runtime import BatchInfo, Chunk, takes_keyword

#: Every CuPy name this module uses (attribute paths from the ``cupy`` module).
CUPY_NAMES = (
    "cuda.Device",
    "cuda.Device.use",
    "cuda.Event",
    "cuda.Event.done",
    "cuda.Event.record",
    "cuda.Event.synchronize",
    "cuda.ExternalStream",
    "cuda.Stream",
    "cuda.Stream.done",
    "cuda.Stream.ptr",
    "cuda.Stream.record",
    "cuda.Stream.synchronize",
    "cuda.Stream.wait_event",
    "cuda.alloc_pinned_memory",
    "cuda.get_current_stream",
    "cuda.memory.OutOfMemoryError",
    "cuda.runtime.CUDARuntimeError",
    "cuda.runtime.getDeviceCount",
    "cuda.runtime.getDeviceProperties",
    "cuda.runtime.hostRegister",
    "cuda.runtime.hostUnregister",
    "cuda.runtime.memcpyAsync",
    "cuda.runtime.memcpyDeviceToHost",
    "cuda.runtime.memcpyHostToDevice",
    "cuda.runtime.driverGetVersion",  # the doctor's
    "cuda.runtime.runtimeGetVersion",  # the doctor's
    "empty",
    "from_dlpack",
    "ndarray",
    "ndarray.__dlpack__",
    "ndarray.data",
    "ndarray.get",
    "ndarray.reshape",
    "ndarray.view",
    "stack",
)

_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: our views of worker arenas are
_STAGING_SLOTS = 4
_MIN_STAGING = 1 << 20

_lock = threading.Lock()
_override: Any = None  # a simulated device installed by use_backend()
_pinned_live = 0


# ---------------------------------------------------------------- availability


@contextlib.contextmanager
def use_backend(xp: Any) -> Iterator[Any]:
    """Run GPU ops on ``xp`` (a :class:`mpexec.testing.SimCuPy`) instead of CuPy."""
    global _override
    with _lock:
        old, _override = _override, xp
    try:
        yield xp
    finally:
        with _lock:
            _override = old


def backend() -> Any:
    """The CuPy module, or the simulated device installed by :func:`use_backend`."""
    if _override is not None:
        return _override
    import cupy

    return cupy


def require(what: str, device_id: int | None = None) -> Any:
    """The backend, if it can run ``what`` on ``device_id``; else a clear error.

    Raised when a GPU op is defined, so that no raw CUDA traceback surfaces
    later: no CuPy, a CuPy without a usable driver, or too few devices.
    """
    try:
        xp = backend()
    except Exception as exc:  # ImportError, or CUDA libraries that fail to load
        raise GpuUnavailableError(
            f"{what}: device='gpu' needs CuPy, which does not import here "
            f"({type(exc).__name__}: {exc}). From a checkout of mpexec: "
            f"{install_command('cupy')} (CUDA 12; for another CUDA, the cupy-cudaXXx wheel "
            f"of yours; see {INSTALL_DOC}), or use device='cpu'"
        ) from exc
    try:
        count = int(xp.cuda.runtime.getDeviceCount())
    except Exception as exc:
        status = getattr(exc, "status", None)
        cause = (
            "the NVIDIA driver is missing or older than this CuPy's CUDA runtime; "
            "install or update the driver (python -m mpexec doctor shows what CuPy sees)"
            if status == 35
            else "CUDA reports no usable device (check CUDA_VISIBLE_DEVICES and nvidia-smi)"
        )
        raise GpuUnavailableError(f"{what}: device='gpu' cannot run here: {cause} ({exc})") from exc
    device = 0 if device_id is None else device_id
    if count == 0 or not 0 <= device < count:
        raise GpuUnavailableError(
            f"{what}: device='gpu' on device {device}, but CUDA sees "
            f"{count} device{'s' if count != 1 else ''}; give pipeline_def(device_id=...) "
            "a device that exists, or use device='cpu'"
        )
    return xp


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class GpuStats:
    """What the stage moved, and how (cheap to take; benchmarks print it)."""

    h2d_registered_bytes: int
    h2d_staged_bytes: int
    h2d_copies: int
    d2h_bytes: int
    registered_segments: int
    registration_failures: int
    staging_waits: int  # a staging slot was still in use and its copy event was waited on
    pending_releases: int


class _StagingSlot:
    """One pinned host buffer of the staging ring, and the event of its last copy."""

    __slots__ = ("event", "host", "mem")

    def __init__(self) -> None:
        self.mem: Any = None
        self.host: np.ndarray[Any, Any] | None = None
        self.event: Any = None


class _PinnedView:
    """Exports pinned memory to NumPy and keeps the allocation alive as the base."""

    __slots__ = ("__array_interface__", "__weakref__", "mem")

    def __init__(self, mem: Any, nbytes: int) -> None:
        self.mem = mem
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(mem.ptr), False),
            "version": 3,
        }


def pinned_array(xp: Any, nbytes: int) -> np.ndarray[Any, Any]:
    """``nbytes`` of page-locked host memory as a NumPy uint8 array (keeps it alive)."""
    global _pinned_live
    mem = xp.cuda.alloc_pinned_memory(max(nbytes, 1))
    view = _PinnedView(mem, nbytes)
    with _lock:
        _pinned_live += 1
    weakref.finalize(view, _pinned_freed)
    return np.asarray(view)


def pinned_live() -> int:
    """Pinned buffers this module allocated that are still referenced (a leak check)."""
    return _pinned_live


def _pinned_freed() -> None:
    global _pinned_live
    _pinned_live -= 1  # an int update: atomic under the GIL, no lock in a finalizer


# ---------------------------------------------------------------- doctor probes


def probe_host_register(xp: Any, nbytes: int = 1 << 21) -> tuple[bool, str | None]:
    """Whether a shared-memory segment can be page-locked in place; (ok, why not)."""
    seg = shm.Segment.create(nbytes, tag="mpx-probe")
    try:
        xp.cuda.runtime.hostRegister(seg.address, seg.size, 0)
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"
    else:
        xp.cuda.runtime.hostUnregister(seg.address)
        return True, None
    finally:
        seg.close()


def measure_h2d(xp: Any, nbytes: int = 64 << 20, repeat: int = 5) -> dict[str, float]:
    """Host-to-device GB/s (best of ``repeat``) from registered shared, pinned and pageable memory.

    Each copy is one ``cudaMemcpyAsync`` on a non-blocking stream, timed to that
    stream's synchronization.
    """

    seg = shm.Segment.create(nbytes, tag="mpx-probe")
    shared = np.ndarray((nbytes,), np.uint8, buffer=seg.buf)
    shared[:] = 1
    pinned = pinned_array(xp, nbytes)
    pinned[:] = 1
    pageable = np.ones(nbytes, np.uint8)
    rt = xp.cuda.runtime
    result: dict[str, float] = {}
    registered = False
    try:
        try:
            rt.hostRegister(seg.address, seg.size, 0)
            registered = True
        except rt.CUDARuntimeError:
            pass
        with xp.cuda.Device(0):
            stream = xp.cuda.Stream(non_blocking=True)
            dev = xp.empty(nbytes, np.uint8)
            kinds = [("registered", shared)] if registered else []
            kinds += [("pinned", pinned), ("pageable", pageable)]
            for kind, host in kinds:
                best = float("inf")
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    rt.memcpyAsync(
                        int(dev.data.ptr),
                        _address(host),
                        nbytes,
                        rt.memcpyHostToDevice,
                        stream.ptr,
                    )
                    stream.synchronize()
                    best = min(best, time.perf_counter() - t0)
                result[kind] = nbytes / best / 1e9
    finally:
        if registered:
            rt.hostUnregister(seg.address)
        del shared
        seg.close()
    return result


# ---------------------------------------------------------------- the stage


class GpuStage:
    """A pipeline's device context: streams, registered memory, staging, pending copies.

    ``register=False`` turns host registration off (every copy is staged);
    ``staging_slots`` is the depth of the pinned staging ring. Not thread-safe:
    one thread (the pipeline's GPU thread) drives it. :meth:`close` is
    idempotent; after it no copy is in flight and nothing stays registered.
    """

    def __init__(
        self,
        xp: Any,
        device_id: int = 0,
        *,
        register: bool = True,
        staging_slots: int = _STAGING_SLOTS,
    ) -> None:
        self.xp = xp
        self.device_id = device_id
        self.device = xp.cuda.Device(device_id)
        self._register = register
        with self.device:
            self.h2d = xp.cuda.Stream(non_blocking=True)
            self.d2h = xp.cuda.Stream(non_blocking=True)
        self._streams: dict[str, Any] = {}
        self._registered: dict[int, tuple[int, Any]] = {}  # address -> (size, segment)
        self._unregistrable: set[int] = set()
        self._slots = [_StagingSlot() for _ in range(max(1, staging_slots))]
        self._next_slot = 0
        # (event, things to drop, callbacks) per copy, oldest first: the copy stream is
        # in order, so events complete in this order.
        self._pending: collections.deque[tuple[Any, list[Any], list[Callable[[], None]]]] = (
            collections.deque()
        )
        self._held: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        self._closed = False
        self._registered_bytes = self._staged_bytes = self._copies = self._d2h_bytes = 0
        self._failures = self._staging_waits = 0

    # ------------------------------------------------------------ streams
    def stream(self, key: str) -> Any:
        """The non-blocking stream of op ``key`` (one per op, created on first use)."""
        s = self._streams.get(key)
        if s is None:
            with self.device:
                s = self._streams[key] = self.xp.cuda.Stream(non_blocking=True)
        return s

    # ------------------------------------------------------------ host -> device
    def to_device(
        self,
        columns: Sequence[Sequence[np.ndarray[Any, Any]]],
        consumer: Any,
        on_release: Callable[[], None] | None = None,
    ) -> list[list[Any]]:
        """Copy host columns (lists of samples) to the device for ``consumer``'s work.

        Each column lands in one device buffer; each run of samples contiguous
        in host memory is one ``cudaMemcpyAsync`` on the copy stream, from the
        page-locked arena segment itself, or else through a staging slot.
        ``consumer`` waits on the copy's event. The host arrays are kept (and
        ``on_release`` called) until that event has completed.
        """
        self._check_open()
        self.reap()
        out: list[list[Any]] = []
        holds: list[Any] = []
        with self.device, self.h2d:
            out.extend(self._column_to_device(list(column), holds) for column in columns)
            event = self.h2d.record()
        consumer.wait_event(event)
        self._pending.append((event, holds, [on_release] if on_release else []))
        return out

    def _column_to_device(self, column: list[np.ndarray[Any, Any]], holds: list[Any]) -> list[Any]:
        xp = self.xp
        sizes = [int(a.nbytes) for a in column]
        addresses = [_address(a) for a in column]
        total = sum(sizes)
        dev = xp.empty(max(total, 1), np.uint8)
        base = int(dev.data.ptr)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        holds.extend(column)
        staged: list[int] = []
        i = 0
        while i < len(column):
            a = column[i]
            if not sizes[i]:
                i += 1
                continue
            if not (a.flags.c_contiguous and self._host_ready(a)):
                staged.append(i)
                i += 1
                continue
            # A run: following samples that start where this one ends.
            j = i + 1
            end = addresses[i] + sizes[i]
            while (
                j < len(column)
                and sizes[j]
                and addresses[j] == end
                and column[j].flags.c_contiguous
                and self._host_ready(column[j])
            ):
                end += sizes[j]
                j += 1
            n = offsets[j] - offsets[i]
            self._copy_h2d(base + offsets[i], addresses[i], n)
            self._registered_bytes += n
            i = j
        if staged:
            self._stage(column, staged, sizes, offsets, base)
        return _sample_views(dev, column, offsets)

    def _stage(
        self,
        column: list[np.ndarray[Any, Any]],
        staged: list[int],
        sizes: list[int],
        offsets: list[int],
        base: int,
    ) -> None:
        need = sum(sizes[k] for k in staged)
        slot = self._take_slot(need)
        assert slot.host is not None
        pos = 0
        runs: list[tuple[int, int, int]] = []  # (device offset, slot offset, bytes)
        for k in staged:
            n = sizes[k]
            slot.host[pos : pos + n] = _bytes_of(column[k])
            if (
                runs
                and runs[-1][0] + runs[-1][2] == offsets[k]
                and runs[-1][1] + runs[-1][2] == pos
            ):
                d, s, m = runs[-1]
                runs[-1] = (d, s, m + n)
            else:
                runs.append((offsets[k], pos, n))
            pos += n
        src = _address(slot.host)
        for d, s, m in runs:
            self._copy_h2d(base + d, src + s, m)
        self._staged_bytes += need
        # The slot is reused only after this copy's event: record one for it alone.
        slot.event = self.h2d.record()

    def _take_slot(self, nbytes: int) -> _StagingSlot:
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        if slot.event is not None and not slot.event.done:
            self._staging_waits += 1
            slot.event.synchronize()  # this one copy, not the device
        slot.event = None
        if slot.host is None or slot.host.nbytes < nbytes:
            cap = max(nbytes, _MIN_STAGING, 0 if slot.host is None else 2 * slot.host.nbytes)
            slot.host = pinned_array(self.xp, cap)
        return slot

    def _copy_h2d(self, dst: int, src: int, nbytes: int) -> None:
        rt = self.xp.cuda.runtime
        rt.memcpyAsync(dst, src, nbytes, rt.memcpyHostToDevice, self.h2d.ptr)
        self._copies += 1

    def _host_ready(self, a: np.ndarray[Any, Any]) -> bool:
        """True if ``a`` lies in a page-locked segment (registering it on first sight)."""
        seg = shm.segment_of(a)
        if seg is None or not self._register:
            return False
        address = seg.address
        if address in self._registered:
            return True
        if address in self._unregistrable:
            return False
        size = int(seg.size)
        flags = _HOST_REGISTER_READ_ONLY if seg.readonly else 0
        try:
            self.xp.cuda.runtime.hostRegister(address, size, flags)
        except self.xp.cuda.runtime.CUDARuntimeError:
            # Not supported here (or already registered by someone else): stage instead.
            self._unregistrable.add(address)
            self._failures += 1
            return False
        self._registered[address] = (size, seg)
        return True

    # ------------------------------------------------------------ device -> host
    def to_host(
        self,
        columns: Sequence[Sequence[Any]],
        producer: Any,
        alloc: Callable[[int], np.ndarray[Any, Any]] | None = None,
    ) -> list[list[Any]]:
        """Copy device columns to host memory; return once the bytes have landed.

        The D2H stream waits on ``producer``'s work so far; the copy's event is
        synchronized before returning, so the NumPy arrays are complete. Each
        column lands in one host buffer: pinned memory, or ``alloc(nbytes)``
        (a pool's shared memory, page-locked in place like the workers'
        arenas, so that CPU ops in workers read it with no further copy).
        """
        self._check_open()
        xp = self.xp
        rt = xp.cuda.runtime
        out: list[list[Any]] = []
        with self.device:
            self.d2h.wait_event(producer.record())
            for column in columns:
                sizes = [int(a.nbytes) for a in column]
                total = sum(sizes)
                host = pinned_array(xp, total) if alloc is None or not total else alloc(total)
                if alloc is not None and total:
                    self._host_ready(host)  # page-lock the segment, or copy from pageable
                pos = 0
                views = []
                for a, n in zip(column, sizes, strict=True):
                    if n:
                        src = _contiguous(xp, a, producer)
                        rt.memcpyAsync(
                            _address(host) + pos,
                            int(src.data.ptr),
                            n,
                            rt.memcpyDeviceToHost,
                            self.d2h.ptr,
                        )
                    views.append(host[pos : pos + n].view(a.dtype).reshape(a.shape))
                    pos += n
                self._d2h_bytes += pos
                out.append(views)
            event = self.d2h.record()
        event.synchronize()  # before anyone reads the host arrays
        for col in out:
            for v in col:
                v.flags.writeable = False
        return out

    # ------------------------------------------------------------ lifetimes
    def hold(self, stream: Any, objects: list[Any]) -> None:
        """Keep ``objects`` (device buffers) until ``stream``'s work so far has completed.

        A device buffer freed while a kernel still reads it could be reused by
        the copy stream; holding it to the consumer's event prevents that.
        """
        self._held.append((stream.record(), objects))

    def reap(self) -> int:
        """Release what completed copies held; return how many copies completed."""
        n = 0
        while self._pending and self._pending[0][0].done:
            _, holds, callbacks = self._pending.popleft()
            holds.clear()
            for cb in callbacks:
                cb()
            n += 1
        while self._held and self._held[0][0].done:
            self._held.popleft()
        return n

    def stats(self) -> GpuStats:
        return GpuStats(
            self._registered_bytes,
            self._staged_bytes,
            self._copies,
            self._d2h_bytes,
            len(self._registered),
            self._failures,
            self._staging_waits,
            len(self._pending),
        )

    def close(self) -> None:
        """Wait for every copy (their events, not the device), release, unregister."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for event, holds, callbacks in self._pending:
            try:
                event.synchronize()
            except Exception as exc:  # a failed copy: still release and unregister
                errors.append(exc)
            holds.clear()
            for cb in callbacks:
                cb()
        self._pending.clear()
        for event, _ in self._held:
            with contextlib.suppress(Exception):
                event.synchronize()
        self._held.clear()
        for slot in self._slots:
            if slot.event is not None:
                with contextlib.suppress(Exception):
                    slot.event.synchronize()
            slot.event = slot.host = None
        for address in list(self._registered):
            try:
                self.xp.cuda.runtime.hostUnregister(address)
            except Exception as exc:
                errors.append(exc)
            del self._registered[address]
        if errors:
            raise GpuError(
                f"closing the GPU stage of device {self.device_id}: {errors[0]} "
                f"({len(errors)} error{'s' if len(errors) > 1 else ''}); its memory was "
                "released and unregistered anyway"
            ) from errors[0]

    @property
    def closed(self) -> bool:
        return self._closed

    def registered(self) -> list[tuple[int, int]]:
        """(address, size) of each segment registered now."""
        return [(a, s) for a, (s, _) in self._registered.items()]

    def _check_open(self) -> None:
        if self._closed:
            raise GpuError("the GPU stage is closed")


# ---------------------------------------------------------------- running ops


class GpuOpRunner:
    """A GPU op's function, called in this process inside ``with stream:``.

    Inputs are device arrays (DLPack capsules for ``dl_tensor_python_function``);
    outputs must be device arrays or DLPack producers on the device. Seeding
    matches the CPU runner: ``rng`` and the global generators derive from
    (pipeline seed, op, epoch, iteration, sample).
    """

    def __init__(
        self,
        name: str,
        function: Callable[..., Any],
        batch_processing: bool,
        num_outputs: int,
        entropy: int,
        dlpack: bool,
        producers: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.producers = producers  # per input, the op that produces it
        self.function = function
        self.batch_processing = batch_processing
        self.num_outputs = num_outputs
        self.entropy = entropy
        self.dlpack = dlpack
        self.takes_rng = takes_keyword(function, "rng")
        # As the CPU runner's: the SeedSequence's hash replayed on what changes.
        self._seeds = RngSeeds(entropy) if self.takes_rng else None

    def __call__(
        self, xp: Any, stream: Any, chunk: Chunk, inputs: Sequence[Sequence[Any]]
    ) -> tuple[list[Any], ...]:
        """Run over one chunk on ``stream``; per output, a column of device arrays."""
        from . import _runtime

        size = chunk.count
        with stream:
            if self.batch_processing:
                args = tuple(self._arg(list(col), stream) for col in inputs)
                _runtime.set_call_info(BatchInfo(chunk.iteration, chunk.epoch))
                (np_seed,), (py_seed,) = _runtime.call_seeds(
                    self.entropy, chunk.epoch, chunk.iteration, 0, 1
                )
                try:
                    out = self._call(
                        args, (chunk.epoch, chunk.iteration, 0), None, np_seed, py_seed
                    )
                finally:
                    _runtime.set_call_info(None)
                return tuple(
                    self._batch_column(xp, v, i, size) for i, v in enumerate(self._split(out))
                )
            np_seeds, py_seeds = _runtime.sample_seeds(self.entropy, chunk)
            if self._seeds is not None:  # every call's rng hashed at once, as a CPU op's
                self._seeds.prepare((chunk.epoch, chunk.iteration), _runtime.sample_keys(chunk))

            def one(args: tuple[Any, ...], j: int, b: int) -> list[Any]:
                args = tuple([self._arg(a, stream) for a in args])
                key = (chunk.epoch, chunk.iteration, b + 1)
                out = self._call(args, key, b, np_seeds[j], py_seeds[j])
                return [self._device_array(xp, v, i, b) for i, v in enumerate(self._split(out))]

            rows, _ = _runtime.each_sample(chunk, inputs, False, one)
            return tuple([row[i] for row in rows] for i in range(self.num_outputs))

    def _arg(self, value: Any, stream: Any) -> Any:
        if not self.dlpack:
            return value
        if isinstance(value, list):
            return [v.__dlpack__(stream=stream.ptr) for v in value]
        return value.__dlpack__(stream=stream.ptr)

    def _call(
        self,
        args: tuple[Any, ...],
        key: tuple[int, int, int],
        sample: int | None,
        np_seed: int,
        py_seed: int,
    ) -> Any:
        from . import _runtime

        # Global random state reseeded as a CPU op's call (_runtime.OpRunner._call),
        # always: work queued on a stream is not repeated.
        _runtime.reseed(np_seed, py_seed)
        kwargs = {}
        if self._seeds is not None:
            seq = self._seeds.seq(key[:2], key[2])
            kwargs["rng"] = np.random.Generator(np.random.PCG64(seq))
        try:
            return self.function(*args, **kwargs)
        except Exception as exc:
            with contextlib.suppress(AttributeError):
                exc.mpexec_op = self.name  # type: ignore[attr-defined]
                exc.mpexec_sample = sample  # type: ignore[attr-defined]
            raise

    def _split(self, out: Any) -> tuple[Any, ...]:
        n = self.num_outputs
        if n == 0:
            return ()
        if n == 1:
            return (out,)
        if not isinstance(out, (tuple, list)) or len(out) != n:
            got = f"{len(out)} outputs" if isinstance(out, (tuple, list)) else type(out).__name__
            raise OpOutputError(
                f"GPU op '{self.name}' has num_outputs={n}, so its function must return a "
                f"tuple of {n} outputs; it returned {got}"
            )
        return tuple(out)

    def _device_array(self, xp: Any, value: Any, i: int, sample: int | None) -> Any:
        if isinstance(value, xp.ndarray):
            return value
        if hasattr(value, "__dlpack__") or type(value).__name__ == "PyCapsule":
            dev = getattr(value, "__dlpack_device__", None)
            if dev is not None and dev()[0] != 2:  # kDLCUDA
                raise OpOutputError(self._not_device(value, i, sample))
            return xp.from_dlpack(value)
        raise OpOutputError(self._not_device(value, i, sample))

    def _not_device(self, value: Any, i: int, sample: int | None) -> str:
        where = "" if sample is None else f" for sample {sample}"
        return (
            f"output {i} of GPU op '{self.name}'{where} is {type(value).__name__}; a GPU op "
            "returns CuPy arrays (or DLPack producers on the device): move host data with "
            "cupy.asarray, or make the op device='cpu'"
        )

    def _batch_column(self, xp: Any, value: Any, i: int, size: int) -> list[Any]:
        if isinstance(value, (list, tuple)):
            if len(value) != size:
                raise OpOutputError(
                    f"output {i} of GPU batch op '{self.name}' holds {len(value)} samples; "
                    f"the batch has {size}"
                )
            return [self._device_array(xp, v, i, j) for j, v in enumerate(value)]
        dense = self._device_array(xp, value, i, None)
        if dense.ndim == 0 or dense.shape[0] != size:
            raise OpOutputError(
                f"output {i} of GPU batch op '{self.name}' has shape {dense.shape}; a batch "
                f"output needs its first dimension to be the batch size {size}"
            )
        return [dense[j] for j in range(size)]


# ---------------------------------------------------------------- outputs


class GpuBatch(Batch):
    """A :class:`Batch` of device (CuPy) arrays, produced on ``stream``.

    ``as_array()`` stacks on the device, on the producing stream.
    ``__dlpack__(stream=s)`` follows the DLPack stream protocol: the consumer's
    stream ``s`` waits on the producer's work (an event, not a host sync), so
    ``torch.from_dlpack(batch)`` or JAX reads it on its own stream, no copy.
    ``as_cpu()`` copies to host memory.
    """

    __slots__ = ("_stream", "_xp")

    def __init__(
        self,
        samples: Sequence[Any],
        layout: str | None,
        xp: Any,
        stream: Any,
        dense: Any | None = None,
    ) -> None:
        super().__init__(samples, layout, dense)
        self._xp = xp
        self._stream = stream

    @property
    def device(self) -> str:
        return "gpu"

    @property
    def stream(self) -> Any:
        """The stream the samples were produced on."""
        return self._stream

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            dense = self._dense[i] if self._dense is not None else None
            return GpuBatch(self._list()[i], self._layout, self._xp, self._stream, dense)
        return self._list()[i]

    def as_array(self) -> Any:
        """The samples stacked on the device (shape ``(len, *sample)``), on the op's stream."""
        if self._dense is not None:
            return self._dense
        samples = self._list()
        if not self.is_dense() or not samples:
            return super().as_array()  # raises the ragged/empty error
        with self._stream:
            self._dense = self._xp.stack(samples)
        return self._dense

    as_tensor = as_array

    def as_cpu(self) -> Batch:
        """The samples copied to host memory (synchronized on the producer's stream)."""
        with self._stream:
            host = [s.get(stream=self._stream) for s in self._list()]
        for h in host:
            h.flags.writeable = False
        return Batch(host, self._layout)

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """Export the dense batch; ``stream`` is the consumer's, per the DLPack protocol."""
        dense = self.as_array()
        with self._stream:  # CuPy treats the current stream as the producer
            return dense.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self.as_array().__dlpack_device__()


# ---------------------------------------------------------------- helpers


def _address(a: np.ndarray[Any, Any]) -> int:
    return int(a.__array_interface__["data"][0])


def _bytes_of(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _sample_view(dev: Any, offset: int, dtype: np.dtype[Any], shape: tuple[int, ...]) -> Any:
    n = math.prod(shape) * dtype.itemsize
    return dev[offset : offset + n].view(dtype).reshape(shape)


def _sample_views(dev: Any, column: list[np.ndarray[Any, Any]], offsets: list[int]) -> list[Any]:
    """Each sample's array over its bytes of ``dev``: one reshape for a column of one
    shape and dtype, then an index a sample (a slice, a view and a reshape a sample
    cost more than the copy itself for batches of small samples)."""
    if not column:
        return []
    first = column[0]
    shape, dtype = first.shape, first.dtype
    # Scalars keep a view each: indexing to one reads an element (CuPy's `a[k]` of a 1-D
    # array is a 0-d view, but the simulated device, like NumPy, reads it).
    if shape and all(a.shape == shape and a.dtype == dtype for a in column):
        whole = dev[: offsets[-1]].view(dtype).reshape((len(column), *shape))
        return [whole[k] for k in range(len(column))]
    return [_sample_view(dev, offsets[k], a.dtype, a.shape) for k, a in enumerate(column)]


def _contiguous(xp: Any, a: Any, stream: Any) -> Any:
    if a.flags.c_contiguous:
        return a
    with stream:
        return a.copy()
