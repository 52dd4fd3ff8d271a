"""``python -m benchmarks compat torch PATH``: PyTorch's own DataLoader tests against ours.

``PATH`` is a copy of PyTorch's ``test/test_dataloader.py`` (it is PyTorch's
code and never part of this repository). The file runs twice under pytest in
one environment:

- **stock**: as shipped, against ``torch.utils.data.DataLoader``;
- **mpexec**: with ``mpexec.torch.DataLoader`` in its place **in every
  process** — a generated ``sitecustomize.py`` on ``PYTHONPATH`` swaps the
  class into ``torch.utils.data`` and ``torch.utils.data.dataloader`` as soon
  as ``torch`` has been imported, so the tests' own child processes (spawned
  ``multiprocessing`` children, ``python -c`` subprocesses) get ours too.
  Before the run, a ``python -c`` child is asked which class it sees.

Then it prints one row per test (stock outcome, mpexec outcome), the totals,
the tests that pass only because they are skipped in both runs, and, for each
test that fails with mpexec, the first line of why. Every test is bounded
(``--test-timeout``), and so is each run (``--run-timeout``); the temporary
folder and every process a run started are gone when it returns.

Exit status: 0 when every test that passes stock passes with mpexec too, but
those in ``ALLOWED`` (the one that expects torch's pickling limitation); 1
otherwise. A test that runs past ``--test-timeout`` fails: on a loaded machine
some of PyTorch's tests (dozens of spawned workers) take minutes, stock too.
torch's test harness needs the ``expecttest`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.compat._sitehook import sitecustomize

#: Tests allowed to fail with mpexec, and why (docs/loaders.md lists them too).
#: (The issue also allowed test_partial_workers and test_get_worker_info, which
#: read torch's private ``it._workers``: mpexec's iterator lists its workers
#: there too, and both pass.)
ALLOWED: dict[str, str] = {
    "test_worker_init_fn_forkserver": (
        "expects torch's pickling error for a local worker_init_fn; cloudpickle sends it"
    ),
}

# Swaps the class in every Python process started with the folder on PYTHONPATH.
_SITECUSTOMIZE = sitecustomize(
    "benchmarks/compat/torch_suite.py",
    "torch's DataLoader is mpexec's here",
    ("torch", "mpexec.torch"),
    """
def _swap():
    ours = sys.modules.get("mpexec.torch")
    if ours is not None and not hasattr(ours, "DataLoader"):
        return  # mpexec.torch itself is importing torch: swapped once it is done
    import torch.utils.data
    import torch.utils.data.dataloader
    from mpexec.torch import DataLoader

    torch.utils.data.DataLoader = DataLoader
    torch.utils.data.dataloader.DataLoader = DataLoader
""",
    early="torch",
)

# A pytest plugin: one JSON line per test outcome, written as it happens (a run
# cut short keeps what it had), and a per-test alarm.
_PLUGIN = """\
import json
import os
import signal

import pytest

_OUT = os.environ["MPEXEC_COMPAT_RESULTS"]
_LIMIT = int(os.environ.get("MPEXEC_COMPAT_TEST_TIMEOUT", "0"))


def _record(nodeid, outcome, message=""):
    with open(_OUT, "a", encoding="utf-8") as f:
        f.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "message": message}) + "\\n")


def _alarm(signum, frame):
    raise TimeoutError(f"test ran past {_LIMIT} s (benchmarks compat --test-timeout)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _record(item.nodeid, "started")
    if _LIMIT:
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(_LIMIT)
    try:
        yield
    finally:
        if _LIMIT:
            signal.alarm(0)


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        if report.when != "call" and outcome == "failed":
            outcome = "error"
        message = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(report.longrepr)
        elif report.skipped and isinstance(report.longrepr, tuple):
            message = report.longrepr[2]
        _record(report.nodeid, outcome, message)
"""


@dataclass
class Run:
    """One run of the file: each test's outcome and failure message."""

    name: str
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    timed_out: bool = False
    returncode: int | None = None

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())


def _test_name(nodeid: str) -> str:
    """``Class::test`` from a pytest node id."""
    return nodeid.split("::", 1)[-1]


def _env(workdir: Path, test_dir: Path, swapped: bool, results: Path, limit: int) -> dict[str, str]:
    env = dict(os.environ)
    repo = Path(__file__).resolve().parents[2]  # this checkout's mpexec, in every process
    paths = [str(workdir / "site")] if swapped else []
    paths += [str(workdir / "plugin"), str(test_dir), str(repo)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["MPEXEC_COMPAT_RESULTS"] = str(results)
    env["MPEXEC_COMPAT_TEST_TIMEOUT"] = str(limit)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _check_swap(env: dict[str, str], workdir: Path) -> str:
    """The module of the DataLoader class a ``python -c`` child sees."""
    code = "import torch.utils.data as d; print(d.DataLoader.__module__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"a child process could not import torch:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def _run(name: str, path: Path, workdir: Path, swapped: bool, args: argparse.Namespace) -> Run:
    results = workdir / f"{name}.jsonl"
    env = _env(workdir, path.parent, swapped, results, args.test_timeout)
    if swapped:
        seen = _check_swap(env, workdir)
        if seen != "mpexec.torch":
            raise RuntimeError(f"the swap did not take: a child process sees {seen}.DataLoader")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "mpexec_compat_plugin",
        "-c",
        str(workdir / "pytest.ini"),
        "--rootdir",
        str(workdir),
        str(path),
        *(["-k", args.k] if args.k else []),
    ]
    run = Run(name)
    log = (workdir / f"{name}.log").open("w")
    start = time.monotonic()
    # A session of its own: on a time-out the whole process group goes, children too.
    proc = subprocess.Popen(
        cmd, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        run.returncode = proc.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        run.timed_out = True
    finally:
        _kill_group(proc)
        log.close()
    run.seconds = time.monotonic() - start
    started: list[str] = []
    if results.exists():
        for line in results.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            test = _test_name(rec["nodeid"])
            if rec["outcome"] == "started":
                started.append(test)
                continue
            # A failed teardown after a passed call: the test is an error.
            if run.outcomes.get(test) in (None, "passed") or rec["outcome"] == "error":
                run.outcomes[test] = rec["outcome"]
                if rec["message"]:
                    run.messages[test] = rec["message"]
    for test in started:
        if test not in run.outcomes:
            run.outcomes[test] = "timeout" if run.timed_out else "crashed"
    if not run.outcomes:
        tail = (workdir / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the {name} run recorded no test:\n{tail}")
    return run


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the run's process group (the run and anything it left behind), bounded."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
            break
        except subprocess.TimeoutExpired:
            continue


def _first_line(text: str, width: int = 110) -> str:
    line = next((s for s in text.strip().splitlines() if s.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def allowed_why(test: str, allowed: dict[str, str]) -> str | None:
    """Why ``test`` may fail: its entry in ``allowed``, keyed by a ``::``-suffix of its name."""
    for key, why in allowed.items():
        if test == key or test.endswith("::" + key):
            return why
    return None


def report(stock: Run, ours: Run, allowed: dict[str, str]) -> tuple[str, list[str]]:
    """The table, totals and notes as text; the tests that fail against ``allowed``."""
    tests = sorted(set(stock.outcomes) | set(ours.outcomes))
    width = max(len(t) for t in tests)
    lines = [f"{'test':<{width}}  {'stock':<8}  {'mpexec':<8}", "-" * (width + 20)]
    for test in tests:
        a, b = stock.outcomes.get(test, "-"), ours.outcomes.get(test, "-")
        mark = "" if a == b else "   <-- differs"
        lines.append(f"{test:<{width}}  {a:<8}  {b:<8}{mark}")
    lines.append("")
    for run in (stock, ours):
        counts = run.counts()
        summary = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        extra = " (run timed out)" if run.timed_out else ""
        lines.append(
            f"{run.name:<7} {summary} of {sum(counts.values())} in {run.seconds:.0f} s{extra}"
        )
    both_skipped = [
        t for t in tests if stock.outcomes.get(t) == "skipped" and ours.outcomes.get(t) == "skipped"
    ]
    lines.append(f"\nskipped in both runs ({len(both_skipped)}): " + ", ".join(both_skipped))
    bad = [t for t in tests if ours.outcomes.get(t) in ("failed", "error", "timeout", "crashed")]
    unexpected = [
        t for t in bad if stock.outcomes.get(t) == "passed" and allowed_why(t, allowed) is None
    ]
    if bad:
        lines.append(f"\nfailing with mpexec ({len(bad)}):")
        for test in bad:
            why = allowed_why(test, allowed)
            tag = f"allowed: {why}" if why else _first_line(ours.messages.get(test, ""))
            lines.append(f"  {test}: {ours.outcomes[test]} - {tag}")
    return "\n".join(lines), unexpected


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compat torch",
        description=textwrap.dedent(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("path", type=Path, help="a copy of PyTorch's test/test_dataloader.py")
    parser.add_argument("-k", default="", help="pytest -k expression (both runs)")
    parser.add_argument("--only", choices=("stock", "mpexec"), help="run one side only")
    parser.add_argument("--test-timeout", type=int, default=900, help="seconds per test")
    parser.add_argument("--run-timeout", type=int, default=7200, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write both runs' outcomes here")
    args = parser.parse_args(argv)
    path = args.path.resolve()
    if not path.is_file():
        parser.error(f"no such file: {path}")
    with tempfile.TemporaryDirectory(prefix="mpexec-compat-torch-") as tmp:
        workdir = Path(tmp)
        (workdir / "site").mkdir()
        (workdir / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        (workdir / "plugin").mkdir()
        (workdir / "plugin" / "mpexec_compat_plugin.py").write_text(_PLUGIN)
        (workdir / "pytest.ini").write_text("[pytest]\n")
        runs = {}
        for name, swapped in (("stock", False), ("mpexec", True)):
            if args.only and args.only != name:
                runs[name] = Run(name)
                continue
            print(f"running {path.name}: {name} ...", file=sys.stderr, flush=True)
            runs[name] = _run(name, path, workdir, swapped, args)
    text, unexpected = report(runs["stock"], runs["mpexec"], ALLOWED)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    name: {
                        "outcomes": run.outcomes,
                        "messages": run.messages,
                        "seconds": run.seconds,
                        "timed_out": run.timed_out,
                    }
                    for name, run in runs.items()
                },
                indent=1,
            )
        )
    if args.only:
        return 0
    return 1 if unexpected else 0


__all__ = ["ALLOWED", "allowed_why", "main", "report"]
