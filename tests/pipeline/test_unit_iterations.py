"""Several iterations a unit (issue 37), on by policy (mpexec._grouping).

Where an op's unit is a whole batch (batch mode fused with its source), k
consecutive iterations go to a worker as one call and come back in one answer.
These hold that this changes nothing a user sees: outputs (their randomness
too), order, epoch ends and each iteration's own error are those of one
iteration a unit; that the units did carry several iterations, and only where
the policy says (the memory cap, an epoch's ramp); that a refused call falls
back to single units; and that a Ctrl-C while units are held or sent loses and
repeats no batch. (``MPEXEC_UNIT_ITERATIONS`` overrides k's bound, for A/B.)
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _codec, _executors, _grouping, _runtime, _scheduler, fn
from mpexec._executors import LocalPoolExecutor, WorkUnit
from mpexec._grouping import fill_plan, grouped_window
from mpexec._runtime import Chunk
from tests.pipeline.lean_ops import Indices, Samples, modules_loaded
from tests.pipeline.test_ctrl_c_steps import interrupt_at, watched_epoch

pytestmark = pytest.mark.usefixtures("no_leaks")

BATCH = 4


def _jitter(x: np.ndarray[Any, Any], i: Any, rng: np.random.Generator) -> tuple[Any, Any]:
    return x + rng.standard_normal(3), i


def _mix(xs: list[Any], ids: list[Any]) -> tuple[Any, Any]:
    """A batch op that reads the whole batch and draws from ``np.random``."""
    info = mpexec.sample_info()
    assert isinstance(info, mpexec.BatchInfo)
    return np.stack(xs) * np.random.rand(), [i + 1000 * info.iteration for i in ids]


def _graph(n: int, *, jitter: bool, **source: Any) -> Any:
    x, i = fn.external_source(source=Samples(n, **source), batch=False, num_outputs=2)
    if jitter:
        x, i = fn.python_function(x, i, function=_jitter, num_outputs=2)
    return fn.python_function(x, i, function=_mix, batch_processing=True, num_outputs=2)


def _pipe(n: int, workers: int, jitter: bool = False, **source: Any) -> mpexec.Pipeline:
    pipe = mpexec.Pipeline(
        batch_size=BATCH, num_workers=workers, seed=7, prefetch_depth=2, last_batch="partial"
    )
    pipe.define(lambda: _graph(n, jitter=jitter, **source))
    return pipe


def _outcomes(n: int, *, workers: int, jitter: bool = False, **source: Any) -> list[Any]:
    """Per run() of two epochs: the batch's bytes, or its error's type and message."""
    pipe = _pipe(n, workers, jitter, **source)
    got: list[Any] = []
    with pipe:
        for _, outs in _two_epochs(pipe, n):
            if isinstance(outs, ValueError):
                got.append((type(outs).__name__, str(outs).splitlines()[0]))
            else:
                got.append([np.asarray(s).tobytes() for b in outs for s in b])
    return got


def _two_epochs(pipe: mpexec.Pipeline, n: int) -> Iterator[tuple[int, Any]]:
    """(epoch, outputs) of each run() of two epochs; a ValueError raised in place of outputs."""
    for e in range(2):
        if e:
            pipe.reset()
        for _ in range(n):  # bounded: an epoch's end that never comes fails the test
            try:
                outs = pipe.run()
            except StopIteration:
                break
            except ValueError as exc:
                yield e, exc
                continue
            yield e, outs
        else:
            raise AssertionError("the epoch did not end")


@pytest.fixture
def grouped(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The iterations of each unit sent as several (the executor's submit_many, spied on)."""
    units_sent: list[list[int]] = []
    real = LocalPoolExecutor.submit_many

    def spy(self: Any, many: Any, units: Any, hooks: Any, worker: Any = None) -> None:
        real(self, many, units, hooks, worker)
        units_sent.append([u.chunk.iteration for u in units])

    monkeypatch.setattr(LocalPoolExecutor, "submit_many", spy)
    return units_sent


def _largest(grouped: list[list[int]]) -> int:
    return max(map(len, grouped), default=0)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("jitter", [False, True])
def test_k_iterations_a_unit_give_the_outputs_of_one(
    k: int, jitter: bool, grouped: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 9 * BATCH + 3  # a short last batch
    reference = _outcomes(n, workers=0, jitter=jitter)
    assert len(reference) == 2 * 10
    monkeypatch.setenv("MPEXEC_UNIT_ITERATIONS", str(k))
    assert _outcomes(n, workers=2, jitter=jitter) == reference
    assert _largest(grouped) == k  # units did carry k iterations


def test_the_policy_groups_by_default_once_the_epochs_end_is_known(
    grouped: list[list[int]],
) -> None:
    n = 24 * BATCH
    reference = _outcomes(n, workers=0)
    assert _outcomes(n, workers=2) == reference  # no knob set
    assert _largest(grouped) == _grouping.MAX_GROUP
    # The first epoch's end unknown, its units carry one iteration (its window
    # would run past the end k times further); the second epoch's carry several,
    # from its start (its first units: the window of one iteration a unit, x k).
    assert len(grouped) >= 24 // 4
    assert grouped[0] == [0, 1, 2, 3]


def test_a_fills_first_group_leaves_before_its_last_launch(
    grouped: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # At 64 workers an epoch's first fill launches hundreds of iterations: a worker
    # waiting for the last of them to get its first group idles the while.
    events: list[Any] = []
    launch, spy = _scheduler.Scheduler._launch, LocalPoolExecutor.submit_many

    def launched(self: Any) -> bool:
        events.append("launch")
        return launch(self)

    def many(self: Any, m: Any, units: Any, hooks: Any, worker: Any = None) -> None:
        events.append(([u.chunk.iteration for u in units], worker))
        spy(self, m, units, hooks, worker)

    monkeypatch.setattr(_scheduler.Scheduler, "_launch", launched)
    monkeypatch.setattr(LocalPoolExecutor, "submit_many", many)
    n = 24 * BATCH
    reference = _outcomes(n, workers=0)
    events.clear()
    assert _outcomes(n, workers=2) == reference
    second = events[events.index(([0, 1, 2, 3], 0)) - 4 :]  # (the second epoch's first fill)
    # Window 16 (4 at k = 1, x 4): each group sent once its 4 are launched, to the
    # workers in turn; then the window's next groups as the first ones are handed over.
    assert second[:10] == ["launch"] * 4 + [([0, 1, 2, 3], 0)] + ["launch"] * 4 + [
        ([4, 5, 6, 7], 1)
    ]
    assert second[10:15] == ["launch"] * 4 + [([8, 9, 10, 11], 0)]


def test_no_group_where_the_memory_cap_holds_no_more_than_one_iteration_a_unit(
    grouped: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 24 * BATCH
    reference = _outcomes(n, workers=0)
    monkeypatch.setattr(_scheduler, "_WINDOW_BYTES", 1)  # the cap: max(depth, workers)
    assert _outcomes(n, workers=2) == reference
    assert grouped == []


def test_the_window_with_k_stays_within_the_cap_and_half_the_arena() -> None:
    for size in (1, 2, 4, 8, 32):
        for cap in range(1, 200):
            window, k = grouped_window(size, cap, 1 << 30, 4)
            assert 1 <= k <= 4
            assert window == size * k
            assert k == 1 or window <= cap  # k = 1: the window as it was
    assert grouped_window(4, 4, 1000, 4) == (4, 1)  # (the cap before any bytes are known)
    assert grouped_window(4, 1000, 1000, 4) == (16, 4)
    assert grouped_window(4, 1000, 1000, 1) == (4, 1)  # (no op groupable)
    assert grouped_window(4, 1000, 11, 4) == (8, 2)  # (half the arena: 11 iterations)


def test_the_group_waits_for_the_epochs_end_and_shrinks_for_its_tail() -> None:
    # Window 16 at k = 4 (4 at k = 1), 2 workers: (limit, group, spread).
    assert fill_plan(16, 4, 0, 0, 0, None, 2) == (4, 1, 2)  # the end unknown: as k = 1
    assert fill_plan(16, 4, 3, 1, 63, None, 2) == (5, 1, 0)
    assert fill_plan(16, 4, 3, 1, 64, None, 2) == (15, 4, 0)  # no end after 4 windows
    assert fill_plan(16, 4, 0, 0, 0, 99, 2) == (16, 4, 2)  # the end known: a group at once
    assert fill_plan(16, 4, 15, 1, 20, 99, 2) == (15, 4, 0)  # not a whole group free: wait
    # Iteration 23 the last: 4 left, 2 workers: a unit of 2 each, in one go.
    assert fill_plan(16, 4, 9, 1, 20, 23, 2) == (13, 2, 0)
    assert fill_plan(16, 4, 12, 1, 22, 23, 2) == (14, 1, 0)


def test_an_iteration_in_a_unit_of_several_fails_alone(
    grouped: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 12 * BATCH
    fail_at = 5 * BATCH + 1  # iteration 5: in a unit with others
    reference = _outcomes(n, workers=0, fail_at=fail_at)
    assert sum(isinstance(o, tuple) for o in reference) == 2  # once an epoch
    monkeypatch.setenv("MPEXEC_UNIT_ITERATIONS", "4")
    assert _outcomes(n, workers=2, fail_at=fail_at) == reference
    assert _largest(grouped) == 4


def test_a_refused_group_is_sent_again_as_single_units(monkeypatch: pytest.MonkeyPatch) -> None:
    # The group's call refused (as a full arena would refuse it), then the single unit
    # of iteration 9 of the first epoch: only that iteration fails.
    n = 24 * BATCH
    reference = _outcomes(n, workers=0)
    refused: list[int] = []
    real = LocalPoolExecutor.submit_hooked

    def refuse_many(self: Any, many: Any, units: Any, hooks: Any, worker: Any = None) -> None:
        refused.append(len(units))
        raise ValueError("no room for the group")

    def refuse_nine(self: Any, unit: Any, hook: Any) -> None:
        if unit.chunk.epoch == 0 and unit.chunk.iteration == 9:
            raise ValueError("no room for iteration 9")
        real(self, unit, hook)

    monkeypatch.setattr(LocalPoolExecutor, "submit_many", refuse_many)
    monkeypatch.setattr(LocalPoolExecutor, "submit_hooked", refuse_nine)
    got = _outcomes(n, workers=2)
    assert refused, "no group was sent: the test tested nothing"
    assert got[9] == ("ValueError", "no room for iteration 9")
    assert got[:9] + got[10:] == reference[:9] + reference[10:]


def test_a_unit_of_a_branchs_rows_is_never_sent_in_a_group() -> None:
    # A group travels as numbers (Chunks) that hold no branch rows: a unit of an
    # `if` branch's samples sent in one would run on the batch's first rows instead.
    calls: list[tuple[str, int]] = []
    executor = types.SimpleNamespace(
        submit_many=lambda many, units, hooks, worker: calls.append(("many", len(units)))
    )

    def single(unit: Any, hook: Any) -> None:
        calls.append(("one", unit.chunk.iteration))

    s = types.SimpleNamespace(pos=0, runner=object(), executor=executor, submit_hooked=single)

    def held(rows: Any) -> list[Any]:
        units = [WorkUnit(s.runner, Chunk(0, i, 0, 2, 2 * i, rows), ()) for i in range(4)]
        return [(s, u, None) for u in units]

    _grouping.send_grouped(held(None), 2, {}, _no_failure, _no_failure)
    assert calls == [("many", 2), ("many", 2)]
    calls.clear()
    _grouping.send_grouped(held((0, 3)), 2, {}, _no_failure, _no_failure)
    assert calls == [("one", 0), ("one", 1), ("one", 2), ("one", 3)]


def test_held_units_leave_a_whole_group_at_a_time_and_a_ctrl_c_returns_the_rest() -> None:
    calls: list[Any] = []
    cut = [False]

    def many(m: Any, units: Any, hooks: Any, worker: Any) -> None:
        if cut[0]:
            raise KeyboardInterrupt
        calls.append((units[0].runner, [u.chunk.iteration for u in units], worker))

    def single(unit: Any, hook: Any) -> None:
        calls.append((unit.runner, unit.chunk.iteration))

    executor = types.SimpleNamespace(submit_many=many)
    a, b = (
        types.SimpleNamespace(pos=p, runner=p, executor=executor, submit_hooked=single)
        for p in "ab"
    )

    def entry(s: Any, i: int) -> Any:
        return (s, WorkUnit(s.runner, Chunk(0, i, 0, 2, 2 * i), ()), None)

    holder = _grouping.Held(_no_failure, _no_failure)
    held = holder.start(2, 2)
    assert held is not None
    for e in (entry(a, 0), entry(b, 0), entry(a, 1)):
        held.append(e)
    held.send()  # a's group leaves; b's one unit stays
    assert calls == [("a", [0, 1], 0)]
    assert [e[1].chunk.iteration for e in held.entries] == [0]
    for e in (entry(a, 2), entry(b, 1)):
        held.append(e)
    held.send()
    held.send(every=True)  # the rest: a's last one alone
    assert calls[1:] == [("b", [0, 1], 0), ("a", 2)]
    held = holder.start(2, 2)  # (a new fill: nothing held, workers in turn from 0)
    assert held is not None
    assert held.entries == []
    for e in (entry(a, 0), entry(b, 0), entry(a, 1)):
        held.append(e)
    cut[0] = True
    with pytest.raises(KeyboardInterrupt) as caught:
        held.send()  # a's group not taken: it and b's held unit go out again
    unsent = caught.value.mpexec_unsent  # type: ignore[attr-defined]
    assert [(s.pos, u.chunk.iteration) for s, u, _ in unsent] == [("a", 0), ("a", 1), ("b", 0)]


class _Counted:
    """A runner that counts how often it is pickled."""

    pickled = 0

    def __call__(self, chunk: Any, out: Any = ()) -> int:
        return int(chunk.iteration)

    def __reduce__(self) -> tuple[Any, ...]:
        _Counted.pickled += 1
        return _Counted, ()


def test_a_unit_of_several_runner_is_pickled_once_for_every_worker() -> None:
    # The pool pickles a function for each worker it first goes to: at 64 workers the
    # first grouped epoch's ramp paid 64 pickles of the op's runner (~60 µs each).
    many = _grouping.ManyRunner(_Counted())
    copies = [pickle.loads(_codec.dump_value(many)) for _ in range(3)]
    assert _Counted.pickled == 1
    record = _runtime.Chunks(0, (5, 6), (4, 4), (20, 24), 0)
    assert [c(record) for c in copies] == [(5, 6)] * 3


def _no_failure(*args: Any) -> Any:
    raise AssertionError(f"unexpected failure: {args}")


# (owner, name, nth): the steps of holding and sending a group, on the caller's thread.
_POINTS = [
    *[(_scheduler.Scheduler, "_launch", n) for n in (1, 6, 9)],  # after: its units held
    (_grouping, "ManyRunner", 1),  # made once an op
    *[(_grouping.Held, "send", n) for n in (1, 2, 5)],  # each op's whole groups held; the rest
    *[(_grouping, "send_grouped", n) for n in (1, 3)],  # what Held.send sends, at once
    *[(_executors, "Chunks", n) for n in (1, 3)],  # submit_many: the record made, not sent
    *[(LocalPoolExecutor, "submit_many", n) for n in (1, 3)],  # after: the pool took it
    *[(LocalPoolExecutor, "submit_hooked", n) for n in (1,)],  # a single: the end's
]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("owner", "name", "nth"), _POINTS, ids=[f"{n}-{k}" for _, n, k in _POINTS])
def test_a_ctrl_c_while_a_group_is_held_or_sent_loses_and_repeats_no_batch(
    monkeypatch: pytest.MonkeyPatch,
    grouped: list[list[int]],
    owner: Any,
    name: str,
    nth: int,
    when: str,
) -> None:
    n = 24 * BATCH
    with _pipe(n, 2) as pipe:  # (the second epoch: the first's end unknown, no group)
        watched_epoch(pipe)
        pipe.reset()
        reference, _ = watched_epoch(pipe)
    armed, calls = interrupt_at(monkeypatch, owner, name, nth, when)
    with _pipe(n, 2) as pipe:
        watched_epoch(pipe)
        pipe.reset()
        armed[0] = True
        got, count = watched_epoch(pipe)
    assert count == 1, f"{name} was called {calls[0]} times on this thread: no interrupt"
    assert _largest(grouped) == _grouping.MAX_GROUP
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"batch {i} differs from an uninterrupted run's"


@pytest.mark.parametrize("nth", [1, 2, 4])
def test_a_ctrl_c_as_a_send_of_groups_returns_sends_no_unit_again(
    monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    # A Ctrl-C is checked as send_grouped returns: what it sent must not still count
    # as held then (it was sent again, and a batch callable source called twice).
    sent: list[tuple[int, int]] = []
    many, one = LocalPoolExecutor.submit_many, LocalPoolExecutor.submit_hooked

    def spy_many(self: Any, runner: Any, units: Any, hooks: Any, worker: Any = None) -> None:
        many(self, runner, units, hooks, worker)
        sent.extend((u.chunk.epoch, u.chunk.iteration) for u in units)

    def spy_one(self: Any, unit: Any, hook: Any) -> None:
        one(self, unit, hook)
        sent.append((unit.chunk.epoch, unit.chunk.iteration))

    monkeypatch.setattr(LocalPoolExecutor, "submit_many", spy_many)
    monkeypatch.setattr(LocalPoolExecutor, "submit_hooked", spy_one)
    armed, _ = interrupt_at(monkeypatch, _grouping, "send_grouped", nth, "after")
    n = 24 * BATCH
    runs = []
    for interrupted in (False, True):
        sent.clear()
        with _pipe(n, 2) as pipe:
            watched_epoch(pipe)
            pipe.reset()
            armed[0] = interrupted
            got, count = watched_epoch(pipe)
            armed[0] = False
        assert count == interrupted, "no interrupt landed"
        assert len(got) == n // BATCH
        runs.append(sorted(it for e, it in sent if e == 1))
    assert runs[1] == runs[0], "a unit was sent twice, or not at all"


def test_a_workers_first_unit_of_several_imports_no_module(grouped: list[list[int]]) -> None:
    # A module a worker must import for its first unit of several held every
    # worker back at the first grouped epoch's start (2-40 ms each on a loaded host).
    n = 24 * BATCH
    pipe = mpexec.Pipeline(batch_size=BATCH, num_workers=2, seed=7, prefetch_depth=2)
    pipe.define(
        lambda: fn.python_function(
            fn.external_source(source=Indices(n), batch=False),
            function=modules_loaded,
            batch_processing=True,
        )
    )
    counts: list[list[int]] = [[], []]
    with pipe:
        for e, (out,) in _two_epochs(pipe, n):
            counts[e] += [int(np.asarray(s)[0]) for s in out]
    assert grouped  # the second epoch's units carried several
    assert len(counts[1]) == n
    assert max(counts[1]) <= max(counts[0])
