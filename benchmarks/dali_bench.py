"""mpexec inside a real DALI pipeline: DALI's python_function alone, and spread over workers.

One DALI CPU pipeline (``device_id=None``, run synchronously:
``exec_async=False, exec_pipelined=False``): an ``external_source`` of
128x128x3 uint8 images, batch size 16, then ``fn.python_function(...,
batch_processing=True)`` whose work is ~4 ms of GIL-bound Python per sample
(calibrated here at start-up, the same for every system). Three systems,
each its own pipeline, measured side by side in one run (the systems take
turns, round after round, the one going first rotating), so that the ratios
hold on a loaded machine where absolute times do not:

- ``DALI alone``: the batch function loops over the samples in DALI's
  Python thread (DALI runs python_function there, under the GIL);
- ``DALI + WorkerPool.map``: a naive wrapper, ``list(pool.map(work, batch))``
  with 2 workers: one call per sample, each sample copied into shared memory
  by the pool as an argument;
- ``DALI + mpexec.dali``: ``mpexec.dali.python_function(work, num_workers=2)``:
  the batch copied once into one shared block, a few calls of many rows.

A round is made of blocks: 2 batches of each system in turn, the order
rotating from block to block, so that every system of a round meets the
same load (a round's phases are interleaved at ~0.1 s, not ~1 s). Samples/s
per round, and per round the ratio of each system to DALI alone (with the
CPU time the DALI process spent per sample: the work itself for DALI alone,
what handing it out costs for the others, which load does not change); the
median ratio and its range over the rounds are the figures. A control, more
systems in the same blocks, says what this machine allowed at that time:
the same work on a batch in one of 2 processes of a plain
``multiprocessing`` pool (no DALI, no mpexec), then split over both, on
batches each process made before timing, as DALI's source's are (and, as a
serial baseline beside DALI alone, the same loop in this process, which is
not in the ceiling: it ran the work 8-11% slower a sample in CPU time than
the plain processes). On a host loaded by other work, 2 processes get less
than 2 cores, and no system can exceed that ratio ("the host's 2-process
ceiling", which moved 1.56-1.80 from run to run here). So mpexec.dali's figure against it is
taken round by round: its ratio over the same round's ceiling, then the
median and range of those (and, with no serial baseline in it at all,
mpexec.dali's samples/s over the plain 2 processes'). Every output
is compared with the serial one, in every round. A probe section reports
where copies happen: what DALI hands the function (views of its own buffer?
back to back?), what the pool copied as arguments, and whether DALI copies
what the function returns.

Run with ``python -m benchmarks dali`` (``--quick`` for a smoke test); needs
DALI (``pip install -e ".[dali]"`` in a checkout; the wheel is for Linux x86_64).

The same rounds also measure DALI alone and mpexec.dali under **DALI's
default executor** (DALI 2.x: ``exec_dynamic``, asynchronous, prefetch
queue 2), a second figure beside the target's definition, which stays the
synchronous one. There, DALI runs the function in its executor thread while
the caller's ``run()`` feeds the next batch's input and takes the outputs, so
part of DALI's own work between two calls of the function leaves the
function's thread. Such a pipeline computes ``prefetch_queue_depth - 1``
batches ahead of what was asked: each of its blocks ends once that batch is
done too (``_Counted``), so that none of its work falls in another system's
block, and a block still holds as many batches' work as it returns.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
import mpexec.dali
from benchmarks._common import (
    RESULTS,
    cli,
    closing,
    fmt_time,
    log,
    stamp,
    table,
    targets_text,
    write,
)

WORKERS = 2
BATCH = 16
SHAPE = (128, 128, 3)
WORK_SECONDS = 0.004  # per sample
TARGET_RATIO = 1.9  # mpexec.dali over DALI alone, 2 workers (issue 22)
TARGET_OF_CEILING = 0.97  # that ratio over the host's 2-process ceiling (issue 37)
#: The two systems that run again under DALI's default executor (and their names there).
DEFAULT_EXECUTOR = ", DALI's default executor"
ALONE, OURS = "DALI alone", "DALI + mpexec.dali"


class Work:
    """~``seconds`` of GIL-bound Python per sample, then a cheap, checkable change."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        acc = 0
        for i in range(self.loops):
            acc = (acc * 31 + i) & 0xFFFF
        return image ^ np.uint8(acc & 0xFF)


def calibrate(seconds: float) -> Work:
    """A :class:`Work` that takes about ``seconds`` of CPU time (of this thread: the
    same on a loaded machine, where its wall time is longer)."""
    probe = Work(20_000)
    image = np.zeros(SHAPE, np.uint8)
    best = min(_cpu_time(probe, image) for _ in range(5))
    return Work(max(1000, int(20_000 * seconds / best)))


def _cpu_time(work: Work, image: np.ndarray[Any, Any]) -> float:
    t0 = time.thread_time()
    work(image)
    return time.thread_time() - t0


def images(iteration: int, rows: range = range(BATCH)) -> list[np.ndarray[Any, Any]]:
    """The batch of one iteration (or its ``rows``): images made from their index."""
    base = iteration * BATCH
    return [
        np.full(SHAPE, (base + j) % 251, np.uint8) + np.arange(SHAPE[2], dtype=np.uint8)
        for j in rows
    ]


class _Batches:
    """The DALI source: batch ``i`` of the pre-made ones, round and round."""

    def __init__(self, n: int) -> None:
        self.batches = [images(i) for i in range(n)]

    def __call__(self, info: Any) -> list[np.ndarray[Any, Any]]:
        return self.batches[info.iteration % len(self.batches)]


class _Alone:
    def __init__(self, work: Work) -> None:
        self.work = work

    def __call__(self, batch: list[Any]) -> list[Any]:
        return [self.work(x) for x in batch]


class _NaiveMap:
    def __init__(self, work: Work, pool: mpexec.WorkerPool) -> None:
        self.work, self.pool = work, pool

    def __call__(self, batch: list[Any]) -> list[Any]:
        return list(self.pool.map(self.work, batch, timeout=120))


class _Counted:
    """A DALI function that counts its calls that returned (DALI's executor thread
    makes them under the default executor): how far a pipeline has computed."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.done = 0
        self.changed = threading.Condition()

    def __call__(self, *batch: Any) -> Any:
        out = self.function(*batch)
        with self.changed:
            self.done += 1
            self.changed.notify_all()
        return out

    def wait_for(self, calls: int) -> None:
        """Until ``calls`` calls have returned (the batch DALI computes ahead); asleep,
        not polling: a poll would take CPU from the workers."""
        with self.changed:
            self.changed.wait_for(lambda: self.done >= calls, timeout=120)


def _pipeline(function: Callable[..., Any], n_batches: int, default: bool = False) -> Any:
    from nvidia.dali import fn, pipeline_def

    # Synchronous: all of an iteration's work happens inside run(), so a pipeline
    # waiting for its turn computes nothing ahead (which would compete for the CPU
    # with the one being measured, and make short rounds look fast). ``default``:
    # DALI's default executor, whose batch computed ahead the caller waits for.
    options = {} if default else {"exec_async": False, "exec_pipelined": False}

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, **options)
    def graph() -> Any:
        x = fn.external_source(source=_Batches(n_batches), batch=True, batch_info=True)
        return fn.python_function(x, function=function, batch_processing=True)

    pipe = graph()
    pipe.build()
    return pipe


#: This process's batches for the control, made before any timing (:func:`premake`),
#: as DALI's source's are (:class:`_Batches`).
_PREMADE: list[list[np.ndarray[Any, Any]]] = []


def premake(n: int) -> None:
    """Make the control's ``n`` batches in this process (the parent, and each plain
    process as its pool's initializer): the control's timed work a sample is then
    the function alone, as inside DALI, whose source hands out batches made
    before timing. Made inside the timed loop (~0.12 ms of CPU an image here), they
    cost the control ~3.5% of a ~3.4 ms sample that DALI alone did not pay."""
    _PREMADE[:] = [images(i) for i in range(n)]


def _work_on(args: tuple[Work, int, int, int]) -> float:
    """The control's task, in a plain process: ``work`` on rows ``a:b`` of batch ``i``
    (of the batches :func:`premake` made in that process). Returns the CPU time it
    took (of the thread that ran it)."""
    work, i, a, b = args
    t0 = time.thread_time()
    for x in _PREMADE[i % len(_PREMADE)][a:b]:
        work(x)
    return time.thread_time() - t0


def _serial(work: Work, batches: range) -> float:
    """The serial baseline: ``work`` on whole batches, in this process (the one DALI
    alone runs in). Returns the CPU time the work took."""
    return sum(_work_on((work, i, 0, BATCH)) for i in batches)


def _one_plain(work: Work, batches: range, executor: Any) -> float:
    """The control's first half: each whole batch in one of the 2 plain processes (the
    other idle). Returns the CPU time the work took there."""
    return sum(t for i in batches for t in executor.map(_work_on, [(work, i, 0, BATCH)]))


def _parallel(work: Work, batches: range, executor: Any) -> float:
    """The control's second half: each batch split over the 2 plain processes. Returns
    the CPU time the work took there (both processes)."""
    half = BATCH // 2
    return sum(
        t
        for i in batches
        for t in executor.map(_work_on, [(work, i, 0, half), (work, i, half, BATCH)])
    )


def _pace_task(args: tuple[Work, int]) -> float:
    """``work`` on ``n`` blank images where this runs; the CPU time it took (this thread's)."""
    work, n = args
    image = np.zeros(SHAPE, np.uint8)
    t0 = time.thread_time()
    for _ in range(n):
        work(image)
    return time.thread_time() - t0


def pace(work: Work, ours: Any, plain: Any, rounds: int, n: int = 4) -> dict[str, dict[str, Any]]:
    """The work's CPU a sample at the same moment, over a plain process's, round by round:
    one of mpexec.dali's workers (``ours``, an executor-like ``submit``) while one plain
    process (``plain``) runs the same, then this process while a plain process does.

    Taken at the same moment, the host's drift cancels, which a ratio between blocks
    does not quite. In small probes (docs/dali.md, "The work's pace at the same
    moment") an mpexec worker read 0.94-1.16x (median 1.10) of a plain process at once
    on a quiet host with address-space randomisation on (20 of 21 runs above 1),
    0.91-1.11x with it off (median 0.99): the pace depends on the processes' layout,
    by a lever not found; this line says what each run drew."""
    over: dict[str, list[float]] = {OURS: [], SERIAL: []}
    for _ in range(rounds):
        theirs = plain.submit(_pace_task, (work, n))
        mine = ours.submit(_pace_task, (work, n))
        over[OURS].append(mine.result() / theirs.result())
        theirs = plain.submit(_pace_task, (work, n))
        here = _pace_task((work, n))
        over[SERIAL].append(here / theirs.result())
    return {k: _spread(v) for k, v in over.items()}


#: The serial baseline in this process, and the control's two halves (the same two
#: plain processes: one of them, then both), measured as more systems in every block.
SERIAL, ONE_PLAIN, PARALLEL = "plain, 1 process", "plain, 1 of the 2", "plain, 2 processes"
CONTROL = (SERIAL, ONE_PLAIN, PARALLEL)


def _queued() -> float | None:
    """Seconds this thread has spent ready to run but waiting for a CPU (Linux's
    schedstat; None elsewhere): wall time a CPU-bound loop lost to other tasks."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def schedule(
    systems: list[str], iterations: int, block: int, round_: int
) -> Iterator[tuple[str, range]]:
    """One round: ``block`` batches of each system in turn, until every system has made
    ``iterations``; the order rotates from block to block (and from round to round),
    so that a change in the host's load meets every system alike."""
    for c, start in enumerate(range(0, iterations, block)):
        k = (round_ + c) % len(systems)
        for name in systems[k:] + systems[:k]:
            yield name, range(start, min(start + block, iterations))


def paired(rates: dict[str, list[float]], ours: str, alone: str) -> dict[str, list[float]]:
    """Round by round, from rates measured in the same round: the host's 2-process
    ceiling (the 2 plain processes over one of themselves), ``ours`` over ``alone``,
    that ratio over the ceiling, and ``ours`` over the plain 2 processes directly.

    The ceiling's two halves run in the same processes: over this process's serial
    loop instead, it read 2.07-2.26x on a quiet host, because this process ran the same
    work ~8-11% slower a sample (CPU time) than the plain processes did; over one of
    them, it is what a second process adds on this host. The ratio is still taken
    over at most :data:`WORKERS` (``of_ceiling``): 2 processes cannot do more than
    twice one's work by their CPUs."""
    ceiling = [p / s for p, s in zip(rates[PARALLEL], rates[ONE_PLAIN], strict=True)]
    ratio = [o / a for o, a in zip(rates[ours], rates[alone], strict=True)]
    return {
        "ceiling": ceiling,
        "ratio": ratio,
        "of_ceiling": [r / min(c, WORKERS) for r, c in zip(ratio, ceiling, strict=True)],
        "vs_plain_2_processes": [o / p for o, p in zip(rates[ours], rates[PARALLEL], strict=True)],
    }


def beyond_work(
    rates: dict[str, list[float]], work_us: list[float], names: list[str]
) -> dict[str, float]:
    """Per system, the median over rounds of a batch's wall time beyond its work: the
    batch's period less the busiest worker's samples at the serial control's CPU a
    sample (its work alone) in that round. What the workers waited a batch: DALI's own
    steps, handing out and joining (issue 37's model of the figure is made of these)."""
    out = {}
    for name in names:
        share = -(-BATCH // (WORKERS if name in (OURS, PARALLEL) else 1))
        out[name] = statistics.median(
            (BATCH / r - share * w / 1e6) * 1e3 for r, w in zip(rates[name], work_us, strict=True)
        )
    return out


def work_cpu_over_serial(
    work_cpu: dict[str, list[float]], workers: list[float]
) -> dict[str, dict[str, Any]]:
    """The work's CPU a sample where it ran over this process's serial loop's, round by
    round: the control's two halves and mpexec.dali's workers (rounds where the op gave
    no reading are left out). On a shared host the same function's CPU a sample drifts
    by up to ~10% from one moment to the next, in every kind of process alike (fresh
    processes of each kind, alternated, docs/dali.md): a ratio within a round cancels
    most of it, where the figures' own ranges across rounds do not."""
    serial = work_cpu[SERIAL]
    rows = {k: work_cpu[k] for k in (ONE_PLAIN, PARALLEL)}
    rows[OURS] = workers
    out = {}
    for name, values in rows.items():
        ratios = [v / s for v, s in zip(values, serial, strict=True) if s > 0 and not math.isnan(v)]
        if ratios:
            out[name] = _spread(ratios)
    return out


def _spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "rounds": values,
    }


def throughput(
    functions: dict[str, Callable[..., Any]],
    work: Work,
    iterations: int,
    rounds: int,
    executor: Any,
    block: int = 2,
) -> dict[str, Any]:
    reference = [np.stack([work(x) for x in images(i)]) for i in range(iterations)]
    pipes = {name: _pipeline(f, iterations) for name, f in functions.items()}
    counted = {
        name + DEFAULT_EXECUTOR: _Counted(functions[name])
        for name in (ALONE, OURS)
        if name in functions
    }
    ahead = {}  # run() calls of a default executor's pipeline make this many more batches
    for name, f in counted.items():
        pipes[name] = _pipeline(f, iterations, default=True)
        ahead[name] = pipes[name].prefetch_queue_depth - 1
    premake(iterations)  # the serial control's batches (the plain processes make their own)
    runs = dict.fromkeys(pipes, 0)  # run() calls so far: run k returns batch k % iterations
    systems = [*pipes, *CONTROL]
    rates: dict[str, list[float]] = {k: [] for k in systems}
    # This process's CPU a sample: the pipelines', and the serial control's (whose work a
    # sample should be DALI alone's, less DALI's own: the two baselines' check).
    cpu: dict[str, list[float]] = {k: [] for k in [*pipes, SERIAL]}
    # The main thread's wait for a CPU a sample in the baselines' blocks (DALI alone runs
    # the function on it): where their wall time went that their CPU time does not show.
    queued: dict[str, list[float]] = {ALONE: [], SERIAL: []}
    # The control's work a sample, CPU time of the thread running it (this one, one plain
    # process, each of the two): the halves of a like-for-like ceiling read alike.
    work_cpu: dict[str, list[float]] = {k: [] for k in CONTROL}
    # And mpexec.dali's workers': the op's own reading of its last batch (a chunk's CPU
    # time in the worker, its samples' work and their write into the output block).
    workers_cpu: list[float] = []
    # The same a round (the median of its blocks' readings): each round's figures over the
    # serial loop's of that round, so that the host's drift from round to round cancels.
    workers_by_round: list[float] = []
    identical = dict.fromkeys(pipes, True)
    for name, pipe in pipes.items():  # warm up: workers started, functions cached
        pipe.run()
        runs[name] += 1
        if name in counted:
            counted[name].wait_for(runs[name] + ahead[name])
    _parallel(work, range(1), executor)
    for r in range(rounds):
        spent = dict.fromkeys(systems, 0.0)
        cpu_spent = dict.fromkeys(cpu, 0.0)
        work_spent = dict.fromkeys(CONTROL, 0.0)
        seen_in_round: list[float] = []
        for name, batches in schedule(systems, iterations, block, r):
            q0, c0, t0 = _queued(), time.process_time(), time.perf_counter()
            if name == SERIAL:
                work_spent[name] += _serial(work, batches)
            elif name == ONE_PLAIN:
                work_spent[name] += _one_plain(work, batches, executor)
            elif name == PARALLEL:
                work_spent[name] += _parallel(work, batches, executor)
            else:
                pipe = pipes[name]
                # DALI reuses an output's memory at the next run(): copied at once (~0.1 ms).
                outs = [np.array(pipe.run()[0].as_tensor()) for _ in batches]
                seen = getattr(functions.get(name), "_per_sample", None)  # mpexec.dali's
                if name == OURS and seen:
                    workers_cpu.append(seen * 1e6)
                    seen_in_round.append(seen * 1e6)
                if name in counted:  # its batch ahead is this block's work too
                    counted[name].wait_for(runs[name] + len(batches) + ahead[name])
            spent[name] += time.perf_counter() - t0
            q1 = _queued()
            if name in queued and q0 is not None and q1 is not None:
                queued[name].append((q1 - q0) / (len(batches) * BATCH) * 1e6)
            if name in cpu_spent:
                cpu_spent[name] += time.process_time() - c0
            if name in pipes:
                for k, out in enumerate(outs, start=runs[name]):
                    identical[name] &= bool(np.array_equal(out, reference[k % iterations]))
                runs[name] += len(batches)
        for name in systems:
            rates[name].append(iterations * BATCH / spent[name])
        for name, per_sample in cpu.items():
            per_sample.append(cpu_spent[name] / (iterations * BATCH) * 1e6)
        for name, per_sample in work_cpu.items():
            per_sample.append(work_spent[name] / (iterations * BATCH) * 1e6)
        workers_by_round.append(statistics.median(seen_in_round) if seen_in_round else math.nan)
    base = rates[ALONE]
    pairs = paired(rates, OURS, ALONE)
    out: dict[str, Any] = {
        "samples_per_round": iterations * BATCH,
        "block": block,
        "host_ceiling": _spread(pairs["ceiling"]),
        "mpexec_dali_of_ceiling": _spread(pairs["of_ceiling"]),
        "mpexec_dali_vs_plain_2_processes": _spread(pairs["vs_plain_2_processes"]),
        "control_samples_per_s": {k: rates[k] for k in CONTROL},
        "control_work_cpu_us_per_sample": {k: _spread(v) for k, v in work_cpu.items()},
        "mpexec_dali_workers_cpu_us_per_sample": _spread(workers_cpu) if workers_cpu else None,
        "work_cpu_over_serial": work_cpu_over_serial(work_cpu, workers_by_round),
        "serial_cpu_us_per_sample": statistics.median(cpu[SERIAL]),
        "serial_vs_alone": _spread([s / a for s, a in zip(rates[SERIAL], base, strict=True)]),
        "queued_us_per_sample": {k: statistics.median(v) for k, v in queued.items() if v},
        "beyond_work_ms_per_batch": beyond_work(rates, cpu[SERIAL], [ALONE, OURS, *CONTROL]),
        "by_system": {},
    }
    if OURS + DEFAULT_EXECUTOR in pipes:
        dyn = paired(rates, OURS + DEFAULT_EXECUTOR, ALONE + DEFAULT_EXECUTOR)
        out["default_executor"] = {
            "mpexec_dali_of_ceiling": _spread(dyn["of_ceiling"]),
            "mpexec_dali_vs_plain_2_processes": _spread(dyn["vs_plain_2_processes"]),
            "mpexec_dali_vs_synchronous": _spread(
                [d / s for d, s in zip(rates[OURS + DEFAULT_EXECUTOR], rates[OURS], strict=True)]
            ),
        }
    for name in pipes:
        # Each to DALI alone under its own executor.
        alone = rates[ALONE + DEFAULT_EXECUTOR] if name.endswith(DEFAULT_EXECUTOR) else base
        ratios = [r / b for r, b in zip(rates[name], alone, strict=True)]
        out["by_system"][name] = {
            "samples_per_s": rates[name],
            "dali_process_cpu_us_per_sample": statistics.median(cpu[name]),
            "ratio_vs_alone": _spread(ratios),
            "identical": identical[name],
        }
    return out


def probe(work: Work) -> dict[str, Any]:
    """Where copies happen, measured on a short run of each configuration."""
    seen: dict[str, Any] = {}

    def look(batch: list[Any]) -> list[Any]:
        arrays = [np.asarray(x) for x in batch]
        step = arrays[0].nbytes
        seen["views_of_dali_memory"] = all(not a.flags.owndata for a in arrays)
        seen["back_to_back"] = all(
            a.ctypes.data == arrays[0].ctypes.data + i * step for i, a in enumerate(arrays)
        )
        seen["writable"] = all(a.flags.writeable for a in arrays)
        out = [np.array(a) for a in arrays]
        seen["returned_at"] = [a.ctypes.data for a in out]
        seen["returned"] = out
        return out

    def after(batch: list[Any]) -> list[Any]:
        seen["received_at"] = [np.asarray(a).ctypes.data for a in batch]
        return list(batch)

    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None)
    def graph() -> Any:
        x = fn.external_source(source=_Batches(2), batch=True, batch_info=True)
        y = fn.python_function(x, function=look, batch_processing=True)
        return fn.python_function(y, function=after, batch_processing=True)

    pipe = graph()
    pipe.build()
    pipe.run()
    batch_bytes = BATCH * int(np.prod(SHAPE))
    out = {
        "dali_hands_views_of_its_buffer": seen["views_of_dali_memory"],
        "dali_batch_back_to_back": seen["back_to_back"],
        "dali_inputs_writable": seen["writable"],
        "dali_copies_returned_arrays": seen["returned_at"] != seen["received_at"],
        "batch_bytes": batch_bytes,
    }
    with mpexec.WorkerPool(WORKERS) as pool:
        naive = _NaiveMap(work, pool)
        before = pool.stats().bytes_copied
        naive(images(0))
        out["naive_bytes_copied_by_pool_per_batch"] = pool.stats().bytes_copied - before
        spread = mpexec.dali.python_function(work, pool=pool)
        before = pool.stats().bytes_copied
        spread(images(0))
        out["mpexec_dali_bytes_copied_by_pool_per_batch"] = pool.stats().bytes_copied - before
    return out


#: Linux's personality flag that turns address-space randomisation off for a process
#: and what it execs (``setarch -R``).
_ADDR_NO_RANDOMIZE = 0x0040000


def randomised_layout(proc: Path = Path("/proc")) -> bool | None:
    """Whether this process's address space is laid out at random (Linux's ASLR on, and
    not turned off for this process, e.g. by ``setarch -R``); None where unknown. The
    workers' pace at this work over a plain process's depends on it (:func:`pace`)."""
    try:
        if (proc / "sys/kernel/randomize_va_space").read_text().strip() == "0":
            return False
        return not int((proc / "self/personality").read_text(), 16) & _ADDR_NO_RANDOMIZE
    except (OSError, ValueError):
        return None


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    try:
        import nvidia.dali
    except ImportError as exc:
        log(f"[dali] skipped (not installed): {exc}")
        return {"quick": quick, "skipped": str(exc), "errors": []}

    iterations, rounds = (4, 2) if quick else (12, 11)
    load_before = os.getloadavg()
    result: dict[str, Any] = {
        **stamp(
            quick, numpy=np.__version__, dali=nvidia.dali.__version__, mpexec=mpexec.__version__
        ),
        "settings": {
            "workers": WORKERS,
            "batch_size": BATCH,
            "image": list(SHAPE),
            "iterations_per_round": iterations,
            "rounds": rounds,
            "randomised_layout": randomised_layout(),
        },
        "errors": [],
    }
    t_start = time.perf_counter()
    work = calibrate(WORK_SECONDS)
    result["settings"]["work_ms_per_sample"] = round(
        statistics.median(_cpu_time(work, np.zeros(SHAPE, np.uint8)) for _ in range(5)) * 1e3, 2
    )
    try:
        log("[dali] probe")
        result["copies"] = probe(work)
        log("[dali] throughput")
        ctx = multiprocessing.get_context("forkserver" if sys.platform == "linux" else "spawn")
        with (
            mpexec.WorkerPool(WORKERS) as pool,
            ProcessPoolExecutor(
                WORKERS, mp_context=ctx, initializer=premake, initargs=(iterations,)
            ) as executor,
        ):
            spread = mpexec.dali.python_function(work, num_workers=WORKERS)
            try:
                functions = {
                    ALONE: _Alone(work),
                    "DALI + WorkerPool.map": _NaiveMap(work, pool),
                    OURS: spread,
                }
                result["throughput"] = throughput(functions, work, iterations, rounds, executor)
                result["pace_same_moment"] = pace(work, spread.pool, executor, 4 if quick else 24)
            finally:
                spread.close()
    except Exception as exc:
        result["errors"].append(f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    result["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    result["duration_s"] = round(time.perf_counter() - t_start, 1)
    result["targets"] = targets(result)
    text = report(result)
    print(text)
    write("dali", result, text, out_dir, "DALI alone and DALI with mpexec")
    return result


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    tp = result.get("throughput")
    if not tp:
        return []
    ours = tp["by_system"]["DALI + mpexec.dali"]["ratio_vs_alone"]["median"]
    naive = tp["by_system"]["DALI + WorkerPool.map"]["ratio_vs_alone"]["median"]
    of = tp["mpexec_dali_of_ceiling"]
    return [
        {
            "target": "DALI + mpexec.dali vs DALI alone, 2 workers",
            "value": ours,
            "op": ">=",
            "threshold": TARGET_RATIO,
            "pass": ours >= TARGET_RATIO,
            "note": "median of per-round ratios",
        },
        {
            "target": "DALI + mpexec.dali vs the host's 2-process ceiling",
            "value": of["median"],
            "op": ">=",
            "threshold": TARGET_OF_CEILING,
            "pass": of["median"] >= TARGET_OF_CEILING,
            "note": f"median of per-round ratios, each over its own round's ceiling "
            f"(range {of['min']:.2f} - {of['max']:.2f})",
        },
        {
            "target": "mpexec.dali vs the naive WorkerPool.map wrapper",
            "value": ours / naive,
            "op": ">",
            "threshold": 1.0,
            "pass": ours > naive,
            "note": f"naive: {naive:.2f}x DALI alone",
        },
    ]


def _control_cpu_line(tp: dict[str, Any]) -> str:
    """The control's work a sample in CPU time, where it ran: its two halves should read
    alike (a like-for-like ceiling); this process's serial loop beside them."""
    w = tp.get("control_work_cpu_us_per_sample")
    if not w:
        return ""
    where = {SERIAL: "this process", ONE_PLAIN: "1 plain process", PARALLEL: "each of 2"}
    rows = {where[k]: v for k, v in w.items()}
    if tp.get("mpexec_dali_workers_cpu_us_per_sample"):
        rows["mpexec.dali's workers"] = tp["mpexec_dali_workers_cpu_us_per_sample"]
    return (
        "the work a sample, CPU time where it ran: "
        + ", ".join(
            f"{k} {fmt_time(v['median'])} ({fmt_time(v['min'])} - {fmt_time(v['max'])})"
            for k, v in rows.items()
        )
        + "\n"
        + _over_serial_line(tp)
    )


def _over_serial_line(tp: dict[str, Any]) -> str:
    over = tp.get("work_cpu_over_serial")
    if not over:
        return ""
    where = {ONE_PLAIN: "1 plain process", PARALLEL: "each of 2", OURS: "mpexec.dali's workers"}
    return (
        "the same over this process's, round by round: "
        + ", ".join(
            f"{where[k]} {v['median']:.3f}x ({v['min']:.3f} - {v['max']:.3f})"
            for k, v in over.items()
        )
        + "\n"
    )


def _pace_line(over: dict[str, dict[str, Any]]) -> str:
    where = {OURS: "mpexec.dali's workers", SERIAL: "this process"}
    return (
        "the work's pace at the same moment, over a plain process's (one of each at once; "
        "it depends on the processes' address-space layout): "
        + ", ".join(
            f"{where[k]} {v['median']:.3f}x ({v['min']:.3f} - {v['max']:.3f})"
            for k, v in over.items()
        )
    )


_LAYOUT = {True: "on", False: "off (setarch -R)"}


def report(result: dict[str, Any]) -> str:
    env, st = result["env"], result["settings"]
    load = result["load_avg"]
    parts = [
        (
            f"DALI {env['dali']} CPU pipeline with a python_function of "
            f"{st.get('work_ms_per_sample', '?')} ms CPU/sample (batch {st['batch_size']}, "
            f"{'x'.join(map(str, st['image']))} uint8), {st['workers']} workers; Python "
            f"{env['python']}, {env['cpus']} CPUs; load average {load['before'][0]:.1f} before, "
            f"{load['after'][0]:.1f} after; address-space randomisation "
            f"{_LAYOUT.get(st.get('randomised_layout'), 'unknown')}"
        )
    ]
    tp = result.get("throughput")
    if tp:
        rows = []
        for name, row in tp["by_system"].items():
            r = row["ratio_vs_alone"]
            rates = row["samples_per_s"]
            rows.append(
                [
                    name,
                    f"{statistics.median(rates):.1f}",
                    f"{min(rates):.1f} - {max(rates):.1f}",
                    f"{r['median']:.2f}x",
                    f"{r['min']:.2f} - {r['max']:.2f}",
                    fmt_time(row["dali_process_cpu_us_per_sample"]),
                    "yes" if row["identical"] else "NO",
                ]
            )
        c, of = tp["host_ceiling"], tp["mpexec_dali_of_ceiling"]
        direct = tp["mpexec_dali_vs_plain_2_processes"]
        parts.append(
            f"Throughput, {tp['samples_per_round']} samples a round, {st['rounds']} rounds, "
            f"in blocks of {tp.get('block', '?')} batches a system in turn\n\n"
            + table(
                [
                    "system",
                    "samples/s",
                    "range",
                    "vs alone",
                    "ratio range",
                    "DALI process CPU/sample",
                    "identical",
                ],
                rows,
            )
            + f"\n\nthe host's 2-process ceiling (2 plain processes over 1 of them, same work, "
            f"same rounds): {c['median']:.2f}x ({c['min']:.2f} - {c['max']:.2f})\n"
            + _control_cpu_line(tp)
            + f"mpexec.dali's ratio over its own round's ceiling (at most {WORKERS}x), round by "
            f"round: {of['median']:.2f}x ({of['min']:.2f} - {of['max']:.2f})\n"
            f"mpexec.dali over the plain 2 processes directly (no serial baseline): "
            f"{direct['median']:.2f}x ({direct['min']:.2f} - {direct['max']:.2f})"
        )
        sva = tp.get("serial_vs_alone")
        if sva:  # the two single-threaded baselines, which should read alike
            alone_row = tp["by_system"][ALONE]
            parts[-1] += (
                f"\nthe baselines: plain 1 process over DALI alone, round by round: "
                f"{sva['median']:.2f}x ({sva['min']:.2f} - {sva['max']:.2f}); this process's "
                f"CPU a sample {fmt_time(tp['serial_cpu_us_per_sample'])} against DALI "
                f"alone's {fmt_time(alone_row['dali_process_cpu_us_per_sample'])}"
            )
            q = tp.get("queued_us_per_sample", {})
            if len(q) == 2:
                parts[-1] += (
                    f"; waiting for a CPU (ready, not running) a sample: "
                    f"{fmt_time(q[SERIAL])} against {fmt_time(q[ALONE])}"
                )
            b = tp.get("beyond_work_ms_per_batch")
            if b:
                parts[-1] += (
                    "\na batch's wall time beyond its work (at the serial CPU a sample): "
                    + (", ".join(f"{k} {v:.2f} ms" for k, v in b.items()))
                )
        dyn = tp.get("default_executor")
        if dyn:
            of, direct, sync = (
                dyn["mpexec_dali_of_ceiling"],
                dyn["mpexec_dali_vs_plain_2_processes"],
                dyn["mpexec_dali_vs_synchronous"],
            )
            parts[-1] += (
                "\n\nunder DALI's default executor (another definition: DALI computes a batch "
                "ahead, each to DALI alone under that executor):\n"
                f"mpexec.dali's ratio over its own round's ceiling: "
                f"{of['median']:.2f}x ({of['min']:.2f} - {of['max']:.2f})\n"
                f"mpexec.dali over the plain 2 processes directly: "
                f"{direct['median']:.2f}x ({direct['min']:.2f} - {direct['max']:.2f})\n"
                f"mpexec.dali over itself in the synchronous pipeline: "
                f"{sync['median']:.2f}x ({sync['min']:.2f} - {sync['max']:.2f})"
            )
    if result.get("pace_same_moment"):
        parts[-1] += "\n" + _pace_line(result["pace_same_moment"])
    copies = result.get("copies")
    if copies:
        yes = {True: "yes", False: "no"}
        kib = copies["batch_bytes"] / 1024
        naive_kib = copies["naive_bytes_copied_by_pool_per_batch"] / 1024
        ours_kib = copies["mpexec_dali_bytes_copied_by_pool_per_batch"] / 1024
        rows = [
            [
                "DALI hands the function views of its own buffer",
                yes[copies["dali_hands_views_of_its_buffer"]],
            ],
            [
                "... the batch's samples back to back (one run of memory)",
                yes[copies["dali_batch_back_to_back"]],
            ],
            ["... writable", yes[copies["dali_inputs_writable"]]],
            [
                "DALI copies the arrays the function returns",
                yes[copies["dali_copies_returned_arrays"]],
            ],
            [
                "naive map: bytes the pool copied as arguments, per batch",
                f"{naive_kib:.0f} KiB ({kib:.0f} KiB batch)",
            ],
            [
                "mpexec.dali: bytes the pool copied as arguments, per batch",
                f"{ours_kib:.0f} KiB (its one copy: its own memcpy into a shared block)",
            ],
        ]
        parts.append("Where the copies are\n\n" + table(["what", "measured"], rows, right=set()))
    if result.get("targets"):
        parts.append(targets_text(result["targets"]))
    return closing(parts, result)


def main(argv: list[str] | None = None) -> int:
    return cli("dali_bench", run, argv)


if __name__ == "__main__":
    sys.exit(main())
