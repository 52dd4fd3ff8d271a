"""DALI's conditional execution (``enable_conditionals=True``): ``if`` on a DataNode.

Each branch's ops run only on the samples where its predicate holds, and the
variables the branches set are merged back in the batch's order. The first
part checks what mpexec does on its own; the last runs the same definitions in
real DALI (CPU only, skipped where ``nvidia-dali`` is absent) and compares.
"""

# The definitions below are about `if` statements on DataNodes: a conditional
# expression is not one (DALI does not rewrite those either), nor is `x != 2`
# the `not` being tested; a `return` in one branch is the error being tested.
# ruff: noqa: SIM108, SIM201, RET503, RET508

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn, types
from mpexec.pipeline import Pipeline, do_not_convert, pipeline_def

pytestmark = pytest.mark.usefixtures("no_leaks")


def _index(info: Any) -> np.ndarray[Any, Any]:
    return np.array(info.idx_in_batch, dtype=np.int32)


def _even(info: Any) -> np.ndarray[Any, Any]:
    return np.array(info.idx_in_batch % 2 == 0)


class _Log:
    """Appends ``tag value`` per call to a file (calls in any worker), returns ``x * factor``."""

    def __init__(self, path: Path, tag: str, factor: int = 1) -> None:
        self.path, self.tag, self.factor = str(path), tag, factor

    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        with open(self.path, "a") as f:
            f.write(f"{self.tag} {int(x)}\n")
        return np.asarray(x * self.factor, dtype=x.dtype)  # NumPy 1.x would widen a 0-d int32


_PREFETCH = 2  # the pipeline's default prefetch depth: iterations that may be cut short


def _logged(path: Path) -> dict[str, list[int]]:
    """Per tag, the values its calls saw, each once: every value about as often as the others.

    (Iterations run ahead of ``run()``: with the default prefetch depth of 2, up
    to two iterations are in flight when the pipeline closes, and each may have
    run in part — their chunks are cancelled as the pipeline closes, and which
    chunks ran first depends on the workers' timing. So counts differ by two at
    most.)
    """
    seen: dict[str, collections.Counter[int]] = {}
    for line in path.read_text().split("\n") if path.exists() else []:
        if line:
            tag, value = line.split()
            seen.setdefault(tag, collections.Counter())[int(value)] += 1
    for tag, counts in seen.items():
        many = counts.values()
        assert max(many) - min(many) <= _PREFETCH, f"{tag}: calls per value differ: {counts}"
    return {k: sorted(v) for k, v in seen.items()}


def _only_multiples_of_3(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if int(x) % 3:
        raise ValueError(f"saw sample {int(x)}, which its branch does not hold")
    return np.asarray(x * 10, dtype=x.dtype)  # NumPy 1.x would widen a 0-d int32


def _minus_one() -> np.ndarray[Any, Any]:
    return np.array(-1, dtype=np.int32)


def _where() -> np.ndarray[Any, Any]:
    info = mpexec.sample_info()
    assert isinstance(info, mpexec.SampleInfo)
    return np.array([info.idx_in_batch, info.idx_in_epoch], dtype=np.int64)


def values(batch: mpexec.Batch) -> list[Any]:
    return [np.asarray(a).tolist() for a in batch]


def run(definition: Any, batch_size: int = 8, iterations: int = 1, **params: Any) -> list[Any]:
    params.setdefault("num_workers", 0)
    params.setdefault("seed", 7)
    pipe = pipeline_def(definition, batch_size=batch_size, enable_conditionals=True, **params)()
    with pipe:
        out = [[values(b) for b in pipe.run()] for _ in range(iterations)]
    return out if iterations > 1 else out[0]


# ================================================================ what runs where


def test_each_branch_runs_on_its_samples_and_the_results_merge_in_order() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x % 3 == 0:
            y = fn.python_function(x, function=_only_multiples_of_3)
            z = fn.python_function(function=_minus_one)  # no inputs: one per sample here
        elif x > 4:
            y = x + 100
            z = x
        else:
            y = x
            z = x * 0
        return y, z

    for workers in (0, 2):
        y, z = run(graph, num_workers=workers)
        assert y == [0, 1, 2, 30, 4, 105, 60, 107]
        assert z == [-1, 0, 0, -1, 0, 5, -1, 7]


def _epoch_index(info: Any) -> np.ndarray[Any, Any]:
    return np.array(info.idx_in_epoch, dtype=np.int32)


def test_a_branchs_function_is_called_on_that_branchs_samples_only(tmp_path: Path) -> None:
    log = tmp_path / "calls"

    def graph() -> Any:
        x = fn.external_source(source=_epoch_index, batch=False)
        if x % 6 < 3:
            y = fn.python_function(x, function=_Log(log, "if", 2), reseed="always")
            c = fn.python_function(function=_minus_one, reseed="always")
        else:
            y = fn.python_function(x, function=_Log(log, "else", 3), reseed="always")
            c = x
        return y, c

    y, c = run(graph, batch_size=6, num_workers=2, iterations=2)[1]
    assert y == [12, 14, 16, 27, 30, 33]
    assert c == [-1, -1, -1, 9, 10, 11]
    calls: dict[str, collections.Counter[int]] = {
        "if": collections.Counter(),
        "else": collections.Counter(),
    }
    for line in log.read_text().splitlines():
        tag, value = line.split()
        calls[tag][int(value)] += 1
    # Each function saw its own samples only, each once. Iterations prefetched past
    # the two consumed may have run in part when the pipeline closed: at most once.
    assert all(v % 6 < 3 for v in calls["if"]), calls
    assert all(v % 6 >= 3 for v in calls["else"]), calls
    assert all(n == 1 for counts in calls.values() for n in counts.values()), calls
    assert sorted(v for counts in calls.values() for v in counts if v < 12) == list(range(12))


def _image(info: Any) -> np.ndarray[Any, Any]:
    return np.full((64, 64, 4), info.idx_in_batch, np.float32)  # 64 KiB: never inlined


def _plus_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + 1


def test_a_branchs_samples_reach_the_workers_uncopied() -> None:
    def graph() -> Any:
        img = fn.external_source(source=_image, batch=False)
        first = fn.python_function(img, function=_plus_one)  # in the workers' memory
        if fn.external_source(source=_even, batch=False):
            out = fn.python_function(first, function=_plus_one)
        else:
            out = fn.python_function(first, function=_double)
        return out

    pipe = pipeline_def(graph, batch_size=6, num_workers=2, seed=1, enable_conditionals=True)()
    with pipe:
        for _ in range(3):
            (out,) = pipe.run()
            assert [float(a[0, 0, 0]) for a in out] == [2, 4, 4, 8, 6, 12]
        stats = pipe.stats()
    assert sum(op.bytes_copied for op in stats.ops) == 0, stats


def test_an_op_in_a_branch_knows_its_samples_place_in_the_batch() -> None:
    def graph() -> Any:
        p = fn.external_source(source=_even, batch=False)
        if p:
            w = fn.python_function(function=_where)
        else:
            w = fn.python_function(function=_where) * 0 - 1
        return (w,)

    (w,) = run(graph, batch_size=5, iterations=2)[1]
    assert w == [[0, 5], [-1, -1], [2, 7], [-1, -1], [4, 9]]


def _noisy(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return (x + rng.integers(0, 1_000_000)).astype(x.dtype)


def test_randomness_in_a_branch_is_the_samples_own_and_deterministic() -> None:
    def split() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x % 2 == 0:
            y = fn.python_function(x, function=_noisy, seed=5)
        else:
            y = x * 0 - 1
        return (y,)

    def whole() -> Any:
        x = fn.external_source(source=_index, batch=False)
        return (fn.python_function(x, function=_noisy, seed=5),)

    (got,) = run(split, num_workers=2)
    assert run(split, num_workers=0) == [got]
    (unsplit,) = run(whole)
    # A sample draws in a branch what it draws unsplit (seeds follow its batch index).
    assert got[0::2] == unsplit[0::2]
    assert got[1::2] == [-1] * 4


def test_nested_ifs_and_values_read_from_enclosing_scopes() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        base = x * 1000
        if x > 2:
            if x > 5:
                y = x * 100 + base
            else:
                y = x * 10
        elif x == 0:
            y = x - 1
        else:
            y = base
        return y

    assert run(graph) == [[-1, 1000, 2000, 30, 40, 50, 6600, 7700]]


# ================================================================ empty branches


def _batch_log(path: Path) -> Any:
    def f(xs: list[Any]) -> list[Any]:
        with open(path, "a") as out:
            out.write(f"batch {len(xs)}\n")
        return [x + 1 for x in xs]

    return f


@pytest.mark.parametrize("threshold", [-1, 100], ids=["all-true", "all-false"])
def test_a_branch_no_sample_takes(tmp_path: Path, threshold: int) -> None:
    log = tmp_path / "calls"

    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > threshold:
            y = fn.python_function(x, function=_Log(log, "if"), reseed="always")
        else:
            y = fn.python_function(x, function=_Log(log, "else"), stateful=True)
            y = fn.python_function(y, function=_batch_log(log), batch_processing=True)
        return y

    for workers in (0, 2):
        log.unlink(missing_ok=True)
        got = run(graph, batch_size=4, iterations=2, num_workers=workers)
        if threshold < 0:
            assert got == [[[0, 1, 2, 3]]] * 2
            assert _logged(log) == {"if": [0, 1, 2, 3]}
        else:
            assert got == [[[1, 2, 3, 4]]] * 2
            assert _logged(log) == {"else": [0, 1, 2, 3], "batch": [4]}


# ================================================================ Python values, and/or/not


def test_if_on_python_values_keeps_pythons_meaning() -> None:
    def graph(flag: bool = True) -> Any:
        x = fn.external_source(source=_index, batch=False)
        total = 0
        for i in range(5):
            if i == 3:
                break
            elif i % 2:
                continue
            total += i
        if flag and total == 2:
            y = x + total
        else:
            y = x
        if x > 1:  # a DataNode: the Python `if`s inside it keep their meaning too
            if not flag:
                y = y * 0
            elif total in (1, 2):
                y = y + 100
        return y

    assert run(graph, batch_size=3) == [[2, 3, 104]]


def test_and_or_not_on_dataNodes_compute_the_right_side_where_needed(tmp_path: Path) -> None:
    log = tmp_path / "calls"

    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        a = (x > 0) and fn.python_function(x, function=_Log(log, "and"), reseed="always") < 3
        b = (x < 1) or (x > 2)
        c = not (x > 1)
        if (x > 0) and not (x == 2):
            d = x
        else:
            d = x * 0 - 1
        return a, b, c, d

    a, b, c, d = run(graph, batch_size=4)
    assert a == [False, True, True, False]
    assert b == [True, False, False, True]
    assert c == [True, True, False, False]
    assert d == [-1, 1, -1, 3]
    # The right side of `and` ran where the left side held: samples 1..3, not 0.
    assert _logged(log) == {"and": [1, 2, 3]}


def _helper(x: Any) -> Any:
    if x > 1:
        return x * 2
    return x


@do_not_convert
def _unconverted(x: Any) -> Any:
    if x > 1:
        return x * 2
    return x


def test_functions_the_definition_calls_are_converted_unless_told_not() -> None:
    def graph() -> Any:
        return _helper(fn.external_source(source=_index, batch=False))

    assert run(graph, batch_size=4) == [[0, 1, 4, 6]]

    def refused() -> Any:
        return _unconverted(fn.external_source(source=_index, batch=False))

    with pytest.raises(TypeError, match="not rewritten"):
        run(refused)


class _Legacy(Pipeline):
    def define_graph(self) -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            x = x + 10
        return x


def test_pipeline_with_define_graph_takes_enable_conditionals() -> None:
    with _Legacy(4, num_workers=0, enable_conditionals=True) as pipe:
        (out,) = pipe.run()
    assert values(out) == [0, 1, 12, 13]
    with pytest.raises(TypeError, match="enable_conditionals=True"):
        _Legacy(4, num_workers=0).build()


def test_branch_values_of_python_numbers_become_constants() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y, scale = x, 2
            nothing = None
        else:
            y, scale = x * 0, types.Constant(5)
            nothing = None
        assert nothing is None
        return y, scale

    y, scale = run(graph, batch_size=4)
    assert y == [0, 0, 2, 3]
    assert scale == [5, 5, 2, 2]

    def strings() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            mode = "a"
        else:
            mode = "b"
        return x, mode

    with pytest.raises(TypeError, match="variable 'mode' is set in a branch"):
        run(strings)


def test_a_serialized_pipeline_with_conditionals_gives_the_same_batches() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x % 2 == 0:
            y = fn.python_function(x, function=_noisy, seed=3)
        else:
            y = x
        return y

    pipe = pipeline_def(graph, batch_size=4, num_workers=0, seed=1, enable_conditionals=True)()
    with pipe:
        want = values(pipe.run()[0])
    with Pipeline.deserialize(pipe.serialize()) as again:
        assert values(again.run()[0]) == want


# ================================================================ what is refused


def test_a_variable_set_in_one_branch_and_used_after_is_an_error() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y = x + 1
        return y  # set in one branch only: the point of the test

    with pytest.raises(mpexec.ConditionalError, match="'y' must also be initialized in the `else`"):
        run(graph)


def test_a_variable_set_in_one_branch_and_not_used_after_is_fine() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            tmp = x + 1
            x = tmp * 2
        return x

    assert run(graph, batch_size=4) == [[0, 1, 6, 8]]


def test_a_return_in_one_branch_only_is_an_error() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            return x + 10

    with pytest.raises(mpexec.ConditionalError, match=r"else. branch must also have a return"):
        run(graph)

    def both() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            return x + 10
        return x

    assert run(both, batch_size=4) == [[0, 1, 12, 13]]


def test_branches_of_different_structure_or_dtype_are_errors() -> None:
    def structure() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y = (x, x)
        else:
            y = x
        return y

    with pytest.raises(mpexec.ConditionalError, match="Divergent data"):
        run(structure)

    def dtype() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y = x / 2
        else:
            y = x
        return y

    with pytest.raises(mpexec.ConditionalError, match="float32 of rank 0 in the `if` branch"):
        run(dtype)


def _pair(info: Any) -> np.ndarray[Any, Any]:
    return np.array([True, False])


def test_a_predicate_is_a_scalar_number_and_and_or_take_bools() -> None:
    def numbers() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x:  # DALI takes any scalar: true where nonzero
            y = x * 10
        else:
            y = x - 1
        return y, not x

    assert run(numbers, batch_size=3) == [[-1, 10, 20], [True, False, False]]

    def vector() -> Any:
        p = fn.external_source(source=_pair, batch=False)
        if p:
            y = p
        else:
            y = p
        return y

    with pytest.raises(mpexec.ConditionalError, match=r"restricted to scalar .* Got a 1-d input"):
        run(vector)

    def negated() -> Any:
        return not fn.external_source(source=_pair, batch=False)

    with pytest.raises(mpexec.ConditionalError, match="Logical expression `not`"):
        run(negated)

    def left() -> Any:
        x = fn.external_source(source=_index, batch=False)
        return x and (x > 1)

    with pytest.raises(mpexec.ConditionalError, match="type `int32` as the left argument"):
        run(left)

    def right() -> Any:
        x = fn.external_source(source=_index, batch=False)
        return (x > 1) or x

    with pytest.raises(mpexec.ConditionalError, match="type `int32` as the right argument"):
        run(right)


def test_branches_must_give_one_layout() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False, layout="A")
        if x > 1:
            y = fn.python_function(x, function=_double)  # no layout: "" in DALI
        else:
            y = x
        return y

    with pytest.raises(mpexec.ConditionalError, match='distinct layouts: "" and "A"'):
        run(graph)


def test_a_value_made_in_a_branch_cannot_escape_it() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        made = []
        if x > 1:
            made.append(x + 1)
            y = x
        else:
            y = x
        return y, made[0]

    with pytest.raises(mpexec.ConditionalError, match="made inside a branch"):
        run(graph)

    def used() -> Any:
        x = fn.external_source(source=_index, batch=False)
        made = []
        if x > 1:
            made.append(x + 1)
            y = x
        else:
            y = x
        return y + made[0]

    with pytest.raises(mpexec.ConditionalError, match="made inside a branch"):
        run(used)


def test_without_enable_conditionals_an_if_says_how_to_get_one() -> None:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            x = x + 1
        return x

    with pytest.raises(TypeError, match="enable_conditionals=True"):
        pipeline_def(graph, batch_size=2, num_workers=0)()


def _double(x: Any) -> Any:
    return x * 2


def test_gpu_ops_run_around_ifs_not_inside_branches() -> None:
    from mpexec.testing import SEEDS, simulated

    def inside() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y = fn.python_function(x, function=_double, device="gpu")
        else:
            y = x
        return y

    def split_in() -> Any:
        x = fn.external_source(source=_index, batch=False)
        g = fn.python_function(x, function=_double, device="gpu")
        if x > 1:
            y = fn.python_function(g, function=_double)
        else:
            y = x
        return y

    def after() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            y = x + 10
        else:
            y = x
        return fn.python_function(y, function=_double, device="gpu")

    with simulated(*SEEDS[0]):
        with pytest.raises(mpexec.ConditionalError, match="GPU op inside a branch"):
            run(inside, device_id=0)
        with pytest.raises(mpexec.ConditionalError, match="GPU op's output used inside"):
            run(split_in, device_id=0)
        pipe = pipeline_def(after, batch_size=4, num_workers=0, enable_conditionals=True)(
            device_id=0
        )
        with pipe:
            (out,) = pipe.run()
            assert [int(a) for a in out.as_cpu()] == [0, 2, 24, 26]


# ================================================================ against real DALI


def _dali() -> Any:
    return pytest.importorskip("nvidia.dali")


def _dali_values(definition: Any, batch_size: int) -> list[Any]:
    from nvidia.dali import pipeline_def as dali_pipeline_def

    pipe = dali_pipeline_def(
        definition,
        batch_size=batch_size,
        num_threads=1,
        device_id=None,
        exec_async=False,
        exec_pipelined=False,
        enable_conditionals=True,
    )()
    pipe.build()
    outs = pipe.run()
    got = [[_typed(np.array(o.at(j))) for j in range(len(o))] for o in outs]
    del pipe
    return got


def _typed(a: Any) -> tuple[Any, str]:
    return np.asarray(a).tolist(), str(np.asarray(a).dtype)


def _ours(definition: Any, batch_size: int) -> list[Any]:
    pipe = pipeline_def(
        definition, batch_size=batch_size, num_workers=1, seed=1, enable_conditionals=True
    )()
    with pipe:
        return [[_typed(a) for a in b] for b in pipe.run()]


def _nested(fn: Any) -> Any:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        p = fn.external_source(source=_even, batch=False)
        if x > 2:
            if p:
                y = x * 100
                z = fn.python_function(x, function=_only_even_triple)
            else:
                y = x * 10
                z = x
        elif x == 0:
            y = x - 1
            z = fn.python_function(function=_minus_one)
        else:
            y = x
            z = x + 7
        a = (x > 1) and p
        b = not p or (x == 1)
        return y, z, a, b

    return graph


def _only_even_triple(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    assert int(x) % 2 == 0, int(x)
    assert int(x) > 2, int(x)
    return np.asarray(x * 3)  # (DALI takes arrays, not the NumPy scalar x * 3 is)


def _dalis_test(fn: Any, types: Any) -> Any:
    """The pipeline of DALI's own test_python_function_conditionals, made to return values."""

    def graph() -> Any:
        predicate = fn.external_source(
            source=lambda sample_info: np.array(sample_info.idx_in_batch < 4), batch=False
        )
        if predicate:
            out1, out2 = fn.python_function(
                predicate, num_outputs=2, function=lambda _: (np.array(42), np.array(10))
            )
        else:
            out1 = fn.python_function(function=lambda: np.array(0))
            out2 = types.Constant(np.array(0), device="cpu", dtype=types.INT64)
        return out1, out2

    return graph


def _python_values(fn: Any) -> Any:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 1:
            a, b, c, d = 1, 1.5, np.array(2), True
        else:
            a, b, c, d = 2, 2.5, np.array(3), False
        if x:
            e = x * 10
        else:
            e = x - 1
        return a, b, c, d, e, not x, _returns(x)

    return graph


def _returns(x: Any) -> Any:
    if x > 1:
        return x + 10
    return x


def _empty_branch(fn: Any) -> Any:
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x < 0:
            y = fn.python_function(x, function=_only_multiples_of_3)
        else:
            y = x + 1
        return y

    return graph


@pytest.mark.parametrize(
    ("make", "batch_size"),
    [(_nested, 8), (_dalis_test, 8), (_empty_branch, 4), (_python_values, 4)],
    ids=["nested-and-logic", "dalis-own-test", "empty-branch", "python-values"],
)
def test_outputs_equal_dalis(make: Any, batch_size: int) -> None:
    _dali()
    import nvidia.dali.fn as dali_fn
    import nvidia.dali.types as dali_types

    args = (fn, types) if make is _dalis_test else (fn,)
    dali_args = (dali_fn, dali_types) if make is _dalis_test else (dali_fn,)
    ours = _ours(make(*args), batch_size)
    theirs = _dali_values(make(*dali_args), batch_size)
    assert ours == theirs  # values and dtypes


def test_dali_refuses_what_we_refuse() -> None:
    _dali()
    import nvidia.dali.fn as dali_fn

    def one_branch(fn: Any) -> Any:
        def graph() -> Any:
            x = fn.external_source(source=_index, batch=False)
            if x > 1:
                y = x + 1
            return y  # set in one branch only

        return graph

    with pytest.raises(RuntimeError, match="'y' must also be initialized in the `else` branch"):
        _dali_values(one_branch(dali_fn), 2)
    with pytest.raises(RuntimeError, match="'y' must also be initialized in the `else` branch"):
        run(one_branch(fn), batch_size=2)


def test_python_function_runs_in_a_worker_process() -> None:
    # (So the side-effect tests above saw calls in workers, not here.)
    def graph() -> Any:
        x = fn.external_source(source=_index, batch=False)
        if x > 0:
            y = fn.python_function(x, function=_pid)
        else:
            y = fn.python_function(x, function=_pid)
        return y

    (pids,) = run(graph, batch_size=2, num_workers=1)
    assert os.getpid() not in pids


def _pid(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array(os.getpid())
