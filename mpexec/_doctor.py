"""``python -m mpexec doctor``: what this machine offers mpexec.

The report is gathered once into a frozen :class:`DoctorReport` and then either
printed for a person or dumped as JSON (``--json``), so both views always carry
the same facts. Gathering never fails because an optional piece is missing:
CuPy that does not import, or a GPU that is not there, is reported, not raised.
The one fatal finding is a shared-memory setup that cannot work (for example
an invalid ``SHM_BACKEND``); the report then says why and the exit status is 1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from shm import PlatformInfo, platform_info

from ._extras import FrameworkStatus, frameworks
from ._host import cgroup_cpu_quota, default_start_method, usable_cpus
from ._version import __version__

_KiB = 1 << 10
_MiB = 1 << 20
_GiB = 1 << 30

#: Below this much ``/dev/shm``, named POSIX segments are likely to run out.
_SMALL_DEV_SHM = 1 * _GiB


@dataclass(frozen=True)
class GpuReport:
    """Whether CuPy imports and how many CUDA devices it sees."""

    #: ``cupy.__version__``, or None when CuPy does not import.
    cupy_version: str | None
    #: Why CuPy did not import (None when it did).
    cupy_error: str | None
    #: CUDA devices visible to this process (0 when none, or no CuPy).
    cuda_devices: int
    #: Device names, in device-id order.
    device_names: tuple[str, ...]
    #: Why the CUDA runtime could not be queried (None when it could).
    cuda_error: str | None
    #: CUDA driver and runtime versions (e.g. 12040), None when unknown.
    driver_version: int | None = None
    runtime_version: int | None = None
    #: Whether cudaHostRegister page-locks shared memory in place (None: not tried).
    host_register: bool | None = None
    #: Why host registration failed, when it did.
    host_register_error: str | None = None
    #: Host-to-device bandwidth in GB/s, by kind of host memory (registered shared
    #: memory, pinned, pageable); empty without a device.
    h2d_gbps: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DoctorReport:
    """Everything ``python -m mpexec doctor`` reports."""

    mpexec_version: str
    python_version: str
    python_implementation: str
    numpy_version: str
    os: str
    machine: str
    #: The multiprocessing start method mpexec uses for its workers.
    start_method: str
    #: CPUs this process may run on (its affinity mask where the OS has one).
    usable_cpus: int
    #: CPUs in the machine, as ``os.cpu_count()`` reports them.
    cpu_count: int | None
    #: CPUs' worth of time the cgroup quota allows, or None when unlimited.
    cpu_quota: float | None
    #: Shared-memory facts, or None when they could not be gathered (see shm_error).
    shm: PlatformInfo | None
    shm_error: str | None
    gpu: GpuReport
    #: Findings a person should act on, one sentence each.
    notes: tuple[str, ...]
    #: torch, JAX, TensorFlow, Ray, CuPy and DALI: installed versions, usable extras.
    frameworks: tuple[FrameworkStatus, ...] = ()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def gpu_report(*, measure: bool = False) -> GpuReport:
    """Probe CuPy and the CUDA runtime; never raises.

    ``measure=True`` (the doctor command) also tries host registration of a
    shared-memory segment and times host-to-device copies, when a device is there.
    """
    with warnings.catch_warnings():
        # CuPy warns at import about CUDA paths it cannot find; the report says it better.
        warnings.simplefilter("ignore")
        try:
            import cupy
        except Exception as exc:  # ImportError, or CUDA libraries that fail to load
            return GpuReport(None, _describe(exc), 0, (), None)
        version = str(cupy.__version__)
        runtime = _version_of(cupy.cuda.runtime, "runtimeGetVersion")
        driver = _version_of(cupy.cuda.runtime, "driverGetVersion")
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
            names = tuple(
                _device_name(cupy.cuda.runtime.getDeviceProperties(i)) for i in range(count)
            )
        except Exception as exc:  # CUDARuntimeError without a driver or a device
            return GpuReport(version, None, 0, (), _describe(exc), driver, runtime)
    report = GpuReport(version, None, count, names, None, driver, runtime)
    if measure and count:
        from ._gpu import measure_h2d, probe_host_register

        ok, error = probe_host_register(cupy)
        try:
            bandwidth = tuple(measure_h2d(cupy).items())
        except Exception as exc:  # report, never raise
            bandwidth, error = (), error or _describe(exc)
        report = dataclasses.replace(
            report, host_register=ok, host_register_error=error, h2d_gbps=bandwidth
        )
    return report


def _version_of(runtime: object, name: str) -> int | None:
    try:
        return int(getattr(runtime, name)())
    except Exception:  # no driver: the version is unknown, and the report says why
        return None


def _device_name(props: object) -> str:
    name = props.get("name", b"?") if isinstance(props, dict) else b"?"
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def _notes(
    info: PlatformInfo | None, start_method: str, cpus: int, quota: float | None
) -> tuple[str, ...]:
    notes: list[str] = []
    if start_method != "forkserver" and sys.platform.startswith("linux"):
        notes.append("forkserver is unavailable here; workers start with spawn (slower).")
    if quota is not None and quota < cpus:
        notes.append(
            f"A cgroup quota allows {quota:g} CPUs of the {cpus} usable; "
            "size worker pools by the quota."
        )
    if info is not None:
        dev_shm = info.dev_shm_bytes
        if info.backend == "posix" and dev_shm is not None and dev_shm < _SMALL_DEV_SHM:
            notes.append(
                f"/dev/shm is only {_fmt_bytes(dev_shm)} and bounds the posix backend; "
                "enlarge it (docker: --shm-size) or use memfd."
            )
        if info.free_bytes < _SMALL_DEV_SHM:
            notes.append(
                f"Only {_fmt_bytes(info.free_bytes)} is free for new shared-memory segments."
            )
    return tuple(notes)


def collect(*, measure: bool = True) -> DoctorReport:
    """Gather the report; only the shared-memory probe can record an error."""
    shm_info: PlatformInfo | None
    shm_error: str | None = None
    try:
        shm_info = platform_info()
    except (OSError, ValueError) as exc:
        shm_info, shm_error = None, _describe(exc)
    start_method = default_start_method()
    cpus = usable_cpus()
    quota = cgroup_cpu_quota()
    return DoctorReport(
        mpexec_version=__version__,
        python_version=platform.python_version(),
        python_implementation=platform.python_implementation(),
        numpy_version=np.__version__,
        os=f"{platform.system()} {platform.release()}",
        machine=platform.machine(),
        start_method=start_method,
        usable_cpus=cpus,
        cpu_count=os.cpu_count(),
        cpu_quota=quota,
        shm=shm_info,
        shm_error=shm_error,
        gpu=gpu_report(measure=measure),
        notes=_notes(shm_info, start_method, cpus, quota),
        frameworks=frameworks(),
    )


def _fmt_bytes(n: int) -> str:
    if n >= _GiB:
        return f"{n / _GiB:.1f} GiB"
    if n >= _MiB:
        return f"{n / _MiB:.1f} MiB"
    return f"{n / _KiB:.1f} KiB"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def format_report(report: DoctorReport) -> str:
    """The report as a few aligned lines for a person."""
    cpus = f"{report.usable_cpus} usable of {report.cpu_count or '?'}"
    if report.cpu_quota is not None:
        cpus += f", cgroup quota {report.cpu_quota:g}"
    lines = [
        f"mpexec {report.mpexec_version}",
        f"  python        {report.python_version} ({report.python_implementation})",
        f"  numpy         {report.numpy_version}",
        f"  os            {report.os} ({report.machine})",
        f"  start method  {report.start_method}",
        f"  cpus          {cpus}",
        "shared memory",
    ]
    info = report.shm
    if info is None:
        lines.append(f"  error         {report.shm_error}")
    else:
        dev_shm = "none" if info.dev_shm_bytes is None else _fmt_bytes(info.dev_shm_bytes)
        facilities = f"memfd: {_yes(info.memfd)}, eventfd: {_yes(info.eventfd)}"
        lines += [
            f"  backend       {info.backend} ({facilities})",
            f"  page size     {info.page_size} B, alignment {info.alignment} B",
            f"  free          {_fmt_bytes(info.free_bytes)} for new segments",
            f"  total memory  {_fmt_bytes(info.total_memory)}",
            f"  /dev/shm      {dev_shm}",
        ]
    gpu = report.gpu
    lines.append("gpu")
    if gpu.cupy_version is None:
        lines.append(f"  cupy          not importable ({gpu.cupy_error})")
    else:
        lines.append(f"  cupy          {gpu.cupy_version}")
    if gpu.cupy_version is not None:
        lines.append(
            f"  cuda          driver {_cuda_version(gpu.driver_version)}, "
            f"runtime {_cuda_version(gpu.runtime_version)}"
        )
    if gpu.cuda_error is not None:
        lines.append(f"  cuda devices  none ({gpu.cuda_error})")
    elif gpu.cuda_devices:
        lines.append(f"  cuda devices  {gpu.cuda_devices}: {', '.join(gpu.device_names)}")
    else:
        lines.append("  cuda devices  none")
    if gpu.host_register is not None:
        how = "yes" if gpu.host_register else f"no ({gpu.host_register_error}); copies are staged"
        lines.append(f"  host register {how}")
    if gpu.h2d_gbps:
        rates = ", ".join(f"{kind} {gbps:.1f}" for kind, gbps in gpu.h2d_gbps)
        lines.append(f"  H2D GB/s      {rates}")
    lines += format_frameworks(report.frameworks)
    if report.notes:
        lines.append("notes")
        lines += [f"  - {note}" for note in report.notes]
    return "\n".join(lines)


def format_frameworks(found: tuple[FrameworkStatus, ...]) -> list[str]:
    """The ``frameworks`` section: each one's version, and whether its extra is usable."""
    rows = []
    for f in found:
        label = "DALI" if f.imports == "nvidia.dali" else f.imports
        if f.version is None:
            version = "not installed"
        else:
            version = (
                f.version
                if f.distribution in (None, f.imports)
                else (f"{f.version} ({f.distribution})")
            )
        if f.usable:
            use = f"extra {f.extra} usable ({f.enables})"
        else:
            use = f"extra {f.extra} not usable: {f.advice} (for {f.enables})"
        rows.append((label, version, use))
    width = max((len(v) for _, v, _ in rows), default=0)
    lines = ["frameworks"] if rows else []
    lines += [f"  {label:<13} {version:<{width}}  {use}" for label, version, use in rows]
    return lines


def _cuda_version(v: int | None) -> str:
    if v is None:
        return "unknown"
    return "none" if v == 0 else f"{v // 1000}.{v % 1000 // 10}"


def run_doctor(*, as_json: bool = False) -> int:
    """Print the report; return 0, or 1 when shared memory cannot work here."""
    report = collect()
    if as_json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(format_report(report))
    return 0 if report.shm_error is None else 1
