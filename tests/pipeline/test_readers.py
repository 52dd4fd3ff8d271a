"""``fn.readers.file`` and ``fn.decoders.image``: DALI's listing, labels, sharding and stream.

Every expectation of the reader's order without shuffling is what DALI 2.4
gave for the same files (``test_interop.py`` compares with the real package
where it is installed). The decoder needs Pillow; its tests skip without it.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn, ops, types
from mpexec.pipeline import Pipeline

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.fixture
def flat(tmp_path: Path) -> list[str]:
    """Nine files f0.jpg .. f8.jpg whose bytes are their names."""
    names = [f"f{i}.jpg" for i in range(9)]
    for n in names:
        (tmp_path / n).write_bytes(n.encode())
    return [str(tmp_path / n) for n in names]


def stream(batch_size: int, iterations: int, num_workers: int = 0, **reader: Any) -> Any:
    """(names, labels, epoch_size) of the first ``iterations`` batches of a reader."""
    pipe = Pipeline(batch_size, num_workers=num_workers, seed=7)
    with pipe:
        data, labels = fn.readers.file(name="R", **reader)
        pipe.set_outputs(data, labels)
    names, got = [], []
    with pipe:
        size = pipe.epoch_size("R")
        for _ in range(iterations):
            d, lab = pipe.run()
            names.append([bytes(x).decode()[1:-4] for x in d])
            got.append([int(x[0]) for x in lab])
            assert (lab.dtype, lab.shape()[0]) == (np.int32, (1,))
            assert d.dtype == np.uint8
    return names, got, size


def test_files_wrap_around_as_dali_readers_do(flat: list[str]) -> None:
    names, labels, size = stream(3, 4, files=flat)
    assert size == 9
    assert names == [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"], ["0", "1", "2"]]
    assert labels == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 1, 2]]


def test_files_with_labels_and_file_root(flat: list[str]) -> None:
    root = str(Path(flat[0]).parent)
    rel = [Path(f).name for f in flat[:3]]
    _, labels, _ = stream(3, 1, file_root=root, files=rel, labels=[5, 6, 7])
    assert labels == [[5, 6, 7]]


@pytest.mark.parametrize(
    ("shard", "want"),
    [
        # DALI 2.4: shard i starts at floor(9*i/n) and reads on past its own files.
        ((2, 0), [["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"], ["0", "1", "2"]]),
        ((2, 1), [["4", "5", "6"], ["7", "8", "0"], ["1", "2", "3"], ["4", "5", "6"]]),
        ((4, 3), [["6", "7", "8"], ["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"]]),
    ],
)
def test_shards_start_where_dalis_do(flat: list[str], shard: Any, want: Any) -> None:
    names, _, size = stream(3, 4, files=flat, num_shards=shard[0], shard_id=shard[1])
    assert names == want
    assert size == 9


def test_stick_to_shard_and_pad_last_batch_as_dali(flat: list[str]) -> None:
    names, _, _ = stream(3, 3, files=flat, num_shards=2, shard_id=0, stick_to_shard=True)
    assert names == [["0", "1", "2"], ["3", "0", "1"], ["2", "3", "0"]]
    names, _, size = stream(3, 4, files=flat, num_shards=2, shard_id=1, pad_last_batch=True)
    assert names == [["4", "5", "6"], ["7", "8", "8"], ["0", "1", "2"], ["3", "3", "3"]]
    assert size == 10
    names, _, size = stream(4, 3, files=flat, num_shards=3, shard_id=0, pad_last_batch=True,
                            stick_to_shard=True)  # fmt: skip
    assert names == [["0", "1", "2", "2"]] * 3
    assert size == 9


@pytest.mark.parametrize("mode", ["random_shuffle", "shuffle_after_epoch"])
def test_shuffles_are_deterministic_permutations_of_each_pass(flat: list[str], mode: str) -> None:
    first, _, _ = stream(3, 6, num_workers=1, files=flat, **{mode: True})
    again, _, _ = stream(3, 6, files=flat, **{mode: True})
    assert first == again, "the same in a worker and here, run after run"
    passes = [[n for batch in first[3 * p : 3 * p + 3] for n in batch] for p in range(2)]
    for p in passes:
        assert sorted(p) == [str(i) for i in range(9)], "each pass reads every file once"
    assert passes[0] != passes[1], "another order each pass"
    assert passes[0] != [str(i) for i in range(9)]


def test_directory_listing_labels_and_filters_are_dalis(tmp_path: Path) -> None:
    # DALI 2.4 on this tree: sub-directories sorted, one label each, not recursing,
    # file filters case-insensitive, files at the top ignored.
    for rel in ("b/x.jpg", "b/z/a.jpg", "b/a.JPG", "b/c.png", "b/d.txt", "a/1.jpg", "A/2.jpg",
                "top.jpg"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode())
    pipe = Pipeline(7, 0, None, 1)
    with pipe:
        data, labels = fn.readers.file(file_root=str(tmp_path), name="R")
        pipe.set_outputs(data, labels)
    with pipe:
        d, lab = pipe.run()
        assert pipe.epoch_size() == {"R": 5}
    got = [(bytes(x).decode(), int(y[0])) for x, y in zip(d, lab, strict=True)]
    assert got == [
        ("A/2.jpg", 0),
        ("a/1.jpg", 1),
        ("b/a.JPG", 2),
        ("b/c.png", 2),
        ("b/x.jpg", 2),
        ("A/2.jpg", 0),
        ("a/1.jpg", 1),
    ]


def test_file_list(tmp_path: Path, flat: list[str]) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text("f3.jpg 30\nf1.jpg 10\n")
    names, labels, size = stream(2, 1, file_list=str(listing))
    assert (names, labels, size) == ([["3", "1"]], [[30, 10]], 2)


def test_reader_errors_name_the_reader(flat: list[str]) -> None:
    with Pipeline(2, 0), pytest.raises(ValueError, match=r"'R'.*shard_id"):
        fn.readers.file(files=flat, num_shards=2, shard_id=2, name="R")
    with Pipeline(2, 0), pytest.raises(FileNotFoundError, match="not a directory"):
        fn.readers.file(file_root=flat[0] + ".missing")
    with Pipeline(2, 0), pytest.raises(ValueError, match="no files"):
        fn.readers.file(files=[])


def test_legacy_reader_op(flat: list[str]) -> None:
    reader = ops.readers.File(files=flat)
    pipe = Pipeline(2, 0, None, 1)
    with pipe:
        _, labels = reader()
        pipe.set_outputs(labels)
    with pipe:
        (labels,) = pipe.run()
    assert labels.as_array().ravel().tolist() == [0, 1]


# ================================================================ decoder


def _jpeg(tmp_path: Path, name: str, pixels: np.ndarray[Any, Any], **save: Any) -> str:
    image = pytest.importorskip("PIL.Image")
    path = tmp_path / name
    image.fromarray(pixels).save(path, **save)
    return str(path)


@pytest.mark.parametrize(
    ("output_type", "channels"),
    [(types.RGB, 3), (types.BGR, 3), (types.GRAY, 1), (types.ANY_DATA, 3)],
)
def test_image_decoder_matches_pillow(tmp_path: Path, output_type: Any, channels: int) -> None:
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    files = [
        _jpeg(tmp_path, f"{i}.jpg", rng.integers(0, 255, (20 + i, 31, 3), dtype=np.uint8))
        for i in range(3)
    ]
    pipe = Pipeline(3, 1, None, 1)
    with pipe:
        data, _ = fn.readers.file(files=files)
        pipe.set_outputs(fn.decoders.image(data, device="cpu", output_type=output_type))
    with pipe:
        (out,) = pipe.run()
    assert out.layout() == "HWC"
    for f, got in zip(files, out, strict=True):
        mode = {types.GRAY: "L"}.get(output_type, "RGB")
        img = image.open(f)
        img.draft(mode, img.size)  # GRAY: libjpeg's luma, as DALI decodes it
        want = np.asarray(img.convert(mode))
        want = want[:, :, None] if want.ndim == 2 else want
        if output_type == types.BGR:
            want = want[:, :, ::-1]
        assert got.shape == (*want.shape[:2], channels)
        assert np.array_equal(got, want)


def test_image_decoder_applies_exif_orientation(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    pixels = np.zeros((10, 20, 3), np.uint8)
    exif = image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: DALI (adjust_orientation=True) turns it upright
    buf = io.BytesIO()
    image.fromarray(pixels).save(buf, format="JPEG", exif=exif)
    path = tmp_path / "o.jpg"
    path.write_bytes(buf.getvalue())
    pipe = Pipeline(1, 0, None, 1)
    with pipe:
        data, _ = fn.readers.file(files=[str(path)])
        pipe.set_outputs(fn.decoders.image(data), fn.decoders.image(data, adjust_orientation=False))
    with pipe:
        upright, raw = pipe.run()
    assert upright.shape()[0] == (20, 10, 3)
    assert raw.shape()[0] == (10, 20, 3)


def test_mixed_device_decoding_says_what_to_use() -> None:
    pipe = Pipeline(1, 0)
    with pipe:
        x = fn.external_source(source=[[np.zeros(3, np.uint8)]], name="x")
        with pytest.raises(ValueError, match=r"device='cpu'.*mpexec\.dali"):
            fn.decoders.image(x, device="mixed")
        pipe.set_outputs(x)


def test_legacy_decoder_op(tmp_path: Path) -> None:
    f = _jpeg(tmp_path, "a.jpg", np.full((4, 6, 3), 200, np.uint8))
    decode = ops.decoders.Image(device="cpu", output_type=types.RGB)
    pipe = Pipeline(1, 0, None, 1)
    with pipe:
        data, _ = ops.readers.File(files=[f])()
        pipe.set_outputs(decode(data))
    with pipe:
        (out,) = pipe.run()
    assert out.shape()[0] == (4, 6, 3)
    assert isinstance(out, mpexec.Batch)


def test_file_list_parsing_as_dali(tmp_path: Path, flat: list[str]) -> None:
    """A tab separates like a space; a UTF-8 byte-order mark is not part of the first name."""
    listing = tmp_path / "list.txt"
    listing.write_bytes("\ufeffF3.jpg\t30\nf1.jpg  10\n".replace("F3", "f3").encode("utf-8"))
    names, labels, size = stream(2, 1, file_list=str(listing))
    assert (names, labels, size) == ([["3", "1"]], [[30, 10]], 2)


def test_reader_argument_errors_say_where(tmp_path: Path, flat: list[str]) -> None:
    listing = tmp_path / "bad.txt"
    listing.write_text("f3.jpg 30\nf1.jpg ten\n")
    with Pipeline(2, 0), pytest.raises(ValueError, match=r"bad\.txt'?, line 2: the label 'ten'"):
        fn.readers.file(file_list=str(listing))
    with Pipeline(2, 0), pytest.raises(TypeError, match=r"shard_id must be an int, not 1\.0"):
        fn.readers.file(files=flat, num_shards=2, shard_id=1.0)


def test_a_looping_link_is_skipped_not_fatal(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "x.jpg").write_bytes(b"_x.jpg")
    (root / "a" / "loop.jpg").symlink_to(root / "a" / "loop.jpg")  # ELOOP when followed
    (root / "loop").symlink_to(root / "loop")
    names, labels, size = stream(1, 1, file_root=str(root))
    assert (names, labels, size) == ([["x"]], [[0]], 1)


def test_a_16_bit_grayscale_png_is_scaled_as_dali(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image")
    wide = (np.arange(40 * 30, dtype=np.uint32).reshape(40, 30) * 54).astype(np.uint16)
    path = tmp_path / "deep.png"
    image.fromarray(wide).save(path)
    for output_type, channels in ((types.GRAY, 1), (types.RGB, 3)):
        pipe = Pipeline(1, 1, None, 1)
        with pipe:
            data, _ = fn.readers.file(files=[str(path)])
            pipe.set_outputs(fn.decoders.image(data, output_type=output_type))
        with pipe:
            (out,) = pipe.run()
        want = np.rint(wide / 257).astype(np.uint8)  # DALI 2.4: round(v / 257)
        assert out[0].shape == (40, 30, channels)
        for c in range(channels):
            assert np.array_equal(out[0][:, :, c], want)
