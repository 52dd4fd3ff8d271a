"""``python -m benchmarks tf``: what handing a pipeline's batches to tf.data costs.

One pipeline, whose source yields dense batches of a given size (float32, made
once, copied into shared memory as any source's arrays are), is read side by
side, round after round, four ways (the tests check that the tensors are the
batches' shared memory, uncopied):

- ``pipeline``: iterating the pipeline itself (the batches as NumPy arrays);
- ``tf, len known``: ``mpexec.tf.dataset(pipe)`` when the source has a ``len()``
  (``Dataset.range`` and one ``numpy_function`` call a batch);
- ``tf, len unknown``: the same through ``Dataset.from_generator`` (a source
  without ``len()``);
- ``pipeline + copy``: the pipeline with one ``np.copy`` of each batch, the
  least a hand-off that copies would cost.

Per batch size: the median time a batch (spread over rounds) and each way's
ratio to ``pipeline``.

Then a ``tf.data`` map inside TensorFlow's graph (``map_ways``), side by side:
``Dataset.range(N).map(lambda i: OP(f, [i], tf.float32), num_parallel_calls=2)
.batch(64)`` with ``OP`` TensorFlow's ``tf.numpy_function`` and mpexec's
``mpexec.numpy_function`` (a worker each call, two workers), against
``mpexec.tf.dataset`` over an mpexec pipeline running ``f`` (two workers); ``f``
is workload 1's heavy augment (``process_sample``, ~11 ms a sample) and the
light op (``x + 1`` on 16 floats). The serial loop (``f`` called in a plain
Python loop over the same samples, in the same run, its rounds interleaved with
the maps') is the unit the 2-core ceiling is measured in: each way is reported
also as a multiple of it and as its share of that ceiling (x serial / 2, two
workers or two TF threads). The main process's CPU a sample (all its threads:
TF's runtime and the calls' hand-off) is reported beside the times.
The CPU that other processes used during the run is reported: figures from a
busy machine are flagged. Only the ratios travel between machines.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
from benchmarks._common import RESULTS, cli, fmt_size, log, table, write
from mpexec import fn
from mpexec._cpuload import CpuMeter

NAME = "tf"
WAYS = ("pipeline", "tf, len known", "tf, len unknown", "pipeline + copy")


class Batches:
    """``n`` dense float32 batches of ``nbytes`` each, sized (``len``) or not."""

    def __init__(self, n: int, nbytes: int) -> None:
        self.batches = [
            np.full((4, nbytes // 16), i, np.float32) for i in range(n)
        ]  # 4 samples a batch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self.batches)


def make(batches: Batches, sized: bool) -> mpexec.Pipeline:
    def unsized() -> Iterator[np.ndarray[Any, Any]]:
        yield from batches.batches

    source: Any = batches if sized else unsized

    @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=0)
    def pipe() -> Any:
        # Read again each epoch: an iterable that does not cycle is read once.
        return fn.external_source(source=source, batch=True, cycle="raise")

    return pipe()  # type: ignore[no-any-return]


def read_epoch(
    dataset: Any, clock: Callable[[], float] = time.perf_counter
) -> tuple[int, float, float]:
    """``(elements, seconds, release seconds)`` of one pass over ``dataset``.

    ``seconds`` runs from making the iterator to its end of sequence, what the
    reader waits for; releasing the iterator is timed apart. TensorFlow's
    ``tf.data`` autotuning thread (one per iterator, on by default) sleeps
    10, 20, 40 ... ms between its runs, and releasing the iterator can wait
    out its sleep: the pass then seems to end 2.55 s, 5.11 s or 10.23 s after
    it began (10 ms x (2^k - 1)), whatever the op in the map.
    """
    n = 0
    t0 = clock()
    it = iter(dataset)
    for _ in it:
        n += 1
    t1 = clock()
    del it
    return n, t1 - t0, clock() - t1


def epoch(
    way: str, pipes: dict[str, Any], datasets: dict[str, Any], released: list[float]
) -> float:
    """Seconds a batch, over one epoch read ``way`` (the epoch's start included).

    A dataset's iterator release is appended to ``released`` (see :func:`read_epoch`).
    """
    n = 0
    t0 = time.perf_counter()
    if way in ("pipeline", "pipeline + copy"):
        pipes["sized"].reset()  # as each pass of a dataset does, timed alike
        for (batch,) in pipes["sized"]:
            a = np.asarray(batch.as_array())
            if way == "pipeline + copy":
                a = a.copy()
            n += 1
        return (time.perf_counter() - t0) / max(1, n)
    n, seconds, release = read_epoch(datasets[way])
    released.append(release)
    return seconds / max(1, n)


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run the benchmark, print its table, write ``tf.json`` and ``tf.md``."""
    result: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": os.getloadavg(),
        "errors": [],
    }
    try:
        from mpexec import tf as mtf
    except ImportError as exc:
        print(f"tf: skipped: {exc}")
        result["skipped"] = str(exc)
        return result
    sizes = [1 << 20] if quick else [64 << 10, 1 << 20, 16 << 20]
    n, rounds = (10, 2) if quick else (40, 7)
    meter = CpuMeter()
    rows = []
    released: list[float] = []  # seconds each dataset iterator's release took
    for nbytes in sizes:
        log(f"[{NAME}] batches of {fmt_size(nbytes)} ...")
        data = Batches(n, nbytes)
        # Three pipelines alike: one read directly, one behind each dataset (a dataset
        # starts its pipeline's epochs itself).
        with (
            make(data, sized=True) as plain,
            make(data, sized=True) as sized,
            make(data, sized=False) as unsized,
        ):
            pipes = {"sized": plain}
            known = mtf.dataset(sized)
            datasets = {"tf, len known": known, "tf, len unknown": mtf.dataset(unsized)}
            assert int(known.cardinality()) == n
            times: dict[str, list[float]] = {w: [] for w in WAYS}
            for _ in range(rounds):
                for way in WAYS:
                    times[way].append(epoch(way, pipes, datasets, released))
        med = {w: statistics.median(v) for w, v in times.items()}
        rows.append(
            {
                "batch_bytes": nbytes,
                "median_s": med,
                "min_s": {w: min(v) for w, v in times.items()},
                "max_s": {w: max(v) for w, v in times.items()},
                "vs_pipeline": {w: med[w] / med["pipeline"] for w in WAYS},
            }
        )
    maps = map_ways(mtf, quick)
    load = meter.stop()
    result.update(rows=rows, maps=maps, host_load=load.to_json(), release_s=released)
    text = (
        "Time a batch, median over rounds (min - max), and its ratio to iterating the "
        "pipeline itself\n\n"
    )
    text += table(
        ["batch", *WAYS],
        [
            [
                fmt_size(r["batch_bytes"]),
                *(
                    f"{r['median_s'][w] * 1e6:.0f} us ({r['min_s'][w] * 1e6:.0f} - "
                    f"{r['max_s'][w] * 1e6:.0f}) {r['vs_pipeline'][w]:.2f}x"
                    for w in WAYS
                ),
            ]
            for r in rows
        ],
    )
    text += (
        f"\n\n{n} batches an epoch, {rounds} rounds, the ways interleaved; load average "
        f"{result['load_average'][0]:.1f} at the start; other processes used "
        f"{100 * load.other_share:.0f}% of the {load.cpus} CPUs during the run"
        + (" (busy: take the ratios as approximate)" if load.other_share >= 0.1 else "")
        + "; the datasets' iterator releases, not timed above, took up to "
        + f"{max(released or [0]):.2f} s"
        + "\n"
    )
    text += "\n" + map_table(maps)
    print(text)
    write(NAME, result, text, out_dir, "ways of reading one pipeline; tf.data maps")
    return result


MAP_WAYS = ("tf.numpy_function", "mpexec.numpy_function", "mpexec.tf.dataset")
#: ``f`` in a plain Python loop over the same samples: the ceiling's unit.
SERIAL = "serial loop"
#: The ceiling over the serial loop: two workers (or two TF threads) on two cores.
CEILING = 2


def serial_loop(f: Any, n: int) -> tuple[float, float]:
    """``(seconds, main CPU seconds)`` of ``f`` over samples ``0 .. n-1`` in a plain loop."""
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(n):
        f(np.int64(i))
    return time.perf_counter() - t0, time.process_time() - c0


def heavy(i: Any) -> np.ndarray[Any, Any]:
    """Workload 1 (the augment), from the index TF hands over."""
    from benchmarks._workloads import process_sample

    return process_sample(int(i))


def light(i: Any) -> np.ndarray[Any, Any]:
    """The light op: ``x + 1`` on 16 floats made from the index."""
    return np.full(16, i, np.float32) + 1


class Sized:
    """``f`` of each sample's index, ``n`` samples an epoch: a sized pipeline source."""

    def __init__(self, f: Any, n: int) -> None:
        self.f, self.n = f, n

    def __len__(self) -> int:
        return self.n

    def __call__(self, info: Any) -> Any:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return self.f(np.int64(info.idx_in_epoch))


def map_ways(mtf: Any, quick: bool) -> list[dict[str, Any]]:
    """Each workload through each of :data:`MAP_WAYS`.

    The maps' rounds interleave, then the pipeline's rounds follow.
    """
    import tensorflow as tf

    rows = []
    pool = mpexec.WorkerPool(2)
    mpexec.set_default_pool(pool)
    try:
        workloads = (
            ("heavy (workload 1)", heavy, 128 if quick else 256),
            ("light (x + 1, 16 floats)", light, 2048 if quick else 8192),
        )
        for label, f, n in workloads:
            log(f"[{NAME}] tf.data map, {label} ...")
            ops = {"tf.numpy_function": tf.numpy_function,
                   "mpexec.numpy_function": mpexec.numpy_function}  # fmt: skip
            datasets = {
                way: tf.data.Dataset.range(n)
                .map(lambda i, op=op, f=f: op(f, [i], tf.float32), num_parallel_calls=2)
                .batch(64)
                for way, op in ops.items()
            }

            source = Sized(f, n)

            @mpexec.pipeline_def(batch_size=64, num_workers=2, seed=0)
            def piped(source: Sized = source) -> Any:
                return fn.external_source(source=source, batch=False)

            times: dict[str, list[float]] = {w: [] for w in (SERIAL, *MAP_WAYS)}
            cpu: dict[str, list[float]] = {w: [] for w in (SERIAL, *MAP_WAYS)}
            released: dict[str, list[float]] = {w: [] for w in MAP_WAYS}

            # The two maps' rounds interleave; the pipeline's come after them, with
            # its workers started only then: a pipeline works ahead of its reader (its
            # first iteration, read for the spec, then its window), which would take
            # the CPUs from whatever runs beside it, and reads what it made meanwhile
            # for free.
            with contextlib.ExitStack() as stack:
                for ways in ((SERIAL, *MAP_WAYS[:2]), MAP_WAYS[2:]):
                    if "mpexec.tf.dataset" in ways:
                        pipe = stack.enter_context(piped())
                        datasets["mpexec.tf.dataset"] = mtf.dataset(pipe)
                    for r in range((2 if quick else 7) + 1):
                        for way in ways:
                            if way == SERIAL:  # the pool's workers idle meanwhile
                                seconds, busy = serial_loop(f, n)
                                if r:
                                    times[way].append(seconds / n)
                                    cpu[way].append(busy / n)
                                continue
                            c0 = time.process_time()
                            _, seconds, release = read_epoch(datasets[way])
                            if r:  # the first round warms up: workers, tracing, shipping
                                times[way].append(seconds / n)
                                cpu[way].append((time.process_time() - c0) / n)
                                released[way].append(release)
            med = {w: statistics.median(v) for w, v in times.items()}
            vs_serial = {w: med[SERIAL] / med[w] for w in MAP_WAYS}
            rows.append({
                "workload": label, "samples": n, "median_s": med,
                "min_s": {w: min(v) for w, v in times.items()},
                "max_s": {w: max(v) for w, v in times.items()},
                "main_cpu_s": {w: statistics.median(v) for w, v in cpu.items()},
                "rounds": len(times["mpexec.tf.dataset"]),
                "all_s": times, "release_s": released,
                "speedup_vs_tf": {w: med["tf.numpy_function"] / med[w] for w in MAP_WAYS},
                "speedup_vs_serial": vs_serial,
                "of_ceiling": {w: x / CEILING for w, x in vs_serial.items()},
            })  # fmt: skip
    finally:
        mpexec.set_default_pool(None)
        pool.shutdown()
    return rows


def map_table(rows: list[dict[str, Any]]) -> str:
    text = (
        "tf.data map, num_parallel_calls=2, batches of 64: time a sample, median over rounds "
        "(min - max), its speed-up over tf.numpy_function, and the main process's CPU a "
        "sample (the two maps' rounds interleaved; the pipeline's after them, its workers "
        "started then, so that its work ahead of the reader overlaps no other way). A pass "
        "is timed from making its iterator to its end of sequence; releasing the iterator, "
        "which can wait out the sleep of tf.data's autotuning thread (up to seconds, any "
        "op), is timed apart: the longest release is the last column. The serial loop "
        "(the function in a plain Python loop over the same samples, its rounds "
        "interleaved with the maps') is the unit of the second table: each way as a "
        f"multiple of it, and its share of the {CEILING}-core ceiling (x serial / {CEILING})"
        "\n\n"
    )
    text += table(
        ["workload", *MAP_WAYS, "longest release"],
        [
            [
                f"{r['workload']} ({r['samples']})",
                *(
                    f"{r['median_s'][w] * 1e6:.0f} us ({r['min_s'][w] * 1e6:.0f} - "
                    f"{r['max_s'][w] * 1e6:.0f}) {r['speedup_vs_tf'][w]:.2f}x, cpu "
                    f"{r['main_cpu_s'][w] * 1e6:.0f} us"
                    for w in MAP_WAYS
                ),
                f"{max(max(v) for v in r['release_s'].values()):.2f} s",
            ]
            for r in rows
        ],
    )
    return (
        text
        + "\n\n"
        + table(
            ["workload", SERIAL, *(f"{w}: x serial, of ceiling" for w in MAP_WAYS)],
            [
                [
                    f"{r['workload']} ({r['samples']})",
                    " ".join(
                        (
                            f"{r['median_s'][SERIAL] * 1e6:.0f} us",
                            f"({r['min_s'][SERIAL] * 1e6:.0f} - {r['max_s'][SERIAL] * 1e6:.0f})",
                        )
                    ),
                    *(
                        f"{r['speedup_vs_serial'][w]:.2f}x, {100 * r['of_ceiling'][w]:.0f}%"
                        for w in MAP_WAYS
                    ),
                ]
                for r in rows
            ],
        )
    )


if __name__ == "__main__":
    sys.exit(cli(NAME, run, None))
