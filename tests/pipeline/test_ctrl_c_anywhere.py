"""A Ctrl-C at every point of ``run()`` where CPython can raise one: nothing lost or repeated.

CPython raises a signal handler's ``KeyboardInterrupt`` where it checks for
one: as a Python function starts, as a call returns, at a loop's jump back
(and on 3.10 at a taken conditional jump). A profile function sees the first
two as its ``call`` / ``return`` / ``c_return`` events, so raising
``KeyboardInterrupt`` from it at the n-th event of a ``run()`` lands where a
real Ctrl-C can, deterministically. These sweep n over a run()'s events, one
interrupt a run(), and check every batch (and every op's error) against what
an uninterrupted run gives: each once, in order, then the pipeline closes clean.

The documented limits are left out (docs/pipeline.md, "Ctrl-C"): an item of
an iterable read here, lost as it is taken (``next_item``), a value lost as
``run()`` returns it to the caller, and a release of a batch's memory (a
finalizer: an interrupt there is printed, never raised to the caller; the
release is finished by the next one, which tests/shm/test_release_ctrl_c.py
sweeps; one cut off as the finalizer starts, before any of its code, is lost).

test_ctrl_c_steps.py forces interrupts at named callees; this covers the
points no list names (it found a launch's handler reading a name not yet
bound, an op booked as dispatched before its try, an error lost between its
hand-out and its raise, and a lock the caller held for good).
"""

from __future__ import annotations

import random
import sys
import threading
from types import FrameType
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._executors import LocalPoolExecutor
from tests.conftest import InterruptAt, wait_until

pytestmark = pytest.mark.usefixtures("no_leaks")

FAILS = 12  # sample k fails where k % FAILS == 5: a failed iteration every third
# (function, event or "*"): where an interrupt is documented to lose something.
_LIMITS = {("next_item", "*"), ("run", "return")}


def _limit(frame: FrameType, event: str) -> bool:
    name = frame.f_code.co_name
    if (name, "*") in _LIMITS or (name, event) in _LIMITS:
        return True
    # A release's finalizer (run wherever a batch's last view goes, a gc pass's too): an
    # interrupt there is printed, never raised to run()'s caller, and the release is
    # finished by the next one (tests/shm/test_release_ctrl_c.py sweeps it).
    return "shm" in frame.f_code.co_filename and _in_release(frame)


def _in_release(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "_fire":
            return True
        frame = frame.f_back
    return False


def _plus_one(x: np.ndarray) -> np.ndarray:
    if x[0] % FAILS == 5:
        raise ValueError(f"sample {int(x[0])}")
    return x + 1


class _Epoch:
    """A per-sample source of ``EPOCH`` samples an epoch (called in the workers)."""

    def __call__(self, info: Any) -> np.ndarray:
        if info.idx_in_epoch >= EPOCH:
            raise StopIteration
        return np.full(3, info.idx_in_epoch)


def _plus_one_batch(xs: list[np.ndarray]) -> list[np.ndarray]:
    return [_plus_one(x) for x in xs]


EPOCH = 48  # samples an epoch where the source is read in the workers


def _graph(workers: int, stateful: bool, grouped: bool = False) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=4, num_workers=workers, seed=1, prefetch_depth=2)
    def graph() -> Any:
        if grouped:  # read in the workers, a batch op: units of several iterations (by policy)
            index = fn.external_source(source=_Epoch(), batch=False)
            return fn.python_function(index, function=_plus_one_batch, batch_processing=True)
        index = fn.external_source(source=[np.full(3, k) for k in range(10**5)], batch=False)
        outs = [fn.python_function(index, function=_plus_one)]
        if stateful:  # its turn is passed on here: a repeat or a loss shows in its counts
            outs.append(fn.python_function(index, function=np.copy, stateful=True))
        return tuple(outs)

    return graph()


def _run(pipe: mpexec.Pipeline, interrupt: InterruptAt, target: int) -> Any:
    """One run() with the interrupt armed at ``target``: its batch, its error, or None."""
    interrupt.seen, interrupt.target, interrupt.where = 0, target, ""
    caught: BaseException | None = None
    sys.setprofile(interrupt)
    try:
        out = pipe.run()
    except BaseException as exc:
        sys.setprofile(None)
        caught = exc
    sys.setprofile(None)
    if caught is None:
        return ("batch", int(out[0].as_array()[0, 0]) - 1, out)
    if isinstance(caught, KeyboardInterrupt):
        return None
    if isinstance(caught, StopIteration):
        return ("end", 0, None)
    if isinstance(caught, ValueError):
        return ("error", int(str(caught).split()[1]), None)
    raise caught


def _sweep(pipe: mpexec.Pipeline, stateful: bool, runs: int, epoch: int = 0) -> int:
    """Interrupt ``runs`` run()s and check each outcome; returns how many landed.

    Each kind of run() (a batch's, an error's, an epoch end's) is interrupted in
    turn at its events 1, 2, ... from its start (from 1 again once a run() ends
    before its target); at its last, last but one, ... (as many as its last
    uninterrupted run() had: the hand-out is at the end); and at one drawn from
    those of its longest run() (a run() that launches and sends a window's
    iterations is one in several, and far longer than the others).
    """
    interrupt = InterruptAt(skip=_limit)
    landed, expected, where = 0, 0, ""
    draw = random.Random(0)
    step = {"batch": 0, "error": 0, "end": 0}
    events = {"batch": 0, "error": 0, "end": 0}  # in its kind's last run() not interrupted
    longest = dict(events)
    for _ in range(runs):
        first = 4 * expected
        failing = [k for k in range(first, first + 4) if k % FAILS == 5]
        want = ("error", failing[0]) if failing else ("batch", first)
        if epoch and first >= epoch:  # (``epoch`` samples an epoch: then reset, profile off)
            want = ("end", 0)
        kind = want[0]
        step[kind] += 1
        n = step[kind] // 3 + 1
        target = (n, max(1, events[kind] + 1 - n), draw.randint(1, longest[kind] + 1))[
            step[kind] % 3 if events[kind] else 0
        ]
        for armed in (target, 0):  # (0: the run() after one interrupted)
            watchdog = threading.Timer(30, pipe.close)  # a hang fails, not hangs, the test
            watchdog.start()
            try:
                got = _run(pipe, interrupt, armed)
            finally:
                watchdog.cancel()
            if got is None:
                landed, where = landed + 1, interrupt.where
                continue
            if armed:
                step[kind] = 0  # it ended before its target-th event: from 1 again
            events[kind] = interrupt.seen
            longest[kind] = max(longest[kind], interrupt.seen)
            assert got[:2] == want, f"after an interrupt at {where}"
            if stateful and got[2] is not None:
                counts = got[2][1].as_array()[:, 0].tolist()
                assert counts == list(range(first, first + 4)), f"after an interrupt at {where}"
            expected += 1
            if want[0] == "end":
                pipe.reset()
                expected = 0
            break
    return landed


def _no_reference_kept(pipe: mpexec.Pipeline) -> None:
    """Every reference to the pool's memory sent to a worker comes back once they are idle.

    What an interrupted send had shared and never sent, or a release taken off
    its ring and not applied, would be held for good (the pool's memory, until
    it closes): the sweeps found both, and a unit's blocks given back by no one.
    """
    pool = pipe._pool
    wait_until(
        lambda: pool.stats().arena.exported == 0,
        what=f"the references sent to come back ({pool.stats().arena.exported} kept)",
    )


@pytest.mark.parametrize(("workers", "stateful"), [(2, False), (2, True), (0, True)])
def test_a_ctrl_c_anywhere_in_run_loses_and_repeats_no_batch_nor_error(
    workers: int, stateful: bool
) -> None:
    with _graph(workers, stateful) as pipe:
        pipe.build()
        landed = _sweep(pipe, stateful, runs=900)
        if workers:
            _no_reference_kept(pipe)
    assert landed > 400, "too few interrupts landed: the sweep tested little"


def test_a_ctrl_c_anywhere_in_run_with_units_of_several_iterations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A source read in the workers and a batch op: from the second epoch, units carry
    # several iterations, held and sent in groups by the fill (mpexec._grouping).
    grouped: list[int] = []
    real = LocalPoolExecutor.submit_many

    def spy(self: Any, many: Any, units: Any, hooks: Any, worker: Any = None) -> None:
        real(self, many, units, hooks, worker)
        grouped.append(len(units))

    monkeypatch.setattr(LocalPoolExecutor, "submit_many", spy)
    # (The grouping's own steps, one by one: test_unit_iterations.py's injections.)
    with _graph(2, False, grouped=True) as pipe:
        pipe.build()
        landed = _sweep(pipe, False, runs=900, epoch=EPOCH)
        _no_reference_kept(pipe)
    assert grouped, "no unit of several iterations was sent: the test tested nothing"
    assert landed > 400, "too few interrupts landed: the sweep tested little"
