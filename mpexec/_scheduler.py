"""The scheduler: plan, iteration window, dispatch, chunking and assembly.

::

    Pipeline              Scheduler (main process)                  UnitExecutor
    --------              ------------------------                  ------------
    build()  --------->   plan: ops -> OpState, chains fused
    run() / iteration ->  window: _Iterations in flight, enough for
                            prefetch_depth units per worker (within
                            a memory budget)
                            launch: sources that run here
                            (iterables, batch callables,
                            feed_input) -> executor.share()
                            all sources in: batch size known;
                            iterations compute in order
                          dispatch: an op whose inputs are in
                            (another executor's column it   -->  handoff(column): a
                            cannot read: handed off first)        Future (a GPU thread's
                                                                  D2H copy)
                            chunking: k chunks of the batch (whole
                            batches once quick samples are known)
                            one WorkUnit per chunk  ----------->  submit_unit(unit)
                                                                    its runner on its rows:
                                                                    in a worker (WorkerPool,
                                                                    RayPool), here
                                                                    (num_workers=0), or on
                                                                    the GPU thread
                          assembly  <---- Future[ChunkResult] ----  done callback (any
                            chunks in order -> columns;             thread)
                            dependants dispatched
    run() returns i  <--  all outputs in: tuple of Batch

    who owns what: the Pipeline owns the WorkerPool it started (and so its
    arenas and rings; a pool given with ``pool=`` stays its owner's) and
    its GPU stage; the Scheduler owns the iterations in flight and each op's state;
    a Batch owns (keeps alive) the views of shared memory it hands out.

The unit of work is a ``WorkUnit`` (one chunk of an iteration through an op
or a fused chain of per-sample ops, or a whole batch through a per-sample
source's chain and the batch op it feeds); what runs units is a ``UnitExecutor``.
Both live in :mod:`mpexec._executors`, whose docstring is the protocol. The
scheduler knows nothing of devices: it picks each op's executor once, by the
op's device, and from then on asks that executor for what differs (its
runner, the bytes it copies, a column handed to another executor, the
columns and ``Batch`` of its results). A chain never spans two executors.
Arrays never pass through the scheduler by value: a result is a view of a
worker's arena, and handing it to the next op sends its descriptor on.
Randomness depends only on (seed, op, epoch, iteration, sample), so results do
not depend on the executor, chunking, prefetch or timing. Stateful ops run in
iteration order on one worker: each has a turn counter, and an iteration's call
waits for its turn.

Scaling to many workers: a chunk costs the main process about the same CPU
whatever it carries, so a batch cut into a chunk per worker would cost it more a
sample the more workers there are. Once an op's calls have shown how long a
sample takes, its chunks are whole batches (fewer samples only where a batch
would take over the CPU time of the one chunk policy, _mapping.calls_in_chunk),
and the window holds enough iterations for every worker to have prefetch_depth units of
work (a stateless batch op's call is one unit: a whole batch), as many as
_WINDOW_BYTES of their outputs allow; where it allows fewer, batches are cut
smaller again. Results come back a chunk, so a batch, at a time.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from . import _branches, _grouping
from ._batch import Batch
from ._chains import batch_in_workers, fuse_chains
from ._errors import MpexecError, PoolClosedError
from ._executors import UnitExecutor, WorkUnit, op_runner
from ._graph import DataNode, Plan, Scope
from ._grouping import Held, fill_plan, groupable, grouped_window
from ._iterations import (
    Iteration,
    OpState,
    OpStats,
    annotate,
    assemble,
    assemble_one,
    next_item,
    one_pass,
    pull,
)
from ._mapping import calls_in_chunk
from ._modes import WORKER_SOURCES, Device, LastBatch, OpKind, SourceMode
from ._runtime import Chunk, ChunkResult, derive_seed, nbytes
from ._source_runners import batch_rows, own_columns

# How an op's batch is cut into chunks, how many iterations in flight (_chunk_count, window).
_MAX_CHUNKS_PER_WORKER = 4  # chunks of one op's batch, per worker, at most
_FIRST_CHUNKS = 16  # chunks of one op's batch at most, until a sample's CPU time is known
_WINDOW_BYTES = 1 << 30  # what the iterations in flight may hold (their outputs)
_WAIT_SECONDS = 1.0  # how often a waiting run() looks whether the pipeline closed


class Scheduler:
    """Runs a planned graph's iterations over a :class:`UnitExecutor`.

    Thread-safe: ``next_result``, ``reset``, ``feed`` and ``close`` take the
    scheduler's lock; chunk results come back on the executor's threads.
    """

    def __init__(
        self,
        plan: Plan,
        executor: UnitExecutor,
        *,
        batch_size: int,
        prefetch_depth: int,
        seed: int,
        last_batch: str,
        debug: bool,
        gpu: UnitExecutor | None = None,
    ) -> None:
        self.batch_size = batch_size
        self.prefetch_depth = prefetch_depth
        self.last_batch = LastBatch(last_batch)
        self.executor = executor  # the default one of each op
        self._workers = executor.workers
        self._plan = plan
        self._lock = threading.RLock()
        self._window: collections.deque[Iteration] = collections.deque()
        # The iterations of the window not computing yet, in order (_sources_in).
        self._waiting: collections.deque[Iteration] = collections.deque()
        self.handed: tuple[Iteration, int] | None = None  # run()'s last (counts: delivered)
        self.hand_outs = 0  # next_result's hand-outs so far (an int: holds no batch)
        self._epoch = 0
        self._next_index = 0
        self._next_seq = 0
        self._ending = False  # a source ended this epoch: launch no more
        # Where the last epoch ended (its iteration with a source's end): an epoch
        # launches no further until that iteration came in without one, rather than
        # a window of iterations past its end (W x prefetch_depth dispatches wasted).
        self._end: int | None = None
        self._closed = False
        self._interrupted = False  # a step here raised (a Ctrl-C lands anywhere): _resume
        self._delivered = 0  # iterations of this epoch handed to the caller
        self.busy: dict[int, float] = collections.defaultdict(float)  # pid -> seconds
        self.faults = 0  # minor page faults in the workers' chunks (ChunkResult.faults)
        self._pos = {id(op): i for i, op in enumerate(plan.ops)}
        self.ops: list[OpState] = []
        # Each op's executor, by its device: GPU ops run in this process, on the
        # GPU stage's thread. Stateful ops take that executor's workers in turn.
        executors: dict[str, UnitExecutor] = {Device.CPU: executor}
        if gpu is not None:
            executors[Device.GPU] = gpu
        n_stateful: dict[int, int] = collections.defaultdict(int)
        for i, op in enumerate(plan.ops):
            ex = executors[op.device]
            runner = None
            if op.kind in (OpKind.SPLIT, OpKind.MERGE):
                pass  # rows selected here (_select)
            elif not op.is_source or op.source_mode in WORKER_SOURCES:
                make = getattr(ex, "runner", None) or op_runner
                runner = make(op, derive_seed(seed, op.index, op.seed), debug=debug)
            worker = None
            if op.stateful:
                worker = n_stateful[id(ex)] % max(1, ex.workers)
                n_stateful[id(ex)] += 1
            self.ops.append(OpState(op, i, runner, worker, ex))
        # (A branch's predicate is waited for, and read, by the ops in that branch:
        # its op is never absorbed into a chain, whose values stay in the workers.)
        self._consumers = [
            sorted({self._pos[id(c)] for c in plan.ops if any(n.op is op for n in c.waits())})
            for op in plan.ops
        ]
        # Per-sample ops that only feed the next one run inside its call (_chains).
        outputs = {self._pos[id(n.op)] for n in plan.outputs}
        drop = self.last_batch is LastBatch.DROP
        fuse_chains(self.ops, self._consumers, outputs, executor, drop)
        # What sizes the window (iterations in flight, see the window property):
        # per op run by the pipeline's workers (stateless), the chunks its last
        # batch was cut into -- a batch op's call is one, known now -- and the
        # bytes one iteration's outputs hold (learned from the first one).
        self._units = {s.pos: 1 for s in self.ops if batch_in_workers(s, executor)}
        self._batch_op = bool(self._units)  # a batch op's call takes a whole batch
        # GPU ops' outputs in flight are device memory, which the budget does not
        # see: there the window stays prefetch_depth (but for a batch op's).
        self._other_executor = any(s.executor is not executor for s in self.ops)
        self._iteration_bytes = 0
        # The window, its cap, iterations a unit (_grouping): kept till what sizes them changes.
        self._window_size = self._cap = self._group = 0
        self._defer: Held | None = None
        self._held = Held(self._fail, annotate)  # (each fill's, _fill)
        # What every iteration walks, worked out once: the plan does not change.
        self._sources = [s for s in self.ops if s.source and not s.absorbed]
        self._here = [s for s in self._sources if s.runner is None]
        self._fed = [s for s in self.ops if s.op.source_mode == SourceMode.FEED]
        self._computed = sum(1 for s in self.ops if not (s.source or s.absorbed))
        self._outputs = [(self.ops[self._pos[id(n.op)]], n) for n in plan.outputs]
        for s in self.ops:  # (producer, output index) of each input; the ops a unit runs
            s.producers = [(self.ops[self._pos[id(n.op)]], n.index) for n in s.inputs]
            s.names = tuple(m.op.name for m in s.members)
            s.groupable = groupable(s, executor)
        self._most, self._arena = _grouping.bounds(self.ops, executor)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def window(self) -> int:
        """Iterations in flight at most: ``prefetch_depth`` units of work per worker.

        An iteration gives the workers as many units as its ops' batches are
        cut into (:meth:`_chunk_count`): one, for a batch op or a per-sample
        op whose chunks are whole batches. So the window is ``prefetch_depth
        x workers / units`` iterations, at least ``prefetch_depth`` and within
        what ``_WINDOW_BYTES`` holds of them (:meth:`_window_cap`). Until the
        first iterations have said how their ops are cut, it is ``prefetch_depth``.
        """
        if self._window_size:
            return self._window_size
        depth, workers = self.prefetch_depth, self._workers
        units = min(self._units.values(), default=0)
        if workers <= 1 or not units:
            size = depth
        else:
            size = max(depth, min(-(-depth * workers // units), self._window_cap()))
        room = (self._window_cap(), self._arena // (2 * self._iteration_bytes or 1))
        size, self._group = grouped_window(size, *room, self._most * (units == 1))
        # Kept until a batch is cut into another count of units, or an iteration
        # grows (_dispatch, _finish): 15-20 Python calls a batch otherwise.
        self._window_size = size
        return size

    def _window_cap(self) -> int:
        """Iterations in flight that ``_WINDOW_BYTES`` holds.

        Until an iteration's size is known, and in a pipeline with GPU ops:
        ``prefetch_depth``, or ``prefetch_depth`` batches per worker where a
        stateless batch op runs in the workers (its call is a whole batch).
        """
        if self._cap:
            return self._cap
        depth, workers = self.prefetch_depth, self._workers
        if not self._iteration_bytes or self._other_executor:
            cap = depth * workers if self._batch_op else depth
        else:
            floor = max(depth, workers) if self._batch_op else depth  # fewer: workers idle
            cap = max(floor, _WINDOW_BYTES // self._iteration_bytes)
        self._cap = cap  # (kept as the window is)
        return cap

    # ------------------------------------------------------------ running
    def next_result(self) -> tuple[Batch, ...]:
        """The next iteration's outputs (see :meth:`Pipeline.run`)."""
        __tracebackhide__ = True  # an error raised here keeps no frame of it (for_caller)
        with self._lock:
            if self._interrupted:
                self._resume()
            self._hand_over()
            self._fill()
            if not self._window:
                if self._ending:
                    raise StopIteration
                fed = [
                    s.op.name for s in self.ops if s.op.source_mode == SourceMode.FEED and not s.fed
                ]
                raise MpexecError(
                    f"external_source {', '.join(map(repr, fed))} has no data for the next "
                    "iteration: call pipe.feed_input(name, batch) before run()"
                )
            it = self._window[0]
        while not it.done.wait(_WAIT_SECONDS):
            if self._closed:
                raise PoolClosedError("the pipeline was closed while waiting for an iteration")
        with self._lock:
            self._fill(1)  # as if ``it`` had left the window: it is done
        if it.dropped and self._closed:
            # Not StopIteration: that would end a ``for batch in pipe`` loop as an epoch.
            raise PoolClosedError("the pipeline was closed while waiting for an iteration")
        # Handed out only by the last statements (no call between them and the return,
        # so a Ctrl-C cannot land there): an interrupted run() leaves ``it`` for the next.
        result, error, n = it.result, it.error, self.hand_outs + 1
        if result is None and error is None:
            self.handed, self.hand_outs = (it, 0), n
            raise StopIteration
        if error is not None:  # (it counts: the next run() is the next one) take_error's stores
            it.dropped, it.error, self.handed, self.hand_outs = True, None, (it, 1), n
            raise error  # (the stored error: run() shows where it was raised)
        assert result is not None
        self.handed, self.hand_outs = (it, 1), n
        return result

    def take_back(self, error: BaseException | None, since: int) -> None:
        """What ``next_result`` handed out after ``hand_outs`` was ``since`` was not taken
        (a Ctrl-C in ``Pipeline.run``): the next one hands it out again (``error``)."""
        with self._lock:
            last = self.handed
            if self.hand_outs != since:  # (else none since: the interrupt came before)
                self.handed = None
                if isinstance(error, Exception) and last and last[1] and last[0].result is None:
                    last[0].error = error  # (a failed iteration's, let go of: take_error)

    def _hand_over(self) -> None:
        """The iteration the last ``next_result`` handed out leaves the window (lock held)."""
        handed, self.handed = self.handed, None
        if handed is not None and self._window and self._window[0] is handed[0]:
            self._delivered += handed[1]  # (with the pop: no call between the two)
            self._window.popleft()

    def _resume(self) -> None:
        """Finish the steps an exception (a Ctrl-C) left half-done: their iterations."""
        for s in self.ops:  # a stateful op's unit sent, its turn not passed on
            while s.worker is not None and any(
                x.seq == s.turn and s.pos in x.dispatched for x in self._window
            ):
                self._advance_turn(s)
        for it in list(self._waiting):  # a launch stopped between its worker sources
            for s in self._sources:
                if it.dropped or it.error is not None:
                    break
                if s.runner is not None and s.pos not in it.dispatched:
                    self._dispatch(it, s)
        self._sources_in(None)
        for it in list(self._window):
            if it.error is not None:
                self._abandon(it)
            if it.result is not None or it.error is not None:
                it.done.set()
            elif it.computing and not it.dropped:
                self._dispatch_ready(it) if it.ops_left else self._finish(it)
        self._interrupted = False

    def reset(self) -> None:
        """Start the next epoch: sources begin again from their start, except
        iterables that do not cycle, which keep their place (DALI: one pass)."""
        with self._lock:
            once = [(s, s.iterator) for s in self.ops if one_pass(s.op)]
            self._restart(self._epoch + 1, 0)
            for s, iterator in once:
                s.iterator = iterator

    def _restart(self, epoch: int, index: int) -> None:
        while self._window:
            self._drop(self._window.popleft())
        self._waiting.clear()
        self.handed = None
        self._epoch = epoch
        self._next_index = self._delivered = index
        self._ending = False
        for s in self.ops:
            s.iterator = None
            s.reading = []
            if s.op.source_mode != SourceMode.FEED:
                s.fed.clear()  # (a batch an interrupted launch read)

    def position(self) -> tuple[int, int]:
        """(epoch, iterations of it handed out): where :meth:`seek` would resume."""
        with self._lock:
            self._hand_over()
            return self._epoch, self._delivered

    def seek(self, epoch: int, index: int) -> None:
        """Continue at iteration ``index`` of ``epoch``, as if run there from the start.

        Iterations are functions of (seed, op, epoch, iteration, sample), so
        only what is not must be replayed: iterables read here are advanced
        by the samples the first ``index`` iterations took (and dropped).
        """
        with self._lock:
            self._restart(epoch, index)
            for s in self.ops:
                if s.op.source_mode != SourceMode.ITER or s.absorbed:
                    continue
                per_iteration = 1 if s.op.batch_processing else self.batch_size
                self._skip_items(s, index * per_iteration)

    def _skip_items(self, s: OpState, count: int) -> None:
        """Read ``count`` items of an iterable source and drop them, in bounded time.

        A cycling source starts again at its end: once it has, its period is known, and
        only ``count`` modulo it is read (at most two passes, however large ``count``).
        """
        read, period = 0, 0
        while count > 0:
            before = s.iterator
            if next_item(s) is None:
                return
            count -= 1
            read += 1
            if not period and before is not None and s.iterator is not before:
                # It ran out and began again: that item opened its second pass.
                period = read - 1
                count %= period

    def feed(self, name: str, data: Any) -> None:
        """Queue ``data`` as the next batch of the external_source ``name``."""
        with self._lock:
            state = next((s for s in self.ops if s.op.name == name), None)
            if state is None or state.op.source_mode != SourceMode.FEED:
                names = [s.op.name for s in self.ops if s.op.source_mode == SourceMode.FEED]
                raise KeyError(
                    f"no external_source named {name!r} takes feed_input "
                    f"(those that do: {names or 'none'})"
                )
            op = state.op
            rows = batch_rows(op.describe(), data, op.num_outputs, self.batch_size)
            columns = self._own(state, tuple(list(c) for c in zip(*rows, strict=True)))
            state.fed.append(list(zip(*columns, strict=True)))

    def close(self) -> None:
        """Drop the iterations in flight and launch no more; idempotent."""
        with self._lock:
            self._closed = True
            while self._window:
                self._drop(self._window.popleft())
            self._waiting.clear()

    def op_stats(self) -> tuple[OpStats, ...]:
        with self._lock:
            return tuple(s.stats() for s in self.ops)

    # ------------------------------------------------------------ scheduling
    def _fill(self, spare: int = 0) -> None:
        end, size, limit, group = self._end, self._window_size or self.window, 0, self._group
        held = None
        if group > 1:  # a group launched at once, each op's units held and sent as one
            if self._window and (size + spare - len(self._window) < group or self._ending):
                return  # (no group fits, nor mostly a smaller one; or the end is out)
            at = (len(self._window), spare, self._next_index, end, self._workers)
            limit, group, spread = fill_plan(size, group, *at)
            held = self._defer = self._held.start(group, spread)
        self._interrupted = True  # until it returns: an exception leaves it (_resume)
        try:
            # (The window's kept size read first: the property's call is ~3 a batch.)
            while (
                len(self._window) < (limit or (self._window_size or self.window) + spare)
                and not self._ending
                and not self._closed
            ):
                if (end is not None and self._next_index > end) or not self._launch():
                    break
                if held is not None and len(held.entries) >= group:
                    held.send()  # each op's group as soon as it is held
            if held is not None and held.entries:
                held.send(every=True)
        except BaseException as exc:  # (a Ctrl-C): units not sent go out again (_resume)
            _grouping.unsend([] if held is None else getattr(exc, "mpexec_unsent", held.entries))
            raise
        finally:
            self._defer = None
        self._interrupted = False

    def _launch(self) -> bool:
        """Start the next iteration: run the sources here, dispatch those in workers."""
        if self._fed and any(not s.fed for s in self._fed):
            return False
        it = Iteration(self._epoch, self._next_index, self.batch_size, len(self.ops))
        sources = self._sources  # (before the try: its handler reads it)
        try:
            self._next_index += 1
            self._window.append(it)
            self._waiting.append(it)
            it.sources_left = len(sources)
            for s in self._here:
                try:  # (pull leaves the batch first in s.fed: taken once it is the iteration's)
                    it.values[s.pos] = samples = pull(s, it, self.batch_size)
                    s.fed.popleft()
                    # Fed batches were copied when fed: the caller may reuse its arrays.
                    # (The copy may find shared memory full: it fails this iteration, in
                    # the window already, as a source's error does.)
                    if s.op.source_mode != SourceMode.FEED:
                        it.values[s.pos] = self._own(s, samples)
                except Exception as exc:
                    if it.values[s.pos] is None and s.op.source_mode == SourceMode.FEED:
                        s.fed.popleft()  # (a bad fed batch is consumed)
                    s.reading = []
                    self._fail(it, annotate(exc, s.op, it, None))
                    return True
                n = len(samples[0])
                if (
                    n < self.batch_size
                    and s.op.source_mode == SourceMode.ITER
                    and not s.op.batch_processing
                ):
                    it.stop = n if it.stop is None else min(it.stop, n)
                it.size = min(it.size, n)
                it.sources_left -= 1
            for s in sources:
                if s.runner is not None:
                    self._dispatch(it, s)
        except BaseException:
            # (A Ctrl-C.) Once a source's unit went to a worker, the iteration stays:
            # that source may be stateful (an iterable read in its worker), so its
            # call must not run again; _resume dispatches the sources left.
            if not (
                it.computing
                or it.dropped
                or it.error is not None
                or any(s.pos in it.dispatched for s in sources)
            ):
                self._unlaunch(it)  # the next run() launches it again
            raise
        if it.sources_left == 0:
            self._sources_in(it)
        return True

    def _unlaunch(self, it: Iteration) -> None:
        """Undo a launch an exception left half-done: its batches read go back first."""
        for s in self._here:
            vals = it.values[s.pos]
            # (Not a batch still first in fed: pulled, not taken yet, see _launch.)
            if vals is not None and not (s.fed and s.fed[0] is s.pulled):
                s.fed.appendleft(list(zip(*vals, strict=True)))
        for queue in (self._waiting, self._window):
            if it in queue:
                queue.remove(it)
        self._next_index = it.index
        self._drop(it)

    def _own(self, s: OpState, columns: tuple[list[Any], ...]) -> tuple[Any, ...]:
        """A source's columns copied once, into shared memory (see own_columns)."""
        owned, shared = own_columns(columns, s.executor if self._workers else None)
        s.bytes_copied += shared
        return owned

    def _sources_in(self, it: Iteration | None) -> None:
        """Every source of ``it`` has delivered: let iterations compute, in order."""
        del it
        # Only the iterations not computing yet are looked at (a window of hundreds
        # of iterations in flight must not cost a pass over it per iteration).
        waiting = self._waiting
        while waiting:
            it = waiting[0]
            if it.seq >= 0 or it.dropped:  # computing already (it.computing), or dropped
                waiting.popleft()
                continue
            if it.sources_left > 0 and it.error is None:
                return  # later iterations wait for this one: order of epoch ends
            if it.error is not None:
                waiting.popleft()
                continue
            size = it.size if it.stop is None else min(it.size, it.stop)
            if it.stop is None and it.index == self._end:
                self._end = None  # a longer epoch than the last: the next run() fills on
            if it.stop is not None:
                self._ending, self._end = True, it.index
                for later in [x for x in self._window if x.index > it.index]:
                    self._drop(later)  # (then out: a Ctrl-C between leaves it to _resume)
                    self._window.remove(later)
                if size == 0 or (size < self.batch_size and self.last_batch is LastBatch.DROP):
                    it.result = None
                    it.done.set()
                    waiting.popleft()  # (last: a Ctrl-C before leaves it to _resume)
                    return
            for s in self._sources:
                vals = it.values[s.pos]
                assert vals is not None
                if vals and max(map(len, vals)) > size:  # (else: as they are)
                    it.values[s.pos] = tuple(v[:size] for v in vals)
            it.size = size  # (booked with seq and the pop: no call before the pop)
            it.seq = self._next_seq
            self._next_seq += 1
            it.ops_left = self._computed
            waiting.popleft()
            if it.ops_left == 0:
                self._finish(it)
            else:
                self._dispatch_ready(it)

    def _dispatch_ready(self, it: Iteration) -> None:
        for s in self.ops:
            if it.error is not None or it.dropped or it.result is not None:
                return
            if s.source or s.absorbed or s.pos in it.dispatched:
                continue
            if any(it.values[self._pos[id(n.op)]] is None for n in s.waits):
                continue
            if s.selects:  # a split or merge: done here, now (later ops of this pass see it)
                try:
                    it.values[s.pos] = self._select(it, s)
                except Exception as exc:
                    self._fail(it, annotate(exc, s.op, it, None))
                    return
                self._done_here(it, s)
                continue
            try:
                ready = self._handed_off(it, s)
            except Exception as exc:  # a closed GPU stage: fail the iteration, in the window
                self._fail(it, annotate(exc, s.op, it, None))
                return
            if not ready or s.pos in it.dispatched:
                continue  # (dispatched already: by a handoff that completed meanwhile)
            if s.worker is not None and s.turn != it.seq:
                continue  # a stateful op: an earlier iteration goes first
            try:
                samples = self._rows(it, s.members[0].op.scope)
            except Exception as exc:
                self._fail(it, annotate(exc, s.op, it, None))
                return
            if samples is not None and not len(samples):
                # A branch no sample took: nothing to call (DALI calls no batch function either).
                it.values[s.pos] = tuple([] for _ in range(s.op.num_outputs))
                self._done_here(it, s)  # (its turn passed on after, or by _resume)
                if s.worker is not None:
                    self._advance_turn(s)
                continue
            self._dispatch(it, s, samples)
            if s.worker is not None:
                self._advance_turn(s)

    def _done_here(self, it: Iteration, s: OpState) -> None:
        """Op ``s`` of ``it`` was computed here, with no unit: the last one finishes it."""
        it.ops_left -= 1  # (booked with the next: no call between)
        it.dispatched.add(s.pos)
        if it.ops_left == 0:
            self._finish(it)

    # ------------------------------------------------------------ conditionals
    def _rows(self, it: Iteration, scope: Scope | None) -> np.ndarray[Any, Any] | None:
        """The batch indices of ``scope``'s samples in ``it`` (None: the whole batch)."""
        if scope is None:
            return None
        return self._scope(it, scope)[1]

    def _scope(
        self, it: Iteration, scope: Scope
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """(mask over the parent's samples, batch indices) of ``scope`` in ``it``.

        Worked out once per iteration from the predicate's column, which must
        hold a scalar bool per sample (DALI's rule for an ``if`` predicate).
        """
        got = it.scopes.get(id(scope))
        if got is None:
            outer = self._rows(it, scope.parent)
            pred = scope.predicate
            column = self._column(it, pred)
            mask = _branches.mask(column, pred.name, scope.branch, scope.logical)
            rows = np.flatnonzero(mask) if outer is None else outer[mask]
            got = it.scopes[id(scope)] = (mask, rows)
        return got

    def _column(self, it: Iteration, node: DataNode) -> Any:
        vals = it.values[self._pos[id(node.op)]]
        assert vals is not None
        return vals[node.index]

    def _select(self, it: Iteration, s: OpState) -> tuple[Any, ...]:
        """A split's or merge's column: rows of its inputs, uncopied (views of their arrays)."""
        op = s.op
        columns = [self._column(it, n) for n in op.inputs]
        if op.kind is OpKind.SPLIT:
            assert op.scope is not None
            return (_branches.split(columns[0], self._scope(it, op.scope)[0]),)
        taken = op.inputs[0].op.scope  # the `if` branch: where the merge takes its rows
        assert taken is not None
        yes, no = columns
        return (_branches.merge(yes, no, self._scope(it, taken)[0], op.function),)

    def _advance_turn(self, s: OpState) -> None:
        s.turn += 1
        while s.turn in s.skipped:
            s.skipped.discard(s.turn)
            s.turn += 1
        for other in list(self._window):
            if other.seq == s.turn:
                self._dispatch_ready(other)

    def _dispatch(self, it: Iteration, s: OpState, samples: Any = None) -> None:
        """Send op ``s`` of iteration ``it`` to the workers, in chunks.

        ``samples``: the batch indices of the samples it runs on, where not all
        (an op in a branch of an ``if`` on a DataNode).
        """
        try:  # (the add in it: a Ctrl-C as it returns must undo it)
            it.dispatched.add(s.pos)
            self._send(it, s, samples)
        except BaseException as exc:  # (a Ctrl-C): sent again, its units sent ignored, unless
            # all were taken (_send: they come back; a stateful op's call must not run twice)
            done = not it.values or it.values[s.pos] is not None or it.error is not None
            if not (done or getattr(exc, "mpexec_sent", False)):  # (no values: run here, done)
                it.dispatched.discard(s.pos)
                it.parts.pop(s.pos, None)
            raise

    def _send(self, it: Iteration, s: OpState, samples: Any) -> None:
        op = s.op
        assert s.runner is not None
        inputs = []
        for p, index in s.producers:
            vals = it.values[p.pos]
            assert vals is not None
            column = vals[index]
            if p.handoff is not None and p.executor is not s.executor:
                column = it.host[(p.pos, index)].result()  # done: see _handed_off
            inputs.append(column)
        chained = len(s.members) > 1  # the chain counts its ops' bytes itself
        for column in inputs:
            if not chained:
                s.bytes_in += nbytes(column)
            if s.copied_bytes is not None:
                s.bytes_copied += s.copied_bytes(column)
        size = it.size if samples is None else len(samples)
        k = 1
        if not (op.batch_processing or op.stateful or s.executor.workers <= 1):
            k = self._chunk_count(s, size)
            if s.executor is self.executor and s.worker is None and self._units.get(s.pos) != k:
                self._units[s.pos] = k  # sizes the window
                self._window_size = self._cap = 0
        try:
            blocks = self._blocks(s, size)  # shared memory may be full: fail the iteration
        except Exception as exc:
            self._fail(it, annotate(exc, op, it, None))
            return
        # Where the executor offers it, a unit's outcome comes back to a hook,
        # with no Future between (no condition, no guarded callback a unit).
        hooked = s.submit_hooked
        if k == 1:
            # The batch in one unit (batch mode; per sample once learned): no parts,
            # bounds nor cut blocks. ``blocks`` marks the dispatch (_on_chunk, _dispatch).
            it.parts[s.pos] = blocks
            where = None if samples is None else tuple([int(r) for r in samples])
            chunk = Chunk(it.epoch, it.index, 0, size, it.epoch_start, where)
            rows = tuple([col[:size] for col in inputs]) if inputs else ()
            unit = WorkUnit(s.runner, chunk, rows, s.worker, s.names, tuple(blocks))
            hook = functools.partial(self._on_chunk, it, s, blocks, -1, time.perf_counter())
            if self._defer is not None and hooked is not None and s.groupable:
                self._defer.append((s, unit, hook))  # (_fill sends it, with its group)
                return
            try:
                if hooked is not None:
                    hooked(unit, hook)
                    return
                future = s.executor.submit_unit(unit)
            except Exception as exc:
                self._fail(it, annotate(exc, op, it, None))
                return
            except BaseException as exc:  # (a Ctrl-C): was the unit taken? (_dispatch)
                sent = hooked is not None and getattr(exc, "mpexec_taken", False) is True
                exc.mpexec_sent = sent  # type: ignore[attr-defined]
                raise
            future.add_done_callback(hook)
            return
        edges = [size * j // k for j in range(k + 1)]
        bounds = [(edges[j], edges[j + 1]) for j in range(k)]
        parts: list[ChunkResult | None] = [None] * k
        it.parts[s.pos] = parts
        it.bounds[s.pos] = bounds
        it.blocks[s.pos] = blocks
        submit = s.executor.submit_unit
        names = s.names
        runner = s.runner
        done = -1  # the last unit the executor took
        try:
            for ci, (a, b) in enumerate(bounds):
                where = None if samples is None else tuple(int(r) for r in samples[a:b])
                chunk = Chunk(it.epoch, it.index, a, b - a, it.epoch_start, where)
                if not blocks or b - a == size:  # (the whole batch: its blocks as they are)
                    out = tuple(blocks)
                else:
                    out = tuple([None if k is None else k[a:b] for k in blocks])
                rows = tuple([col[a:b] for col in inputs]) if inputs else ()
                unit = WorkUnit(runner, chunk, rows, s.worker, names, out)
                t0 = time.perf_counter()
                hook = functools.partial(self._on_chunk, it, s, parts, ci, t0)
                try:
                    if hooked is not None:
                        hooked(unit, hook)
                        done = ci  # (no call between: a Ctrl-C lands before or after both)
                        continue
                    future = submit(unit)
                except Exception as exc:
                    self._fail(it, annotate(exc, op, it, None))
                    return
                future.add_done_callback(hook)
        except BaseException as exc:  # (a Ctrl-C): were all its units taken? (_dispatch)
            # The one it fell in was, where the pool says so (WorkerPool._submit); a
            # unit not hooked (a Future's callback not added yet) counts as not taken.
            taken = done + 1 + (getattr(exc, "mpexec_taken", False) is True)
            exc.mpexec_sent = hooked is not None and taken == len(bounds)  # type: ignore[attr-defined]
            raise

    def _handed_off(self, it: Iteration, s: OpState) -> bool:
        """Whether ``s``'s inputs from other executors are readable by its own.

        An executor whose outputs others cannot read as they are (the GPU's)
        hands each column off once per iteration (``handoff``: a copy to the
        host, queued on its own thread); ``s`` is dispatched when every one
        it needs has landed (:meth:`_on_handoff` looks again).
        """
        ready = True
        for n in s.inputs:
            p = self.ops[self._pos[id(n.op)]]
            if p.handoff is None or p.executor is s.executor:
                continue
            key = (p.pos, n.index)
            future = it.host.get(key)
            if future is None:
                vals = it.values[p.pos]
                assert vals is not None
                future = p.handoff(vals[n.index], n.op.name, s.executor)
                it.host[key] = future
                future.add_done_callback(functools.partial(self._on_handoff, it))
            if not future.done() or future.exception() is not None:
                ready = False
        return ready

    def _on_handoff(self, it: Iteration, future: Future[Any]) -> None:
        """A column handed off to another executor landed (in any thread, or inline)."""
        with self._lock:
            if it.dropped or it.error is not None:
                return
            if future.cancelled():
                self._fail(it, PoolClosedError("the pipeline was closed"))
                return
            exc = future.exception()
            if exc is not None:
                self._fail(it, exc)
                return
            try:
                self._dispatch_ready(it)
            except Exception as bug:  # a bug here must not hang run()
                self._fail(it, bug)

    def _blocks(self, s: OpState, size: int) -> list[Any]:
        """Per output of ``s``: a dense block for the batch, or None; [] if none."""
        empty = s.empty
        if empty is None or not size or s.blocks.count(None) == len(s.blocks):
            return []
        return [None if b is None else empty((size, *b[0]), b[1]) for b in s.blocks]

    def _chunk_count(self, s: OpState, size: int) -> int:
        """How many chunks op ``s``'s batch of ``size`` samples is cut into.

        Until its calls' CPU time is known, one per worker, ``_FIRST_CHUNKS``
        at most (a batch of 64 over 64 workers went out as 64 one-sample
        units, ~10 ms of the main process's CPU for what may be 64 µs of work;
        in 16 units of 4, a heavy first batch takes 4 samples' time, and the
        window still gives every worker its units). Then one: a chunk
        costs the main process ~100-200 µs of CPU however many samples it
        carries (its encoding, ring push, result and assembly), so a whole
        batch a chunk costs it the least a sample however many workers there
        are, and the window (:attr:`window`) keeps more iterations in flight to
        give every worker its share. (Chunks of 64 samples cost a pipeline of
        light samples in batches of 256 on 2 workers 2.3x the main process's
        CPU a sample, and 1.6x the time.) Where a batch takes more of a
        worker's CPU than the one chunk policy gives a chunk
        (:func:`~mpexec._mapping.calls_in_chunk`: CPU, so that a loaded host
        does not cut batches smaller), chunks carry fewer (a long chunk delays
        the first batch, idles workers at an epoch's end). Where the
        memory budget caps the window, the batch is cut into enough chunks for
        every worker to hold ``prefetch_depth``; ``_MAX_CHUNKS_PER_WORKER`` at most.
        """
        workers = self._workers
        if not s.cpu_samples:
            return max(1, min(size, workers, _FIRST_CHUNKS))
        carry = calls_in_chunk(s.cpu_s / s.cpu_samples, size)
        # (Rounded: a chunk a little longer than the policy's beats twice the chunks.)
        cap = self._cap or self._window_cap()
        chunks = max(round(size / carry), -(-self.prefetch_depth * workers // cap))
        return max(1, min(size, workers * _MAX_CHUNKS_PER_WORKER, chunks))

    def _on_chunk(
        self, it: Iteration, s: OpState, parts: list[Any], ci: int, t0: float, future: Any
    ) -> None:
        """A chunk came back (in the executor's thread, or inline); ``future``: its done
        Future, or the outcome ``submit_hooked`` hands a hook (the same readers).
        ``parts``: its dispatch's chunks so far; ``ci`` < 0: a batch sent as one unit,
        ``parts`` its blocks (its outcome is then the columns: see :func:`assemble_one`)."""
        elapsed = time.perf_counter() - t0
        with self._lock:
            try:  # (one frame a unit: its steps are here, not in a helper)
                try:
                    exc = future.exception()  # (not cancelled() first: a frame less a unit)
                except CancelledError:
                    self._fail(it, PoolClosedError("the pipeline was closed"))
                    return
                if exc is not None:
                    if self._workers == 0 and isinstance(exc, KeyboardInterrupt):
                        raise exc  # noqa: TRY301 - a Ctrl-C in a function run here: sent again
                    name = getattr(exc, "mpexec_op", None)
                    op = next((m.op for m in s.members if m.op.name == name), s.op)
                    self._fail(it, annotate(exc, op, it, getattr(exc, "mpexec_sample", None)))
                    return
                res: ChunkResult = future.result()
                per_op = res.per_op or ((res.seconds, 0, 0),)
                members = s.members
                if len(per_op) != len(members):
                    # A batch op ending a source's chain has no entry where it was not
                    # called: for a batch that nobody receives, see SourceBatchRunner.
                    assert len(per_op) == len(members) - s.op.batch_processing
                    s.uncalled += 1
                    s.uncalled_samples += res.count
                # Calls and samples per op, for its whole chain (OpState.calls).
                s.units += 1
                s.cpu_samples += res.count
                for m, (spent, b_in, b_out) in zip(members, per_op, strict=False):
                    m.function_s += spent
                    m.bytes_in += b_in
                    m.bytes_out += b_out
                s.waiting_s += max(0.0, elapsed - res.seconds)
                s.cpu_s += res.cpu
                if s.executor is self.executor:  # per worker of the pipeline's pool
                    self.busy[res.pid] += res.seconds
                    self.faults += res.faults
                if it.dropped or it.error is not None or it.parts.get(s.pos) is not parts:
                    return  # (not parts: of a dispatch a Ctrl-C stopped, sent again)
                if ci < 0:  # the batch in one unit (_send): ``parts`` is its blocks
                    del it.parts[s.pos]
                    columns = assemble_one(s, res, parts, self._workers == 0)
                    parts = [res]
                else:
                    parts[ci] = res
                    for p in parts:  # (a loop, not any(): no generator a batch)
                        if p is None:
                            return
                    del it.parts[s.pos]
                    bounds = it.bounds.pop(s.pos)
                    blocks = it.blocks.pop(s.pos)
                    columns = assemble(s, parts, bounds, blocks, self._workers == 0)
                if len(s.members) == 1 or s.executor is self.executor:
                    size = 0
                    for col in columns:
                        size += nbytes(col)
                    if len(s.members) == 1:
                        s.bytes_out += size
                    if s.executor is self.executor:
                        it.nbytes += size
                it.values[s.pos] = columns
                if s.source:
                    for p in parts:
                        if p is not None and p.stop is not None:
                            it.stop = p.stop if it.stop is None else min(it.stop, p.stop)
                    it.size = min(it.size, len(columns[0]))
                    it.sources_left -= 1
                    if it.sources_left == 0:
                        self._sources_in(it)
                    return
                it.ops_left -= 1
                if it.ops_left == 0:
                    self._finish(it)
                else:
                    self._dispatch_ready(it)
            except Exception as exc:  # a bug here must not hang run()
                self._fail(it, exc)

    def _finish(self, it: Iteration) -> None:
        plan = self._plan
        assert plan is not None
        out = []
        for p, n in self._outputs:
            vals = it.values[p.pos]
            assert vals is not None
            layout = n.op.output_layouts[n.index]
            if p.batch is None:
                out.append(Batch(vals[n.index], layout))
            else:
                out.append(p.batch(vals[n.index], layout, n.op.name))
        it.result = tuple(out)
        if it.nbytes > self._iteration_bytes:  # sizes the window
            self._iteration_bytes = it.nbytes
            self._window_size = self._cap = 0
        it.values = []
        it.host = {}
        it.done.set()

    def _fail(self, it: Iteration, exc: BaseException) -> None:
        if it.error is None and not it.dropped:
            it.error = exc
        self._abandon(it)
        it.done.set()
        if not it.computing:
            # Its sources will not all come in: later iterations must not wait.
            self._sources_in(it)

    def _drop(self, it: Iteration) -> None:
        it.dropped = True
        self._abandon(it)
        it.done.set()

    def _abandon(self, it: Iteration) -> None:
        """Stateful ops this iteration will not call give up their turn."""
        it.values = [None] * len(self.ops)
        it.host = {}
        if not it.computing:
            return
        for s in self.ops:
            if s.worker is not None and s.pos not in it.dispatched:
                it.dispatched.add(s.pos)
                if s.turn == it.seq:
                    self._advance_turn(s)
                else:
                    s.skipped.add(it.seq)
