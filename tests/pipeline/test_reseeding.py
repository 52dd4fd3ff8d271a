"""Global random state is reseeded only where a call reads it (``_globalrandom.GlobalRandom``).

A call that draws from ``np.random`` or ``random`` must see exactly the state
reseeding before every call gives (docs/design.md, "Determinism"), whatever earlier calls, the
caller or a cached Gaussian left behind. The reference here reseeds before every
call (``watch`` off, in this process); the runs under test speculate, in workers
and inline. A runner speculates only after a streak of cheap calls that drew
nothing, so some functions here draw late (after 31 draw-free samples).

The contract on calls run twice (issue 23): only ``reseed="auto"`` ops whose
calls were all cheap and draw-free may see one call run again; a slow function,
``reseed="always"`` and every op under a ``timeout`` are called once per sample.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _globalrandom, _runtime, fn
from mpexec._runtime import Chunk, OpRunner

N = 64
BATCH = 8


def _source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= N:
        raise StopIteration
    return np.array([info.idx_in_epoch], dtype=np.int64)


def _np_sometimes(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Draws on every third sample only: most calls before it drew nothing."""
    if x[0] % 3 == 2:
        return np.random.random(2) + x[0]
    return np.zeros(2) + x[0]


def _np_624_words(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """312 doubles are 624 words: the position is back where reseeding left it."""
    if x[0] % 4 == 1:
        return np.random.random(312)[:2] + x[0]
    return np.zeros(2) + x[0]


def _py_sometimes(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] % 5 == 3:
        return np.array([random.random(), random.getrandbits(20)]) + x[0]
    return np.zeros(2) + x[0]


def _leaves_gaussians(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """One of a pair each: both generators cache the other for the next draw."""
    if x[0] % 2:
        return np.array([np.random.standard_normal(), random.gauss(0.0, 1.0)])
    return np.zeros(2)


def _gaussians_sometimes(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] % 3:
        return np.array([np.random.standard_normal(), random.gauss(0.0, 1.0)])
    return np.zeros(2)


def _np_late(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Draws on every 32nd sample: a runner speculates before its first draw."""
    if x[0] % 32 == 31:
        return np.random.random(2) + x[0]
    return np.zeros(2) + x[0]


def _py_late(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] % 32 == 29:
        return np.array([random.random(), random.gauss(0.0, 1.0)]) + x[0]
    return np.zeros(2) + x[0]


def _never(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return (x * 2).astype(np.float64)


def make(num_workers: int) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=BATCH, num_workers=num_workers, seed=42)
    def graph() -> Any:
        src = fn.external_source(source=_source, batch=False)
        return (
            fn.python_function(src, function=_np_sometimes),
            fn.python_function(src, function=_np_624_words),
            fn.python_function(src, function=_py_sometimes),
            fn.python_function(fn.python_function(src, function=_never), function=_np_sometimes),
            fn.python_function(src, function=_leaves_gaussians),
            fn.python_function(src, function=_gaussians_sometimes),
            fn.python_function(src, function=_np_late),
            fn.python_function(src, function=_py_late),
            fn.python_function(fn.python_function(src, function=_never), function=_np_late),
        )

    return graph()


def run(pipe: mpexec.Pipeline, between: Any = None) -> list[list[bytes]]:
    got = []
    with pipe:
        for outs in pipe:
            got.append([np.asarray(s).tobytes() for b in outs for s in b])
            if between is not None:
                between()
    return got


@pytest.fixture(scope="module")
def reference() -> list[list[bytes]]:
    saved = _runtime._globals.watch
    _runtime._globals.watch = False  # reseed before every call
    try:
        return run(make(0))
    finally:
        _runtime._globals.watch = saved


def test_the_state_is_watched_here() -> None:
    """On CPython with NumPy's MT19937 the speculation is on (else the tests prove little)."""
    assert _runtime._globals.watch
    _runtime.reseed(1, 2)
    assert _runtime._globals.fresh()
    np.random.random_sample()
    assert not _runtime._globals.fresh()
    _runtime.reseed(1, 2)
    random.random()
    assert not _runtime._globals.fresh()
    _runtime.reseed(1, 2)
    np.random.random(312)  # 624 words: the position comes back, the words do not
    assert not _runtime._globals.fresh()
    _runtime.reseed(1, 2)
    random.setstate((*random.getstate()[:2], 0.5))  # a cached Gaussian, nothing drawn
    assert not _runtime._globals.fresh()


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_outputs_equal_reseeding_before_every_call(
    reference: list[list[bytes]], num_workers: int
) -> None:
    assert len(reference) == N // BATCH
    assert run(make(num_workers)) == reference


def test_the_caller_drawing_between_inline_runs_changes_nothing(
    reference: list[list[bytes]],
) -> None:
    def draw() -> None:
        np.random.standard_normal()  # leaves the pair's second value cached
        random.gauss(0.0, 1.0)

    assert run(make(0), between=draw) == reference


def _counted(calls: list[int], first_draw: int = 1) -> Any:
    def function(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        calls.append(int(x[0]))
        return np.random.random(1) if x[0] >= first_draw and x[0] % 2 else np.zeros(1)

    return function


def _chunk(count: int, iteration: int = 0) -> Chunk:
    return Chunk(epoch=0, iteration=iteration, start=0, count=count, epoch_start=0)


@pytest.fixture
def cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call counts as cheap: what speculation does, whatever the host's speed."""
    monkeypatch.setattr(_runtime, "_CHEAP_SECONDS", 10.0)


@pytest.mark.usefixtures("cheap")
def test_a_drawing_call_runs_again_once_then_every_call_is_reseeded() -> None:
    calls: list[int] = []
    streak = _runtime._CHEAP_STREAK
    first = streak + 3  # its first draw, after calls that drew nothing
    runner = OpRunner("op", _counted(calls, first), "sample", 1, 7)
    n = first + 4
    xs = np.arange(n).reshape(n, 1)
    one = runner(_chunk(n), xs)
    # reseeded until the streak, then speculative: the first draw ran twice
    assert calls == [*range(first + 1), first, *range(first + 1, n)]
    calls.clear()
    two = runner(_chunk(n), xs)
    assert calls == list(range(n))
    (got,), (again,) = one.outputs, two.outputs
    assert [a.tobytes() for a in got] == [b.tobytes() for b in again]


@pytest.mark.usefixtures("cheap")
def test_a_function_that_draws_early_is_never_called_twice() -> None:
    calls: list[int] = []
    runner = OpRunner("op", _counted(calls), "sample", 1, 7)  # draws from sample 1 on
    runner(_chunk(40), np.arange(40).reshape(40, 1))
    runner(_chunk(40), np.arange(40).reshape(40, 1))
    assert calls == list(range(40)) * 2


def test_slow_calls_are_never_speculative() -> None:
    """Calls over ``_CHEAP_SECONDS`` reseed first, so a late draw is not run twice."""
    calls: list[int] = []
    counted = _counted(calls, first_draw=3 * _runtime._CHEAP_STREAK)

    def slow(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        time.sleep(2 * _runtime._CHEAP_SECONDS)
        return counted(x)  # type: ignore[no-any-return]

    runner = OpRunner("op", slow, "sample", 1, 7)
    n = 4 * _runtime._CHEAP_STREAK
    runner(_chunk(n), np.arange(n).reshape(n, 1))
    assert calls == list(range(n))


@pytest.mark.usefixtures("cheap")
def test_a_slow_speculative_chunk_ends_the_speculation(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    streak = _runtime._CHEAP_STREAK
    counted = _counted(calls, first_draw=100)

    def sometimes_slow(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if x[0] == streak + 1:  # speculative by now: the chunk takes longer than "cheap"
            monkeypatch.setattr(_runtime, "_CHEAP_SECONDS", 0.0)
        return counted(x)  # type: ignore[no-any-return]

    runner = OpRunner("op", sometimes_slow, "sample", 1, 7)
    n = streak + 2
    runner(_chunk(n), np.arange(n).reshape(n, 1))
    monkeypatch.setattr(_runtime, "_CHEAP_SECONDS", 10.0)
    calls.clear()
    runner(_chunk(4), np.arange(100, 104).reshape(4, 1))  # draws at 101 and 103
    assert calls == [100, 101, 102, 103]  # reseeding again when the draw came


@pytest.mark.usefixtures("cheap")
def test_calls_that_draw_nothing_leave_the_state_alone() -> None:
    runner = OpRunner("op", _never, "sample", 1, 7)
    streak = _runtime._CHEAP_STREAK
    runner(_chunk(streak), np.arange(streak).reshape(streak, 1))  # reseeded: the streak
    _runtime.reseed(123, 456)
    before = (np.random.get_state()[1].copy(), random.getstate())
    runner(_chunk(5), np.arange(5).reshape(5, 1))
    assert np.array_equal(np.random.get_state()[1], before[0])
    assert random.getstate() == before[1]


@pytest.mark.parametrize("kind", ["stateful", "preserve"])
def test_calls_that_may_not_repeat_always_reseed(kind: str) -> None:
    calls: list[int] = []
    runner = OpRunner("op", _counted(calls), "sample", 1, 7, repeatable=False)
    _runtime.reseed(0, 0)
    runner(_chunk(6), np.arange(6).reshape(6, 1))
    assert calls == list(range(6)), kind


@pytest.mark.usefixtures("no_leaks")
def test_a_stateful_op_is_never_called_twice() -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            self.n += 1
            return np.array([self.n, np.random.randint(1 << 30)], dtype=np.int64)

    @mpexec.pipeline_def(batch_size=BATCH, num_workers=2, seed=3)
    def graph() -> Any:
        src = fn.external_source(source=_source, batch=False)
        return fn.python_function(src, function=Counter(), stateful=True)

    with graph() as pipe:
        counts = [int(s[0]) for (out,) in pipe for s in out]
    assert counts == list(range(1, N + 1))


@pytest.mark.usefixtures("cheap")
def test_an_error_from_a_speculative_call_that_drew_is_the_reseeded_calls() -> None:
    seen: list[float] = []

    def fails(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if not x[0]:
            return np.zeros(1)
        value = np.random.random()
        seen.append(value)
        raise ValueError(f"drew {value!r}")

    runner = OpRunner("op", fails, "sample", 1, 7)
    streak = _runtime._CHEAP_STREAK
    runner(_chunk(streak), np.zeros((streak, 1)))  # speculative from now on
    _runtime.reseed(0, 0)
    with pytest.raises(ValueError) as info:
        runner(_chunk(1), np.ones((1, 1)))
    assert len(seen) == 2
    assert seen[0] != seen[1]
    assert str(info.value) == f"drew {seen[1]!r}"  # the run on freshly reseeded state
    (np_seed,), _ = _runtime.call_seeds(7, 0, 0, 1, 1)
    np.random.seed(np_seed)
    assert seen[1] == np.random.random()


def test_another_bit_generator_turns_the_watch_off() -> None:
    """After ``np.random.set_bit_generator`` the words watched are not the state used."""
    g = _globalrandom.GlobalRandom()
    assert g.watch
    g.reseed(1, 2)
    assert g.fresh()
    g.bit_generator = object()  # as if np.random's RandomState had another one now
    assert not g.fresh()
    g.reseed(1, 2)
    assert not g.watch


def _chunks_of_every_kind() -> list[Chunk]:
    rnd = random.Random(11)
    chunks = [Chunk(0, 0, 0, 0, 0), Chunk(3, 1 << 70, 5, 40, 0), Chunk(1 << 65, 2, 0, 1, 9)]
    for _ in range(40):
        rows = tuple(sorted(rnd.sample(range(300), rnd.randint(1, 20))))
        chunks.append(Chunk(rnd.getrandbits(40), rnd.getrandbits(20), 0, len(rows), 0, rows))
        chunks.append(Chunk(rnd.getrandbits(8), rnd.getrandbits(70), rnd.randint(0, 99), 64, 0))
    return chunks


def test_a_chains_seeds_are_each_ops_own() -> None:
    """``chain_seeds`` (one pass of arrays for a chain's ops) gives each op what
    ``sample_seeds`` gives it alone, in branches (``rows``) and past 64 bits too."""
    rnd = random.Random(12)
    for chunk in _chunks_of_every_kind():
        entropies = [rnd.getrandbits(rnd.choice([1, 32, 64, 128, 200])) for _ in range(6)]
        got = _runtime.chain_seeds(entropies, chunk)
        assert got == [_runtime.sample_seeds(e, chunk) for e in entropies]


def test_a_chain_hashes_its_ops_seeds_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of four ops mixes its chunk's seeds in 2 array passes, not 2 an op (issue 37:
    ~20 us of array calls a chunk each), and draws what the ops draw apart."""
    passes = []
    real = _runtime._mix_array

    def counting(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        passes.append(z.shape)
        return real(z)

    def draws(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return np.array([np.random.randint(1 << 30), random.getrandbits(30)]) + x[:1]

    ops = [OpRunner(f"op{i}", draws, "sample", 1, entropy=100 + i) for i in range(4)]
    chunk = Chunk(1, 2, 0, 8, 16)
    column = [np.zeros(2, dtype=np.int64)] * 8
    alone = column
    for op in ops:
        alone = list(op(chunk, alone).outputs[0])
    monkeypatch.setattr(_runtime, "_mix_array", counting)
    chained = _runtime.ChainRunner(ops, [(0,)] * 4)(chunk, column)
    assert len(passes) == 2
    assert [a.tobytes() for a in chained.outputs[0]] == [a.tobytes() for a in alone]
