"""``python -m benchmarks compat torchdata PATH``: torchdata's StatefulDataLoader tests, on ours.

``PATH`` is a copy of torchdata's ``test/stateful_dataloader/`` folder (or one
or more of its files): torchdata's code, never part of this repository. The
files that read as the suite (``SUITE_FILES``, those present) run twice under
pytest in one environment:

- **stock**: as shipped, against ``torchdata.stateful_dataloader.StatefulDataLoader``;
- **mpexec**: with ``mpexec.torch.DataLoader`` in its place **in every
  process** — a generated ``sitecustomize.py`` on ``PYTHONPATH`` swaps the
  class into ``torchdata.stateful_dataloader`` (and its ``stateful_dataloader``
  module) as soon as both are imported. torch's own ``DataLoader`` is left as
  it is: one test compares the two. Before the run, a ``python -c`` child is
  asked which class it sees.

Then it prints, as ``compat torch`` does, one row per test, the totals and, for
each test that fails with mpexec, the first line of why, with the reason when
the test is one ``ALLOWED`` to fail. Needs ``torchdata``, ``parameterized``
(its tests use it) and, for ``test_hugging_face.py``, ``datasets``.

Exit status: 0 when every test that passes stock passes with mpexec too, but
those in ``ALLOWED``; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from benchmarks.compat._sitehook import sitecustomize

# The run, its report and the per-test plugin are torch's runner's: one
# behaviour for both suites (a shared private seam inside benchmarks/compat).
from benchmarks.compat.torch_suite import _PLUGIN, Run, _kill_group, _test_name, report

#: torchdata 0.11.0's ``test/stateful_dataloader/`` files that make the measure.
SUITE_FILES: tuple[str, ...] = (
    "test_state_dict.py",
    "test_sampler.py",
    "test_hugging_face.py",
    "test_incremental_state.py",
)

_LAYOUT = "reads torchdata's private state layout (state['_snapshot']['_worker_snapshots'])"

#: Tests allowed to fail with mpexec, and why (docs/loaders.md lists them too).
ALLOWED: dict[str, str] = {
    "test_num_workers_mismatch": (
        "expects a state taken with another num_workers to be refused; mpexec resumes it"
    ),
    "test_initial_state": _LAYOUT,
    "test_load_state_after_initial_state_dict": _LAYOUT,
    "TestDynamicStateIterableDataset_shard0::test": _LAYOUT,
    "TestDatasetIteratorStateDuplication_shard0::test": _LAYOUT,
    "TestSingleIterCalled_shard0::test_inline": _LAYOUT,
    "TestSingleIterCalled_shard0::test_mp": _LAYOUT,
    "TestSingleIterCalled_shard0::test_inline_iter": _LAYOUT,
    "TestSingleIterCalled_shard0::test_mp_iter": _LAYOUT,
    "test_out_of_order_iterable_ds_one_completed_worker": _LAYOUT,
    "test_out_of_order_iterable_ds_no_completed_workers": _LAYOUT,
}

# Swaps the class in every Python process started with the folder on PYTHONPATH.
_SITECUSTOMIZE = sitecustomize(
    "benchmarks/compat/torchdata_suite.py",
    "StatefulDataLoader is mpexec's here",
    ("torchdata.stateful_dataloader", "mpexec.torch"),
    """
def _swap():
    ours = sys.modules.get("mpexec.torch")
    theirs = sys.modules.get("torchdata.stateful_dataloader")
    if theirs is None or (ours is not None and not hasattr(ours, "DataLoader")):
        return  # one of the two is still importing: swapped once both are done
    from mpexec.torch import DataLoader
    import torchdata.stateful_dataloader.stateful_dataloader as module

    theirs.StatefulDataLoader = DataLoader
    module.StatefulDataLoader = DataLoader
""",
)

_CHECK = (
    "from torchdata.stateful_dataloader import StatefulDataLoader as c; "
    "print(c.__module__.split('._')[0])"
)


def _files(path: Path) -> list[Path]:
    """The suite's files under ``path`` (a folder), or ``path`` itself (a file)."""
    if path.is_file():
        return [path]
    return [path / name for name in SUITE_FILES if (path / name).is_file()]


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
    """The package of the StatefulDataLoader class a ``python -c`` child sees."""
    done = subprocess.run(
        [sys.executable, "-c", _CHECK],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"a child process could not import torchdata:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


def _run(
    name: str, files: list[Path], workdir: Path, swapped: bool, args: argparse.Namespace
) -> Run:
    results = workdir / f"{name}.jsonl"
    env = _env(workdir, files[0].parent, swapped, results, args.test_timeout)
    if swapped:
        seen = _check_swap(env, workdir)
        if seen != "mpexec.torch":
            raise RuntimeError(f"the swap did not take: a child process sees {seen}'s class")
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
        "--rootdir",  # the tests' folder: node ids then name their file
        str(files[0].parent),
        *map(str, files),
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
            # File and class: the four files reuse class names (two hold a
            # TestStatefulDataLoaderIterable_shard0).
            test = f"{Path(rec['nodeid'].split('::', 1)[0]).stem}::{_test_name(rec['nodeid'])}"
            if rec["outcome"] == "started":
                started.append(test)
                continue
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compat torchdata",
        description=textwrap.dedent(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument(
        "path", type=Path, help="a copy of torchdata's test/stateful_dataloader/ (or one file)"
    )
    parser.add_argument("-k", default="", help="pytest -k expression (both runs)")
    parser.add_argument("--only", choices=("stock", "mpexec"), help="run one side only")
    parser.add_argument("--test-timeout", type=int, default=900, help="seconds per test")
    parser.add_argument("--run-timeout", type=int, default=7200, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write both runs' outcomes here")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in _files(args.path)]
    if not files:
        parser.error(f"none of {', '.join(SUITE_FILES)} under {args.path}")
    with tempfile.TemporaryDirectory(prefix="mpexec-compat-torchdata-") as tmp:
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
            print(f"running {len(files)} files: {name} ...", file=sys.stderr, flush=True)
            runs[name] = _run(name, files, workdir, swapped, args)
    tests = sorted(set(runs["stock"].outcomes) | set(runs["mpexec"].outcomes))
    text, unexpected = report(runs["stock"], runs["mpexec"], ALLOWED)
    passed = sum(1 for t in tests if runs["mpexec"].outcomes.get(t) == "passed")
    text += f"\n\nmpexec passes {passed} of {len(tests)}; allowed to fail: {len(ALLOWED)}"
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


__all__ = ["ALLOWED", "SUITE_FILES", "main"]
