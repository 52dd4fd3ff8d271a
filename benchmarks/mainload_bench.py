"""Where one main process stops scaling: its CPU per sample, with more workers than cores.

This host has 2 cores; users have 32-128. Past the workers, what bounds a
loader is its main process: every sample's dispatch, bookkeeping and hand-off
runs there, on one core (the GIL). So each system's **main-process CPU time
per sample** is measured (``time.process_time`` of the main process: all its
threads, the pool's manager thread included) while W workers *sleep* instead
of computing (``time.sleep(w)`` a sample, then the sample is made): sleeping
workers take almost no CPU, so W = 16..128 of them on 2 cores stand in for W
busy workers on W cores, as far as the main process is concerned. The model is
then one line: ``X(W) = min(W / w, 1 / c)`` samples/s, where ``c`` is the
main-process CPU a sample (docs/scaling.md).

Systems: the mpexec pipeline per sample and in batch mode, ``WorkerPool.map``
(one call a sample, its automatic chunks, and chunks of 64 calls; and its
automatic chunks of calls that spin ``w`` of CPU instead of sleeping,
``map_auto_cpu``: those chunks carry a CPU time, so sleeping calls travel in
larger chunks than busy ones, and cost the main process less a call. With more
workers than cores, the spinning ones share the cores with the main process:
their rate is the host's, their main CPU a call still the library's),
``mpexec.torch.DataLoader`` and ``torch.utils.data.DataLoader`` (both: map-style
data set, batches of 64, persistent workers), and DALI's parallel
``external_source`` (the whole sample in DALI's Python workers). Samples:
light (16 float32) and heavy (224x224x3 float32, 588 KiB); ``w`` = 2 ms and
0.5 ms. Each round starts every system in turn (one at a time: 128 workers
each), runs a warm-up epoch, then a measured one; rounds rotate the order.
"Of ideal" divides by ``W / w'``, where ``w'`` is what one sample took here,
calibrated in this process (the kernel's timer slack makes a 0.5 ms sleep
~0.56 ms).

Beside them, **bare processes** (``bare``): W processes of no library, each
making its share of the epoch's samples in a plain loop and saying how many.
They are this host's own ceiling for W sleeping workers (each wake-up costs the
host tens of µs of CPU, and 2 cores run them all): "of ceiling" divides each
system's rate by theirs, measured in the same round. "Steady" is the rate over
the middle half of an epoch's batches (no start-up ramp, no tail of workers
with nothing left); an epoch is at least ``ROUNDS`` (``QUICK_ROUNDS``) batches
a worker, so that its middle half spans several. "Workers' CPU" is the CPU
time of all the main process's descendants a sample, and "host busy" the
share of all the host's CPUs in use over the epoch (others' processes too).

And **the floor** (``floor``): W processes of no library, sent a batch's first
index and answering with the batch's bytes over a pipe, 2 batches in flight a
worker. Its main CPU is what a batch, and the wake-ups it brings, cost this
host with none of mpexec's code: the least any loader of whole batches pays.

With ``--idle``, each sample's start and end in its worker are written down
(``time.monotonic``, one line a sample appended to a file per worker: ~10-30 µs
of the worker's CPU a sample, so only on request), and the workers' idle time
over the measured epoch is split three ways, as shares of W x the epoch's wall
time: **start** (before a worker's first sample: the ramp), **end** (after its
last one: the tail, workers with nothing left while others finish) and
**middle** (between its samples).

With ``--spin``, every system's samples spin ``w`` of the worker's CPU instead
of sleeping: busy workers, for a host with at least W + 1 cores (on fewer, the
workers share the cores with the main process and "of ideal" is the host's).
docs/scaling.md has a 16-core host's figures.

Run with ``python -m benchmarks mainload`` (``--quick``: fewer rounds and
sizes; ``--mainload-systems``, ``--workers``, ``--sleeps-ms`` and ``--kinds``
pick a subset, as ``--mainload-systems pipeline,torch --workers 16,64``).
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import RESULTS, git_state, log, table, write

BATCH = 64
SLEEPS = (0.002, 0.0005)  # a worker's "work" per sample, asleep
WORKERS = (2, 16, 64, 128)
SHAPES = {"light": (16,), "heavy": (224, 224, 3)}
EPOCH_S = 1.0  # an epoch's length at the ideal rate (0.25 s with --quick)
MAX_BATCHES = {"light": 2048, "heavy": 48}  # an epoch's cap, in batches
# An epoch's least batches a worker (light samples; heavy ones are capped above):
# with fewer, its start-up ramp and its tail are most of it (2 a worker at 64
# workers and 0.25 s: no steady state at all).
ROUNDS, QUICK_ROUNDS = 8, 4


class Sleepy:
    """Sample ``index`` after ``sleep`` seconds asleep (a worker on a core of its own).

    A picklable object rather than a module global set through the
    environment: worker processes forked from a server started earlier would
    not see a later change.
    """

    def __init__(self, sleep: float, kind: str, trace: str | None = None) -> None:
        self.sleep = sleep
        self.kind = kind
        self.shape = SHAPES[kind]
        self.trace = trace  # a folder: each sample's start and end, a file per process

    def work(self) -> None:
        time.sleep(self.sleep)

    def __call__(self, index: Any) -> np.ndarray[Any, Any]:
        t0 = time.monotonic()
        self.work()
        out = np.full(self.shape, float(np.asarray(index).reshape(-1)[0] % 251), np.float32)
        if self.trace is not None:
            fd = os.open(
                os.path.join(self.trace, str(os.getpid())),
                os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                0o600,
            )
            try:
                os.write(fd, f"{t0:.6f} {time.monotonic():.6f}\n".encode())
            finally:
                os.close(fd)
        return out


class Spinning(Sleepy):
    """Sample ``index`` after ``sleep`` seconds of the worker's CPU, spun (``map_auto_cpu``).

    Sleeping workers stand in for busy ones as far as the main process is
    concerned, except where its cost follows the calls' CPU: ``map()``'s
    automatic chunks carry a CPU time, so sleeping calls (little CPU) travel in
    larger chunks than calls that compute. On a host with fewer cores than
    workers these compete with the main process for the cores: their rate of
    "ideal" is then the host's, not the library's.
    """

    def work(self) -> None:
        end = time.thread_time() + self.sleep
        while time.thread_time() < end:
            pass


class SleepyBatch:
    """A batch op: each of its samples as :class:`Sleepy` makes it."""

    def __init__(self, sample: Sleepy) -> None:
        self.sample = sample

    def __call__(self, indices: list[Any]) -> np.ndarray[Any, Any]:
        return np.stack([self.sample(i) for i in indices])


class _Index:
    """A per-sample source: the sample's index (mpexec's pipeline)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.array([info.idx_in_epoch], np.int64)


class _Whole:
    """A per-sample source that makes the whole sample (DALI's parallel external_source)."""

    def __init__(self, n: int, sample: Sleepy) -> None:
        self.n = n
        self.sample = sample

    def __call__(self, info: Any) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return self.sample(info.idx_in_epoch)


class _Dataset:
    def __init__(self, n: int, sample: Sleepy) -> None:
        self.n = n
        self.sample = sample

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        return torch.from_numpy(self.sample(i))


# (run an epoch: samples, appending the time of each batch to the list given; close)
Epoch = tuple[Callable[[list[float]], int], Callable[[], None]]
Maker = Callable[[int, int, Sleepy], Epoch]


def _pipeline(workers: int, n: int, sample: Sleepy, batch_mode: bool) -> Epoch:
    import mpexec
    from mpexec import fn

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=workers, seed=1)
    def pipe() -> Any:
        index = fn.external_source(source=_Index(n), batch=False)
        f = SleepyBatch(sample) if batch_mode else sample
        return fn.python_function(index, function=f, batch_processing=batch_mode)

    p = pipe()
    p.build()
    fresh = [True]

    def epoch(marks: list[float]) -> int:
        if not fresh[0]:
            p.reset()
        fresh[0] = False
        got = 0
        for (out,) in p:
            got += len(out)
            marks.append(time.perf_counter())
        return got

    return epoch, p.close


def _pool_map(workers: int, n: int, sample: Sleepy, chunksize: int | None) -> Epoch:
    import mpexec

    pool = mpexec.WorkerPool(workers)

    def epoch(marks: list[float]) -> int:
        got = 0
        batch: list[Any] = []
        for one in pool.map(sample, range(n), chunksize=chunksize, prefetch=2 * workers):
            batch.append(one)
            if len(batch) == BATCH:
                got += len(np.stack(batch))
                marks.append(time.perf_counter())
                batch = []
        return got + (len(np.stack(batch)) if batch else 0)

    return epoch, pool.shutdown


def _loader(workers: int, n: int, sample: Sleepy, ours: bool) -> Epoch:
    if ours:
        from mpexec.torch import DataLoader
    else:
        from torch.utils.data import DataLoader
    loader = DataLoader(
        _Dataset(n, sample), batch_size=BATCH, num_workers=workers, persistent_workers=True
    )

    def epoch(marks: list[float]) -> int:
        got = 0
        for b in loader:
            got += len(b)
            marks.append(time.perf_counter())
        return got

    def close() -> None:
        # Persistent workers end with the loader's iterator, which it keeps.
        loader.__dict__["_iterator"] = None

    return epoch, close


def _dali(workers: int, n: int, sample: Sleepy) -> Epoch:
    from nvidia import dali
    from nvidia.dali import fn as dfn

    pipe = dali.Pipeline(
        batch_size=BATCH,
        device_id=None,
        seed=1,
        num_threads=1,
        py_num_workers=workers,
        py_start_method="fork",
    )
    with pipe:
        pipe.set_outputs(dfn.external_source(source=_Whole(n, sample), batch=False, parallel=True))
    pipe.build()
    fresh = [True]

    def epoch(marks: list[float]) -> int:
        if not fresh[0]:
            pipe.reset()
        fresh[0] = False
        got = 0
        while True:
            try:
                (out,) = pipe.run()
            except StopIteration:
                return got
            got += len(out)
            marks.append(time.perf_counter())

    def close() -> None:
        nonlocal pipe
        del pipe

    return epoch, close


def _bare_worker(conn: Any, sample: Sleepy) -> None:
    """Make ``count`` samples for each count received; reply with the count (0: stop)."""
    while True:
        count = conn.recv()
        if not count:
            return
        for i in range(count):
            sample(i)
        conn.send(count)


def _plain_processes(
    workers: int, target: Callable[..., None], sample: Sleepy
) -> tuple[list[Any], list[Any]]:
    """W processes running ``target(conn, sample)``, and our ends of their pipes
    (``forkserver``: no fork of a process with threads)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    conns, procs = [], []
    for _ in range(workers):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=target, args=(there, sample), daemon=True)
        proc.start()
        there.close()
        conns.append(here)
        procs.append(proc)
    return conns, procs


def _bare(workers: int, n: int, sample: Sleepy) -> Epoch:
    """W processes of no library, each making its share of the samples in a loop.

    The host's own ceiling for W sleeping workers: no dispatch, no results
    handed back, the epoch split evenly once (``forkserver``: no fork of a
    process with threads).
    """
    from multiprocessing.connection import wait

    conns, procs = _plain_processes(workers, _bare_worker, sample)

    def epoch(marks: list[float]) -> int:
        for i, conn in enumerate(conns):
            conn.send(n * (i + 1) // workers - n * i // workers)
        got, left = 0, list(conns)
        while left:
            ready = wait(left)
            for conn in [c for c in left if c in ready]:
                got += conn.recv()
                left.remove(conn)
        return got

    def close() -> None:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.send(0)
        for proc in procs:
            proc.join(10)
        for conn in conns:
            conn.close()

    return epoch, close


def _floor_worker(conn: Any, sample: Sleepy) -> None:
    """For each index received (8 bytes), its batch made; the index sent back (-1: stop)."""
    fd = conn.fileno()
    while True:
        data = os.read(fd, 8)
        if len(data) < 8 or (first := int.from_bytes(data, "little", signed=True)) < 0:
            return
        for i in range(BATCH):
            sample(first + i)
        os.write(fd, data)


def _floor(workers: int, n: int, sample: Sleepy) -> Epoch:
    """The least main-process work a batch through W processes: 8 bytes there and back.

    No library: each worker is sent a batch's first index over a socket pair and
    answers with it once the batch is made; the caller keeps 2 batches in flight
    a worker (``select`` and ``os.read``/``os.write``: no Python of a library's)
    and wraps a slot of a buffer as the batch, as a loader handing out views of
    shared memory does. Its main CPU is what a batch and the wake-ups it brings
    cost this host with none of mpexec's code (docs/scaling.md, "The floor at 2
    workers").
    """
    import select

    conns, procs = _plain_processes(workers, _floor_worker, sample)
    fds = [c.fileno() for c in conns]
    slots = np.zeros((2 * workers, BATCH, *sample.shape), np.float32)

    def epoch(marks: list[float]) -> int:
        batches, sent, done, got = -(-n // BATCH), 0, 0, 0
        for _ in range(2):
            for fd in fds:
                if sent < batches:
                    os.write(fd, sent.to_bytes(8, "little"))
                    sent += 1
        while done < batches:
            for fd in select.select(fds, [], [])[0]:
                first = int.from_bytes(os.read(fd, 8), "little")
                got += len(slots[first // BATCH % len(slots)])  # the batch: a view
                done += 1
                marks.append(time.perf_counter())
                if sent < batches:
                    os.write(fd, sent.to_bytes(8, "little"))
                    sent += 1
        return got

    def close() -> None:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.write(fd, (-1).to_bytes(8, "little", signed=True))
        for proc in procs:
            proc.join(10)
        for conn in conns:
            conn.close()

    return epoch, close


#: key -> (name in the tables, what it needs, maker)
SYSTEMS: dict[str, tuple[str, str | None, Maker]] = {
    "bare": ("bare processes (the host's ceiling)", None, _bare),
    "floor": ("the floor: 8 bytes a batch, no library", None, _floor),
    "pipeline": (
        "mpexec pipeline, per sample",
        None,
        lambda w, n, s: _pipeline(w, n, s, False),
    ),
    "pipeline_batch": (
        "mpexec pipeline, batch mode",
        None,
        lambda w, n, s: _pipeline(w, n, s, True),
    ),
    "map": ("WorkerPool.map, one call a sample", None, lambda w, n, s: _pool_map(w, n, s, 1)),
    "map_auto": (
        "WorkerPool.map, automatic chunks",
        None,
        lambda w, n, s: _pool_map(w, n, s, None),
    ),
    "map_auto_cpu": (
        "WorkerPool.map, automatic chunks, calls spin w of CPU (W > cores: they share the main's)",
        None,
        lambda w, n, s: _pool_map(w, n, Spinning(s.sleep, s.kind, s.trace), None),
    ),
    "map64": ("WorkerPool.map, chunks of 64", None, lambda w, n, s: _pool_map(w, n, s, 64)),
    "mpexec_torch": (
        "mpexec.torch.DataLoader",
        "torch",
        lambda w, n, s: _loader(w, n, s, True),
    ),
    "torch": ("torch DataLoader", "torch", lambda w, n, s: _loader(w, n, s, False)),
    "dali_parallel": ("DALI parallel external_source", "nvidia.dali", _dali),
}
#: Run by default: one call a sample is left out (100 µs a sample, known: docs/scaling.md).
DEFAULT_SYSTEMS = tuple(k for k in SYSTEMS if k != "map")


def _installed(module: str | None) -> bool:
    if module is None:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _calibrate(sample: Sleepy, count: int = 200) -> float:
    """Seconds one sample takes here (its sleep and making it), median of ``count``."""
    took = []
    for i in range(count):
        t0 = time.perf_counter()
        sample(i)
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def epoch_batches(kind: str, workers: int, samples: float, quick: bool) -> int:
    """An epoch's batches: ``samples`` (the epoch's length at the ideal rate) in batches,
    at least ``ROUNDS`` (``QUICK_ROUNDS``) a worker and 8, at most ``MAX_BATCHES``."""
    rounds = workers * (QUICK_ROUNDS if quick else ROUNDS)
    return min(MAX_BATCHES[kind], max(8, rounds, round(samples / BATCH)))


def steady_rate(marks: Sequence[float]) -> float | None:
    """Batches a second over the middle half of an epoch's batches (times in ``marks``);
    None under 8 batches."""
    a, b = len(marks) // 4, 3 * len(marks) // 4
    if len(marks) < 8 or marks[b] <= marks[a]:
        return None
    return (b - a) / (marks[b] - marks[a])


def idle_split(
    spans: Sequence[Sequence[tuple[float, float]]], t0: float, t1: float, workers: int
) -> tuple[float, float, float]:
    """Workers' idle time over an epoch from ``t0`` to ``t1``: (start, middle, end), as
    shares of ``workers`` x its wall time. ``spans``: per worker, its samples' (start, end);
    a worker with none is idle throughout (counted at the start)."""
    total = workers * (t1 - t0)
    start = end = busy = 0.0
    for worker in spans:
        rows = sorted(r for r in worker if r[0] >= t0)
        if rows:
            start += rows[0][0] - t0
            end += t1 - rows[-1][1]
            busy += sum(b - a for a, b in rows)
    start += (workers - sum(1 for rows in spans if rows)) * (t1 - t0)
    return start / total, (total - busy - start - end) / total, end / total


def _read_trace(folder: str) -> list[list[tuple[float, float]]]:
    spans = []
    for name in glob.glob(os.path.join(folder, "*")):
        with open(name) as f:
            rows = [(float(a), float(b)) for a, b in (line.split() for line in f)]
        spans.append(rows)
    return spans


def _clear_trace(folder: str) -> None:
    for name in glob.glob(os.path.join(folder, "*")):
        os.unlink(name)


def _descendants_cpu() -> float:
    """CPU seconds of every live descendant of this process (its workers, their servers)."""
    import psutil

    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _host_busy() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole host so far (every core, every process)."""
    import psutil

    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle, sum(t)


def _measure(
    epoch: Callable[[list[float]], int], trace: str | None = None, workers: int = 0
) -> dict[str, float | None]:
    """One epoch: samples/s, steady samples/s, main and workers' CPU µs a sample, host busy;
    with ``trace`` (the samples' folder), the workers' idle time at start, middle, end."""
    marks: list[float] = []
    if trace is not None:
        _clear_trace(trace)
    w0, h0 = _descendants_cpu(), _host_busy()
    m0 = time.monotonic()
    c0, t0 = time.process_time(), time.perf_counter()
    n = epoch(marks)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    m1 = time.monotonic()
    w1, h1 = _descendants_cpu(), _host_busy()
    steady = steady_rate(marks)
    idle = (None, None, None)
    if trace is not None:
        idle = idle_split(_read_trace(trace), m0, m1, workers)
    return {
        "idle_start": idle[0],
        "idle_middle": idle[1],
        "idle_end": idle[2],
        "rate": n / wall,
        "steady": None if steady is None else steady * n / len(marks),
        "main_us": 1e6 * cpu / n,
        "workers_us": 1e6 * (w1 - w0) / n,
        "host_busy": (h1[0] - h0[0]) / max(1e-9, h1[1] - h0[1]),
    }


def run(
    quick: bool = False,
    out_dir: Path = RESULTS,
    systems: Sequence[str] | None = None,
    workers: Sequence[int] | None = None,
    sleeps: Sequence[float] | None = None,
    kinds: Sequence[str] | None = None,
    idle: bool = False,
    spin: bool = False,
) -> dict[str, Any]:
    keys = [k for k in (systems or DEFAULT_SYSTEMS) if _installed(SYSTEMS[k][1])]
    skipped = [k for k in (systems or DEFAULT_SYSTEMS) if k not in keys]
    workers_list = tuple(workers or ((2, 16) if quick else WORKERS))
    sleep_list = tuple(sleeps or ((SLEEPS[0],) if quick else SLEEPS))
    kind_list = tuple(kinds or (("light",) if quick else ("light", "heavy")))
    rounds = 2 if quick else 3
    epoch_s = 0.25 if quick else EPOCH_S
    warnings.filterwarnings("ignore", message=".*worker processes in total")  # on purpose
    res: dict[str, Any] = {}
    load0 = os.getloadavg()
    t_start = time.perf_counter()
    trace = tempfile.mkdtemp(prefix="mpexec-mainload-") if idle else None
    try:
        _run_all(
            res, keys, kind_list, sleep_list, workers_list, rounds, epoch_s, quick, trace, spin
        )
    finally:
        if trace is not None:
            shutil.rmtree(trace, ignore_errors=True)
    return _report(res, skipped, load0, t_start, sleep_list, quick, out_dir, idle, spin)


def _run_all(
    res: dict[str, Any],
    keys: list[str],
    kind_list: Sequence[str],
    sleep_list: Sequence[float],
    workers_list: Sequence[int],
    rounds: int,
    epoch_s: float,
    quick: bool,
    trace: str | None,
    spin: bool = False,
) -> None:
    make = Spinning if spin else Sleepy
    for kind in kind_list:
        for sleep in sleep_list:
            sample = make(sleep, kind, trace)
            took = _calibrate(make(sleep, kind))
            for w in workers_list:
                ideal = w / took
                batches = epoch_batches(kind, w, ideal * epoch_s, quick)
                n = BATCH * batches
                got: dict[str, list[dict[str, float | None]]] = {k: [] for k in keys}
                loads = []
                for r in range(rounds):
                    for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                        epoch, close = SYSTEMS[key][2](w, n, sample)
                        try:
                            epoch([])  # warm-up: workers started, shapes and timings learned
                            got[key].append(_measure(epoch, trace, w))
                        finally:
                            close()
                    loads.append(os.getloadavg()[0])
                ceiling = (
                    statistics.median(float(x["rate"] or 0) for x in got["bare"])
                    if got.get("bare")
                    else None
                )
                for key, runs in got.items():
                    rates = [float(x["rate"] or 0) for x in runs]
                    cpus = [float(x["main_us"] or 0) for x in runs]
                    steadies = [float(x["steady"]) for x in runs if x["steady"] is not None]
                    rate = statistics.median(rates)
                    res.setdefault(kind, {}).setdefault(f"{sleep * 1e3:g} ms", {}).setdefault(
                        key, {}
                    )[str(w)] = {
                        "samples_per_s": rate,
                        "rate_min": min(rates),
                        "rate_max": max(rates),
                        "ideal_per_s": ideal,
                        "of_ideal": rate / ideal,
                        "of_ceiling": None if not ceiling else rate / ceiling,
                        "steady_of_ideal": (
                            statistics.median(steadies) / ideal if steadies else None
                        ),
                        "main_cpu_us": statistics.median(cpus),
                        "main_cpu_us_min": min(cpus),
                        "main_cpu_us_max": max(cpus),
                        "workers_cpu_us": statistics.median(
                            float(x["workers_us"] or 0) for x in runs
                        ),
                        "host_busy": statistics.median(float(x["host_busy"] or 0) for x in runs),
                        "epoch_samples": n,
                        "sample_s": took,
                        "loadavg": loads,
                        **{
                            f"idle_{part}": statistics.median(
                                float(x[f"idle_{part}"] or 0) for x in runs
                            )
                            for part in ("start", "middle", "end")
                            if trace is not None
                        },
                    }
                log(
                    f"[mainload] {kind}, {sleep * 1e3:g} ms, {w} workers: done "
                    f"(load {os.getloadavg()[0]:.1f})"
                )


def _report(
    res: dict[str, Any],
    skipped: list[str],
    load0: tuple[float, float, float],
    t_start: float,
    sleep_list: Sequence[float],
    quick: bool,
    out_dir: Path,
    idle: bool,
    spin: bool = False,
) -> dict[str, Any]:
    rows = []
    for kind, by_sleep in res.items():
        for sleep_name, by_system in by_sleep.items():
            for key, by_w in by_system.items():
                for w, f in by_w.items():
                    rows.append(
                        [
                            kind,
                            sleep_name,
                            SYSTEMS[key][0],
                            w,
                            f"{f['samples_per_s']:,.0f} / {f['ideal_per_s']:,.0f}",
                            f"{f['of_ideal']:.2f}",
                            "" if f["of_ceiling"] is None else f"{f['of_ceiling']:.2f}",
                            ("" if f["steady_of_ideal"] is None else f"{f['steady_of_ideal']:.2f}"),
                            (
                                f"{f['main_cpu_us']:.1f} ({f['main_cpu_us_min']:.1f}-"
                                f"{f['main_cpu_us_max']:.1f})"
                            ),
                            f"{1e6 / f['main_cpu_us']:,.0f}",
                            f"{f['workers_cpu_us']:.0f}",
                            f"{100 * f['host_busy']:.0f}%",
                            f"{min(f['loadavg']):.1f}-{max(f['loadavg']):.1f}",
                        ]
                        + (
                            [
                                " / ".join(
                                    f"{100 * f[f'idle_{part}']:.1f}"
                                    for part in ("start", "middle", "end")
                                )
                            ]
                            if idle
                            else []
                        )
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
        "sleeps_s": list(sleep_list),
        "spin": spin,
        "skipped": skipped,
        "duration_s": round(time.perf_counter() - t_start),
        "results": res,
        "errors": [],
    }
    text = (
        f"Workers {'spin w of CPU' if spin else 'sleep w'} a sample; ideal: workers / w', "
        f"w' what a sample took in this process; load average {load0[0]:.1f} -> "
        f"{os.getloadavg()[0]:.1f}"
        f"{'; not installed: ' + ', '.join(skipped) if skipped else ''}.\n"
        "main CPU: µs of the main process's CPU time (all its threads) a sample, median "
        "(min-max) of the rounds; saturates at: 1 / main CPU, the samples/s at which the "
        "main process fills one core; of ceiling: divided by the bare processes' rate (the "
        "host's own ceiling for W sleeping processes, same rounds); steady: of ideal over the "
        "middle half of the epoch's batches; workers' CPU: µs of CPU of all the main process's "
        "descendants a sample; host busy: of all CPUs, every process; load: the 1-minute load "
        "average after each round"
        + (
            "; idle: the workers' idle time at the epoch's start / middle / end, % of "
            "workers x its wall time (--idle: samples timed in the workers)"
            if idle
            else ""
        )
        + ".\n\n"
        + table(
            [
                "samples",
                "w",
                "system",
                "workers",
                "samples/s / ideal",
                "of ideal",
                "of ceiling",
                "steady",
                "main CPU µs",
                "saturates at /s",
                "workers' CPU µs",
                "host busy",
                "load",
            ]
            + (["idle start / middle / end %"] if idle else []),
            rows,
            right=set(range(3, 14 if idle else 13)),
        )
        + f"\n\ntook {result['duration_s']} s\n"
    )
    write("mainload", result, text, out_dir, "main-process CPU per sample")
    print(text)
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.mainload_bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    run(args.quick, args.out, **options(args))
    return 0


def add_arguments(parser: Any) -> None:
    """The mainload benchmark's own options (``python -m benchmarks`` has them too)."""
    parser.add_argument(
        "--mainload-systems",
        default=None,
        help=f"mainload only: a comma-separated subset of {','.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--workers",
        default=None,
        help="mainload only: comma-separated worker counts (default 2,16,64,128)",
    )
    parser.add_argument(
        "--sleeps-ms",
        default=None,
        help="mainload only: comma-separated sleeps a sample, in ms (default 2,0.5)",
    )
    parser.add_argument(
        "--kinds", default=None, help="mainload only: light, heavy or both (default both)"
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="mainload only: time each sample in its worker; the workers' idle time at "
        "the epoch's start, middle and end (a column)",
    )
    parser.add_argument(
        "--spin",
        action="store_true",
        help="mainload only: workers spin w of CPU a sample instead of sleeping (busy "
        "cores: meaningful only with at least W + 1 cores)",
    )


def options(args: Any) -> dict[str, Any]:
    """``run``'s keyword arguments from parsed options (``--systems`` checked here)."""
    out: dict[str, Any] = {}
    systems = args.mainload_systems.split(",") if args.mainload_systems else None
    if systems:
        unknown = [s for s in systems if s not in SYSTEMS]
        if unknown:
            raise SystemExit(f"mainload: unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
        out["systems"] = systems
    if args.workers:
        out["workers"] = [int(x) for x in args.workers.split(",")]
    if args.sleeps_ms:
        out["sleeps"] = [float(x) / 1e3 for x in args.sleeps_ms.split(",")]
    if getattr(args, "idle", False):
        out["idle"] = True
    if getattr(args, "spin", False):
        out["spin"] = True
    if args.kinds:
        kinds = list(SHAPES) if args.kinds == "both" else args.kinds.split(",")
        unknown = [k for k in kinds if k not in SHAPES]
        if unknown:
            raise SystemExit(f"mainload: unknown kinds {unknown}; known: {', '.join(SHAPES)}, both")
        out["kinds"] = kinds
    return out
