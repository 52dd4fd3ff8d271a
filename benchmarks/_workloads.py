"""The functions every system runs in ``python -m benchmarks peers``: identical for all.

Module-level functions only, so that every system (and every start method)
can pickle them by reference. Nothing here depends on which process, worker
or library runs it: every random choice comes from the sample's index,
``np.random.default_rng([seed, index])``, never from a per-worker generator,
so that each system's output can be compared, bit for bit, with the serial one.

Workload 1 (augmentation), per sample ``i``:

``load_image(i)``
    A deterministic 256x256x3 uint8 image (what a reader and decoder would
    hand over), made from the index.
``augment(image, i)``
    Random crop 256 -> 224, random horizontal flip, brightness and contrast
    jitter in float32, then a per-pixel noise field drawn by a pure-Python
    generator (the Python-heavy part: the GIL is held most of the time) and
    the ImageNet normalisation. Returns 224x224x3 float32.
``process_sample(i)``
    ``augment(load_image(i), i)``: what a map-style worker runs.

Workload 2 (JPEG decoding and augmentation), per sample ``i``:

``load_jpeg(i)``
    The encoded bytes of JPEG ``i % 9`` (a 1-D uint8 array), and the index: what a
    reader hands over. The nine JPEGs are made in each process, once, from a real
    photograph that ships with matplotlib (``sample_data/grace_hopper.jpg``, found
    without importing matplotlib): three 512x512 windows of it, each resized (Lanczos)
    to 256, 384 and 512 px squares and encoded by Pillow at quality 90.
``decode_augment(encoded, i)``
    Pillow's decoding to 256x256x3 uint8 (resized bilinearly where larger), then
    ``augment``. Returns 224x224x3 float32.
``jpeg_sample(i)``
    ``decode_augment(*load_jpeg(i))``: what a map-style worker runs.

Workloads 1 and 2 are :data:`PER_SAMPLE` entries, and every system of them is
built from one: its ``load`` (a source's or data set's sample), ``transform``
(the op run on that) and ``sample`` (both, for map-style systems).

Workload 3 (per-call overhead): ``echo``. Workload 4 (transfer): ``add_one``.

Workload 6 (light ops, per-item cost), per sample ``i``: ``light_load(i)`` is 16
float32 made from the index (and the index), ``light_transform`` is ``x + 1``;
batches of 256. ``light_batch_transform`` is the same on a whole batch (for
batch-mode ops).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SIZE = 256
CROP = 224
CHANNELS = 3
IMAGE_SHAPE = (IMAGE_SIZE, IMAGE_SIZE, CHANNELS)
OUTPUT_SHAPE = (CROP, CROP, CHANNELS)
BATCH_SIZE = 64

IMAGE_SEED = 20_261_201  # what the images are made of
AUGMENT_SEED = 42  # the random choices of the augmentation

# Every NOISE_STEP-th pixel of a row gets its own noise value, from a pure-Python
# generator; the values are repeated over the pixels in between. It sets how much
# of the time is spent in the interpreter, with the GIL held: about 75% at 1 (the
# rest is NumPy, part of which releases the GIL).
NOISE_STEP = 1

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
INV_255 = np.float32(1.0 / 255.0)
NOISE_SCALE = np.float32(1.0 / 512.0)


def load_image(index: int) -> np.ndarray[Any, Any]:
    """Image ``index`` of the data set: 256x256x3 uint8, the same wherever it is made.

    Smooth gradients plus seeded noise, so that crops and flips change the result.
    """
    index = int(index)
    rng = np.random.default_rng([IMAGE_SEED, index])
    img = rng.integers(0, 64, IMAGE_SHAPE, dtype=np.uint8)
    ramp = np.arange(IMAGE_SIZE, dtype=np.uint16)
    img[:, :, 0] += ((ramp[None, :] + 7 * index) % 192).astype(np.uint8)
    img[:, :, 1] += ((ramp[:, None] + 13 * index) % 192).astype(np.uint8)
    img[:, :, 2] += np.uint8((31 * index) % 192)
    return img


def augment(image: np.ndarray[Any, Any], index: Any) -> np.ndarray[Any, Any]:
    """Crop, flip, jitter, noise and normalise one image; deterministic in ``index``."""
    return _augment(image, index, NOISE_STEP)


def augment4(image: np.ndarray[Any, Any], index: Any) -> np.ndarray[Any, Any]:
    """:func:`augment` with a noise value per 4 pixels: 3-4 ms a sample where it takes 11."""
    return _augment(image, index, 4)


def _augment(image: np.ndarray[Any, Any], index: Any, noise_step: int) -> np.ndarray[Any, Any]:
    """Crop, flip, jitter, noise and normalise one image; deterministic in ``index``.

    ``index`` may be an int or an array holding one (as a pipeline passes it).
    Every float operation is elementwise or exact (the image mean is an integer
    sum), so that the result does not depend on memory alignment or SIMD width.
    """
    index = int(np.asarray(index).reshape(-1)[0])
    rng = np.random.default_rng([AUGMENT_SEED, index])
    top, left = (int(v) for v in rng.integers(0, IMAGE_SIZE - CROP + 1, size=2))
    flip = bool(rng.random() < 0.5)
    brightness = np.float32(rng.uniform(-0.125, 0.125))
    contrast = np.float32(rng.uniform(0.75, 1.25))
    state = int(rng.integers(1, 1 << 31))

    crop = image[top : top + CROP, left : left + CROP]
    if flip:
        crop = crop[:, ::-1]
    mean = np.float32(int(crop.sum(dtype=np.int64)) / crop.size / 255.0)
    x = crop.astype(np.float32)
    x *= INV_255
    x -= mean
    x *= contrast
    x += mean + brightness

    # The Python-heavy part: a noise value per noise_step pixels from a linear
    # congruential generator, one interpreter iteration each.
    cols = CROP // noise_step
    noise = np.empty((CROP, cols), dtype=np.float32)
    for r in range(CROP):
        row = []
        for _ in range(cols):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            row.append((state >> 16) % 17 - 8)
        noise[r] = row
    noise *= NOISE_SCALE
    x += np.repeat(noise, noise_step, axis=1)[:, :, None]

    np.clip(x, np.float32(0.0), np.float32(1.0), out=x)
    x -= MEAN
    x /= STD
    return x


def process_sample(index: int) -> np.ndarray[Any, Any]:
    """One sample of workload 1, from its index: what a map-style worker runs."""
    return augment(load_image(index), index)


def process_sample4(index: int) -> np.ndarray[Any, Any]:
    """One sample of workload 1b (:func:`augment4`), from its index."""
    return augment4(load_image(index), index)


def load_sample(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(image, index)`` for pipelines whose source hands both to the augmentation op."""
    return load_image(index), np.array([index], dtype=np.int64)


# ---------------------------------------------------------------- workload 2
JPEG_SOURCE = "grace_hopper.jpg"  # matplotlib's sample photograph, 512x600 RGB
JPEG_SIZES = (256, 384, 512)  # the encoded squares' sides, in pixels
JPEG_WINDOWS = 3  # 512x512 windows of the photograph, top to bottom
JPEG_QUALITY = 90


def jpeg_source() -> Path | None:
    """Where matplotlib's sample photograph is, if it is installed (matplotlib not imported)."""
    spec = importlib.util.find_spec("matplotlib")
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder, "mpl-data", "sample_data", JPEG_SOURCE)
        if path.is_file():
            return path
    return None


def jpeg_unavailable() -> str | None:
    """None if workload 2 can run here, else why not (a skip reason)."""
    if importlib.util.find_spec("PIL") is None:
        return "skipped (Pillow not installed: it decodes the JPEGs)"
    if jpeg_source() is None:
        return f"skipped (no matplotlib with sample_data/{JPEG_SOURCE}: the JPEGs are made of it)"
    return None


@functools.cache
def jpeg_files() -> tuple[bytes, ...]:
    """The encoded JPEGs of workload 2, made once per process; the same in every process."""
    from PIL import Image

    path = jpeg_source()
    if path is None:
        raise RuntimeError(jpeg_unavailable())
    with Image.open(path) as f:
        photo = f.convert("RGB")
    width, height = photo.size
    side = min(width, height)
    tops = np.linspace(0, height - side, JPEG_WINDOWS).round().astype(int)
    lefts = np.linspace(0, width - side, JPEG_WINDOWS).round().astype(int)
    files = []
    for size in JPEG_SIZES:
        for top, left in zip(tops, lefts, strict=True):
            window = photo.crop((int(left), int(top), int(left) + side, int(top) + side))
            if size != side:
                window = window.resize((size, size), Image.Resampling.LANCZOS)
            out = io.BytesIO()
            window.save(out, format="JPEG", quality=JPEG_QUALITY)
            files.append(out.getvalue())
    return tuple(files)


def jpeg_dataset() -> dict[str, Any]:
    """What workload 2's data set is made of (for the report)."""
    from PIL import features

    files = jpeg_files()
    return {
        "source": f"matplotlib sample_data/{JPEG_SOURCE}",
        "files": len(files),
        "sizes": list(JPEG_SIZES),
        "quality": JPEG_QUALITY,
        "mean_bytes": int(np.mean([len(f) for f in files])),
        "pillow": features.version("pil"),
        "libjpeg_turbo": features.version("libjpeg_turbo"),
    }


def load_jpeg(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(encoded bytes as 1-D uint8, index)``: sample ``index`` of workload 2, as read."""
    files = jpeg_files()
    encoded = np.frombuffer(files[int(index) % len(files)], dtype=np.uint8)
    return encoded, np.array([index], dtype=np.int64)


def decode(encoded: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A JPEG's bytes decoded by Pillow to 256x256x3 uint8 (bilinear downsizing if larger)."""
    from PIL import Image

    with Image.open(io.BytesIO(np.asarray(encoded, dtype=np.uint8).tobytes())) as f:
        image = f.convert("RGB")
    if image.size != (IMAGE_SIZE, IMAGE_SIZE):
        image = image.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
    return np.asarray(image)


def decode_augment(encoded: np.ndarray[Any, Any], index: Any) -> np.ndarray[Any, Any]:
    """Workload 2's op: decode, then workload 1's ``augment``."""
    return augment(decode(encoded), index)


def jpeg_sample(index: int) -> np.ndarray[Any, Any]:
    """One sample of workload 2, from its index: what a map-style worker runs."""
    return decode_augment(*load_jpeg(index))


# ---------------------------------------------------------------- workload 6
LIGHT_SIZE = 16
LIGHT_BATCH = 256
LIGHT_SHAPE = (LIGHT_SIZE,)


def light_load(index: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """``(16 float32, index)``: sample ``index`` of workload 6, as read."""
    index = int(index)
    x = np.arange(LIGHT_SIZE, dtype=np.float32) + np.float32(index % 1021)
    return x, np.array([index], dtype=np.int64)


def light_transform(x: np.ndarray[Any, Any], index: Any) -> np.ndarray[Any, Any]:
    """Workload 6's op: ``x + 1`` (``index`` unused: the op is as light as it gets)."""
    del index
    return x + np.float32(1.0)


def light_sample(index: int) -> np.ndarray[Any, Any]:
    """One sample of workload 6, from its index: what a map-style worker runs."""
    return light_transform(*light_load(index))


def light_batch_transform(xs: list[Any], indices: list[Any]) -> np.ndarray[Any, Any]:
    """Workload 6's op on a whole batch (a batch-mode op): one ``x + 1`` of the stack."""
    del indices
    return np.stack(xs) + np.float32(1.0)


# ---------------------------------------------------------------- workloads 1, 2 and 6
@dataclass(frozen=True)
class PerSample:
    """A per-sample workload: the module-level functions its systems call."""

    load: Callable[[int], tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]  # (input, index)
    transform: Callable[[np.ndarray[Any, Any], Any], np.ndarray[Any, Any]]  # -> output_shape
    sample: Callable[[int], np.ndarray[Any, Any]]  # transform(*load(i))
    batch_size: int = BATCH_SIZE
    output_shape: tuple[int, ...] = OUTPUT_SHAPE
    batch_transform: Callable[[list[Any], list[Any]], np.ndarray[Any, Any]] | None = None


PER_SAMPLE: dict[str, PerSample] = {
    "augment": PerSample(load_sample, augment, process_sample),
    "augment4": PerSample(load_sample, augment4, process_sample4),
    "jpeg": PerSample(load_jpeg, decode_augment, jpeg_sample),
    "light": PerSample(
        light_load,
        light_transform,
        light_sample,
        LIGHT_BATCH,
        LIGHT_SHAPE,
        light_batch_transform,
    ),
}


def process_batch(indices: Iterable[int], workload: str = "augment") -> np.ndarray[Any, Any]:
    """A whole batch of a per-sample workload, stacked: (n, 224, 224, 3) float32."""
    sample = PER_SAMPLE[workload].sample
    return np.stack([sample(i) for i in indices])


def batches_of(n: int, batch_size: int = BATCH_SIZE) -> list[range]:
    """The indices of each batch of an epoch of ``n`` samples (the last may be short)."""
    return [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]


def digest(array: Any) -> str:
    """A digest of an array's dtype, shape and bytes (how outputs are compared)."""
    a = np.ascontiguousarray(array)
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data)
    return h.hexdigest()


def reference_digests(n: int, batch_size: int = BATCH_SIZE) -> list[str]:
    """The serial result of workload 1: one digest per batch."""
    return [digest(process_batch(b)) for b in batches_of(n, batch_size)]


# ---------------------------------------------------------------- workload 3
def echo(x: Any) -> Any:
    """The trivial call: returns its argument."""
    return x


# ---------------------------------------------------------------- workload 4
def add_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A new array of the same size and dtype, computed cheaply."""
    return x + np.ones(1, dtype=x.dtype)


def transfer_input(nbytes: int) -> np.ndarray[Any, Any]:
    """The input of workload 4: ``nbytes`` of float32, values that ``+ 1`` keeps exact."""
    return (np.arange(nbytes // 4, dtype=np.int64) % 1021).astype(np.float32)
