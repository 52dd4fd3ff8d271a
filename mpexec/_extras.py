"""The optional extras: which framework each enables, and how to install it.

mpexec is installed from a checkout, not from a package index, so an extra is
``pip install -e ".[torch]"`` run in the checkout (``docs/install.md``). Every
``ImportError`` hint and ``python -m mpexec doctor`` take the command from
here, and a test holds the docs to the same words. Nothing here imports a
framework.
"""

from __future__ import annotations

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


#: The frameworks mpexec can use, in the order ``doctor`` lists them. DALI has
#: no extra (its wheel depends on the CUDA version): ``name`` is empty.
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
    Extra("cupy", "cupy", "CuPy", 'GPU ops (device="gpu")', "13", ("cupy", "cupy-cuda*")),
    Extra("", "nvidia.dali", "DALI", "running beside DALI", "", ("nvidia-dali*",)),
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
