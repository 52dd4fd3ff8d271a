"""``python -m mpexec demo``: a CPU-bound image augmentation pipeline, timed.

The demo generates a deterministic set of photograph-like images, encodes them
(a small header and ``zlib``), and runs the usual training-time augmentation
over them in rounds (:mod:`mpexec._demo_images` has the images and the steps),
three ways in turn: in an mpexec pipeline (one ``python_function`` op per step),
in a plain serial loop here calling the same functions, and in as many plain
processes as the pipeline has workers, each looping over its share of the set:
the host's own ceiling in that round, which the pipeline's figure is read
against. It prints the median throughputs and speed-ups, CPU time an image, and
per-op statistics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from . import fn
from ._cpuload import CpuLoad, CpuMeter, own_cpu_seconds
from ._demo_images import (
    CROP,
    STEPS,
    U8,
    EncodedImages,
    augment_one,
    color_jitter,
    decode,
    flip,
    make_image_set,
    normalize,
    random_crop,
    sample_digest,
    warm_up_serial,
)
from ._demo_plain import PlainProcesses
from ._host import keep_memory_warm, usable_cpus
from ._pipeline import Pipeline, pipeline_def

# ------------------------------------------------------------------------ running it


class Progress:
    """Progress: a one-line bar on a terminal, a line every few seconds elsewhere.

    On a terminal it redraws at most ten times a second with ``\\r``, and
    :meth:`close` ends the line. Elsewhere (a log file, a pipe, CI) it writes
    a plain line every :attr:`LINE_EVERY_S` seconds and one at :meth:`close`,
    so a redirected run still shows that it is alive. The rate counts from
    creation, or from the last :meth:`restart`.
    """

    WIDTH = 30
    #: Seconds between two progress lines when the stream is not a terminal.
    LINE_EVERY_S = 2.0

    def __init__(self, label: str, total: int, stream: TextIO, *, enabled: bool) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream
        self.enabled = enabled
        self.bar = enabled and self.is_terminal(stream)
        self.done = 0
        self._start = time.perf_counter()
        self._drawn_at = -math.inf if self.bar else self._start
        self._drawn_done = -1

    @staticmethod
    def is_terminal(stream: TextIO) -> bool:
        isatty = getattr(stream, "isatty", None)
        return bool(isatty is not None and isatty())

    @staticmethod
    def wanted(stream: TextIO, *, disabled: bool = False) -> bool:
        """Whether to show progress on ``stream`` at all (unless ``disabled``)."""
        del stream
        return not disabled

    def restart(self) -> None:
        """Start the clock again (after a startup that the rate should not count)."""
        self._start = time.perf_counter()

    def update(self, n: int) -> None:
        """Count ``n`` more images; redraw if it is time to."""
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.bar:
            if now - self._drawn_at >= 0.1 or self.done >= self.total:
                self._draw(now)
        elif now - self._drawn_at >= self.LINE_EVERY_S:
            self._line(now)

    def _rate(self, now: float) -> float:
        elapsed = now - self._start
        return self.done / elapsed if elapsed > 0 else 0.0

    def _draw(self, now: float) -> None:
        self._drawn_at, self._drawn_done = now, self.done
        filled = int(min(1.0, self.done / self.total) * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(
            f"\r{self.label:<9}[{bar}] {self.done}/{self.total} images  "
            f"{self._rate(now):7.1f} images/s"
        )
        self.stream.flush()

    def _line(self, now: float) -> None:
        self._drawn_at, self._drawn_done = now, self.done
        self.stream.write(
            f"{self.label:<9}{self.done}/{self.total} images  {self._rate(now):7.1f} images/s\n"
        )
        self.stream.flush()

    def close(self) -> None:
        """Show the final count if not yet shown; end the bar's line (when enabled)."""
        if not self.enabled:
            return
        if self.bar:
            if self._drawn_done != self.done:
                self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()
        elif self._drawn_done != self.done:
            self._line(time.perf_counter())


@dataclass(frozen=True)
class DemoConfig:
    """What ``python -m mpexec demo`` runs (its command-line options)."""

    images: int = 256
    size: int = 256
    batch_size: int = 32
    workers: int = 1
    epochs: int = 2
    seed: int = 0
    progress: bool = True
    #: Timed rounds, each a serial pass and a pipeline epoch (in turn); medians are reported.
    rounds: int = 5
    #: Time the host's ceiling too in each round: ``workers`` plain processes over the set.
    control: bool = True


@dataclass(frozen=True)
class Timing:
    """One measured run: how many images, in how long."""

    images: int
    seconds: float

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class CpuUse:
    """Where a timed phase's CPU time went, and the page faults it took."""

    images: int
    wall_s: float
    #: CPU seconds of this process (all its threads).
    main_s: float
    #: CPU seconds of the workers (this process's descendants).
    workers_s: float
    #: Minor page faults: the serial loop's (this process), or the workers' inside their calls.
    faults: int
    workers: int = 0

    def per_image_ms(self, seconds: float) -> float:
        return 1e3 * seconds / max(1, self.images)

    @property
    def faults_per_image(self) -> float:
        return self.faults / max(1, self.images)

    @property
    def workers_busy(self) -> float:
        """The workers' CPU time over their wall time (1.0: every worker always on a CPU)."""
        capacity = self.wall_s * self.workers
        return self.workers_s / capacity if capacity > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {
            "main_ms_per_image": self.per_image_ms(self.main_s),
            "workers_ms_per_image": self.per_image_ms(self.workers_s),
            "faults_per_image": self.faults_per_image,
            "workers_busy": self.workers_busy,
        }


class _CpuClock:
    """A phase's :class:`CpuUse` from creation to :meth:`stop`; the readings that scan the
    process tree (1-2 ms each on a busy host) stay out of the main process's window."""

    def __init__(self, faults: Callable[[], int]) -> None:
        self._faults = faults
        self._workers0, self._faults0 = _descendants_cpu_s(), faults()
        self._main0, self._t0 = _main_cpu_s(), time.perf_counter()

    def stop(self, images: int, workers: int) -> CpuUse:
        wall, main = time.perf_counter() - self._t0, _main_cpu_s() - self._main0
        faults = self._faults() - self._faults0
        descendants = max(0.0, _descendants_cpu_s() - self._workers0)
        return CpuUse(images, wall, main, descendants, faults, workers)


def _main_cpu_s() -> float:
    return sum(resource.getrusage(resource.RUSAGE_SELF)[:2])  # user + system


def _descendants_cpu_s() -> float:
    """CPU seconds of this process's descendants (its workers), less its own."""
    return own_cpu_seconds() - _main_cpu_s()


def serial_warmup_images(config: DemoConfig) -> int:
    """Images of the serial loop's untimed warm-up: a batch for each worker, at most the
    set (its memory is warm after a few images: the report shows its faults a sample)."""
    return min(config.images, config.batch_size * max(1, config.workers))


def run_serial(
    encoded: Sequence[U8], seed: int, progress: Progress | None = None
) -> tuple[Timing, str]:
    """Augment every image once in a plain loop here; the timing and an output digest
    (of the per-sample digests, as the pipeline's)."""
    digest = hashlib.sha1(usedforsecurity=False)
    start = time.perf_counter()
    for index, item in enumerate(encoded):
        digest.update(sample_digest(augment_one(item, seed, index)).data)
        if progress is not None:
            progress.update(1)
    seconds = time.perf_counter() - start
    return Timing(len(encoded), seconds), digest.hexdigest()


def build_pipeline(source: EncodedImages, config: DemoConfig) -> Pipeline:
    """The augmentation as an mpexec pipeline (defined, not yet started)."""

    # pipeline_def is typed Any; this names what it returns.
    define: Callable[[Callable[[], Any]], Callable[[], Pipeline]] = pipeline_def(
        batch_size=config.batch_size,
        num_workers=config.workers,
        seed=config.seed,
        prefetch_depth=2,
        # Every image, as the serial loop makes them: a short last batch is kept
        # (DALI's default, which pipelines follow, drops it).
        last_batch="partial",
    )

    @define
    def augment() -> Any:
        enc = fn.external_source(source=source, batch=False, name="images")
        img = fn.python_function(enc, function=decode, name="decode")
        img = fn.python_function(img, function=random_crop, name="random_crop")
        img = fn.python_function(img, function=flip, name="flip")
        img = fn.python_function(img, function=color_jitter, name="color_jitter")
        out = fn.python_function(img, function=normalize, output_layouts="CHW", name="normalize")
        return out, fn.python_function(out, function=sample_digest, name="digest")

    return augment()


#: The warm-up ends once the workers take fewer minor page faults a sample than this
#: (cold: about 100, one per page of a sample's output), or after MAX_WARMUP_EPOCHS.
WARM_FAULTS_PER_SAMPLE = 10.0
MAX_WARMUP_EPOCHS = 3


@dataclass(frozen=True)
class PipelineRun:
    """The pipeline's part of the demo: its timed epochs, one a round."""

    timings: tuple[Timing, ...]
    #: Building the graph and starting the workers (not timed).
    startup_s: float
    #: Batches of each timed epoch.
    batches: int
    #: SHA-1 of the per-sample SHA-1s of every timed epoch, in order.
    digest: str
    stats: Any
    #: Who used the CPUs during each timed epoch (startup and warm-up not counted).
    loads: tuple[CpuLoad, ...] = ()
    #: Images of the warm-up epochs (each a pass over the set), and how long they took.
    warmup_images: int = 0
    warmup_epochs: int = 0
    warmup_s: float = 0.0
    #: The workers' page faults a sample in the last warm-up epoch (None: not measured).
    warmup_faults: float | None = None
    #: CPU time and page faults of each timed epoch.
    cpu: tuple[CpuUse, ...] = ()

    @property
    def timing(self) -> Timing:
        """The timed epochs together."""
        return Timing(sum(t.images for t in self.timings), sum(t.seconds for t in self.timings))


def _worker_faults(pipe: Any) -> tuple[int, int] | None:
    """(workers' page faults, samples delivered) so far, or None where not measured."""
    stats = pipe.stats()
    faults, samples = getattr(stats, "worker_faults", None), getattr(stats, "samples", None)
    return None if faults is None or samples is None else (int(faults), int(samples))


class PipelineSide:
    """The pipeline, started and warmed once; :meth:`epoch` times one epoch of it.

    The warm-up (untimed) runs epochs (the first a pass over the image set,
    the next ones as timed) until the workers' memory is warm, as a long
    training run's is: fewer than
    :data:`WARM_FAULTS_PER_SAMPLE` minor page faults a sample (a cold worker
    takes about one per page of each output it writes), at most
    :data:`MAX_WARMUP_EPOCHS`. It also lets the workers import the functions
    and the scheduler learn the ops' times. Every timed epoch starts after
    ``reset()``, with nothing in flight, so that no work of a timed image is
    done before its clock starts.
    """

    def __init__(self, source: EncodedImages, config: DemoConfig) -> None:
        self.source = source
        self.config = config
        self.digest = hashlib.sha1(usedforsecurity=False)
        self.rounds: list[tuple[Timing, CpuLoad, CpuUse, int]] = []
        start = time.perf_counter()
        self.pipe = build_pipeline(source, config)
        self.pipe.__enter__()
        try:
            self.pipe.build()
            self.startup_s = time.perf_counter() - start
            self._warm_up()
        except BaseException:
            self.close()
            raise

    def _warm_up(self) -> None:
        self.warmup_images = self.warmup_epochs = 0
        self.warmup_faults: float | None = None
        start = time.perf_counter()
        while self.source.warmup and self.warmup_epochs < MAX_WARMUP_EPOCHS:
            before = _worker_faults(self.pipe)
            images = sum(len(batch) for batch, _ in self.pipe)
            self.pipe.reset()
            self.warmup_images += images
            self.warmup_epochs += 1
            after = _worker_faults(self.pipe)
            if before is None or after is None or after[1] == before[1]:
                break
            self.warmup_faults = (after[0] - before[0]) / (after[1] - before[1])
            if self.warmup_faults < WARM_FAULTS_PER_SAMPLE:
                break
        self.warmup_s = time.perf_counter() - start

    def epoch(self, progress: Progress | None = None) -> tuple[Timing, CpuLoad, CpuUse, int]:
        """One timed epoch: its timing, the host's load, its CPU use, its batches."""
        before = _worker_faults(self.pipe)
        meter = CpuMeter()  # while the workers live: their CPU time is ours
        clock = _CpuClock(lambda: 0)
        if progress is not None:
            progress.restart()
        start = time.perf_counter()
        images = batches = 0
        for batch, digests in self.pipe:
            for sample, sample_sha in zip(batch, digests, strict=True):
                _check_output(sample)
                self.digest.update(np.asarray(sample_sha).data)
            images += len(batch)
            batches += 1
            if progress is not None:
                progress.update(len(batch))
        seconds = time.perf_counter() - start
        cpu = clock.stop(images, self.config.workers)  # first: the meter's scan is not in it
        load = meter.stop()
        self.pipe.reset()
        after = _worker_faults(self.pipe)
        if before is not None and after is not None:
            cpu = dataclasses.replace(cpu, faults=after[0] - before[0])
        self.rounds.append((Timing(images, seconds), load, cpu, batches))
        return self.rounds[-1]

    def result(self) -> PipelineRun:
        """The :class:`PipelineRun` of the epochs timed so far."""
        return PipelineRun(
            timings=tuple(r[0] for r in self.rounds),
            startup_s=self.startup_s,
            batches=self.rounds[0][3] if self.rounds else 0,
            digest=self.digest.hexdigest(),
            stats=self.pipe.stats(),
            loads=tuple(r[1] for r in self.rounds),
            warmup_images=self.warmup_images,
            warmup_epochs=self.warmup_epochs,
            warmup_s=self.warmup_s,
            warmup_faults=self.warmup_faults,
            cpu=tuple(r[2] for r in self.rounds),
        )

    def close(self) -> None:
        self.pipe.__exit__(None, None, None)


def run_pipeline(
    source: EncodedImages, config: DemoConfig, progress: Progress | None = None
) -> PipelineRun:
    """Start the pipeline, warm it up, then time one epoch of it."""
    side = PipelineSide(source, config)
    try:
        side.epoch(progress)
        return side.result()
    finally:
        side.close()


def _check_output(sample: Any) -> None:
    shape, dtype = getattr(sample, "shape", None), getattr(sample, "dtype", None)
    if shape != (3, CROP, CROP) or dtype != np.float32:
        raise RuntimeError(
            f"the pipeline returned a {dtype} array of shape {shape}, "
            f"expected float32 {(3, CROP, CROP)}"
        )


@dataclass(frozen=True)
class SerialRun:
    """The serial loop's part of the demo: a timed pass over the set a round."""

    timings: tuple[Timing, ...]
    digest: str
    loads: tuple[CpuLoad, ...] = ()
    cpu: tuple[CpuUse, ...] = ()
    warmup_images: int = 0


@dataclass(frozen=True)
class PlainRun:
    """The ceiling's part of the demo: a timed pass over the set a round, split among
    as many plain processes as the pipeline has workers."""

    timings: tuple[Timing, ...]
    digest: str
    loads: tuple[CpuLoad, ...] = ()
    cpu: tuple[CpuUse, ...] = ()
    #: Starting the processes and their warm-up (not timed).
    startup_s: float = 0.0


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _total_load(loads: Sequence[CpuLoad]) -> CpuLoad | None:
    """The loads of several phases as one (their times summed)."""
    if not loads:
        return None
    return CpuLoad(
        wall_s=sum(x.wall_s for x in loads),
        cpus=loads[0].cpus,
        own_cpu_s=sum(x.own_cpu_s for x in loads),
        other_cpu_s=sum(x.other_cpu_s for x in loads),
        steal_cpu_s=sum(x.steal_cpu_s for x in loads),
    )


@dataclass(frozen=True)
class DemoResult:
    """Everything the demo measured."""

    config: DemoConfig
    usable_cpus: int
    encoded_bytes: int
    generate_s: float
    serial: SerialRun
    pipeline: PipelineRun
    #: The host's ceiling, round by round (None: not measured).
    plain: PlainRun | None = None

    @property
    def speedups(self) -> tuple[float, ...]:
        """Each round's pipeline throughput over the serial loop's in the same round."""
        return _ratios(self.pipeline.timings, self.serial.timings)

    @property
    def ceilings(self) -> tuple[float, ...]:
        """Each round's plain processes' throughput over the serial loop's: the most
        this host gave that many processes of this work in that round."""
        return () if self.plain is None else _ratios(self.plain.timings, self.serial.timings)

    @property
    def of_ceiling(self) -> tuple[float, ...]:
        """Each round's pipeline throughput over the plain processes'."""
        return () if self.plain is None else _ratios(self.pipeline.timings, self.plain.timings)

    @property
    def speedup(self) -> float:
        """The median of the rounds' speed-ups."""
        return _median(self.speedups)

    @property
    def serial_load(self) -> CpuLoad | None:
        return _total_load(self.serial.loads)

    @property
    def pipeline_load(self) -> CpuLoad | None:
        return _total_load(self.pipeline.loads)

    @property
    def plain_load(self) -> CpuLoad | None:
        return None if self.plain is None else _total_load(self.plain.loads)

    @property
    def other_share(self) -> float | None:
        """The largest share of the CPUs other processes used in a side's timed runs."""
        loads = (self.serial_load, self.pipeline_load, self.plain_load)
        shares = [x.other_share for x in loads if x is not None]
        return max(shares) if shares else None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (``--json``)."""
        s, p = self.serial, self.pipeline
        return {
            "config": dataclasses.asdict(self.config),
            "usable_cpus": self.usable_cpus,
            "encoded_bytes": self.encoded_bytes,
            "generate_s": self.generate_s,
            "serial": _side_json(s.timings, s.cpu)
            | {"digest": s.digest, "warmup_images": s.warmup_images},
            "pipeline": _side_json(p.timings, p.cpu)
            | {
                "startup_s": p.startup_s,
                "warmup_images": p.warmup_images,
                "warmup_epochs": p.warmup_epochs,
                "warmup_s": p.warmup_s,
                "warmup_faults_per_image": p.warmup_faults,
                "batches": p.batches,
                "digest": p.digest,
            },
            "plain": None
            if self.plain is None
            else _side_json(self.plain.timings, self.plain.cpu)
            | {"digest": self.plain.digest, "startup_s": self.plain.startup_s},
            "speedup": self.speedup,
            "speedups": list(self.speedups),
            "ceiling": _median(self.ceilings) if self.ceilings else None,
            "ceilings": list(self.ceilings),
            "of_ceiling": _median(self.of_ceiling) if self.of_ceiling else None,
            "host_load": {
                name: None if load is None else load.to_json()
                for name, load in (
                    ("serial", self.serial_load),
                    ("pipeline", self.pipeline_load),
                    ("plain", self.plain_load),
                )
            },
            "stats": _stats_json(p.stats),
        }


def _ratios(num: Sequence[Timing], den: Sequence[Timing]) -> tuple[float, ...]:
    """Round by round, the throughput of ``num`` over that of ``den``."""
    return tuple(a.images_per_s / b.images_per_s for a, b in zip(num, den, strict=False))


def _side_json(timings: Sequence[Timing], cpu: Sequence[CpuUse]) -> dict[str, Any]:
    """A side's medians over its rounds, then each round."""
    rates = [t.images_per_s for t in timings]
    return {
        "images": timings[0].images if timings else 0,
        "seconds": _median([t.seconds for t in timings]),
        "images_per_s": _median(rates),
        "rounds": [
            {"images": t.images, "seconds": t.seconds, "images_per_s": t.images_per_s}
            | (c.to_json() if c is not None else {})
            for t, c in itertools.zip_longest(timings, cpu[: len(timings)])
        ],
    }


def _stats_json(stats: Any) -> Any:
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        return json.loads(json.dumps(dataclasses.asdict(stats), default=str))
    return str(stats)


def run_demo(config: DemoConfig, *, err: TextIO | None = None) -> DemoResult:
    """Generate the images, start and warm the pipeline (and the plain processes of the
    ceiling), then time ``config.rounds`` rounds of the sides in turn; return the
    measurements.

    The sides alternate within a round and their order rotates from round to
    round (serial first, then pipeline first, ...), so that a change in the
    host's load or clock meets all alike; each round's ratios compare phases
    run next to each other. Progress bars, when ``config.progress`` is set, go
    to ``err`` (default: stderr).
    """
    err = sys.stderr if err is None else err
    bar = Progress("images", config.images, err, enabled=config.progress)
    start = time.perf_counter()
    try:
        encoded = make_image_set(config.images, config.seed, config.size, bar)
    finally:
        bar.close()
    generate_s = time.perf_counter() - start

    serial_warm = serial_warmup_images(config)
    warm_up_serial(encoded, config.seed, serial_warm)
    serial: list[tuple[Timing, CpuLoad, CpuUse]] = []
    serial_digest = ""

    def serial_round() -> None:
        nonlocal serial_digest
        bar = Progress("serial", len(encoded), err, enabled=config.progress)
        try:
            meter = CpuMeter()
            clock = _CpuClock(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            timing, serial_digest = run_serial(encoded, config.seed, bar)
            use = clock.stop(timing.images, 0)  # first: the meter's scan is not in it
            serial.append((timing, meter.stop(), use))
        finally:
            bar.close()

    plain_runs: list[tuple[Timing, CpuLoad, CpuUse]] = []
    # First, with no pipeline thread or worker yet: only the plain loops in them.
    plain = (
        PlainProcesses(encoded, config.seed, config.workers, serial_warm, SERIAL_WARM_MEMORY)
        if config.control and config.workers > 0
        else None
    )
    side: PipelineSide | None = None
    try:
        source = EncodedImages(encoded, passes=config.epochs, warmup=len(encoded))
        side = PipelineSide(source, config)

        def pipeline_round() -> None:
            assert side is not None
            bar = Progress("pipeline", len(source), err, enabled=config.progress)
            try:
                side.epoch(bar)
            finally:
                bar.close()

        def plain_round() -> None:
            assert plain is not None
            bar = Progress("plain", len(encoded), err, enabled=config.progress)
            try:
                meter = CpuMeter()
                wall, cpu, faults = plain.round()
                load = meter.stop()
                bar.update(len(encoded))  # one answer a pass: the bar moves at its end
            finally:
                bar.close()
            use = CpuUse(len(encoded), wall, 0.0, cpu, faults, config.workers)
            plain_runs.append((Timing(len(encoded), wall), load, use))

        phases = [serial_round, pipeline_round] + ([plain_round] if plain else [])
        for r in range(config.rounds):
            for phase in phases[r % len(phases) :] + phases[: r % len(phases)]:
                phase()
        pipeline = side.result()
    finally:
        if side is not None:
            side.close()
        if plain is not None:
            plain.close()
    if plain is not None and plain.digest != serial_digest:
        raise RuntimeError(
            "the demo's plain processes made other outputs than its serial loop "
            f"(digests {plain.digest} and {serial_digest})"
        )

    return DemoResult(
        config=config,
        usable_cpus=usable_cpus(),
        encoded_bytes=sum(int(e.nbytes) for e in encoded),
        generate_s=generate_s,
        serial=SerialRun(
            timings=tuple(x[0] for x in serial),
            digest=serial_digest,
            loads=tuple(x[1] for x in serial),
            cpu=tuple(x[2] for x in serial),
            warmup_images=serial_warm,
        ),
        pipeline=pipeline,
        plain=None
        if plain is None
        else PlainRun(
            timings=tuple(x[0] for x in plain_runs),
            digest=plain.digest,
            loads=tuple(x[1] for x in plain_runs),
            cpu=tuple(x[2] for x in plain_runs),
            startup_s=plain.startup_s,
        ),
    )


def _plural(n: int, word: str, words: str = "") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


#: Other processes' share of the CPUs from which the speed-up is flagged, and from
#: which it is called meaningless (the peers benchmark flags figures from 10%).
NOT_QUIET_SHARE = 0.10
BUSY_SHARE = 0.25


def host_load_text(result: DemoResult) -> tuple[str, str]:
    """What to say after the speed-up, and the host-load line ("" when unmeasured)."""
    share = result.other_share
    if share is None:
        return "", ""
    sides = (
        ("serial loop", result.serial_load),
        ("pipeline", result.pipeline_load),
        ("plain processes", result.plain_load),
    )
    loads = [(name, load) for name, load in sides if load is not None]
    cpus = _plural(loads[0][1].cpus, "CPU")
    parts = [f"{100 * load.other_share:.0f}% during the {name}" for name, load in loads]
    parts[0] = parts[0].replace(" during", f" of the {cpus} during", 1)
    line = (
        f"other processes used {', '.join(parts[:-1])} and {parts[-1]}"
        if len(parts) > 1
        else (f"other processes used {parts[0]}")
    )
    if share >= BUSY_SHARE:
        return ": not meaningful, the host was busy", line
    if share >= NOT_QUIET_SHARE:
        return ": the host was not quiet, take it as approximate", line
    return "", line + " (a quiet host)"


def _spread(values: Sequence[float], fmt: str) -> str:
    """``[low-high]`` of ``values`` (empty for fewer than two)."""
    return f"[{min(values):{fmt}}-{max(values):{fmt}}]" if len(values) > 1 else ""


def cpu_lines(result: DemoResult) -> list[str]:
    """CPU time and page faults an image, medians over the rounds."""
    s, p = result.serial.cpu, result.pipeline.cpu
    lines = []
    if s:
        lines.append(
            f"  serial    {_median([c.per_image_ms(c.main_s) for c in s]):5.2f} ms in this "
            f"process, {_median([c.faults_per_image for c in s]):.1f} page faults"
        )
    if p:
        main = _median([c.per_image_ms(c.main_s) for c in p])
        faults = _median([c.faults_per_image for c in p])
        if result.config.workers:
            lines.append(
                f"  pipeline  {_median([c.per_image_ms(c.workers_s) for c in p]):5.2f} ms in "
                f"the workers ({_median([c.workers_busy for c in p]):.0%} busy), "
                f"{main:.2f} ms in this process, {faults:.1f} worker page faults"
            )
        else:
            lines.append(f"  pipeline  {main:5.2f} ms in this process (inline, no workers)")
    if result.plain is not None and result.plain.cpu:
        c = result.plain.cpu
        lines.append(
            f"  plain     {_median([u.per_image_ms(u.workers_s) for u in c]):5.2f} ms in the "
            f"processes ({_median([u.workers_busy for u in c]):.0%} busy), "
            f"{_median([u.faults_per_image for u in c]):.1f} page faults"
        )
    return lines


def format_result(result: DemoResult) -> str:
    """The measurements for a person: throughput first, then the per-op statistics."""
    c, s, p = result.config, result.serial, result.pipeline
    mib = result.encoded_bytes / (1 << 20)
    steps = " -> ".join(name for name, _, _ in STEPS)
    images = (
        f"{_plural(c.images, 'image')} of about {c.size}x{c.size}, seed {c.seed} "
        f"({mib:.1f} MiB encoded, generated in {result.generate_s:.2f} s)"
    )
    warm = (
        f" (until under {WARM_FAULTS_PER_SAMPLE:.0f} worker page faults a sample: "
        f"{p.warmup_faults:.1f})"
        if p.warmup_faults is not None
        else ""
    )
    s_rates = [t.images_per_s for t in s.timings]
    p_rates = [t.images_per_s for t in p.timings]
    serial = (
        f"{_median(s_rates):8.1f} images/s {_spread(s_rates, '.0f')}  "
        f"({_plural(c.images, 'image')} a round, one loop in this process)"
    )
    pipeline = (
        f"{_median(p_rates):8.1f} images/s {_spread(p_rates, '.0f')}  "
        f"({_plural(c.images * c.epochs, 'image')} a round: {_plural(c.epochs, 'pass', 'passes')}, "
        f"{_plural(p.batches, 'batch', 'batches')} of up to {c.batch_size})"
    )
    speedup = (
        f"{result.speedup:8.2f}x {_spread(result.speedups, '.2f')}  "
        f"({_plural(c.workers, 'worker')}, {_plural(result.usable_cpus, 'usable CPU')})"
    )
    verdict, load = host_load_text(result)
    plain_lines = []
    if result.plain is not None:
        rates = [t.images_per_s for t in result.plain.timings]
        procs = _plural(c.workers, "plain process", "plain processes")
        plain = (
            f"  plain     {_median(rates):8.1f} images/s {_spread(rates, '.0f')}  "
            f"({_plural(c.images, 'image')} a round: {procs}, each a loop over its share)"
        )
        plain_lines = [plain]
        ceiling = (
            f"  ceiling   {_median(result.ceilings):8.2f}x {_spread(result.ceilings, '.2f')}  "
            f"(the plain processes over the serial loop: this host's own limit); the "
            f"pipeline {_median(result.of_ceiling):.2f} of it {_spread(result.of_ceiling, '.2f')}"
        )
    startup = (
        f"  startup   {p.startup_s:.2f} s: building the graph, starting "
        f"{_plural(c.workers, 'worker')}"
        + (
            ""
            if result.plain is None
            else f"; {result.plain.startup_s:.2f} s: the plain processes, warmed up"
        )
    )
    warmup = (
        f"  warm-up   {p.warmup_s:.2f} s: the pipeline {_plural(p.warmup_images, 'image')}"
        f"{warm}, the serial loop {_plural(s.warmup_images, 'image')}"
    )
    sides = (
        "the serial loop, the pipeline and the plain processes"
        if plain_lines
        else ("the serial loop and the pipeline")
    )
    rounds = (
        f"throughput: {_plural(len(s.timings), 'round')}, {sides} in turn; medians [lowest-highest]"
    )
    return "\n".join(
        [
            f"mpexec demo: {images}",
            f"  {steps}: float32 3x{CROP}x{CROP} per image",
            "not timed",
            startup,
            warmup,
            rounds,
            f"  serial    {serial}",
            f"  pipeline  {pipeline}",
            *plain_lines,
            f"  speed-up  {speedup}{verdict}",
            *([ceiling] if plain_lines else []),
            *([f"  host load {load}"] if load else []),
            "cpu time an image: medians",
            *cpu_lines(result),
            f"output digest  {p.digest}  (SHA-1 of the SHA-1s of the pipeline's outputs, in order)",
            "per-op stats",
            str(p.stats),
        ]
    )


#: Freed memory this process's malloc keeps for the serial loop: the pool's default
#: ``warm_memory``, so that both sides run with the same malloc settings.
SERIAL_WARM_MEMORY = 256 << 20


def main(config: DemoConfig, *, as_json: bool = False, out: TextIO | None = None) -> int:
    """Run the demo and print its result; return the exit status (0).

    First sets this process's malloc as the workers' (``warm_memory``, docs/pool.md):
    else the serial loop may take ~200 page faults an image that the workers do not,
    flattering the pipeline. Process-wide: hence here, not in :func:`run_demo`.
    """
    keep_memory_warm(SERIAL_WARM_MEMORY)
    result = run_demo(config)
    stream = sys.stdout if out is None else out
    if as_json:
        print(json.dumps(result.to_json(), indent=2), file=stream)
    else:
        print(format_result(result), file=stream)
    return 0
