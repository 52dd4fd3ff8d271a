"""An epoch's iterator, as the caller sees it: resuming, counting, telemetry.

Runs in the caller. :class:`EpochIter` adds to torch's base iterator what
an mpexec epoch needs (the batches numbered, a resumed epoch's consumed
ones skipped, the counters of ``stats()``); :class:`InlineIter` is torch's
own single-process iterator with it (``num_workers=0``). The iterator over
workers is ``_iterator.WorkersIter``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

from .._errors import BrokenPoolError, LoaderTimeoutError
from .._tracebacks import for_caller
from . import _compat
from ._fetch import iterable_snapshot, state_of
from ._state import Progress, Resume, set_rng_states
from ._stats import Counters

__all__ = ["EpochIter", "InlineIter"]


class EpochIter(_compat.BaseIter):  # type: ignore[misc]
    """What an epoch needs beyond torch's base iterator: resuming, counting, telemetry."""

    finished = False
    _sampler_iter: Iterator[Any]  # torch's: the indices still to come
    _progress: Progress
    _counters: Counters
    _position = 0  # where in the epoch the batch of the last _next_index() is
    _to_drop = 0

    @property
    def seed(self) -> int:
        """The base seed this iterator's workers were (or would be) seeded from."""
        return int(self._base_seed)

    @property
    def in_flight(self) -> int:
        """Batches sent to workers and not yet yielded."""
        return 0

    def _torch_reset(self, loader: Any) -> None:
        """torch's own ``_reset``: the epoch's sampler iterator (and a datapipe's seed)."""
        super()._reset(loader)

    def _start_at(self, resume: Resume | None) -> None:
        """Number the epoch's batches; skip those a resumed epoch consumed already.

        For a map-style dataset the sampler's indices alone decide a batch:
        consumed ones are skipped unfetched. An iterable dataset's are fetched
        again and dropped (see DataLoader.load_state_dict).
        """
        skip = resume.batches if resume is not None else 0
        beyond = resume.beyond if resume is not None else frozenset()
        self._skipped_unfetched = 0
        self._to_drop = 0
        if self._dataset_kind == _compat.DatasetKind.Map:
            self._sampler_iter = _positions(self._sampler_iter, skip, beyond)
            self._num_yielded = skip
            self._skipped_unfetched = skip
            for position in range(skip):
                self._progress.done(position)
            for position in beyond:
                self._progress.done(position)
        else:
            self._sampler_iter = _positions(self._sampler_iter, 0, frozenset())
            if resume is not None and resume.snapshots and resume.num_workers == self._num_workers:
                # Stateful: each worker's iterator goes on from its state.
                self._progress.consumed = skip
            else:  # the consumed batches are made again, and dropped
                self._to_drop = skip + len(beyond)
        if resume is not None and resume.num_workers == self._num_workers:
            self._progress.snapshots.update(resume.snapshots)
            self._progress.ended.update(resume.ended)
            self._progress.next_worker = resume.next_worker

    def _next_index(self) -> Any:
        self._position, index = next(self._sampler_iter)  # may raise StopIteration
        return index

    def prime(self) -> None:
        """Take the sampler's first index now (it is kept): what it draws, it draws here.

        A ``RandomSampler`` without a generator draws its seed from torch's
        global generator at its first index: a resumed loader has that come
        from its own stream, while it is in place (``_state.own_stream``).
        """
        try:
            head = next(self._sampler_iter)
        except StopIteration:
            return
        self._sampler_iter = itertools.chain([head], self._sampler_iter)

    def _consumed(self, position: int, failed: bool = False) -> None:
        if self._dataset_kind == _compat.DatasetKind.Map:
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


def _caller_snapshot(resume: Resume | None) -> Any:
    """The caller's dataset (and iterator) state a ``num_workers=0`` resume loads, or None."""
    if resume is not None and resume.num_workers == 0:
        return resume.snapshots.get(0)
    return None


def _positions(indices: Iterator[Any], start: int, beyond: frozenset[int]) -> Iterator[Any]:
    """``(position in the epoch, batch indices)`` from ``start``, but those in ``beyond``."""
    numbered = enumerate(itertools.islice(indices, start, None), start)
    return ((p, i) for p, i in numbered if p not in beyond) if beyond else numbered


class InlineIter(EpochIter, _compat.SingleProcessIter):  # type: ignore[misc]
    """``num_workers=0``: torch's own single-process iterator."""

    def __init__(
        self, loader: Any, progress: Progress, resume: Resume | None, counters: Counters
    ) -> None:
        super().__init__(loader)
        self._progress = progress
        self._counters = counters
        self._counters.running(self)
        if resume is not None and not resume.fresh:  # taken from persistent workers' epoch
            set_rng_states(loader, resume.rng)
            self._base_seed = resume.base_seed
            self._torch_reset(loader)
        self._start_at(resume)

    @staticmethod
    def restore_dataset(dataset: Any, kind: Any, resume: Resume | None) -> None:
        """A resumed epoch: an iterable dataset's own state, loaded before the iterator is made.

        torch's single-process iterator calls ``iter(dataset)`` as it is built:
        the state goes in first, so that ``__iter__`` sees it and runs once, as
        in a worker (and in torchdata). Outside the loader's own stream, as
        :meth:`restore`.
        """
        snapshot = _caller_snapshot(resume)
        if (
            snapshot is not None
            and kind == _compat.DatasetKind.Iterable
            and snapshot.get("dataset") is not None
        ):
            dataset.load_state_dict(snapshot["dataset"])

    def restore(self, resume: Resume | None) -> None:
        """A resumed epoch: a map dataset's state, or an iterable one's iterator's, loaded here.

        After the loader's own stream is put back (a dataset that keeps torch's
        global random state sets it here, for its draws to come). An iterable
        dataset's own state went in before this iterator was made
        (:meth:`restore_dataset`).
        """
        snapshot = _caller_snapshot(resume)
        if snapshot is None:
            return
        if self._dataset_kind == _compat.DatasetKind.Map:
            if snapshot.get("dataset") is not None:
                self._dataset.load_state_dict(snapshot["dataset"])
        else:
            # torch's fetcher made the iterator over the dataset as restored: go on from its state.
            fetcher = self._dataset_fetcher
            fetcher.ended = False
            if snapshot.get("iterator") is not None:
                fetcher.dataset_iter.load_state_dict(snapshot["iterator"])
            if snapshot.get("ended"):  # that iterator had ended: this epoch's is a new one
                fetcher.dataset_iter = iter(self._dataset)

    def snapshot(self) -> None:
        """The caller's dataset (and iterator) state now: as the epoch begins, after a batch."""
        if self._dataset_kind == _compat.DatasetKind.Iterable:
            snap = iterable_snapshot(self._dataset, self._dataset_fetcher.dataset_iter)
        else:
            dataset = state_of(self._dataset)
            snap = None if dataset is None else {"dataset": dataset, "iterator": None}
        if snap is not None:
            self._progress.snapshots[0] = snap

    def _next_data(self) -> Any:
        try:
            data = super()._next_data()
        except StopIteration:
            self.snapshot()  # the dataset's state at the epoch's end (its epoch count)
            raise
        except Exception:
            self._consumed(self._position, failed=True)
            self.snapshot()
            raise
        self._consumed(self._position)
        self.snapshot()
        return data
