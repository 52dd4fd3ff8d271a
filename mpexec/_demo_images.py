"""The demo's data and work: synthetic photograph-like images, their codec, the augmentation.

The steps, each a module-level function so that workers import it by
reference::

    decode -> random_crop -> flip -> color_jitter -> normalize
    bytes     224x224x3      224x224x3  224x224x3    float32 3x224x224

``color_jitter`` ends with a deliberately Python-heavy step (a per-row loop
that builds a gamma table in pure Python), the kind of code that holds the GIL
and gains nothing from threads: only processes run it in parallel.
:mod:`mpexec._demo` runs them, timed, in a pipeline, in a serial loop and in
plain processes (the host's own ceiling).
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class Counter(Protocol):
    """What counts the images made (the demo's progress bar)."""

    def update(self, n: int) -> None: ...


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


def make_image_set(count: int, seed: int, size: int, progress: Counter | None = None) -> list[U8]:
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


def warm_up_serial(encoded: Sequence[U8], seed: int, count: int) -> None:
    """The serial loop's warm-up: its first ``count`` images, as the timed loop makes them."""
    for index in range(min(count, len(encoded))):
        sample_digest(augment_one(encoded[index], seed, index))
