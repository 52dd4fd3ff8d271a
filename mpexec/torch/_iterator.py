"""An epoch over an mpexec pool: torch's multiprocessing iterator, with mpexec's workers.

Runs in the caller. Batch ``k`` goes to worker ``k mod n`` (skipping
workers whose iterable dataset ended), as in ``torch.utils.data``; each is a
call pinned to its worker (``_fetch.fetch``), whose result comes back as
tensors over the worker's arena (``_tensors.from_wire``). A batch's call has
no ``Future``: the pool's thread hands its outcome to a hook that files it
by the call's key and wakes the caller (:func:`_arrived`).
"""

from __future__ import annotations

import functools
import itertools
import queue
import time
import weakref
from concurrent.futures import Future
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe

from .._errors import BrokenPoolError, LoaderTimeoutError, WorkerCrashedError
from .._pool import read_settled, wait_settled
from .._tracebacks import reraise
from . import _compat, _fetch, _processes, _tensors
from ._epoch import EpochIter
from ._fetch import WorkerConfig
from ._state import Progress, Resume, set_rng_states
from ._stats import Counters

__all__ = ["WorkersIter"]


class WorkersIter(EpochIter):
    """An epoch (or, with ``persistent_workers``, every epoch) over an mpexec pool."""

    _base_seed: int
    _shared_seed: int | None

    def __init__(
        self, loader: Any, progress: Progress, resume: Resume | None, counters: Counters
    ) -> None:
        super().__init__(loader)  # torch's: draws the base seed (and a datapipe's shared seed)
        self._progress = progress
        self._counters = counters
        self._counters.running(self)
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        again = resume is not None and not resume.fresh
        if resume is not None and again:
            # A persistent epoch after the first: its workers were seeded when
            # the loader's first epoch began, and the epoch itself drew only
            # the sampler's (and a datapipe's) seeds, from the states it began with.
            set_rng_states(loader, resume.rng)
            self._base_seed = resume.base_seed
            self._torch_reset(loader)
        init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            # torch's: shard the datapipe across the workers, then the user's init.
            shard = _compat.sharding_worker_init_fn
            init_fn = functools.partial(shard, init_fn, self._world_size, self._rank)
        config = WorkerConfig(
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
            snapshots=_snapshots(resume, self._num_workers),
        )
        method = _processes.start_method(loader.multiprocessing_context)
        self._pool = _processes.start_pool(config, method)
        # batch position -> (worker, its indices, its call's key), in the order
        # sent: one dict for the iterator's life (its finalizer holds it).
        self._tasks: dict[int, tuple[int, Any, int]] = {}
        self._keys = itertools.count()  # unique for the iterator's life: a late
        # outcome of an epoch left early never passes for a batch of the next one.
        self._outcomes: dict[int, Any] = {}
        self._arrivals: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._closer = weakref.finalize(self, _processes.close_pool, self._pool, self._tasks, True)
        # torch's iterator lists its worker processes; code written for it
        # joins them, or reads their pids and exit codes.
        self._workers = _processes.processes(self._pool)
        self._reset(loader, first_iter=True, resume=resume, draw=not again)

    def next_epoch(self, loader: Any, progress: Progress, resume: Resume | None) -> None:
        """Persistent workers: this iterator runs the loader's next epoch."""
        self._progress = progress
        self._reset(loader, resume=resume)

    @property
    def in_flight(self) -> int:
        return 0 if self.finished else len(self._tasks)

    def _reset(
        self,
        loader: Any,
        first_iter: bool = False,
        *,
        resume: Resume | None = None,
        draw: bool = True,
    ) -> None:
        if draw:
            super()._reset(loader, first_iter)  # torch's: the sampler, a datapipe's seed
        self.finished = False
        self._start_at(resume)
        self._tasks.clear()
        # Outcomes of batches the last epoch left in flight land in its own dict.
        self._outcomes = {}
        self._arrivals = queue.SimpleQueue()
        self._hook = functools.partial(_arrived, self._outcomes, self._arrivals.put)
        self._workers_status = [True] * self._num_workers
        self._workers_num_tasks = [0] * self._num_workers
        # Batch k goes to worker k mod n; a resumed epoch starts where it stopped.
        start = self._skipped_unfetched % self._num_workers
        snapshots = _snapshots(resume, self._num_workers)
        if snapshots is not None and self._dataset_kind == _compat.DatasetKind.Iterable:
            # Each worker's iterator goes on from its state: those that had
            # ended stay ended, and the next batch is the next worker's.
            assert resume is not None
            self._workers_status = [w not in resume.ended for w in range(self._num_workers)]
            start = resume.next_worker % self._num_workers
        order = [*range(start, self._num_workers), *range(start)]
        self._worker_cycle = itertools.cycle(order)
        if not first_iter:
            # Behind whatever the last epoch left on each worker (calls pinned
            # to a worker run in order), a fresh fetcher for the new epoch.
            submit = self._pool.submit_call
            resumed = [
                (w, submit(_fetch.resume_worker, (self._shared_seed, snap), worker=w))
                for w, snap in self._resumes(snapshots)
            ]
            for worker, future in resumed:
                self._wait_one(future, -1, worker)
                self._outcome(read_settled(future), -1, worker, None)
        for _ in range(self._prefetch_factor * self._num_workers):
            self._try_put_index()

    def _resumes(self, snapshots: dict[int, Any] | None) -> list[tuple[int, Any]]:
        """The workers whose new epoch runs code of the dataset's, with their snapshots.

        An iterable dataset's worker calls ``iter()`` on it (and reseeds a
        datapipe), each epoch: its error is ``iter(loader)``'s, so every
        worker is resumed, and waited for, before the first batch. A map-style
        dataset's fetcher keeps nothing from one epoch to the next: only a
        worker given a resumed epoch's snapshot has anything to do. The others
        are not sent a round trip for nothing; at 64 workers those were a
        barrier of 15-40 ms before any worker began the epoch.
        """
        snaps = snapshots or {}
        if self._dataset_kind == _compat.DatasetKind.Iterable:
            return [(w, snaps.get(w)) for w in range(self._num_workers)]
        return [(w, snap) for w, snap in sorted(snaps.items()) if snap is not None]

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
        key = next(self._keys)
        try:
            self._pool.submit_hooked(
                _fetch.fetch, (index,), {}, worker, functools.partial(self._hook, key), view=False
            )
        except BrokenPoolError as exc:  # a worker died since the last result
            err = self._crashed(exc, -1, worker, None)
            self._shutdown_workers()
            if err is exc:  # not a crash (a worker that could not start): its own cause stays
                raise
            raise err from exc
        self._tasks[self._position] = (worker, index, key)
        self._workers_num_tasks[worker] += 1

    def _next_data(self) -> Any:
        while True:
            if not self._tasks:
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if self._in_order:
                position = next(iter(self._tasks))
                worker, index, key = self._tasks[position]
                outcome = self._outcomes.pop(key, None)
                if outcome is None:
                    # Timed out: the batch stays first in line, for the next call (as torch).
                    outcome = self._await(position, worker, key)
            else:
                position = self._first_done()
                worker, index, key = self._tasks[position]
                outcome = self._outcomes.pop(key)
            del self._tasks[position]
            self._workers_num_tasks[worker] -= 1
            exc = outcome.exception()  # _read's, inline: a call less a batch
            settled = (None, exc) if exc is not None else (outcome.result(), None)
            data = self._outcome(settled, position, worker, index)
            if data is _fetch.ENDED:  # this worker's iterable dataset is exhausted
                self._workers_status[worker] = False
                self._progress.ended.add(worker)
                self._try_put_index()
                continue
            if data is _fetch.SKIPPED:  # sent before its worker said it had ended
                continue
            self._progress.next_worker = (worker + 1) % self._num_workers
            self._consumed(position)
            self._try_put_index()
            data = _tensors.from_wire(data)
            if self._pin_memory:
                data = _compat.pin_memory(data, self._pin_memory_device)
            return data

    def _wait_one(self, future: Future[Any], position: int, worker: int) -> None:
        """Wait for one batch: on its future's own condition, not ``wait()``'s.

        ``concurrent.futures.wait`` installs a waiter (an ``Event``, its own
        ``Condition``) on the future and takes the future's lock three times: at
        2 workers, where the caller sleeps for nearly every batch and wakes with
        cold caches, that was about 40 Python calls a batch on each side.
        The pool's ``wait_settled`` is the same wait: no polling, as ``wait()``
        never polled. A cancelled batch is settled: ``_outcome`` raises it.
        """
        if not wait_settled(future, self._timeout or None):
            raise self._timed_out(position, worker)

    def _await(self, position: int, worker: int, key: int) -> Any:
        """The outcome of the call ``key`` (batch ``position``), once the pool's thread files it.

        Asleep on the arrivals' queue (the GIL released, a Ctrl-C raised here);
        each arrival wakes it once, whichever batch it is. Past the loader's
        timeout, torch's timeout error: the batch's outcome still lands.
        """
        outcomes, get = self._outcomes, self._arrivals.get
        deadline = time.monotonic() + self._timeout if self._timeout else None
        while key not in outcomes:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._timed_out(position, worker)
            try:  # noqa: SIM105 - suppress() costs three Python calls a wake-up
                get(timeout=left)
            except queue.Empty:
                pass
        return outcomes.pop(key)

    def _first_done(self) -> int:
        """The first batch sent whose outcome is in (``in_order=False``), once one is."""
        outcomes, get = self._outcomes, self._arrivals.get
        first = next(iter(self._tasks))
        deadline = time.monotonic() + self._timeout if self._timeout else None
        while True:
            for position, (_, _, key) in self._tasks.items():
                if key in outcomes:
                    return position
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._timed_out(first, self._tasks[first][0])
            try:  # noqa: SIM105 - suppress() costs three Python calls a wake-up
                get(timeout=left)
            except queue.Empty:
                pass

    def _outcome(
        self, settled: tuple[Any, BaseException | None], position: int, worker: int, index: Any
    ) -> Any:
        """A finished task's payload; its error, raised (a dead worker ends the epoch)."""
        data, exc = settled
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
        busy, data, snapshot = data
        if snapshot is not None and position >= 0:  # the worker's state after this batch
            self._progress.snapshots[worker] = snapshot
        if busy is not None and data is not _fetch.ENDED and data is not _fetch.SKIPPED:
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
        outcomes = self._outcomes
        mine = [
            (p, i)
            for p, (w, i, key) in self._tasks.items()
            if w == worker and not (key in outcomes and _read(outcomes[key])[1] is None)
        ]
        if position >= 0 and task_worker == worker:
            mine.append((position, index))
        what = "starting its epoch"
        if mine:
            p, i = min(mine, key=lambda t: t[0])
            samples = (
                f"sample indices {i}"
                if self._dataset_kind == _compat.DatasetKind.Map
                else "samples of its iterable dataset"
            )
            what = f"fetching batch {p} of this epoch ({samples})"
        how = (
            f"is killed by signal: {_processes.signal_text(-exc.exitcode)}"
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

    def stop(self) -> None:
        """Stop the workers now: they finish the batch they make, then exit."""
        self._shutdown_workers()

    def _shutdown_workers(self) -> None:
        """torch's name for :meth:`stop` (torch's loader and code written for it call it)."""
        self.finished = True
        if self._closer.detach() is not None:
            _processes.close_pool(self._pool, self._tasks, False)

    def __len__(self) -> int:
        return len(self._index_sampler)


def _arrived(outcomes: dict[int, Any], put: Any, key: int, outcome: Any) -> None:
    """A batch's call settled (in the pool's thread): its outcome filed, the caller woken."""
    outcomes[key] = outcome
    put(key)


def _read(outcome: Any) -> tuple[Any, BaseException | None]:
    """``(result, None)`` or ``(None, exception)`` of a settled batch's outcome (what the pool
    hands a hook: ``exception()`` and ``result()`` as a done ``Future``'s).

    Raises ``CancelledError`` for a cancelled one (its epoch was stopped), as
    ``Future.result()`` does.
    """
    exc = outcome.exception()
    return (None, exc) if exc is not None else (outcome.result(), None)


def _snapshots(resume: Resume | None, num_workers: int) -> dict[int, Any] | None:
    """A resumed epoch's per-worker dataset states, if taken with as many workers."""
    if resume is None or not resume.snapshots or resume.num_workers != num_workers:
        return None
    return resume.snapshots
