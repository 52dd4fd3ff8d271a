"""Pipeline.state_dict / load_state_dict: a resumed run yields exactly the rest."""

from __future__ import annotations

import functools
import json
import textwrap
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from tests.conftest import run_python

pytestmark = pytest.mark.usefixtures("no_leaks")


def noisy(info: Any, rng: Any = None) -> Any:
    if info.idx_in_epoch >= 22:
        raise StopIteration
    return np.full(64, info.idx_in_epoch, np.float32) + np.random.random(64).astype(np.float32)


def jitter(x: Any, rng: Any) -> Any:
    return x * rng.random(x.shape, dtype=np.float32)


LABELS = [np.arange(i, i + 3) for i in range(100, 122)]  # re-read every epoch


def build(num_workers: int = 2, prefetch: int = 3) -> mpexec.Pipeline:
    @mpexec.pipeline_def(
        batch_size=4,
        num_workers=num_workers,
        seed=17,
        prefetch_depth=prefetch,
        last_batch="partial",
    )
    def pipe() -> Any:
        x = fn.external_source(source=noisy, batch=False)
        # An iterable read here, started again each epoch (cycle="raise").
        y = fn.external_source(source=LABELS, batch=False, cycle="raise")
        return fn.python_function(x, function=jitter), y

    return pipe()  # type: ignore[no-any-return]


def digest(outputs: Any) -> list[list[float]]:
    return [
        np.asarray(b.as_array()).sum(axis=tuple(range(1, 2))).round(4).tolist() for b in outputs
    ]


def epochs(pipe: mpexec.Pipeline, n: int) -> list[Any]:
    out = []
    for e in range(n):
        if e:
            pipe.reset()
        out += [digest(o) for o in pipe]
    return out


SCRIPT = """
import json, sys
from tests.pipeline.test_resume import build, digest, epochs
def main():
    mode, k = sys.argv[1], int(sys.argv[2])
    with build(num_workers=1, prefetch=1) as pipe:
        if mode == "save":
            for _ in range(k):
                pipe.run()
            print(json.dumps(pipe.state_dict()))
            return
        pipe.load_state_dict(json.loads(sys.stdin.read()))
        rest = [digest(o) for o in pipe]
        pipe.reset()
        rest += [digest(o) for o in pipe]
        print(json.dumps(rest))
if __name__ == "__main__":
    main()
"""


def test_resume_in_a_new_process(tmp_path: Any) -> None:
    with build() as pipe:
        full = epochs(pipe, 2)
    per_epoch = len(full) // 2
    assert per_epoch == 6
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(SCRIPT))

    def run(*args: str, stdin: str = "") -> str:
        return run_python(str(script), *args, stdin=stdin)

    k = 4
    state = run("save", str(k))
    assert json.loads(state) == {
        "version": 2,
        "seed": 17,
        "batch_size": 4,
        "epoch": 0,
        "iteration": k,
        "graph": build().state_dict()["graph"],
    }
    assert json.loads(run("load", str(k), stdin=state)) == full[k:]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_in_place_drops_iterations_in_flight(num_workers: int) -> None:
    with build(num_workers) as pipe:
        full = epochs(pipe, 2)
    with build(num_workers) as pipe:
        for _ in range(2):
            pipe.run()
        state = pipe.state_dict()
        pipe.run()  # one more, and some in flight: all forgotten
        pipe.load_state_dict(state)
        rest = [digest(o) for o in pipe]
        pipe.reset()
        rest += [digest(o) for o in pipe]
    assert rest == full[2:]


def test_state_of_a_later_epoch_and_before_build() -> None:
    with build(0) as pipe:
        full = epochs(pipe, 2)
        assert pipe.state_dict()["epoch"] == 1
    pipe = build(0)
    pipe.load_state_dict({**pipe.state_dict(), "epoch": 1, "iteration": 5})
    assert pipe.state_dict()["iteration"] == 5
    with pipe:
        assert [digest(o) for o in pipe] == full[6 + 5 :]


def test_bad_states_are_refused() -> None:
    pipe = build(0)
    with pytest.raises(ValueError, match="state_dict"):
        pipe.load_state_dict({"epoch": 0})
    good = pipe.state_dict()
    with pytest.raises(ValueError, match="seed=3"):
        pipe.load_state_dict({**good, "seed": 3})
    with pytest.raises(ValueError, match="ints >= 0"):
        pipe.load_state_dict({**good, "epoch": -1})

    @mpexec.pipeline_def(batch_size=4, num_workers=0, seed=17)
    def counting() -> Any:
        return fn.python_function(
            fn.external_source(source=noisy, batch=False), function=np.copy, stateful=True
        )

    stateful = counting()
    with pytest.raises(mpexec.MpexecError, match="stateful"):
        stateful.load_state_dict({**stateful.state_dict(), "iteration": 1})


def _other() -> mpexec.Pipeline:
    # The same seed and batch size as build(), another graph.
    @mpexec.pipeline_def(batch_size=4, num_workers=0, seed=17)
    def pipe() -> Any:
        x = fn.external_source(source=noisy, batch=False)
        return (fn.python_function(x, function=np.copy),)

    return pipe()  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "bad",
    [
        ["not", "a", "dict"],
        None,
        {"iteration": True},  # a bool is no iteration count
        {"epoch": 1.0},
        {"graph": "0" * 32},
        {"extra": 1},
        {"version": 1},
    ],
    ids=["list", "none", "bool", "float", "graph", "extra-key", "version-1"],
)
def test_only_a_state_of_this_definition_is_accepted(bad: Any) -> None:
    pipe = build(0)
    state = {**pipe.state_dict(), **bad} if isinstance(bad, dict) else bad
    with pytest.raises(ValueError, match="state"):
        pipe.load_state_dict(state)


def test_a_state_of_another_graph_is_refused_even_with_the_same_seed() -> None:
    with pytest.raises(ValueError, match="another pipeline definition"):
        _other().load_state_dict(build(0).state_dict())
    # The same definition, built again (or in another process): accepted.
    assert build(0).state_dict()["graph"] == build(2).state_dict()["graph"]
    build(0).load_state_dict(build(2).state_dict())


def _cycling(iteration: int) -> list[float]:
    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=1)
    def pipe() -> Any:
        return fn.external_source(source=[np.float64(i) for i in range(5)], batch=False, cycle=True)

    p = pipe()
    p.load_state_dict({**p.state_dict(), "iteration": iteration})
    with p:
        (out,) = p.run()
        return [float(x) for x in out]


def test_resuming_a_cycling_source_far_ahead_takes_bounded_time() -> None:
    # Iteration 10**15 of a 5-item cycle: 2 * 10**15 items to skip, read as
    # 2 * 10**15 mod 5 after one pass (an unbounded spin before).
    assert _cycling(3) == [1.0, 2.0]  # items 6 and 7: 1 and 2 of the second pass
    assert _cycling(10**15) == [0.0, 1.0]
    assert _cycling(10**15 + 1) == [2.0, 3.0]


# ---------------------------------------------------------------- what the fingerprint sees
def _scale(x: Any, factor: float = 1.0) -> Any:
    return x * factor


def _fingerprint(define: Any) -> str:
    """The graph fingerprint of a pipeline whose definition is ``define()`` (built twice: equal)."""

    def make() -> str:
        pipe = mpexec.Pipeline(batch_size=2, num_workers=0, seed=5)
        pipe.define(define)
        return str(pipe.state_dict()["graph"])

    first = make()
    assert make() == first, "one definition, two fingerprints"
    return first


def _files(tmp_path: Any) -> list[str]:
    paths = []
    for i in range(4):
        p = tmp_path / f"{i}.bin"
        p.write_bytes(bytes([i]))
        paths.append(str(p))
    return paths


def _reader(paths: list[str], **kw: Any) -> Any:
    return lambda: fn.readers.file(files=paths, name="R", **kw)[0]


def _counter(info: Any) -> Any:
    return np.full(2, info.idx_in_epoch)


@pytest.mark.parametrize(
    "what",
    [
        "shard_id",
        "file list",
        "random_shuffle",
        "arithmetic constant",
        "fn.constant value",
        "list source",
        "partial argument",
    ],
)
def test_a_state_does_not_load_across_graphs_that_differ_in_parameters(
    what: str, tmp_path: Any
) -> None:
    """Two graphs that differ only in a built-in op's parameter have two fingerprints."""
    paths = _files(tmp_path)
    x = lambda: fn.external_source(source=_counter, batch=False, name="x")  # noqa: E731
    pairs: dict[str, tuple[Any, Any]] = {
        "shard_id": (
            _reader(paths, num_shards=2, shard_id=0),
            _reader(paths, num_shards=2, shard_id=1),
        ),
        "file list": (_reader(paths), _reader([*paths[:3], paths[0]])),
        "random_shuffle": (_reader(paths), _reader(paths, random_shuffle=True)),
        "arithmetic constant": (lambda: x() * 2, lambda: x() * 3),
        "fn.constant value": (
            lambda: fn.constant(fdata=[1.0, 2.0]),
            lambda: fn.constant(fdata=[1.0, 3.0]),
        ),
        "list source": (
            lambda: fn.external_source(source=[np.zeros(2), np.ones(2)], batch=False),
            lambda: fn.external_source(source=[np.zeros(2), np.zeros(2)], batch=False),
        ),
        "partial argument": (
            lambda: fn.python_function(x(), function=functools.partial(_scale, factor=2.0)),
            lambda: fn.python_function(x(), function=functools.partial(_scale, factor=3.0)),
        ),
    }
    a, b = pairs[what]
    assert _fingerprint(a) != _fingerprint(b), f"graphs differing in {what} share a fingerprint"

    def pipe(define: Any) -> mpexec.Pipeline:
        p = mpexec.Pipeline(batch_size=2, num_workers=0, seed=5)
        p.define(define)
        return p

    with pytest.raises(ValueError, match="another pipeline definition"):
        pipe(b).load_state_dict(pipe(a).state_dict())


def test_a_user_function_is_seen_by_its_name_only() -> None:
    """What the docs say a fingerprint cannot see: a function's body or closure."""
    x = lambda: fn.external_source(source=_counter, batch=False, name="x")  # noqa: E731

    def closure(factor: float) -> Any:
        def _scale(v: Any) -> Any:  # the same qualified name, whatever factor is
            return v * factor

        return _scale

    one = _fingerprint(lambda: fn.python_function(x(), function=closure(2.0)))
    assert one == _fingerprint(lambda: fn.python_function(x(), function=closure(3.0)))
    assert one != _fingerprint(lambda: fn.python_function(x(), function=_scale))
