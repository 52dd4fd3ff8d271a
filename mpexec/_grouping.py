"""Several iterations a unit (issue 37): fewer calls, fewer wake-ups, a batch.

Where an op's unit is a whole batch (a batch op, or per-sample ops whose
chunks are whole batches) and the window is wider than the workers need, the
scheduler holds the units of the iterations one ``_fill`` launches and sends
each op's ``k`` consecutive ones as one call of a :class:`ManyRunner`; the one
answer is fanned out to each iteration's hook (:class:`FanOut`). Outputs are
those of one iteration a unit: each iteration keeps its chunk, seed and blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from ._modes import SourceMode
from ._runtime import ManyRunner
from ._tracebacks import unpack_error

if TYPE_CHECKING:
    from ._executors import WorkUnit
    from ._iterations import OpState

#: Iterations a unit at most: 4 halves the main process's CPU a batch at 2 workers
#: (docs/scaling.md); more buys little and lengthens an epoch's ramp and tail.
MAX_GROUP = 4


def max_group() -> int:
    """:data:`MAX_GROUP`, or ``MPEXEC_UNIT_ITERATIONS`` (internal: for A/B; 1 turns it off)."""
    return max(1, int(os.environ.get("MPEXEC_UNIT_ITERATIONS", MAX_GROUP)))


def groupable(s: OpState, executor: Any) -> bool:
    """Whether op ``s``'s whole-batch units may carry several iterations: run by the
    pipeline's pool, on any worker, with no state and no iterable read in a worker."""
    return (
        s.executor is executor
        and executor.workers > 1
        and hasattr(executor, "submit_many")
        and s.worker is None
        and not any(m.op.stateful or m.op.source_mode is SourceMode.WORKER_ITER for m in s.members)
    )


def bounds(ops: list[OpState], executor: Any) -> tuple[int, int]:
    """(k at most, the bytes of the pool's arena): (1, 0) where no op is groupable, or
    a source is read here (its batches' copies in the arena are not in an
    iteration's bytes, which size the window: k x them might not fit)."""
    if not any(s.groupable for s in ops) or any(
        s.source and not s.absorbed and s.runner is None for s in ops
    ):
        return 1, 0
    try:  # (a pool that does not say: no group, as a full arena would fail them)
        return max_group(), int(executor.pool.stats().arena.capacity)
    except Exception:
        return 1, 0


def grouped_window(size: int, cap: int, arena: int, most: int) -> tuple[int, int]:
    """(window, k) from one iteration a unit's window ``size``.

    Each worker keeps as many units as with k = 1, of k iterations each, so the
    window is k x ``size``: k is as large as the cap ``cap`` (``_WINDOW_BYTES``)
    and half the pool's arena (``arena``, in iterations: the rest for the
    sources' copies and the batches the caller holds) allow, at most ``most``.
    Until an iteration's bytes are known the cap is the k = 1 window's, so k is
    1: no launch further ahead than k = 1's before block shapes are learned.
    """
    k = max(1, min(most, min(cap, arena) // max(1, size)))
    return size * k, k


#: Before an epoch's end is known, k stays 1 for this many windows of it.
BLIND_WINDOWS = 4


def fill_plan(
    window: int, k: int, in_flight: int, spare: int, index: int, end: int | None, workers: int
) -> tuple[int, int, int]:
    """(iterations the window may hold after this ``_fill``, iterations a unit, the
    workers its groups go to in turn: 0, the pool's least busy).

    Before the epoch's end is known (its first pass), the window runs past the end
    by up to its size, work thrown away that holds a worker into the next epoch: k
    times more of it at k. So k is 1 there for the epoch's first
    :data:`BLIND_WINDOWS` windows (an epoch with no end gets k after them). Once
    the end is known, the group shrinks when fewer than k per worker are left:
    every worker gets a unit of the tail. Iterations are launched a whole group
    at a time, but for the epoch's last ones. An epoch's first groups (the window
    empty) go to the workers in turn: the pool picks the worker with the fewest
    calls queued, and the last epoch's dropped units, short but many, would send
    every group of the new one to the same worker (its epoch then twice as long).
    """
    blind = end is None and index < BLIND_WINDOWS * window
    if blind:
        group, target = 1, window // k + spare  # (one iteration a unit's window)
    else:
        group = k if end is None else min(k, max(1, (end + 1 - index) // workers))
        target = window + spare
    launch = (target - in_flight) // group * group
    if end is not None and end + 1 - index <= target - in_flight:
        launch = end + 1 - index  # the epoch's last ones: in one go
    return in_flight + max(0, launch), group, workers * (in_flight == 0)


Entry = tuple["OpState", "WorkUnit", Any]  # (op, its unit, its hook: a partial of _on_chunk)


def send_grouped(
    held: list[Entry],
    group: int,
    runners: dict[int, ManyRunner],
    fail: Callable[[Any, BaseException], None],
    annotate: Callable[[Exception, Any, Any, None], BaseException],
    spread: int = 0,
    turns: dict[int, int] | None = None,
    whole: bool = False,
) -> None:
    """Send ``held``, each op's consecutive units ``group`` a call (an op's j-th call
    to worker j modulo ``spread``, j counted in ``turns`` across the calls of a fill;
    0: any). ``whole``: only whole groups; the rest stays in ``held``.

    A call the executor refused is sent again as single units, so only the
    iterations whose own unit is refused fail (``fail``, the error ``annotate``-d).
    On a Ctrl-C the exception's ``mpexec_unsent`` lists the entries not sent (see
    :func:`unsend`); a call the pool says it took (``mpexec_taken``) went.
    """
    by_op: dict[int, list[Entry]] = {}
    for entry in held:
        by_op.setdefault(entry[0].pos, []).append(entry)
    parts = [e[a : a + group] for e in by_op.values() for a in range(0, len(e), group)]
    kept: list[Entry] = []
    if whole and (len(by_op) > 1 or len(held) % group):
        kept = [e for part in parts if len(part) < group for e in part]
        parts = [part for part in parts if len(part) == group]
    turns = {} if turns is None else turns
    order = [e for part in parts for e in part]
    sent = calling = 0  # entries sent (or failed) so far; in the call under way
    try:
        for part in parts:
            s = part[0][0]
            # A ManyRunner rebuilds each chunk from Chunks' numbers: a unit that is not a
            # whole batch (a branch's rows of an `if`) goes alone, or its rows would be lost.
            if len(part) > 1 and all(
                u.chunk.rows is None and not u.chunk.start for _, u, _ in part
            ):
                many = runners.get(s.pos)
                if many is None:
                    many = runners[s.pos] = ManyRunner(s.runner)
                calling = len(part)
                j = turns[s.pos] = turns.get(s.pos, -1) + 1
                worker = j % spread if spread else None
                try:
                    units, hooks = [u for _, u, _ in part], [h for *_, h in part]
                    s.executor.submit_many(many, units, hooks, worker)  # type: ignore[attr-defined]
                    sent += calling
                    continue
                except Exception:  # sent again one by one below: each fails alone
                    pass
            calling = 1
            for _, unit, hook in part:
                try:
                    s.submit_hooked(unit, hook)  # type: ignore[misc]
                except Exception as exc:
                    fail(hook.args[0], annotate(exc, s.op, hook.args[0], None))
                sent += 1
        held[:] = kept  # (here, not by the caller: a Ctrl-C can land as this returns)
    except BaseException as exc:  # (a Ctrl-C): the call under way was taken, or not
        taken = getattr(exc, "mpexec_taken", False) is True
        exc.mpexec_unsent = order[sent + calling * taken :] + kept  # type: ignore[attr-defined]
        raise


class Held:
    """The units a ``_fill`` holds, each op's sent as soon as ``group`` of them are
    held (:meth:`send`), in order: a worker need not wait for the fill's last launch
    (at 64 workers, hundreds of them) to get its first group. ``entries``: held, not
    sent; a Ctrl-C in :meth:`send` lists them in its ``mpexec_unsent`` with the units
    of the send it cut short (``_fill`` then :func:`unsend`-s them). One a scheduler,
    started again by each fill (:meth:`start`)."""

    __slots__ = ("annotate", "append", "entries", "fail", "group", "runners", "spread", "turns")

    def __init__(
        self,
        fail: Callable[[Any, BaseException], None],
        annotate: Callable[[Exception, Any, Any, None], BaseException],
    ) -> None:
        self.fail, self.annotate = fail, annotate
        self.runners: dict[int, ManyRunner] = {}  # an op's ManyRunner, made once
        self.entries: list[Entry] = []
        self.append = self.entries.append  # (the list's own: no Python call a unit)
        self.group = self.spread = 0
        self.turns: dict[int, int] = {}

    def start(self, group: int, spread: int) -> Held | None:
        """Held for a fill of ``group``-iteration units (None where ``group`` is 1: units
        go out as they are made), the first to workers in turn where ``spread``."""
        if group <= 1:
            return None
        self.entries.clear()  # (what a Ctrl-C left: unsent already, _fill)
        self.group, self.spread, self.turns = group, spread, {}
        return self

    def send(self, every: bool = False) -> None:
        """Send each op's whole groups held (``every``: all, an op's last group smaller)."""
        held, group, spread = self.entries, self.group, self.spread
        runners, fail, annotate = self.runners, self.fail, self.annotate
        send_grouped(held, group, runners, fail, annotate, spread, self.turns, not every)


def unsend(entries: list[Entry]) -> None:
    """Units held and not sent (a Ctrl-C): their iterations dispatch them again."""
    for s, _, hook in entries:
        hook.args[0].dispatched.discard(s.pos)
        hook.args[0].parts.pop(s.pos, None)


class _Settled:
    """One iteration's share of a :class:`ManyRunner`'s answer, read as a done Future."""

    __slots__ = ("answer",)

    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def exception(self) -> BaseException | None:
        return unpack_error(self.answer) if type(self.answer) is bytes else None

    def result(self) -> Any:
        return self.answer


class FanOut:
    """The hook of a unit of several iterations: each iteration's hook gets its answer."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: list[Callable[[Any], object]]) -> None:
        self.hooks = hooks

    def __call__(self, outcome: Any) -> None:
        try:
            failed = outcome.exception() is not None
        except CancelledError:
            failed = True
        if failed:  # the call failed as a whole (a worker lost, the pool closed)
            for hook in self.hooks:
                hook(outcome)
            return
        for hook, answer in zip(self.hooks, outcome.result(), strict=True):
            hook(_Settled(answer))
