"""mpexec.torch: DataLoader parity with torch's own, workers, errors, resuming, DLPack."""

from __future__ import annotations

import base64
import collections
import contextlib
import gc
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import textwrap
import threading
import time
import traceback
import weakref
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import (  # noqa: E402
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
    get_worker_info,
)
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

import mpexec  # noqa: E402
import shm  # noqa: E402
from mpexec import _tracebacks  # noqa: E402
from mpexec import torch as mt  # noqa: E402
from mpexec.torch import _fetch, _processes, _tensors  # noqa: E402
from tests.conftest import run_python  # noqa: E402
from tests.test_tracebacks import _assert_worker_text, _mpexec_frames  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")

Point = collections.namedtuple("Point", ["x", "label"])


# ------------------------------------------------------------------ datasets
class DictDataset(Dataset):  # type: ignore[type-arg]
    """Dicts of arrays, numbers and strings."""

    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng(i)
        return {
            "image": rng.integers(0, 255, (8, 9, 3), dtype=np.uint8),
            "feat": rng.standard_normal(40).astype(np.float32),
            "weight": float(i) / 3,
            "label": i % 5,
            "name": f"sample-{i}",
            "pair": (np.int16(i), torch.full((2,), i, dtype=torch.float64)),
        }


class NamedDataset(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> Point:
        return Point(torch.arange(600, dtype=torch.int64) * i, i % 2 == 0)


class RandomDataset(Dataset):  # type: ignore[type-arg]
    """Samples from the worker's torch, NumPy and random state: checks the seeding."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        info = get_worker_info()
        return (
            torch.rand(3),
            np.random.random_sample(2),
            random.random(),
            -1 if info is None else info.id,
            -1 if info is None else info.seed,
        )


class ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """Shards itself by get_worker_info(), as torch's docs show."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None:
            lo, hi = self.start, self.end
        else:
            per = -(-(self.end - self.start) // info.num_workers)
            lo = self.start + info.id * per
            hi = min(lo + per, self.end)
        for i in range(lo, hi):
            yield {"i": i, "x": np.full((4, 300), i, np.float32)}

    def __len__(self) -> int:
        return self.end - self.start


class Failing(Dataset):  # type: ignore[type-arg]
    def __init__(self, bad: int, how: str = "raise") -> None:
        self.bad, self.how = bad, how

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            if self.how == "raise":
                raise KeyError(f"no sample {i}")
            if self.how == "exit":
                os._exit(3)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "hang":
                time.sleep(60)
        return np.full(3, i)


class ArrayDataset(Dataset):  # type: ignore[type-arg]
    """Each sample one array or tensor (what a worker stacks as it fetches).

    ``odd``: sample ``odd`` differs from the rest (``shape``, ``dtype`` or
    ``type``), so that default_collate itself must stack (or refuse) the batch.
    """

    def __init__(self, kind: str = "numpy", odd: int = -1, how: str = "") -> None:
        self.kind, self.odd, self.how = kind, odd, how

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        x = np.random.default_rng(i).standard_normal((3, 5, 4)).astype(np.float32)
        if i == self.odd and self.how == "shape":
            x = x[:, :4]
        if i == self.odd and self.how == "dtype":
            x = x.astype(np.float64)
        if (self.kind == "torch") != (i == self.odd and self.how == "type"):
            return torch.from_numpy(x)
        return x


def stack_pairs(batch: list[Any]) -> Any:
    xs = torch.stack([torch.as_tensor(b[0]) for b in batch])
    return xs * 2, [int(b[1]) for b in batch]


def tensor_ds(n: int = 50) -> TensorDataset:
    return TensorDataset(
        torch.arange(n * 12, dtype=torch.float32).reshape(n, 3, 4), torch.arange(n) % 7
    )


# ------------------------------------------------------------------ helpers
def assert_same(a: Any, b: Any, where: str = "batch") -> None:
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{where}: {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}: {a.shape} != {b.shape}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def both(make: Any, epochs: int = 1) -> tuple[list[Any], list[Any]]:
    """Batches of torch's loader and of ours, built by ``make(cls)`` with the same seeds."""
    out = []
    for cls in (TorchLoader, mt.DataLoader):
        torch.manual_seed(1234)
        np.random.seed(1234)  # what num_workers=0 draws from
        random.seed(1234)
        loader = make(cls)
        out.append([b for _ in range(epochs) for b in loader])
        del loader
    return out[0], out[1]


def check_parity(make: Any, epochs: int = 1) -> list[Any]:
    want, got = both(make, epochs)
    assert len(got) == len(want)
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        assert_same(g, w, f"batch {i}")
    return got


def mapping_of(address: int) -> tuple[str, bool]:
    """(permissions, whether it maps an mpexec segment) of the mapping holding ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms, *_ = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms, "memfd:mpx" in line or "/mpx-" in line
    raise AssertionError(f"{address:#x} is in no mapping")


def gen(seed: int = 7) -> Any:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ parity
PARITY = {
    "tensors-shuffle": lambda cls, nw: cls(
        tensor_ds(), batch_size=8, shuffle=True, generator=gen(), num_workers=nw
    ),
    "tensors-global-rng": lambda cls, nw: cls(
        tensor_ds(), batch_size=6, shuffle=True, num_workers=nw
    ),
    "dicts-drop-last": lambda cls, nw: cls(
        DictDataset(), batch_size=5, drop_last=True, num_workers=nw
    ),
    "dicts-keep-last": lambda cls, nw: cls(
        DictDataset(), batch_size=5, shuffle=True, generator=gen(3), num_workers=nw
    ),
    "namedtuples": lambda cls, nw: cls(NamedDataset(), batch_size=4, num_workers=nw),
    "subset-sampler": lambda cls, nw: cls(
        DictDataset(),
        batch_size=3,
        sampler=SubsetRandomSampler(list(range(0, 37, 2)), generator=gen(5)),
        num_workers=nw,
    ),
    "weighted-sampler": lambda cls, nw: cls(
        tensor_ds(),
        batch_size=4,
        sampler=WeightedRandomSampler(torch.linspace(0.1, 1, 50), 30, generator=gen(9)),
        num_workers=nw,
    ),
    "batch-sampler": lambda cls, nw: cls(
        tensor_ds(),
        batch_sampler=BatchSampler(RandomSampler(range(50), generator=gen(2)), 7, False),
        num_workers=nw,
    ),
    "batch-list": lambda cls, nw: cls(
        tensor_ds(), batch_sampler=[[3, 1, 4], [1, 5, 9], [2, 6]], num_workers=nw
    ),
    "no-batching": lambda cls, nw: cls(DictDataset(9), batch_size=None, num_workers=nw),
    "custom-collate": lambda cls, nw: cls(
        tensor_ds(), batch_size=9, collate_fn=stack_pairs, num_workers=nw
    ),
    "sequential-sampler": lambda cls, nw: cls(
        tensor_ds(), batch_size=16, sampler=SequentialSampler(range(50)), num_workers=nw
    ),
    "ndarray-samples": lambda cls, nw: cls(
        ArrayDataset(), batch_size=6, shuffle=True, generator=gen(4), num_workers=nw
    ),
    "tensor-samples": lambda cls, nw: cls(ArrayDataset("torch"), batch_size=6, num_workers=nw),
    "odd-dtype-sample": lambda cls, nw: cls(
        ArrayDataset(odd=9, how="dtype"), batch_size=4, num_workers=nw
    ),
    "odd-type-sample": lambda cls, nw: cls(
        ArrayDataset(odd=5, how="type"), batch_size=4, num_workers=nw
    ),
    "worker-rng": lambda cls, nw: cls(
        RandomDataset(), batch_size=3, shuffle=True, generator=gen(11), num_workers=nw
    ),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_same_batches_as_torch_two_workers(case: str) -> None:
    check_parity(lambda cls: PARITY[case](cls, 2))


@pytest.mark.parametrize("nw", [0, 1, 3])
@pytest.mark.parametrize("case", ["dicts-keep-last", "worker-rng", "batch-sampler"])
def test_same_batches_any_worker_count(case: str, nw: int) -> None:
    many = nw > len(os.sched_getaffinity(0))
    # More workers than CPUs: torch's warning, from both loaders.
    with pytest.warns(UserWarning, match="worker processes") if many else contextlib.nullcontext():
        check_parity(lambda cls: PARITY[case](cls, nw))


@pytest.mark.parametrize("persistent", [False, True])
def test_epochs_reshuffle_like_torch(persistent: bool) -> None:
    got = check_parity(
        lambda cls: cls(
            DictDataset(),
            batch_size=6,
            shuffle=True,
            generator=gen(4),
            num_workers=2,
            persistent_workers=persistent,
            prefetch_factor=3,
        ),
        epochs=3,
    )
    assert len(got) == 3 * 7


def test_constructor_checks_and_len_are_torchs() -> None:
    loader = mt.DataLoader(tensor_ds(), batch_size=8, num_workers=2)
    assert isinstance(loader, TorchLoader)
    assert len(loader) == len(TorchLoader(tensor_ds(), batch_size=8)) == 7
    assert len(mt.DataLoader(tensor_ds(), batch_size=8, drop_last=True)) == 6
    with pytest.raises(ValueError, match="prefetch_factor"):
        mt.DataLoader(tensor_ds(), prefetch_factor=2)
    with pytest.raises(ValueError, match="persistent_workers"):
        mt.DataLoader(tensor_ds(), persistent_workers=True)
    with pytest.raises(ValueError, match="sampler option is mutually exclusive"):
        mt.DataLoader(tensor_ds(), shuffle=True, sampler=SequentialSampler(range(3)))


def test_in_order_false_yields_every_batch() -> None:
    want, got = both(lambda cls: cls(tensor_ds(), batch_size=4, num_workers=2, in_order=False))
    key = lambda b: b[1].tolist() + b[0].flatten().tolist()[:1]  # noqa: E731
    assert sorted(map(key, got)) == sorted(map(key, want))


# ------------------------------------------------------------------ iterable datasets
@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(4, False), (4, True), (5, False), (5, True), (None, False)]
)
def test_iterable_dataset_shards_by_worker_info(batch_size: int | None, drop_last: bool) -> None:
    got = check_parity(
        lambda cls: cls(
            ShardedStream(0, 22), batch_size=batch_size, drop_last=drop_last, num_workers=2
        )
    )
    seen = [int(i) for b in got for i in np.atleast_1d(np.asarray(b["i"]))]
    assert len(seen) == len(set(seen))  # every sample once: the dataset sharded itself


def test_iterable_dataset_len_warns_like_torch() -> None:
    loader = mt.DataLoader(ShardedStream(0, 10), batch_size=None, num_workers=2)
    assert len(loader) == 10
    batches = list(loader)
    assert len(batches) == 10


def test_worker_info_and_init_fn() -> None:
    def probe(i: int) -> Any:
        info = get_worker_info()
        return (info.id, info.num_workers, info.seed, type(info.dataset).__name__, os.getpid())

    class Probe(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> Any:
            return probe(i)

    inits = []

    def init(worker_id: int) -> None:
        assert get_worker_info().id == worker_id
        torch.manual_seed(100 + worker_id)  # the dataset sees what init did

    torch.manual_seed(0)
    loader = mt.DataLoader(Probe(), batch_size=None, num_workers=2, worker_init_fn=init)
    rows = list(loader)
    assert [r[0] for r in rows] == [0, 1] * 4  # batch k on worker k mod 2
    assert {r[1] for r in rows} == {2}
    seeds = {r[0]: r[2] for r in rows}
    assert seeds[1] == seeds[0] + 1  # base_seed + worker id, as torch
    assert {r[3] for r in rows} == {"Probe"}
    assert os.getpid() not in {r[4] for r in rows}
    assert get_worker_info() is None
    del inits


# ------------------------------------------------------------------ shared memory
def checked_collate(batch: list[Any]) -> Any:
    out = default_collate(batch)
    # default_collate, in an mpexec worker, stacks straight into the worker's arena.
    array = _tensors.shared_array(out[0])
    assert array is not None, "the collated tensor is not in the worker's arena"
    assert shm.in_shared_memory(array)
    assert array.ctypes.data == out[0].data_ptr()
    return out


def test_batches_are_collated_into_shared_memory_and_outlive_the_loader() -> None:
    # 12 KiB batches: past the 1 KiB under which a view rides in the ring record.
    data = TensorDataset(torch.rand(64, 3, 64), torch.arange(64))
    loader = mt.DataLoader(data, batch_size=16, num_workers=2, collate_fn=checked_collate)
    held = list(loader)
    for x, _ in held:
        # The worker's pages, mapped shared, not a copy: shared memory as torch sees it.
        assert x.is_shared()
        assert mapping_of(x.data_ptr()) == ("rw-s", True)
    del loader
    gc.collect()
    want = list(TorchLoader(data, batch_size=16))
    for g, w in zip(held, want, strict=True):
        assert_same(g, w)


def _fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_a_workers_segment_is_opened_once_for_all_its_batches(monkeypatch: Any) -> None:
    # Each batch tensor maps its worker's segment by fd; the fd came from opening
    # /proc/<pid>/fd/<n> again for every batch (50-70 µs a batch at 16 workers).
    opened: list[Any] = []
    real = shm.Segment.open_fd

    def counted(self: shm.Segment, writable: bool = False) -> int:
        opened.append(self)
        return real(self, writable)

    monkeypatch.setattr(shm.Segment, "open_fd", counted)
    data = TensorDataset(torch.rand(480, 3, 64), torch.arange(480))
    loader = mt.DataLoader(data, batch_size=16, num_workers=2, persistent_workers=True)
    for _ in range(2):
        got = list(loader)
        assert all(x.is_shared() for x, _ in got)
    assert len(got) == 30
    # One open a segment mapped (each worker's arena), not one a batch (60).
    assert 1 <= len(opened) == len({id(s) for s in opened}) <= 8
    want = list(TorchLoader(data, batch_size=16))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    # A forked child keeps none of those fds (nor the segments they would keep alive).
    fds = list(_tensors._segment_fds.values())
    assert fds
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        closed = not _tensors._segment_fds and all(_fd_closed(fd) for fd in fds)
        os._exit(0 if closed else 1)
    assert os.waitpid(pid, 0)[1] == 0
    del got, loader
    gc.collect()


class CountingDataset(Dataset):  # type: ignore[type-arg]
    """Samples of 64 KiB (or ``size`` floats), each holding how many samples were alive when
    it was made."""

    alive = 0

    def __init__(self, size: int = 16384) -> None:
        self.size = size

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        x = np.full(self.size, CountingDataset.alive, np.float32)
        CountingDataset.alive += 1
        weakref.finalize(x, _one_less)
        return x


def _one_less() -> None:
    CountingDataset.alive -= 1


def test_batches_come_back_by_hook_without_a_future(monkeypatch: Any) -> None:
    # A Future a batch (its condition made, taken, notified on both threads,
    # concurrent.futures.wait()'s waiter before that) was ~30 Python calls a
    # batch, run cold at 2 workers: a batch's call hands its outcome to a hook.
    futures: list[Any] = []
    real = mpexec.WorkerPool.submit_call

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        futures.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mpexec.WorkerPool, "submit_call", counted)
    data = TensorDataset(torch.arange(96))
    for timeout, in_order in ((0, True), (30, True), (30, False)):
        loader = mt.DataLoader(
            data,
            batch_size=8,
            num_workers=2,
            persistent_workers=True,
            timeout=timeout,
            in_order=in_order,
        )
        for _ in range(2):  # a map-style dataset's second epoch resumes no worker
            got = torch.cat([b for (b,) in loader]).tolist()
            assert (got if in_order else sorted(got)) == list(range(96))
        del loader
    assert futures == []


class Slow(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        time.sleep(1.0)  # a batch of 2: 2 s, far past the SIGINT (at 0.2 s) on a busy host
        return i


def test_ctrl_c_while_waiting_for_a_batch_raises_there_and_loses_it_not() -> None:
    # The caller sleeps on the arrivals' queue: a SIGINT wakes it at once, and the
    # batch, filed when it comes, is the next next()'s.
    it = iter(mt.DataLoader(Slow(), batch_size=2, num_workers=1))
    timer = threading.Timer(
        0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)
    )
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert time.monotonic() - start < 1.5  # raised asleep, not once the batch came
    finally:
        timer.join()
    assert [b.tolist() for b in it] == [[0, 1], [2, 3]]


def test_single_array_samples_are_stacked_as_they_come() -> None:
    # default_collate would hold every sample of a batch, then their stack; a
    # worker copies each into the batch's block at once and drops it.
    loader = mt.DataLoader(CountingDataset(), batch_size=8, num_workers=2)
    batches = list(loader)
    assert [b.shape for b in batches] == [(8, 16384)] * 3
    assert all(b.max().item() == 0 for b in batches), [b[:, 0].tolist() for b in batches]
    assert all(mapping_of(b.data_ptr()) == ("rw-s", True) for b in batches)  # no copy


def test_small_samples_are_stacked_once_a_batch() -> None:
    # Under _fetch.ROWS_MIN a row's checks and copy cost more than the batch held
    # twice: the samples go to default_collate together, as in torch.
    size = _fetch.ROWS_MIN // 4 - 1
    loader = mt.DataLoader(CountingDataset(size), batch_size=8, num_workers=2)
    batches = list(loader)
    assert [b.shape for b in batches] == [(8, size)] * 3
    assert all(b[:, 0].tolist() == list(range(8)) for b in batches), [b[:, 0] for b in batches]
    assert all(mapping_of(b.data_ptr()) == ("rw-s", True) for b in batches)  # stacked in the arena


class ArenaSetting(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        here = mpexec._worker.current()
        return -1 if here is None else here[1].discard_min


def test_workers_give_dropped_batches_pages_back() -> None:
    # Like torch's per-batch segments, not the arena's high-water mark (see shm.Arena).
    got = list(mt.DataLoader(ArenaSetting(), batch_size=2, num_workers=2))
    assert [b.tolist() for b in got] == [[_fetch.DISCARD_MIN] * 2] * 2


def test_unstackable_samples_fail_as_in_torch() -> None:
    # A sample unlike the first: default_collate itself refuses the batch, as in torch.
    for cls in (TorchLoader, mt.DataLoader):
        it = iter(cls(ArrayDataset(odd=6, how="shape"), batch_size=4, num_workers=2))
        try:
            assert next(it).shape == (4, 3, 5, 4)
            with pytest.raises(RuntimeError):
                next(it)
        finally:
            # Now, not whenever the error's traceback lets go of the iterator.
            it._shutdown_workers()  # type: ignore[attr-defined]


def test_early_break_leaks_nothing() -> None:
    loader = mt.DataLoader(DictDataset(200), batch_size=4, num_workers=2, prefetch_factor=4)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    first = next(iter(loader))
    assert first["image"].shape == (4, 8, 9, 3)


def test_pin_memory_without_accelerator_is_torchs_warning() -> None:
    if torch.accelerator.is_available():  # pragma: no cover - GPU machines
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        check_parity(lambda cls: cls(tensor_ds(), batch_size=8, num_workers=2, pin_memory=True))


# ------------------------------------------------------------------ failures
def _frames(exc: BaseException) -> list[str]:
    """The names of the frames of ``exc``'s traceback, outermost first."""
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def test_dataset_error_keeps_type_traceback_and_index() -> None:
    loader = mt.DataLoader(Failing(13), batch_size=4, num_workers=2)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    with pytest.raises(KeyError, match="no sample 13") as info:
        next(it)
    assert isinstance(info.value.__cause__, mpexec.RemoteTraceback)
    assert "__getitem__" in info.value.__cause__.tb
    assert any("sample index 13" in n and "worker 1" in n for n in info.value.__notes__)
    assert info.value.mpexec_sample == 13
    # Like torch, the epoch goes on after a failed batch.
    rest = list(it)
    assert len(got) + len(rest) == 9
    assert rest[0].tolist()[0] == [16, 16, 16]


class EpochFailing(IterableDataset):  # type: ignore[type-arg]
    """Iterating it fails from its second epoch on (a persistent worker's new epoch)."""

    def __init__(self) -> None:
        self.epochs = 0

    def __iter__(self) -> Any:
        self.epochs += 1
        if self.epochs > 1:
            Failing(0)[0]  # raises KeyError two frames into the user's code
        return iter([np.zeros(3)] * 4)


@pytest.mark.parametrize("nw", [0, 2])
def test_a_dataset_error_shows_the_users_frames_not_the_loaders(
    nw: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a pool's result() (tests/test_tracebacks.py): one line of the loader, the
    re-raise; none of its iterator's frames (``_next_data``, ``_outcome``) above."""
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)
    it = iter(mt.DataLoader(Failing(5), batch_size=4, num_workers=nw))
    next(it)
    with pytest.raises(KeyError, match="no sample 5") as info:
        next(it)
    exc = info.value
    assert _mpexec_frames(exc) == ["_epoch.py:__next__"]
    if nw:
        assert _frames(exc) == [
            "test_a_dataset_error_shows_the_users_frames_not_the_loaders",
            "__next__",
        ]
        _assert_worker_text(exc, "__getitem__")
        assert any("sample index 5" in n for n in exc.__notes__)
    else:  # raised here: the dataset's frames, below torch's own fetcher's
        assert _frames(exc)[-1] == "__getitem__"
    del it, exc, info


def test_a_persistent_workers_epoch_error_shows_the_users_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(_tracebacks.FULL_TRACEBACK_ENV, raising=False)
    loader = mt.DataLoader(EpochFailing(), batch_size=2, num_workers=1, persistent_workers=True)
    assert len(list(loader)) == 2
    with pytest.raises(KeyError, match="no sample 0") as info:
        iter(loader)  # the kept worker starts its second epoch
    exc = info.value
    assert _mpexec_frames(exc) == ["_loader.py:__iter__"]
    assert _frames(exc) == [
        "test_a_persistent_workers_epoch_error_shows_the_users_frames",
        "__iter__",
    ]
    _assert_worker_text(exc, "__iter__", "__getitem__")
    del loader, exc, info


@pytest.mark.parametrize("iterable", [False, True])
def test_a_persistent_epoch_resumes_only_workers_with_something_to_do(
    iterable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A map-style dataset's fetcher keeps nothing from one epoch to the next: its
    workers get no resume round trip (a barrier before any batch, 15-40 ms at 64
    workers). An iterable dataset's each call iter() on it anew: each is resumed."""
    sent: list[str] = []
    real, hooked = mpexec.WorkerPool.submit_call, mpexec.WorkerPool.submit_hooked

    def counted(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(fn.__name__)
        return real(self, fn, *args, **kwargs)

    def counted_hooked(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(fn.__name__)
        return hooked(self, fn, *args, **kwargs)

    monkeypatch.setattr(mpexec.WorkerPool, "submit_call", counted)
    monkeypatch.setattr(mpexec.WorkerPool, "submit_hooked", counted_hooked)
    data = ShardedStream(0, 12) if iterable else Failing(99)
    loader = mt.DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True)
    first = [b["i"].tolist() for b in loader] if iterable else [b.tolist() for b in loader]
    sent.clear()
    again = [b["i"].tolist() for b in loader] if iterable else [b.tolist() for b in loader]
    assert again == first
    assert sent.count("resume_worker") == (2 if iterable else 0)
    assert sent.count("fetch") >= len(first)
    del loader


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_dead_worker_is_worker_crashed_error(how: str) -> None:
    loader = mt.DataLoader(Failing(6, how), batch_size=2, num_workers=2)
    with pytest.raises(mpexec.WorkerCrashedError) as info:
        list(loader)
    assert info.value.pid > 0


def test_persistent_workers_restart_after_a_crash() -> None:
    # The crash comes in the epoch's last batch: the next epoch's first is made long before.
    loader = mt.DataLoader(
        Failing(38, "exit"), batch_size=2, num_workers=2, persistent_workers=True
    )
    with pytest.raises(mpexec.WorkerCrashedError):
        list(loader)
    it = iter(loader)  # a new pool: the crashed one is not reused
    assert next(it).tolist() == [[0, 0, 0], [1, 1, 1]]
    del it, loader


def test_timeout_is_loader_timeout_error() -> None:
    loader = mt.DataLoader(Failing(0, "hang"), batch_size=2, num_workers=2, timeout=1)
    with pytest.raises(mpexec.LoaderTimeoutError, match="timed out after 1 seconds") as info:
        next(iter(loader))
    assert isinstance(info.value, RuntimeError)  # what torch raises


def test_unpicklable_dataset_is_a_clear_error() -> None:
    class Local(Dataset):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.lock = __import__("threading").Lock()

        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int) -> int:
            return i

    # Under fork (torch's default here) the workers inherit it, as torch's do;
    # a start method that must pickle it says so.
    with pytest.raises(mpexec.SerializationError, match="worker_init"):
        list(mt.DataLoader(Local(), num_workers=1, multiprocessing_context="forkserver"))


class Unpicklable(Dataset):  # type: ignore[type-arg]
    """A dataset that refuses pickling, and shows its array's address in a worker."""

    def __init__(self) -> None:
        self.data = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: its own mapping

    def __reduce__(self) -> Any:
        raise TypeError("Unpicklable is not picklable")

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        return self.data.__array_interface__["data"][0], int(self.data[i])


@pytest.mark.skipif(mp.get_all_start_methods()[0] != "fork", reason="fork is not the default")
@pytest.mark.usefixtures("forkable")
def test_default_start_is_torchs_fork_sharing_the_callers_dataset() -> None:
    # torch forks its workers from the caller: the dataset (and torch) are
    # shared pages, never pickled. So are ours, unless a context is given.
    data = Unpicklable()
    address = data.data.__array_interface__["data"][0]
    loader = mt.DataLoader(data, batch_size=2, num_workers=2)
    got = list(loader)
    assert [b[1].tolist() for b in got] == [[0, 1], [2, 3]]
    assert {int(a) for b in got for a in b[0]} == {address}  # the caller's own array
    want = list(TorchLoader(data, batch_size=2, num_workers=2))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    assert _fetch.inherited == {}  # nothing kept for workers already forked


def test_start_method_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    default = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(_processes, "cuda_initialised", lambda: False)  # a GPU host's tests
    assert _processes.start_method(None) == default
    assert _processes.start_method(mp.get_context("spawn")) == "spawn"
    if default == "fork":
        # A forked child cannot use the CUDA context it would inherit.
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        assert _processes.start_method(None) == mpexec._host.default_start_method()
        # CUDA initialised by another library (CuPy for a GPU op, JAX): the same, where
        # the pool would refuse a fork (found on an H200: the drop-in asked for one).
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(_processes, "cuda_initialised", lambda: True)
        assert _processes.start_method(None) == mpexec._host.default_start_method()


WORKER_MODULES_SCRIPT = """
import multiprocessing as mp, sys
import torch.utils.data
from mpexec.torch import DataLoader

class Modules(torch.utils.data.Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, i):  # runs in the loader's worker: what it has imported
        return " ".join(sorted(m for m in sys.modules if m.split(".")[0] in ("mpexec", "shm")))

if __name__ == "__main__":
    ctx = mp.get_context(sys.argv[1])
    print(*DataLoader(Modules(), batch_size=None, num_workers=1, multiprocessing_context=ctx))
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_loader_worker_imports_no_caller_room(tmp_path: Any, method: str) -> None:
    # The worker's rooms (_fetch, _tensors, _compat) and the pool's worker side: not the
    # caller's loader, nor the pool, scheduler, pipeline, executors or graph.
    script = tmp_path / "modules.py"
    script.write_text(WORKER_MODULES_SCRIPT)
    loaded = set(run_python(str(script), method, timeout=300).split())
    assert {"mpexec.torch._fetch", "mpexec._worker"} <= loaded
    caller = {"_loader", "_epoch", "_iterator", "_state", "_stats", "_processes", "_convert"}
    machinery = {"_pool", "_scheduler", "_pipeline", "_executors", "_graph"}
    assert sorted(m for m in loaded if m.split(".")[-1] in caller) == []
    assert sorted(m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in machinery) == []


# ------------------------------------------------------------------ resuming
RESUME_SCRIPT = """
import json, sys, torch
from mpexec import torch as mt
from tests.adapters.test_torch import RESUME_CASES
def main():
    case, k, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.manual_seed(99)
    loader = RESUME_CASES[case]()
    out = []
    if mode == "save":
        it = iter(loader)
        for _ in range(k):
            next(it)
        print(json.dumps(loader.state_dict()))
        return
    loader.load_state_dict(json.loads(sys.stdin.read()))
    for epoch in range(2):
        for b in loader:
            out.append(b["i"].tolist() if isinstance(b, dict) else b[1].tolist())
    print(json.dumps(out))
if __name__ == "__main__":
    main()
"""

RESUME_CASES = {
    "map-shuffle": lambda: mt.DataLoader(tensor_ds(40), batch_size=3, shuffle=True, num_workers=2),
    "map-generator": lambda: mt.DataLoader(
        tensor_ds(40), batch_size=4, shuffle=True, generator=gen(8), num_workers=0
    ),
    "iterable": lambda: mt.DataLoader(ShardedStream(0, 30), batch_size=4, num_workers=2),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_in_a_new_process_yields_the_rest(case: str, tmp_path: Any) -> None:
    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(RESUME_SCRIPT))

    def run(*args: str, stdin: str = "") -> Any:
        return run_python(str(script), case, *args, stdin=stdin)

    # Uninterrupted: torch.manual_seed(99), then epochs 0 and 1.
    torch.manual_seed(99)
    loader = RESUME_CASES[case]()
    full = [
        (b["i"].tolist() if isinstance(b, dict) else b[1].tolist())
        for _ in range(2)
        for b in loader
    ]
    del loader
    per_epoch = len(full) // 2
    k = 3
    state = run(str(k), "save")
    assert len(state) < 30_000
    assert json.loads(state)["batches"] == k
    resumed = json.loads(run(str(k), "load", stdin=state))
    assert resumed == full[k:]
    assert len(resumed) == 2 * per_epoch - k


def test_load_state_dict_rejects_garbage() -> None:
    loader = mt.DataLoader(tensor_ds(), batch_size=4)
    with pytest.raises(ValueError, match="state_dict"):
        loader.load_state_dict({"batches": 2})
    with pytest.raises(ValueError, match="batches"):
        loader.load_state_dict({"version": 1, "rng": loader.state_dict()["rng"], "batches": -1})


def test_the_state_format_is_checked_without_a_loader() -> None:
    # The format's own room: a state read against a loader's facts, no loader, no process.
    from mpexec.torch import _state

    g = gen(3)
    rng = {"loader": base64.b64encode(g.get_state().numpy().tobytes()).decode("ascii")}
    state = {"version": 2, "rng": rng, "fresh": False, "base_seed": 7, "batches": 2}
    state |= {"beyond": [4], "batch_size": 4, "length": 6}
    facts = {"generators": {"loader": g}, "batch_size": 4, "length": 6}
    resume = _state.validate(state, **facts)
    assert (resume.batches, resume.beyond, resume.fresh, resume.base_seed) == (
        2,
        frozenset({4}),
        False,
        7,
    )
    with pytest.raises(ValueError, match="batch_size=8"):
        _state.validate(state, **{**facts, "batch_size": 8})
    with pytest.raises(ValueError, match="over 6 batches an epoch, this loader has 5"):
        _state.validate(state, **{**facts, "length": 5})
    with pytest.raises(ValueError, match="generators"):
        _state.validate(state, **{**facts, "generators": {"loader": g, "sampler": gen(4)}})
    with pytest.raises(ValueError, match="not a generator state"):
        _state.validate({**state, "rng": {"loader": rng["loader"][:-8]}}, **facts)
    with pytest.raises(ValueError, match="past 2"):
        _state.validate({**state, "beyond": [1]}, **facts)
    with pytest.raises(ValueError, match="past the epoch's 6"):
        _state.validate({**state, "beyond": [6]}, **facts)


def test_state_between_epochs_starts_the_next_epoch() -> None:
    loader = mt.DataLoader(tensor_ds(20), batch_size=4, shuffle=True, generator=gen(1))
    list(loader)
    state = loader.state_dict()
    assert state["batches"] == 0
    want = [b[1].tolist() for b in loader]
    loader.load_state_dict(state)
    assert [b[1].tolist() for b in loader] == want


def _init_fails_on_worker_1(worker_id: int) -> None:
    if worker_id == 1:
        time.sleep(0.5)  # worker 0 is up first: the loader starts on it (ready="first")
        raise RuntimeError("worker 1's init failed on purpose")


def test_a_later_worker_whose_init_fails_raises_its_error_from_next() -> None:
    loader = mt.DataLoader(
        list(range(8)), batch_size=None, num_workers=2, worker_init_fn=_init_fails_on_worker_1
    )
    with pytest.raises(RuntimeError) as info:
        list(loader)
    err: BaseException | None = info.value
    chain = []
    while err is not None and len(chain) < 10:
        chain.append(err)
        err = err.__cause__
    assert info.value.__cause__ is not info.value
    assert any("worker 1's init failed on purpose" in str(e) for e in chain), chain


def test_a_contiguous_batch_becomes_a_shared_tensor_in_few_calls() -> None:
    # At 2 workers the caller runs this cold once a batch, so its Python calls
    # are its cost: NumPy's ``ctypes.data`` (two calls) and three generators over
    # the strides made 21 calls a batch of one tensor; 8 now. A length-1 axis
    # (whose stride NumPy's contiguity ignores) or a strided array keeps its strides.
    with shm.Arena(1 << 20, name="wire") as arena:
        arrays = [arena.empty((64, 16), np.float32) for _ in range(5)]
        for i, a in enumerate(arrays):
            a[:] = np.arange(a.size, dtype=np.float32).reshape(a.shape) + i
        # Transposed; and C-contiguous to NumPy with a length-1 axis of stride 0.
        odd = [arena.empty((16, 64), np.float32).T, arena.empty((64, 16), np.float32)[:, None]]
        _tensors.from_wire(_tensors.WireTensor(arrays[0]))  # warm: the segment's fd opened
        calls = 0

        def count(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            calls += event == "call"

        wires = [_tensors.WireTensor(a) for a in arrays[1:]]
        sys.setprofile(count)
        try:
            got = [_tensors.from_wire(w) for w in wires]
        finally:
            sys.setprofile(None)
        per_batch = (calls - 1) / 4  # (less the list comprehension's own call)
        for t, a in zip(got, arrays[1:], strict=True):
            assert t.is_shared()
            assert t.stride() == (16, 1)
            assert np.array_equal(t.numpy(), a)
        for a in odd:
            t = _tensors.from_wire(_tensors.WireTensor(a))
            assert t.is_shared()
            assert tuple(s * 4 for s in t.stride()) == a.strides
            assert np.array_equal(t.numpy(), a)
        del got, wires, t, a, arrays, odd
        gc.collect()
    assert per_batch <= 6, per_batch  # 21 before; 8 before _tensor_in inline
