"""``python -m mpexec demo``: a CPU-bound image augmentation pipeline, timed.

The demo generates a deterministic set of photograph-like images, encodes them
(a small header and ``zlib``), and runs the usual training-time augmentation
over them in rounds, two ways in turn: in an mpexec pipeline (one ``python_function``
op per step), and in a plain serial loop here calling the same functions. It prints
the median throughputs and speed-up, CPU time an image, and per-op statistics.

The steps, each a module-level function so that workers import it by
reference::

    decode -> random_crop -> flip -> color_jitter -> normalize
    bytes     224x224x3      224x224x3  224x224x3    float32 3x224x224

``color_jitter`` ends with a deliberately Python-heavy step (a per-row loop
that builds a gamma table in pure Python), the kind of code that holds the GIL
and gains nothing from threads: only processes run it in parallel.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import resource
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from . import fn
from ._cpuload import CpuLoad, CpuMeter, own_cpu_seconds
from ._host import keep_memory_warm, usable_cpus
from ._pipeline import Pipeline, pipeline_def

#: Side of the square crop the pipeline produces.
CROP = 224
#: ImageNet channel statistics (RGB), on the 0-255 scale.
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32) * 255

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

# ------------------------------------------------------------------------ the image set

#: Encoded image: this header (magic, height, width, channels), then zlib-compressed pixels.
_HEADER = struct.Struct("<4sIII")
_MAGIC = b"MPXI"
_ZLIB_LEVEL = 6


def encode(img: U8) -> U8:
    """``img`` (uint8, HxWxC) as a 1-D uint8 array: a 16-byte header, then zlib (level 6)."""
    if img.dtype != np.uint8 or img.ndim != 3:
        raise ValueError(f"encode wants a uint8 HxWxC array, not {img.dtype} {img.shape}")
    h, w, c = img.shape
    payload = zlib.compress(np.ascontiguousarray(img).tobytes(), _ZLIB_LEVEL)
    return np.frombuffer(_HEADER.pack(_MAGIC, h, w, c) + payload, dtype=np.uint8)


def decode(encoded: U8) -> U8:
    """The image that :func:`encode` encoded: uint8, HxWxC (read-only)."""
    data = np.ascontiguousarray(encoded, dtype=np.uint8).reshape(-1)
    if data.size < _HEADER.size:
        raise ValueError(f"not an encoded image: {data.size} bytes, shorter than its header")
    magic, h, w, c = _HEADER.unpack(data[: _HEADER.size].tobytes())
    if magic != _MAGIC:
        raise ValueError(f"not an encoded image: magic {magic!r}, expected {_MAGIC!r}")
    raw = zlib.decompress(data[_HEADER.size :].data)
    if len(raw) != h * w * c:
        raise ValueError(f"corrupt image: {len(raw)} bytes of pixels for shape {(h, w, c)}")
    return np.frombuffer(raw, dtype=np.uint8).reshape(h, w, c)


def image_shape(index: int, seed: int, size: int) -> tuple[int, int, int]:
    """The shape of image ``index``: each side drawn from 7/8 to 5/4 of ``size``."""
    rng = np.random.default_rng((seed, index, 0))
    lo, hi = max(1, size * 7 // 8), max(1, size * 5 // 4)
    h, w = (int(v) for v in rng.integers(lo, hi + 1, size=2))
    return h, w, 3


def synthetic_image(index: int, seed: int, size: int) -> U8:
    """A deterministic photograph-like image: a gradient sky, soft shapes, texture, noise.

    Image ``index`` depends only on ``(index, seed, size)``, so a smaller set is
    a prefix of a larger one. Vectorised float32: a few milliseconds at 256x256.
    """
    h, w, _ = image_shape(index, seed, size)
    rng = np.random.default_rng((seed, index, 1))
    y = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :]
    # A linear gradient between two colours, in a random direction.
    angle = float(rng.uniform(0, 2 * math.pi))
    t = x * np.float32(math.cos(angle)) + y * np.float32(math.sin(angle))
    t -= t.min()
    t /= np.float32(max(float(t.max()), 1e-6))
    c0, c1 = rng.uniform(20, 235, size=(2, 3)).astype(np.float32)
    img = c0 + t[..., None] * (c1 - c0)
    # Soft-edged ellipses and rectangles blended over it, each within its bounding box.
    for _ in range(int(rng.integers(3, 7))):
        cy, cx, ry, rx = (float(v) for v in rng.uniform((0, 0, 0.06, 0.06), (1, 1, 0.3, 0.3)))
        colour = rng.uniform(0, 255, size=3).astype(np.float32)
        round_shape = bool(rng.random() < 0.6)
        opacity = np.float32(rng.uniform(0.5, 0.95))
        y0, y1 = max(0, int((cy - ry) * h)), min(h, int((cy + ry) * h) + 2)
        x0, x1 = max(0, int((cx - rx) * w)), min(w, int((cx + rx) * w) + 2)
        if y0 >= y1 or x0 >= x1:
            continue
        dy = (y[y0:y1] - np.float32(cy)) / np.float32(ry)
        dx = (x[:, x0:x1] - np.float32(cx)) / np.float32(rx)
        d = np.sqrt(dy * dy + dx * dx) if round_shape else np.maximum(np.abs(dy), np.abs(dx))
        alpha = np.clip((1 - d) * np.float32(8), 0, 1) * opacity
        patch = img[y0:y1, x0:x1]
        patch += alpha[..., None] * (colour - patch)
    # A low-frequency texture and sensor noise (luma only).
    fy, fx = (np.float32(v) for v in rng.uniform(2, 12, size=2))
    texture = np.float32(6) * np.sin(np.float32(2 * math.pi) * (fy * y + fx * x))
    texture += rng.standard_normal(size=(h, w), dtype=np.float32) * np.float32(2.5)
    img += texture[..., None]
    out: U8 = np.clip(img + np.float32(0.5), 0, 255).astype(np.uint8)
    return out


def make_image_set(count: int, seed: int, size: int, progress: Progress | None = None) -> list[U8]:
    """``count`` encoded synthetic images (see :func:`synthetic_image`)."""
    images = []
    for i in range(count):
        images.append(encode(synthetic_image(i, seed, size)))
        if progress is not None:
            progress.update(1)
    return images


class EncodedImages:
    """The pipeline's source: ``callable(SampleInfo)`` over encoded images, picklable.

    Returns sample ``info.idx_in_epoch``, cycling through the images ``passes``
    times, then raises ``StopIteration``, which ends the epoch. With ``warmup``,
    epoch 0 is a warm-up of the first ``warmup`` images only, and the passes
    come from epoch 1 on (``len()`` counts those).
    """

    def __init__(self, data: Sequence[U8], passes: int = 1, warmup: int = 0) -> None:
        if not data:
            raise ValueError("EncodedImages needs at least one image")
        if passes < 1:
            raise ValueError(f"passes must be at least 1, not {passes}")
        if warmup < 0:
            raise ValueError(f"warmup must be at least 0, not {warmup}")
        self.data = list(data)
        self.passes = passes
        self.warmup = warmup

    def __len__(self) -> int:
        return len(self.data) * self.passes

    def __call__(self, info: Any) -> U8:
        idx = int(info.idx_in_epoch)
        warming = self.warmup and int(getattr(info, "epoch_idx", 0)) == 0
        if idx >= (self.warmup if warming else len(self)):
            raise StopIteration
        return self.data[idx % len(self.data)]


# ------------------------------------------------------------------------ the ops


def random_crop(img: U8, *, rng: np.random.Generator) -> U8:
    """A random 224x224 window of ``img``; a smaller side is first padded by its edge."""
    h, w = img.shape[:2]
    if h < CROP or w < CROP:
        pad_h, pad_w = max(0, CROP - h), max(0, CROP - w)
        pads = ((pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0))
        img = np.pad(img, pads, mode="edge")
        h, w = img.shape[:2]
    top = int(rng.integers(0, h - CROP + 1))
    left = int(rng.integers(0, w - CROP + 1))
    out: U8 = img[top : top + CROP, left : left + CROP].copy()
    return out


def flip(img: U8, *, rng: np.random.Generator) -> U8:
    """``img`` mirrored left to right with probability 1/2 (always a new array)."""
    out: U8 = np.ascontiguousarray(img[:, ::-1]) if rng.random() < 0.5 else img.copy()
    return out


#: Rows that share one gamma table in :func:`color_jitter`.
_GAMMA_BAND = 4
#: Luma weights (ITU-R BT.601), for saturation.
_LUMA = tuple(np.float32(v) for v in (0.299, 0.587, 0.114))


def color_jitter(img: U8, *, rng: np.random.Generator) -> U8:
    """Random brightness, contrast and saturation (float32), then a graduated gamma.

    The gamma part is Python on purpose: a loop over the rows maps each row
    through a 256-entry lookup table, rebuilt in pure Python for every band of
    four rows (the gamma drifts from top to bottom, like a graduated filter).
    That holds the GIL for most of the op's time, as much real augmentation
    code does.
    """
    brightness, contrast, saturation = rng.uniform(0.75, 1.25, size=3)
    gamma_top, gamma_bottom = (float(g) for g in rng.uniform(0.7, 1.4, size=2))
    x = img.astype(np.float32)
    x *= np.float32(brightness)
    gray = x[..., 0] * _LUMA[0] + x[..., 1] * _LUMA[1] + x[..., 2] * _LUMA[2]  # no BLAS
    mean = np.float32(gray.mean())
    x = (x - mean) * np.float32(contrast) + mean
    gray = (gray - mean) * np.float32(contrast) + mean
    x = (x - gray[..., None]) * np.float32(saturation) + gray[..., None]
    out: U8 = np.clip(np.rint(x), 0, 255).astype(np.uint8)
    rows = out.shape[0]
    table = np.empty(256, dtype=np.uint8)
    for r in range(rows):
        if r % _GAMMA_BAND == 0:  # a new band: a new table, built in pure Python
            f = r / max(1, rows - 1)
            gamma = gamma_top + (gamma_bottom - gamma_top) * f
            table[:] = [round(255.0 * (i / 255.0) ** gamma) for i in range(256)]
        out[r] = table[out[r]]
    return out


def normalize(img: U8) -> F32:
    """``img`` (uint8 HWC) as float32 CHW, less the ImageNet mean, over its std."""
    x = (img.astype(np.float32) - MEAN) / STD
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def sample_digest(img: Any) -> U8:
    """The SHA-1 of a sample's bytes (20 uint8): the demo's check of every output.

    Made where the sample is made (in a worker; in the serial loop, in the loop),
    so that hashing 600 KB a sample is the same work on both sides and not the
    main process's: a training loop hands its batches on, it does not read them.
    """
    h = hashlib.sha1(np.ascontiguousarray(img).data, usedforsecurity=False)
    return np.frombuffer(h.digest(), dtype=np.uint8)


#: The augmentation, in order: (name, function, takes an ``rng`` keyword).
STEPS: tuple[tuple[str, Callable[..., Any], bool], ...] = (
    ("decode", decode, False),
    ("random_crop", random_crop, True),
    ("flip", flip, True),
    ("color_jitter", color_jitter, True),
    ("normalize", normalize, False),
)


def augment_one(encoded: U8, seed: int, index: int) -> F32:
    """All of :data:`STEPS` on one sample, in this process.

    The ``rng`` of step ``k`` for sample ``index`` is seeded with
    ``(seed, k, index)``: deterministic, but not the pipeline's streams, so
    serial and pipeline outputs have the same distribution, not the same values.
    """
    x: Any = encoded
    for k, (_, function, wants_rng) in enumerate(STEPS):
        kwargs = {"rng": np.random.default_rng((seed, k, index))} if wants_rng else {}
        x = function(x, **kwargs)
    out: F32 = x
    return out


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


def warm_up_serial(encoded: Sequence[U8], seed: int, count: int) -> None:
    """The serial loop's warm-up: its first ``count`` images, as the timed loop makes them."""
    for index in range(min(count, len(encoded))):
        sample_digest(augment_one(encoded[index], seed, index))


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

    @property
    def speedups(self) -> tuple[float, ...]:
        """Each round's pipeline throughput over the serial loop's in the same round."""
        return tuple(
            p.images_per_s / s.images_per_s
            for s, p in zip(self.serial.timings, self.pipeline.timings, strict=False)
        )

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
    def other_share(self) -> float | None:
        """The larger share of the CPUs other processes used in the two sides' timed runs."""
        shares = [x.other_share for x in (self.serial_load, self.pipeline_load) if x is not None]
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
            "speedup": self.speedup,
            "speedups": list(self.speedups),
            "host_load": {
                name: None if load is None else load.to_json()
                for name, load in (("serial", self.serial_load), ("pipeline", self.pipeline_load))
            },
            "stats": _stats_json(p.stats),
        }


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
    """Generate the images, start and warm the pipeline, then time ``config.rounds``
    rounds of the serial loop and the pipeline in turn; return the measurements.

    The two sides alternate within a round and swap order from round to round
    (serial first, then pipeline first, ...), so that a change in the host's
    load or clock meets both alike; each round's speed-up compares the two
    phases run next to each other. Progress bars, when ``config.progress`` is
    set, go to ``err`` (default: stderr).
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

    source = EncodedImages(encoded, passes=config.epochs, warmup=len(encoded))
    side = PipelineSide(source, config)
    try:

        def pipeline_round() -> None:
            bar = Progress("pipeline", len(source), err, enabled=config.progress)
            try:
                side.epoch(bar)
            finally:
                bar.close()

        for r in range(config.rounds):
            for phase in (serial_round, pipeline_round)[:: 1 if r % 2 == 0 else -1]:
                phase()
        pipeline = side.result()
    finally:
        side.close()

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
    loads = [
        (name, load)
        for name, load in (("serial loop", result.serial_load), ("pipeline", result.pipeline_load))
        if load is not None
    ]
    cpus = _plural(loads[0][1].cpus, "CPU")
    parts = [f"{100 * load.other_share:.0f}% during the {name}" for name, load in loads]
    parts[0] = parts[0].replace(" during", f" of the {cpus} during", 1)
    line = f"other processes used {' and '.join(parts)}"
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
    startup = (
        f"  startup   {p.startup_s:.2f} s: building the graph, starting "
        f"{_plural(c.workers, 'worker')}"
    )
    warmup = (
        f"  warm-up   {p.warmup_s:.2f} s: the pipeline {_plural(p.warmup_images, 'image')}"
        f"{warm}, the serial loop {_plural(s.warmup_images, 'image')}"
    )
    rounds = (
        f"throughput: {_plural(len(s.timings), 'round')}, the serial loop and the pipeline "
        "in turn; medians [lowest-highest]"
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
            f"  speed-up  {speedup}{verdict}",
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
