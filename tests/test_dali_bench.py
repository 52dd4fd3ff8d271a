"""``python -m benchmarks dali``: how its rounds are laid out and how its ratios are paired
(issue 37's figure against the host's 2-process ceiling is read from them)."""

from __future__ import annotations

import pytest

from benchmarks import dali_bench
from benchmarks.dali_bench import PARALLEL, SERIAL, paired, schedule


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
        SERIAL: [50.0, 40.0],
        PARALLEL: [90.0, 60.0],
    }
    got = paired(rates, "ours", "alone")
    assert got["ceiling"] == pytest.approx([1.8, 1.5])
    assert got["ratio"] == pytest.approx([1.8, 1.5])
    assert got["of_ceiling"] == pytest.approx([1.0, 1.0])
    assert got["vs_plain_2_processes"] == pytest.approx([2.0, 2.5])


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
