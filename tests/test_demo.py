"""``python -m mpexec demo``: its image set, its ops, the serial baseline and the CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pytest

from mpexec import _demo
from mpexec import _demo_images as demo_images
from mpexec.__main__ import main as cli_main
from mpexec._cpuload import CpuLoad

CROP = demo_images.CROP


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
    encoded = demo_images.encode(img)
    assert encoded.dtype == np.uint8
    assert encoded.ndim == 1
    decoded = demo_images.decode(read_only(encoded))
    assert decoded.dtype == np.uint8
    assert decoded.shape == shape
    np.testing.assert_array_equal(decoded, img)


def test_encode_compresses_smooth_images() -> None:
    img = demo_images.synthetic_image(0, seed=0, size=128)
    assert demo_images.encode(img).nbytes < img.nbytes


def test_encode_rejects_non_images() -> None:
    with pytest.raises(ValueError, match="uint8 HxWxC"):
        demo_images.encode(np.zeros((4, 4), np.uint8))
    with pytest.raises(ValueError, match="uint8 HxWxC"):
        demo_images.encode(np.zeros((4, 4, 3), np.float32))


def test_decode_rejects_garbage() -> None:
    encoded = demo_images.encode(np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="shorter than its header"):
        demo_images.decode(encoded[:5])
    bad = encoded.copy()
    bad[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        demo_images.decode(bad)
    other = demo_images.encode(np.zeros((4, 5, 3), np.uint8))
    spliced = np.concatenate([encoded[:16], other[16:]])
    with pytest.raises(ValueError, match="corrupt"):
        demo_images.decode(spliced)


def test_synthetic_images_are_deterministic_and_sized() -> None:
    a = demo_images.synthetic_image(3, seed=7, size=64)
    b = demo_images.synthetic_image(3, seed=7, size=64)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.uint8
    assert a.shape == demo_images.image_shape(3, seed=7, size=64)
    h, w, c = a.shape
    assert c == 3
    assert 56 <= h <= 80
    assert 56 <= w <= 80
    assert not np.array_equal(a[: min(h, 56), :56], demo_images.synthetic_image(3, 8, 64)[:56, :56])
    assert a.std() > 5  # not a flat field


def test_image_set_is_a_prefix_of_a_larger_one() -> None:
    small = demo_images.make_image_set(2, seed=1, size=48)
    large = demo_images.make_image_set(3, seed=1, size=48)
    for x, y in zip(small, large, strict=False):
        np.testing.assert_array_equal(x, y)
    shapes = {demo_images.decode(e).shape for e in large}
    assert len(shapes) > 1  # sizes vary


def test_encoded_images_source() -> None:
    data = demo_images.make_image_set(3, seed=0, size=16)
    source = demo_images.EncodedImages(data, passes=2)
    assert len(source) == 6

    @dataclass
    class Info:
        idx_in_epoch: int

    assert source(Info(1)) is data[1]
    assert source(Info(4)) is data[1]
    with pytest.raises(StopIteration):
        source(Info(6))
    one_pass = demo_images.EncodedImages(data)
    with pytest.raises(StopIteration):
        one_pass(Info(3))
    clone = pickle.loads(pickle.dumps(source))
    np.testing.assert_array_equal(clone(Info(2)), data[2])
    with pytest.raises(ValueError, match="at least one image"):
        demo_images.EncodedImages([])
    with pytest.raises(ValueError, match="passes"):
        demo_images.EncodedImages(data, passes=0)


def test_encoded_images_warm_up_in_epoch_0() -> None:
    # The demo's warm-up: epoch 0 makes the first images only, the passes follow.
    data = demo_images.make_image_set(3, seed=0, size=16)
    source = demo_images.EncodedImages(data, passes=2, warmup=2)
    assert len(source) == 6  # the timed epochs'
    assert source(_Info(1, 0)) is data[1]
    with pytest.raises(StopIteration):
        source(_Info(2, 0))
    assert source(_Info(5, 1)) is data[2]
    with pytest.raises(StopIteration):
        source(_Info(6, 1))
    with pytest.raises(ValueError, match="warmup"):
        demo_images.EncodedImages(data, warmup=-1)


@dataclass
class _Info:
    idx_in_epoch: int
    epoch_idx: int = 0


# ------------------------------------------------------------------ the ops


def test_ops_pickle_by_reference() -> None:
    for _, function, _ in demo_images.STEPS:
        assert function.__module__ == "mpexec._demo_images"
        blob = pickle.dumps(function)
        assert len(blob) < 100
        assert pickle.loads(blob) is function


@pytest.mark.parametrize("shape", [(256, 300, 3), (CROP, CROP, 3), (100, 400, 3), (5, 5, 3)])
def test_random_crop_stays_in_bounds(shape: tuple[int, int, int]) -> None:
    img = rng(1).integers(0, 256, size=shape, dtype=np.uint8)
    for seed in range(5):
        out = demo_images.random_crop(read_only(img), rng=rng(seed))
        assert out.shape == (CROP, CROP, 3)
        assert out.dtype == np.uint8
        assert out.flags.writeable
        np.testing.assert_array_equal(out, demo_images.random_crop(img, rng=rng(seed)))
        if shape[0] >= CROP and shape[1] >= CROP:  # a window of the image itself
            replay = rng(seed)
            top = int(replay.integers(0, shape[0] - CROP + 1))
            left = int(replay.integers(0, shape[1] - CROP + 1))
            np.testing.assert_array_equal(out, img[top : top + CROP, left : left + CROP])
        else:  # padded by the edge: every value comes from the image
            assert set(np.unique(out)) <= set(np.unique(img))


def test_random_crop_varies_with_the_rng() -> None:
    img = rng(1).integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    crops = {demo_images.random_crop(img, rng=rng(s)).tobytes() for s in range(6)}
    assert len(crops) > 1


def test_flip_mirrors_or_copies() -> None:
    img = rng(2).integers(0, 256, size=(CROP, CROP, 3), dtype=np.uint8)
    seen = set()
    for seed in range(16):
        out = demo_images.flip(read_only(img), rng=rng(seed))
        assert out.shape == img.shape
        assert out.dtype == np.uint8
        assert not np.shares_memory(out, img)
        np.testing.assert_array_equal(out, demo_images.flip(img, rng=rng(seed)))
        if np.array_equal(out, img):
            seen.add("same")
        else:
            np.testing.assert_array_equal(out, img[:, ::-1])
            seen.add("mirrored")
    assert seen == {"same", "mirrored"}


def test_color_jitter_is_deterministic_per_rng() -> None:
    img = demo_images.random_crop(demo_images.synthetic_image(0, 0, 256), rng=rng())
    before = img.copy()
    a = demo_images.color_jitter(read_only(img), rng=rng(5))
    b = demo_images.color_jitter(read_only(img), rng=rng(5))
    c = demo_images.color_jitter(read_only(img), rng=rng(6))
    np.testing.assert_array_equal(img, before)  # input untouched
    assert a.shape == img.shape
    assert a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, img)


def test_normalize_gives_float32_chw() -> None:
    img = rng(3).integers(0, 256, size=(CROP, CROP, 3), dtype=np.uint8)
    out = demo_images.normalize(read_only(img))
    assert out.shape == (3, CROP, CROP)
    assert out.dtype == np.float32
    assert out.flags.c_contiguous
    expected = (img.astype(np.float64) - demo_images.MEAN) / demo_images.STD
    np.testing.assert_allclose(out, expected.transpose(2, 0, 1), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the serial baseline


def test_serial_baseline_is_deterministic() -> None:
    encoded = demo_images.make_image_set(3, seed=0, size=64)
    timing, digest = _demo.run_serial(encoded, seed=0)
    assert timing.images == 3
    assert timing.seconds > 0
    assert timing.images_per_s > 0
    assert _demo.run_serial(encoded, seed=0)[1] == digest
    assert _demo.run_serial(encoded, seed=1)[1] != digest
    out = demo_images.augment_one(encoded[0], seed=0, index=0)
    assert out.shape == (3, CROP, CROP)
    assert out.dtype == np.float32
    assert np.isfinite(out).all()


# ------------------------------------------------------------------ progress bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _demo.Progress.wanted(io.StringIO())
    assert _demo.Progress.wanted(FakeTerminal())
    assert not _demo.Progress.wanted(FakeTerminal(), disabled=True)
    assert not _demo.Progress.wanted(io.StringIO(), disabled=True)

    # Not a terminal: a plain line every LINE_EVERY_S seconds, and one at the end.
    clock = [100.0]
    monkeypatch.setattr(_demo.time, "perf_counter", lambda: clock[0])
    log = io.StringIO()
    bar = _demo.Progress("pipeline", 8, log, enabled=True)
    assert not bar.bar
    bar.update(2)  # no time has passed: nothing yet
    assert log.getvalue() == ""
    clock[0] += _demo.Progress.LINE_EVERY_S
    bar.update(2)
    clock[0] += 1.0
    bar.update(2)  # within the interval: no line
    bar.update(2)
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines == [
        "pipeline 4/8 images      2.0 images/s",
        "pipeline 8/8 images      2.7 images/s",
    ]
    assert "\r" not in log.getvalue()

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


#: The fake's own reference: a test may count the serial loop's calls of the module's.
_AUGMENT = demo_images.augment_one


class FakePipeline:
    """The pipeline's contract, serially, for testing the demo without it."""

    def __init__(self, source: demo_images.EncodedImages, config: _demo.DemoConfig) -> None:
        self.source = source
        self.config = config
        self.calls = 0
        self.epoch = 0
        self.epochs: list[int] = []  # images made in each epoch

    def __enter__(self) -> FakePipeline:
        return self

    def build(self) -> None:
        pass

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        pass

    def __iter__(self) -> Iterator[tuple[list[np.ndarray], list[np.ndarray]]]:
        idx = 0
        self.epochs.append(0)
        while True:
            batch = []
            for _ in range(self.config.batch_size):
                try:
                    enc = self.source(_Info(idx, self.epoch))
                except StopIteration:
                    break
                batch.append(_AUGMENT(enc, self.config.seed + 1, idx))
                idx += 1
            self.calls += len(batch)
            self.epochs[-1] += len(batch)
            if not batch:
                return
            yield batch, [demo_images.sample_digest(x) for x in batch]

    def reset(self) -> None:
        self.epoch += 1

    def stats(self) -> str:
        return f"FAKE STATS {self.calls} calls"


@pytest.fixture
def fake_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_demo, "build_pipeline", FakePipeline)


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_reports_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    config = _demo.DemoConfig(
        images=3, size=48, batch_size=2, workers=2, epochs=2, rounds=2, progress=False
    )
    assert _demo.main(config) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "throughput: 2 rounds" in out
    assert "serial" in out
    assert "pipeline" in out
    assert "speed-up" in out
    assert "6 images a round: 2 passes" in out
    assert "3 batches of up to 2" in out
    assert "FAKE STATS 15 calls" in out  # a warm-up of 3, then 2 rounds of 6
    assert "the pipeline 3 images" in out
    assert "cpu time an image" in out


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = _demo.DemoConfig(
        images=2, size=32, batch_size=4, workers=1, epochs=1, rounds=3, progress=False
    )
    assert _demo.main(config, as_json=True) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["images"] == 2
    assert summary["serial"]["images"] == 2
    assert summary["pipeline"]["images"] == 2
    assert summary["pipeline"]["batches"] == 1
    assert summary["speedup"] > 0
    assert len(summary["speedups"]) == 3
    assert summary["speedup"] == sorted(summary["speedups"])[1]
    for side in ("serial", "pipeline"):
        assert [r["images"] for r in summary[side]["rounds"]] == [2, 2, 2]
        for r in summary[side]["rounds"]:
            assert r["main_ms_per_image"] >= 0
            assert r["faults_per_image"] >= 0
    assert summary["stats"] == "FAKE STATS 8 calls"  # a warm-up of 2, then 3 rounds of 2
    assert summary["pipeline"]["warmup_images"] == 2
    assert summary["pipeline"]["warmup_epochs"] == 1
    for phase in ("serial", "pipeline"):
        load = summary["host_load"][phase]
        assert 0.0 <= load["other_share"] <= 1.0
        assert load["wall_s"] > 0
        assert load["own_cpu_s"] >= 0


def _result(
    serial_other: float, pipeline_other: float, rates: tuple[tuple[float, float], ...] = ((2, 4),)
) -> _demo.DemoResult:
    """A result whose serial loop and pipeline saw other processes use these shares, and
    made these images a second in each round (serial, pipeline)."""

    def load(share: float) -> CpuLoad:
        return CpuLoad(wall_s=10.0, cpus=2, own_cpu_s=5.0, other_cpu_s=20.0 * share, steal_cpu_s=0)

    def cpu(workers: int) -> _demo.CpuUse:  # the serial loop's: 4 images; the pipeline's: 8
        if workers:
            return _demo.CpuUse(8, 2.0, 0.1, 4.0, 40, workers)
        return _demo.CpuUse(4, 2.0, 0.016, 0.0, 40, 0)

    config = _demo.DemoConfig(images=4, workers=2, rounds=len(rates), progress=False)
    run = _demo.PipelineRun(
        tuple(_demo.Timing(8, 8 / p) for _, p in rates),
        0.5,
        1,
        "ab" * 20,
        "STATS",
        tuple(load(pipeline_other) for _ in rates),
        warmup_images=8,
        warmup_epochs=2,
        warmup_s=1.0,
        warmup_faults=3.0,
        cpu=tuple(cpu(2) for _ in rates),
    )
    serial = _demo.SerialRun(
        tuple(_demo.Timing(4, 4 / s) for s, _ in rates),
        "cd" * 20,
        tuple(load(serial_other) for _ in rates),
        tuple(cpu(0) for _ in rates),
        4,
    )
    return _demo.DemoResult(config, 2, 1000, 0.1, serial, run)


@pytest.mark.parametrize(
    ("serial", "pipeline", "verdict"),
    [
        (0.61, 0.58, ": not meaningful, the host was busy"),
        (0.02, 0.30, ": not meaningful, the host was busy"),
        (0.12, 0.03, ": the host was not quiet, take it as approximate"),
        (0.02, 0.03, ""),
    ],
)
def test_demo_says_how_busy_the_host_was(serial: float, pipeline: float, verdict: str) -> None:
    lines = _demo.format_result(_result(serial, pipeline)).splitlines()
    speedup = next(line for line in lines if line.startswith("  speed-up"))
    assert speedup.endswith("(2 workers, 2 usable CPUs)" + verdict), speedup
    load = lines[lines.index(speedup) + 1]
    assert load.startswith(
        f"  host load other processes used {100 * serial:.0f}% of the 2 CPUs during the "
        f"serial loop and {100 * pipeline:.0f}% during the pipeline"
    ), load
    assert load.endswith("(a quiet host)") == (verdict == "")


def test_the_speed_up_is_the_median_of_the_rounds_each_against_its_own_serial_loop() -> None:
    # Round by round, pipeline over the serial loop next to it: 2.0, 1.5, 3.0 -> 2.0
    # (the ratio of the sides' medians would be 150 / 50 = 3.0).
    result = _result(0.0, 0.0, ((50, 100), (100, 150), (20, 60)))
    assert result.speedups == pytest.approx((2.0, 1.5, 3.0))
    assert result.speedup == pytest.approx(2.0)
    text = _demo.format_result(result)
    assert "speed-up      2.00x [1.50-3.00]" in text
    assert "  serial        50.0 images/s [20-100]  (4 images a round" in text
    assert "throughput: 3 rounds" in text
    assert "the pipeline 8 images (until under 10 worker page faults a sample: 3.0)" in text
    cpu = text.split("cpu time an image: medians\n", 1)[1].splitlines()
    assert cpu[0] == "  serial     4.00 ms in this process, 10.0 page faults"
    assert cpu[1] == (
        "  pipeline  500.00 ms in the workers (100% busy), 12.50 ms in this process, "
        "5.0 worker page faults"
    )


@pytest.mark.usefixtures("fake_pipeline")
def test_demo_draws_progress_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    tty = FakeTerminal()
    config = _demo.DemoConfig(images=2, size=32, batch_size=2, workers=1, epochs=1)
    _demo.run_demo(config, err=tty)
    assert "\rserial" in tty.getvalue()
    assert "\rpipeline" in tty.getvalue()
    assert "\rplain" in tty.getvalue()
    assert capsys.readouterr().err == ""


@pytest.mark.usefixtures("no_leaks")
def test_pipeline_outputs_do_not_depend_on_workers() -> None:
    source = demo_images.EncodedImages(demo_images.make_image_set(3, seed=0, size=32), passes=2)
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


def test_the_demo_warms_up_both_sides_before_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pipeline warms up over a whole pass of the set (an epoch of its own: the
    # timed one starts with nothing in flight), the loop over a batch per worker;
    # the clock counts only the timed images.
    made: list[FakePipeline] = []

    def build(source: demo_images.EncodedImages, config: _demo.DemoConfig) -> FakePipeline:
        made.append(FakePipeline(source, config))
        return made[-1]

    monkeypatch.setattr(_demo, "build_pipeline", build)
    serial_calls = []
    augment = demo_images.augment_one

    def counted(encoded: np.ndarray, seed: int, index: int) -> np.ndarray:
        serial_calls.append(index)
        return augment(encoded, seed, index)

    config = _demo.DemoConfig(
        images=5, size=32, batch_size=2, workers=2, epochs=1, rounds=1, progress=False
    )
    monkeypatch.setattr(_demo, "augment_one", counted)
    monkeypatch.setattr(demo_images, "augment_one", counted)  # the warm-up's
    result = _demo.run_demo(config)
    assert made[0].epochs == [5, 5]  # the warm-up (a pass), then the timed epoch
    assert result.pipeline.warmup_images == 5
    assert result.pipeline.timing.images == 5
    assert serial_calls == [0, 1, 2, 3, 0, 1, 2, 3, 4]  # the warm-up's 4, then the set
    assert result.serial.timings == (result.serial.timings[0],)
    assert result.serial.timings[0].images == 5


@pytest.mark.parametrize(
    ("control", "order"),
    [
        # serial, pipeline | pipeline, serial | serial, pipeline: a drift in the host's
        # load meets both sides alike, and each round's ratio compares neighbours.
        (False, "SP PS SP"),
        # With the plain processes the order rotates: each side goes first once.
        (True, "SPC PCS CSP"),
    ],
)
def test_the_rounds_rotate_the_sides(
    monkeypatch: pytest.MonkeyPatch, control: bool, order: str
) -> None:
    log: list[str] = []
    monkeypatch.setattr(_demo, "build_pipeline", FakePipeline)
    serial, epoch = _demo.run_serial, _demo.PipelineSide.epoch
    plain_round = _demo.PlainProcesses.round

    def run_serial(*args: Any, **kwargs: Any) -> Any:
        log.append("S")
        return serial(*args, **kwargs)

    def run_epoch(self: _demo.PipelineSide, *args: Any) -> Any:
        log.append("P")
        return epoch(self, *args)

    def run_plain(self: Any) -> Any:
        log.append("C")
        return plain_round(self)

    monkeypatch.setattr(_demo, "run_serial", run_serial)
    monkeypatch.setattr(_demo.PipelineSide, "epoch", run_epoch)
    monkeypatch.setattr(_demo.PlainProcesses, "round", run_plain)
    config = _demo.DemoConfig(
        images=2, size=32, batch_size=2, workers=1, rounds=3, progress=False, control=control
    )
    result = _demo.run_demo(config)
    assert log == list(order.replace(" ", ""))
    assert len(result.speedups) == 3
    assert [t.images for t in result.pipeline.timings] == [4, 4, 4]  # 2 passes a round
    assert len(result.ceilings) == (3 if control else 0)


# ------------------------------------------------------------------ the host's ceiling


@pytest.mark.usefixtures("no_leaks")
def test_the_plain_processes_redo_the_serial_loop_and_give_the_rounds_ceiling() -> None:
    config = _demo.DemoConfig(
        images=4, size=32, batch_size=2, workers=2, epochs=1, rounds=2, progress=False
    )
    result = _demo.run_demo(config)
    plain = result.plain
    assert plain is not None
    assert [t.images for t in plain.timings] == [4, 4]
    assert plain.digest == result.serial.digest  # the same images, made alike
    assert plain.startup_s > 0
    assert all(c.workers == 2 and c.workers_s > 0 for c in plain.cpu)
    # Round by round: pipeline / serial = (pipeline / plain) * (plain / serial).
    for sp, oc, ce in zip(result.speedups, result.of_ceiling, result.ceilings, strict=True):
        assert sp == pytest.approx(oc * ce)
    lines = _demo.format_result(result).splitlines()
    assert sum(line.startswith("  plain ") for line in lines) == 2  # throughput and cpu
    ceiling = next(line for line in lines if line.startswith("  ceiling"))
    assert f"the pipeline {statistics.median(result.of_ceiling):.2f} of it" in ceiling
    summary = result.to_json()
    assert [r["images"] for r in summary["plain"]["rounds"]] == [4, 4]
    assert summary["ceilings"] == list(result.ceilings)
    assert summary["of_ceiling"] == statistics.median(result.of_ceiling)
    assert summary["host_load"]["plain"]["wall_s"] > 0


def test_without_control_or_workers_no_plain_process_runs() -> None:
    for config in (
        _demo.DemoConfig(images=2, size=32, batch_size=2, workers=1, rounds=1, control=False),
        _demo.DemoConfig(images=2, size=32, batch_size=2, workers=0, rounds=1),
    ):
        result = _demo.run_demo(dataclasses.replace(config, progress=False))
        assert result.plain is None
        assert result.ceilings == () == result.of_ceiling
        text = _demo.format_result(result)
        assert "  ceiling" not in text
        assert "  plain" not in text
        assert result.to_json()["ceiling"] is None


@pytest.mark.usefixtures("no_leaks")
def test_plain_processes_that_made_other_outputs_fail_the_demo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    serial = _demo.run_serial

    def other_digest(*args: Any, **kwargs: Any) -> Any:
        timing, _ = serial(*args, **kwargs)
        return timing, "0" * 40

    monkeypatch.setattr(_demo, "build_pipeline", FakePipeline)
    monkeypatch.setattr(_demo, "run_serial", other_digest)
    config = _demo.DemoConfig(images=2, size=32, batch_size=2, workers=1, rounds=1, progress=False)
    with pytest.raises(RuntimeError, match="plain processes made other outputs"):
        _demo.run_demo(config)


@pytest.mark.usefixtures("no_leaks")
def test_a_plain_process_that_dies_is_a_clear_error_and_all_are_reaped() -> None:
    encoded = demo_images.make_image_set(4, seed=0, size=32)
    plain = _demo.PlainProcesses(encoded, 0, 2, 2, 0)
    procs = list(plain._procs)  # the test kills one
    try:
        assert plain.round()[0] > 0
        os.kill(procs[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="plain process of the demo's ceiling exited"):
            plain.round()
    finally:
        plain.close()
    assert not any(p.is_alive() for p in procs)
    assert procs[0].exitcode == 0


@dataclass
class _FaultStats:
    worker_faults: int
    samples: int


class WarmingPipeline(FakePipeline):
    """A fake whose workers fault less each epoch: 100, 40, 5, 1 a sample."""

    FAULTS = (100, 40, 5, 1)

    def __init__(self, source: demo_images.EncodedImages, config: _demo.DemoConfig) -> None:
        super().__init__(source, config)
        self.faults = 0

    def reset(self) -> None:
        self.faults += self.FAULTS[min(self.epoch, 3)] * self.epochs[-1]
        super().reset()

    def stats(self) -> Any:
        return _FaultStats(self.faults, sum(self.epochs))


def test_the_pipeline_warms_up_until_its_workers_stop_faulting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A cold worker takes about a fault per page of every output it writes, for
    # more than one pass of the set: the warm-up goes on, a pass at a time, until
    # the faults a sample fall under WARM_FAULTS_PER_SAMPLE (or MAX_WARMUP_EPOCHS).
    monkeypatch.setattr(_demo, "build_pipeline", WarmingPipeline)
    images = demo_images.make_image_set(3, seed=0, size=32)
    source = demo_images.EncodedImages(images, passes=1, warmup=3)
    config = _demo.DemoConfig(images=3, batch_size=2, workers=1, progress=False)
    run = _demo.run_pipeline(source, config)
    assert (run.warmup_epochs, run.warmup_images, run.warmup_faults) == (3, 9, 5.0)
    assert run.cpu[0].faults == 3  # the timed epoch: 1 a sample
    monkeypatch.setattr(_demo, "MAX_WARMUP_EPOCHS", 2)
    run = _demo.run_pipeline(source, config)
    assert (run.warmup_epochs, run.warmup_faults) == (2, 40.0)


def test_the_command_runs_the_serial_loop_with_the_workers_malloc_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without it, the loop here took 210-560 page faults an image (its heap's free
    # top trimmed and grown again every image) where the warm workers took none.
    import inspect

    from mpexec import WorkerPool

    default = inspect.signature(WorkerPool).parameters["warm_memory"].default
    assert default == _demo.SERIAL_WARM_MEMORY
    calls: list[Any] = []
    monkeypatch.setattr(_demo, "keep_memory_warm", lambda limit: calls.append(("warm", limit)))
    monkeypatch.setattr(_demo, "run_demo", lambda config: calls.append("run") or _result(0, 0))
    assert _demo.main(_demo.DemoConfig(progress=False), out=io.StringIO()) == 0
    assert calls == [("warm", _demo.SERIAL_WARM_MEMORY), "run"]


@pytest.mark.usefixtures("no_leaks")
def test_the_digest_is_made_with_each_sample() -> None:
    # Each sample's SHA-1 is made where the sample is (a worker; in the loop, the
    # loop), not by the main process: it reads 20 bytes a sample, not 600 KB.
    source = demo_images.EncodedImages(demo_images.make_image_set(3, seed=0, size=32))
    config = _demo.DemoConfig(images=3, batch_size=2, workers=1, seed=5, progress=False)
    with _demo.build_pipeline(source, config) as pipe:
        outs, digests = [], []
        for batch, shas in pipe:
            outs += [np.array(x) for x in batch]
            digests += [np.array(d) for d in shas]
    assert [d.tobytes() for d in digests] == [
        hashlib.sha1(x.tobytes(), usedforsecurity=False).digest() for x in outs
    ]
    whole = hashlib.sha1(b"".join(d.tobytes() for d in digests), usedforsecurity=False)
    assert _demo.run_pipeline(source, config).digest == whole.hexdigest()


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
    options = ["--epochs", "4", "--seed", "9", "--rounds", "2", "--no-progress", "--json"]
    assert cli_main([*argv, *options]) == 0
    assert seen["config"] == _demo.DemoConfig(
        images=5, size=64, batch_size=3, workers=0, epochs=4, seed=9, progress=False, rounds=2
    )
    assert seen["as_json"] is True
    assert cli_main([*argv, "--no-control"]) == 0
    assert seen["config"].control is False

    from mpexec._host import usable_cpus

    assert cli_main(["demo"]) == 0
    assert seen["config"].workers == usable_cpus()
    assert seen["config"].images == 256
    assert seen["config"].batch_size == 32
    assert seen["config"].rounds == 5
    assert seen["config"].progress is True  # lines, since stderr is not a terminal here
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
    assert "host load other processes used" in done.stdout
    assert "Traceback" not in done.stderr
    assert done.stderr == "", done.stderr  # --no-progress
    # docs/demo.md shows what the demo prints: the same lines, only the numbers differ.
    doc = _doc_block("## Reading the output")
    assert [_shape(line) for line in doc] == [_shape(line) for line in done.stdout.splitlines()]


DOC = Path(__file__).resolve().parent.parent / "docs" / "demo.md"


def _doc_block(heading: str) -> list[str]:
    """The lines of the first ```text block after ``heading`` in docs/demo.md."""
    text = DOC.read_text().split(f"\n{heading}\n", 1)[1]
    return text.split("```text\n", 1)[1].split("\n```", 1)[0].splitlines()


def _shape(line: str) -> str:
    """A report line less what varies from run to run: numbers, the digest, and what
    the speed-up and host-load lines say about the machine's load."""
    if line.startswith("  speed-up"):
        line = line.split(")", 1)[0]
    if line.startswith("  host load"):
        line = line.split(" during the pipeline", 1)[0]
    line = re.sub(r"\b[0-9a-f]{40}\b", "DIGEST", line)
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return " ".join(line.split())


def _doctor_shape(lines: list[str]) -> list[str]:
    """Sections and row labels of the doctor's report, less the machine-dependent
    ones (the GPU section's rows, the notes)."""
    out, section = [], ""
    for line in lines:
        if not line.startswith("  "):
            section = line.split()[0] if line.startswith("mpexec ") else line
            out.append(section)
        elif section not in ("gpu", "notes"):
            out.append(f"{section}: {line.split('  ')[1].strip()}")
    return [x for x in out if x != "notes"]


def test_doc_shows_what_doctor_prints() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mpexec", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    doc = _doc_block("## `python -m mpexec doctor`")
    assert _doctor_shape(doc) == _doctor_shape(done.stdout.splitlines())


@pytest.mark.usefixtures("no_leaks")
def test_cli_demo_shows_progress_lines_when_not_on_a_terminal() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mpexec", "demo", "--images", "8", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    for label, total in (("images", 8), ("serial", 8), ("pipeline", 16), ("plain", 8)):
        assert any(line.startswith(f"{label:<9}{total}/{total} images") for line in lines), lines
    assert "\r" not in done.stderr
