"""The optional extras: which framework each enables, and how to install it.

mpexec is installed from a checkout, not from a package index, so an extra is
``pip install -e ".[torch]"`` run in the checkout (``docs/install.md``). Every
``ImportError`` hint and ``python -m mpexec doctor`` take the command from
here, and a test holds the docs to the same words. Nothing here imports a
framework.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["EXTRAS", "Extra", "extra", "install_command", "missing_message"]

#: Where the install instructions live, relative to the checkout.
INSTALL_DOC = "docs/install.md"


@dataclass(frozen=True)
class Extra:
    """One optional extra of ``pyproject.toml``."""

    #: The extra's name, as in ``pip install -e ".[torch]"``.
    name: str
    #: The framework's import name (``"tensorflow"``, ``"nvidia.dali"``).
    imports: str
    #: The framework, for a person (``"PyTorch"``).
    framework: str
    #: What the extra enables in mpexec.
    enables: str
    #: The oldest framework version the extra accepts (its ``>=`` bound); "" if none.
    minimum: str = ""
    #: Distribution names that provide the framework, or prefixes of them ending in "*".
    distributions: tuple[str, ...] = ()


#: The frameworks mpexec can use, in the order ``doctor`` lists them. DALI's
#: extra installs the CUDA 12 wheel; any ``nvidia-dali-*`` build serves mpexec.dali.
EXTRAS: tuple[Extra, ...] = (
    Extra("torch", "torch", "PyTorch", "mpexec.torch", "2.6", ("torch",)),
    Extra("jax", "jax", "JAX", "mpexec.jax", "0.4.31", ("jax",)),
    Extra(
        "tf",
        "tensorflow",
        "TensorFlow",
        "mpexec.tf",
        "2.16",
        ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tf-nightly*"),
    ),
    Extra("ray", "ray", "Ray", "mpexec.ray", "2.9", ("ray",)),
    Extra("cupy", "cupy", "CuPy", 'GPU ops, device="gpu"', "13", ("cupy", "cupy-cuda*")),
    Extra("dali", "nvidia.dali", "DALI", "mpexec.dali", "2.4", ("nvidia-dali*",)),
)


def extra(name: str) -> Extra:
    """The extra called ``name``."""
    for e in EXTRAS:
        if e.name == name:
            return e
    raise KeyError(name)


def install_command(name: str) -> str:
    """What installs extra ``name`` from a checkout of mpexec."""
    return f'pip install -e ".[{name}]"'


#: Why torch gets a warning of its own: PyPI's Linux wheel is the CUDA build.
TORCH_CPU_NOTE = (
    "an unpinned torch resolves to the CUDA build on Linux (several GB of NVIDIA "
    "libraries); for a CPU-only machine install torch from PyTorch's CPU wheel index "
    "first (the index its install page gives for 'CPU')"
)


def missing_message(name: str, exc: BaseException) -> str:
    """The ``ImportError`` text of a module whose extra ``name`` is not installed."""
    e = extra(name)
    text = (
        f"{e.enables} needs {e.framework}, which does not import here "
        f"({type(exc).__name__}: {exc}). From a checkout of mpexec: "
        f"{install_command(name)} (see {INSTALL_DOC})"
    )
    if name == "torch":
        text += f"; {TORCH_CPU_NOTE}"
    return text


@dataclass(frozen=True)
class FrameworkStatus:
    """One framework as installed here (what ``doctor`` reports), found without importing it."""

    #: The framework, for a person (``"PyTorch"``), and its import name.
    framework: str
    imports: str
    #: The extra that uses it and what that enables.
    extra: str
    enables: str
    #: The installed version and distribution (``"2.21.0"``, ``"tensorflow-cpu"``), or None.
    version: str | None
    distribution: str | None
    #: Whether what the extra enables can be used: installed, at least ``minimum``.
    usable: bool
    #: Why not, or what to run, for a person ("" when usable).
    advice: str


#: The version of a framework that imports but has no package metadata.
UNKNOWN = "unknown version"


def _version_tuple(version: str) -> tuple[int, ...]:
    """The leading numeric release of ``version``: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    parts = []
    for piece in version.split("+", 1)[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(digits) != len(piece):  # "0rc1": the release ends here
            break
    return tuple(parts)


def _installed(e: Extra, dists: Mapping[str, list[str]]) -> tuple[str | None, str | None]:
    """``(version, distribution)`` of the installed framework, or ``(None, None)``."""
    import importlib.metadata
    import importlib.util

    top = e.imports.split(".", 1)[0]
    try:
        if importlib.util.find_spec(e.imports) is None:
            return None, None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return None, None
    for dist in dists.get(top, []):
        name = _canonical(dist)
        if any(
            name == _canonical(want)
            or (want.endswith("*") and name.startswith(_canonical(want[:-1])))
            for want in e.distributions
        ):
            try:
                return importlib.metadata.version(dist), name
            except importlib.metadata.PackageNotFoundError:
                continue
    return UNKNOWN, None  # importable, but no package metadata (e.g. on PYTHONPATH)


def _canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: ``tensorflow_cpu`` is ``tensorflow-cpu``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def frameworks() -> tuple[FrameworkStatus, ...]:
    """Each framework of :data:`EXTRAS`: installed version, and whether its extra is usable.

    Reads the installed packages' metadata only: importing TensorFlow or torch
    takes seconds and may print, and a framework that fails to import says so
    itself when its mpexec module is imported.
    """
    import importlib.metadata

    dists = importlib.metadata.packages_distributions()
    out = []
    for e in EXTRAS:
        version, dist = _installed(e, dists)
        if version is None:
            usable = False
            advice = install_command(e.name)
        elif (
            e.minimum and version != UNKNOWN and _version_tuple(version) < _version_tuple(e.minimum)
        ):
            usable = False
            advice = f"{e.enables} needs {e.imports} >= {e.minimum}"
        else:
            usable, advice = True, ""
        out.append(
            FrameworkStatus(
                e.framework, e.imports, e.name, e.enables, version, dist, usable, advice
            )
        )
    return tuple(out)
