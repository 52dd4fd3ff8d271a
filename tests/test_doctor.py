"""``python -m mpexec doctor`` reports the frameworks: versions, and which extras are usable."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from typing import Any

import pytest

from mpexec import _doctor, _extras

LABELS = ("torch", "jax", "tensorflow", "ray", "cupy", "DALI")


def _doctor_run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "mpexec", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


def test_doctor_lists_every_framework_with_its_installed_version() -> None:
    text = _doctor_run()
    section = text.split("\nframeworks\n", 1)[1].split("\nnotes\n", 1)[0].splitlines()
    rows = {line.split()[0]: line for line in section if line.startswith("  ")}
    assert tuple(rows) == LABELS, section
    for e in _extras.EXTRAS:
        label = "DALI" if e.imports == "nvidia.dali" else e.imports
        row = rows[label]
        if importlib.util.find_spec(e.imports.split(".")[0]) is None:
            assert "not installed" in row, row
            assert _extras.install_command(e.name) in row, row
        else:
            version = next(
                (
                    importlib.metadata.version(d)
                    for d in importlib.metadata.packages_distributions().get(
                        e.imports.split(".")[0], []
                    )
                    if _extras._canonical(d).startswith(
                        _extras._canonical(e.distributions[0].rstrip("*"))
                    )
                ),
                None,
            )
            if version is not None:
                assert version in row, row
        assert f"extra {e.name} " in row, row


def test_doctor_json_carries_the_frameworks() -> None:
    report = json.loads(_doctor_run("--json"))
    found = {f["imports"]: f for f in report["frameworks"]}
    assert set(found) == {e.imports for e in _extras.EXTRAS}
    for f in found.values():
        assert set(f) >= {"version", "distribution", "extra", "usable", "advice"}
        assert f["usable"] is (f["version"] is not None and not f["advice"])


def test_doctor_imports_no_framework() -> None:
    code = (
        "import sys\n"
        "from mpexec._doctor import collect\n"
        "collect(measure=False)\n"
        "print(sorted(set(sys.modules) & {'torch', 'jax', 'tensorflow', 'ray', 'nvidia.dali'}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


@pytest.fixture
def fake_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment with an old torch, no JAX or CuPy, TensorFlow's CPU build,
    a Ray with no package metadata and DALI for CUDA 12."""
    dists = {
        "torch": ["torch"],
        "tensorflow": ["tensorflow_cpu"],
        "nvidia": ["nvidia-nvjpeg-cu12", "nvidia-dali-cuda120"],
    }
    versions = {"torch": "2.5.1+cu121", "tensorflow_cpu": "2.21.0", "nvidia-dali-cuda120": "2.4.0"}
    present = {"torch", "tensorflow", "ray", "nvidia.dali"}

    def find_spec(name: str, package: Any = None) -> Any:
        return object() if name in present else None

    def version(dist: str) -> str:
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: dists)
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.mark.usefixtures("fake_site")
def test_frameworks_report_versions_and_usable_extras() -> None:
    found = {f.imports: f for f in _extras.frameworks()}
    torch, jax, tf, ray = found["torch"], found["jax"], found["tensorflow"], found["ray"]
    assert (torch.version, torch.usable) == ("2.5.1+cu121", False)
    assert torch.advice == "mpexec.torch needs torch >= 2.6"
    assert (jax.version, jax.usable, jax.advice) == (None, False, 'pip install -e ".[jax]"')
    assert (tf.version, tf.distribution, tf.usable) == ("2.21.0", "tensorflow-cpu", True)
    assert (ray.version, ray.usable) == (_extras.UNKNOWN, True)
    assert found["cupy"].version is None
    dali = found["nvidia.dali"]
    assert (dali.version, dali.distribution, dali.extra) == ("2.4.0", "nvidia-dali-cuda120", "dali")
    assert dali.usable

    text = "\n".join(_doctor.format_frameworks(tuple(found.values())))
    assert "tensorflow    2.21.0 (tensorflow-cpu)" in text
    assert 'extra jax not usable: pip install -e ".[jax]"' in text
    assert "extra torch not usable: mpexec.torch needs torch >= 2.6" in text
    assert "extra tf usable (mpexec.tf)" in text
    assert "DALI          2.4.0 (nvidia-dali-cuda120)  extra dali usable (mpexec.dali)" in text


@pytest.mark.usefixtures("fake_site")
@pytest.mark.parametrize("installed", [None, "2.3.1"])
def test_the_dali_row_names_the_dali_extra(
    installed: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like every other row: what to install, or why what is installed will not do."""
    if installed is None:
        spec = importlib.util.find_spec  # fake_site's
        absent = lambda name, package=None: None if "dali" in name else spec(name)  # noqa: E731
        monkeypatch.setattr(importlib.util, "find_spec", absent)
    else:
        monkeypatch.setattr(importlib.metadata, "version", lambda dist: installed)
    dali = {f.imports: f for f in _extras.frameworks()}["nvidia.dali"]
    row = next(r for r in _doctor.format_frameworks((dali,)) if r.startswith("  DALI"))
    assert not dali.usable
    if installed is None:
        want = 'not installed  extra dali not usable: pip install -e ".[dali]"'
    else:
        want = "2.3.1 (nvidia-dali-cuda120)  extra dali not usable: "
        want += "mpexec.dali needs nvidia.dali >= 2.4"
    assert row.endswith(f"{want} (for mpexec.dali)"), row


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0+cpu", (2, 13, 0)), ("0.4.31rc1", (0, 4, 31)), ("2.16", (2, 16)), ("dev", ())],
)
def test_version_release(version: str, release: tuple[int, ...]) -> None:
    assert _extras._version_tuple(version) == release
