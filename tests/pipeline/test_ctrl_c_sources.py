"""A Ctrl-C while an iteration's sources that run in the workers are sent.

``run()`` launches an iteration by reading the sources run here, then sending a
unit per source run in a worker (DALI's parallel ``external_source``). An
iterable or generator read in its worker is stateful: each call takes its next
batch. An interrupt after one source's unit went out used to undo the whole
launch, and the next ``run()`` sent that unit again: the iterable, asked twice
for the same iteration, took that for the end of its epoch, and every batch after
was lost. Now the iteration stays once a source's unit went out, and the next
``run()`` sends the sources left: each source is called once an iteration. An
iterable asked again for the iteration it just read gives that batch again (a
unit sent twice where the scheduler cannot tell it was taken, an interrupt just
after ``submit_hooked`` returned, where CPython checks no signal).
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from mpexec import _executors, _scheduler, fn
from mpexec.pipeline import Pipeline
from tests.pipeline.test_ctrl_c_steps import interrupt_at, watched_epoch

pytestmark = pytest.mark.usefixtures("no_leaks")

B = 10  # batches in the epoch


def _batches() -> Any:
    for i in range(B):
        yield [np.full(3, 4 * i + k, np.int64) for k in range(4)]


class _BatchOf:
    """A batch callable that records each call's iteration in a file."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __call__(self, info: Any) -> list[np.ndarray]:
        with open(self.path, "a") as f:
            f.write(f"{info.iteration}\n")
        if info.iteration >= B:
            raise StopIteration
        return [np.full(2, 100 * info.iteration + k, np.int64) for k in range(4)]


def _pipe(path: pathlib.Path) -> Pipeline:
    pipe = Pipeline(4, 1, None, py_num_workers=2, seed=1, prefetch_queue_depth=2)
    with pipe:
        pipe.set_outputs(
            fn.external_source(_batches, parallel=True, cycle="raise"),  # read in one worker
            fn.external_source(_BatchOf(path), parallel=True, batch=True, batch_info=True),
        )
    return pipe


def _calls(path: pathlib.Path) -> list[int]:
    """The iterations the callable was called for (not those prefetched past the end)."""
    return sorted(i for i in map(int, path.read_text().split()) if i < B)


# (owner, name, when): the first source's unit sent, then the interrupt: after its
# dispatch returned, or inside the second's; after the pool took a unit, where the
# scheduler cannot tell it was taken (it sends it again).
_POINTS = [
    (_scheduler.Scheduler, "_dispatch", "after"),
    (_scheduler.Scheduler, "_dispatch", "before"),
    (_executors.LocalPoolExecutor, "submit_hooked", "after"),
]


@pytest.mark.parametrize("nth", [1, 2, 5, 6])
@pytest.mark.parametrize(
    ("owner", "name", "when"), _POINTS, ids=[f"{n}-{w}" for _, n, w in _POINTS]
)
def test_a_ctrl_c_between_worker_sources_loses_and_repeats_no_batch(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: pathlib.Path,
    owner: Any,
    name: str,
    when: str,
    nth: int,
) -> None:
    with _pipe(tmp_path / "reference") as pipe:
        reference = watched_epoch(pipe)[0]
    assert len(reference) == B
    armed, calls = interrupt_at(monkeypatch, owner, name, nth, when)
    with _pipe(tmp_path / "interrupted") as pipe:
        pipe.build()
        armed[0] = True
        got, count = watched_epoch(pipe)
    assert count == 1, f"{name} was called {calls[0]} times on this thread: no interrupt"
    assert len(got) == B, "batches lost (the iterable read twice for one iteration)"
    for i, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a == b, f"batch {i} differs from an uninterrupted run's"
    if name == "_dispatch":  # (after submit_hooked: sent again, so called again)
        assert _calls(tmp_path / "interrupted") == list(range(B)), "a source called twice"
