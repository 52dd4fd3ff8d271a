"""The README's code: complete blocks run; sketches (with ``...``) use only real names."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mpexec
from mpexec import fn

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _is_sketch(code: str) -> bool:
    """A block with ``...`` for the reader's own code: it shows an API, it cannot run."""
    return any(
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and node.value.value is Ellipsis
        for node in ast.walk(ast.parse(code))
    )


COMPLETE = [b for b in BLOCKS if not _is_sketch(b)]
SKETCHES = [b for b in BLOCKS if _is_sketch(b)]


def test_readme_has_both_kinds() -> None:
    assert len(COMPLETE) >= 2
    assert len(SKETCHES) >= 2


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("code", COMPLETE, ids=lambda c: c.strip().splitlines()[0][:40])
def test_complete_blocks_run(code: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("code", SKETCHES, ids=lambda c: c.strip().splitlines()[0][:40])
def test_sketches_use_real_names(code: str) -> None:
    tree = ast.parse(code)
    namespaces = {"mpexec": mpexec, "fn": fn}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpexec"):
            framework = {"mpexec.ray": "ray", "mpexec.torch": "torch", "mpexec.tf": "tensorflow"}
            needs = framework.get(node.module)
            if needs and importlib.util.find_spec(needs) is None:
                continue  # an optional extra that is not installed here
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module}.{alias.name}"
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in namespaces
        ):
            assert hasattr(namespaces[node.value.id], node.attr), f"{node.value.id}.{node.attr}"
