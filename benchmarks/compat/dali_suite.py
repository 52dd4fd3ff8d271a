"""``python -m benchmarks compat dali PATH``: DALI's own python_function tests against mpexec.

``PATH`` is DALI's ``dali/test/python/operator_2/test_python_function.py`` (or
the folder holding it, where ``test_python_function_cleanup.py`` is run too),
from a checkout of DALI: the file is read there, never copied here. It runs
twice in this environment, each run a pytest process of its own (restarted
past a test that hangs or crashes it):

- ``dali``: as shipped, against the installed ``nvidia-dali`` package (on a
  machine without a CUDA device, DALI's pipelines are made with
  ``device_id=None``, DALI's CPU-only mode, which its tests' ``device_id=0``
  would refuse: see ``dali_support/dali_compat_plugin.py``);
- ``mpexec``: with the module aliases ``nvidia.dali`` -> ``mpexec`` and
  ``nvidia.dali.X`` -> ``mpexec.X`` in every process (workers included), and
  nothing else: the port a user makes by renaming the import.

Both runs get the same stand-ins for what the file imports from DALI's test
tree and nose2 (``benchmarks/compat/dali_support``, ours), a generated
stand-in for the DALI_extra JPEG folder it reads (small JPEGs in DALI_extra's
``db/single/jpeg`` layout, made in a temporary folder that is removed after),
and ``numpy.float_`` restored for NumPy 2. A table of the two outcomes, test
by test, and the totals are printed; ``--json``/``--markdown`` also write them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent / "dali_support"
FILES = ("test_python_function.py", "test_python_function_cleanup.py")
RUNS = ("dali", "mpexec")

#: DALI_extra's db/single/jpeg: its sub-directories (the labels) and how many JPEGs each holds.
JPEG_LAYOUT = {
    "0": 4,
    "1": 3,
    "100": 1,
    "113": 1,
    "134": 2,
    "182": 2,
    "241": 3,
    "312": 1,
    "362": 3,
    "425": 2,
    "450": 3,
    "641": 2,
    "695": 1,
    "704": 3,
    "721": 1,
    "755": 3,
    "814": 2,
    "84": 1,
}


@dataclass
class Outcome:
    outcome: str  # passed, failed, error, skipped, timeout, crashed, not run
    message: str = ""


@dataclass
class RunResult:
    name: str
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    collect_errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    processes: int = 0

    @property
    def passed(self) -> int:
        return sum(1 for o in self.outcomes.values() if o.outcome == "passed")


def main(argv: list[str]) -> int:
    """Run the suite; 0 when every requested run finished, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks compat dali",
        description="Run DALI's own python_function tests against DALI and against mpexec "
        "(nvidia.dali renamed to mpexec), side by side.",
    )
    parser.add_argument("path", type=Path, help="DALI's test_python_function.py, or its folder")
    parser.add_argument("--runs", choices=("both", *RUNS), default="both")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run (1800)")
    parser.add_argument("--test-timeout", type=float, default=300, help="seconds per test (300)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, to run a subset")
    parser.add_argument("--json", type=Path, help="write the outcomes as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    try:
        files = test_files(args.path)
    except FileNotFoundError as exc:
        print(exc, file=sys.stderr)
        return 2
    runs = RUNS if args.runs == "both" else (args.runs,)
    work = Path(tempfile.mkdtemp(prefix="mpexec-dali-compat-"))
    try:
        make_dali_extra(work / "dali_extra")
        results = [run_suite(name, files, work, args) for name in runs]
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    ids = _all_ids(results)
    for r in results:
        _fill_collection_errors(r, ids)
    print(table(results, ids))
    print()
    for r in results:
        print(
            f"{r.name:>7}: {r.passed}/{len(ids)} passed in {r.seconds:.0f} s "
            f"({r.processes} pytest process{'es' if r.processes != 1 else ''})"
        )
    if args.json:
        args.json.write_text(json.dumps(_as_json(results, ids), indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(table(results, ids, markdown=True) + "\n")
    finished = all(
        r.outcomes and not any(o.outcome == "not run" for o in r.outcomes.values()) for r in results
    )
    return 0 if finished else 1


def test_files(path: Path) -> list[Path]:
    """The test files at ``path``: the file itself, or those of :data:`FILES` in the folder."""
    path = path.resolve()
    if path.is_file():
        return [path]
    found = [path / f for f in FILES if (path / f).is_file()]
    if not found:
        raise FileNotFoundError(f"no {FILES[0]} at {path}")
    return found


# ---------------------------------------------------------------- data


def make_dali_extra(root: Path, seed: int = 0) -> Path:
    """Small JPEGs in DALI_extra's ``db/single/jpeg`` layout, under ``root``.

    Sizes, aspect ratios and chroma subsampling vary (odd widths, 4:4:4,
    4:2:2, 4:2:0, as DALI_extra's folder ``0`` has them); the pictures are
    smooth gradients with noise, so that they compress like photographs.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    jpeg = root / "db" / "single" / "jpeg"
    k = 0
    for label, count in JPEG_LAYOUT.items():
        folder = jpeg / label
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            h, w = int(rng.integers(48, 128)), int(rng.integers(48, 160)) | (k & 1)
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
            pixels = np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(
                folder / f"sample_{i}.jpg", quality=int(rng.integers(70, 96)), subsampling=k % 3
            )
            k += 1
    (jpeg / "image_list.txt").write_text("".join(f"{d}/sample_0.jpg {d}\n" for d in JPEG_LAYOUT))
    (jpeg / "0" / "image_list.txt").write_text("sample_0.jpg 0\n")
    return root


# ---------------------------------------------------------------- running


def run_suite(name: str, files: list[Path], work: Path, args: Any) -> RunResult:
    """One run (``dali`` or ``mpexec``), in pytest processes restarted past a hang or crash."""
    result = RunResult(name)
    base = work / name
    tmp = base / "tmp"
    tmp.mkdir(parents=True)
    events = base / "events.jsonl"
    ini = base / "pytest.ini"
    ini.write_text("[pytest]\n")
    rootdir = files[0].parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(SUPPORT), str(ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
        "DALI_EXTRA_PATH": str(work / "dali_extra"),
        "TMPDIR": str(tmp),  # the file's tempfile.mkdtemp() calls land here, and go with it
        "MPEXEC_COMPAT_RESULTS": str(events),
        "MPEXEC_COMPAT_TEST_TIMEOUT": str(args.test_timeout),
    }
    env.pop("MPEXEC_COMPAT_ALIAS", None)
    if name == "mpexec":
        env["MPEXEC_COMPAT_ALIAS"] = "nvidia.dali=mpexec"
    else:
        env["MPEXEC_COMPAT_DALI_CPU"] = "1"  # device_id=None where there is no CUDA device
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        "--rootdir",
        str(rootdir),
        "-p",
        "no:cacheprovider",
        "-p",
        "dali_compat_plugin",
        "-q",
        "--no-header",
        "-rN",
    ]
    if args.keyword:
        command += ["-k", args.keyword]
    started = time.monotonic()
    deadline = started + args.timeout
    targets: list[str] = [str(f) for f in files]
    collected: list[str] = []
    log = base / "pytest.log"
    while targets:
        result.processes += 1
        with open(log, "a", encoding="utf-8") as out:
            proc = subprocess.Popen(
                command + targets,
                cwd=tmp,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group holds every process it starts
            )
            timed_out = False
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        done_before = len(result.outcomes)
        collected = _read_events(events, result, collected)
        in_flight = [i for i in _started(events) if i not in result.outcomes]
        for nodeid in in_flight:
            why = "the run's time ran out" if timed_out else f"pytest exited ({proc.returncode})"
            result.outcomes[nodeid] = Outcome("crashed", f"{why} while it ran")
        left = [i for i in collected if i not in result.outcomes]
        if timed_out:
            for nodeid in left:
                result.outcomes[nodeid] = Outcome("not run", "the run's time ran out")
            break
        if not left or len(result.outcomes) == done_before:
            break
        targets = [f"{rootdir / i}" for i in left]
    result.seconds = time.monotonic() - started
    if not result.outcomes and not result.collect_errors:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:] if log.exists() else []
        result.collect_errors.append(" | ".join(tail) or "pytest produced no results")
    return result


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """End the pytest process and anything it left behind (its whole process group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
            out.append(json.loads(line))
    return out


def _read_events(path: Path, result: RunResult, collected: list[str]) -> list[str]:
    for e in _events(path):
        kind = e.get("event")
        if kind == "collected" and not collected:
            collected = list(e["ids"])
        elif kind == "collect_error" and e["message"] not in result.collect_errors:
            result.collect_errors.append(f"{e['id']}: {e['message']}")
        elif kind == "result":
            result.outcomes[e["id"]] = Outcome(e["outcome"], e.get("message", ""))
        elif kind == "timeout":
            result.outcomes[e["id"]] = Outcome("timeout", f"ran past {e['seconds']:.0f} s")
    return collected


def _started(path: Path) -> list[str]:
    return [e["id"] for e in _events(path) if e.get("event") == "start"]


# ---------------------------------------------------------------- reporting


def _all_ids(results: list[RunResult]) -> list[str]:
    ids: list[str] = []
    for r in results:
        ids += [i for i in r.outcomes if i not in ids]
    return ids


def _fill_collection_errors(result: RunResult, ids: list[str]) -> None:
    """Tests another run collected but this one could not (its file failed to import)."""
    if not result.collect_errors:
        return
    for nodeid in ids:
        if nodeid not in result.outcomes:
            file = nodeid.split("::")[0]
            why = next((e for e in result.collect_errors if e.startswith(file)), None)
            result.outcomes[nodeid] = Outcome(
                "error", f"collection: {why or result.collect_errors[0]}"
            )


def table(results: list[RunResult], ids: list[str], markdown: bool = False) -> str:
    """The outcomes, a row per test; the message of the last run's failures."""
    last = results[-1]
    heads = ["test", *(r.name for r in results), f"{last.name}: why not passed"]
    rows = []
    for nodeid in ids:
        name = nodeid.split("::", 1)[-1]
        cells = [r.outcomes.get(nodeid, Outcome("not run")).outcome for r in results]
        o = last.outcomes.get(nodeid, Outcome("not run"))
        why = "" if o.outcome == "passed" else o.message.replace("\n", " ")
        rows.append([name, *cells, why[:110]])
    totals = ["total passed", *(f"{r.passed}/{len(ids)}" for r in results), ""]
    if markdown:
        lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines.append("| " + " | ".join(f"**{c}**" if c else "" for c in totals) + " |")
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(heads, *rows, totals, strict=True)]
    widths[-1] = min(widths[-1], 110)

    def fmt(row: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    return "\n".join([fmt(heads), *(fmt(r) for r in rows), fmt(totals)])


def _as_json(results: list[RunResult], ids: list[str]) -> dict[str, Any]:
    return {
        "tests": ids,
        "runs": {
            r.name: {
                "passed": r.passed,
                "seconds": round(r.seconds, 1),
                "collect_errors": r.collect_errors,
                "outcomes": {i: vars(o) for i, o in r.outcomes.items()},
            }
            for r in results
        },
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
