"""Sending calls: encode a task's function and arguments and push them to a worker.

A :class:`CallSender` owns the function cache (each function pickled once,
known to each worker by id) and hands waiting calls to workers with room. It
works on the pool's state, under its lock, and knows nothing of the pool.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import struct
import time
from collections.abc import Callable
from typing import Any

import shm

from .. import _codec
from .._errors import SerializationError
from .._protocol import CALL, FORGET, FUNC, HEADER, RECORD_SIZE, spill
from ._future import Task
from ._state import PoolState, Slot

_FN_CACHE = 1024  # functions kept (strongly) with their ids; older ones are forgotten


class CallSender:
    """Pushes calls onto the workers' task rings (callers hold ``state.lock``)."""

    def __init__(
        self,
        state: PoolState,
        *,
        inline_max: int,
        push_timeout: float,
        timeout: float | None,
    ) -> None:
        self.state = state  # the slots to push to, the counters, the manager's doorbell
        self.inline_max = inline_max  # arrays up to this size travel in the record
        self.push_timeout = push_timeout  # how long a push waits for room in a ring
        self.timeout = timeout  # the pool's per-call limit: the manager must know of calls
        self.fn_ids: collections.OrderedDict[Any, int] = collections.OrderedDict()
        self.next_fn_id = itertools.count(1)

    def send(self, task: Task, slot: Slot, reader: bool = False) -> None:
        """Encode ``task`` for ``slot`` and push it (the state lock is held).

        ``reader``: its caller reads its outcome itself next (``run_call``): a done
        ring kept aside for direct reads stays so (else it is watched again).
        """
        state = self.state
        arena = state.arena
        assert arena is not None
        fn = task.fn
        try:  # function_id()'s common case, inline: a function sent before
            fn_id = self.fn_ids.get(fn)
        except TypeError:
            fn_id = None
        if fn_id is None:
            fn_id = self.function_id(fn)
        else:
            self.fn_ids.move_to_end(fn)
        records = []
        if slot.forget:
            forget = slot.take_forgotten()
            body = struct.pack(f"<{len(forget)}I", *forget)
            records.append(spill(FORGET, body, arena, slot.arg_releases))
        if fn_id not in slot.fns:
            try:
                body = _codec.dump_value(task.fn)
            except SerializationError:
                self.forget_function(task.fn)
                raise
            records.append(spill(FUNC, body, arena, slot.arg_releases, fn_id=fn_id))
        ring = slot.tasks
        before = ring.pushed
        sent = len(records) + 1  # what the ring's count reads once the call's record is in
        # What the encoding shares, booked as each reference is counted: given back
        # below if the call's record never goes in, even if a Ctrl-C cut us off
        # from the encoding's result as it returned.
        booked: list[shm.ArrayDescriptor] = []
        try:
            enc = _codec.encode_call(
                task.args, task.kwargs, arena, slot.arg_releases, self.inline_max, None, booked
            )
            data = enc.data
            if HEADER.size + len(data) <= RECORD_SIZE:  # spill()'s common case, inline
                records.append(HEADER.pack(CALL, 0, fn_id, task.task_id) + data)
            else:
                records.append(
                    spill(CALL, data, arena, slot.arg_releases, task.task_id, fn_id, booked)
                )
            if len(records) == 1:
                ring.push(records[0], timeout=self.push_timeout, watch=[slot.process])
            else:
                ring.push_many(records, timeout=self.push_timeout, watch=[slot.process])
            task.sent = time.perf_counter()
            slot.enqueue(task, fn_id)
        except BaseException:
            # A KeyboardInterrupt can land after the call's record went in (inside
            # the push, or before the enqueue): the worker runs it and answers, so
            # it is queued as sent (its arguments lent), or the manager would meet
            # an answer no queue holds and break the pool.
            if ring.pushed - before < sent:
                _codec.give_back(arena, booked, slot.arg_releases)
            elif task not in slot.queue:
                task.sent = time.perf_counter()
                slot.enqueue(task, fn_id)
            raise
        watcher = state.watcher
        if watcher is not None and watcher.aside and not reader:
            watcher.sent(slot)
        state.bytes_shared += enc.bytes_shared  # (inline: a frame less a call)
        state.bytes_copied += enc.bytes_copied
        if self.timeout is not None:
            state.poke()  # the manager sleeps until the earliest deadline

    def dispatch_pending(self) -> None:
        """Hand waiting calls to workers with room (the state lock is held)."""
        self.state.dispatch_pending(self.send)

    def check_picklable(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        """Raise SerializationError now for a call that cannot be sent (nothing is copied)."""
        if not self.known_function(fn):  # pickling a function again costs as much as a call
            _codec.dump_value(fn)
        # Arrays are not copied: nothing is shared, only checked.
        _codec.encode_call(args, kwargs, None, None, inline_max=-1, owner=self.state.arena)

    # ------------------------------------------------------------ the function cache
    def known_function(self, fn: Callable[..., Any]) -> bool:
        """Whether ``fn`` pickled before (a function keeps its id only if it did)."""
        try:
            return fn in self.fn_ids
        except TypeError:  # unhashable
            return False

    def forget_function(self, fn: Callable[..., Any]) -> None:
        """Drop ``fn`` (it no longer pickles): checked again next time, gone from workers."""
        fn_id = None
        with contextlib.suppress(TypeError):
            fn_id = self.fn_ids.pop(fn, None)
        if fn_id is not None:
            self.forget_everywhere(fn_id)

    def function_id(self, fn: Callable[..., Any]) -> int:
        key: Any = fn
        try:
            fn_id = self.fn_ids.get(key)
        except TypeError:  # unhashable callable: a new id each time
            fn_id, key = None, _Unhashable(fn)
        if fn_id is not None:
            self.fn_ids.move_to_end(key)
            return fn_id
        fn_id = next(self.next_fn_id)
        self.fn_ids[key] = fn_id
        if len(self.fn_ids) > _FN_CACHE:
            _, old = self.fn_ids.popitem(last=False)
            self.forget_everywhere(old)
        return fn_id

    def forget_everywhere(self, fn_id: int) -> None:
        """Workers that cached function ``fn_id`` drop it with their next task."""
        for slot in self.state.slots:
            if fn_id in slot.fns:
                slot.fns.discard(fn_id)
                slot.forget.append(fn_id)


class _Unhashable:
    """Stands in for an unhashable callable as a cache key (by identity)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
