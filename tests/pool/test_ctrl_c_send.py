"""A Ctrl-C that lands just after a call's record went into its worker's ring.

The worker runs that call and answers it: the pool must have queued it, or the
manager meets an answer no queue holds and the pool breaks ("completion out of
order"; ``tests/pipeline/test_run_ctrl_c.py`` hit it about 1 run in 7 on 3.12).
"""

from __future__ import annotations

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
