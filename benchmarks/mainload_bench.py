"""Where one main process stops scaling: its CPU per sample, with more workers than cores.

This host has 2 cores; users have 32-128. Past the workers, what bounds a
loader is its main process: every sample's dispatch, bookkeeping and hand-off
runs there, on one core (the GIL). So each system's **main-process CPU time
per sample** is measured (``time.process_time`` of the main process: all its
threads, the pool's manager thread included) while W workers *sleep* instead
of computing (``time.sleep(SLEEP_S)`` a sample, then the sample is made):
sleeping workers take no CPU, so W = 4..16 of them on 2 cores is an honest
stand-in for W busy workers on W cores, as far as the main process is
concerned. The model is then one line: a main process saturates its core at
``1 / cpu_per_sample`` samples/s, whatever the number of workers.

Systems: the mpexec pipeline per sample and in batch mode, ``WorkerPool.map``
(one call a sample, its automatic chunks, and chunks of 64 calls),
``mpexec.torch.DataLoader`` and ``torch.utils.data.DataLoader`` (both: map-style
data set, batches of 64,
persistent workers). Samples: light (16 float32) and heavy (224x224x3
float32, 588 KiB). Rounds interleave the systems; medians and spreads.

Run with ``python -m benchmarks mainload`` (``--quick``: fewer rounds and sizes).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import RESULTS, cli, git_state, log, table, write

SLEEP_S = 0.002  # a worker's "work" per sample: 2 ms asleep
BATCH = 64
SHAPES = {"light": (16,), "heavy": (224, 224, 3)}


def sleepy_sample(index: Any) -> np.ndarray[Any, Any]:
    """Sample ``index`` after ``SLEEP_S`` asleep (a worker on a core of its own)."""
    time.sleep(SLEEP_S)
    shape = SHAPES[os.environ.get("MPEXEC_MAINLOAD_KIND", "light")]
    return np.full(shape, float(np.asarray(index).reshape(-1)[0] % 251), np.float32)


def sleepy_batch(indices: list[Any]) -> np.ndarray[Any, Any]:
    """A batch op: each of its samples as :func:`sleepy_sample` makes it."""
    return np.stack([sleepy_sample(i) for i in indices])


class _Source:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.array([info.idx_in_epoch], np.int64)


class _Dataset:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(sleepy_sample(i))


Epoch = tuple[Callable[[], int], Callable[[], None]]  # (run an epoch: samples, close)


def _pipeline(workers: int, n: int, batch_mode: bool) -> Epoch:
    import mpexec
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=workers, seed=1, prefetch_depth=2)
    def pipe() -> Any:
        index = fn.external_source(source=_Source(n), batch=False)
        f = sleepy_batch if batch_mode else sleepy_sample
        return fn.python_function(index, function=f, batch_processing=batch_mode)

    p = pipe()
    p.build()
    fresh = [True]

    def epoch() -> int:
        if not fresh[0]:
            p.reset()
        fresh[0] = False
        return sum(len(out) for (out,) in p)

    return epoch, p.close


def _pool_map(workers: int, n: int, chunksize: int | None) -> Epoch:
    import mpexec

    pool = mpexec.WorkerPool(workers)

    def epoch() -> int:
        got = 0
        batch: list[Any] = []
        for sample in pool.map(sleepy_sample, range(n), chunksize=chunksize, prefetch=2 * workers):
            batch.append(sample)
            if len(batch) == BATCH:
                got += len(np.stack(batch))
                batch = []
        return got + (len(np.stack(batch)) if batch else 0)

    return epoch, pool.shutdown


def _loader(workers: int, n: int, ours: bool) -> Epoch:
    if ours:
        from mpexec.torch import DataLoader
    else:
        from torch.utils.data import DataLoader
    loader = DataLoader(_Dataset(n), batch_size=BATCH, num_workers=workers, persistent_workers=True)

    def epoch() -> int:
        return sum(len(b) for b in loader)

    def close() -> None:
        # Persistent workers end with the loader's iterator, which it keeps.
        loader.__dict__["_iterator"] = None

    return epoch, close


def _systems(have_torch: bool) -> dict[str, Callable[[int, int], Any]]:
    systems: dict[str, Callable[[int, int], Any]] = {
        "mpexec pipeline, per sample": lambda w, n: _pipeline(w, n, False),
        "mpexec pipeline, batch mode": lambda w, n: _pipeline(w, n, True),
        "WorkerPool.map": lambda w, n: _pool_map(w, n, 1),
        "WorkerPool.map, automatic chunks": lambda w, n: _pool_map(w, n, None),
        "WorkerPool.map, chunks of 64": lambda w, n: _pool_map(w, n, 64),
    }
    if have_torch:
        systems["mpexec.torch.DataLoader"] = lambda w, n: _loader(w, n, True)
        systems["torch DataLoader"] = lambda w, n: _loader(w, n, False)
    return systems


def _measure(epoch: Callable[[], int]) -> tuple[float, float]:
    """(samples/s, main-process CPU µs a sample) over one epoch."""
    c0, t0 = time.process_time(), time.perf_counter()
    n = epoch()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return n / wall, 1e6 * cpu / n


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    have_torch = importlib.util.find_spec("torch") is not None
    workers_list = (2, 8) if quick else (2, 4, 8, 16)
    rounds = 2 if quick else 3
    kinds = ("light",) if quick else ("light", "heavy")
    systems = _systems(have_torch)
    warnings.filterwarnings("ignore", message=".*worker processes in total")  # on purpose
    res: dict[str, Any] = {}
    load0 = os.getloadavg()
    for kind in kinds:
        os.environ["MPEXEC_MAINLOAD_KIND"] = kind  # workers inherit it
        for workers in workers_list:
            ideal = workers / SLEEP_S
            n = BATCH * max(4, int(ideal * (0.5 if quick else 1.5)) // BATCH)
            if kind == "heavy":  # 588 KiB a sample: an epoch of 12 batches is plenty
                n = min(n, 12 * BATCH)
            started = {}
            for name, make in systems.items():
                epoch, close = make(workers, n)
                epoch()  # warm-up: workers started, shapes learned
                started[name] = (epoch, close)
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in systems}
            for r in range(rounds):
                names = list(systems)
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    got[name].append(_measure(started[name][0]))
            for _, close in started.values():
                close()
            for name, samples in got.items():
                rates = [s[0] for s in samples]
                cpus = [s[1] for s in samples]
                res.setdefault(kind, {}).setdefault(name, {})[str(workers)] = {
                    "samples_per_s": statistics.median(rates),
                    "rate_min": min(rates),
                    "rate_max": max(rates),
                    "ideal_per_s": ideal,
                    "main_cpu_us": statistics.median(cpus),
                    "main_cpu_us_min": min(cpus),
                    "main_cpu_us_max": max(cpus),
                }
            log(f"[mainload] {kind}, {workers} workers: done")
    rows = []
    for kind, by_system in res.items():
        for name, by_w in by_system.items():
            for w, f in by_w.items():
                rows.append(
                    [
                        kind,
                        name,
                        w,
                        f"{f['samples_per_s']:,.0f} / {f['ideal_per_s']:,.0f}",
                        (
                            f"{f['main_cpu_us']:.1f} ({f['main_cpu_us_min']:.1f}-"
                            f"{f['main_cpu_us_max']:.1f})"
                        ),
                        f"{1e6 / f['main_cpu_us']:,.0f}",
                    ]
                )
    commit, dirty = git_state("mpexec", "shm", "benchmarks")
    result = {
        "benchmark": "mainload",
        "quick": quick,
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "git_commit": commit,
        "git_dirty": dirty,
        "cpus": os.cpu_count(),
        "loadavg_start": list(load0),
        "loadavg_end": list(os.getloadavg()),
        "sleep_s": SLEEP_S,
        "results": res,
    }
    text = (
        f"Workers sleep {SLEEP_S * 1e3:.0f} ms a sample (ideal rate: workers / "
        f"{SLEEP_S * 1e3:.0f} ms); load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}.\n"
        "main CPU: µs of the main process's CPU time (all its threads) a sample, median "
        "(min-max) of the rounds; saturates at: 1 / main CPU, the samples/s at which the "
        "main process fills one core.\n\n"
        + table(
            ["samples", "system", "workers", "samples/s / ideal", "main CPU µs", "saturates at /s"],
            rows,
            right={2, 3, 4, 5},
        )
    )
    write("mainload", result, text, out_dir, "main-process CPU per sample")
    return result


def main(argv: list[str] | None = None) -> int:
    return cli("mainload_bench", run, argv)
