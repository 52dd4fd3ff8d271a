"""``mpexec.torch.DataLoader``: torch's loader, with its workers run by mpexec.

Runs in the caller. The loader picks an epoch's iterator (``_epoch``,
``_iterator``), keeps the epoch's progress for ``state_dict()`` (the format
is ``_state``'s) and the counters of ``stats()`` (``_stats``).
"""

from __future__ import annotations

import copy
import numbers
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader as _TorchLoader

from .._tracebacks import for_caller
from . import _compat, _state
from ._epoch import EpochIter, InlineIter
from ._iterator import WorkersIter
from ._state import (
    Progress,
    Resume,
    load_samplers,
    own_stream,
    rng_states,
    sampler_states,
    set_rng_states,
)
from ._stats import Counters, LoaderStats

__all__ = ["DataLoader"]

_T_co = TypeVar("_T_co", covariant=True)


class DataLoader(_TorchLoader[_T_co]):  # type: ignore[misc]
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

    ``snapshot_every_n_steps`` is torchdata's ``StatefulDataLoader``'s, taken
    for its API: the state here is exact after every batch at no cost, so the
    value changes nothing (an int >= 0, or None).

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

    def __init__(
        self,
        *args: Any,
        warm_batches: int = 0,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        given: object = warm_batches  # NumPy integers too; bool and float refused
        if isinstance(given, bool) or not isinstance(given, numbers.Integral) or int(given) < 0:
            raise ValueError(f"warm_batches must be an int >= 0 (bytes), not {warm_batches!r}")
        warm_batches = int(given)
        if snapshot_every_n_steps is not None and (
            type(snapshot_every_n_steps) is not int or snapshot_every_n_steps < 0
        ):
            raise ValueError(
                "snapshot_every_n_steps must be an int >= 0 or None, "
                f"not {snapshot_every_n_steps!r}"
            )
        super().__init__(*args, **kwargs)
        self.warm_batches = warm_batches
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._mp_progress: Progress | None = None  # the epoch now running, or last run
        self._mp_resume: Resume | None = None  # load_state_dict(), for the next epoch
        self._mp_loaded: dict[str, Any] | None = None  # that state, as given (state_dict())
        # Once resumed without generator=: the loader's own stream (see _state.own_stream).
        self._mp_stream: torch.Generator | None = None
        self._mp_counters = Counters()

    def __iter__(self) -> Any:
        __tracebackhide__ = True  # an error starting the epoch is raised from here
        try:
            return self._start_epoch()
        except Exception as exc:
            # A worker's error (a persistent worker's new epoch): where it was raised.
            raise for_caller(exc)  # noqa: B904

    def _start_epoch(self) -> Any:
        resume = self._mp_resume
        if self.num_workers == 0:
            InlineIter.restore_dataset(self.dataset, self._dataset_kind, resume)
        with own_stream(self._mp_stream):
            it = self._start_epoch_here()
            if self._mp_stream is not None or isinstance(it, InlineIter):
                # The sampler's first draw now (as the workers' prefetch does): from
                # the loader's stream too, and before the dataset's state is taken.
                it.prime()
        if isinstance(it, InlineIter):
            it.restore(resume)  # the dataset's own state: after the stream is put back
            it.snapshot()  # and as the epoch begins (a state taken before its first batch)
        return it

    def _start_epoch_here(self) -> EpochIter:
        resume, self._mp_resume = self._mp_resume, None
        self._mp_loaded = None
        previous = self._mp_progress
        if resume is not None:
            load_samplers(self, resume.samplers)
        samplers = sampler_states(self)  # as the epoch begins (before its sampler iterates)
        persistent = self.persistent_workers and self.num_workers > 0
        kept: WorkersIter | None = self._iterator if persistent else None
        # The uninterrupted run began a resumed epoch with the loader's first
        # workers (fresh) or with kept ones (seeded alike): so does this one.
        reuse = (
            kept is not None
            and kept.alive
            and (resume is None or (not resume.fresh and resume.base_seed == kept.seed))
        )
        if kept is not None and not reuse:
            kept.stop()
            self._iterator = None
        if kept is not None and reuse:
            if resume is not None:
                set_rng_states(self, resume.rng)
            progress = Progress(rng_states(self), fresh=False, base_seed=kept.seed)
            kept.next_epoch(self, progress, resume)
            it: EpochIter = kept
        else:
            fresh = resume is None or resume.fresh
            if resume is not None and fresh:
                set_rng_states(self, resume.rng)
            rng = rng_states(self) if resume is None or fresh else resume.rng
            progress = Progress(rng, fresh=fresh, base_seed=0)
            it = self._make_iterator(progress, resume)
            progress.base_seed = it.seed
            if persistent:
                self._iterator = it
        progress.samplers = samplers
        if resume is None and previous is not None and (reuse or self.num_workers == 0):
            # The same datasets go on (kept workers', the caller's): until a
            # worker's first batch, its state is where the last epoch left it.
            for w, snap in _next_epoch(previous.snapshots).items():
                progress.snapshots.setdefault(w, snap)
        # Only the progress is kept here: an epoch's iterator, and with it its
        # workers and prefetched batches, goes as soon as the caller drops it.
        self._mp_progress = progress
        return it

    def _get_iterator(self) -> Any:
        return self._make_iterator(Progress(rng_states(self), fresh=True, base_seed=0), None)

    def _make_iterator(self, progress: Progress, resume: Resume | None) -> EpochIter:
        if self.num_workers == 0:
            return InlineIter(self, progress, resume, self._mp_counters)
        self.check_worker_number_rationality()
        return WorkersIter(self, progress, resume, self._mp_counters)

    # ------------------------------------------------------------ telemetry
    def stats(self) -> LoaderStats:
        """Where the time goes: the caller's waits, the workers' work, batches in flight.

        Counted over the loader's life. A caller that waits little per batch
        is the bottleneck itself (the model); one that waits about as long as
        a worker takes per batch, divided by the workers, waits on the loader.
        """
        c = self._mp_counters
        it = self._iterator if self._iterator is not None else c.current()
        in_flight = it.in_flight if isinstance(it, EpochIter) else 0
        return c.snapshot(self.num_workers, in_flight)

    # ------------------------------------------------------------ resuming
    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: a small JSON-able dict for :meth:`load_state_dict`.

        It holds the random generators' states at the start of the current
        epoch (the loader's ``generator``, or torch's global one, and the
        sampler's own), whether that epoch started new workers, and which of
        its batches were consumed (yielded, or failed with the dataset's
        error); between epochs, the states now and no batch (and, with
        persistent workers, their base seed: the next epoch keeps them). After
        :meth:`load_state_dict` and before the next epoch starts, the state loaded.
        """
        if self._mp_resume is not None and self._mp_loaded is not None:
            return copy.deepcopy(self._mp_loaded)
        p = self._mp_progress
        state: dict[str, Any] = {"version": _state.STATE_VERSION}
        if p is not None and not p.finished:
            state.update(p.to_state())
        else:
            kept = self._iterator if self.persistent_workers and self.num_workers > 0 else None
            if kept is not None and kept.alive:  # the next epoch draws no base seed
                fresh, base_seed = False, kept.seed
            else:
                fresh, base_seed = True, 0
            with own_stream(self._mp_stream):
                rng = rng_states(self)
            state.update(rng=rng, fresh=fresh, base_seed=base_seed, batches=0, beyond=[])
            samplers = sampler_states(self)
            if samplers:
                state["samplers"] = samplers
            # The datasets that go on into the next epoch (kept workers', the
            # caller's) go on from their states; new workers start anew.
            carried = _next_epoch(p.snapshots) if p is not None else {}
            if carried and (not fresh or self.num_workers == 0):
                state.update(workers={str(w): x for w, x in sorted(carried.items())})
                state.update(ended=[], next_worker=0)
        if "workers" in state:
            state["num_workers"] = self.num_workers
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

        Without ``generator=``, the loader's draws (its epochs' seeds, a
        ``RandomSampler``'s) come from then on from a stream of its own,
        restored from the state, and torch's global generator is left as the
        program set it.

        A state that did not come from :meth:`state_dict` of a loader built
        like this one is refused here, with ``ValueError``.
        """
        self._mp_resume = _state.validate(
            state,
            generators=_state.generators(self),
            batch_size=self.batch_size,
            length=self._mp_length(),
        )
        self._mp_loaded = copy.deepcopy(dict(state))
        if self.generator is None and self._mp_stream is None:
            self._mp_stream = torch.Generator()  # its state: the resumed epoch's, at iter()

    def _mp_length(self) -> int | None:
        """Batches per epoch, where the sampler knows (map-style datasets)."""
        if self._dataset_kind != _compat.DatasetKind.Map:
            return None
        try:
            return len(self)
        except TypeError:
            return None


def _next_epoch(snapshots: dict[int, Any]) -> dict[int, Any]:
    """The workers' states as the next epoch finds them: their epoch's iterators ended.

    A resumed worker loads them (an iterator's ``load_state_dict`` may set the
    worker's random state, as the kept worker's is), then makes the new epoch's
    iterator (``iter(dataset)``), as a kept worker does.
    """
    return {w: {**snap, "ended": True} for w, snap in snapshots.items()}


# Shown and pickled under the public path (torch's test runner checks that a
# process's DataLoader is mpexec.torch's).
DataLoader.__module__ = "mpexec.torch"
