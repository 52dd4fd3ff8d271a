"""PyTorch back-end: a drop-in ``DataLoader`` over mpexec's workers; pipelines as tensors.

::

    caller (main process)                         shared memory           worker i (WorkerPool)
    ---------------------                         -------------           ---------------------
    __iter__: torch's sampler, generator and      dataset copy, seeded
      base seed (torch's own _BaseDataLoaderIter)                         as torch seeds it;
    task k: a batch of indices  --- task ring i (round robin, pinned) --> get_worker_info() set
                                                                          dataset[idx] ...
                                                                          collate_fn: torch's
                                                  worker arena i  <------ stack writes there,
                                                                          then unmaps the pages
    tensors over those pages, mapped by  <------ descriptors --- done ring i  (no copy, no pickle)
      torch's allocator (is_shared())

Batch ``k`` goes to worker ``k mod n`` (skipping workers whose iterable
dataset ended), exactly as in ``torch.utils.data.DataLoader``, so the same
sampler and generator give the same batches, bit for bit. The caller's
tensors map the worker's arena pages: they stay valid for as long as they
are held, after the loader and its workers are gone. The loader keeps an
epoch's progress (for ``state_dict()``), never its iterator: dropping the
iterator stops the epoch's workers.

Importing this module imports torch; ``mpexec`` itself never does.
"""

from __future__ import annotations

import base64
import collections.abc
import contextlib
import copy
import ctypes
import functools
import itertools
import mmap
import multiprocessing as mp
import numbers
import os
import resource
import signal
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from multiprocessing import connection as _mp_connection
from typing import Any, TypeVar

try:
    import torch
    from torch.utils.data import IterDataPipe, MapDataPipe
    from torch.utils.data import _utils as _torch_utils
    from torch.utils.data import dataloader as _dl
    from torch.utils.data.graph_settings import apply_random_seed
except ImportError as _exc:  # pragma: no cover - exercised without torch installed
    from ._extras import missing_message

    raise ImportError(missing_message("torch", _exc)) from _exc

import numpy as np

import shm

from . import _launch, _worker
from ._batch import Batch
from ._errors import BrokenPoolError, LoaderTimeoutError, WorkerCrashedError
from ._host import default_start_method
from ._pipeline import Pipeline
from ._pool import WorkerPool
from ._tracebacks import for_caller, reraise

# torch's own collation and worker modules, and its dataset kinds: the loader
# extends them as torch's own does (each reached from here alone).
_collate = _torch_utils.collate
_torch_worker = _torch_utils.worker
_Kind = _dl._DatasetKind  # noqa: SLF001 - torch's map-style / iterable marker

__all__ = ["DataLoader", "LoaderStats", "iterate", "to_torch"]

_STATE_VERSION = 2
_T_co = TypeVar("_T_co", covariant=True)


# ------------------------------------------------------------------ the loader
class DataLoader(_dl.DataLoader[_T_co]):  # type: ignore[misc]
    """``torch.utils.data.DataLoader``, with its workers run by mpexec.

    The constructor, its checks and its defaults are torch's own (this is a
    subclass, generic like torch's): only where batches are fetched and
    collated changes. With ``num_workers=0`` batches are made in the caller,
    by torch's own single-process iterator. With workers, each batch is
    fetched and collated in an mpexec worker, and the collated tensors are
    built straight in that worker's shared memory and reach the caller as
    tensors over it.

    - The same batches as torch's loader with the same sampler and generator.
    - ``torch.utils.data.get_worker_info()`` works in the dataset and in
      ``worker_init_fn`` (id, num_workers, seed, the worker's dataset copy);
      an ``IterDataPipe`` is sharded across the workers and reseeded every
      epoch, as torch does.
    - A dataset error keeps its type, with the worker's traceback as
      ``__cause__`` and a note naming the worker and the sample index; a dead
      worker is :class:`mpexec.WorkerCrashedError` naming the batch and the
      sample indices it was fetching; ``timeout`` expiring is
      :class:`mpexec.LoaderTimeoutError` (a ``RuntimeError``, as torch's),
      and the late batch still comes on the next ``next()``.
    - :meth:`state_dict` / :meth:`load_state_dict` resume an epoch where it
      stopped, in another process; :meth:`stats` says where the time goes.

    One keyword is mpexec's own: ``warm_batches`` (bytes, default 0). As
    torch's batches do, a batch's pages go back to the system once the
    caller drops it, so each batch's pages are faulted in and zeroed again
    in its worker. With ``warm_batches=n`` each worker keeps up to ``n``
    bytes of dropped batches' pages, the newest, for its next batches to
    take warm (and keeps its own mapping of the batches it made): faster
    where making a batch is cheap against its size, for up to ``n`` bytes of
    memory per worker. See docs/loaders.md, "Warm batches".
    """

    _iterator: Any  # torch's: the persistent workers' iterator

    def __init__(self, *args: Any, warm_batches: int = 0, **kwargs: Any) -> None:
        given: object = warm_batches  # NumPy integers too; bool and float refused
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or int(given) < 0:
            raise ValueError(f"warm_batches must be an int >= 0 (bytes), not {warm_batches!r}")
        warm_batches = int(given)
        super().__init__(*args, **kwargs)
        self.warm_batches = warm_batches
        self._mp_progress: _Progress | None = None  # the epoch now running, or last run
        self._mp_resume: _Resume | None = None  # load_state_dict(), for the next epoch
        self._mp_counters = _Counters()

    def __iter__(self) -> Any:
        __tracebackhide__ = True  # an error starting the epoch is raised from here
        try:
            return self._start_epoch()
        except Exception as exc:
            # A worker's error (a persistent worker's new epoch): where it was raised.
            raise for_caller(exc)  # noqa: B904

    def _start_epoch(self) -> Any:
        resume, self._mp_resume = self._mp_resume, None
        persistent = self.persistent_workers and self.num_workers > 0
        kept: _WorkersIter | None = self._iterator if persistent else None
        # The uninterrupted run began a resumed epoch with the loader's first
        # workers (fresh) or with kept ones: so does this one.
        reuse = kept is not None and kept.alive and (resume is None or not resume.fresh)
        if kept is not None and not reuse:
            kept._shutdown_workers()  # noqa: SLF001 - torch's iterator protocol
            self._iterator = None
        if kept is not None and reuse:
            if resume is not None:
                _set_rng_states(self, resume.rng)
            progress = _Progress(_rng_states(self), fresh=False, base_seed=kept._base_seed)  # noqa: SLF001 - torch's iterator's seed
            kept._progress = progress  # noqa: SLF001 - this module's iterator
            kept._reset(self, resume=resume)  # noqa: SLF001 - torch's iterator protocol
            it = kept
        else:
            fresh = resume is None or resume.fresh
            if resume is not None and fresh:
                _set_rng_states(self, resume.rng)
            rng = _rng_states(self) if resume is None or fresh else resume.rng
            progress = _Progress(rng, fresh=fresh, base_seed=0)
            it = self._make_iterator(progress, resume)
            progress.base_seed = int(it._base_seed)  # noqa: SLF001 - torch's iterator's seed
            if persistent:
                self._iterator = it
        # Only the progress is kept here: an epoch's iterator, and with it its
        # workers and prefetched batches, goes as soon as the caller drops it.
        self._mp_progress = progress
        return it

    def _get_iterator(self) -> Any:
        return self._make_iterator(_Progress(_rng_states(self), fresh=True, base_seed=0), None)

    def _make_iterator(self, progress: _Progress, resume: _Resume | None) -> _EpochIter:
        if self.num_workers == 0:
            return _InlineIter(self, progress, resume)
        self.check_worker_number_rationality()
        return _WorkersIter(self, progress, resume)

    # ------------------------------------------------------------ telemetry
    def stats(self) -> LoaderStats:
        """Where the time goes: the caller's waits, the workers' work, batches in flight.

        Counted over the loader's life. A caller that waits little per batch
        is the bottleneck itself (the model); one that waits about as long as
        a worker takes per batch, divided by the workers, waits on the loader.
        """
        c = self._mp_counters
        it = self._iterator if self._iterator is not None else c.current()
        in_flight = len(it._tasks) if isinstance(it, _WorkersIter) and not it.finished else 0  # noqa: SLF001 - this module's iterator
        return LoaderStats(
            num_workers=self.num_workers,
            batches=c.batches,
            failed=c.failed,
            wait_s=c.wait_s,
            in_flight=in_flight,
            worker_busy_s=tuple(c.busy_s),
            worker_batches=tuple(c.worker_batches),
        )

    # ------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: a small JSON-able dict for :meth:`load_state_dict`.

        It holds the random generators' states at the start of the current
        epoch (the loader's ``generator``, or torch's global one, and the
        sampler's own), whether that epoch started new workers, and which of
        its batches were consumed (yielded, or failed with the dataset's
        error); between epochs, the states now and no batch.
        """
        p = self._mp_progress
        state: dict[str, Any] = {"version": _STATE_VERSION}
        if p is not None and not p.finished:
            state.update(
                rng=p.rng,
                fresh=p.fresh,
                base_seed=p.base_seed,
                batches=p.consumed,
                beyond=sorted(p.beyond),
            )
        else:
            state.update(rng=_rng_states(self), fresh=True, base_seed=0, batches=0, beyond=[])
        state.update(batch_size=self.batch_size, length=self._mp_length())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues that epoch.

        The next epoch's iterator restores the generators' states and yields
        exactly the batches an uninterrupted run yields from there. For a
        map-style dataset the batches already consumed are skipped without
        being fetched (so a dataset whose samples depend on more than their
        index, e.g. on a worker's random state, may differ); for an iterable
        dataset they are fetched again and dropped.

        A state that did not come from :meth:`state_dict` of a loader built
        like this one is refused here, with ``ValueError``.
        """
        self._mp_resume = _validate(self, state)

    def _mp_length(self) -> int | None:
        """Batches per epoch, where the sampler knows (map-style datasets)."""
        if self._dataset_kind != _Kind.Map:
            return None
        try:
            return len(self)
        except TypeError:
            return None


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a :class:`DataLoader`'s work over its life (see :meth:`DataLoader.stats`)."""

    num_workers: int
    batches: int  # yielded
    failed: int  # raised the dataset's or collate_fn's error
    wait_s: float  # the caller's time in next(), waiting for batches (or making them)
    in_flight: int  # batches sent to workers and not yet yielded, now
    worker_busy_s: tuple[float, ...]  # per worker: time fetching and collating
    worker_batches: tuple[int, ...]  # per worker: batches made

    @property
    def wait_per_batch_s(self) -> float:
        return self.wait_s / self.batches if self.batches else 0.0

    def __str__(self) -> str:
        lines = [
            (
                f"{self.batches} batches ({self.failed} failed), {self.in_flight} in flight; "
                f"the caller waited {self.wait_s:.3f} s, "
                f"{self.wait_per_batch_s * 1e3:.2f} ms a batch"
            )
        ]
        for w, (busy, n) in enumerate(zip(self.worker_busy_s, self.worker_batches, strict=True)):
            per = busy / n * 1e3 if n else 0.0
            lines.append(f"worker {w}: {n} batches, busy {busy:.3f} s ({per:.2f} ms a batch)")
        return "\n".join(lines)


class _Counters:
    """What :meth:`DataLoader.stats` reports, kept up to date by the loader's iterators."""

    def __init__(self) -> None:
        self.batches = 0
        self.failed = 0
        self.wait_s = 0.0
        self.busy_s: list[float] = []
        self.worker_batches: list[int] = []
        self._current: weakref.ref[_EpochIter] | None = None

    def current(self) -> _EpochIter | None:
        return self._current() if self._current is not None else None

    def running(self, it: _EpochIter) -> None:
        self._current = weakref.ref(it)

    def made(self, worker: int, busy: float) -> None:
        while len(self.busy_s) <= worker:
            self.busy_s.append(0.0)
            self.worker_batches.append(0)
        self.busy_s[worker] += busy
        self.worker_batches[worker] += 1


@dataclass
class _Progress:
    """One epoch, as :meth:`DataLoader.state_dict` describes it."""

    rng: dict[str, str]  # the generators when the epoch began (before its draws)
    fresh: bool  # it began with new workers (so it drew a base seed first)
    base_seed: int  # its workers' base seed
    consumed: int = 0  # batches consumed (yielded or failed): a prefix of the epoch's order
    beyond: set[int] = field(default_factory=set)  # consumed past that prefix (in_order=False)
    finished: bool = False

    def done(self, position: int) -> None:
        """Batch ``position`` of the epoch was consumed."""
        if position != self.consumed:
            self.beyond.add(position)
            return
        self.consumed += 1
        while self.consumed in self.beyond:
            self.beyond.remove(self.consumed)
            self.consumed += 1


@dataclass(frozen=True)
class _Resume:
    rng: dict[str, str]
    fresh: bool
    base_seed: int
    batches: int
    beyond: frozenset[int]


def _validate(loader: DataLoader[Any], state: Any) -> _Resume:
    """The resume point ``state`` describes, or ValueError saying what is wrong with it."""

    def bad(what: str) -> ValueError:
        return ValueError(f"load_state_dict(): {what} (pass what DataLoader.state_dict() returned)")

    if not isinstance(state, collections.abc.Mapping):
        raise bad(f"the state must be a dict, not {type(state).__name__}")
    version = state.get("version")
    if version not in (1, _STATE_VERSION):
        raise bad(f"unknown state version {version!r:.50} (this mpexec writes {_STATE_VERSION})")
    rng = state.get("rng")
    gens = _generators(loader)
    if not isinstance(rng, collections.abc.Mapping) or set(rng) != set(gens):
        names = sorted(rng) if isinstance(rng, collections.abc.Mapping) else rng
        raise bad(
            f"state['rng'] holds generators {names!r:.100}, this loader has {sorted(gens)}: "
            "build the loader as it was built when the state was taken"
        )
    for name, text in rng.items():
        try:
            raw = base64.b64decode(text, validate=True)
            probe = torch.Generator(device=gens[name].device)
            probe.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        except Exception as exc:
            raise bad(f"state['rng'][{name!r}] is not a generator state ({exc})") from None
        if len(raw) != gens[name].get_state().numel():
            raise bad(f"state['rng'][{name!r}] is truncated ({len(raw)} bytes)")
    batches = state.get("batches")
    if type(batches) is not int or batches < 0:
        raise bad(f"state['batches'] must be an int >= 0, not {batches!r:.50}")
    fresh, base_seed, beyond = True, 0, frozenset[int]()
    if version == _STATE_VERSION:
        if state.get("batch_size") != loader.batch_size:
            raise bad(
                f"the state was taken with batch_size={state.get('batch_size')!r:.50}, "
                f"this loader has batch_size={loader.batch_size}"
            )
        length = loader._mp_length()  # noqa: SLF001 - this module's loader
        if state.get("length") != length:
            raise bad(
                f"the state was taken over {state.get('length')!r:.50} batches an epoch, "
                f"this loader has {length}: the same dataset and sampler are needed"
            )
        raw_fresh, raw_seed = state.get("fresh"), state.get("base_seed")
        if type(raw_fresh) is not bool or type(raw_seed) is not int:
            raise bad("state['fresh'] must be a bool and state['base_seed'] an int")
        fresh, base_seed = raw_fresh, raw_seed
        raw_beyond = state.get("beyond")
        if not isinstance(raw_beyond, list) or any(
            type(b) is not int or b <= batches for b in raw_beyond
        ):
            raise bad(f"state['beyond'] must list batch positions past {batches}")
        beyond = frozenset(raw_beyond)
        if length is not None and batches + len(beyond) > length:
            raise bad(f"state['batches'] is {batches}, but an epoch has {length} batches")
        if length is not None and any(b >= length for b in beyond):
            raise bad(f"state['beyond'] names batches past the epoch's {length}")
    return _Resume(dict(rng), fresh, base_seed, batches, beyond)


def _generators(loader: DataLoader[Any]) -> dict[str, torch.Generator]:
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


def _rng_states(loader: DataLoader[Any]) -> dict[str, str]:
    return {
        name: base64.b64encode(gen.get_state().numpy().tobytes()).decode("ascii")
        for name, gen in _generators(loader).items()
    }


def _set_rng_states(loader: DataLoader[Any], states: dict[str, str]) -> None:
    gens = _generators(loader)
    for name, text in states.items():
        raw = np.frombuffer(base64.b64decode(text), np.uint8).copy()
        gens[name].set_state(torch.from_numpy(raw))


# ------------------------------------------------------------------ iterators
class _EpochIter(_dl._BaseDataLoaderIter):  # type: ignore[misc]  # noqa: SLF001 - torch's
    """What an epoch needs beyond torch's base iterator: resuming, counting, telemetry."""

    finished = False
    _sampler_iter: Iterator[Any]  # torch's: the indices still to come
    _progress: _Progress
    _counters: _Counters
    _position = 0  # where in the epoch the batch of the last _next_index() is
    _to_drop = 0

    def _torch_reset(self, loader: DataLoader[Any]) -> None:
        """torch's own ``_reset``: the epoch's sampler iterator (and a datapipe's seed)."""
        super()._reset(loader)

    def _start_at(self, resume: _Resume | None) -> None:
        """Number the epoch's batches; skip those a resumed epoch consumed already.

        For a map-style dataset the sampler's indices alone decide a batch:
        consumed ones are skipped unfetched. An iterable dataset's are fetched
        again and dropped (see DataLoader.load_state_dict).
        """
        skip = resume.batches if resume is not None else 0
        beyond = resume.beyond if resume is not None else frozenset()
        self._skipped_unfetched = 0
        self._to_drop = 0
        if self._dataset_kind == _Kind.Map:
            self._sampler_iter = _positions(self._sampler_iter, skip, beyond)
            self._num_yielded = skip
            self._skipped_unfetched = skip
            for position in range(skip):
                self._progress.done(position)
            for position in beyond:
                self._progress.done(position)
        else:
            self._sampler_iter = _positions(self._sampler_iter, 0, frozenset())
            self._to_drop = skip + len(beyond)

    def _next_index(self) -> Any:
        self._position, index = next(self._sampler_iter)  # may raise StopIteration
        return index

    def _consumed(self, position: int, failed: bool = False) -> None:
        if self._dataset_kind == _Kind.Map:
            self._progress.done(position)
        else:  # counted, not placed: a resumed epoch drops as many
            self._progress.consumed += 1
        if failed:
            self._counters.failed += 1

    def __next__(self) -> Any:
        __tracebackhide__ = True  # a batch's error is raised from here, for the caller
        start = time.perf_counter()
        try:
            while self._to_drop:
                try:
                    super().__next__()
                except (StopIteration, LoaderTimeoutError, BrokenPoolError):
                    raise
                except Exception:
                    pass
                self._to_drop -= 1
            data = super().__next__()
        except StopIteration:
            self.finished = self._progress.finished = True
            raise
        except Exception as exc:
            # The dataset's (or collate_fn's) error, its traceback where it was
            # raised: not the path through torch's iterator and this one.
            raise for_caller(exc)  # noqa: B904
        finally:
            self._counters.wait_s += time.perf_counter() - start
        self._counters.batches += 1
        return data


def _positions(indices: Iterator[Any], start: int, beyond: frozenset[int]) -> Iterator[Any]:
    """``(position in the epoch, batch indices)`` from ``start``, but those in ``beyond``."""
    numbered = enumerate(itertools.islice(indices, start, None), start)
    return ((p, i) for p, i in numbered if p not in beyond) if beyond else numbered


# torch's single-process iterator: a private class of torch, subclassed as its own loader does.
class _InlineIter(_EpochIter, _dl._SingleProcessDataLoaderIter):  # type: ignore[misc]  # noqa: SLF001
    """``num_workers=0``: torch's own single-process iterator."""

    def __init__(
        self, loader: DataLoader[Any], progress: _Progress, resume: _Resume | None
    ) -> None:
        super().__init__(loader)
        self._progress = progress
        self._counters = loader._mp_counters  # noqa: SLF001 - this module's loader
        self._counters.running(self)
        if resume is not None and not resume.fresh:  # taken from persistent workers' epoch
            _set_rng_states(loader, resume.rng)
            self._base_seed = resume.base_seed
            self._torch_reset(loader)
        self._start_at(resume)

    def _next_data(self) -> Any:
        try:
            data = super()._next_data()
        except StopIteration:
            raise
        except Exception:
            self._consumed(self._position, failed=True)
            raise
        self._consumed(self._position)
        return data


@dataclass
class _WorkerConfig:
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


class _WorkersIter(_EpochIter):
    """An epoch (or, with ``persistent_workers``, every epoch) over an mpexec pool."""

    _base_seed: int
    _shared_seed: int | None

    def __init__(
        self, loader: DataLoader[Any], progress: _Progress, resume: _Resume | None
    ) -> None:
        super().__init__(loader)  # torch's: draws the base seed (and a datapipe's shared seed)
        self._progress = progress
        self._counters = loader._mp_counters  # noqa: SLF001 - this module's loader
        self._counters.running(self)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        again = resume is not None and not resume.fresh
        if resume is not None and again:
            # A persistent epoch after the first: its workers were seeded when
            # the loader's first epoch began, and the epoch itself drew only
            # the sampler's (and a datapipe's) seeds, from the states it began with.
            _set_rng_states(loader, resume.rng)
            self._base_seed = resume.base_seed
            self._torch_reset(loader)
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            # torch's: shard the datapipe across the workers, then the user's init.
            shard = _dl._sharding_worker_init_fn  # noqa: SLF001 - torch's, as its loader does
            init_fn = functools.partial(shard, init_fn, self._world_size, self._rank)
        config = _WorkerConfig(
            dataset=self._dataset,
            kind=self._dataset_kind,
            auto_collation=self._auto_collation,
            collate_fn=self._collate_fn,
            drop_last=self._drop_last,
            base_seed=self._base_seed,
            shared_seed=self._shared_seed,
            num_workers=self._num_workers,
            worker_init_fn=init_fn,
            warm_batches=loader.warm_batches,
        )
        self._pool = _start_pool(config, _start_method(loader.multiprocessing_context))
        # batch position -> (worker, future of the batch, its indices), in the
        # order sent: one dict for the iterator's life (its finalizer holds it).
        self._tasks: dict[int, tuple[int, Future[Any], Any]] = {}
        self._closer = weakref.finalize(self, _close_pool, self._pool, self._tasks, True)
        # torch's iterator lists its worker processes; code written for it
        # joins them, or reads their pids and exit codes.
        self._workers = _processes(self._pool)
        self._reset(loader, first_iter=True, resume=resume, draw=not again)

    def _reset(
        self,
        loader: DataLoader[Any],
        first_iter: bool = False,
        *,
        resume: _Resume | None = None,
        draw: bool = True,
    ) -> None:
        if draw:
            super()._reset(loader, first_iter)  # torch's: the sampler, a datapipe's seed
        self.finished = False
        self._start_at(resume)
        self._tasks.clear()
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
                self._pool.submit_call(_resume_worker, (self._shared_seed,), worker=w)
                for w in range(self._num_workers)
            ]
            for worker, future in enumerate(resumed):
                self._wait([future], -1, worker)
                self._outcome(future, -1, worker, None)
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
        try:
            future = self._pool.submit_call(_fetch, (index,), worker=worker)
        except BrokenPoolError as exc:  # a worker died since the last result
            err = self._crashed(exc, -1, worker, None)
            self._shutdown_workers()
            if err is exc:  # not a crash (a worker that could not start): its own cause stays
                raise
            raise err from exc
        self._tasks[self._position] = (worker, future, index)
        self._workers_num_tasks[worker] += 1

    def _next_data(self) -> Any:
        while True:
            if not self._tasks:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if self._in_order:
                position = next(iter(self._tasks))
                worker, future, index = self._tasks[position]
                # Timed out: the batch stays first in line, for the next call (as torch).
                self._wait([future], position, worker)
            else:
                position = self._first_done()
                worker, future, index = self._tasks[position]
            del self._tasks[position]
            self._workers_num_tasks[worker] -= 1
            data = self._outcome(future, position, worker, index)
            if data is _ENDED:  # this worker's iterable dataset is exhausted
                self._workers_status[worker] = False
                self._try_put_index()
                continue
            if data is _SKIPPED:  # sent before its worker said it had ended
                continue
            self._consumed(position)
            self._try_put_index()
            data = _from_wire(data)
            if self._pin_memory:
                data = _torch_utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data

    def _wait(self, futures: list[Future[Any]], position: int, worker: int) -> None:
        done, _ = wait(futures, timeout=self._timeout or None, return_when=FIRST_COMPLETED)
        if not done:
            raise self._timed_out(position, worker)

    def _first_done(self) -> int:
        futures = {future: p for p, (_, future, _) in self._tasks.items()}
        first = next(iter(self._tasks))
        self._wait(list(futures), first, self._tasks[first][0])
        return min(futures[f] for f in futures if f.done())

    def _outcome(self, future: Future[Any], position: int, worker: int, index: Any) -> Any:
        """A finished task's payload; its error, raised (a dead worker ends the epoch)."""
        exc = future.exception(timeout=0)
        if isinstance(exc, BrokenPoolError):
            err = self._crashed(exc, position, worker, index)
            self._shutdown_workers()
            if err is exc:  # not a crash (a worker that could not start): its own cause stays
                raise exc
            raise err from exc
        if exc is not None:
            if position >= 0:
                self._consumed(position, failed=True)
                self._try_put_index()
            reraise(exc)  # the worker's error: __next__ raises it where it was raised
        busy, data = future.result(timeout=0)
        if busy is not None and data is not _ENDED and data is not _SKIPPED:
            self._counters.made(worker, busy)
        return data

    def _crashed(
        self, exc: BrokenPoolError, position: int, task_worker: int, index: Any
    ) -> BrokenPoolError:
        """torch's message for a dead worker, naming the batch and samples it was fetching."""
        if not isinstance(exc, WorkerCrashedError):
            return exc
        pids = self._pool.pids
        worker = pids.index(exc.pid) if exc.pid in pids else task_worker
        # Calls pinned to a worker run in order: the dead one was running the
        # first of its calls that had not finished.
        mine = [
            (p, i)
            for p, (w, f, i) in self._tasks.items()
            if w == worker and not (f.done() and f.exception() is None)
        ]
        if position >= 0 and task_worker == worker:
            mine.append((position, index))
        what = "starting its epoch"
        if mine:
            p, i = min(mine, key=lambda t: t[0])
            samples = (
                f"sample indices {i}"
                if self._dataset_kind == _Kind.Map
                else "samples of its iterable dataset"
            )
            what = f"fetching batch {p} of this epoch ({samples})"
        how = (
            f"is killed by signal: {_signal_text(-exc.exitcode)}"
            if exc.exitcode is not None and exc.exitcode < 0
            else f"exited unexpectedly with exit code {exc.exitcode}"
        )
        err = WorkerCrashedError(
            f"DataLoader worker (pid {exc.pid}) {how}. It was worker {worker}, {what}. {exc.cause}",
            pid=exc.pid,
            exitcode=exc.exitcode,
            cause=exc.cause,
        )
        err.worker = worker  # type: ignore[attr-defined]
        if mine:
            err.batch, err.indices = min(mine, key=lambda t: t[0])  # type: ignore[attr-defined]
        return err

    def _timed_out(self, position: int, worker: int) -> LoaderTimeoutError:
        what = "to start its epoch" if position < 0 else f"for batch {position} of this epoch"
        return LoaderTimeoutError(
            f"DataLoader timed out after {self._timeout} seconds waiting for worker {worker} "
            f"{what}: the dataset or collate_fn is slower than the loader's timeout, or stuck "
            "(the batch is not lost: the next next() waits for it again; raise timeout=, "
            "or look at what the worker is doing)"
        )

    @property
    def alive(self) -> bool:
        """Its workers still run (not stopped after a crash or an epoch's end)."""
        return bool(self._closer.alive)

    def _shutdown_workers(self) -> None:
        """Stop the workers now (torch's name): they finish the batch they make, then exit."""
        self.finished = True
        if self._closer.detach() is not None:
            _close_pool(self._pool, self._tasks, False)

    def __len__(self) -> int:
        return len(self._index_sampler)


def _processes(pool: WorkerPool) -> list[_WorkerProcess]:
    """The pool's worker processes, by worker index (what torch's ``it._workers`` lists)."""
    return [_WorkerProcess(process) for process in pool.processes]


class _WorkerProcess:
    """A worker's ``multiprocessing.Process``, still readable once the pool has closed it.

    The pool joins and closes its processes when it shuts down; torch's
    ``it._workers`` are Process objects that code reads afterwards (``pid``,
    ``exitcode``, ``join()``, ``is_alive()``, ``terminate()``).
    """

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid
        self.name: str = process.name
        # multiprocessing's: it keeps the exit code after the pool's Process.close().
        self._popen = process._popen  # noqa: SLF001

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(ValueError):  # closed: joined already
            self._process.join(timeout)
        self._settle()

    @property
    def exitcode(self) -> int | None:
        code = self._poll()
        if code is None and self._exited():
            code = self._settle()
        return code

    def _poll(self) -> int | None:
        try:
            return self._process.exitcode  # type: ignore[no-any-return]
        except ValueError:  # closed after it exited
            return self._popen.returncode  # type: ignore[no-any-return]

    def _exited(self) -> bool:
        """Its sentinel says it is gone (or the pool closed it, having reaped it)."""
        try:
            return bool(_mp_connection.wait([self._process.sentinel], 0))
        except (ValueError, OSError):
            return True

    def _settle(self) -> int | None:
        """The exit code of a process that is gone, once whoever reaps it has stored it.

        The pool's stop thread may be reaping it at this very moment: then
        multiprocessing's ``poll()`` here gets ECHILD from ``waitpid`` and
        says "still running" until that thread stores the exit code (it waits
        for the GIL to). Bounded: after 5 s, whatever ``poll()`` says.
        """
        deadline = time.monotonic() + 5.0
        code = self._poll()
        while code is None and self._exited() and time.monotonic() < deadline:
            time.sleep(0.001)  # lets the reaping thread run
            code = self._poll()
        return code

    def terminate(self) -> None:
        with contextlib.suppress(ValueError):  # closed: nothing left to stop
            self._process.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ValueError):
            self._process.kill()

    def __repr__(self) -> str:
        return f"<DataLoader worker {self.name} pid={self.pid} exitcode={self.exitcode}>"


def _signal_text(signum: int) -> str:
    try:
        return signal.strsignal(signum) or f"signal {signum}"
    except ValueError:
        return f"signal {signum}"


def _start_pool(config: _WorkerConfig, start_method: str) -> WorkerPool:
    """Workers set up as torch's: under fork they inherit the config, else it travels with them.

    Forked workers take the config (the dataset above all) from the memory
    they inherit, as torch's do: nothing is pickled, pages stay shared. Spawned
    and fork-server workers get it pickled as multiprocessing pickles a
    Process's arguments (so a ``multiprocessing.Value`` or ``Semaphore`` in
    the dataset works, as in torch), with functions and classes by value.
    """
    _preload_torch(start_method)
    if start_method == "fork":
        key = next(_config_keys)
        _inherited[key] = config
        try:
            return WorkerPool(
                config.num_workers,
                start_method=start_method,
                worker_init=_start_worker,
                worker_init_args=(key,),
                arena_size=_ARGS_ARENA,
                worker_arena_size=_WORKER_ARENA,
                # The first batch goes to the first worker up, as torch's does, not
                # once the last has started (each fork of a process with torch in
                # it takes ~5 ms). Every worker has forked when this returns.
                ready="first",
            )
        finally:
            del _inherited[key]  # every worker has forked (or failed to)
    with _launch.sending(config, "the DataLoader's dataset and worker setup") as token:
        return WorkerPool(
            config.num_workers,
            start_method=start_method,
            worker_init=_start_worker,
            worker_init_args=(token,),
            arena_size=_ARGS_ARENA,
            worker_arena_size=_WORKER_ARENA,
        )


#: The pool's own arena carries only the batches' indices to the workers:
#: reserved (committed) memory the default 64 MiB would waste (it grows if needed).
_ARGS_ARENA = 1 << 20
#: Each worker's arena starts this size (committed at once) and grows by a
#: segment per batch that does not fit: batches of a few MiB fit; larger
#: ones (the ones that matter) get segments their size.
_WORKER_ARENA = 8 << 20


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


def _close_pool(pool: WorkerPool, tasks: dict[int, Any], background: bool) -> None:
    """An epoch's end: batches not started are cancelled, prefetched ones dropped, workers stopped.

    As torch's iterator does, a worker gets a grace (5 s) to finish the batch
    it is making and exit by itself (exit code 0), and is terminated after.
    Called as the iterator's finalizer (``background``), the waiting happens
    in a thread of its own: dropping an iterator never blocks.
    """
    running = [f for _, f, _ in tasks.values() if not f.cancel() and not f.done()]
    tasks.clear()  # the prefetched batches go now
    if background:
        threading.Thread(
            target=_stop_pool, args=(pool, running), name="mpexec-loader-stop", daemon=True
        ).start()
    else:
        _stop_pool(pool, running)


def _stop_pool(pool: WorkerPool, running: list[Future[Any]]) -> None:
    _, stuck = wait(running, timeout=_STOP_GRACE)
    running.clear()  # their batches too
    # Nothing left to run: shutdown(wait=True) gives the idle workers their grace.
    pool.shutdown(wait=not stuck, cancel_futures=True)


#: Seconds a worker gets to finish its batch when an epoch is stopped (torch's 5).
_STOP_GRACE = 5.0


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
        if self.config.kind == _Kind.Iterable:
            self.iterator = iter(self.config.dataset)


_state: _WorkerState | None = None

#: Bytes from which a freed block of a worker's arena gives its pages back.
_DISCARD_MIN = 1 << 20

# fork: the configs of pools being started, by key; a forked worker finds its own here.
_inherited: dict[int, _WorkerConfig] = {}
_config_keys = itertools.count()


def _start_worker(config: _WorkerConfig | int | _launch.Sent) -> None:
    """Set a pool worker up as torch sets up a DataLoader worker.

    ``config`` is the config, or its key in :data:`_inherited` (``fork``),
    or the token it was sent with (``spawn``, ``forkserver``).
    """
    global _state
    if isinstance(config, int):
        config = _inherited[config]
    elif isinstance(config, _launch.Sent):
        config = config.receive()
    assert isinstance(config, _WorkerConfig)
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
    _reseed_datapipe(config, config.shared_seed)
    # torch's get_worker_info() reads it (no public setter).
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
    here[1].keep_free = config.warm_batches
    if config.worker_init_fn is not None:
        config.worker_init_fn(index)
    _state = _WorkerState(config, index)


def _reseed_datapipe(config: _WorkerConfig, shared_seed: int | None) -> None:
    """torch's: every worker seeds an IterDataPipe's shuffling alike, anew each epoch."""
    if isinstance(config.dataset, IterDataPipe) and shared_seed is not None:
        shared_rng = torch.Generator()
        shared_rng.manual_seed(shared_seed)
        config.dataset = apply_random_seed(config.dataset, shared_rng)


def _resume_worker(shared_seed: int | None) -> tuple[None, None]:
    assert _state is not None
    _reseed_datapipe(_state.config, shared_seed)
    _state.new_epoch()
    return None, None


def _fetch(index: Any) -> tuple[float, Any]:
    """One batch (or sample), fetched and collated as torch's fetchers do; the time it took."""
    start = time.perf_counter()
    data = _fetch_batch(index)
    return time.perf_counter() - start, data


def _fetch_batch(index: Any) -> Any:
    state = _state
    assert state is not None
    if state.ended:
        return _SKIPPED
    config = state.config
    if config.kind == _Kind.Iterable:
        first = state.fetched
        data = _next_samples(state, index)
        if data is _ENDED:
            return _ENDED
        where = f"samples {first}..{state.fetched - 1} of its iterator"
    else:
        data = _get_samples(state, index)
        where = f"sample indices {index}"
    if isinstance(data, _Stacked):
        return _sent(_to_wire(data.tensor))
    try:
        return _sent(_to_wire(config.collate_fn(data)))
    except Exception as exc:
        _note(exc, f"in DataLoader worker {state.index} (pid {os.getpid()}), collating {where}")
        raise


def _sent(wire: Any) -> Any:
    """A finished batch: the worker lets go of its pages in the arena (they stay shared).

    The worker never reads a batch again once it is made; only the caller
    does. Dropping the worker's own mapping of its pages (``MADV_DONTNEED``
    on shared memory keeps the data: it is the memfd's) leaves them mapped by
    the caller alone, as torch's batches are once sent, instead of counting
    in both processes' memory while the batch waits to be taken. With warm
    batches the worker keeps its mapping: its next batches reuse these pages,
    and each page dropped is a fault to take it again.
    """
    if _state is None or not _state.config.warm_batches:
        _walk(wire, _Tensor, _unmap_own)
    return wire


def _unmap_own(t: _Tensor) -> _Tensor:
    here = _worker.current()
    array = t.array
    if here is not None and array.nbytes >= _DISCARD_MIN and here[1].owns(array):
        start = array.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
        end = array.ctypes.data + _extent(array)
        _libc().madvise(start, end - start, _MADV_DONTNEED)
    return t


_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


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
_TORCH_DTYPES = {np.dtype(n): t for t, n in _NUMPY_DTYPES.items()}


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
    tensor = _shared_tensor(t.array)
    if tensor is None:
        tensor = torch.from_numpy(t.array)
        tensor._mpexec_array = t.array  # noqa: SLF001 - our tag: the view of shared memory it is (see _shared_array)
    return tensor


# ------------------------------------------------------------------ tensors over shared memory
#: Live batch tensors that hold an fd (see _shared_tensor), and their budget.
_fds_held = 0
_fds_budget: int | None = None


def _segment_fd(array: np.ndarray[Any, Any], writable: bool) -> tuple[int, int] | None:
    """An fd of the shared-memory segment ``array`` is a view of, and where its data starts.

    The caller closes the fd. None if ``array`` is in no segment, or the
    segment can no longer be opened (its owner has exited).
    """
    seg = shm.segment_of(array)
    if seg is None:
        return None
    h = seg.handle
    path = f"/proc/{h.owner_pid}/fd/{h.fd}" if h.backend == "memfd" else f"/dev/shm{h.name}"
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError:
        return None
    if os.fstat(fd).st_ino != h.inode:  # the owner is gone, its fd number reused
        os.close(fd)
        return None
    return fd, seg.offset + (array.ctypes.data - seg.address)


def _shared_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor | None:
    """A tensor over ``array``'s shared pages that torch knows are shared (``is_shared()``).

    torch's own batches are in a shared-memory mapping of torch's (one fd
    each), which torch.multiprocessing sends on by fd, uncopied. This maps the
    worker's segment the same way, so a batch goes on to other processes
    without a copy too, and holds ``array`` (so its memory) for as long as
    the storage lives. Each such tensor holds an fd, as torch's do: past a
    quarter of the open-files limit, batches come as plain tensors over the
    same memory instead (None here), rather than leaving the process
    without fds ("Too many open files", torch's well-known failure).
    """
    global _fds_held, _fds_budget
    dtype = _TORCH_DTYPES.get(array.dtype)
    size = array.itemsize
    if (
        dtype is None
        or not array.flags.writeable
        or array.nbytes == 0
        or any(st < 0 or st % size for st in array.strides)
    ):
        return None
    if _fds_budget is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        _fds_budget = (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 4
    if _fds_held >= _fds_budget:
        return None
    found = _segment_fd(array, writable=True)
    if found is None:
        return None
    fd, start = found
    try:
        if start % size:
            return None
        end = start + _extent(array)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, end)  # noqa: SLF001 - torch's fd-backed storage (is_shared); maps a dup of fd
    except RuntimeError:  # out of fds, or of address space: the plain tensor will do
        return None
    finally:
        os.close(fd)
    _fds_held += 1
    # The storage's Python object lives as long as the storage (torch keeps it):
    # so does what it holds, the array (the memory) and the fd's count.
    storage._mpexec_keep = _Held(array)  # noqa: SLF001 - our tag: keeps the memory mapped
    out = torch.empty(0, dtype=dtype)
    out.set_(storage, start // size, array.shape, tuple(st // size for st in array.strides))
    return out


class _Held:
    """What a shared batch tensor's storage holds: its array, and one fd of the budget."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    def __del__(self) -> None:
        global _fds_held
        _fds_held -= 1


def _private_tensor(
    first: np.ndarray[Any, Any], shape: tuple[int, ...], strides: tuple[int, ...], keep: Any
) -> torch.Tensor | None:
    """A writable tensor of ``shape`` and byte ``strides`` from ``first``'s data, copy-on-write.

    Reads share the pages of the segment ``first`` is in, uncopied; a write
    copies the page it touches into memory of this tensor's own
    (``MAP_PRIVATE``), so it changes this tensor only, never the shared memory
    that other batches, consumers or the pipeline read. ``keep`` (the arrays
    the tensor spans) is held as long as the tensor. None if ``first`` is in
    no segment that can be opened.
    """
    dtype = _TORCH_DTYPES.get(first.dtype)
    if dtype is None or any(st < 0 for st in strides) or 0 in shape:
        return None
    found = _segment_fd(first, writable=False)
    if found is None:
        return None
    fd, start = found
    end = start + first.itemsize + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    try:
        base = start // mmap.PAGESIZE * mmap.PAGESIZE
        pages = _map_private(fd, base, end - base)
    except OSError:
        return None
    finally:
        os.close(fd)
    pages._mpexec_keep = keep  # noqa: SLF001 - our tag: keeps the memory mapped; the shared memory stays allocated while the copy reads it
    view: np.ndarray[Any, Any] = np.ndarray(
        shape, first.dtype, buffer=pages, offset=start - base, strides=strides
    )
    return torch.from_numpy(view)


def _extent(array: np.ndarray[Any, Any]) -> int:
    """Bytes from an array's first element to the end of its last (strides >= 0)."""
    last = sum((n - 1) * st for n, st in zip(array.shape, array.strides, strict=True))
    return int(array.itemsize + last)


def _map_private(fd: int, offset: int, length: int) -> Any:
    """``length`` bytes of ``fd`` mapped copy-on-write (``MAP_PRIVATE``); unmapped when dropped.

    libc's mmap, not Python's: Python's keeps a duplicate of the fd for each
    mapping (before 3.13), an open file per tensor.
    """
    libc = _libc()
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    address = libc.mmap(None, length, prot, mmap.MAP_PRIVATE, fd, offset)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    pages = (ctypes.c_char * length).from_address(address)
    weakref.finalize(pages, libc.munmap, address, length)
    return pages


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.mmap.restype = ctypes.c_void_p
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.munmap.restype = ctypes.c_int
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc


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
    """A pipeline's iterations as tuples of torch tensors over the batches' memory, no copy.

    A dense output becomes one tensor (stacked first if its op made it sample
    by sample: ``Batch.as_array``); a ragged one, a list of per-sample
    tensors. See :func:`to_torch` for what writing to them does.
    """
    for outputs in pipe:
        yield tuple(to_torch(b) for b in outputs)


def to_torch(batch: Batch) -> Any:
    """One batch as a tensor over its memory (a list of per-sample tensors if ragged).

    The pipeline's memory is read-only (other outputs, later consumers may
    share it). The tensors are writable, as torch's are, and copy-on-write:
    reading shares the pages, a write copies the pages it touches first, so
    it changes that tensor alone, never the batch or anything else. GPU
    batches come through DLPack, on the consumer's stream.
    """
    if batch.device != "cpu":
        if batch.is_dense() and len(batch):
            return torch.from_dlpack(batch)
        return [torch.from_dlpack(s) for s in batch]
    samples = list(batch)
    if not (batch.is_dense() and samples):
        return [_sample_tensor(s) for s in samples]
    first = samples[0]
    step = samples[1].ctypes.data - first.ctypes.data if len(samples) > 1 else first.nbytes
    seg = shm.segment_of(first)
    if seg is not None and all(
        s.ctypes.data == first.ctypes.data + i * step
        and s.strides == first.strides
        and s.dtype == first.dtype
        and shm.segment_of(s) is seg
        for i, s in enumerate(samples)
    ):
        # Rows of one block (the op made the batch dense, or its samples lie
        # end to end): that memory, copy-on-write.
        shape = (len(samples), *first.shape)
        tensor = _private_tensor(first, shape, (step, *first.strides), samples)
        if tensor is not None:
            return tensor
    # Separate samples, or memory that is not shared: stacked, into a block of the tensor's own.
    return torch.from_numpy(np.stack(samples))


def _sample_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    tensor = _private_tensor(array, array.shape, array.strides, array)
    if tensor is None:  # not in shared memory (a small array rides in its record): a copy
        tensor = torch.from_numpy(np.array(array))
    return tensor
