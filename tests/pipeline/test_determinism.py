"""Determinism matrix: with a seed, outputs are bit-identical across runs and across
``num_workers`` (0 = inline), ``prefetch_depth`` and start method (docs/design.md, "Determinism").

One pipeline holds every source of randomness a function may use: a per-sample source
in the workers (``np.random``), an op taking ``rng``, one using ``np.random``'s global
state, one using ``random``, one reading ``mpexec.sample_info()``, a batch op taking
``rng`` and an op with its own ``seed=``. Two epochs (``reset()`` between) of batch size 5
over 12 samples: 5, 5 and a short last batch of 2.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _gpu, fn
from mpexec.testing import SimCuPy

pytestmark = pytest.mark.usefixtures("no_leaks")

SEED = 1234
EPOCH = 12
BATCH = 5
OP_SEED = 777

#: The outputs of the pipeline, in order.
OUTPUTS = (
    "source",
    "rng",
    "rng_again",
    "np_random",
    "random",
    "sample_info",
    "batch_rng",
    "own_seed",
)
RANDOM_OUTPUTS = ("source", "rng", "rng_again", "np_random", "random", "batch_rng")


# ---------------------------------------------------------------- functions (module level)
def _source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= EPOCH:
        raise StopIteration
    noise = np.random.randint(0, 1 << 30, size=3)
    return np.concatenate([[info.idx_in_epoch, info.epoch_idx], noise]).astype(np.int64)


def _with_rng(x: np.ndarray[Any, Any], rng: np.random.Generator) -> np.ndarray[Any, Any]:
    return rng.standard_normal(4) + x[0]


def _with_np_random(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.random.random(4) + x[0]


def _with_random(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array([random.random() for _ in range(4)]) + x[0]


def _with_sample_info(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.array([*mpexec.sample_info(), *x[:2]], dtype=np.int64)


def _batch_with_rng(xs: list[Any], rng: np.random.Generator) -> list[Any]:
    info = mpexec.sample_info()
    return [
        np.concatenate([rng.integers(0, 1 << 30, size=3), [*info, len(xs)]]).astype(np.int64)
        for _ in xs
    ]


def params(
    num_workers: int, prefetch_depth: int, start_method: str | None, seed: int
) -> dict[str, Any]:
    """The pipeline parameters every pipeline of this matrix varies."""
    return {
        "batch_size": BATCH,
        "num_workers": num_workers,
        "prefetch_depth": prefetch_depth,
        "start_method": start_method,
        "seed": seed,
        "last_batch": "partial",  # mpexec's choice: the short last batch is compared too
    }


def make(
    num_workers: int | None,
    prefetch_depth: int = 1,
    start_method: str | None = None,
    seed: int = SEED,
    pool: Any = None,
) -> mpexec.Pipeline:
    """The pipeline; on ``pool`` when given (then ``num_workers`` is None: the pool's)."""

    @mpexec.pipeline_def(
        batch_size=BATCH,
        num_workers=num_workers,
        prefetch_depth=prefetch_depth,
        start_method=start_method,
        seed=seed,
        pool=pool,
        last_batch="partial",  # mpexec's choice: the short last batch is compared too
    )
    def graph() -> Any:
        src = fn.external_source(source=_source, batch=False, name="source")
        return (
            src,
            fn.python_function(src, function=_with_rng, name="rng"),
            fn.python_function(src, function=_with_rng, name="rng_again"),
            fn.python_function(src, function=_with_np_random, name="np_random"),
            fn.python_function(src, function=_with_random, name="random"),
            fn.python_function(src, function=_with_sample_info, name="sample_info"),
            fn.python_function(
                src, function=_batch_with_rng, batch_processing=True, name="batch_rng"
            ),
            fn.python_function(src, function=_with_rng, seed=OP_SEED, name="own_seed"),
        )

    return graph()


Run = list[list[list[np.ndarray[Any, Any]]]]  # [epoch*iteration][output][sample]


def run_two_epochs(pipe: mpexec.Pipeline) -> Run:
    """Every output of two epochs (reset between), copied out."""
    got: Run = []
    with pipe:
        for epoch in range(2):
            if epoch:
                pipe.reset()
            got.extend([[np.array(s, copy=True) for s in b] for b in outs] for outs in pipe)
    return got


def assert_identical(got: Run, want: Run, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} iterations, expected {len(want)}"
    for i, (g_outs, w_outs) in enumerate(zip(got, want, strict=True)):
        for name, g, w in zip(OUTPUTS, g_outs, w_outs, strict=True):
            assert len(g) == len(w), f"{what}: iteration {i}, {name}: batch sizes differ"
            for j, (a, b) in enumerate(zip(g, w, strict=True)):
                same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
                assert same, f"{what}: iteration {i}, output {name}, sample {j}: {a} != {b}"


@pytest.fixture(scope="module")
def reference() -> Run:
    """The inline (num_workers=0) outputs, computed once."""
    return run_two_epochs(make(0))


# ---------------------------------------------------------------- tests
def test_reference_shape(reference: Run) -> None:
    """Two epochs of 5, 5 and 2 samples, and the values are what they claim to be."""
    assert [len(outs[0]) for outs in reference] == [5, 5, 2, 5, 5, 2]
    for i, outs in enumerate(reference):
        epoch, iteration = divmod(i, 3)
        for j, info in enumerate(outs[OUTPUTS.index("sample_info")]):
            idx = iteration * BATCH + j
            assert info.tolist() == [idx, j, iteration, epoch, idx, epoch]
        for row in outs[OUTPUTS.index("batch_rng")]:
            assert row[3:].tolist() == [iteration, epoch, len(outs[0])]
    # randomness differs between samples, and between two ops with one function
    for outs in reference:
        for name in RANDOM_OUTPUTS:
            col = outs[OUTPUTS.index(name)]
            if name == "batch_rng":
                col = [c[:3] for c in col]
            elif name == "source":
                col = [c[2:] for c in col]
            assert len({c.tobytes() for c in col}) == len(col), f"{name}: samples repeat"
        rng, again = outs[OUTPUTS.index("rng")], outs[OUTPUTS.index("rng_again")]
        assert all(a.tobytes() != b.tobytes() for a, b in zip(rng, again, strict=True))


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize("prefetch_depth", [1, 3])
@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_bit_identical_across_workers_prefetch_and_start_method(
    reference: Run, num_workers: int, prefetch_depth: int, start_method: str
) -> None:
    got = run_two_epochs(make(num_workers, prefetch_depth, start_method))
    what = f"num_workers={num_workers}, prefetch_depth={prefetch_depth}, {start_method}"
    assert_identical(got, reference, what)


@pytest.mark.parametrize("num_workers", [2, 3])
def test_bit_identical_whatever_the_chunking(
    reference: Run, num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow ops are cut into several chunks per worker: outputs stay the same."""
    from mpexec import _mapping, _scheduler

    monkeypatch.setattr(_mapping, "AUTO_CHUNK_SECONDS", 1e-9)  # every op "slow": most chunks
    counts: list[int] = []
    chunk_count = _scheduler.Scheduler._chunk_count

    def spy(self: _scheduler.Scheduler, s: Any, size: int) -> int:
        counts.append(chunk_count(self, s, size))
        return counts[-1]

    monkeypatch.setattr(_scheduler.Scheduler, "_chunk_count", spy)
    got = run_two_epochs(make(num_workers, 2))
    assert_identical(got, reference, f"num_workers={num_workers}, 4 chunks per worker")
    assert max(counts) == min(BATCH, 4 * num_workers)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bit_identical_on_a_given_pool(reference: Run, num_workers: int) -> None:
    """``pool=``: a WorkerPool the pipeline does not own; it stays usable after."""
    with mpexec.WorkerPool(num_workers, seed=99) as pool:
        for prefetch_depth in (1, 3):
            pipe = make(None, prefetch_depth, pool=pool)
            assert pipe.num_workers == num_workers
            got = run_two_epochs(pipe)
            assert_identical(got, reference, f"given pool of {num_workers}, {prefetch_depth}")
        # The pipeline left the pool running, and its results still the caller's own.
        x = np.arange(5000.0)
        y = pool.submit(np.negative, x).result(timeout=60)
        assert y.flags.writeable
        np.testing.assert_array_equal(y, -x)


def test_given_pool_is_checked() -> None:
    with pytest.raises(TypeError, match=r"WorkerPool or an mpexec\.ray\.RayPool"):
        mpexec.Pipeline(batch_size=2, pool=object())  # type: ignore[arg-type]
    with mpexec.WorkerPool(0) as pool:
        with pytest.raises(ValueError, match="disagrees"):
            mpexec.Pipeline(batch_size=2, num_workers=3, pool=pool)
        with pytest.raises(ValueError, match="timeout belongs to the pool"):
            mpexec.Pipeline(batch_size=2, timeout=5.0, pool=pool)
        assert mpexec.Pipeline(batch_size=2, num_workers=0, pool=pool).num_workers == 0


def test_same_seed_same_outputs_other_seed_other_outputs(reference: Run) -> None:
    assert_identical(run_two_epochs(make(2, 2)), reference, "a second run, same seed")
    other = run_two_epochs(make(2, 2, seed=SEED + 1))
    assert len(other) == len(reference)
    for i, (o_outs, r_outs) in enumerate(zip(other, reference, strict=True)):
        for name, o, r in zip(OUTPUTS, o_outs, r_outs, strict=True):
            same = [a.tobytes() == b.tobytes() for a, b in zip(o, r, strict=True)]
            if name in RANDOM_OUTPUTS:
                assert not any(same), f"iteration {i}, {name}: the seed changed nothing"
            else:  # sample_info is not random; own_seed has its own seed
                assert all(same), f"iteration {i}, {name}: depends on the pipeline seed"


def test_op_seed_is_independent_of_the_pipeline_seed(reference: Run) -> None:
    """An op's explicit ``seed=`` alone decides its randomness."""
    k = OUTPUTS.index("own_seed")
    other = run_two_epochs(make(0, seed=SEED + 99))
    for o_outs, r_outs in zip(other, reference, strict=True):
        assert [a.tobytes() for a in o_outs[k]] == [b.tobytes() for b in r_outs[k]]
    # and it is not the stream the op would get without it
    rng = OUTPUTS.index("rng")
    assert [a.tobytes() for a in reference[0][k]] != [b.tobytes() for b in reference[0][rng]]


def test_seed_none_picks_a_seed_that_reruns_identically() -> None:
    """``seed=None`` picks one; rebuilding with ``pipe.seed`` gives the same outputs."""
    first = make(0, seed=None)  # type: ignore[arg-type]
    assert isinstance(first.seed, int)
    assert_identical(run_two_epochs(make(0, seed=first.seed)), run_two_epochs(first), "seed")


def test_call_seeds_depend_on_the_call_not_on_the_chunk() -> None:
    """A chunk's seeds, computed at once, are each call's own: chunking changes nothing."""
    from mpexec._runtime import call_seeds

    entropy = (1 << 127) + 12345
    whole = call_seeds(entropy, 2, 7, 1, 64)
    for k in range(64):
        one = call_seeds(entropy, 2, 7, 1 + k, 1)
        assert (whole[0][k], whole[1][k]) == (one[0][0], one[1][0])
    # Every part of the key matters, and the 64 calls' seeds are distinct.
    assert len(set(whole[0])) == len(set(whole[1])) == 64
    for other in (
        call_seeds(entropy + 1, 2, 7, 1, 64),
        call_seeds(entropy ^ (1 << 100), 2, 7, 1, 64),
        call_seeds(entropy, 3, 7, 1, 64),
        call_seeds(entropy, 2, 8, 1, 64),
    ):
        assert not set(other[1]) & set(whole[1])
    assert all(0 <= s < 1 << 32 for s in whole[0])
    assert all(0 <= s < 1 << 64 for s in whole[1])


def _gauss_once(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # One draw each: both generators cache the second value of a pair, which the
    # reseeding before the next call must clear.
    return np.array([random.gauss(0.0, 1.0), float(np.random.standard_normal())]) + x[0]


def test_cached_gaussians_do_not_leak_into_the_next_call() -> None:
    def run(num_workers: int) -> list[bytes]:
        @mpexec.pipeline_def(
            batch_size=BATCH, num_workers=num_workers, seed=SEED, last_batch="partial"
        )
        def graph() -> Any:
            src = fn.external_source(source=_source, batch=False)
            return fn.python_function(src, function=_gauss_once)

        with graph() as pipe:
            return [np.asarray(s).tobytes() for (out,) in pipe for s in out]

    inline = run(0)
    assert len(set(inline)) == len(inline) == EPOCH
    assert run(2) == inline


# ---------------------------------------------------------------- dense blocks and GPU ops
def _plus_rng(x: Any, rng: np.random.Generator) -> Any:
    noise = rng.standard_normal(x.shape[-1]).astype(np.float32)
    if isinstance(x, np.ndarray):
        return (x[:4] + noise).astype(np.float32)
    return x[:4] + _gpu.backend().asarray(noise)


def make_mixed(num_workers: int, prefetch_depth: int, start_method: str | None) -> mpexec.Pipeline:
    """Declared shapes (dense blocks from the first batch) into a GPU op and back to CPU."""

    @mpexec.pipeline_def(**params(num_workers, prefetch_depth, start_method, SEED))
    def graph() -> Any:
        src = fn.external_source(source=_source, batch=False, name="source")
        dense = fn.python_function(
            src,
            function=_with_rng,
            output_shapes=[(4,)],
            output_dtypes=[np.float64],
            name="dense",
        )
        gpu = fn.python_function(dense, function=_plus_rng, device="gpu", name="gpu")
        back = fn.python_function(gpu, function=_with_rng, name="back")
        batch = fn.python_function(
            back, function=_batch_with_rng, batch_processing=True, name="batch_rng"
        )
        return dense, gpu, back, batch

    return graph()


def run_mixed(num_workers: int, prefetch_depth: int, start_method: str | None) -> Run:
    with _gpu.use_backend(SimCuPy(1, progress=0.3)):
        got: Run = []
        with make_mixed(num_workers, prefetch_depth, start_method) as pipe:
            for epoch in range(2):
                if epoch:
                    pipe.reset()
                for outs in pipe:
                    got.append([[np.array(s, copy=True) for s in b.as_cpu()] for b in outs])
        return got


@pytest.mark.parametrize(
    ("num_workers", "prefetch_depth", "start_method"),
    [(1, 1, "spawn"), (2, 3, "spawn"), (2, 1, "forkserver"), (1, 3, "forkserver")],
)
def test_dense_blocks_and_gpu_ops_are_bit_identical_across_workers(
    num_workers: int, prefetch_depth: int, start_method: str
) -> None:
    want = run_mixed(0, 1, None)
    assert [len(outs[0]) for outs in want] == [5, 5, 2, 5, 5, 2]
    got = run_mixed(num_workers, prefetch_depth, start_method)
    what = f"GPU sim, num_workers={num_workers}, prefetch_depth={prefetch_depth}, {start_method}"
    assert len(got) == len(want), what
    for i, (g_outs, w_outs) in enumerate(zip(got, want, strict=True)):
        for k, (g, w) in enumerate(zip(g_outs, w_outs, strict=True)):
            assert [a.tobytes() for a in g] == [b.tobytes() for b in w], f"{what}: {i}, {k}"
