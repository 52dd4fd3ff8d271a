"""What every benchmark module shares: tables, targets, the watchdog, results files, CLI."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
KiB, MiB = 1 << 10, 1 << 20


def fmt_time(us: float) -> str:
    if us < 1_000:
        return f"{us:.1f} us"
    if us < 1_000_000:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = set(range(1, len(headers))) if right is None else right
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def git_state(*paths: str) -> tuple[str | None, bool | None]:
    """The checkout's short commit, and whether ``paths`` have uncommitted changes."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--", *paths))
    except (OSError, subprocess.SubprocessError):
        return None, None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def host() -> dict[str, Any]:
    """The machine and interpreter a benchmark ran on, and the load when it began."""
    import numpy as np

    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "numpy": np.__version__,
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def stamp(quick: bool, **versions: Any) -> dict[str, Any]:
    """A result's opening: whether quick, when (UTC), and what ran it.

    ``env`` holds Python's version, ``versions`` (numpy, the peer, mpexec...),
    the CPU count and the commit of this checkout (and whether it was dirty).
    """
    commit, dirty = git_state("mpexec", "shm", "benchmarks")
    return {
        "quick": quick,
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "env": {
            "python": platform.python_version(),
            **versions,
            "cpus": os.cpu_count(),
            "commit": commit,
            "dirty": dirty,
        },
    }


def closing(parts: list[str], result: dict[str, Any], kinds: tuple[str, ...] = ("errors",)) -> str:
    """A report's text: ``parts``, each list of ``kinds`` in ``result`` that is not
    empty, then how long the run took."""
    parts = [
        *parts,
        *(
            f"{kind}:\n" + "\n".join(f"  {p}" for p in result[kind])
            for kind in kinds
            if result[kind]
        ),
        f"took {result['duration_s']} s",
    ]
    return "\n\n".join(parts) + "\n"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def targets_text(targets: list[dict[str, Any]]) -> str:
    """The PASS/MISS table; a target's ``unit`` is ``"x"`` (a ratio, default), ``"us"``,
    or any other text, written after the value as it is (``" faults"``)."""
    rows = []
    for t in targets:
        unit = t.get("unit") or "x"
        unit = " us" if unit == "us" else unit
        value = "" if t["value"] is None else f"{t['value']:.2f}{unit}"
        want = "" if t["threshold"] is None else f"{t['op']} {t['threshold']:g}{unit}"
        rows.append([t["target"], value, want, "PASS" if t["pass"] else "MISS", t["note"]])
    return "Targets\n\n" + table(["target", "value", "wanted", "", "note"], rows, right={1})


class Watchdog:
    """Calls ``stop`` when a section overruns its deadline, so that no wait outlives it.

    ``stop`` ends the section's processes; their peers' blocked waits then fail
    (EOF, :class:`shm.PeerDiedError`), and :meth:`check` says why.
    """

    def __init__(self, stop: Callable[[], None], seconds: float, what: str) -> None:
        self.stop = stop
        self.seconds = seconds
        self.what = what
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog {what}", daemon=True)

    def _run(self) -> None:
        if not self._done.wait(self.seconds):
            self.fired = True
            log(f"{self.what} overran {self.seconds:.0f} s: stopping its processes")
            self.stop()

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5.0)

    def check(self, exc: BaseException | None = None) -> None:
        if self.fired:
            raise RuntimeError(
                f"{self.what} overran its {self.seconds:.0f} s deadline: its processes were stopped"
            ) from exc


def write(name: str, result: dict[str, Any], text: str, out_dir: Path, compared: str) -> None:
    """``<name>.json`` and ``<name>.md`` (``-quick`` for quick runs) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = result["quick"]
    stem = name + ("-quick" if quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(
        f"# {name} benchmark{' (quick run)' if quick else ''}\n\n"
        f"Written by `python -m benchmarks {name}{' --quick' if quick else ''}` "
        f"on {result['date_utc']}; "
        f"numbers and settings in [{stem}.json]({stem}.json). Ratios compare {compared} "
        "measured side by side in the same run.\n\n"
        f"```text\n{text}```\n"
    )
    log(f"[{name}] wrote {stem}.json and {stem}.md in the results folder")


def cli(module: str, run: Callable[[bool, Path], dict[str, Any]], argv: list[str] | None) -> int:
    """``python -m benchmarks.<module> [--quick] [--out DIR]``; 1 if a section failed."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    return 1 if run(args.quick, args.out)["errors"] else 0
