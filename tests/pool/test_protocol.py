"""The wire between the pool and a worker (``mpexec._protocol``), without processes.

Records are built and read back in this process; the worker's loop
(``mpexec._worker._Worker``) runs here too, on rings whose both ends are ours:
the format, the spill through the arena and the cancellation handshake are
checked without starting a worker.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle
import numpy as np
import pytest

import shm
from mpexec import _codec, _protocol, _worker
from mpexec._protocol import (
    CALL,
    CANCEL,
    ERROR,
    FORGET,
    FUNC,
    HEADER,
    OK,
    RECORD_SIZE,
    SKIPPED,
    SPILLED,
    VERDICT,
    Kind,
    body_of,
    record,
    spill,
    spin_until,
)


def test_the_header_is_16_bytes_kind_flags_fn_id_task_id() -> None:
    rec = record(Kind.CALL, b"body", task_id=2**40 + 3, fn_id=7, flags=SPILLED)
    assert HEADER.size == 16
    assert rec[0] == 2
    assert rec[1] == SPILLED
    assert rec[2:4] == b"\0\0"  # padding
    assert struct.unpack_from("<I", rec, 4) == (7,)
    assert struct.unpack_from("<Q", rec, 8) == (2**40 + 3,)
    assert rec[16:] == b"body"
    assert HEADER.unpack_from(rec) == (CALL, SPILLED, 7, 2**40 + 3)


def test_record_kinds_are_one_byte_each_and_never_change() -> None:
    # Both ends of a ring read these numbers: a worker started from an older
    # checkout's fork server must agree with the pool.
    assert {k.name: int(k) for k in Kind} == {
        "FUNC": 1,
        "CALL": 2,
        "FORGET": 3,
        "CANCEL": 4,
        "VERDICT": 5,
        "HELLO": 10,
        "FAILED": 11,
        "OK": 12,
        "ERROR": 13,
        "SKIPPED": 14,
    }
    for kind in Kind:
        assert getattr(_protocol, kind.name) is kind  # the module constants are the members
        assert record(kind, b"")[0] == kind


def test_a_record_slot_holds_a_call_with_an_inline_array() -> None:
    # An array up to the inline limit rides in the record: with the call's own
    # pickle around it, it must still fit one slot (else every call spills).
    enc = _codec.encode_call((np.ones(_codec.INLINE_MAX // 8),), {}, None)
    assert HEADER.size + len(enc.data) <= RECORD_SIZE
    ring = shm.Ring(2, RECORD_SIZE)
    try:
        ring.push(record(CALL, enc.data), timeout=1)
        rec = ring.try_pop()
        assert rec is not None
        (args, kwargs) = _codec.decode(body_of(rec, rec[1]))
        assert np.array_equal(args[0], np.ones(_codec.INLINE_MAX // 8))
        assert kwargs == {}
    finally:
        ring.close()


@pytest.fixture
def arena() -> Iterator[shm.Arena]:
    with shm.Arena(1 << 20, name="protocol-test") as a:
        yield a


def test_a_body_that_fits_stays_in_the_record(arena: shm.Arena) -> None:
    body = bytes(range(256)) * ((RECORD_SIZE - HEADER.size) // 256)
    body += b"x" * (RECORD_SIZE - HEADER.size - len(body))  # exactly a full slot
    rec = spill(OK, body, arena, None, task_id=5, fn_id=1)
    assert len(rec) == RECORD_SIZE
    kind, flags, fn_id, task_id = HEADER.unpack_from(rec)
    assert (kind, flags, fn_id, task_id) == (OK, 0, 1, 5)
    assert bytes(body_of(rec, flags)) == body
    assert arena.stats().allocations == 0


def test_a_body_one_byte_too_big_is_spilled_through_the_arena(arena: shm.Arena) -> None:
    body = np.random.default_rng(0).bytes(RECORD_SIZE - HEADER.size + 1)
    rec = spill(ERROR, body, arena, None, task_id=9)
    kind, flags, _, task_id = HEADER.unpack_from(rec)
    assert (kind, flags, task_id) == (ERROR, SPILLED, 9)
    assert len(rec) < 200  # a descriptor, not the bytes
    assert arena.stats().allocations == 1
    view = body_of(rec, flags)
    assert bytes(view) == body
    del view
    arena.collect()
    assert arena.stats().allocations == 0, "the spilled body's memory was not given back"


def test_spin_until_polls_for_a_moment_then_gives_up() -> None:
    assert spin_until(lambda: True, 0.0)
    t0 = time.perf_counter()
    assert not spin_until(lambda: False, 0.01)
    assert time.perf_counter() - t0 >= 0.01
    calls = []
    assert spin_until(lambda: calls.append(1) or len(calls) > 3, 5.0)
    assert len(calls) == 4


# ---------------------------------------------------------------- the worker's side, here


def _double(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return a * 2


def _fail() -> None:
    raise KeyError("nope")


class _Wire:
    """The pool's ends of a worker's rings, and the worker's loop, in this process."""

    def __init__(self, arena: shm.Arena) -> None:
        self.tasks = shm.Ring(16, RECORD_SIZE)
        self.done = shm.Ring(16, RECORD_SIZE)
        self.releases = shm.Ring(64, shm.RELEASE_RECORD_SIZE)
        self.lifeline = shm.Lifeline()
        boot = _worker.WorkerBoot(
            index=0,
            generation=0,
            tasks=self.tasks,
            done=self.done,
            arg_releases=self.releases,
            result_releases=self.releases,
            lifeline=self.lifeline,
            main_arena_id=arena.id,
            main_pid=0,
            seed_entropy=0,
            init=None,
            segment_size=1 << 20,
            inline_max=_codec.INLINE_MAX,
        )
        self.worker = _worker._Worker(boot, arena)

    def run(self) -> list[tuple[int, int, bytes]]:
        """Let the worker handle what its ring holds; (kind, task id, body) it sent back."""
        self.worker.take(0)
        while self.worker.backlog:
            self.worker.handle(self.worker.backlog.popleft())
        out = []
        while (rec := self.done.try_pop()) is not None:
            kind, flags, _, task_id = HEADER.unpack_from(rec)
            out.append((kind, task_id, bytes(body_of(rec, flags))))
        return out

    def close(self) -> None:
        for ring in (self.tasks, self.done, self.releases):
            ring.close()
        self.lifeline.close()


@pytest.fixture
def wire(arena: shm.Arena) -> Iterator[_Wire]:
    w = _Wire(arena)
    yield w
    w.close()


def test_func_then_call_come_back_as_ok_with_the_result(wire: _Wire) -> None:
    x = np.arange(5.0)
    wire.tasks.push_many(
        [
            record(FUNC, cloudpickle.dumps(_double), fn_id=1),
            record(CALL, _codec.encode_call((x,), {}, None).data, task_id=41, fn_id=1),
        ]
    )
    [(kind, task_id, body)] = wire.run()
    assert (kind, task_id) == (OK, 41)
    assert np.array_equal(_codec.decode(body), x * 2)
    # The function is cached by its id: a second call needs no FUNC record.
    wire.tasks.push(record(CALL, _codec.encode_call((x,), {}, None).data, task_id=42, fn_id=1))
    [(kind, task_id, _)] = wire.run()
    assert (kind, task_id) == (OK, 42)
    # FORGET drops it: a call naming it now fails, as an ERROR record.
    wire.tasks.push(record(FORGET, struct.pack("<I", 1)))
    wire.tasks.push(record(CALL, _codec.encode_call((x,), {}, None).data, task_id=43, fn_id=1))
    [(kind, task_id, body)] = wire.run()
    assert (kind, task_id) == (ERROR, 43)
    exc, tb = pickle.loads(body)
    assert isinstance(exc, KeyError)
    assert "Traceback" in tb


def test_an_exception_comes_back_as_an_error_record_with_its_traceback(wire: _Wire) -> None:
    wire.tasks.push_many(
        [
            record(FUNC, cloudpickle.dumps(_fail), fn_id=2),
            record(CALL, _codec.encode_call((), {}, None).data, task_id=7, fn_id=2),
        ]
    )
    [(kind, task_id, body)] = wire.run()
    assert (kind, task_id) == (ERROR, 7)
    exc, tb = pickle.loads(body)
    assert type(exc) is KeyError
    assert exc.args == ("nope",)
    assert "_fail" in tb


@pytest.mark.parametrize("verdict", [b"\x01", b"\x00"])
def test_cancel_and_verdict_decide_whether_the_call_runs(wire: _Wire, verdict: bytes) -> None:
    # The pool's side of the handshake for call number 1: CANCEL 1, then the
    # verdict. The worker skips the call exactly when the verdict says cancel.
    wire.tasks.push_many(
        [
            record(FUNC, cloudpickle.dumps(_double), fn_id=1),
            record(CANCEL, b"", 1),
            record(VERDICT, verdict, 1),
            record(CALL, _codec.encode_call((np.ones(3),), {}, None).data, task_id=9, fn_id=1),
        ]
    )
    [(kind, task_id, _)] = wire.run()
    assert task_id == 9
    assert kind == (SKIPPED if verdict == b"\x01" else OK)
    assert wire.done.progress() == 1  # the worker published that it reached call 1
