"""mpexec.torch.DataLoader where PyTorch's own test suite and an adversarial probe found it apart.

Each test here failed before its fix (issue 21): resuming exactly, timeouts
and early exits that lose nothing, errors and telemetry a torch user expects.
"""

from __future__ import annotations

import functools
import gc
import json
import mmap
import multiprocessing as mp
import os
import threading
import time
import typing
from typing import Any

import numpy as np
import psutil
import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset, IterableDataset  # noqa: E402
from torch.utils.data.datapipes.iter import IterableWrapper  # noqa: E402

import mpexec  # noqa: E402
from mpexec import torch as mt  # noqa: E402
from mpexec.torch import _processes, _tensors  # noqa: E402
from tests.adapters.test_torch import assert_same, check_parity, mapping_of  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")


# ------------------------------------------------------------------ the suite's findings
class Count(IterableDataset):  # type: ignore[type-arg]
    """Plain ints, one stream per worker (sharded by get_worker_info())."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        step, first = (1, 0) if info is None else (info.num_workers, info.id)
        return iter(range(first, self.n, step))


def test_iterable_dataset_of_numbers_without_batching() -> None:
    # Each sample is an int: nothing may take its len().
    got = check_parity(lambda cls: cls(Count(9), batch_size=None, num_workers=2))
    assert sorted(got) == list(range(9))


def test_loader_class_is_generic_like_torchs() -> None:
    alias = mt.DataLoader[list[torch.Tensor]]
    assert typing.get_origin(alias) is mt.DataLoader
    assert typing.get_args(alias) == (list[torch.Tensor],)


def _datapipe() -> Any:
    return IterableWrapper(range(40)).shuffle(buffer_size=8).sharding_filter()


@pytest.mark.parametrize("persistent", [False, True])
def test_datapipe_is_sharded_and_reseeded_each_epoch_like_torch(persistent: bool) -> None:
    got = check_parity(
        lambda cls: cls(
            _datapipe(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=persistent
        ),
        epochs=3,
    )
    per_epoch = [sorted(int(i) for b in got[k : k + 10] for i in b) for k in (0, 10, 20)]
    assert per_epoch == [list(range(40))] * 3  # every sample once an epoch: sharded
    orders = [[int(i) for b in got[k : k + 10] for i in b] for k in (0, 10, 20)]
    assert orders[0] != orders[1] != orders[2]  # shuffled anew each epoch


class SharedCounter(Dataset):  # type: ignore[type-arg]
    """Counts its fetches in a multiprocessing.Value, under a Semaphore (torch's test does)."""

    def __init__(self, ctx: Any) -> None:
        self.count = ctx.Value("i", 0)
        self.gate = ctx.Semaphore(1)

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        with self.gate, self.count.get_lock():
            self.count.value += 1
        return i


@pytest.fixture(scope="module")
def mp_helpers() -> None:
    """multiprocessing's own long-lived fds, opened before a test counts fds.

    The heap that holds every Value (one fd, kept for the process's life) and
    the resource tracker that spawn and forkserver children report to.
    """
    from multiprocessing import resource_tracker

    mp.get_context("spawn").Value("i", 0)
    resource_tracker.ensure_running()


@pytest.mark.usefixtures("mp_helpers")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataset_with_multiprocessing_value_and_semaphore(method: str) -> None:
    # They travel as they travel to torch's workers: by name, and by a passed fd.
    ctx = mp.get_context(method)
    data = SharedCounter(ctx)
    loader = mt.DataLoader(data, batch_size=3, num_workers=2, multiprocessing_context=ctx)
    assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert data.count.value == 12  # the workers counted in the caller's memory


# ------------------------------------------------------------------ resuming exactly
class Numbered(Dataset):  # type: ignore[type-arg]
    """Sample i is i (and its square); sample ``bad`` raises, in every epoch."""

    def __init__(self, bad: int = -1) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise KeyError(f"sample {i}")
        return torch.tensor([i, i * i])


def _epoch_of(loader: Any, take_at: int | None = None) -> tuple[list[Any], Any, int]:
    """One epoch's batches ("error" for a failed one); a state taken in it, and where.

    The state is taken once ``take_at`` batches are consumed, or, with
    ``take_at=None``, right after the failed batch (after 2 without one).
    """
    out: list[Any] = []
    state, at = None, -1
    it = iter(loader)
    while True:
        try:
            out.append(next(it))
        except StopIteration:
            break
        except KeyError:
            out.append("error")
            if take_at is None:
                state, at = json.loads(json.dumps(loader.state_dict())), len(out)
        if take_at is not None and len(out) == take_at:
            state, at = json.loads(json.dumps(loader.state_dict())), len(out)
    return out, state, at


RESUME_MATRIX = [
    (persistent, error, nw)
    for persistent in (False, True)
    for error in (False, True)
    for nw in (0, 1, 2)
    if nw or not persistent  # torch refuses persistent workers without workers
]


@pytest.mark.parametrize(("persistent", "error", "nw"), RESUME_MATRIX)
def test_resumed_run_yields_exactly_the_rest(persistent: bool, error: bool, nw: int) -> None:
    def make() -> Any:
        return mt.DataLoader(
            Numbered(bad=7 if error else -1),
            batch_size=3,
            shuffle=True,
            num_workers=nw,
            persistent_workers=persistent,
        )

    torch.manual_seed(2024)  # the loader draws from torch's global generator
    loader = make()
    epochs, states = [], []
    for _ in range(3):
        batches, state, at = _epoch_of(loader, None if error else 2)
        epochs.append(batches)
        states.append((state, at))
    del loader
    for e, (state, at) in enumerate(states):
        assert state is not None
        torch.manual_seed(e)  # whatever the global generator holds now: the state says
        resumed = make()
        resumed.load_state_dict(state)
        got = [b for _ in range(3 - e) for b in _epoch_of(resumed, take_at=-1)[0]]
        want = epochs[e][at:] + [b for later in epochs[e + 1 :] for b in later]
        assert len(got) == len(want), f"state taken in epoch {e}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"epoch {e}, batch {at + i}")
        del resumed


def test_state_counts_failed_batches() -> None:
    loader = mt.DataLoader(Numbered(bad=4), batch_size=3, num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(KeyError):
        next(it)  # batch 1 (samples 3..5) failed: it was consumed all the same
    assert loader.state_dict()["batches"] == 2
    del it


@pytest.mark.parametrize(
    "spoil",
    [
        "not-a-dict",
        "no-version",
        "rng-truncated",
        "rng-garbage",
        "rng-names",
        "batch-size",
        "batches-negative",
        "batches-bool",
        "batches-past-the-end",
        "beyond-garbage",
        "length",
    ],
)
def test_load_state_dict_refuses_what_state_dict_did_not_make(spoil: str) -> None:
    loader = mt.DataLoader(Numbered(), batch_size=3, shuffle=True)
    state: Any = loader.state_dict()
    rng = state["rng"]["loader"]
    if spoil == "not-a-dict":
        state = [state]
    elif spoil == "no-version":
        del state["version"]
    elif spoil == "rng-truncated":
        state["rng"]["loader"] = rng[: len(rng) // 2]
    elif spoil == "rng-garbage":
        state["rng"]["loader"] = "%%" + rng[2:]
    elif spoil == "rng-names":
        state["rng"]["sampler"] = rng
    elif spoil == "batch-size":
        state["batch_size"] = 4
    elif spoil == "batches-negative":
        state["batches"] = -1
    elif spoil == "batches-bool":
        state["batches"] = True
    elif spoil == "batches-past-the-end":
        state["batches"] = 9  # 24 samples in batches of 3: 8 an epoch
    elif spoil == "beyond-garbage":
        state["beyond"] = [0, "x"]
    elif spoil == "length":
        state["length"] = 80
    with pytest.raises(ValueError, match="load_state_dict"):
        loader.load_state_dict(state)
    # Refused at once: the next epoch is an ordinary one.
    assert len(list(loader)) == 8


# ------------------------------------------------------------------ timeouts, early exits
class SlowOnce(Dataset):  # type: ignore[type-arg]
    """Sample ``slow`` takes ``seconds``; every other sample is immediate."""

    def __init__(self, slow: int, seconds: float) -> None:
        self.slow, self.seconds = slow, seconds

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> Any:
        if i == self.slow:
            time.sleep(self.seconds)
        return torch.tensor([i])


@pytest.mark.parametrize("in_order", [True, False])
def test_timeout_loses_no_batch(in_order: bool) -> None:
    loader = mt.DataLoader(
        SlowOnce(slow=2, seconds=3.0), batch_size=2, num_workers=2, timeout=0.5, in_order=in_order
    )
    it = iter(loader)
    got, timeouts = [], 0
    while True:
        try:
            got.append(next(it))
        except mpexec.LoaderTimeoutError:
            timeouts += 1  # as torch: the late batch comes on a later next()
            assert timeouts < 100
        except StopIteration:
            break
    assert timeouts >= 1
    assert sorted(int(x) for b in got for x in b) == list(range(16))
    if in_order:
        assert [int(x) for b in got for x in b] == list(range(16))


def _memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:mpx" in line for line in f)


def _gone(pids: list[int]) -> bool:
    alive = []
    for pid in pids:
        try:
            alive.append(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
        except psutil.NoSuchProcess:
            continue
    return not any(alive)


def test_iterator_lists_its_workers_like_torch() -> None:
    # Code written for torch reads it._workers: pids, is_alive(), join(), exitcode.
    loader = mt.DataLoader(Numbered(), batch_size=2, num_workers=2)
    it = iter(loader)
    workers = it._workers
    assert [w.pid for w in workers] == it._pool.pids
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    next(it)
    del it  # torch's test_iterable_style_dataset: the workers exit, and cleanly
    for w in workers:
        w.join(10)
        assert not w.is_alive()
        assert w.exitcode == 0  # read after the pool closed its Process objects
    w.terminate()  # nothing left to stop: no error


def _second_worker_slow(worker_id: int) -> None:
    if worker_id == 1:
        time.sleep(60)  # still starting when the iterator goes: stopped after the grace


@pytest.mark.parametrize("ours", [True, False], ids=["mpexec", "torch"])
def test_a_worker_its_loader_stops_after_the_grace_exits_0_like_torchs(ours: bool) -> None:
    # torch's worker exits 0 on a SIGTERM from its parent (a C handler): what a worker
    # past the stop's 5 s grace gets (one slow to start, or, on a loaded host, slow to
    # leave: CI's rehearsal saw 143 here once). Ours exits 128 + SIGTERM on one;
    # it._workers reads that as 0 when the loader sent it.
    cls = mt.DataLoader if ours else torch.utils.data.DataLoader
    it = iter(cls(Numbered(), batch_size=2, num_workers=2, worker_init_fn=_second_worker_slow))
    workers = it._workers
    next(it)  # the first worker's
    del it
    for w in workers:
        w.join(30)
    assert [w.exitcode for w in workers] == [0, 0]


def _exit_now() -> None:
    os._exit(0)


def test_worker_reaped_by_another_thread_is_not_alive() -> None:
    # The pool's stop thread reaps a worker while the caller joins it (torch's
    # test_partial_workers): multiprocessing's poll() takes the ECHILD its own
    # waitpid gets for "still running", until the reaping thread has stored
    # the exit code. Here the reaper is this test, storing it 0.3 s late.
    proc = mp.get_context("fork").Process(target=_exit_now)
    proc.start()
    worker = _processes.WorkerProcess(proc)
    _, status = os.waitpid(proc.pid, 0)  # reaped, behind the Process's back
    popen = worker._handle
    late = threading.Timer(0.3, setattr, (popen, "returncode", os.waitstatus_to_exitcode(status)))
    late.start()
    try:
        worker.join(10)
        assert not worker.is_alive()
        assert worker.exitcode == 0
    finally:
        late.join()
        proc.close()


@pytest.mark.parametrize("how", ["break", "exception", "ctrl-c"])
def test_dropped_iterator_frees_workers_and_batches(how: str) -> None:
    loader = mt.DataLoader(Numbered(), batch_size=2, num_workers=2, prefetch_factor=4)
    list(loader)  # one whole epoch first: what an epoch leaves behind is the baseline
    gc.collect()
    maps = _memfd_maps()
    pids: list[int] = []

    def run() -> None:
        it = iter(loader)
        pids.extend(it._pool.pids)
        for i, _ in enumerate(it):
            if i == 1:
                if how == "break":
                    break
                raise KeyboardInterrupt if how == "ctrl-c" else RuntimeError("stop")

    with pytest.raises((RuntimeError, KeyboardInterrupt)) if how != "break" else _nothing():
        run()
    # The loader is still held; the epoch's workers and prefetched batches are not.
    wait_until(lambda: _gone(pids), 10, "the epoch's workers to exit")
    wait_until(lambda: _memfd_maps() <= maps, 10, "the prefetched batches' memory to go")
    assert loader.state_dict()["batches"] == 2  # where it stopped is still known


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------ errors, telemetry
class ExitsAt(Dataset):  # type: ignore[type-arg]
    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            os._exit(7)
        return torch.tensor([i])


def test_worker_crash_names_the_batch_and_its_samples() -> None:
    loader = mt.DataLoader(ExitsAt(5), batch_size=2, num_workers=2)
    with pytest.raises(mpexec.WorkerCrashedError) as info:
        list(loader)
    err = info.value
    assert err.batch == 2
    assert err.indices == [4, 5]
    assert err.worker == 0
    assert "DataLoader worker (pid" in str(err)  # as torch words it
    assert "batch 2" in str(err)
    assert "[4, 5]" in str(err)
    assert err.exitcode == 7


def test_stats_tell_the_loader_from_the_model() -> None:
    loader = mt.DataLoader(Numbered(), batch_size=2, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    assert loader.stats().in_flight > 0
    rest = list(it)
    stats = loader.stats()
    assert stats.batches == 1 + len(rest) == 12
    assert stats.in_flight == 0
    assert stats.failed == 0
    assert sum(stats.worker_batches) == 12
    assert len(stats.worker_batches) == 2
    assert all(b > 0 for b in stats.worker_busy_s)
    assert stats.wait_s > 0
    assert stats.wait_per_batch_s == stats.wait_s / 12
    assert "worker 1: 6 batches" in str(stats)
    del it


# ------------------------------------------------------------------ batches as torch sees them
class Images(Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> Any:
        return torch.full((3, 32, 32), float(i)), i


def test_loader_batches_are_shared_memory_as_torch_knows_it() -> None:
    batches = list(mt.DataLoader(Images(), batch_size=4, num_workers=2))
    for x, _ in batches:
        assert x.is_shared()  # as torch's own batches: sent on by fd, uncopied
        assert mapping_of(x.data_ptr()) == ("rw-s", True)  # the worker's pages, not a copy
    assert [int(x[0, 0, 0, 0]) for x, _ in batches] == [0, 4, 8]
    x = batches[0][0]
    x.add_(100)  # the batch is the caller's: written in place, no one else reads it
    assert int(x[1, 0, 0, 0]) == 101


def test_shared_batches_stay_within_a_budget_of_fds(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each shared batch tensor holds an fd, as torch's do; past the budget, plain tensors.
    monkeypatch.setattr(_tensors, "_fds_budget", 2)
    monkeypatch.setattr(_tensors, "_fds_held", 0)
    batches = [x for x, _ in mt.DataLoader(Images(), batch_size=2, num_workers=2)]
    assert [x.is_shared() for x in batches] == [True, True, False, False, False, False]
    assert [int(x[0, 0, 0, 0]) for x in batches] == [0, 2, 4, 6, 8, 10]
    del batches
    gc.collect()
    assert _tensors.fds_held() == 0


def _twice(xs: list[Any]) -> Any:
    return np.stack(xs) * 2


def test_pipeline_tensors_are_copy_on_write() -> None:
    @mpexec.pipeline_def(batch_size=4, num_workers=2, seed=1)
    def pipe() -> Any:
        src = mpexec.fn.external_source(
            source=lambda info: np.full((128, 128), info.idx_in_epoch, np.float32), batch=False
        )
        out = mpexec.fn.python_function(src, function=_twice, batch_processing=True)
        return out, out, src

    with pipe() as p:
        a, b, src = p.run()
        t = mt.to_torch(a)
        assert mapping_of(t.data_ptr()) == ("rw-p", True)  # the batch's pages, no copy
        rows = [mt.to_torch(src)[i] for i in range(4)]
        t.add_(1)  # writable, as torch's tensors are: it changes this tensor alone
        for r in rows:
            r.mul_(0)
        assert float(t[1, 0, 0]) == 3.0
        assert float(a.as_array()[1, 0, 0]) == 2.0  # not the batch
        assert float(b.as_array()[1, 0, 0]) == 2.0  # nor another output over the same memory
        assert float(mt.to_torch(a)[1, 0, 0]) == 2.0  # nor a later export
        assert [float(x[0, 0]) for x in src] == [0.0, 1.0, 2.0, 3.0]
        ragged = mt.to_torch(src[1:2])
        assert float(ragged[0, 0, 0]) == 1.0
        del t, rows, ragged


# ------------------------------------------------------------------ memory
class Big(Dataset):  # type: ignore[type-arg]
    """Samples of 512 KiB: batches of 4 MiB."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> Any:
        return torch.full((128, 1024), float(i))


def _arena_rss(pid: int) -> int:
    """Bytes of mpexec arena segments resident in ``pid``'s own page tables."""
    total, arena = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                arena = "memfd:mpx-arena" in line
            elif arena and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def _all_in(it: Any) -> bool:
    """Every batch sent has come back (its outcome filed, not yet taken)."""
    return all(key in it._outcomes for _, _, key in it._tasks.values())


def test_workers_let_go_of_made_batches_and_reserve_little() -> None:
    loader = mt.DataLoader(Big(), batch_size=8, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    first = next(it)  # batch 1 is being made meanwhile
    wait_until(functools.partial(_all_in, it), 30, "batch 1")
    # Made and waiting, like the one the caller holds: mapped by the caller
    # alone (as torch's batches in transit are), not counted in the worker too.
    assert _arena_rss(it._pool.pids[0]) < first.nbytes // 2
    assert first.is_shared()
    # The pool's own arena carries only indices: it commits 1 MiB, not 64.
    assert it._pool.stats().arena.reserved <= 1 << 20
    assert [int(b[0, 0, 0]) for b in it] == [8, 16, 24]
    del first, it


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _epoch_faults(**kwargs: Any) -> list[int]:
    """A loader's worker's minor faults in each epoch after the first (persistent workers)."""
    loader = mt.DataLoader(Big(), batch_size=8, num_workers=1, persistent_workers=True, **kwargs)
    it = iter(loader)
    pid = it._pool.pids[0]
    assert [int(b[0, 0, 0]) for b in it] == [0, 8, 16, 24]
    faults = []
    for _ in range(4):
        before = _minor_faults(pid)  # before iter(): it sets the worker going
        it = iter(loader)
        assert [int(b[0, 0, 0]) for b in it] == [0, 8, 16, 24]
        faults.append(_minor_faults(pid) - before)
    del it, loader  # its workers stop here, not with a failed test's frame
    gc.collect()
    return faults


def test_warm_batches_let_a_worker_make_its_next_batches_in_warm_pages() -> None:
    pages = 8 * 128 * 1024 * 4 // mmap.PAGESIZE  # of one batch
    # Default, as torch's segments: each batch's pages are faulted in anew.
    assert min(_epoch_faults()) >= 3 * pages  # of the epoch's 4 batches
    # Warm: the worker takes the dropped batches' pages again, as they are.
    # (Until the worker has had as many batches alive at once as it ever
    # will, which under load can take an epoch or two, one may still need a
    # new block: the quietest epoch is the steady state.)
    assert min(_epoch_faults(warm_batches=64 << 20)) < pages // 4
    # A bound below one batch keeps none of them: batches are given back and
    # faulted in again (but for a block freed and taken again at once, which
    # stays committed either way: about half of them here).
    assert min(_epoch_faults(warm_batches=1 << 20)) >= pages


def test_warm_batches_must_be_a_byte_count() -> None:
    for bad in (-1, True, 1.5, "64M"):
        with pytest.raises(ValueError, match="warm_batches"):
            mt.DataLoader(Big(), batch_size=8, num_workers=1, warm_batches=bad)
    assert mt.DataLoader(Big(), batch_size=8).warm_batches == 0
    # A NumPy integer is an int (numbers.Integral), as a size read from a config often is.
    loader = mt.DataLoader(Big(), batch_size=8, num_workers=1, warm_batches=np.int64(1 << 20))
    assert loader.warm_batches == 1 << 20
    assert type(loader.warm_batches) is int
