"""``python -m benchmarks mainload``'s options (issue 37's figures are taken with them)."""

from __future__ import annotations

import argparse
import time

import pytest

from benchmarks import mainload_bench


def _options(*argv: str) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    mainload_bench.add_arguments(parser)
    return mainload_bench.options(parser.parse_args(list(argv)))


def test_kinds_both_is_light_and_heavy() -> None:
    # Its help says "light, heavy or both": "both" ran nothing (a KeyError at the first sample).
    assert _options("--kinds", "both")["kinds"] == ["light", "heavy"]
    assert _options("--kinds", "heavy")["kinds"] == ["heavy"]
    assert "kinds" not in _options()


def test_an_unknown_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(SystemExit, match="light, heavy"):
        _options("--kinds", "medium")


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("workers", [2, 16, 64, 128])
def test_an_epoch_gives_every_worker_several_batches(workers: int, quick: bool) -> None:
    # At 64 workers the quick epoch was 0.25 s at the ideal rate: 119 batches, under
    # two a worker, so start-up and tail were most of what it measured.
    samples = workers / 0.002 * (0.25 if quick else 1.0)
    batches = mainload_bench.epoch_batches("light", workers, samples, quick)
    least = mainload_bench.QUICK_ROUNDS if quick else mainload_bench.ROUNDS
    assert batches >= least * workers
    assert batches >= round(samples / mainload_bench.BATCH)


def test_the_steady_rate_leaves_out_an_epochs_start_and_tail() -> None:
    # 100 batches: a slow start (10 at 0.1 s each), 80 at 10 ms, a slow tail.
    marks, t = [], 0.0
    for i in range(100):
        t += 0.1 if i < 10 or i >= 90 else 0.01
        marks.append(t)
    assert mainload_bench.steady_rate(marks) == pytest.approx(100.0)
    assert mainload_bench.steady_rate(marks[:7]) is None


def test_idle_is_split_into_the_epochs_start_middle_and_end() -> None:
    # 2 workers over 10 s: one works 1-4 and 5-9 (idle 1 at the start, 1 between, 1 at
    # the end), the other 0-10; a third never worked (idle throughout, at the start).
    spans = [[(5.0, 9.0), (1.0, 4.0), (-3.0, -1.0)], [(0.0, 10.0)]]
    start, middle, end = mainload_bench.idle_split(spans, 0.0, 10.0, 3)
    assert (start, middle, end) == pytest.approx((11 / 30, 1 / 30, 1 / 30))
    assert _options("--idle")["idle"] is True
    assert "idle" not in _options()


def test_spin_gives_every_system_samples_that_spin_the_workers_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _options("--spin")["spin"] is True
    assert "spin" not in _options()
    made: list[type] = []

    def probe(workers: int, n: int, sample: mainload_bench.Sleepy) -> tuple[object, object]:
        made.append(type(sample))
        return (lambda marks: n), (lambda: None)

    monkeypatch.setitem(mainload_bench.SYSTEMS, "probe", ("probe", None, probe))
    for spin in (True, False):
        res: dict[str, object] = {}
        mainload_bench._run_all(res, ["probe"], ["light"], [1e-5], [2], 1, 0.01, True, None, spin)
    assert made == [mainload_bench.Spinning, mainload_bench.Sleepy]
    # A spinning sample takes its w of the thread's CPU; a sleeping one almost none.
    t0 = time.thread_time()
    mainload_bench.Spinning(0.02, "light")(0)
    assert time.thread_time() - t0 >= 0.02
