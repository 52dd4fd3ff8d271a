"""The public face: exports, layering, and the doctor command."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

import mpexec
import shm

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("module", [shm, mpexec])
def test_all_is_sorted_and_complete(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]

    # ruff's RUF022 order: CONSTANTS, then Classes, then functions, each sorted.
    def group(n: str) -> tuple[int, str]:
        return (0 if n.isupper() else 1 if n[:1].isupper() else 2, n)

    assert names == sorted(names, key=group)
    assert len(set(names)) == len(names)
    public = {n for n in vars(module) if not n.startswith("_")} - {"annotations"}
    assert public - set(names) - {"__version__"} <= {
        n for n in public if isinstance(getattr(module, n), type(sys))
    }
    for name in names:
        assert hasattr(module, name), name


def test_shm_never_imports_mpexec() -> None:
    for path in (ROOT / "shm").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert all(not a.name.startswith("mpexec") for a in node.names), path
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("mpexec"), path


def test_errors_live_under_public_path_and_pickle() -> None:
    for name in shm.__all__:
        obj = getattr(shm, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert obj.__module__ == "shm"
            err = pickle.loads(pickle.dumps(obj("boom")))
            assert type(err) is obj
            assert str(err) == "boom"
    assert issubclass(shm.RingTimeoutError, TimeoutError)
    assert issubclass(shm.ArenaFullError, MemoryError)
    assert issubclass(shm.PeerDiedError, shm.RingClosedError)


def test_doctor_reports_the_machine() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mpexec", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(out.stdout)
    text = json.dumps(report)
    assert shm.platform_info().backend in text
    assert "forkserver" in text or "spawn" in text


def test_cli_without_command_exits_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mpexec"], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 2


_CPU_ONLY = """
import sys
import numpy as np
import mpexec
from mpexec import fn

@mpexec.pipeline_def(batch_size=2, num_workers=1, seed=0)
def graph():
    x = fn.external_source(source=lambda info: np.full(3, info.idx_in_epoch), batch=False)
    return fn.python_function(x, function=lambda a: a * 2)

if __name__ == "__main__":
    with graph() as pipe:
        (out,) = pipe.run()
    with mpexec.WorkerPool(1) as pool:
        assert pool.submit(sum, [1, 2]).result(30) == 3
    assert out.as_array().tolist() == [[0, 0, 0], [2, 2, 2]]
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx", "torch", "ray")))
"""


def test_cpu_only_use_never_imports_cupy(tmp_path: pathlib.Path) -> None:
    """CuPy is imported lazily, only for GPU work: a stand-in CuPy that leaves a mark
    when imported (in the main process or a worker) must be left alone."""
    fake = tmp_path / "site" / "cupy"
    fake.mkdir(parents=True)
    mark = tmp_path / "imported"
    (fake / "__init__.py").write_text(f"open({str(mark)!r}, 'a').write('cupy\\n')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", _CPU_ONLY],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert not mark.exists(), "CuPy was imported by CPU-only use"
    # and the stand-in is importable, so the check above can fail
    probe = [sys.executable, "-c", "import cupy"]
    subprocess.run(probe, env=env, check=True, timeout=60)
    assert mark.exists()


def test_import_mpexec_loads_what_is_used_only() -> None:
    # A spawned or forkserver worker imports mpexec to run its loop: the
    # pipeline, TensorFlow and DALI front ends are not its to load.
    code = (
        "import sys, mpexec\n"
        "print(sorted(m for m in sys.modules if m.startswith('mpexec')))\n"
        "pool = mpexec.WorkerPool(1, start_method='spawn')\n"
        "print(pool.submit(eval, \"sorted(m for m in __import__('sys').modules "
        "if m.startswith('mpexec'))\").result(60))\n"
        "pool.shutdown()\n"
        "print(mpexec.pipeline_def is mpexec.pipeline.pipeline_def, 'Batch' in dir(mpexec))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == "['mpexec', 'mpexec._version']"
    in_worker = set(eval(out[1]))  # a list of names, printed by the worker
    assert "mpexec._worker" in in_worker
    assert not in_worker & {"mpexec._pipeline", "mpexec._pyfunc", "mpexec._scheduler", "mpexec.fn"}
    assert out[2] == "True True"


def test_a_name_mpexec_lacks_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        mpexec.NoSuchThing  # type: ignore[attr-defined]
    assert set(mpexec.__all__) <= set(dir(mpexec))
