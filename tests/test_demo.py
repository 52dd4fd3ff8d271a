"""``python -m mpexec demo``: its image set, its ops, the serial baseline and the CLI."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import pytest

from mpexec import _demo
from mpexec.__main__ import main as cli_main

CROP = _demo.CROP


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def read_only(a: np.ndarray) -> np.ndarray:
    """What a pipeline hands a function: a read-only view."""
    v = a.view()
    v.flags.writeable = False
    return v


# ------------------------------------------------------------------ image set and codec


@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 5, 3), (300, 257, 3), (10, 10, 1)])
def test_decode_inverts_encode(shape: tuple[int, int, int]) -> None:
    img = rng().integers(0, 256, size=shape, dtype=np.uint8)
    encoded = _demo.encode(img)
    assert encoded.dtype == np.uint8
    assert encoded.ndim == 1
    decoded = _demo.decode(read_only(encoded))
    assert decoded.dtype == np.uint8
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, img)


def test_encode_compresses_smooth_images() -> None:
    img = _demo.synthetic_image(0, seed=0, size=128)
    assert _demo.encode(img).nbytes < img.nbytes


def test_encode_rejects_non_images() -> None:
    with pytest.raises(ValueError, match="uint8 HxWxC"):
        _demo.encode(np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="uint8 HxWxC"):
        _demo.encode(np.zeros((4, 4, 3), np.float32))


def test_decode_rejects_garbage() -> None:
    encoded = _demo.encode(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="shorter than its header"):
        _demo.decode(encoded[:5])
    bad = encoded.copy()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        _demo.decode(bad)
    other = _demo.encode(np.zeros((4, 5, 3), np.uint8))
    spliced = np.concatenate([encoded[:16], other[16:]])
    with pytest.raises(ValueError, match="corrupt"):
        _demo.decode(spliced)


def test_synthetic_images_are_deterministic_and_sized() -> None:
    a = _demo.synthetic_image(3, seed=7, size=64)
    b = _demo.synthetic_image(3, seed=7, size=64)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.uint8
    assert a.shape == _demo.image_shape(3, seed=7, size=64)
    h, w, c = a.shape
    assert c == 3
    assert 56 <= h <= 80
    assert 56 <= w <= 80
    assert not np.array_equal(a[: min(h, 56), :56], _demo.synthetic_image(3, 8, 64)[:56, :56])
    assert a.std() > 5  # not a flat field


def test_image_set_is_a_prefix_of_a_larger_one() -> None:
    small = _demo.make_image_set(2, seed=1, size=48)
    large = _demo.make_image_set(3, seed=1, size=48)
    for x, y in zip(small, large, strict=False):
        np.testing.assert_array_equal(x, y)
    shapes = {_demo.decode(e).shape for e in large}
    assert len(shapes) > 1  # sizes vary


def test_encoded_images_source() -> None:
    data = _demo.make_image_set(3, seed=0, size=16)
    source = _demo.EncodedImages(data, passes=2)
    assert len(source) == 6

    @dataclass
    class Info:
        idx_in_epoch: int

    assert source(Info(1)) is data[1]
    assert source(Info(4)) is data[1]
    with pytest.raises(StopIteration):
        source(Info(6))
    one_pass = _demo.EncodedImages(data)
    with pytest.raises(StopIteration):
        one_pass(Info(3))
    clone = pickle.loads(pickle.dumps(source))
    np.testing.assert_array_equal(clone(Info(2)), data[2])
    with pytest.raises(ValueError, match="at least one image"):
        _demo.EncodedImages([])
    with pytest.raises(ValueError, match="passes"):
        _demo.EncodedImages(data, passes=0)


# ------------------------------------------------------------------ the ops


def test_ops_pickle_by_reference() -> None:
    for _, function, _ in _demo.STEPS:
        assert function.__module__ == "mpexec._demo"
        blob = pickle.dumps(function)
        assert len(blob) < 100
        assert pickle.loads(blob) is function


@pytest.mark.parametrize("shape", [(256, 300, 3), (CROP, CROP, 3), (100, 400, 3), (5, 5, 3)])
def test_random_crop_stays_in_bounds(shape: tuple[int, int, int]) -> None:
    img = rng(1).integers(0, 256, size=shape, dtype=np.uint8)
    for seed in range(5):
        out = _demo.random_crop(read_only(img), rng=rng(seed))
        assert out.shape == (CROP, CROP, 3)
        assert out.dtype == np.uint8
        assert out.flags.writeable
        np.testing.assert_array_equal(out, _demo.random_crop(img, rng=rng(seed)))
        if shape[0] >= CROP and shape[1] >= CROP:  # a window of the image itself
            replay = rng(seed)
            top = int(replay.integers(0, shape[0] - CROP + 1))
            left = int(replay.integers(0, shape[1] - CROP + 1))
            np.testing.assert_array_equal(out, img[top : top + CROP, left : left + CROP])
        else:  # padded by the edge: every value comes from the image
            assert set(np.unique(out)) <= set(np.unique(img))


def test_random_crop_varies_with_the_rng() -> None:
    img = rng(1).integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    crops = {_demo.random_crop(img, rng=rng(s)).tobytes() for s in range(6)}
    assert len(crops) > 1


def test_flip_mirrors_or_copies() -> None:
    img = rng(2).integers(0, 256, size=(CROP, CROP, 3), dtype=np.uint8)
    seen = set()
    for seed in range(16):
        out = _demo.flip(read_only(img), rng=rng(seed))
        assert out.shape == img.shape
        assert out.dtype == np.uint8
        assert not np.shares_memory(out, img)
        np.testing.assert_array_equal(out, _demo.flip(img, rng=rng(seed)))
        if np.array_equal(out, img):
            seen.add("same")
        else:
            np.testing.assert_array_equal(out, img[:, ::-1])
            seen.add("mirrored")
    assert seen == {"same", "mirrored"}


def test_color_jitter_is_deterministic_per_rng() -> None:
    img = _demo.random_crop(_demo.synthetic_image(0, 0, 256), rng=rng())
    before = img.copy()
    a = _demo.color_jitter(read_only(img), rng=rng(5))
    b = _demo.color_jitter(read_only(img), rng=rng(5))
    c = _demo.color_jitter(read_only(img), rng=rng(6))
    np.testing.assert_array_equal(img, before)  # input untouched
    assert a.shape == img.shape
    assert a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, img)


def test_normalize_gives_float32_chw() -> None:
    img = rng(3).integers(0, 256, size=(CROP, CROP, 3), dtype=np.uint8)
    out = _demo.normalize(read_only(img))
    assert out.shape == (3, CROP, CROP)
    assert out.dtype == np.float32
    assert out.flags.c_contiguous
    expected = (img.astype(np.float64) - _demo.MEAN) / _demo.STD
    np.testing.assert_allclose(out, expected.transpose(2, 0, 1), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the serial baseline


def test_serial_baseline_is_deterministic() -> None:
    encoded = _demo.make_image_set(3, seed=0, size=64)
    timing, digest = _demo.run_serial(encoded, seed=0)
    assert timing.images == 3
    assert timing.seconds > 0
    assert timing.images_per_s > 0
    assert _demo.run_serial(encoded, seed=0)[1] == digest
    assert _demo.run_serial(encoded, seed=1)[1] != digest
    out = _demo.augment_one(encoded[0], seed=0, index=0)
    assert out.shape == (3, CROP, CROP)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()


# ------------------------------------------------------------------ progress bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal() -> None:
    assert not _demo.Progress.wanted(io.StringIO())
    assert _demo.Progress.wanted(FakeTerminal())
    assert not _demo.Progress.wanted(FakeTerminal(), disabled=True)

    quiet = io.StringIO()
    bar = _demo.Progress("serial", 4, quiet, enabled=False)
    bar.update(4)
    bar.close()
    assert quiet.getvalue() == ""

    tty = FakeTerminal()
    bar = _demo.Progress("serial", 4, tty, enabled=True)
    bar.update(1)
    bar.update(3)
    bar.close()
    text = tty.getvalue()
    assert text.startswith("\rserial")
    assert "4/4 images" in text.rsplit("\r", 1)[1]  # the last drawing is complete
    assert text.endswith("\n")
    assert "#" * _demo.Progress.WIDTH in text


# ------------------------------------------------------------------ the demo, end to end


@dataclass
class _Info:
    idx_in_epoch: int


class FakePipeline:
    """The pipeline's contract, serially, for testing the demo without it."""

    def __init__(self, source: _demo.EncodedImages, config: _demo.DemoConfig) -> None:
        self.source = source
        self.config = config
        self.calls = 0

    def __enter__(self) -> FakePipeline:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[list[np.ndarray]]]:
        idx = 0
        while True:
            batch = []
            for _ in range(self.config.batch_size):
                try:
                    enc = self.source(_Info(idx))
                except StopIteration:
                    break
                batch.append(_demo.augment_one(enc, self.config.seed + 1, idx))
                idx += 1
            self.calls += len(batch)
            if not batch:
                return
            yield (batch,)

    def stats(self) -> str:
        return f"FAKE STATS {self.calls} calls"


@pytest.fixture
def fake_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_demo, "build_pipeline", FakePipeline)


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_reports_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    config = _demo.DemoConfig(images=3, size=48, batch_size=2, workers=2, epochs=2, progress=False)
    assert _demo.main(config) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "throughput" in out
    assert "serial" in out
    assert "pipeline" in out
    assert "speed-up" in out
    assert "6 images in" in out  # 2 epochs of 3
    assert "3 batches of up to 2" in out
    assert "FAKE STATS 6 calls" in out


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = _demo.DemoConfig(images=2, size=32, batch_size=4, workers=1, epochs=1, progress=False)
    assert _demo.main(config, as_json=True) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["images"] == 2
    assert summary["serial"]["images"] == 2
    assert summary["pipeline"]["images"] == 2
    assert summary["pipeline"]["batches"] == 1
    assert summary["speedup"] > 0
    assert summary["stats"] == "FAKE STATS 2 calls"


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_draws_progress_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    tty = FakeTerminal()
    config = _demo.DemoConfig(images=2, size=32, batch_size=2, workers=1, epochs=1)
    _demo.run_demo(config, err=tty)
    assert "\rserial" in tty.getvalue()
    assert "\rpipeline" in tty.getvalue()
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("no_leaks")
def test_pipeline_outputs_do_not_depend_on_workers() -> None:
    source = _demo.EncodedImages(_demo.make_image_set(3, seed=0, size=32), passes=2)
    runs = [
        _demo.run_pipeline(source, _demo.DemoConfig(images=3, batch_size=4, workers=w, seed=5))
        for w in (0, 2)
    ]
    for run in runs:
        assert run.timing.images == 6
        assert run.batches == 2
        assert run.startup_s >= 0
        assert "color_jitter" in str(run.stats)
    assert runs[0].digest == runs[1].digest


def test_demo_rejects_a_wrong_output() -> None:
    with pytest.raises(RuntimeError, match="expected float32"):
        _demo._check_output(np.zeros((CROP, CROP, 3), np.float32))


# ------------------------------------------------------------------ command line


def test_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["demo", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--batch-size", "--workers", "--images", "--epochs", "--seed", "--size"):
        assert option in out
    assert "--no-progress" in out
    assert "--json" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--bogus"],
        ["demo", "--batch-size", "0"],
        ["demo", "--images", "many"],
        ["demo", "--workers", "-1"],
        ["demo", "--epochs", "0"],
        ["demo", "--size", "0"],
        ["demo", "extra"],
    ],
)
def test_cli_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_passes_options_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_main(config: _demo.DemoConfig, *, as_json: bool = False) -> int:
        seen["config"], seen["as_json"] = config, as_json
        return 0

    monkeypatch.setattr(_demo, "main", fake_main)
    argv = ["demo", "--images", "5", "--batch-size", "3", "--workers", "0", "--size", "64"]
    assert cli_main([*argv, "--epochs", "4", "--seed", "9", "--no-progress", "--json"]) == 0
    assert seen["config"] == _demo.DemoConfig(
        images=5, size=64, batch_size=3, workers=0, epochs=4, seed=9, progress=False
    )
    assert seen["as_json"] is True

    from mpexec._host import usable_cpus

    assert cli_main(["demo"]) == 0
    assert seen["config"].workers == usable_cpus()
    assert seen["config"].images == 256
    assert seen["config"].batch_size == 32
    assert seen["config"].progress is False  # stderr is not a terminal under pytest
    assert seen["as_json"] is False


@pytest.mark.usefixtures("no_leaks")
def test_cli_demo_runs_the_pipeline() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpexec",
            "demo",
            *("--images", "16", "--batch-size", "4", "--workers", "2", "--no-progress"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "throughput" in done.stdout
    assert "images/s" in done.stdout
    assert "speed-up" in done.stdout
    assert "Traceback" not in done.stderr
