"""Decoders, DALI style: ``fn.decoders.image`` decodes in the workers, with Pillow.

Pillow is an optional extra (``pip install -e ".[image]"`` in a checkout), imported by the
workers when they decode and checked for when the op is defined. Measured
against DALI 2.4's CPU decoder (docs/pipeline.md, "Porting from DALI"): RGB
and BGR pixels are identical (JPEG baseline and progressive, 4:4:4, 4:2:2,
4:2:0, odd sizes, grayscale and CMYK JPEG, PNG); GRAY of JPEGs is identical
(libjpeg's luma, as DALI takes it); GRAY of other formats is DALI's formula
computed here, off by one in about 0.1% of pixels. Other libjpeg builds than
the ones these wheels bundle may round differently.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._extras import INSTALL_DOC, install_command
from .._graph import DataNode
from .._types import DALIImageType, as_numpy_dtype
from ._core import graph_for, python_function

__all__ = ["image"]

_MODES = {
    DALIImageType.RGB: "RGB",
    DALIImageType.BGR: "RGB",
    DALIImageType.GRAY: "L",
    DALIImageType.YCbCr: "YCbCr",
}


def image(
    data: DataNode,
    *,
    device: str | None = "cpu",
    output_type: Any = DALIImageType.RGB,
    dtype: Any = None,
    adjust_orientation: bool = True,
    name: str | None = None,
    preserve: bool = False,
    bytes_per_sample_hint: int | Sequence[int] = 0,
    **dali_options: Any,
) -> DataNode:
    """Decode encoded images (uint8 arrays) into HWC uint8 arrays (DALI's ``fn.decoders.image``).

    ``output_type``: ``types.RGB`` (default), ``BGR``, ``GRAY`` (one
    channel, ``HW1``), ``YCbCr``, or ``ANY_DATA`` (the image's own channels).
    ``adjust_orientation`` applies the EXIF orientation, as DALI does.
    ``device="cpu"`` only: ``"mixed"`` (DALI's GPU decoding) is an error that
    says what to do instead. DALI's tuning options (``hw_decoder_load``,
    ``use_fast_idct``, the memory paddings, ...) are accepted and have no
    effect; ``jpeg_fancy_upsampling`` is what Pillow always does.
    """
    del bytes_per_sample_hint, dali_options
    graph = graph_for("decoders.image")
    name_ = name if name is not None else graph.unique_name("image_decoder")
    what = f"fn.decoders.image '{name_}'"
    if device == "mixed":
        raise ValueError(
            f"{what}: device='mixed' decodes on the GPU in DALI; mpexec decodes on the CPU "
            "with Pillow: use device='cpu', or keep DALI's decoder in a DALI pipeline and run "
            "your Python functions in it with mpexec.dali.python_function"
        )
    if device not in ("cpu", None):
        raise ValueError(f"{what}: device must be 'cpu', not {device!r}")
    if dtype is not None and as_numpy_dtype(dtype) != np.uint8:
        raise ValueError(f"{what}: decoded images are uint8 here (dtype=types.UINT8), not {dtype}")
    kind = _image_type(what, output_type)
    _require_pillow(what)
    out: DataNode = python_function(
        data,
        function=ImageDecoder(kind, adjust_orientation),
        output_layouts="HWC",
        preserve=preserve,
        name=name_,
    )
    return out


class ImageDecoder:
    """Bytes of an image file -> HWC uint8 array, with Pillow (runs in the workers)."""

    def __init__(self, output_type: DALIImageType, adjust_orientation: bool = True) -> None:
        self.output_type = output_type
        self.adjust_orientation = adjust_orientation

    def __call__(self, data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        from PIL import Image, ImageOps

        img: Any = Image.open(io.BytesIO(np.ascontiguousarray(data).data))
        gray = self.output_type == DALIImageType.GRAY
        if gray and img.format == "JPEG":
            img.draft("L", img.size)  # libjpeg's own luma, as DALI decodes it (exact)
        if self.adjust_orientation:
            img = ImageOps.exif_transpose(img)
        if img.mode.startswith("I;16") or img.mode == "I":
            # 16-bit grayscale: scaled to 8 bits as DALI does (round(v / 257)), where
            # Pillow's conversion would clip every value above 255.
            wide = np.asarray(img, dtype=np.float64)
            img = Image.fromarray(np.rint(np.clip(wide, 0, 65535) / 257).astype(np.uint8))
        if gray and img.mode not in ("L", "RGB"):
            img = img.convert("RGB")
        if gray and img.mode == "RGB":
            # DALI's conversion (float luma, rounded down), not Pillow's (rounded).
            rgb = np.asarray(img, dtype=np.float32)
            luma = np.floor(rgb @ np.array([0.299, 0.587, 0.114], np.float32))
            return np.ascontiguousarray(luma.astype(np.uint8)[:, :, None])
        mode = _MODES.get(self.output_type)
        if mode is not None and img.mode != mode:
            img = img.convert(mode)
        out = np.asarray(img)
        if out.ndim == 2:
            out = out[:, :, None]
        if self.output_type == DALIImageType.BGR:
            out = out[:, :, ::-1]
        return np.ascontiguousarray(out, dtype=np.uint8)

    def __repr__(self) -> str:
        return f"ImageDecoder({self.output_type})"


def _image_type(what: str, value: Any) -> DALIImageType:
    if isinstance(value, DALIImageType):
        return value
    name = getattr(value, "name", None)  # real DALI's enum, by name
    if type(value).__name__ == "DALIImageType" and str(name) in DALIImageType.__members__:
        return DALIImageType[str(name)]
    raise TypeError(f"{what}: output_type must be a types.DALIImageType, not {value!r}")


def _require_pillow(what: str) -> None:
    try:
        import PIL  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"{what} decodes with Pillow, which is not installed: from a checkout of mpexec, "
            f"{install_command('image')} (see {INSTALL_DOC})"
        ) from exc
