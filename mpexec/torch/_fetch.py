"""A loader's worker: its config, its setup as torch's, its fetchers, its collation.

Runs in the loader's workers (an mpexec ``WorkerPool``'s); the caller builds
the :class:`WorkerConfig` here and names the entry points. The pool calls
:func:`start_worker` once per worker, then :func:`fetch` per batch and
:func:`resume_worker` per later epoch of persistent workers; these are
pickled by reference, so a spawned or fork-server worker imports this room
and what it needs (``_compat``, ``_tensors``), never a caller room. As
torch's ``_utils/fetch.py``, the two kinds of dataset get two fetcher
classes, picked once per worker. torch's ``default_collate`` stacks tensors
into torch's own shared memory in a worker (a segment per batch); here it
stacks into the worker's arena (:func:`collate_tensors`), and a batch of
single-array samples is stacked row by row as its samples come
(:func:`stack_samples`); a finished batch's pages are then let go by the
worker (:func:`sent`): only the caller maps them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe
from torch.utils.data.graph_settings import apply_random_seed

from .. import _launch, _worker
from . import _compat, _tensors

__all__ = [
    "DISCARD_MIN",
    "ENDED",
    "ROWS_MIN",
    "SKIPPED",
    "WorkerConfig",
    "collate_tensors",
    "fetch",
    "inherited",
    "iterable_snapshot",
    "registered",
    "resume_worker",
    "start_worker",
    "state_of",
]


# ------------------------------------------------------------------ the config
@dataclass
class WorkerConfig:
    """What every worker gets at its start (pickled once per worker, or inherited)."""

    dataset: Any
    kind: int
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    shared_seed: int | None  # an IterDataPipe's, for its shuffling
    num_workers: int
    worker_init_fn: Any
    warm_batches: int  # bytes of dropped batches' pages a worker keeps
    # A resumed epoch: per worker, its dataset's (and iterator's) state to load.
    snapshots: dict[int, Any] | None = None


#: fork: the configs of pools being started, by key; a forked worker finds its own here.
inherited: dict[int, WorkerConfig] = {}
_keys = itertools.count()


@contextlib.contextmanager
def registered(config: WorkerConfig) -> Iterator[int]:
    """``config`` under a key of :data:`inherited` while workers fork (dropped after)."""
    key = next(_keys)
    inherited[key] = config
    try:
        yield key
    finally:
        del inherited[key]  # every worker has forked (or failed to)


# ------------------------------------------------------------------ the fetchers
def iterable_snapshot(dataset: Any, iterator: Any) -> Any:
    """An iterable dataset's and its iterator's states, or None (neither is Stateful).

    A dataset that is its own iterator (``__iter__`` returns ``self``) is
    saved once, as the iterator, and loaded after ``iter()`` (as torchdata
    does: its state may only exist once iteration began).
    """
    dataset_state = None if iterator is dataset else state_of(dataset)
    iterator_state = state_of(iterator)
    if dataset_state is None and iterator_state is None:
        return None
    return {"dataset": dataset_state, "iterator": iterator_state}


def state_of(obj: Any) -> Any:
    """``obj.state_dict()`` if ``obj`` follows the Stateful protocol (torchdata's), else None."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ):
        return obj.state_dict()
    return None


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> str:
        return self.name  # pickled by reference: the same object on both sides

    def __repr__(self) -> str:
        return f"mpexec.torch.{self.name}"


#: A worker's iterable dataset is exhausted (it makes no more batches this epoch).
ENDED = _Marker("ENDED")
#: A batch sent to a worker after its dataset ended: nothing made.
SKIPPED = _Marker("SKIPPED")


class _Fetcher:
    """One worker's batches: its samples fetched and collated as torch's fetchers do."""

    def __init__(self, config: WorkerConfig, index: int) -> None:
        self.config = config
        self.index = index

    def new_epoch(self, snapshot: Any = None) -> None:
        """A later epoch of persistent workers begins (resumed: from ``snapshot``)."""
        if snapshot is not None and snapshot.get("dataset") is not None:
            self.config.dataset.load_state_dict(snapshot["dataset"])

    def fetch(self, index: Any) -> Any:
        raise NotImplementedError

    def snapshot(self) -> Any:
        """The Stateful protocol: the dataset's state now, or None (not Stateful)."""
        dataset = state_of(self.config.dataset)
        return None if dataset is None else {"dataset": dataset, "iterator": None}

    def _collated(self, data: Any, where: str) -> Any:
        if isinstance(data, Stacked):
            wire = _tensors.to_wire(data.tensor)
        else:
            try:
                wire = _tensors.to_wire(self.config.collate_fn(data))
            except Exception as exc:
                _note(exc, f"in {self._who()}, collating {where}")
                raise
        return sent(wire, self.config.warm_batches)

    def _who(self) -> str:
        return f"DataLoader worker {self.index} (pid {os.getpid()})"


class MapFetcher(_Fetcher):
    """A map-style dataset: a batch is the samples at the sampler's indices."""

    def __init__(self, config: WorkerConfig, index: int, snapshot: Any = None) -> None:
        super().__init__(config, index)
        super().new_epoch(snapshot)

    def fetch(self, index: Any) -> Any:
        return self._collated(self._samples(index), f"sample indices {index}")

    def _samples(self, index: Any) -> Any:
        config = self.config
        if not config.auto_collation:
            return self._one(index)
        getitems = getattr(config.dataset, "__getitems__", None)
        if getitems:
            try:
                return getitems(index)
            except Exception as exc:
                _note(exc, f"in {self._who()}, fetching sample indices {index} (__getitems__)")
                raise
        if config.collate_fn is _compat.collate.default_collate and _worker.current() is not None:
            return stack_samples(self._one, self._many, list(index))
        return self._many(index)

    def _one(self, i: Any) -> Any:
        try:
            return self.config.dataset[i]
        except Exception as exc:
            _note(exc, f"in {self._who()}, fetching sample index {i}", i)
            raise

    def _many(self, indices: Any) -> list[Any]:
        """The samples at ``indices``: :meth:`_one`'s, in one frame (a call less a sample)."""
        get = self.config.dataset.__getitem__
        samples: list[Any] = []
        i = None
        try:
            for i in indices:
                samples.append(get(i))
        except Exception as exc:
            _note(exc, f"in {self._who()}, fetching sample index {i}", i)
            raise
        return samples


class IterableFetcher(_Fetcher):
    """An iterable dataset: a batch is the next samples of this worker's iterator."""

    def __init__(self, config: WorkerConfig, index: int, snapshot: Any = None) -> None:
        super().__init__(config, index)
        self.iterator: Iterator[Any] = iter(())
        self.new_epoch(snapshot)

    def new_epoch(self, snapshot: Any = None) -> None:
        self.fetched = 0  # samples taken from the iterator so far
        self.exhausted = False  # the iterator raised StopIteration
        self.ended = False  # and the caller was told (later fetches are skipped)
        super().new_epoch(snapshot)  # the dataset's state first: __iter__ may read it
        self.iterator = iter(self.config.dataset)
        if snapshot is not None and snapshot.get("iterator") is not None:
            self.iterator.load_state_dict(snapshot["iterator"])  # type: ignore[attr-defined]
        if snapshot is not None and snapshot.get("ended"):
            # Its last epoch's iterator, restored, had ended: this epoch's is a new one.
            self.iterator = iter(self.config.dataset)

    def snapshot(self) -> Any:
        """The dataset's and its iterator's states: once, as the iterator's, if they are one."""
        return iterable_snapshot(self.config.dataset, self.iterator)

    def fetch(self, index: Any) -> Any:
        if self.ended:
            return SKIPPED
        first = self.fetched
        data = self._samples(index)
        if data is ENDED:
            return ENDED
        return self._collated(data, f"samples {first}..{self.fetched - 1} of its iterator")

    def _samples(self, index: Any) -> Any:
        config = self.config
        wanted = len(index) if config.auto_collation else 1
        data: list[Any] = []
        while len(data) < wanted and not self.exhausted:
            try:
                data.append(next(self.iterator))
            except StopIteration:
                self.exhausted = True
                break
            except Exception as exc:
                where = f"in {self._who()}, fetching sample {self.fetched} of its iterator"
                _note(exc, where, self.fetched)
                raise
            self.fetched += 1
        if not data or (config.drop_last and config.auto_collation and len(data) < wanted):
            self.ended = True
            return ENDED
        return data if config.auto_collation else data[0]


_fetcher: _Fetcher | None = None


def start_worker(config: WorkerConfig | int | _launch.Sent) -> None:
    """Set a pool worker up as torch sets up a DataLoader worker.

    ``config`` is the config, or its key in :data:`inherited`
    (``fork``), or the token it was sent with (``spawn``, ``forkserver``).
    """
    global _fetcher
    if isinstance(config, int):
        config = inherited[config]
    elif isinstance(config, _launch.Sent):
        config = config.receive()
    assert isinstance(config, WorkerConfig)
    here = _worker.current()
    assert here is not None, "mpexec.torch workers run in a WorkerPool"
    index = here[0]
    torch.set_num_threads(1)
    seed = config.base_seed + index
    random.seed(seed)
    torch.manual_seed(seed)
    # torch's own worker seeding and worker info: as in its workers.
    np.random.seed(_compat.worker_seed_state(config.base_seed, index))
    _reseed_datapipe(config, config.shared_seed)
    _compat.set_worker_info(index, config.num_workers, seed, config.dataset)
    # torch's default collation stacks tensors into torch's own shared memory
    # in a worker (a segment per batch); here it stacks into this worker's
    # arena, whose arrays travel back by descriptor. torch documents
    # default_collate_fn_map as the place to extend default_collate.
    _compat.collate.default_collate_fn_map[torch.Tensor] = collate_tensors
    # A batch's pages go back to the system once the caller drops it, as
    # torch's per-batch segments do, rather than staying resident at the
    # arena's high-water mark (batches in flight at the busiest moment).
    here[1].discard_min = DISCARD_MIN
    here[1].keep_free = config.warm_batches
    if config.worker_init_fn is not None:
        config.worker_init_fn(index)
    kind = MapFetcher if config.kind == _compat.DatasetKind.Map else IterableFetcher
    _fetcher = kind(config, index, (config.snapshots or {}).get(index))


def _reseed_datapipe(config: WorkerConfig, shared_seed: int | None) -> None:
    """torch's: every worker seeds an IterDataPipe's shuffling alike, anew each epoch."""
    if isinstance(config.dataset, IterDataPipe) and shared_seed is not None:
        shared_rng = torch.Generator()
        shared_rng.manual_seed(shared_seed)
        config.dataset = apply_random_seed(config.dataset, shared_rng)


def resume_worker(shared_seed: int | None, snapshot: Any = None) -> tuple[None, None, None]:
    """A later epoch of persistent workers: a datapipe reseeded, a fresh fetcher state.

    ``snapshot``: a resumed epoch's state for this worker's dataset (and iterator).
    """
    assert _fetcher is not None
    _reseed_datapipe(_fetcher.config, shared_seed)
    _fetcher.new_epoch(snapshot)
    return None, None, None


def fetch(index: Any) -> tuple[float, Any, Any]:
    """One batch (or sample), fetched and collated as torch's fetchers do; the time it took.

    And the worker's Stateful snapshot after it (None if the dataset keeps no
    state): the caller keeps the one of the last batch it consumed from this
    worker, so a state is exact after every batch.
    """
    start = time.perf_counter()
    assert _fetcher is not None
    data = _fetcher.fetch(index)
    snapshot = None if data is SKIPPED else _fetcher.snapshot()
    return time.perf_counter() - start, data, snapshot


def _note(exc: BaseException, where: str, sample: Any = None) -> None:
    note = f"mpexec: raised {where}"
    if hasattr(exc, "add_note"):
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
    else:  # pragma: no cover - Python 3.10
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
    if sample is not None:
        with contextlib.suppress(AttributeError):  # exceptions with __slots__
            exc.mpexec_sample = sample  # type: ignore[attr-defined]


# ------------------------------------------------------------------ collation into the arena
#: Bytes from which a freed block of a worker's arena gives its pages back.
DISCARD_MIN = 1 << 20
#: Bytes from which a sample is stacked into its batch's row as it comes. A
#: smaller one goes to ``default_collate`` with its batch: a batch held twice
#: is then a few hundred KiB at most, and one ``torch.stack`` costs 0.1 us a
#: sample where a row's checks and copy cost 4 us warm, 15-30 us a sample in
#: a worker woken cold (one that sleeps or reads between samples).
ROWS_MIN = 16 << 10


class Stacked:
    """A batch of single-array samples, already stacked as ``default_collate`` stacks it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def stack_samples(
    get: Callable[[Any], Any], get_all: Callable[[Any], list[Any]], indices: list[Any]
) -> Any:
    """The samples at ``indices`` (each ``get(i)``), stacked as they come when each is one array.

    ``default_collate`` gets the list of samples, then stacks them: a worker
    holds the batch twice. Here a sample that is one ndarray or tensor of
    :data:`ROWS_MIN` bytes or more is copied into its row of the batch's
    block in the arena as soon as it is fetched, and dropped. The result is
    ``default_collate``'s, bit for bit; any other sample, or one unlike the
    first (whose stacking fails or promotes), gets the list (the rest from
    ``get_all``) and ``default_collate`` itself.
    """
    if not indices:
        return []
    first = get(indices[0])
    kind = _stack_kind(first)
    if kind is None or math.prod(kind[1]) * kind[2].itemsize < ROWS_MIN:
        return [first, *get_all(indices[1:])]
    here = _worker.current()
    assert here is not None
    block = here[1].empty((len(indices), *kind[1]), kind[2])
    out = torch.from_numpy(block)
    _copy_row(block, out, 0, first)
    del first  # only its copy is kept
    for row, i in enumerate(indices[1:], 1):
        sample = get(i)
        if _stack_kind(sample) != kind:
            kept = [_row_sample(block, out, r, kind[0]) for r in range(row)]
            return [*kept, sample, *(get(j) for j in indices[row + 1 :])]
        _copy_row(block, out, row, sample)
        del sample
    return Stacked(_tensors.tag(out, block))  # travels back by descriptor


def _stack_kind(sample: Any) -> tuple[type, tuple[int, ...], Any] | None:
    """(type, shape, NumPy dtype) of a sample stacked in place, or None: default_collate's."""
    if type(sample) is np.ndarray:
        dtype = sample.dtype
        if sample.ndim and dtype.isnative and dtype in _tensors.STACKED_NUMPY:
            return np.ndarray, sample.shape, dtype
    elif type(sample) is torch.Tensor:
        dtype = _tensors.NUMPY_DTYPES.get(sample.dtype)
        if (
            dtype is not None
            and sample.ndim
            and sample.layout == torch.strided
            and sample.device.type == "cpu"
            and not (sample.is_nested or sample.requires_grad)
            and not (sample.is_conj() or sample.is_neg())
        ):
            return torch.Tensor, tuple(sample.shape), np.dtype(dtype)
    return None


def _copy_row(block: np.ndarray[Any, Any], out: torch.Tensor, row: int, sample: Any) -> None:
    if isinstance(sample, np.ndarray):
        np.copyto(block[row], sample, casting="no")
    else:
        out[row].copy_(sample)


def _row_sample(block: np.ndarray[Any, Any], out: torch.Tensor, row: int, kind: type) -> Any:
    """Row ``row`` as the sample it was copied from (for default_collate to stack again)."""
    return block[row].copy() if kind is np.ndarray else out[row].clone()


def collate_tensors(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """torch's ``collate_tensor_fn``, stacking into this worker's arena."""
    elem = batch[0]
    here = _worker.current()
    dtype = _tensors.NUMPY_DTYPES.get(elem.dtype)
    if (
        here is None
        or dtype is None
        or elem.is_nested
        or elem.layout != torch.strided
        or elem.device.type != "cpu"
    ):
        return _compat.collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    array = here[1].empty((len(batch), *elem.shape), dtype)
    out = torch.stack(list(batch), 0, out=torch.from_numpy(array))
    return _tensors.tag(out, array)


def sent(wire: Any, warm_batches: int) -> Any:
    """A finished batch: the worker lets go of its pages in the arena (they stay shared).

    The worker never reads a batch again once it is made; only the caller
    does. Dropping the worker's own mapping of its pages (``MADV_DONTNEED``
    on shared memory keeps the data: it is the memfd's) leaves them mapped by
    the caller alone, as torch's batches are once sent, instead of counting
    in both processes' memory while the batch waits to be taken. With warm
    batches the worker keeps its mapping: its next batches reuse these pages,
    and each page dropped is a fault to take it again.
    """
    if not warm_batches:
        _tensors.walk(wire, _tensors.WireTensor, _unmap_own)
    return wire


def _unmap_own(t: _tensors.WireTensor) -> _tensors.WireTensor:
    here = _worker.current()
    array = t.array
    if here is not None and array.nbytes >= DISCARD_MIN and here[1].owns(array):
        _tensors.discard_pages(array)
    return t
