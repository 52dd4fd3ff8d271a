"""Fork after CUDA: mpexec asks CUDA's driver for contexts, never loading or initialising it."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest

from mpexec import WorkerPool, _host
from mpexec._pool import _factory


class _Driver:
    """A stand-in for libcuda: ``cuInit`` run or not, and which contexts exist."""

    def __init__(self, initialised: bool, primary: list[bool], current: bool) -> None:
        self.initialised, self.primary, self.current = initialised, primary, current

    def cuDeviceGetCount(self, count: Any) -> int:
        if not self.initialised:
            return 3  # CUDA_ERROR_NOT_INITIALIZED
        count._obj.value = len(self.primary)
        return 0

    def cuDeviceGet(self, device: Any, ordinal: int) -> int:
        device._obj.value = 100 + ordinal  # a handle, not the ordinal
        return 0

    def cuDevicePrimaryCtxGetState(self, device: Any, flags: Any, active: Any) -> int:
        active._obj.value = int(self.primary[device.value - 100])
        return 0

    def cuCtxGetCurrent(self, context: Any) -> int:
        context._obj.value = 0x1000 if self.current else None
        return 0


def _loaded(driver: _Driver | None, modes: list[int]) -> Any:
    def cdll(name: str, mode: int = 0) -> _Driver:
        assert name == "libcuda.so.1"
        modes.append(mode)
        if driver is None:
            raise OSError(f"{name}: cannot open shared object file")  # not loaded here
        return driver

    return cdll


@pytest.mark.parametrize(
    ("driver", "holds_a_context"),
    [
        (None, False),  # no library loaded the driver (import cupy / import torch)
        (_Driver(False, [], False), False),  # loaded, cuInit not run
        (_Driver(True, [False, False], False), False),  # cuInit only: is_available()
        (_Driver(True, [False, True], False), True),  # a device's primary context in use
        (_Driver(True, [False], True), True),  # a context of its own, current here
    ],
)
def test_fork_counts_as_unsafe_once_this_process_holds_a_cuda_context(
    monkeypatch: pytest.MonkeyPatch, driver: _Driver | None, holds_a_context: bool
) -> None:
    modes: list[int] = []
    monkeypatch.setattr(ctypes, "CDLL", _loaded(driver, modes))
    assert _host.cuda_initialised() is holds_a_context
    # Only a driver some library already loaded is asked: dlopen never loads it.
    assert modes == [os.RTLD_NOLOAD | os.RTLD_LAZY]


@pytest.mark.usefixtures("no_leaks")
def test_fork_is_refused_after_cuda_with_a_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_factory, "cuda_initialised", lambda: True)
    with pytest.raises(ValueError, match=r"after CUDA was initialised.*'forkserver' or 'spawn'"):
        WorkerPool(1, start_method="fork")
    with WorkerPool(1, start_method="forkserver") as pool:  # the way out works
        assert pool.submit(abs, -3).result(60) == 3


def test_a_fork_start_looks_up_the_workers_malloc_controls_first() -> None:
    """A forked worker's first ``dlopen``/``dlsym`` could wait for good on the loader's
    lock, held at the fork by a thread of this process (TensorFlow's, JAX's): what its
    malloc settings call is looked up here, and inherited."""
    if not _host.glibc_malloc():
        pytest.skip("malloc here is not glibc's: a worker sets nothing")
    _host._mallinfo.cache_clear()
    for name in ("mallopt", "malloc_trim"):
        vars(_host._libc()).pop(name, None)  # as in a process that never looked them up
    _factory.context("fork")
    found = vars(_host._libc())
    assert "mallopt" in found
    assert "malloc_trim" in found
    assert _host._mallinfo.cache_info().currsize == 1
