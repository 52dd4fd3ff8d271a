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


#: Each optional framework's example, and the module it cannot do without.
OPTIONAL = [
    ("torch_loader.py", "torch"),
    ("ray_basics.py", "ray"),
    ("tf_data_map.py", "tensorflow"),
]


@pytest.mark.parametrize(("name", "framework"), OPTIONAL, ids=[n for n, _ in OPTIONAL])
def test_example_skips_politely_without_its_framework(name: str, framework: str) -> None:
    """Run as a user without the extra would: a one-line skip, status 0, no traceback."""
    example = next(p for p in EXAMPLES if p.name == name)
    code = (
        "import runpy, sys\n"
        f"sys.modules[{framework!r}] = None  # import {framework} fails, as when not installed\n"
        f"runpy.run_path({str(example)!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("skipping the example: "), done.stdout
    assert 'pip install -e ".[' in done.stdout or framework == "torch", done.stdout
