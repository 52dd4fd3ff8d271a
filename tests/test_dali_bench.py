"""``python -m benchmarks dali``: how its rounds are laid out and how its ratios are paired
(issue 37's figure against the host's 2-process ceiling is read from them)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from benchmarks import dali_bench
from benchmarks.dali_bench import ONE_PLAIN, PARALLEL, SERIAL, paired, schedule


def test_a_round_interleaves_every_system_in_blocks_and_rotates_their_order() -> None:
    # Every system (the control's two halves too) runs a block of batches in turn, so
    # that a round's systems meet the same load; the one going first rotates.
    systems = ["A", "M", SERIAL, PARALLEL]
    steps = list(schedule(systems, iterations=6, block=2, round_=0))
    assert [name for name, _ in steps] == [
        *("A", "M", SERIAL, PARALLEL),
        *("M", SERIAL, PARALLEL, "A"),
        *(SERIAL, PARALLEL, "A", "M"),
    ]
    for name in systems:  # each makes every batch of the round once, in order
        done = [i for n, batches in steps if n == name for i in batches]
        assert done == list(range(6))
    later = [name for name, _ in schedule(systems, iterations=6, block=2, round_=1)]
    assert later[:4] == ["M", SERIAL, PARALLEL, "A"]
    short = list(schedule(systems, iterations=5, block=2, round_=0))
    assert [len(b) for n, b in short if n == "A"] == [2, 2, 1]


def test_the_figure_against_the_ceiling_is_paired_round_by_round() -> None:
    # Round 1: the ceiling was 1.8 and mpexec.dali 1.8x alone (1.0 of it); round 2 a
    # loaded host's 1.5 and 1.5x (1.0 again). The ratio of medians would mix rounds.
    rates = {
        "alone": [100.0, 100.0],
        "ours": [180.0, 150.0],
        ONE_PLAIN: [50.0, 40.0],
        PARALLEL: [90.0, 60.0],
    }
    got = paired(rates, "ours", "alone")
    assert got["ceiling"] == pytest.approx([1.8, 1.5])
    assert got["ratio"] == pytest.approx([1.8, 1.5])
    assert got["of_ceiling"] == pytest.approx([1.0, 1.0])
    assert got["vs_plain_2_processes"] == pytest.approx([2.0, 2.5])


def test_the_ceiling_compares_the_plain_processes_with_one_of_themselves() -> None:
    # The serial loop in the benchmark's own process ran the same work ~8% slower a
    # sample (CPU time) than the plain processes: a ceiling over it read above 2x. The
    # ceiling is the 2 plain processes over one of them; the serial loop is not in it.
    rates = {
        "alone": [100.0],
        "ours": [180.0],
        SERIAL: [46.0],
        ONE_PLAIN: [50.0],
        PARALLEL: [95.0],
    }
    got = paired(rates, "ours", "alone")
    assert got["ceiling"] == pytest.approx([1.9])
    assert got["of_ceiling"] == pytest.approx([180 / 100 / 1.9])


def test_the_work_a_sample_is_read_over_the_serial_loops_of_the_same_round() -> None:
    # The host's speed drifts from round to round alike for every kind of process: the
    # plain processes at 1.1x the serial loop in each round read 1.1x flat, where their
    # own readings (1100 and 2200 us) overlap the serial loop's range. A round where
    # mpexec.dali gave no reading (nan) is left out of its row, not read as 0 or nan.
    work_cpu = {SERIAL: [1000.0, 2000.0], ONE_PLAIN: [1100.0, 2200.0], PARALLEL: [1050.0, 2100.0]}
    got = dali_bench.work_cpu_over_serial(work_cpu, [1200.0, float("nan")])
    assert got[ONE_PLAIN]["min"] == got[ONE_PLAIN]["max"] == pytest.approx(1.1)
    assert got[PARALLEL]["median"] == pytest.approx(1.05)
    assert got[dali_bench.OURS]["rounds"] == pytest.approx([1.2])
    line = dali_bench._over_serial_line({"work_cpu_over_serial": got})
    assert line.startswith("the same over this process's, round by round: 1 plain process 1.100x")
    assert "mpexec.dali's workers 1.200x (1.200 - 1.200)" in line
    # No reading at all from the op: its row is left out.
    assert dali_bench.OURS not in dali_bench.work_cpu_over_serial(work_cpu, [float("nan")] * 2)


class _Timeline:
    """Fake executors over one event log: what was submitted when, and when each result
    was asked for. A task's reading is given per executor (CPU seconds)."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def executor(self, name: str, reading: float) -> Any:
        events = self.events

        class _Future:
            def result(self) -> float:
                events.append(f"{name} result")
                return reading

        class _Executor:
            def submit(self, fn: Any, args: tuple[Any, ...]) -> _Future:
                assert fn is dali_bench._pace_task
                events.append(f"{name} submit")
                return _Future()

        return _Executor()


def test_the_pace_is_read_with_a_plain_process_running_the_same_work_at_the_same_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker's pace over a plain process's is only drift-free if both run at once: both
    # tasks are out before either result is awaited, and this process's own reading is
    # taken while a plain process runs its task.
    t = _Timeline()

    def here(args: Any) -> float:
        t.events.append("here")
        return 0.0033

    # (the fakes check the function they are handed against the module's, patched too)
    monkeypatch.setattr(dali_bench, "_pace_task", here)
    got = dali_bench.pace(
        dali_bench.Work(10), t.executor("ours", 0.0036), t.executor("plain", 0.003), rounds=2
    )
    round_ = ["plain submit", "ours submit", "ours result", "plain result"]
    round_ += ["plain submit", "here", "plain result"]
    assert t.events == round_ * 2
    assert got[dali_bench.OURS]["rounds"] == pytest.approx([1.2, 1.2])
    assert got[SERIAL]["median"] == pytest.approx(1.1)
    line = dali_bench._pace_line(got)
    assert "mpexec.dali's workers 1.200x (1.200 - 1.200), this process 1.100x" in line


def test_the_pace_task_times_the_work_alone() -> None:
    assert 0 < dali_bench._pace_task((dali_bench.Work(1000), 3)) < 10


def test_the_ceiling_a_figure_is_taken_over_is_at_most_two() -> None:
    # 2 processes cannot do twice one's work and more by their CPUs: a round whose
    # control reads above 2x takes mpexec.dali's 1.8x as 0.9 of 2, not of 2.1.
    rates = {"alone": [100.0], "ours": [180.0], ONE_PLAIN: [50.0], PARALLEL: [105.0]}
    got = paired(rates, "ours", "alone")
    assert got["ceiling"] == pytest.approx([2.1])  # reported as measured
    assert got["of_ceiling"] == pytest.approx([0.9])


def test_a_batchs_time_beyond_its_work_counts_the_busiest_workers_samples() -> None:
    # 16 samples of 2 ms of work: alone a batch of 40 ms is 8 ms beyond it; spread over 2
    # workers (8 samples each), a batch of 20 ms is 4 ms beyond it.
    batch = dali_bench.BATCH
    rates = {
        dali_bench.ALONE: [batch / 0.040],
        dali_bench.OURS: [batch / 0.020],
        SERIAL: [batch / (batch * 0.002)],
        ONE_PLAIN: [batch / (batch * 0.002)],
        PARALLEL: [batch / (batch * 0.001)],
    }
    got = dali_bench.beyond_work(rates, [2000.0], list(rates))
    assert got[dali_bench.ALONE] == pytest.approx(40 - 2 * batch)
    assert got[dali_bench.OURS] == pytest.approx(20 - batch)
    assert got[SERIAL] == pytest.approx(0.0)
    assert got[ONE_PLAIN] == pytest.approx(0.0)
    assert got[PARALLEL] == pytest.approx(0.0)


def test_the_target_reads_the_paired_median() -> None:
    tp = {
        "by_system": {
            "DALI + mpexec.dali": {"ratio_vs_alone": {"median": 1.7}},
            "DALI + WorkerPool.map": {"ratio_vs_alone": {"median": 1.5}},
        },
        "mpexec_dali_of_ceiling": {"median": 0.96, "min": 0.9, "max": 1.01},
    }
    rows = {t["target"]: t for t in dali_bench.targets({"throughput": tp})}
    row = rows["DALI + mpexec.dali vs the host's 2-process ceiling"]
    assert (row["value"], row["threshold"], row["pass"]) == (0.96, 0.97, False)
    assert "range 0.90 - 1.01" in row["note"]


class _FakeDaliPipe:
    """DALI's pipeline as the benchmark drives it, without DALI: run() k returns batch
    k % n. ``default``: DALI's default executor, which makes the batch after the one
    returned in its own thread (here 20 ms late), while the caller goes on."""

    prefetch_queue_depth = 2

    def __init__(self, function: Any, n: int, default: bool = False) -> None:
        self.function, self.n, self.default = function, n, default
        self.made = 0  # batches made so far
        self.runs = 0  # run() calls so far
        self.ahead: threading.Thread | None = None
        self.ready: list[Any] = []

    def _make(self, delay: float = 0.0) -> None:
        time.sleep(delay)
        out = self.function(dali_bench.images(self.made % self.n))
        self.made += 1
        self.ready.append(np.stack(out))

    def run(self) -> list[Any]:
        self.runs += 1
        if self.ahead is not None:
            self.ahead.join()
        if not self.ready:
            self._make()
        out = self.ready.pop(0)
        if self.default:
            self.ahead = threading.Thread(target=self._make, args=(0.02,))
            self.ahead.start()
        return [_Tensor(out)]


class _Tensor:
    def __init__(self, array: Any) -> None:
        self.array = array

    def as_tensor(self) -> Any:
        return self.array


class _InProcess:
    def map(self, fn: Any, items: Any) -> Any:
        return map(fn, items)


def test_a_default_executors_work_ahead_stays_in_its_own_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Under DALI's default executor a pipeline makes a batch ahead of the one run()
    # returns: each of its blocks ends once that batch is made, so no other system's
    # block (here: the control's) runs beside it.
    pipes: list[_FakeDaliPipe] = []

    def fake(function: Any, n: int, default: bool = False) -> _FakeDaliPipe:
        pipes.append(_FakeDaliPipe(function, n, default))
        return pipes[-1]

    behind: list[int] = []  # at each block of the control: batches ahead not yet made
    serial = dali_bench._serial

    def watched(work: Any, batches: range) -> float:
        # The function DALI calls (the benchmark's counter): its returned calls.
        behind.extend(p.runs + 1 - p.function.done for p in pipes if p.default)
        return serial(work, batches)

    monkeypatch.setattr(dali_bench, "_pipeline", fake)
    monkeypatch.setattr(dali_bench, "_serial", watched)
    work = dali_bench.Work(10)
    functions = {
        dali_bench.ALONE: dali_bench._Alone(work),
        dali_bench.OURS: dali_bench._Alone(work),
    }
    out = dali_bench.throughput(functions, work, iterations=4, rounds=2, executor=_InProcess())
    assert len(pipes) == 4
    assert sum(p.default for p in pipes) == 2
    assert behind == [0] * len(behind)
    assert behind
    for row in out["by_system"].values():
        assert row["identical"]
    assert set(out["default_executor"]) >= {"mpexec_dali_of_ceiling", "mpexec_dali_vs_synchronous"}
    # The two single-threaded baselines, side by side: the serial control's CPU a sample
    # too (DALI alone's less DALI's own, if the control does the same work).
    assert out["serial_cpu_us_per_sample"] > 0
    assert len(out["serial_vs_alone"]["rounds"]) == 2
    assert set(out["beyond_work_ms_per_batch"]) == {
        dali_bench.ALONE,
        dali_bench.OURS,
        *dali_bench.CONTROL,
    }
    # The control's work a sample in CPU time, where each part ran: its two halves in
    # the plain processes, the serial loop in this one.
    work_cpu = out["control_work_cpu_us_per_sample"]
    assert set(work_cpu) == set(dali_bench.CONTROL)
    assert all(len(v["rounds"]) == 2 and v["min"] > 0 for v in work_cpu.values())
    # And over the serial loop's, round by round (the fake op gives no workers' reading).
    assert set(out["work_cpu_over_serial"]) == {ONE_PLAIN, PARALLEL}
    assert all(len(v["rounds"]) == 2 for v in out["work_cpu_over_serial"].values())
    if dali_bench._queued() is not None:  # Linux: each baseline's wait for a CPU too
        assert set(out["queued_us_per_sample"]) == {dali_bench.ALONE, SERIAL}


class _Seen(dali_bench.Work):
    """The benchmark's work, noting the images it is given."""

    def __init__(self) -> None:
        super().__init__(10)
        self.seen: list[Any] = []

    def __call__(self, image: Any) -> Any:
        self.seen.append(image)
        return super().__call__(image)


def test_the_control_works_on_batches_made_before_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    # Like DALI's source (batches made before timing), the control's timed loop makes no
    # image: it runs the function alone on each sample, each half on its own rows.
    dali_bench.premake(4)
    expected = dali_bench._Batches(4).batches  # what DALI's source hands out
    made: list[int] = []
    real = np.full

    def full(shape: Any, value: Any, dtype: Any = None) -> Any:
        made.append(int(value))
        return real(shape, value, dtype)

    monkeypatch.setattr(dali_bench.np, "full", full)
    work = _Seen()
    dali_bench._parallel(work, range(3, 4), _InProcess())
    assert len(work.seen) == dali_bench.BATCH
    for got, want in zip(work.seen, expected[3], strict=True):
        np.testing.assert_array_equal(got, want)
    work.seen.clear()
    dali_bench._serial(work, range(5, 6))  # batch 5 of 4 made: batch 1, as DALI's source
    assert len(work.seen) == dali_bench.BATCH
    for got, want in zip(work.seen, expected[1], strict=True):
        np.testing.assert_array_equal(got, want)
    work.seen.clear()
    dali_bench._one_plain(work, range(2, 3), _InProcess())  # the whole batch, one process
    assert len(work.seen) == dali_bench.BATCH
    for got, want in zip(work.seen, expected[2], strict=True):
        np.testing.assert_array_equal(got, want)
    assert made == []


@pytest.mark.parametrize(
    ("system", "personality", "expected"),
    [("2", "00000000", True), ("2", "00040000", False), ("0", "00000000", False)],
)
def test_the_report_says_whether_the_address_space_was_laid_out_at_random(
    tmp_path: Any, system: str, personality: str, expected: bool
) -> None:
    # Each process tree's pace at the work is drawn at its start when it is: the report
    # says so, whether the kernel randomises (randomize_va_space) or this process and
    # its children were started with it off (setarch -R sets ADDR_NO_RANDOMIZE).
    (tmp_path / "sys/kernel").mkdir(parents=True)
    (tmp_path / "self").mkdir()
    (tmp_path / "sys/kernel/randomize_va_space").write_text(system + "\n")
    (tmp_path / "self/personality").write_text(personality + "\n")
    assert dali_bench.randomised_layout(tmp_path) is expected
    assert dali_bench.randomised_layout(tmp_path / "missing") is None
