"""A Ctrl-C that lands just after a call's record went into its worker's ring.

The worker runs that call and answers it: the pool must have queued it, or the
manager meets an answer no queue holds and the pool breaks ("completion out of
order"; ``tests/pipeline/test_run_ctrl_c.py`` hit it about 1 run in 7 on 3.12).
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Any

import pytest

import mpexec

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.mark.parametrize("where", ["in the push, after its record went in", "after the push"])
def test_a_ctrl_c_after_a_call_went_in_leaves_the_pool_working(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    with mpexec.WorkerPool(1) as pool:
        assert pool.submit(abs, -1).result(30) == 1  # the function is known: one record
        ring = type(pool._state.slots[0].tasks)
        armed = [True]
        if where.startswith("in the push"):
            real = ring.push

            def push(self: Any, *args: Any, **kwargs: Any) -> None:
                real(self, *args, **kwargs)
                if armed[0]:
                    armed[0] = False
                    raise KeyboardInterrupt

            monkeypatch.setattr(ring, "push", push)
        else:
            slot_type = type(pool._state.slots[0])
            real_enqueue = slot_type.enqueue

            def enqueue(self: Any, *args: Any) -> None:
                if armed[0]:
                    armed[0] = False
                    raise KeyboardInterrupt
                real_enqueue(self, *args)

            monkeypatch.setattr(slot_type, "enqueue", enqueue)
        with pytest.raises(KeyboardInterrupt):
            pool.submit(abs, -2)
        monkeypatch.undo()
        assert [pool.submit(abs, -i).result(30) for i in range(3, 8)] == [3, 4, 5, 6, 7]
        assert pool._state.broken is None


class _Waiting:
    """A call waiting in the pool, as dispatch_pending sees it."""

    def __init__(self, n: int, worker: int | None) -> None:
        self.n = n
        self.worker = worker
        self.sent = 0.0
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()


@pytest.mark.parametrize("taken", [False, True], ids=["before its push", "after its push"])
def test_a_ctrl_c_inside_a_send_of_waiting_calls_keeps_the_rest_waiting_in_order(
    monkeypatch: pytest.MonkeyPatch, taken: bool
) -> None:
    # A caller's submit sends the calls that wait (PoolState.dispatch_pending) on the
    # caller's thread: an interrupt there must not drop the calls it had taken off
    # the queue, or their callers wait forever.
    with mpexec.WorkerPool(1) as pool:
        state = pool._state
        # Call 0 waits for a full worker (kept back), 1 goes, 2 is interrupted.
        calls = [_Waiting(0, 7), _Waiting(1, None), _Waiting(2, None), _Waiting(3, 7)]
        calls += [_Waiting(4, None)]
        sent = []

        def send(task: Any, slot: Any) -> None:
            if task.n == 2 and taken:
                task.sent = 1.0  # its record went in: its worker runs it
            if task.n == 2:
                raise KeyboardInterrupt
            task.sent = 1.0
            sent.append(task.n)

        monkeypatch.setattr(state, "pick_slot", lambda task: None if task.worker == 7 else 0)
        with state.lock:
            real = state.pending
            state.pending = collections.deque(calls)  # type: ignore[arg-type]
            try:
                with pytest.raises(KeyboardInterrupt):
                    state.dispatch_pending(send)
                left = [t.n for t in state.pending]  # type: ignore[attr-defined]
            finally:
                state.pending = real
        monkeypatch.undo()
        assert sent == [1]
        assert left == ([0, 3, 4] if taken else [0, 2, 3, 4])
        assert pool.submit(abs, -3).result(30) == 3
