"""``mpexec.dali``: mpexec behind DALI's python_function, and as DALI's source.

The first half calls the objects as DALI would (lists of arrays in, lists
out; an iterable read batch by batch), with no DALI installed. The second half
runs them inside real DALI pipelines (``nvidia-dali``, CPU only: tox's ``dali``
environment) and checks mpexec's DALI names against the real package.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import mpexec
import mpexec.dali
import mpexec.fn as mfn
import mpexec.types as mtypes

pytestmark = pytest.mark.usefixtures("no_leaks")


def _work(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2 + 1


def _pid_and_sum(x: np.ndarray[Any, Any], y: np.ndarray[Any, Any]) -> tuple[Any, Any]:
    return np.array([os.getpid()]), np.array([x.sum() + y.sum()])


def _batch_sum(xs: list[Any]) -> list[Any]:
    assert isinstance(xs, list)
    return [x.sum(keepdims=True) for x in xs]


def _fails(x: np.ndarray[Any, Any]) -> Any:
    raise KeyError(f"no key for {x.shape}")


def _back_to_back(n: int, shape: tuple[int, ...]) -> list[np.ndarray[Any, Any]]:
    """Samples as DALI hands them: views of one buffer, back to back."""
    buffer = np.arange(n * int(np.prod(shape)), dtype=np.float32).reshape(n, *shape)
    return list(buffer)


# ================================================================ without DALI


def test_python_function_spreads_a_batch_over_the_workers() -> None:
    batch = _back_to_back(12, (4, 5))
    others = [np.full((2,), i, np.int16) for i in range(12)]
    with mpexec.dali.python_function(_pid_and_sum, num_workers=2, num_outputs=2) as spread:
        for _ in range(3):
            pids, sums = spread(batch, others)
            assert [s.tolist() for s in sums] == [
                [float(x.sum()) + float(y.sum())] for x, y in zip(batch, others, strict=True)
            ]
        assert {int(p[0]) for p in pids} - {os.getpid()}, "computed in the workers"
        assert spread.pool.stats().bytes_copied == 0, "the batch went as one shared block"


def test_python_function_takes_ragged_batches_and_batch_functions() -> None:
    ragged = [np.ones((i + 1, 3), np.uint8) for i in range(5)]
    with mpexec.dali.python_function(_work, num_workers=1) as spread:
        out = spread(ragged)
        assert [o.tolist() for o in out] == [_work(x).tolist() for x in ragged]
        assert spread([]) == []
    with mpexec.dali.python_function(_batch_sum, num_workers=2, batch_processing=True) as spread:
        out = spread(_back_to_back(7, (3,)))
        assert [float(o[0]) for o in out] == [float(x.sum()) for x in _back_to_back(7, (3,))]


def test_python_function_outputs_fill_a_block_and_fall_back_when_ragged() -> None:
    uniform = _back_to_back(6, (4, 3))
    ragged = [np.ones((i + 1, 3), np.float32) for i in range(6)]
    with mpexec.dali.python_function(_work, num_workers=2) as spread:
        for batch in (uniform, uniform, ragged, uniform):  # learns the shape, then blocks
            out = spread(batch)
            assert [o.tolist() for o in out] == [_work(x).tolist() for x in batch]
        first = spread(uniform)
        assert all(np.shares_memory(first[0].base, o) for o in first), "one block's rows"


def _half_fails(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] < 0:
        raise KeyError("negative")
    return x * 2 + 1


def test_python_function_takes_the_last_batchs_blocks_again_when_nothing_holds_them() -> None:
    # DALI copies what the function returns and lets it go before its next call: the
    # next batch of that shape writes the same shared blocks, input and output, instead
    # of allocating two and freeing two (the arena's collection of the last batch's
    # fell on the first allocation, before any worker had work).
    batch = _back_to_back(8, (3,))
    with mpexec.dali.python_function(_half_fails, num_workers=2) as spread:
        spread(batch)
        spread(batch)  # learns the output's shape: from here on, blocks
        allocated: list[tuple[int, ...]] = []
        real = spread.pool.empty

        def counted(shape: Any, dtype: Any = np.float64) -> Any:
            allocated.append(shape)
            return real(shape, dtype)

        spread.pool.empty = counted  # type: ignore[method-assign]
        for k in range(3):
            out = spread([x + k for x in batch])
            assert np.array_equal(np.stack(out), (np.stack(batch) + k) * 2 + 1)
            del out
        assert allocated == []
        # Rows a caller keeps are never written over: that block is not taken again.
        kept = spread(batch)
        again = spread([x + 1 for x in batch])
        assert np.array_equal(np.stack(kept), np.stack(batch) * 2 + 1)
        assert np.array_equal(np.stack(again), (np.stack(batch) + 1) * 2 + 1)
        assert allocated == [(8, 3)]
        del kept, again
        # After a failed batch (a chunk may still be running), nothing is offered.
        allocated.clear()
        with pytest.raises(KeyError, match="negative"):
            spread([-x - 1 for x in batch])
        out = spread(batch)
        assert np.array_equal(np.stack(out), np.stack(batch) * 2 + 1)
        assert allocated == [(8, 3), (8, 3)]  # the failed batch took the last ones


def test_python_function_errors_keep_their_type() -> None:
    with mpexec.dali.python_function(_fails, num_workers=1) as spread:
        with pytest.raises(KeyError, match="no key for"):
            spread([np.zeros(3)])
        with pytest.raises(ValueError, match="different sizes"):
            spread([np.zeros(3)], [])


def test_python_function_on_a_given_pool_leaves_it_running() -> None:
    with mpexec.WorkerPool(1) as pool:
        spread = mpexec.dali.python_function(_work, pool=pool)
        assert spread([np.zeros(2)])[0].tolist() == [1.0, 1.0]
        spread.close()
        assert pool.submit(abs, -1).result(30) == 1


def _indexed(info: Any) -> np.ndarray[Any, Any]:
    return np.full((2, 2), info.idx_in_epoch, np.float32)


def _source_pipe(n: int) -> mpexec.Pipeline:
    @mpexec.pipeline_def(batch_size=4, num_workers=1, seed=11)
    def graph() -> Any:
        # cycle="raise": each epoch reads the list again (without: one pass, as DALI).
        samples = [_indexed(_Info(i)) for i in range(n)]
        x = mfn.external_source(source=samples, batch=False, cycle="raise")
        return x, x * 2

    return graph()


class _Info:
    def __init__(self, i: int) -> None:
        self.idx_in_epoch = i


def test_python_function_runner_loads_no_caller_side_module_in_a_worker() -> None:
    """A worker that unpickles the chunk runner imports the worker side only: not the
    pool, the pipeline or the scheduler (which ``mpexec.dali`` itself imports)."""
    import ast
    import pickle
    import subprocess
    import sys

    import cloudpickle

    # np.negative pickles by reference, as numpy's: the child imports nothing of the test.
    runner = cloudpickle.dumps(mpexec.dali.python_function(np.negative)._runner)
    code = (
        "import pickle, sys; runner = pickle.loads(sys.stdin.buffer.read()); "
        "print(sorted(m for m in sys.modules if m.startswith('mpexec')))"
    )
    root = str(Path(mpexec.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=runner,
        capture_output=True,
        check=True,
        env=env,
        timeout=60,
    )
    loaded = set(ast.literal_eval(out.stdout.decode()))
    assert "mpexec._dali_runner" in loaded
    assert not loaded & {"mpexec.dali", "mpexec._pool", "mpexec._pipeline", "mpexec._scheduler"}
    assert pickle.loads(runner)(*[[np.ones(2)]])[1][0][0].tolist() == [-1.0, -1.0]


def test_python_function_chunks_follow_maps_chunk_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows per chunk come from the one chunk policy (``calls_in_chunk``), with its
    target for a batch waited for alone: about BALANCE_CHUNK_SECONDS of CPU a
    chunk, 3 to 4 chunks a worker, or one where the cut would all go out at once."""
    import mpexec._mapping as mapping
    from mpexec.dali import _chunks

    assert _chunks(0, 4, 0.0) == [(0, 0)]
    assert len(_chunks(64, 4, 0.0)) == 4  # nothing measured yet: one a worker
    assert len(_chunks(64, 4, 1e-6)) == 4  # quick samples: one a worker
    assert len(_chunks(64, 4, 0.01)) == 16  # slow samples: a shorter tail, 4 a worker
    bounds = _chunks(64, 4, 0.00375)  # 0.02 s a chunk: 5 samples, 3 chunks a worker
    assert len(bounds) == 12
    assert (bounds[0][0], bounds[-1][1]) == (0, 64)
    monkeypatch.setattr(mapping, "BALANCE_CHUNK_SECONDS", 0.0375)  # 10 a chunk: 2 a worker
    assert len(_chunks(64, 4, 0.00375)) == 4  # ... which would all go at once: 1 a worker


def test_python_function_sends_one_chunk_a_worker_where_all_would_go_at_once() -> None:
    # Two chunks a worker all go out together (the in-flight window), placed before
    # any worker has shown itself slower: the finer cut rebalances nothing, and each
    # chunk costs a send, a result and a wake-up (the benchmark's batch of 16 at
    # ~4 ms a sample, 2 workers: 4 chunks before, 2 now).
    from mpexec.dali import _chunks

    assert _chunks(64, 4, 0.002) == [(0, 16), (16, 32), (32, 48), (48, 64)]  # 2 a worker
    assert _chunks(16, 2, 0.004) == [(0, 8), (8, 16)]
    assert len(_chunks(16, 2, 0.008)) == 8  # 4 a worker: the last 4 go as chunks come back


class _RecordingPool:
    """A pool that runs each call at once, and notes what the first input held then."""

    num_workers = 2

    def __init__(self) -> None:
        self.seen: list[np.ndarray[Any, Any]] = []
        self.first: np.ndarray[Any, Any] | None = None

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
        block = np.zeros(shape, dtype)
        if self.first is None:
            self.first = block
        return block

    def submit(self, fn: Any, *args: Any, out: tuple[Any, ...] = ()) -> Future[Any]:
        assert self.first is not None
        self.seen.append(self.first.copy())
        done: Future[Any] = Future()
        done.set_result(fn(*args, out=tuple(None if o is None else o.array for o in out)))
        return done


def _slow_last_row(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] >= 21:  # the batch's last row (see below): its chunk comes back well after
        time.sleep(0.3)
    return x * 2 + 1


def test_python_function_wakes_its_caller_once_every_chunk_is_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Once every chunk is out (2 workers: a batch is 2 or 4 chunks, all sent at
    # once), DALI's thread sleeps until all are back, or one fails: it used to wake
    # for each chunk that came back, with nothing more to send.
    waits: list[str] = []
    real = mpexec.dali.wait

    def counted(fs: Any, timeout: Any = None, return_when: str = "ALL_COMPLETED") -> Any:
        waits.append(return_when)
        return real(fs, timeout, return_when)

    monkeypatch.setattr(mpexec.dali, "wait", counted)
    batch = _back_to_back(8, (3,))
    with mpexec.dali.python_function(_slow_last_row, num_workers=2) as spread:
        got = spread(batch)  # nothing timed yet: one chunk a worker
    assert np.array_equal(np.stack(got), np.stack(batch) * 2 + 1)
    assert waits == ["FIRST_EXCEPTION"]


@pytest.mark.parametrize("adjacent", [True, False])
def test_python_function_copies_each_chunk_in_as_it_goes(adjacent: bool) -> None:
    # The first chunk goes to a worker once its own rows are in shared memory,
    # not the whole batch's (the copy of the rest overlaps the first chunks' work).
    batch = np.arange(1, 9, dtype=np.float32).repeat(3).reshape(8, 3)
    samples = list(batch) if adjacent else [np.array(x) for x in batch]
    pool = _RecordingPool()
    spread = mpexec.dali.python_function(_work, pool=pool)  # type: ignore[arg-type]
    got = spread(samples)
    assert np.array_equal(np.stack(got), _work(batch))
    first = pool.seen[0]
    assert np.array_equal(first[:4], batch[:4])  # 2 chunks: the first one's rows, only
    assert not first[4:].any()
    assert np.array_equal(pool.seen[1], batch)


def test_python_function_learns_nothing_from_a_batch_written_whole_into_its_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first batch sets the output block's shape (learned from its samples); a batch
    # whose every row was written into that block hands DALI the block's rows as they
    # are: checking their shapes and dtypes again, a sample at a time, learns nothing.
    learned: list[int] = []
    real = mpexec.dali.DaliFunction._learn

    def counted(self: Any, i: int, col: list[Any]) -> None:
        learned.append(len(col))
        real(self, i, col)

    monkeypatch.setattr(mpexec.dali.DaliFunction, "_learn", counted)
    spread = mpexec.dali.python_function(_work, pool=_RecordingPool())  # type: ignore[arg-type]
    for k in range(3):
        batch = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) + k
        assert np.array_equal(np.stack(spread(list(batch))), _work(batch))
    assert learned == [8]


class _Blocks:
    """The pool's ``empty``, alone (what :class:`mpexec.dali._SharedRows` asks of it)."""

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
        return np.zeros(shape, dtype)


def test_python_function_copies_a_dense_batch_in_with_no_python_call_a_sample() -> None:
    # The calling thread's copy of a batch into shared memory, before any worker has
    # work: DALI's thread runs it on cold code after DALI's own steps. It checked that
    # DALI's views lay back to back through ndarray.ctypes, two Python calls a sample.
    from mpexec.dali import _SharedRows

    calls = {}
    for n in (4, 32):
        samples = _back_to_back(n, (5, 3))
        seen = [0]

        def count(frame: Any, event: str, arg: Any, seen: list[int] = seen) -> None:
            if event == "call" and frame.f_code.co_name != "<genexpr>":
                seen[0] += 1

        sys.setprofile(count)
        try:
            rows = _SharedRows(_Blocks(), samples)  # type: ignore[arg-type]
            got = [rows.rows(0, n // 2), rows.rows(n // 2, n)]
        finally:
            sys.setprofile(None)
        assert np.array_equal(np.concatenate(got), np.stack(samples))
        calls[n] = seen[0]
    assert calls[32] == calls[4]


@pytest.mark.parametrize(
    "samples",
    [
        [np.array(float(i)) for i in range(5)],  # one value each
        [np.zeros((3, 0), np.int16) for _ in range(4)],  # empty samples
        list(np.arange(60, dtype=np.int32).reshape(5, 4, 3)[:, ::2]),  # strided views
        list(np.arange(60, dtype=np.uint8).reshape(3, 4, 5).transpose(0, 2, 1)),  # F-order
    ],
    ids=["scalars", "empty", "strided", "transposed"],
)
def test_python_function_copies_in_samples_of_any_layout(samples: list[Any]) -> None:
    from mpexec.dali import _SharedRows

    rows = _SharedRows(_Blocks(), samples)  # type: ignore[arg-type]
    n = len(samples)
    got = np.concatenate([rows.rows(0, 2), rows.rows(2, n)])
    assert got.shape == (n, *samples[0].shape)
    assert np.array_equal(got, np.stack(samples))


def test_source_gives_dense_blocks_and_ends_epochs() -> None:
    pipe = _source_pipe(8)
    with pipe:
        src = mpexec.dali.source(pipe)
        epochs = []
        for _ in range(2):
            items = list(iter(src))  # a second iter() starts the next epoch
            epochs.append([a[:, 0, 0].tolist() for a, _ in items])
            a, b = items[0]
            assert isinstance(a, np.ndarray)
            assert np.array_equal(b, a * 2)
        assert epochs == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
        with pytest.raises(StopIteration):  # a new source on the ended epoch: ended too
            next(iter(mpexec.dali.source(pipe)))
        pipe.reset()
        b = next(iter(mpexec.dali.source(pipe, outputs=[1])))  # one output: not a tuple
        assert b[:, 0, 0].tolist() == [0, 2, 4, 6]


# ================================================================ with DALI


def _dali() -> Any:
    return pytest.importorskip("nvidia.dali")


def _dali_batch(i: Any) -> list[np.ndarray[Any, Any]]:
    return [np.full((3, 4), int(i.iteration) * 8 + j, np.float32) for j in range(8)]


def test_dali_pipeline_runs_mpexec_behind_its_python_function() -> None:
    _dali()
    from nvidia.dali import fn, pipeline_def

    spread = mpexec.dali.python_function(_pid_and_sum, num_workers=2, num_outputs=2)

    @pipeline_def(batch_size=8, num_threads=1, device_id=None)
    def graph() -> Any:
        x = fn.external_source(source=_dali_batch, batch=True, batch_info=True)
        pids, sums = fn.python_function(x, x, function=spread, batch_processing=True, num_outputs=2)
        return x, pids, sums

    try:
        pipe = graph()
        pipe.build()
        for _ in range(3):
            x, pids, sums = pipe.run()
            xs = [np.array(x.at(j)) for j in range(8)]
            assert [float(np.array(sums.at(j))[0]) for j in range(8)] == [
                2 * float(a.sum()) for a in xs
            ]
            assert {int(np.array(pids.at(j))[0]) for j in range(8)} - {os.getpid()}
        del pipe
    finally:
        spread.close()


def test_dali_pipeline_fed_by_an_mpexec_pipeline_epoch_by_epoch() -> None:
    _dali()
    from nvidia.dali import pipeline_def

    def epochs(n_epochs: int) -> list[list[list[float]]]:
        mp = _source_pipe(8)

        @pipeline_def(batch_size=4, num_threads=1, device_id=None)
        def graph() -> Any:
            a, b = mpexec.dali.external_source(mp)
            return a, b + 1

        out = []
        with mp:
            pipe = graph()
            pipe.build()
            for _ in range(n_epochs):
                seen = []
                try:
                    while True:
                        a, b = pipe.run()
                        av = np.array(a.as_tensor())
                        assert np.array_equal(np.array(b.as_tensor()), av * 2 + 1)
                        seen.append(av[:, 0, 0].tolist())
                except StopIteration:
                    pipe.reset()
                out.append(seen)
            del pipe
        return out

    first = epochs(2)
    assert first == [[[0, 1, 2, 3], [4, 5, 6, 7]]] * 2
    assert epochs(2) == first, "seeded: the same in another run"


def test_reader_matches_dalis_reader(tmp_path: Path) -> None:
    _dali()
    from nvidia.dali import fn, pipeline_def

    for d, n in (("0", 2), ("1", 3), ("100", 1), ("2", 2)):
        (tmp_path / d).mkdir()
        for i in range(n):
            (tmp_path / d / f"{i}.jpg").write_bytes(f"{d}/{i}".encode())

    def dali(**kw: Any) -> list[Any]:
        @pipeline_def(batch_size=3, num_threads=1, device_id=None, seed=1)
        def graph() -> Any:
            return tuple(fn.readers.file(file_root=str(tmp_path), **kw))

        pipe = graph()
        pipe.build()
        out = []
        for _ in range(5):
            d, lab = pipe.run()
            out += [(bytes(np.array(d.at(j))), int(np.array(lab.at(j))[0])) for j in range(3)]
        del pipe
        return out

    def ours(**kw: Any) -> list[Any]:
        pipe = mpexec.Pipeline(3, 0, None, 1)
        with pipe:
            pipe.set_outputs(*mfn.readers.file(file_root=str(tmp_path), **kw))
        out = []
        with pipe:
            for _ in range(5):
                d, lab = pipe.run()
                out += [(bytes(x), int(y[0])) for x, y in zip(d, lab, strict=True)]
        return out

    shardings: list[dict[str, Any]] = [
        {},
        {"num_shards": 3, "shard_id": 2},
        {"num_shards": 2, "shard_id": 1, "stick_to_shard": True},
        {"num_shards": 2, "shard_id": 0, "pad_last_batch": True},
    ]
    for kw in shardings:
        assert ours(**kw) == dali(**kw), kw


def test_arithmetic_promotion_matches_dali() -> None:
    _dali()
    import operator

    from nvidia.dali import fn, pipeline_def

    cases = [
        (np.uint8, 2),
        (np.uint8, 2.5),
        (np.int64, 2.5),
        (np.uint16, np.int8),
        (np.uint64, np.int64),
        (np.int64, np.float32),
    ]

    def value(t: Any) -> Any:
        return [np.array([3, 1], t)]

    for a, b in cases:
        for op in (operator.add, operator.truediv):

            @pipeline_def(batch_size=1, num_threads=1, device_id=None)
            def graph(a: Any = a, b: Any = b, op: Any = op) -> Any:
                x = fn.external_source(source=[value(a)])
                y = b if not isinstance(b, type) else fn.external_source(source=[value(b)])
                return op(x, y)

            pipe = graph()
            pipe.build()
            want = np.array(pipe.run()[0].at(0))
            del pipe
            ours = mpexec.Pipeline(1, 0, None, 1)
            with ours:
                x = mfn.external_source(source=[value(a)])
                y = b if not isinstance(b, type) else mfn.external_source(source=[value(b)])
                ours.set_outputs(op(x, y))
            with ours:
                got = ours.run()[0][0]
            assert got.dtype == want.dtype, (a, b, op)
            assert np.array_equal(got, want), (a, b, op)


def test_types_match_dalis_values() -> None:
    _dali()
    import nvidia.dali.types as dtypes

    for name in ("UINT8", "INT32", "FLOAT", "FLOAT16", "FLOAT64", "BOOL", "INT64", "UINT64"):
        assert int(getattr(mtypes, name)) == int(getattr(dtypes, name)), name
    for name in ("RGB", "BGR", "GRAY", "INTERP_NN", "INTERP_LINEAR", "INTERP_CUBIC"):
        assert int(getattr(mtypes, name)) == int(getattr(dtypes, name)), name
    for t in (dtypes.UINT8, dtypes.FLOAT, dtypes.BOOL):
        assert mtypes.to_numpy_type(t) is dtypes.to_numpy_type(t)


def test_real_dali_types_work_in_mpexec_ops() -> None:
    _dali()
    import nvidia.dali.types as dtypes

    pipe = mpexec.Pipeline(2, 0, None, 1)
    with pipe:
        x = mfn.external_source(source=_indexed, batch=False)
        a, b = mfn.python_function(
            x,
            function=lambda v: (v.astype(np.uint8), v.astype(np.int32)),
            num_outputs=2,
            output_dtypes=[dtypes.UINT8, dtypes.INT32],
        )
        pipe.set_outputs(a, b, mfn.ones(shape=[2], dtype=dtypes.FLOAT16))
    with pipe:
        a, b, c = pipe.run()
    assert (a.dtype, b.dtype, c.dtype) == (np.uint8, np.int32, np.float16)


def test_image_decoder_pixels_match_dalis(tmp_path: Path) -> None:
    _dali()
    image = pytest.importorskip("PIL.Image")
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali import types as dtypes

    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:61, 0:83]
    base = np.stack([x * 3, y * 4, (x + y) * 2], axis=-1)
    files = []
    for k, save in enumerate(
        [
            {"subsampling": 0},
            {"subsampling": 1},
            {"subsampling": 2, "quality": 50},
            {"progressive": True},
        ]
    ):
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        path = tmp_path / f"{k}.jpg"
        image.fromarray(pixels).save(path, **save)
        files.append(str(path))
    for dali_type, ours_type in ((dtypes.RGB, mtypes.RGB), (dtypes.GRAY, mtypes.GRAY)):

        @pipeline_def(batch_size=len(files), num_threads=1, device_id=None)
        def graph(t: Any = dali_type) -> Any:
            jpegs, _ = fn.readers.file(files=files)
            return fn.decoders.image(jpegs, device="cpu", output_type=t)

        pipe = graph()
        pipe.build()
        (want,) = pipe.run()
        want_arrays = [np.array(want.at(i)) for i in range(len(files))]
        del pipe
        ours = mpexec.Pipeline(len(files), 1, None, 1)
        with ours:
            jpegs, _ = mfn.readers.file(files=files)
            ours.set_outputs(mfn.decoders.image(jpegs, output_type=ours_type))
        with ours:
            (got,) = ours.run()
            for a, b in zip(got, want_arrays, strict=True):
                assert np.array_equal(a, b), dali_type
