"""The documentation's examples run, and clean up after themselves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "docs" / "examples").glob("*.py"))
#: Examples of an optional extra, by file-name prefix: they run where it is installed.
EXTRAS = {"ray_": "ray"}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(example: Path, no_leaks: None) -> None:
    for prefix, module in EXTRAS.items():
        if example.name.startswith(prefix):
            pytest.importorskip(module)
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
