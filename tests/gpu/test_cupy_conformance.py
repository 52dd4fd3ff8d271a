"""API conformance: every CuPy name the GPU stage and the simulator use exists in real CuPy.

Real CuPy imports without a GPU (``pip install cupy-cuda12x``), so this runs on
any machine (tox -e cupy): each name of ``_gpu.CUPY_NAMES`` must resolve in
CuPy and in the simulator, callables must take the same parameters (from
``inspect.signature``, or the signature line CuPy's Cython functions carry in
their docstrings), and properties must be properties in both. Without a CUDA
driver, defining a GPU op must give the one clear error.
"""

from __future__ import annotations

import inspect
import re
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # CuPy warns about CUDA paths it cannot find
    cupy = pytest.importorskip("cupy")

import mpexec
from mpexec import _gpu
from mpexec.testing import SimCuPy

# Names whose values are instance attributes in CuPy (set in __init__): checked on an instance.
_INSTANCE = {"cuda.Stream.ptr": lambda: cupy.cuda.Stream.null}
# Callables whose construction signature the GPU stage does not rely on.
_NO_SIGNATURE = {"ndarray"}


def _resolve(root: Any, name: str) -> Any:
    obj = root
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _params_from_signature(obj: Any) -> list[str]:
    out = []
    star = False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append("*" + p.name)
            star = True
        elif p.kind is p.KEYWORD_ONLY and not star:
            out += ["*", p.name]
            star = True
        elif p.kind is not p.VAR_KEYWORD:
            out.append(p.name)
    return [n for n in out if n != "self"]


def _params_from_docstring(obj: Any) -> list[str] | None:
    first = (obj.__doc__ or "").strip().splitlines()[:1]
    m = re.match(r"^[\w.]+\((.*?)\)", first[0]) if first else None
    if m is None:
        return None
    out = []
    for raw in filter(None, (t.strip() for t in m.group(1).split(","))):
        token = raw.split("=")[0].strip().split()[-1]  # drop the C type and the default
        out.append(token)
    return [n for n in out if n != "self"]


def _real_params(obj: Any) -> list[str] | None:
    target = obj
    try:
        return _params_from_signature(target)
    except (ValueError, TypeError):
        doc = _params_from_docstring(obj)
        if doc is None and isinstance(obj, type):
            doc = _params_from_docstring(obj.__init__)
        return doc


@pytest.fixture(scope="module")
def sim() -> SimCuPy:
    return SimCuPy(0)


@pytest.mark.parametrize("name", _gpu.CUPY_NAMES)
def test_name_exists_in_cupy_and_the_simulator_alike(name: str, sim: SimCuPy) -> None:
    if name in _INSTANCE:
        owner, attr = name.rsplit(".", 1)
        real = getattr(_INSTANCE[name](), attr)
        assert isinstance(real, int)
        assert isinstance(getattr(sim.cuda.Stream(), attr), int)
        return
    real = _resolve(cupy, name)
    fake = _resolve(sim, name)
    if isinstance(real, int):  # an enum value (memcpyHostToDevice...)
        assert fake == real, f"{name}: simulator {fake}, CuPy {real}"
        return
    real_attr = (
        inspect.getattr_static(_resolve(cupy, name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])
        if "." in name
        else real
    )
    if isinstance(real_attr, (property,)) or type(real_attr).__name__ == "getset_descriptor":
        owner = _resolve(sim, name.rsplit(".", 1)[0])
        fake_attr = inspect.getattr_static(owner, name.rsplit(".", 1)[1])
        assert isinstance(fake_attr, property), f"{name} is a property in CuPy, not here"
        return
    assert callable(real), name
    assert callable(fake), name
    if name in _NO_SIGNATURE:
        return
    if isinstance(real, type) and issubclass(real, BaseException):
        assert issubclass(fake, BaseException)
    real_params = _real_params(real)
    if real_params is None:
        pytest.fail(f"cannot introspect CuPy's {name}: add it to _NO_SIGNATURE with a reason")
    fake_params = _params_from_signature(fake)
    assert fake_params == real_params, f"{name}: simulator {fake_params}, CuPy {real_params}"


def test_exceptions_have_the_same_bases(sim: SimCuPy) -> None:
    assert issubclass(cupy.cuda.runtime.CUDARuntimeError, RuntimeError)
    assert issubclass(sim.cuda.runtime.CUDARuntimeError, RuntimeError)
    assert issubclass(cupy.cuda.memory.OutOfMemoryError, MemoryError)
    assert issubclass(sim.cuda.memory.OutOfMemoryError, MemoryError)
    assert cupy.cuda.runtime.CUDARuntimeError(35).status == 35
    assert sim.cuda.runtime.CUDARuntimeError(35).status == 35


def _has_device() -> bool:
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver
        return False


@pytest.mark.skipif(_has_device(), reason="a CUDA device is present: the no-driver path is moot")
def test_real_cupy_without_a_driver_gives_the_clear_error() -> None:
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def pipe() -> Any:
        a = fn.external_source(source=[[1, 2]])
        return fn.python_function(a, function=lambda x: x, device="gpu", name="needs_gpu")

    with pytest.raises(mpexec.GpuUnavailableError) as info:
        pipe()
    msg = str(info.value)
    assert "needs_gpu" in msg
    assert "driver" in msg or "no usable device" in msg
    assert isinstance(info.value.__cause__, cupy.cuda.runtime.CUDARuntimeError)
