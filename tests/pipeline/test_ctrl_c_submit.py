"""A Ctrl-C inside the pool's submit of a unit, once the unit's record went in.

The worker runs that unit and answers it. The scheduler used to send the unit
again (it could not tell whether the pool took it), so a ``stateful`` op's call
ran twice: its state moved on one call too far, and every later batch of it
differed from an uninterrupted run's. The pool now says whether it took the call
(``WorkerPool._submit``), and the scheduler keeps a dispatch whose units were all
taken (``Scheduler._send``). Each case forces the interrupt once, on the caller's
thread, at one point of the pool's send, and checks the stateful op's calls (a
file that each call appends to) and every batch against an uninterrupted run.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._pool import _state
from shm import _ring
from tests.pipeline.test_ctrl_c_steps import N, interrupt_at, watched_epoch

pytestmark = pytest.mark.usefixtures("no_leaks")


class _Counted:
    """A stateful op that counts its calls in a file (a call run twice shows twice)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.n = 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.n += 1
        with open(self.path, "a") as f:
            f.write(f"{int(x[0])}\n")
        return x * 1000 + self.n


def _graph(path: str) -> Any:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=3, prefetch_depth=2)
    def graph() -> Any:
        src = fn.external_source(
            source=[np.full(3, i, np.int64) for i in range(N)], batch=False, cycle="raise"
        )
        return fn.python_function(src, function=np.copy), fn.python_function(
            src, function=_Counted(path), stateful=True
        )

    return graph()


def _calls(path: pathlib.Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


# Where the interrupt lands in CallSender.send: its record pushed (inside the push,
# after it returned), or before the pushed call is queued as sent; at its nth call on
# this thread (push_many: a unit whose function goes with it, 3 in the epoch;
# enqueue: of the stateful op's units).
_WHERE = [
    (owner, name, nth)
    for owner, name in [(_ring.Ring, "push"), (_state.Slot, "enqueue")]
    for nth in (1, 2, 5)
] + [(_ring.Ring, "push_many", nth) for nth in (1, 2, 3)]


@pytest.mark.parametrize(("owner", "name", "nth"), _WHERE, ids=[f"{n}-{k}" for _, n, k in _WHERE])
def test_a_unit_taken_by_the_pool_before_a_ctrl_c_is_not_sent_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, owner: Any, name: str, nth: int
) -> None:
    with _graph(str(tmp_path / "reference")) as pipe:
        reference = watched_epoch(pipe)[0]
    reference_calls = _calls(tmp_path / "reference")
    assert reference_calls == list(range(N))  # one call a sample, in order

    # enqueue: the stateful op's calls only (pinned to a worker), interrupted with
    # the record in, before it is queued as sent; push: inside it, after it returned.
    only = (lambda args: args[1].worker is not None) if name == "enqueue" else None
    when = "before" if name == "enqueue" else "after"
    armed, calls = interrupt_at(monkeypatch, owner, name, nth, when, only)
    path = tmp_path / "interrupted"
    with _graph(str(path)) as pipe:
        pipe.build()
        armed[0] = True
        got, count = watched_epoch(pipe)
    assert count == 1, f"{name} was called {calls[0]} times on this thread: no interrupt"
    assert _calls(path) == reference_calls, "the stateful op's calls (a repeat shows twice)"
    assert len(got) == len(reference)
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"batch {i} differs from an uninterrupted run's"
