"""``python -m benchmarks compat tf PATH``: TensorFlow's own py_func tests against mpexec's.

``PATH`` is a copy of TensorFlow's
``tensorflow/python/kernel_tests/py_func_test.py`` (TF2-era, with
``PyFuncAndEagerPyFuncTest``); it is TensorFlow's code and never part of this
repository. It runs twice under pytest in this environment, each run a pytest
process of its own on a copy of the file in a temporary folder:

- **tf**: as shipped;
- **mpexec**: with the three names swapped for ours in the file's calls —
  ``script_ops.py_func`` -> ``mpexec.py_func``, ``script_ops.eager_py_func``
  (TF's ``tf.py_function``) -> ``mpexec.py_function``,
  ``script_ops.numpy_function`` -> ``mpexec.numpy_function`` — the port a user
  makes; TensorFlow's own internals keep TF's functions.

A test counts as passed when it and every subtest of it (TF's
``run_in_graph_and_eager_modes`` runs it once per mode) passed. The table gives
both outcomes, test by test, and why a test failed with mpexec; ``ALLOWED``
lists the tests allowed to fail with mpexec, with the reason (docs/tensorflow.md
lists them too). Exit status 0 when every test that passes with TF passes with
mpexec, but those.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The swap: TF's names in the file -> ours.
SWAP = {
    "script_ops.py_func(": "mpexec.py_func(",
    "script_ops.eager_py_func(": "mpexec.py_function(",
    "script_ops.numpy_function(": "mpexec.numpy_function(",
}

_GRADIENTS = "a gradient through py_function: mpexec's has none (a clear LookupError instead)"
_RAGGED = "a RaggedTensor input or RaggedTensorSpec in Tout: not supported (a clear TypeError)"
#: Tests allowed to fail with mpexec, and why (docs/tensorflow.md lists them too).
ALLOWED: dict[str, str] = {
    "testEagerGradientTape": _GRADIENTS,
    "testEagerGradientTapeMultipleArgs": _GRADIENTS,
    "testTapeCache": _GRADIENTS + "; it counts entries of TF's private tape cache",
    "testRaggedTensorArg": _RAGGED,
    "testRaggedTensorReturn": _RAGGED,
    "testRaggedExpectedListGotList": _RAGGED,
    "testRaggedExpectedListGotTuple": _RAGGED,
    "testRaggedExpectedListGotSingleValue": _RAGGED,
    "testRaggedNoReturnValue": _RAGGED,
    "testRaggedBadReturnTypeExpectedTensorReturnedRagged": _RAGGED,
    "testRaggedBadReturnTypeExpectedRaggedReturnedTensor": _RAGGED,
    "testNoReturnValueStateful": (
        "the function mutates an object of the test's process; with mpexec it runs in a "
        "worker, where the mutation stays (the contract: functions run in another process)"
    ),
}

# Records every test's outcome, subtests folded in: a test fails if any part did.
_PLUGIN = """\
import json, os
_out = os.environ["MPEXEC_TF_COMPAT_RESULTS"]
def _write(nodeid, outcome, message):
    with open(_out, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": nodeid, "outcome": outcome, "message": message}) + "\\n")
def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.failed or report.skipped):
        return
    outcome = "skipped" if report.skipped else report.outcome
    if getattr(report, "context", None) is not None:  # a subtest
        outcome = "sub" + outcome
    message = ""
    if report.failed:
        message = str(getattr(report.longrepr, "reprcrash", report.longrepr))
    _write(report.nodeid, outcome, message[-2000:])
"""


def swapped(text: str) -> str:
    """The test file with TF's three names swapped for mpexec's (and ``import mpexec``)."""
    for old, new in SWAP.items():
        text = text.replace(old, new)
    return re.sub(r"^import gc$", "import gc\n\nimport mpexec", text, count=1, flags=re.M)


def run(name: str, source: Path, work: Path, timeout: float) -> dict[str, tuple[str, str]]:
    """One pytest run of the file (``name`` tf or mpexec); outcome and message per test."""
    folder = work / name
    folder.mkdir()
    text = source.read_text(encoding="utf-8")
    (folder / "py_func_test.py").write_text(
        swapped(text) if name == "mpexec" else text, encoding="utf-8"
    )
    (folder / "tf_compat_plugin.py").write_text(_PLUGIN, encoding="utf-8")
    results = folder / "results.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
        "MPEXEC_TF_COMPAT_RESULTS": str(results),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tf_compat_plugin",
        "--rootdir", str(folder), "py_func_test.py",
    ]  # fmt: skip
    with open(folder / "pytest.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(
            command, cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=timeout, check=False,
        )  # fmt: skip
    del proc
    parts: dict[str, list[tuple[str, str]]] = {}
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            e = json.loads(line)
            outcome = e["outcome"].removeprefix("sub")
            parts.setdefault(e["id"].split("::")[-1], []).append((outcome, e["message"]))
    outcomes: dict[str, tuple[str, str]] = {}
    for test, seen in parts.items():  # any part failed: failed; else any passed: passed
        failed = [m for o, m in seen if o == "failed"]
        if failed:
            outcomes[test] = ("failed", failed[0])
        elif any(o == "passed" for o, _ in seen):
            outcomes[test] = ("passed", "")
        else:
            outcomes[test] = ("skipped", seen[0][1])
    return outcomes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compat tf",
        description="Run TensorFlow's py_func_test.py as shipped and with mpexec's names.",
    )
    parser.add_argument("path", type=Path, help="a copy of TF's py_func_test.py")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run (1200)")
    parser.add_argument("--json", type=Path, help="write the outcomes as JSON here")
    args = parser.parse_args(argv)
    if not args.path.is_file():
        print(f"no file at {args.path}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="mpexec-tf-compat-"))
    try:
        started = time.monotonic()
        runs = {name: run(name, args.path, work, args.timeout) for name in ("tf", "mpexec")}
        seconds = time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)
    tests = sorted({*runs["tf"], *runs["mpexec"]})
    rows = []
    regressions = []
    for test in tests:
        tf_outcome = runs["tf"].get(test, ("not run", ""))[0]
        ours, why = runs["mpexec"].get(test, ("not run", ""))
        note = ""
        if tf_outcome == "passed" and ours != "passed":
            if test in ALLOWED:
                note = f"allowed: {ALLOWED[test]}"
            else:
                regressions.append(test)
                note = why.replace("\n", " ")[:150]
        rows.append((test, tf_outcome, ours, note))
    width = max(len(t) for t in tests) if tests else 4
    print(f"{'test':<{width}}  {'tf':<8}  {'mpexec':<8}  why not passed (mpexec)")
    for test, a, b, note in rows:
        print(f"{test:<{width}}  {a:<8}  {b:<8}  {note}")
    passed = {n: sum(1 for o, _ in r.values() if o == "passed") for n, r in runs.items()}
    print(
        f"\npassed: tf {passed['tf']}/{len(tests)}, mpexec {passed['mpexec']}/{len(tests)}; "
        f"passed with tf, not with mpexec: {len(regressions)} not allowed "
        f"({', '.join(regressions) or 'none'}), "
        f"{sum(1 for r in rows if r[3].startswith('allowed'))} allowed; {seconds:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps({n: dict(r) for n, r in runs.items()}, indent=1) + "\n")
    return 1 if regressions else 0


__all__ = ["ALLOWED", "SWAP", "main", "swapped"]
