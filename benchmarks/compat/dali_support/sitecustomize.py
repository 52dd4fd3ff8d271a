"""Loaded at start-up by every Python process of a compat run (it is first on PYTHONPATH).

``MPEXEC_COMPAT_ALIAS="nvidia.dali=mpexec"`` makes ``nvidia.dali`` and each
``nvidia.dali.X`` the module ``mpexec`` / ``mpexec.X``: the same module
objects, under both names, imported on first use. Nothing else changes.
NumPy 2 removed ``numpy.float_``, which DALI's test file names at import:
it is restored as ``numpy.float64`` in both runs, so the file imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any


class _AliasLoader(importlib.abc.Loader):
    """Hands the import system a module that is already loaded under another name."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module

    def create_module(self, spec: Any) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``source`` and ``source.X`` import as ``target`` and ``target.X``."""

    def __init__(self, source: str, target: str) -> None:
        self.source = source
        self.target = target

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == self.source.partition(".")[0] and "." in self.source:
            # The alias's parent package (``nvidia``): the real one where installed.
            if importlib.machinery.PathFinder.find_spec(fullname, path) is None:
                empty = types.ModuleType(fullname)
                empty.__path__ = []
                return importlib.util.spec_from_loader(
                    fullname, _AliasLoader(empty), is_package=True
                )
            return None
        if fullname != self.source and not fullname.startswith(self.source + "."):
            return None
        module = importlib.import_module(self.target + fullname[len(self.source) :])
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(module), is_package=hasattr(module, "__path__")
        )


def _install() -> None:
    alias = os.environ.get("MPEXEC_COMPAT_ALIAS")
    if alias:
        source, _, target = alias.partition("=")
        sys.meta_path.insert(0, _AliasFinder(source, target))
    import numpy

    if not hasattr(numpy, "float_"):
        numpy.float_ = numpy.float64  # type: ignore[attr-defined]


_install()
