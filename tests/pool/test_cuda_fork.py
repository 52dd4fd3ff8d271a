"""Fork after CUDA: mpexec asks CUDA's driver, never loading or initialising it."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest

from mpexec import WorkerPool, _host
from mpexec._pool import _factory


class _Driver:
    """A stand-in for libcuda: ``cuDeviceGetCount`` answers ``status``."""

    def __init__(self, status: int) -> None:
        self.status = status

    def cuDeviceGetCount(self, count: Any) -> int:
        return self.status


def _loaded(status: int | None, modes: list[int]) -> Any:
    def cdll(name: str, mode: int = 0) -> _Driver:
        assert name == "libcuda.so.1"
        modes.append(mode)
        if status is None:
            raise OSError(f"{name}: cannot open shared object file")  # not loaded here
        return _Driver(status)

    return cdll


@pytest.mark.parametrize(
    ("status", "initialised"),
    [(None, False), (3, False), (0, True)],  # not loaded; CUDA_ERROR_NOT_INITIALIZED; ok
)
def test_cuda_counts_as_initialised_once_some_library_ran_cuinit(
    monkeypatch: pytest.MonkeyPatch, status: int | None, initialised: bool
) -> None:
    modes: list[int] = []
    monkeypatch.setattr(ctypes, "CDLL", _loaded(status, modes))
    assert _host.cuda_initialised() is initialised
    # Only a driver some library already loaded is asked: dlopen never loads it.
    assert modes == [os.RTLD_NOLOAD | os.RTLD_LAZY]


@pytest.mark.usefixtures("no_leaks")
def test_fork_is_refused_after_cuda_with_a_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_factory, "cuda_initialised", lambda: True)
    with pytest.raises(ValueError, match=r"after CUDA was initialised.*'forkserver' or 'spawn'"):
        WorkerPool(1, start_method="fork")
    with WorkerPool(1, start_method="forkserver") as pool:  # the way out works
        assert pool.submit(abs, -3).result(60) == 3
