"""``if`` on a DataNode (DALI's conditional execution): what a branch saves, and what it costs.

One pipeline shape, three ways, batch 64, 2 workers, measured side by side
(rounds interleave them, the one going first rotating):

- ``if``: ``if even: y = heavy(x) else: y = light(x)``: ``heavy`` runs on
  the half of the batch its branch holds (enable_conditionals);
- ``select``: what a pipeline without conditionals does instead: ``heavy``
  and ``light`` on every sample, then a python_function keeps one per sample;
- ``plain``: ``light(x)`` on every sample, no condition (the floor).

``heavy`` sleeps ``SLEEP_S`` per sample (a worker busy on a core of its own,
without taking one: the host's load does not bend the figure), ``light``
returns at once. Figures, medians over the rounds with their range:
samples/s of each, the ratio ``if`` / ``select`` (the work a branch saves:
about 2 when half the samples take it), and the main process's CPU time per
sample (``time.process_time``, all its threads): what the split, the merge
and the branch's extra ops cost the scheduler, against ``plain``. Every
batch is checked against the expected values. Each pipeline has its own 2
workers and ``prefetch_depth=1``; a measure starts after an untimed batch, so
no batch was computed ahead of its clock.

Run with ``python -m benchmarks conditionals`` (``--quick``: fewer rounds).
"""

from __future__ import annotations

import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
from benchmarks._common import RESULTS, cli, git_state, log, table, write
from mpexec import fn

BATCH = 64
WORKERS = 2
SLEEP_S = 0.002  # heavy's work per sample


def index(info: Any) -> np.ndarray[Any, Any]:
    return np.full((16,), info.idx_in_batch, np.float32)


def even(info: Any) -> np.ndarray[Any, Any]:
    return np.array(info.idx_in_batch % 2 == 0)


def heavy(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    time.sleep(SLEEP_S)
    return x * 2


def light(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + 1


def select(p: np.ndarray[Any, Any], a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> Any:
    return a if p else b


def with_if() -> Any:
    x = fn.external_source(source=index, batch=False)
    if fn.external_source(source=even, batch=False):
        y = fn.python_function(x, function=heavy)
    else:
        y = fn.python_function(x, function=light)
    return y


def with_select() -> Any:
    x = fn.external_source(source=index, batch=False)
    p = fn.external_source(source=even, batch=False)
    a = fn.python_function(x, function=heavy)
    b = fn.python_function(x, function=light)
    return fn.python_function(p, a, b, function=select)


def plain() -> Any:
    return fn.python_function(fn.external_source(source=index, batch=False), function=light)


SYSTEMS = {"if": (with_if, True), "select": (with_select, False), "plain": (plain, False)}
WANT = [j * 2.0 if j % 2 == 0 else j + 1.0 for j in range(BATCH)]
WANT_PLAIN = [j + 1.0 for j in range(BATCH)]


def _measure(pipe: mpexec.Pipeline, name: str, iterations: int) -> tuple[float, float]:
    """(samples/s, main-process CPU us per sample) over ``iterations`` batches."""
    want = WANT_PLAIN if name == "plain" else WANT
    pipe.run()  # one iteration in flight (prefetch_depth=1) was computed before: untimed
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iterations):
        (y,) = pipe.run()
        assert [float(a[0]) for a in y] == want, name
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = iterations * BATCH
    return n / wall, cpu / n * 1e6


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    rounds, iterations = (2, 5) if quick else (5, 20)
    load0 = os.getloadavg()
    pipes = {}
    for name, (definition, conditional) in SYSTEMS.items():
        make = mpexec.pipeline_def(
            definition,
            batch_size=BATCH,
            num_workers=WORKERS,
            prefetch_depth=1,  # nothing computed ahead of the clock (see _measure)
            seed=1,
            enable_conditionals=conditional,
        )
        pipes[name] = make()
        pipes[name].build()
        _measure(pipes[name], name, 2)  # warm-up: workers started, shapes learned
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in SYSTEMS}
    try:
        for r in range(rounds):
            names = list(SYSTEMS)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                got[name].append(_measure(pipes[name], name, iterations))
            log(f"[conditionals] round {r + 1}/{rounds} done")
    finally:
        for pipe in pipes.values():
            pipe.close()
    res: dict[str, Any] = {}
    for name, samples in got.items():
        rates, cpus = [s[0] for s in samples], [s[1] for s in samples]
        res[name] = {
            "samples_per_s": statistics.median(rates),
            "rate_min": min(rates),
            "rate_max": max(rates),
            "main_cpu_us": statistics.median(cpus),
            "main_cpu_us_min": min(cpus),
            "main_cpu_us_max": max(cpus),
        }
    ratios = [a[0] / b[0] for a, b in zip(got["if"], got["select"], strict=True)]
    rows = [
        [
            name,
            f"{f['samples_per_s']:,.0f} ({f['rate_min']:,.0f}-{f['rate_max']:,.0f})",
            f"{f['main_cpu_us']:.1f} ({f['main_cpu_us_min']:.1f}-{f['main_cpu_us_max']:.1f})",
        ]
        for name, f in res.items()
    ]
    commit, dirty = git_state("mpexec", "shm", "benchmarks")
    result = {
        "benchmark": "conditionals",
        "quick": quick,
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "dirty": dirty,
        "settings": {
            "batch": BATCH,
            "workers": WORKERS,
            "sleep_s": SLEEP_S,
            "rounds": rounds,
            "iterations": iterations,
        },
        "load_before": load0,
        "load_after": os.getloadavg(),
        "systems": res,
        "if_over_select": {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "errors": [],
    }
    text = (
        f"batch {BATCH}, {WORKERS} workers, heavy = {SLEEP_S * 1e3:.0f} ms asleep a sample "
        f"on half the batch; load {load0[0]:.2f} before, {result['load_after'][0]:.2f} after\n\n"
        + table(["system", "samples/s (range)", "main CPU us/sample (range)"], rows)
        + f"\n\nif / select: {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) over {rounds} rounds\n"
    )
    print(text)
    write("conditionals", result, text, out_dir, "three pipelines of one shape")
    return result


if __name__ == "__main__":
    raise SystemExit(cli("conditionals_bench", run, None))
