"""The runner of PyTorch's own DataLoader tests (``python -m benchmarks compat torch``).

Its measure is only as good as its swap (every process must get mpexec's
class) and its verdict (only the allowed tests may fail): both checked here,
without PyTorch's test file.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from benchmarks.compat import torch_suite

ROOT = Path(__file__).resolve().parents[2]


def test_every_child_process_gets_mpexecs_class(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(torch_suite._SITECUSTOMIZE)
    env = {"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"}
    # torch imported first, then a multiprocessing child of that process: both swapped.
    code = (
        "import multiprocessing as mp, torch.utils.data as d, torch.utils.data.dataloader as dl\n"
        "def probe(q):\n"
        "    import torch.utils.data as d2\n"
        "    q.put(d2.DataLoader.__module__)\n"
        "if __name__ == '__main__':\n"
        "    ctx = mp.get_context('spawn'); q = ctx.Queue()\n"
        "    p = ctx.Process(target=probe, args=(q,))\n"
        "    p.start(); child = q.get(timeout=120); p.join(60)\n"
        "    print(d.DataLoader.__module__, dl.DataLoader.__module__, child)\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["mpexec.torch"] * 3


def _run(name: str, outcomes: dict[str, str]) -> torch_suite.Run:
    run = torch_suite.Run(name, outcomes=dict(outcomes))
    run.messages = {t: f"AssertionError: {t} went wrong" for t, o in outcomes.items()}
    return run


def test_report_fails_only_on_an_unallowed_regression() -> None:
    stock = _run(
        "stock",
        {
            "T::a": "passed",
            "T::test_b": "passed",
            "T::test_c": "failed",
            "T::test_d": "skipped",
        },
    )
    allowed = {"test_b": "reads a private attribute"}
    ours = _run("mpexec", {**stock.outcomes, "T::test_b": "failed", "T::test_c": "failed"})
    text, unexpected = torch_suite.report(stock, ours, allowed)
    assert unexpected == []  # test_b is allowed, test_c fails stock too
    assert "T::test_b: failed - allowed: reads a private attribute" in text
    assert "stock   1 failed, 2 passed, 1 skipped of 4" in text
    ours.outcomes["T::a"] = "timeout"
    text, unexpected = torch_suite.report(stock, ours, allowed)
    assert unexpected == ["T::a"]
    assert "T::a: timeout - AssertionError: T::a went wrong" in text
