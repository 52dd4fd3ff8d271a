"""When a function may be called twice for one sample, and when never (issue 23, item 2).

Reseeding ``np.random`` and ``random`` costs about 5 us, so a runner whose calls
prove cheap and draw-free speculates, and the one call that then draws runs
again (``_globalrandom.GlobalRandom``). That is bounded: a function whose calls take
longer, one that draws from the start, ``reseed="always"`` and every op under a
``timeout`` are called exactly once per sample. Calls are counted in a file
each call appends its sample's index to (the workers are other processes).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _runtime, fn
from mpexec._executors import PoolExecutor
from mpexec._graph import Op
from mpexec._modes import OpKind
from mpexec._runtime import Chunk


def _index(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    return np.array([info.idx_in_epoch], dtype=np.int64)


class _Source:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return _index(info)


class _Logged:
    """Appends each call's sample to ``log``; sleeps ``seconds`` (at sample ``slow_at``
    only, if given); draws from ``np.random`` at samples >= ``draws_from``."""

    def __init__(
        self, log: Path, *, draws_from: int = 0, seconds: float = 0.0, slow_at: int = -1
    ) -> None:
        self.log = str(log)
        self.draws_from = draws_from
        self.seconds = seconds
        self.slow_at = slow_at

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        i = int(x[0])
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        if self.seconds and self.slow_at in (-1, i):
            time.sleep(self.seconds)
        if i >= self.draws_from:
            return np.random.random(2) + i
        return np.zeros(2) + i


def _calls(log: Path) -> list[int]:
    return sorted(int(line) for line in log.read_text().split())


def _run(function: Any, n: int, batch: int, **kwargs: Any) -> list[bytes]:
    op_kwargs = {"reseed": kwargs.pop("reseed")} if "reseed" in kwargs else {}

    @mpexec.pipeline_def(batch_size=batch, seed=5, **kwargs)
    def graph() -> Any:
        src = fn.external_source(source=_Source(n), batch=False)
        return fn.python_function(src, function=function, **op_kwargs)

    with graph() as pipe:
        return [np.asarray(s).tobytes() for (out,) in pipe for s in out]


@pytest.fixture
def cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call counts as cheap, here and in workers forked from here."""
    monkeypatch.setattr(_runtime, "_CHEAP_SECONDS", 10.0)


#: A pool's timeout puts its ops' runners in "never twice" mode, whatever its value;
#: the log shows a call run twice. The bound is one no call here comes near, even on
#: a loaded host where a worker's first call also imports this module (a bound of
#: 3 s for a 2 s call was met by that import alone: TaskTimeoutError, py313 beside a
#: second suite, load 8 on 2 cores).
_TIMEOUT = 30.0


@pytest.mark.usefixtures("no_leaks")
def test_a_slow_drawing_function_under_a_timeout_is_called_once(tmp_path: Path) -> None:
    """Slow (well over ``_CHEAP_SECONDS``) and drawing, under a timeout: once a sample."""
    log = tmp_path / "calls"
    function = _Logged(log, seconds=0.2)
    got = _run(function, 2, 1, num_workers=2, timeout=_TIMEOUT)  # a call a sample
    assert _calls(log) == [0, 1]
    assert got == _run(_Logged(tmp_path / "serial"), 2, 1, num_workers=0)


@pytest.mark.usefixtures("no_leaks", "cheap", "forkable")
def test_under_a_timeout_even_cheap_calls_are_never_run_twice(tmp_path: Path) -> None:
    """Cheap and draw-free for 12 samples, then a call that draws: still once (without
    the timeout it runs twice: test_reseed_always_never_runs_a_call_twice's "auto")."""
    log = tmp_path / "calls"
    function = _Logged(log, draws_from=12)
    got = _run(function, 16, 4, num_workers=1, timeout=_TIMEOUT, start_method="fork")
    assert _calls(log) == list(range(16))
    assert got == _run(_Logged(tmp_path / "serial", draws_from=12), 16, 4, num_workers=0)


class _Claims:
    """Claims a file per sample (O_EXCL: a second claim fails), then draws."""

    def __init__(self, where: Path) -> None:
        self.where = str(where)

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        fd = os.open(os.path.join(self.where, str(int(x[0]))), os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        return np.random.random(3)


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_function_that_claims_a_file_then_draws_runs_in_a_pipeline(
    tmp_path: Path, num_workers: int
) -> None:
    (tmp_path / "serial").mkdir()
    (tmp_path / "pipe").mkdir()
    serial = _run(_Claims(tmp_path / "serial"), 32, 8, num_workers=0)
    assert _run(_Claims(tmp_path / "pipe"), 32, 8, num_workers=num_workers) == serial
    assert sorted(os.listdir(tmp_path / "pipe")) == sorted(str(i) for i in range(32))


@pytest.mark.usefixtures("no_leaks")
def test_a_side_effect_of_calls_over_50_us_happens_once_per_sample(tmp_path: Path) -> None:
    """Calls that take longer than reseeding never speculate, though they draw late."""
    log = tmp_path / "calls"
    function = _Logged(log, draws_from=30, seconds=4 * _runtime._CHEAP_SECONDS)
    got = _run(function, 48, 8, num_workers=2)
    assert _calls(log) == list(range(48))
    assert got == _run(_Logged(tmp_path / "serial", draws_from=30), 48, 8, num_workers=0)


@pytest.mark.usefixtures("no_leaks", "cheap")
@pytest.mark.parametrize("num_workers", [0, 1])
def test_reseed_always_never_runs_a_call_twice(
    tmp_path: Path, num_workers: int, request: pytest.FixtureRequest
) -> None:
    if num_workers:
        request.getfixturevalue("forkable")
    serial = _run(_Logged(tmp_path / "serial", draws_from=20), 32, 8, num_workers=0)
    kwargs: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        kwargs["start_method"] = "fork"  # the workers' calls count as cheap too
    always, auto = tmp_path / "always", tmp_path / "auto"
    assert _run(_Logged(always, draws_from=20), 32, 8, reseed="always", **kwargs) == serial
    assert _calls(always) == list(range(32))
    # the same op in "auto": cheap and draw-free until sample 20, which runs twice
    assert _run(_Logged(auto, draws_from=20), 32, 8, **kwargs) == serial
    assert _calls(auto) == sorted([*range(32), 20])


@pytest.mark.parametrize("bad", ["sometimes", "ALWAYS", True, None, 1])
def test_reseed_is_checked(bad: Any) -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def graph() -> Any:
        src = fn.external_source(source=_Source(2), batch=False)
        return fn.python_function(src, function=np.copy, reseed=bad)

    with pytest.raises(ValueError, match=r"reseed must be 'auto'.*or 'always'"):
        graph()


def test_reseed_always_keeps_two_ops_apart() -> None:
    """Ops that differ only in ``reseed`` are not merged into one (one may repeat)."""
    f = _Logged(Path(os.devnull))

    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=1)
    def graph() -> Any:
        src = fn.external_source(source=_Source(2), batch=False)
        return (
            fn.python_function(src, function=f, seed=3),
            fn.python_function(src, function=f, seed=3, reseed="always"),
        )

    ops = graph()._defined().ops
    assert ops[1].key() != ops[2].key()


class _TimedPool:
    """What a pool with a timeout shows an executor (a ``RayPool``'s ``timeout`` too)."""

    num_workers = 0
    timeout = 5.0


@pytest.mark.usefixtures("cheap")
def test_a_pool_with_a_timeout_gives_runners_that_never_repeat(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    op = Op(OpKind.PYTHON_FUNCTION, "op", 0, (), _Logged(log, draws_from=20))
    runner = PoolExecutor(_TimedPool()).runner(op, 7, debug=False)  # type: ignore[arg-type]
    xs = np.arange(32).reshape(32, 1)
    runner(Chunk(epoch=0, iteration=0, start=0, count=32, epoch_start=0), xs)
    assert _calls(log) == list(range(32))
