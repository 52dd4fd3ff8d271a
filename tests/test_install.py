"""Install instructions that work: docs and ImportError hints say what installs mpexec.

mpexec is not on a package index, so ``pip install mpexec[x]`` cannot work; every
instruction must be the checkout's ``pip install -e ".[x]"`` with an extra that
``pyproject.toml`` defines, and every hint must agree with docs/install.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpexec import _extras

ROOT = Path(__file__).resolve().parent.parent

#: Everything a user reads for install instructions: docs, examples, code, benchmarks.
TEXTS = sorted(
    {
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("docs/**/*.py"),
        *ROOT.glob("mpexec/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("benchmarks/*.md"),
        ROOT / "tox.ini",
    }
)
#: ``pip install mpexec``, ``pip install 'mpexec[x]'``, ``mpexec[x] ...`` as a requirement.
FROM_AN_INDEX = re.compile(r"""pip install(?:\s+-[-\w]+)*\s+['"]?mpexec(?![\w/-])""")
AS_A_REQUIREMENT = re.compile(r"""['"`]mpexec\[\w""")
CHECKOUT_EXTRA = re.compile(r"""pip install -e ["']\.\[([\w,]+)\]["']""")


def pyproject_extras() -> dict[str, str]:
    """Extra name -> its requirement lines, read from pyproject.toml (no tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras: dict[str, str] = {}
    # A list, whose requirements may name extras of their own (ray[client]).
    for m in re.finditer(r"^(\w+) = (\[(?:[^\[\]]|\[[^\]]*\])*\])", section, re.M):
        extras[m.group(1)] = m.group(2)
    return extras


def test_texts_are_found() -> None:
    names = {p.name for p in TEXTS}
    assert {"README.md", "install.md", "ray.md", "jax.py", "ray_basics.py"} <= names


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: p.name)
def test_no_install_from_an_index(path: Path) -> None:
    text = path.read_text()
    bad = [m.group(0) for m in FROM_AN_INDEX.finditer(text)]
    bad += [m.group(0) for m in AS_A_REQUIREMENT.finditer(text)]
    assert not bad, f"{path.name} tells users to install mpexec from an index: {bad}"
    known = pyproject_extras()
    for m in CHECKOUT_EXTRA.finditer(text):
        for name in m.group(1).split(","):
            assert name in known, f"{path.name}: {m.group(0)} names no extra of pyproject.toml"


def test_install_doc_lists_every_extra_command() -> None:
    doc = (ROOT / "docs" / "install.md").read_text()
    for name in pyproject_extras():
        if name == "gpu":  # the CuPy source build, for a local CUDA toolkit: not advertised
            continue
        assert _extras.install_command(name) in doc, name
    prose = " ".join(doc.replace("*", "").split())
    assert "not published on a package index" in prose
    assert "PyTorch's CPU wheel index" in prose
    assert "the torch wheel that pip finds on the Python Package Index is the CUDA build" in prose


def test_extras_match_pyproject() -> None:
    known = pyproject_extras()
    for e in _extras.EXTRAS:
        assert e.name in known, e.name
        bound = re.search(r"[\w-]+(?:\[[\w,-]+\])?>=([\w.]+)", known[e.name])  # ray[client]>=
        assert bound is not None, e.name
        assert bound.group(1) == e.minimum, (e.name, known[e.name], e.minimum)


def test_readme_points_to_the_install_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/install.md" in readme
    assert "not on a package index" in readme


def _import_without(module: str, framework: str) -> str:
    """The ImportError text of ``import mpexec.<module>`` with ``framework`` unimportable."""
    code = textwrap.dedent(
        f"""
        import sys
        import mpexec
        assert {framework!r} not in sys.modules, "import mpexec imported {framework}"
        sys.modules[{framework!r}] = None
        try:
            import mpexec.{module}
        except ImportError as exc:
            print(exc)
        else:
            raise SystemExit("no ImportError")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("module", "extra", "framework"),
    [
        ("jax", "jax", "jax"),
        ("tf", "tf", "tensorflow"),
        ("ray", "ray", "ray"),
        ("torch", "torch", "torch"),
    ],
)
def test_missing_framework_hint_matches_the_docs(module: str, extra: str, framework: str) -> None:
    text = _import_without(module, framework)
    assert _extras.install_command(extra) in text, text
    assert _extras.INSTALL_DOC in text, text
    assert "mpexec[" not in text, text
    if extra == "torch":
        assert "CPU wheel index" in text, text


def test_gpu_hint_matches_the_docs(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpexec import GpuUnavailableError, _gpu

    monkeypatch.setattr(_gpu, "_override", None)  # the real backend: CuPy
    monkeypatch.setitem(sys.modules, "cupy", None)  # which does not import
    with pytest.raises(GpuUnavailableError) as info:
        _gpu.require("fn.python_function 'x'")
    text = str(info.value)
    assert _extras.install_command("cupy") in text, text
    assert _extras.INSTALL_DOC in text, text
    assert _extras.install_command("cupy") in (ROOT / "docs" / "install.md").read_text()
