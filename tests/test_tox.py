"""tox.ini runs every test somewhere it can pass, not only where it skips itself.

The default environments have no optional framework, so a test file that skips
itself as a whole without one (a module-level ``pytest.importorskip("torch")``)
runs only in an environment that installs it, and only if that environment's
command names the file or its folder. A file left out of that command never
runs in CI: it skips everywhere and reports nothing.
"""

from __future__ import annotations

import ast
import configparser
import sys
from pathlib import Path

from mpexec import _extras

ROOT = Path(__file__).resolve().parent.parent


def module_level_skips(path: Path) -> set[str]:
    """The top-level packages ``path`` skips itself without (module-level importorskip)."""
    found = set()
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # a skip inside a test skips that test alone
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "importorskip"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                found.add(node.args[0].value.split(".")[0])
    return found - set(sys.stdlib_module_names)  # `resource`: a platform's, not an extra's


def environments() -> dict[str, tuple[set[str], list[str]]]:
    """Each tox environment: (top-level packages its extras install, test paths it runs)."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    provides = {e.name: e.imports.split(".")[0] for e in _extras.EXTRAS}
    envs = {}
    for section in tox.sections():
        if not section.startswith("testenv"):
            continue
        env = tox[section]
        extras = env.get("extras", tox["testenv"].get("extras", "")).split()
        commands = env.get("commands", tox["testenv"].get("commands", ""))
        words = commands.replace("{posargs:", " ").replace("}", " ").split()
        paths = [w for w in words if w.startswith("tests")]
        if "pytest" in commands:
            envs[section] = ({provides[x] for x in extras if x in provides}, paths or ["tests"])
    return envs


def runs(paths: list[str], test: Path) -> bool:
    rel = test.relative_to(ROOT)
    return any(rel == Path(p) or Path(p) in rel.parents for p in paths)


def test_the_environments_are_read() -> None:
    envs = environments()
    assert envs["testenv:frameworks"][0] >= {"torch", "jax", "tensorflow"}
    assert envs["testenv:ray"][0] == {"ray"}
    assert "tests/adapters/test_ray.py" in envs["testenv:ray"][1]
    assert envs["testenv"] == (set(), ["tests"])
    assert module_level_skips(ROOT / "tests" / "adapters" / "test_torch.py") == {"torch"}


def test_every_file_that_needs_a_framework_runs_where_it_is_installed() -> None:
    envs = environments()
    missed = [
        f"{test.relative_to(ROOT)} (needs {package})"
        for test in sorted(ROOT.glob("tests/**/test_*.py"))
        for package in module_level_skips(test)
        if not any(package in has and runs(paths, test) for has, paths in envs.values())
    ]
    assert not missed, (
        "these test files skip themselves everywhere tox runs them: add each to the "
        f"command of an environment that installs what it needs (tox.ini): {missed}"
    )
