"""A simulated CUDA device: a NumPy stand-in for the CuPy subset mpexec's GPU stage uses.

It exists so that the GPU stage's ordering and lifetime rules are tested on
machines without a GPU. It is strict where a real device is merely
nondeterministic:

- Each stream is a queue of deferred work (copies, event records, waits on
  other streams' events). Work runs only when something waits for it
  (``Event.synchronize``, ``Stream.synchronize``, a stream waiting on an event
  whose stream then runs, a kernel launched on the stream), plus, at every call
  into the simulator, a step of a seeded random stream: streams progress in a
  random but reproducible interleaving.
- Kernels (the NumPy code behind :class:`ndarray` operators and methods) run
  eagerly, after everything already queued on the current stream. A kernel on a
  stream that did not wait for a copy reads the device memory as it is: fresh
  allocations hold garbage (``0xA5`` bytes), so a missing wait shows up as
  wrong numbers.
- A copy from pinned or registered host memory reads its source when it runs,
  not when it is queued. If those bytes changed (a staging buffer reused, an
  arena block released and rewritten), or the pinned buffer was freed or the
  range unregistered before the copy ran, the destination gets garbage and the
  simulator records a :attr:`SimCuPy.violations` entry.
- A device-to-host copy into pinned memory lands only when it runs: reading the
  host buffer before its event completed reads garbage (pinned allocations
  start as ``0xA5`` bytes too).

``SimCuPy(seed)`` is a module-like object: ``sim.cuda.Stream``,
``sim.cuda.runtime.memcpyAsync``, ``sim.empty``... exactly the names the GPU
stage uses (``_gpu.CUPY_NAMES``); the API-conformance tests check each against
real CuPy. It is single-device and serves tests; it is no emulator.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import hashlib
import random
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

from .._runtime import np_from_dlpack

GARBAGE = 0xA5
_PAGE = 4096

# CUDA runtime status codes the simulator raises (the same numbers as CUDA's).
INSUFFICIENT_DRIVER = 35
NO_DEVICE = 100
INVALID_VALUE = 1
HOST_ALREADY_REGISTERED = 712
HOST_NOT_REGISTERED = 713
NOT_SUPPORTED = 801


class CUDARuntimeError(RuntimeError):
    """The simulator's ``cupy.cuda.runtime.CUDARuntimeError`` (same constructor)."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"simulated CUDA error {status}")


class OutOfMemoryError(MemoryError):
    """The simulator's ``cupy.cuda.memory.OutOfMemoryError`` (same constructor)."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: {total:,})")
        self.size, self.total, self.limit = size, total, limit


class _Item:
    """One unit of queued stream work."""

    __slots__ = ("event", "kind", "run")

    def __init__(self, kind: str, run: Callable[[], None] | None, event: Event | None) -> None:
        self.kind = kind  # "copy", "record" or "wait"
        self.run = run
        self.event = event


class Stream:
    """A CUDA stream: an in-order queue of deferred work."""

    _bound: SimCuPy

    _next_ptr = 0x5000

    def __init__(
        self,
        null: bool = False,
        non_blocking: bool = False,
        ptds: bool = False,
        priority: int | None = None,
    ) -> None:
        del ptds, priority
        self._sim = self._bound
        self.null = null
        self.non_blocking = non_blocking
        Stream._next_ptr += 0x10
        self._ptr = 0 if null else Stream._next_ptr
        self._queue: deque[_Item] = deque()
        self._sim._streams[self._ptr] = self

    @property
    def ptr(self) -> int:
        """The ``cudaStream_t`` as an integer (0 for the legacy default stream)."""
        return self._ptr

    # -------------------------------------------------------------- queueing
    def _enqueue(self, item: _Item) -> None:
        with self._sim._lock:
            self._queue.append(item)
            self._sim._step()

    def _run_one(self) -> None:
        with self._sim._lock:
            self._run_one_locked()

    def _run_one_locked(self) -> None:
        item = self._queue.popleft()
        if item.kind == "wait":
            assert item.event is not None
            item.event._complete_now()
        elif item.kind == "record":
            assert item.event is not None
            item.event._done = True
        elif item.run is not None:
            item.run()

    def _drain(self) -> None:
        with self._sim._lock:  # the GPU thread and a D2H caller may drain at once
            while self._queue:
                self._run_one_locked()

    # -------------------------------------------------------------- API
    def record(self, event: Event | None = None) -> Event:
        event = self._sim.cuda.Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        self._sim.waits.append((self, event._stream))
        if event._stream is None or event._done:
            return
        self._enqueue(_Item("wait", None, event))

    def synchronize(self) -> None:
        self._drain()

    @property
    def done(self) -> bool:
        self._sim._step()
        return not self._queue

    def use(self) -> Stream:
        self._sim._local_stack()[:] = [self]
        return self

    def __enter__(self) -> Stream:
        self._sim._local_stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._sim._local_stack().pop()

    def __repr__(self) -> str:
        return f"<sim Stream {self.ptr:#x} ({len(self._queue)} queued)>"


class ExternalStream(Stream):
    """A stream known by pointer (a consumer's stream, in DLPack's protocol)."""

    def __init__(self, ptr: int, device_id: int = -1) -> None:
        del device_id
        sim = self._bound
        known = sim._streams.get(ptr)
        super().__init__(null=ptr == 0)
        if known is not None:  # the same underlying stream: share its queue
            self._queue = known._queue
        self._ptr = ptr
        sim._streams.setdefault(ptr, self)


class Event:
    """A CUDA event: completes when its stream reaches the point it was recorded at."""

    _bound: SimCuPy

    def __init__(
        self, block: bool = False, disable_timing: bool = False, interprocess: bool = False
    ) -> None:
        del block, disable_timing, interprocess
        self._sim = self._bound
        self._stream: Stream | None = None
        self._done = True  # an unrecorded event counts as complete, as in CUDA

    def record(self, stream: Stream | None = None) -> None:
        stream = self._sim.cuda.get_current_stream() if stream is None else stream
        self._stream = stream
        self._done = False
        stream._enqueue(_Item("record", None, self))

    def _complete_now(self) -> None:
        with self._sim._lock:
            while not self._done:
                assert self._stream is not None
                self._stream._run_one_locked()

    def synchronize(self) -> None:
        self._complete_now()

    @property
    def done(self) -> bool:
        self._sim._step()
        return self._done


class Device:
    """A CUDA device; a context manager that makes it current."""

    _bound: SimCuPy

    def __init__(self, device: int | None = None) -> None:
        self._sim = self._bound
        self.id = 0 if device is None else int(device)
        if not 0 <= self.id < self._sim._count():
            raise CUDARuntimeError(INVALID_VALUE)

    def use(self) -> None:
        pass

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


# ---------------------------------------------------------------- memory


class _DeviceMemory:
    __slots__ = ("__weakref__", "buf", "ptr")

    def __init__(self, buf: np.ndarray[Any, Any], ptr: int) -> None:
        self.buf = buf
        self.ptr = ptr


class MemoryPointer:
    """``ndarray.data``: where an array's bytes start on the device."""

    __slots__ = ("mem", "ptr")

    def __init__(self, mem: _DeviceMemory, offset: int) -> None:
        self.mem = mem
        self.ptr = mem.ptr + offset


class _PinnedMem:
    """Page-locked host memory from ``alloc_pinned_memory``; freed when unreferenced."""

    __slots__ = ("__weakref__", "_buf", "ptr", "size")

    def __init__(self, buf: np.ndarray[Any, Any]) -> None:
        self._buf = buf
        self.ptr = int(buf.ctypes.data)
        self.size = int(buf.nbytes)


class _Runtime:
    """``cupy.cuda.runtime``: the functions used, on the simulator."""

    memcpyHostToDevice = 1
    memcpyDeviceToHost = 2
    CUDARuntimeError = CUDARuntimeError

    def __init__(self, sim: SimCuPy) -> None:
        self._sim = sim

    def getDeviceCount(self) -> int:
        return self._sim._count()

    def driverGetVersion(self) -> int:
        if not self._sim.driver:
            return 0  # as CUDA: no driver installed
        return 12040

    def runtimeGetVersion(self) -> int:
        return 12040

    def getDeviceProperties(self, device: int) -> dict[str, Any]:
        self._sim._count()
        return {"name": b"mpexec simulated device", "totalGlobalMem": self._sim.capacity}

    def hostRegister(self, ptr: int, size: int, flags: int) -> None:
        del flags
        sim = self._sim
        sim._count()
        if sim.register_fails:
            raise CUDARuntimeError(NOT_SUPPORTED)
        if any(p < ptr + size and ptr < p + n for p, n in sim.registered.items()):
            raise CUDARuntimeError(HOST_ALREADY_REGISTERED)
        sim.registered[ptr] = size

    def hostUnregister(self, ptr: int) -> None:
        sim = self._sim
        size = sim.registered.pop(ptr, None)
        if size is None:
            raise CUDARuntimeError(HOST_NOT_REGISTERED)
        sim._host_gone(ptr, size, "unregistered")

    def memcpyAsync(self, dst: int, src: int, size: int, kind: int, stream: int) -> None:
        self._sim._memcpy(dst, src, size, kind, stream)


class _Memory:
    OutOfMemoryError = OutOfMemoryError


class _Cuda:
    """``cupy.cuda`` on the simulator."""

    PinnedMemoryPointer = _PinnedMem

    def __init__(self, sim: SimCuPy) -> None:
        self._sim = sim
        self.Stream = _bind(Stream, sim)
        self.ExternalStream = _bind(ExternalStream, sim)
        self.Event = _bind(Event, sim)
        self.Device = _bind(Device, sim)
        self.runtime = _Runtime(sim)
        self.memory = _Memory()

    def get_current_stream(self, device_id: int = -1) -> Stream:
        del device_id
        stack = self._sim._local_stack()
        return stack[-1] if stack else self._sim._null

    def alloc_pinned_memory(self, size: int) -> _PinnedMem:
        sim = self._sim
        sim._count()
        buf = np.full(max(int(size), 1), GARBAGE, np.uint8)
        mem = _PinnedMem(buf)
        sim._pinned[mem.ptr] = (mem.size, buf)
        sim.pinned_live += 1
        weakref.finalize(mem, sim._pinned_freed, mem.ptr, mem.size)
        return mem


# ---------------------------------------------------------------- arrays


class ndarray(NDArrayOperatorsMixin):
    """A device array: NumPy storage that only kernels (operators, methods) read."""

    _bound: SimCuPy

    __array_priority__ = 100

    def __init__(self, view: np.ndarray[Any, Any], mem: _DeviceMemory) -> None:
        self._view = view
        self._mem = mem

    # -------------------------------------------------------------- facts
    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    ndim = property(lambda self: self._view.ndim)
    size = property(lambda self: self._view.size)
    nbytes = property(lambda self: self._view.nbytes)
    strides = property(lambda self: self._view.strides)
    flags = property(lambda self: self._view.flags)

    @property
    def data(self) -> MemoryPointer:
        offset = int(self._view.ctypes.data) - int(self._mem.buf.ctypes.data)
        return MemoryPointer(self._mem, offset)

    def __len__(self) -> int:
        return len(self._view)

    def __repr__(self) -> str:
        return f"<sim ndarray shape={self.shape} dtype={self.dtype}>"

    # -------------------------------------------------------------- kernels
    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        sim = self._mem_sim()
        sim._kernel()
        args = [_unwrap(x) for x in inputs]
        out = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(sim, out)

    def __getitem__(self, key: Any) -> Any:
        v = self._view[key]
        if isinstance(v, np.ndarray):
            return type(self)(v, self._mem)  # a view: no kernel runs
        self._bound._kernel()
        return _wrap(self._bound, v)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mem_sim()._kernel()
        self._view[key] = _unwrap(value)

    def _reduce(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._mem_sim()._kernel()
        return _wrap(self._mem_sim(), getattr(self._view, name)(*args, **kwargs))

    def sum(self, *args: Any, **kwargs: Any) -> Any:
        return self._reduce("sum", *args, **kwargs)

    def astype(self, *args: Any, **kwargs: Any) -> Any:
        return self._reduce("astype", *args, **kwargs)

    def reshape(self, *shape: Any, order: str = "C", copy: bool | None = None) -> Any:
        del copy
        v = self._view.reshape(*shape, order=order)  # type: ignore[call-overload]
        if np.shares_memory(v, self._view):
            return type(self)(v, self._mem)
        self._bound._kernel()
        return _wrap(self._bound, v)

    def view(self, dtype: Any = None, type: Any = None) -> Any:  # CuPy's parameter names
        v = self._view.view(dtype) if dtype is not None else self._view
        return self.__class__(v, self._mem)

    def copy(self, order: str = "C") -> Any:
        return self._reduce("copy", order)

    @property
    def T(self) -> Any:
        return type(self)(self._view.T, self._mem)

    # -------------------------------------------------------------- transfer
    def get(
        self, stream: Stream | None = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> np.ndarray[Any, Any]:
        del blocking
        sim = self._mem_sim()
        (stream or sim.cuda.get_current_stream())._drain()
        host: np.ndarray[Any, Any] = np.array(self._view, order=order)  # type: ignore[call-overload]
        if out is not None:
            out[...] = host
            return out  # type: ignore[no-any-return]
        return host

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: Any = None,
        copy: bool | None = None,
    ) -> Any:
        """The DLPack stream protocol: the consumer's stream waits on this producer's.

        The producer is the current stream (as in CuPy). The simulator's
        capsule is a host capsule of the bytes as they are now: the consumer
        must synchronize its stream before reading them.
        """
        del max_version, dl_device, copy
        sim = self._mem_sim()
        sim.dlpack_streams.append(stream)
        if stream is not None and stream != -1:
            current = sim.cuda.get_current_stream()
            consumer = sim._streams.get(0 if stream in (1, 2) else stream)
            if consumer is None:
                raise ValueError(f"unknown stream {stream!r}")
            if consumer is not current:
                consumer.wait_event(current.record())
        return np.asarray(_Keep(self._view, self._mem)).__dlpack__()

    # -------------------------------------------------------------- internals
    @property
    def _sim(self) -> SimCuPy:
        return self._mem_sim()

    def _mem_sim(self) -> SimCuPy:
        return self._bound


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x._view
    if isinstance(x, np.ndarray) and x.ndim > 0:
        raise TypeError(f"Unsupported type {type(x)}")  # as CuPy: no implicit host arrays
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _wrap(sim: SimCuPy, x: Any) -> Any:
    if isinstance(x, tuple):
        return tuple(_wrap(sim, v) for v in x)
    if not isinstance(x, (np.ndarray, np.generic)):
        return x
    arr = np.asarray(x)
    out = sim.empty(arr.shape, arr.dtype)
    out._view[...] = arr
    return out


# ---------------------------------------------------------------- the module


class SimCuPy:
    """One simulated device, seeded; a module-like object (``sim.cuda.Stream``...)."""

    def __init__(
        self,
        seed: int = 0,
        *,
        devices: int = 1,
        driver: bool = True,
        register_fails: bool = False,
        capacity: int = 1 << 30,
        progress: float = 0.5,
    ) -> None:
        self.__version__ = "sim"
        self.devices = devices
        self.driver = driver
        self.register_fails = register_fails
        self.capacity = capacity
        self.rng = random.Random(seed)
        self._lock = threading.RLock()  # the queues: a GPU thread and a D2H caller share them
        self.progress = progress  # chance that a call lets a random stream run one item
        self.violations: list[str] = []
        self.registered: dict[int, int] = {}
        self.dlpack_streams: list[int | None] = []
        self.waits: list[tuple[Stream, Stream | None]] = []  # (waiting stream, event's stream)
        self.pinned_live = 0
        self.device_bytes = 0
        self._pinned: dict[int, tuple[int, np.ndarray[Any, Any]]] = {}
        self._device: list[tuple[int, weakref.ref[_DeviceMemory]]] = []
        self._next_device_ptr = 0x7000_0000_0000
        self._device_lock = threading.Lock()
        self._pending_reads: list[tuple[int, int, str]] = []  # host ranges queued copies read
        self._tls = threading.local()
        self._streams: dict[int, Stream] = {}
        self._gone: list[tuple[int, int, str]] = []  # host ranges freed under queued copies
        self._graveyard: list[np.ndarray[Any, Any]] = []
        self.ndarray = _bind(ndarray, self)
        self.cuda = _Cuda(self)
        self._null = self.cuda.Stream(null=True)

    # ------------------------------------------------------------ module API
    def empty(self, shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
        self._count()
        dt = np.dtype(dtype)
        shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        if self.device_bytes + nbytes > self.capacity:
            raise OutOfMemoryError(nbytes, self.device_bytes)
        buf = np.full(max(nbytes, 1), GARBAGE, np.uint8)
        with self._device_lock:
            self._next_device_ptr += (max(nbytes, 1) + 511) // 512 * 512
            mem = _DeviceMemory(buf, self._next_device_ptr)
            # The list is replaced, never changed in place (_device_at reads it unlocked),
            # and only here: a free's finalizer that rebuilt it could drop an entry
            # appended meanwhile by another thread (a copy then found no memory there).
            live = [(p, r) for p, r in self._device if r() is not None]
            self._device = [*live, (mem.ptr, weakref.ref(mem))]
            self.device_bytes += nbytes
        weakref.finalize(mem, self._device_freed, nbytes)
        view = buf[:nbytes].view(dt).reshape(shape_t, order=order)
        arr: ndarray = self.ndarray(view, mem)
        return arr

    def stack(
        self,
        tup: Any,
        axis: int = 0,
        out: Any = None,
        *,
        dtype: Any = None,
        casting: str = "same_kind",
    ) -> ndarray:
        self._kernel()
        arrays = [_unwrap(a) for a in tup]
        if dtype is None and casting == "same_kind":
            res = np.stack(arrays, axis=axis)  # NumPy < 1.24 takes no dtype/casting
        else:
            res = np.stack(arrays, axis=axis, dtype=dtype, casting=casting)  # type: ignore[call-overload]
        if out is not None:
            out._view[...] = res
            return out  # type: ignore[no-any-return]
        return _wrap(self, res)  # type: ignore[no-any-return]

    def from_dlpack(self, array: Any, *, device: Any = None, copy: bool | None = None) -> Any:
        """A device array over a DLPack producer's (or capsule's) device memory, no copy."""
        del device, copy
        if isinstance(array, self.ndarray):
            return array
        capsule = array.__dlpack__() if hasattr(array, "__dlpack__") else array
        host = np_from_dlpack(_Capsule(capsule))
        address = int(host.__array_interface__["data"][0])
        for _, ref in self._device:
            mem = ref()
            if (
                mem is not None
                and mem.buf.ctypes.data <= address < mem.buf.ctypes.data + mem.buf.nbytes
            ):
                return self.ndarray(host, mem)
        raise TypeError("not a device array of this simulated device")

    def asarray(
        self, a: Any, dtype: Any = None, order: Any = None, *, blocking: bool = False
    ) -> Any:
        """Host to device, synchronously (pageable memory), on the current stream."""
        del blocking
        if isinstance(a, ndarray):
            return a if dtype is None else a.astype(dtype)
        self._kernel()
        return _wrap(self, np.asarray(a, dtype=dtype, order=order))

    def asnumpy(
        self,
        a: Any,
        stream: Stream | None = None,
        order: str = "C",
        out: Any = None,
        *,
        blocking: bool = True,
    ) -> np.ndarray[Any, Any]:
        if isinstance(a, ndarray):
            return a.get(stream, order, out, blocking)
        return np.asarray(a, order=order)  # type: ignore[call-overload, no-any-return]

    # ------------------------------------------------------------ internals
    def _count(self) -> int:
        if not self.driver:
            raise CUDARuntimeError(INSUFFICIENT_DRIVER)
        if not self.devices:
            raise CUDARuntimeError(NO_DEVICE)
        return self.devices

    def _local_stack(self) -> list[Stream]:
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        return stack

    def _step(self) -> None:
        """Let one random stream run one queued item (the device progressing on its own)."""
        with self._lock:
            self._step_locked()

    def _step_locked(self) -> None:
        if self.rng.random() >= self.progress:
            return
        busy = [s for s in self._streams.values() if s._queue]
        if not busy:
            return
        s = busy[self.rng.randrange(len(busy))]
        head = s._queue[0]
        if head.kind == "wait" and head.event is not None and not head.event._done:
            return  # a stream blocked on another makes no progress by itself
        s._run_one_locked()

    def _kernel(self) -> None:
        """A kernel runs after everything queued on the current stream."""
        self._step()
        self.cuda.get_current_stream()._drain()

    def _device_at(self, ptr: int, size: int) -> np.ndarray[Any, Any]:
        # Read once: a free in another thread (a finalizer) replaces the list meanwhile.
        entries = self._device
        ptrs = [p for p, _ in entries]
        i = bisect.bisect_right(ptrs, ptr) - 1
        mem = entries[i][1]() if i >= 0 else None
        if mem is None or not mem.ptr <= ptr <= ptr + size <= mem.ptr + mem.buf.nbytes:
            raise CUDARuntimeError(INVALID_VALUE)
        return mem.buf[ptr - mem.ptr : ptr - mem.ptr + size]

    def _host_kind(self, ptr: int, size: int) -> str:
        for base, (n, _) in self._pinned.items():
            if base <= ptr and ptr + size <= base + n:
                return "pinned"
        for base, n in self.registered.items():
            if base <= ptr and ptr + size <= base + n:
                return "registered"
        return "pageable"

    def _memcpy(self, dst: int, src: int, size: int, kind: int, stream_ptr: int) -> None:
        self._count()
        stream = self._streams.get(stream_ptr)
        if stream is None:
            raise CUDARuntimeError(INVALID_VALUE)
        if kind == _Runtime.memcpyHostToDevice:
            self._h2d(dst, src, size, stream)
        elif kind == _Runtime.memcpyDeviceToHost:
            self._d2h(dst, src, size, stream)
        else:
            raise CUDARuntimeError(INVALID_VALUE)

    def _h2d(self, dst: int, src: int, size: int, stream: Stream) -> None:
        target = self._device_at(dst, size)
        where = self._host_kind(src, size)
        if where == "pageable":
            # CUDA stages pageable memory before returning: the bytes are taken now.
            data = bytes(ctypes.string_at(src, size))
            stream._enqueue(_Item("copy", lambda: target.__setitem__(slice(None), _b(data)), None))
            return
        digest = _digest(src, size)
        entry = (src, size, "")
        self._pending_reads.append(entry)

        def run() -> None:
            self._pending_reads.remove(entry)
            gone = next((why for p, n, why in self._gone if p <= src < p + n), None)
            if gone is not None or _digest(src, size) != digest:
                what = gone or "changed"
                self.violations.append(
                    f"host memory {src:#x}+{size} was {what} before the copy reading it ran"
                )
                target[:] = GARBAGE
                return
            target[:] = _b(ctypes.string_at(src, size))

        stream._enqueue(_Item("copy", run, None))

    def _d2h(self, dst: int, src: int, size: int, stream: Stream) -> None:
        source = self._device_at(src, size)
        where = self._host_kind(dst, size)
        holder = (ctypes.c_char * size).from_address(dst)

        def run() -> None:
            ctypes.memmove(holder, source.ctypes.data, size)

        stream._enqueue(_Item("copy", run, None))
        if where == "pageable":
            stream._drain()  # CUDA completes a copy into pageable memory before returning

    def _host_gone(self, ptr: int, size: int, why: str) -> None:
        if any(p < ptr + size and ptr < p + n for p, n, _ in self._pending_reads):
            self._gone.append((ptr, size, why))

    def _pinned_freed(self, ptr: int, size: int) -> None:
        self.pinned_live -= 1
        entry = self._pinned.pop(ptr, None)
        self._host_gone(ptr, size, "freed")
        if entry is not None and self._gone:
            # Keep the bytes mapped so that a late copy reads safely (and finds them gone).
            self._graveyard.append(entry[1])

    def _device_freed(self, nbytes: int) -> None:
        # A finalizer takes no lock (it may run inside empty(), on the thread holding it);
        # its entry in _device is pruned by the next allocation.
        self.device_bytes -= nbytes

    def pending(self) -> int:
        """Queued items over all streams (0 once everything ran)."""
        return sum(len(s._queue) for s in self._streams.values())

    def streams(self) -> Iterator[Stream]:
        return iter(list(self._streams.values()))


def _digest(ptr: int, size: int) -> bytes:
    return hashlib.blake2b(ctypes.string_at(ptr, size), digest_size=16).digest()


def _b(data: bytes) -> np.ndarray[Any, Any]:
    return np.frombuffer(data, np.uint8)


def _bind(cls: type[Any], sim: SimCuPy) -> type[Any]:
    """``cls`` for one simulator: its instances find their device through ``_bound``."""
    return type(cls.__name__, (cls,), {"_bound": sim, "__module__": __name__})


class _Capsule:
    """Hands a raw DLPack capsule to ``np.from_dlpack`` (which wants a producer)."""

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class _Keep:
    """A view's bytes for NumPy, keeping their device allocation alive (a capsule's owner)."""

    def __init__(self, view: np.ndarray[Any, Any], mem: _DeviceMemory) -> None:
        self.__array_interface__ = dict(view.__array_interface__)
        self.view = view
        self.mem = mem


#: The (seed, progress) pairs the GPU tests run under: one whose streams never
#: progress unasked, and two that run deferred work at random moments.
SEEDS = [(0, 0.0), (1, 0.3), (2, 0.9)]


@contextlib.contextmanager
def simulated(seed: int, progress: float) -> Iterator[SimCuPy]:
    """GPU ops run on a fresh simulated device here; it must record no violation."""
    from .. import _gpu

    device = SimCuPy(seed, progress=progress)
    with _gpu.use_backend(device):
        yield device
    assert device.violations == [], device.violations
