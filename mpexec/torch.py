"""PyTorch back-end: a drop-in ``DataLoader`` over mpexec's workers; pipelines as tensors.

::

    caller (main process)                         shared memory           worker i (WorkerPool)
    ---------------------                         -------------           ---------------------
    __iter__: torch's sampler, generator and      dataset copy, seeded
      base seed (torch's own _BaseDataLoaderIter)                         as torch seeds it;
    task k: a batch of indices  --- task ring i (round robin, pinned) --> get_worker_info() set
                                                                          dataset[idx] ...
                                                                          collate_fn: torch's
                                                  worker arena i  <------ stack writes there
    tensors = torch.from_numpy(view) <-- descriptors --- done ring i ---  (no copy, no pickle)

Batch ``k`` goes to worker ``k mod n`` (skipping workers whose iterable
dataset ended), exactly as in ``torch.utils.data.DataLoader``, so the same
sampler and generator give the same batches, bit for bit. The caller's
tensors are views of the worker's arena: they stay valid for as long as they
are held, after the loader and its workers are gone.

Importing this module imports torch; ``mpexec`` itself never does.
"""

from __future__ import annotations

import base64
import collections.abc
import contextlib
import copy
import itertools
import multiprocessing as mp
import os
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

try:
    import torch
    from torch.utils.data import _utils as _torch_utils
    from torch.utils.data import dataloader as _dl
    from torch.utils.data._utils import collate as _collate
    from torch.utils.data._utils import worker as _torch_worker
except ImportError as _exc:  # pragma: no cover - exercised without torch installed
    raise ImportError(
        "mpexec.torch needs PyTorch, which is not installed: pip install 'mpexec[torch]'"
    ) from _exc

import numpy as np

from . import _launch, _worker
from ._batch import Batch
from ._errors import BrokenPoolError, LoaderTimeoutError
from ._host import default_start_method
from ._pipeline import Pipeline
from ._pool import WorkerPool

__all__ = ["DataLoader", "iterate", "to_torch"]

_STATE_VERSION = 1


# ------------------------------------------------------------------ the loader
class DataLoader(_dl.DataLoader):  # type: ignore[misc]
    """``torch.utils.data.DataLoader``, with its workers run by mpexec.

    The constructor, its checks and its defaults are torch's own (this is a
    subclass): only where batches are fetched and collated changes. With
    ``num_workers=0`` batches are made in the caller, by torch's own
    single-process iterator. With workers, each batch is fetched and collated
    in an mpexec worker, and the collated tensors are built straight in that
    worker's shared memory and reach the caller as tensors over it.

    - The same batches as torch's loader with the same sampler and generator.
    - ``torch.utils.data.get_worker_info()`` works in the dataset and in
      ``worker_init_fn`` (id, num_workers, seed, the worker's dataset copy).
    - A dataset error keeps its type, with the worker's traceback as
      ``__cause__`` and a note naming the worker and the sample index; a dead
      worker is :class:`mpexec.WorkerCrashedError`; ``timeout`` expiring is
      :class:`mpexec.LoaderTimeoutError` (a ``RuntimeError``, as torch's).
    - :meth:`state_dict` / :meth:`load_state_dict` resume an epoch where it
      stopped, in another process.
    """

    _iterator: Any  # torch's: the persistent workers' iterator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mp_rng_at_start: dict[str, Any] | None = None  # RNG states when the epoch began
        self._mp_iter: _EpochIter | None = None  # the epoch now running
        self._mp_resume: dict[str, Any] | None = None  # load_state_dict(), for the next epoch

    def __iter__(self) -> Any:
        resume, self._mp_resume = self._mp_resume, None
        if resume is not None:
            _set_rng_states(self, resume["rng"])
        self._mp_rng_at_start = _rng_states(self)
        skip = resume["batches"] if resume is not None else 0
        kept = self._iterator
        if self.persistent_workers and self.num_workers > 0 and kept is not None and kept.alive:
            it = kept
            it._reset(self, skip=skip)  # noqa: SLF001 - torch's iterator protocol
        else:
            it = self._make_iterator(skip)
            if self.persistent_workers and self.num_workers > 0:
                self._iterator = it
        self._mp_iter = it
        return it

    def _get_iterator(self) -> Any:
        return self._make_iterator(0)

    def _make_iterator(self, skip: int) -> _EpochIter:
        if self.num_workers == 0:
            return _InlineIter(self, skip)
        self.check_worker_number_rationality()
        return _WorkersIter(self, skip)

    # ------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: a small JSON-able dict for :meth:`load_state_dict`.

        It holds the random generators' states at the start of the current
        epoch (the loader's ``generator``, or torch's global one, and the
        sampler's own) and how many batches of it were yielded; between
        epochs, the states now and 0.
        """
        it = self._mp_iter
        if it is not None and not it.finished and self._mp_rng_at_start is not None:
            return {
                "version": _STATE_VERSION,
                "rng": self._mp_rng_at_start,
                "batches": it.yielded,
            }
        return {"version": _STATE_VERSION, "rng": _rng_states(self), "batches": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch.

        The next epoch's iterator restores the generators' states and yields
        exactly the batches an uninterrupted run yields from there. For a
        map-style dataset the batches already yielded are skipped without
        being fetched (so a dataset whose samples depend on more than their
        index, e.g. on a worker's random state, may differ); for an iterable
        dataset they are fetched again and dropped.
        """
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"load_state_dict() needs a dict from DataLoader.state_dict() "
                f"(version {_STATE_VERSION}), not {state!r:.200}"
            )
        batches = state.get("batches")
        if not isinstance(batches, int) or batches < 0:
            raise ValueError(f"state['batches'] must be an int >= 0, not {batches!r}")
        self._mp_resume = {"rng": state["rng"], "batches": batches}


def _generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The generators an epoch draws from, by a stable name."""
    gens = {"loader": loader.generator if loader.generator is not None else torch.default_generator}
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    for name, owner in (
        ("sampler", sampler),
        ("batch_sampler", batch_sampler),
        ("batch_sampler.sampler", getattr(batch_sampler, "sampler", None)),
    ):
        gen = getattr(owner, "generator", None)
        if isinstance(gen, torch.Generator) and all(gen is not g for g in gens.values()):
            gens[name] = gen
    return gens


def _rng_states(loader: DataLoader) -> dict[str, str]:
    return {
        name: base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")
        for name, gen in _generators(loader).items()
    }


def _set_rng_states(loader: DataLoader, states: dict[str, str]) -> None:
    gens = _generators(loader)
    if set(states) != set(gens):
        raise ValueError(
            f"the state was saved from a loader with generators {sorted(states)}, "
            f"this one has {sorted(gens)}: build the loader as it was built then"
        )
    for name, text in states.items():
        raw = np.frombuffer(base64.b64decode(text), np.uint8).copy()
        gens[name].set_state(torch.from_numpy(raw))


# ------------------------------------------------------------------ iterators
class _EpochIter(_dl._BaseDataLoaderIter):  # type: ignore[misc]  # noqa: SLF001 - torch's
    """What an epoch needs beyond torch's base iterator: skipping and counting."""

    finished = False
    _sampler_iter: Iterator[Any]  # torch's: the indices still to come

    @property
    def yielded(self) -> int:
        return int(self._num_yielded)

    def _skip(self, skip: int) -> None:
        """Drop the first ``skip`` batches (see DataLoader.load_state_dict)."""
        if skip and self._dataset_kind == _dl._DatasetKind.Map:  # noqa: SLF001 - torch's
            # The sampler's indices alone decide a map-style batch: skip them unfetched.
            self._sampler_iter = itertools.islice(self._sampler_iter, skip, None)
            self._num_yielded = skip
            self._skipped_unfetched = skip
        else:
            self._skipped_unfetched = 0
        self._to_drop = 0 if self._skipped_unfetched else skip

    def __next__(self) -> Any:
        try:
            while self._to_drop:
                super().__next__()
                self._to_drop -= 1
            return super().__next__()
        except StopIteration:
            self.finished = True
            raise


# torch's single-process iterator: a private class of torch, subclassed as its own loader does.
class _InlineIter(_EpochIter, _dl._SingleProcessDataLoaderIter):  # type: ignore[misc]  # noqa: SLF001
    """``num_workers=0``: torch's own single-process iterator."""

    def __init__(self, loader: DataLoader, skip: int) -> None:
        super().__init__(loader)
        self._skip(skip)


@dataclass
class _WorkerConfig:
    """What every worker gets at its start (pickled once per worker)."""

    dataset: Any
    kind: int
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    base_seed: int
    num_workers: int
    worker_init_fn: Any


class _WorkersIter(_EpochIter):
    """An epoch (or, with ``persistent_workers``, every epoch) over an mpexec pool."""

    def __init__(self, loader: DataLoader, skip: int) -> None:
        super().__init__(loader)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        config = _WorkerConfig(
            dataset=self._dataset,
            kind=self._dataset_kind,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            num_workers=self._num_workers,
            worker_init_fn=loader.worker_init_fn,
        )
        start_method = _start_method(loader.multiprocessing_context)
        _preload_torch(start_method)
        # Forked workers take the config (the dataset above all) from the memory
        # they inherit, as torch's do: nothing is pickled, pages stay shared.
        key = next(_config_keys) if start_method == "fork" else None
        if key is not None:
            _inherited[key] = config
        try:
            self._pool = WorkerPool(
                self._num_workers,
                start_method=start_method,
                worker_init=_start_worker,
                worker_init_args=(config if key is None else key,),
            )
        finally:
            if key is not None:
                del _inherited[key]  # every worker has forked (or failed to)
        self._closer = weakref.finalize(self, _close_pool, self._pool)
        self._reset(loader, first_iter=True, skip=skip)

    def _reset(self, loader: DataLoader, first_iter: bool = False, skip: int = 0) -> None:
        super()._reset(loader, first_iter)
        self.finished = False
        self._skip(skip)
        # task index -> (worker, future of its batch), in the order sent
        self._tasks: dict[int, tuple[int, Future[Any]]] = {}
        self._send_idx = 0
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        # Batch k goes to worker k mod n; a resumed epoch starts where it stopped.
        start = self._skipped_unfetched % self._num_workers
        order = [*range(start, self._num_workers), *range(start)]
        self._worker_cycle = itertools.cycle(order)
        if not first_iter:
            # Behind whatever the last epoch left on each worker (calls pinned
            # to a worker run in order), a fresh fetcher for the new epoch.
            resumed = [
                self._pool.submit_call(_resume_worker, worker=w) for w in range(self._num_workers)
            ]
            for worker, future in enumerate(resumed):
                self._result(future, -1, worker)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _try_put_index(self) -> None:
        # torch's _MultiProcessingDataLoaderIter._try_put_index, over the pool.
        max_tasks = self._prefetch_factor * self._num_workers
        try:
            index = self._next_index()
        except StopIteration:
            return
        for _ in range(self._num_workers):
            worker = next(self._worker_cycle)
            if self._workers_status[worker] and (
                self._in_order
                or self._workers_num_tasks[worker] < max_tasks // sum(self._workers_status)
            ):
                break
        else:
            return
        future = self._pool.submit_call(_fetch, (index,), worker=worker)
        self._tasks[self._send_idx] = (worker, future)
        self._workers_num_tasks[worker] += 1
        self._send_idx += 1

    def _next_data(self) -> Any:
        while True:
            if not self._tasks:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            idx = next(iter(self._tasks)) if self._in_order else self._first_done()
            worker, future = self._tasks.pop(idx)
            self._workers_num_tasks[worker] -= 1
            try:
                data = self._result(future, idx, worker)
            except BaseException:
                self._try_put_index()
                raise
            if data is _ENDED:  # this worker's iterable dataset is exhausted
                self._workers_status[worker] = False
                self._try_put_index()
                continue
            if data is _SKIPPED:  # sent before its worker said it had ended
                continue
            self._try_put_index()
            data = _from_wire(data)
            if self._pin_memory:
                data = _torch_utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data

    def _first_done(self) -> int:
        futures = {future: idx for idx, (_, future) in self._tasks.items()}
        done, _ = wait(futures, timeout=self._timeout or None, return_when=FIRST_COMPLETED)
        if not done:
            idx = next(iter(self._tasks))
            raise self._timed_out(idx, self._tasks[idx][0])
        return min(futures[f] for f in done)

    def _result(self, future: Future[Any], idx: int, worker: int) -> Any:
        try:
            return future.result(timeout=self._timeout or None)
        except FutureTimeoutError:
            raise self._timed_out(idx, worker) from None
        except BrokenPoolError:
            self._shutdown_workers()
            raise

    def _timed_out(self, idx: int, worker: int) -> LoaderTimeoutError:
        what = "to start its epoch" if idx < 0 else f"for batch {idx} of this epoch"
        return LoaderTimeoutError(
            f"DataLoader timed out after {self._timeout} seconds waiting for worker {worker} "
            f"{what}: the dataset or collate_fn is slower than the loader's timeout, or stuck "
            "(raise timeout=, or look at what the worker is doing)"
        )

    @property
    def alive(self) -> bool:
        """Its workers still run (not stopped after a crash or an epoch's end)."""
        return bool(self._closer.alive)

    def _shutdown_workers(self) -> None:
        self.finished = True
        self._tasks = {}
        self._closer()

    def __len__(self) -> int:
        return len(self._index_sampler)


def _start_method(context: Any) -> str:
    """How the workers start: the ``multiprocessing_context``'s way, else torch's default.

    torch starts a DataLoader's workers with multiprocessing's default method
    (``fork`` on Linux before Python 3.14), from the caller: they share the
    caller's pages (torch, the dataset) instead of holding copies. Once CUDA
    is initialised here, the default is mpexec's (a fork server) instead:
    a forked child cannot use the CUDA context it would inherit.
    """
    if context is not None:
        return str(context.get_start_method())
    method = mp.get_start_method(allow_none=True) or mp.get_all_start_methods()[0]
    if method == "fork" and torch.cuda.is_initialized():
        return default_start_method()
    return method


def _preload_torch(start_method: str | None) -> None:
    """Have mpexec's fork server import torch once, so that workers start in milliseconds.

    A worker forked from the server inherits its modules; without this, each
    worker of each epoch imports torch itself (seconds on a busy machine).
    The user's own (standard) fork server is left alone.
    """
    if (start_method or default_start_method()) == "forkserver":
        _launch.preload("torch")


def _close_pool(pool: WorkerPool) -> None:
    pool.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------ in the workers
class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> str:
        return self.name  # pickled by reference: the same object on both sides

    def __repr__(self) -> str:
        return f"mpexec.torch.{self.name}"


_ENDED = _Marker("_ENDED")
_SKIPPED = _Marker("_SKIPPED")


class _WorkerState:
    def __init__(self, config: _WorkerConfig, index: int) -> None:
        self.config = config
        self.index = index
        self.fetched = 0  # samples taken from an iterable dataset so far
        self.exhausted = False  # its iterator raised StopIteration
        self.ended = False  # and the caller was told (later fetches are skipped)
        self.iterator: Iterator[Any] | None = None
        self.new_epoch()

    def new_epoch(self) -> None:
        self.ended = self.exhausted = False
        self.fetched = 0
        self.iterator = None
        if self.config.kind == _dl._DatasetKind.Iterable:  # noqa: SLF001 - torch's
            self.iterator = iter(self.config.dataset)


_state: _WorkerState | None = None

#: Bytes from which a freed block of a worker's arena gives its pages back.
_DISCARD_MIN = 1 << 20

# fork: the configs of pools being started, by key; a forked worker finds its own here.
_inherited: dict[int, _WorkerConfig] = {}
_config_keys = itertools.count()


def _start_worker(config: _WorkerConfig | int) -> None:
    """Set a pool worker up as torch sets up a DataLoader worker.

    ``config`` is the config, or under ``fork`` its key in :data:`_inherited`.
    """
    global _state
    if isinstance(config, int):
        config = _inherited[config]
    here = _worker.current()
    assert here is not None, "mpexec.torch workers run in a WorkerPool"
    index = here[0]
    torch.set_num_threads(1)
    seed = config.base_seed + index
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    # torch's own worker seeding and worker info (no public setter): as in its workers.
    np.random.seed(_torch_worker._generate_state(config.base_seed, index))  # noqa: SLF001
    _torch_worker._worker_info = _torch_worker.WorkerInfo(  # noqa: SLF001
        id=index, num_workers=config.num_workers, seed=seed, dataset=config.dataset
    )
    # torch's default collation stacks tensors into torch's own shared memory
    # in a worker (a segment per batch); here it stacks into this worker's
    # arena, whose arrays travel back by descriptor. torch documents
    # default_collate_fn_map as the place to extend default_collate.
    _collate.default_collate_fn_map[torch.Tensor] = _collate_tensors
    # A batch's pages go back to the system once the caller drops it, as
    # torch's per-batch segments do, rather than staying resident at the
    # arena's high-water mark (batches in flight at the busiest moment).
    here[1].discard_min = _DISCARD_MIN
    if config.worker_init_fn is not None:
        config.worker_init_fn(index)
    _state = _WorkerState(config, index)


def _resume_worker() -> None:
    assert _state is not None
    _state.new_epoch()


def _fetch(index: Any) -> Any:
    """One batch (or sample), fetched and collated as torch's fetchers do."""
    state = _state
    assert state is not None
    if state.ended:
        return _SKIPPED
    config = state.config
    if config.kind == _dl._DatasetKind.Iterable:  # noqa: SLF001 - torch's
        data = _next_samples(state, index)
        if data is _ENDED:
            return _ENDED
        where = f"samples {state.fetched - len(data)}..{state.fetched - 1} of its iterator"
    else:
        data = _get_samples(state, index)
        where = f"sample indices {index}"
    if isinstance(data, _Stacked):
        return _to_wire(data.tensor)
    try:
        return _to_wire(config.collate_fn(data))
    except Exception as exc:
        _note(exc, f"in DataLoader worker {state.index} (pid {os.getpid()}), collating {where}")
        raise


def _get_samples(state: _WorkerState, index: Any) -> Any:
    config = state.config
    dataset = config.dataset
    if not config.auto_collation:
        return _get_one(state, index)
    getitems = getattr(dataset, "__getitems__", None)
    if getitems:
        try:
            return getitems(index)
        except Exception as exc:
            _note(
                exc,
                f"in DataLoader worker {state.index} (pid {os.getpid()}), "
                f"fetching sample indices {index} (__getitems__)",
            )
            raise
    if config.collate_fn is _collate.default_collate and _worker.current() is not None:
        return _get_stacked(state, list(index))
    return [_get_one(state, i) for i in index]


class _Stacked:
    """A batch of single-array samples, already stacked as ``default_collate`` stacks it."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _get_stacked(state: _WorkerState, indices: list[Any]) -> Any:
    """The samples at ``indices``, stacked as they come when each is one array or tensor.

    ``default_collate`` gets the list of samples, then stacks them: a worker
    holds the batch twice. Here a sample that is one ndarray or tensor is
    copied into its row of the batch's block in the arena as soon as it is
    fetched, and dropped. The result is ``default_collate``'s, bit for bit;
    any other sample, or one unlike the first (whose stacking fails or
    promotes), gets the list and ``default_collate`` itself.
    """
    if not indices:
        return []
    first = _get_one(state, indices[0])
    kind = _stack_kind(first)
    if kind is None:
        return [first, *(_get_one(state, i) for i in indices[1:])]
    here = _worker.current()
    assert here is not None
    block = here[1].empty((len(indices), *kind[1]), kind[2])
    out = torch.from_numpy(block)
    _copy_row(block, out, 0, first)
    del first  # only its copy is kept
    for row, i in enumerate(indices[1:], 1):
        sample = _get_one(state, i)
        if _stack_kind(sample) != kind:
            kept = [_row_sample(block, out, r, kind[0]) for r in range(row)]
            return [*kept, sample, *(_get_one(state, j) for j in indices[row + 1 :])]
        _copy_row(block, out, row, sample)
        del sample
    out._mpexec_array = block  # noqa: SLF001 - our tag: travels back by descriptor
    return _Stacked(out)


def _stack_kind(sample: Any) -> tuple[type, tuple[int, ...], Any] | None:
    """(type, shape, NumPy dtype) of a sample stacked in place, or None: default_collate's."""
    if type(sample) is np.ndarray:
        dtype = sample.dtype
        if sample.ndim and dtype.isnative and dtype in _STACKED_NUMPY:
            return np.ndarray, sample.shape, dtype
    elif type(sample) is torch.Tensor:
        dtype = _NUMPY_DTYPES.get(sample.dtype)
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


def _get_one(state: _WorkerState, i: Any) -> Any:
    try:
        return state.config.dataset[i]
    except Exception as exc:
        _note(
            exc,
            f"in DataLoader worker {state.index} (pid {os.getpid()}), fetching sample index {i}",
            i,
        )
        raise


def _next_samples(state: _WorkerState, index: Any) -> Any:
    assert state.iterator is not None
    config = state.config
    wanted = len(index) if config.auto_collation else 1
    data: list[Any] = []
    while len(data) < wanted and not state.exhausted:
        try:
            data.append(next(state.iterator))
        except StopIteration:
            state.exhausted = True
            break
        except Exception as exc:
            _note(
                exc,
                f"in DataLoader worker {state.index} (pid {os.getpid()}), fetching "
                f"sample {state.fetched} of its iterator",
                state.fetched,
            )
            raise
        state.fetched += 1
    if not data or (config.drop_last and config.auto_collation and len(data) < wanted):
        state.ended = True
        return _ENDED
    return data if config.auto_collation else data[0]


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


def _collate_tensors(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """torch's ``collate_tensor_fn``, stacking into this worker's arena."""
    elem = batch[0]
    here = _worker.current()
    dtype = _NUMPY_DTYPES.get(elem.dtype)
    if (
        here is None
        or dtype is None
        or elem.is_nested
        or elem.layout != torch.strided
        or elem.device.type != "cpu"
    ):
        return _collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    array = here[1].empty((len(batch), *elem.shape), dtype)
    out = torch.stack(list(batch), 0, out=torch.from_numpy(array))
    # tensor.numpy() would be a view whose base is the tensor, not the arena's
    # array: keep the array, so the tensor travels back by descriptor.
    out._mpexec_array = array  # noqa: SLF001 - our tag (see _shared_array)
    return out


_NUMPY_DTYPES = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.complex64: np.complex64,
    torch.complex128: np.complex128,
}

_STACKED_NUMPY = {np.dtype(t) for t in _NUMPY_DTYPES.values()}


# ------------------------------------------------------------------ tensors on the wire
class _Tensor:
    """A tensor on its way to the caller: its memory as an ndarray (sent by descriptor)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Tensor, (self.array,))


def _to_wire(data: Any) -> Any:
    return _walk(data, torch.Tensor, _tensor_out)


def _from_wire(data: Any) -> Any:
    return _walk(data, _Tensor, _tensor_in)


def _tensor_out(t: torch.Tensor) -> Any:
    if t.dtype not in _NUMPY_DTYPES or t.layout != torch.strided or t.device.type != "cpu":
        return t  # pickled by torch (a copy): no NumPy view of it exists
    if t.is_conj() or t.is_neg() or t.requires_grad:
        return t
    array = _shared_array(t)
    return _Tensor(array if array is not None else t.numpy())


def _shared_array(t: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """The array of shared memory a loader's tensor is (None if not, or if resized since)."""
    array = getattr(t, "_mpexec_array", None)
    if (
        array is None
        or t.data_ptr() != array.ctypes.data
        or tuple(t.shape) != array.shape
        or tuple(s * t.element_size() for s in t.stride()) != array.strides
    ):
        return None
    return array  # type: ignore[no-any-return]


def _tensor_in(t: _Tensor) -> torch.Tensor:
    tensor = torch.from_numpy(t.array)
    tensor._mpexec_array = t.array  # noqa: SLF001 - our tag: the view of shared memory it is
    return tensor


def _walk(data: Any, kind: type, fn: Any) -> Any:
    """``data`` with each ``kind`` inside replaced by ``fn(it)``, containers kept."""
    if isinstance(data, kind):
        return fn(data)
    if isinstance(data, (str, bytes)):
        return data
    if isinstance(data, collections.abc.Mapping):
        items = {k: _walk(v, kind, fn) for k, v in data.items()}
        if isinstance(data, collections.abc.MutableMapping):
            try:
                clone = copy.copy(data)
                clone.update(items)
                return clone
            except TypeError:
                return items
        try:
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    if isinstance(data, tuple):
        parts = [_walk(v, kind, fn) for v in data]
        if hasattr(data, "_fields"):  # a named tuple
            return type(data)(*parts)
        return tuple(parts) if type(data) is tuple else type(data)(parts)
    if isinstance(data, list):
        parts = [_walk(v, kind, fn) for v in data]
        if type(data) is list:
            return parts
        try:
            seq: list[Any] = copy.copy(data)
            seq[:] = parts
            return seq
        except TypeError:
            return parts
    return data


# ------------------------------------------------------------------ pipelines
def iterate(pipe: Pipeline) -> Iterator[tuple[Any, ...]]:
    """A pipeline's iterations as tuples of torch tensors, through DLPack, no copy.

    A dense output becomes one tensor over the batch's memory (stacked first
    if its op made it sample by sample: ``Batch.as_array``); a ragged one, a
    list of per-sample tensors. The tensors are read-only memory of the
    pipeline: copy one to write to it.
    """
    for outputs in pipe:
        yield tuple(to_torch(b) for b in outputs)


def to_torch(batch: Batch) -> Any:
    """One batch as a tensor over its memory (a list of per-sample tensors if ragged)."""
    if batch.is_dense() and len(batch):
        return torch.from_dlpack(batch)
    return [torch.from_dlpack(s) for s in batch]
