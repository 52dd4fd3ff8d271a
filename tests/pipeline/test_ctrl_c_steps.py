"""A Ctrl-C that lands inside one of the scheduler's steps on the caller's thread.

``run()`` launches iterations (reads the sources here, dispatches their units),
lets them compute in order and assembles them, all on the caller's thread where
the sources are read here: a ``KeyboardInterrupt`` raised between taking
something (an iteration's place in the window, a fed or read batch, a unit's
dispatch, a stateful op's turn) and booking it left an iteration that never
finished (the next ``run()`` hung) or a batch lost. Each case forces the
interrupt once, at one call of a callee (before it runs, or just after it
returned), goes on iterating, and checks every batch against an uninterrupted
run: each once, in order, bit-identical; then the pipeline closes clean.
"""

from __future__ import annotations

import builtins
import collections
import threading
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _executors, _iterations, _scheduler, fn
from tests.conftest import SIGINT_STORM, run_python

pytestmark = pytest.mark.usefixtures("no_leaks")

N = 40  # samples in the epoch: 10 batches of 4
T = 30  # bound of an epoch's wait


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


class _Running:
    """A stateful op: what it returns depends on every call before (a repeat shows)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.n += 1
        return x * 1000 + self.n


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=3, prefetch_depth=2)
def _graph() -> Any:
    src = fn.external_source(
        source=[np.full(3, i, np.int64) for i in range(N)], batch=False, cycle="raise"
    )
    # The stateful op reads the source: sent from here, its turn passed on here.
    return fn.python_function(src, function=_plus_one), fn.python_function(
        src, function=_Running(), stateful=True
    )


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=3, prefetch_depth=2)
def _stateless() -> Any:
    # The injection after submit_hooked returned lands where no signal is checked
    # (between the return and _send's next store): the scheduler cannot tell that
    # the unit was taken, and sends it again. A stateless op's first outcome is
    # dropped; a stateful op's call would run twice, so that case is left out.
    # Interrupts inside the pool's submit: test_ctrl_c_submit.py.
    return fn.python_function(
        fn.external_source(
            source=[np.full(3, i, np.int64) for i in range(N)], batch=False, cycle="raise"
        ),
        function=_plus_one,
    )


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=3, prefetch_depth=2)
def _sources_only() -> Any:
    # No op to compute: an iteration is finished here, once its source is in.
    return fn.external_source(
        source=[np.full(3, i, np.int64) for i in range(N)], batch=False, cycle="raise"
    )


def _epoch(pipe: Any) -> tuple[list[tuple[bytes, ...]], int]:
    """The epoch's batches (their bytes), going on after each interrupt."""
    got: list[tuple[bytes, ...]] = []
    interrupted = 0
    for _ in range(4 * N):  # bounded: every run() returns, raises, or ends the epoch
        try:
            out = pipe.run()
        except KeyboardInterrupt:
            interrupted += 1
            continue
        except StopIteration:
            return got, interrupted
        got.append(tuple(b.as_array().tobytes() for b in out))
    raise AssertionError("the epoch did not end")


def watched_epoch(pipe: Any) -> tuple[list[tuple[bytes, ...]], int]:
    """``_epoch``, bounded: an iteration that never finishes fails the test, not hangs it."""
    watchdog = threading.Timer(T, pipe.close)
    watchdog.start()
    try:
        return _epoch(pipe)
    finally:
        watchdog.cancel()


def interrupt_at(
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    nth: int,
    when: str,
    only: Any = None,
) -> tuple[list[bool], list[int]]:
    """Make ``owner.name`` raise KeyboardInterrupt once, at its ``nth`` call on the main
    thread once armed (``only(args)``: the calls counted), ``when`` "before" it runs or
    "after" it returned. Returns (armed, calls): set ``armed[0]``; ``calls[0]`` counts."""
    real = getattr(owner, name, None) or getattr(builtins, name)
    main = threading.main_thread()
    calls = [0]
    armed = [False]

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        here = armed[0] and threading.current_thread() is main
        if here and only is not None:
            here = only(args)
        if here:
            calls[0] += 1
        if not (here and calls[0] == nth):
            return real(*args, **kwargs)
        if when == "after":
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted, raising=False)
    return armed, calls


_REFERENCE: dict[Any, list[tuple[bytes, ...]]] = {}


def _reference(graph: Any) -> list[tuple[bytes, ...]]:
    if graph not in _REFERENCE:
        with graph() as pipe:
            _REFERENCE[graph] = _epoch(pipe)[0]
    return _REFERENCE[graph]


# (owner, name): callees of the scheduler's steps on the caller's thread.
_POINTS = [
    (_scheduler, "Iteration"),  # _launch: before its place in the window
    (_iterations, "sample_tuple"),  # _pull: between two samples read
    (_iterations, "check_source_value"),  # _pull: the batch read
    (_scheduler, "own_columns"),  # _launch: the batch read, copied into shared memory
    (_scheduler.Scheduler, "_sources_in"),
    (_scheduler.Scheduler, "_dispatch_ready"),
    (_scheduler.Scheduler, "_handed_off"),
    (_scheduler.Scheduler, "_rows"),
    (_scheduler.Scheduler, "_dispatch"),
    (_scheduler.Scheduler, "_blocks"),  # _dispatch: the op booked, nothing sent
    (_scheduler, "Chunk"),
    (_scheduler, "WorkUnit"),
    (_executors.LocalPoolExecutor, "submit_hooked"),  # after: the pool took the unit
    (_scheduler.Scheduler, "_advance_turn"),  # the stateful op's unit sent, its turn not passed
    # Builtins the steps call between their bookings (_sources_in: the batch's size,
    # its sources' columns cut to it; _launch: the size a source gave).
    (_scheduler, "min"),
    (_scheduler, "max"),
    (_scheduler.Scheduler, "_finish"),  # (of _sources_only)
    (_scheduler, "Batch"),  # _finish: its outputs half made (of _sources_only)
]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("nth", [1, 6])
@pytest.mark.parametrize(("owner", "name"), _POINTS, ids=[n for _, n in _POINTS])
def test_a_ctrl_c_inside_a_step_loses_and_repeats_no_batch(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, nth: int, when: str
) -> None:
    graph = {"_finish": _sources_only, "Batch": _sources_only, "submit_hooked": _stateless}.get(
        name, _graph
    )
    reference = _reference(graph)
    armed, calls = interrupt_at(monkeypatch, owner, name, nth, when)
    with graph() as pipe:
        pipe.build()
        armed[0] = True  # once built: the steps of run() only
        got, count = watched_epoch(pipe)
    assert count == 1, f"{name} was called {calls[0]} times on this thread: no interrupt"
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"batch {i} differs from an uninterrupted run's"


_CHILD_STORM = (
    SIGINT_STORM
    + """
import numpy as np
import mpexec
from mpexec import fn

@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=1)
def graph():
    # Read here: launching an iteration, its ops' dispatch and the stateful op's
    # turn run on this thread, where the SIGINTs land.
    index = fn.external_source(source=[np.full(3, k) for k in range(10**5)], batch=False)
    counted = fn.python_function(index, function=np.copy, stateful=True)
    return fn.python_function(index, function=lambda x: x + 1), counted

if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupter, args=(0.004,))
    interrupted = batches = 0
    with graph() as pipe:
        sender.start()
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                armed[0] = True
                out, counted = pipe.run()
                armed[0] = False
            except KeyboardInterrupt:
                interrupted += 1
                continue
            want = [4 * batches + i for i in range(4)]
            assert counted.as_array()[:, 0].tolist() == want, (batches, counted)
            assert out.as_array()[:, 0].tolist() == [w + 1 for w in want], batches
            batches += 1
        stop.set()
        sender.join(30)
        # The storm over, the next batch comes (a half-done step hung it).
        watchdog = threading.Timer(30, pipe.close)
        watchdog.start()
        out, counted = pipe.run()
        watchdog.cancel()
        assert counted.as_array()[:, 0].tolist() == [4 * batches + i for i in range(4)]
    print(interrupted, batches)
"""
)


def test_a_storm_of_ctrl_c_over_steps_run_here_loses_and_repeats_nothing() -> None:
    # SIGINT every 4 ms for 2 s while run() reads a source here and sends a stateful
    # op's units (the storm of test_run_ctrl_c.py, over the steps on this thread).
    interrupted, batches = map(int, run_python("-c", _CHILD_STORM, timeout=120).split())
    assert interrupted > 0, "no interrupt landed in run(): the test tested nothing"
    assert batches > 0


_CALLS = [0, 0]  # [calls so far, the call that raises] (num_workers=0: this process's)


def _plus_one_interrupted(x: np.ndarray) -> np.ndarray:
    _CALLS[0] += 1
    if _CALLS[0] == _CALLS[1]:
        raise KeyboardInterrupt  # a Ctrl-C inside the function, run on this thread
    return x + 1


@mpexec.pipeline_def(batch_size=4, num_workers=0, seed=3, prefetch_depth=2)
def _here() -> Any:
    src = fn.external_source(
        source=[np.full(3, i, np.int64) for i in range(N)], batch=False, cycle="raise"
    )
    return fn.python_function(src, function=_plus_one_interrupted)


@pytest.mark.parametrize("nth", [1, 7, 30])
def test_a_ctrl_c_inside_a_function_run_here_loses_no_batch(nth: int) -> None:
    # num_workers=0: the function runs in run(), on this thread. Its interrupt was
    # taken for the function's error: the batch failed, and the next run() went on
    # with the one after it.
    _CALLS[:] = [0, 0]
    reference = _reference(_stateless)
    _CALLS[:] = [0, nth]
    with _here() as pipe:
        got, count = _epoch(pipe)
    assert count == 1
    assert got == reference


class _PopInterrupted(collections.deque):  # type: ignore[type-arg]
    """A source's ``fed``: its nth ``popleft`` raises KeyboardInterrupt before popping."""

    def __init__(self, nth: int) -> None:
        super().__init__()
        self.calls, self.nth = 0, nth

    def popleft(self) -> Any:
        self.calls += 1
        if self.calls == self.nth:
            raise KeyboardInterrupt
        return super().popleft()


@pytest.mark.parametrize("nth", [1, 4])
def test_a_ctrl_c_between_a_batch_read_here_and_its_taking_repeats_no_batch(nth: int) -> None:
    # _launch: the batch pull read (left first in the source's fed) is the iteration's,
    # then taken out of fed. An interrupt between the two (no signal check there on
    # CPython 3.11; forced here) put the batch back in front of itself: it came twice.
    reference = _reference(_graph)
    with _graph() as pipe:
        pipe.build()
        here = [s for s in pipe._scheduler.ops if s.op.is_source and s.runner is None]
        assert len(here) == 1
        here[0].fed = fed = _PopInterrupted(nth)
        got, count = watched_epoch(pipe)
    assert fed.calls > nth
    assert count == 1
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"batch {i} differs from an uninterrupted run's"
