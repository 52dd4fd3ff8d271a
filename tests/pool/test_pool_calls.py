"""The pool's and shared memory's Python calls a call, in the main process (issue 37).

At 2 workers the main process runs its code cold after every sleep, once a
pipeline batch or so, so a batch costs about as much as the Python calls it
makes (docs/scaling.md). These count the calls a pipeline-like unit (a small
record, and its rows of a block passed writable) makes in the pool's sending
and delivering modules and in ``shm``: the ring's push and pop, sharing the
block, collecting its release. Before the ring's and the arena's hot paths
were folded into one call each, a unit's encoding made 27 calls in ``shm`` and
a round trip through a pool 74-75 in those modules (all threads); 11 and 37 now.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import _codec
from shm._views import RELEASE

pytestmark = pytest.mark.usefixtures("no_leaks")

#: The modules counted: shared memory, and the pool's own but for the caller's
#: side of a call (``_executor``, ``_future``), which another round reworks.
_MODULES = ("/shm/", "/_pool/_state.py", "/_pool/_sender.py", "/_pool/_manager.py")
_MODULES += ("/_pool/_delivery.py", "/mpexec/_protocol.py")


class _Counter:
    """Python calls made in ``_MODULES`` while ``on``, in any thread that runs profiled."""

    def __init__(self, modules: tuple[str, ...] = _MODULES) -> None:
        self.modules = modules
        self.on = False
        self.calls = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if self.on and event == "call" and any(m in frame.f_code.co_filename for m in self.modules):
            self.calls += 1


def _warm_then_count(call: Any, counter: _Counter, *, this_thread: bool) -> None:
    """``call(i)`` for 8 warm-up calls (the function sent, every cache filled), then 8
    counted; ``this_thread``: profile this thread too (the others are profiled already)."""
    for i in range(8):
        call(i)
    if this_thread:
        sys.setprofile(counter)
    counter.on = True
    try:
        for i in range(8, 16):
            call(i)
    finally:
        counter.on = False
        if this_thread:
            sys.setprofile(None)


def _fill(chunk: tuple[int, int], out: tuple[np.ndarray[Any, Any]]) -> int:
    out[0][:] = chunk[0]
    return chunk[1]


def test_a_units_encoding_makes_few_calls_in_shared_memory() -> None:
    """Sharing a unit's block writable, with its previous block's release to collect."""
    with shm.Arena(1 << 22, name="units", sealed=True) as arena:
        peer = arena.link()
        slab = arena.empty((16, 4096), np.uint8, peer_writable=True)
        blocks = [np.ndarray((64, 16), np.float32, slab[i]) for i in range(16)]
        shared = []
        counter = _Counter(("/shm/",))

        def encode(i: int) -> None:
            if shared:  # the worker released the previous unit's block (not counted)
                on, counter.on = counter.on, False
                peer.try_push(RELEASE.pack(arena.id, shared[-1].alloc_id, 1))
                counter.on = on
            enc = _codec.encode_call(((i, 3),), {"out": (_codec.Writable(blocks[i]),)}, arena, peer)
            shared.extend(enc.refs.shared)

        for i in range(8):  # warm every cache
            encode(i)
        counter.on = True
        sys.setprofile(counter)
        try:
            for i in range(8, 16):
                encode(i)
        finally:
            sys.setprofile(None)
        assert counter.calls / 8 <= 12, counter.calls / 8  # 27 before, 11 now
        peer.try_push(RELEASE.pack(arena.id, shared[-1].alloc_id, 1))
        arena.collect()
        assert arena.stats().exported == 0
        blocks.clear()
        del slab


def _hooked_calls(
    pool: mpexec.WorkerPool,
    fn: Any,
    kwargs_of: Any,
    results: list[Any],
) -> Any:
    """``call(i)``: ``fn((i, i + 1), **kwargs_of(i))`` through ``submit_hooked``, waited for;
    its result appended to ``results`` by the hook (in the manager's thread)."""
    done = threading.Semaphore(0)

    def hook(outcome: Any) -> None:
        results.append(outcome.result())
        done.release()

    def call(i: int) -> None:
        pool.submit_hooked(fn, ((i, i + 1),), kwargs_of(i), None, hook)
        assert done.acquire(timeout=30)

    return call


def _unprofile_threads() -> None:
    """Undo ``threading.setprofile``, and the profile events its threads left on.

    A thread that ends with a profile function set leaves CPython 3.12+'s profile
    events on (the pool's manager, profiled here, ends so): code runs instrumented
    after, and the next ``sys.setprofile(f)`` reports its own return to ``f``.
    This thread's ``sys.setprofile(None)`` turns them off.
    """
    threading.setprofile(None)  # type: ignore[arg-type]
    sys.setprofile(None)


def test_a_pool_round_trip_makes_few_calls_in_the_pool_and_shared_memory() -> None:
    """submit_hooked, the worker's answer, the manager's delivery: counted in every thread."""
    counter = _Counter()
    threading.setprofile(counter)  # the manager thread, started by the pool below
    try:
        with mpexec.WorkerPool(1) as pool:
            slab = pool.empty((16, 4096), np.uint8)
            blocks = [np.ndarray((64, 16), np.float32, slab[i]) for i in range(16)]
            results: list[Any] = []
            call = _hooked_calls(
                pool, _fill, lambda i: {"out": (_codec.Writable(blocks[i]),)}, results
            )

            _warm_then_count(call, counter, this_thread=True)
            assert results == list(range(1, 17))
            assert all((blocks[i] == i).all() for i in range(16))
            blocks.clear()
        del slab
    finally:
        _unprofile_threads()
    assert counter.calls / 8 <= 42, counter.calls / 8  # 74-75 before, 37 now


def _sum(a: Any, b: Any) -> Any:
    return np.asarray(a + b)


def _run_calls_in_a_thread(
    pool: Any, counter: Any, fn: Any, args: Any, calls: int, warm: int = 8
) -> list[Any]:
    """``pool.run_call(fn, args(i))`` ``calls`` times from a thread of its own (a TF
    op's body), ``counter`` profiling that thread after ``warm`` calls (the function
    sent, every cache filled); each result's first item, the result dropped."""
    seen: list[Any] = []

    def body() -> None:
        for i in range(calls):
            if i == warm:
                sys.setprofile(counter)
                counter.on = True
            result = pool.run_call(fn, args(i))
            seen.append(result.flat[0].item())
            del result
        counter.on = False
        sys.setprofile(None)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    return seen


def test_a_run_call_of_arrays_makes_few_calls_in_the_pools_state_and_codec() -> None:
    """A TF op's body: ``run_call`` of a 0-d array from a thread of its own, unpinned.

    Its arguments and result went through a pickler and an unpickler, and the
    pick of the least busy worker through a property and a helper a heap entry:
    32 calls a call in ``_state`` and ``_codec`` (all threads) before, 21 now.
    """
    counter = _Counter(("/_pool/_state.py", "/mpexec/_codec.py"))
    threading.setprofile(counter)
    try:
        with mpexec.WorkerPool(2) as pool:
            x, y = np.asarray(np.int64(3)), np.arange(4.0)
            seen = _run_calls_in_a_thread(pool, counter, _sum, lambda i: (x, y), 24)
            assert seen == [3.0] * 24
    finally:
        _unprofile_threads()
    assert counter.calls / 16 <= 24, counter.calls / 16  # 32 before, 21 now


def _image(i: Any) -> Any:
    return np.full((224, 224, 3), float(i), np.float32)  # 600 KB, as the augment's result


def test_a_run_call_with_a_shared_result_makes_few_calls_in_its_thread() -> None:
    """A TF op's body, whole: ``run_call`` from a thread of its own, a 600 KB result.

    Every Python call of the caller's thread is counted: its submit, its direct
    read of the done ring (with the manager standing aside: each ring's
    ``fileno()`` was three calls), the result's opening (a ``contextlib.suppress``
    when results come from two workers in turn) and its release. The thread
    wakes cold for each call of a heavy op, where each Python call costs
    several times its warm cost: 80 calls a call before, 67 now.
    """
    counter = _Counter(("",))  # every module
    with mpexec.WorkerPool(2) as pool:
        seen = _run_calls_in_a_thread(
            pool, counter, _image, lambda i: (np.asarray(np.int64(i)),), 40
        )
        assert seen == [float(i) for i in range(40)]
    assert counter.calls / 32 <= 70, counter.calls / 32  # 80 before, 67 now


def test_a_hooked_submit_makes_few_calls_in_the_pools_send_path() -> None:
    """The caller's side of ``submit_hooked``: the fork check, the worker's pick, the
    record's header and the byte counts are inline in ``_submit`` and ``send`` (one
    Python frame each of ``check_not_forked``, ``pick_slot``, ``spill`` and
    ``count_sent`` a call before: 4 frames fewer)."""
    modules = ("/_pool/_executor.py", "/_pool/_state.py", "/_pool/_sender.py")
    counter = _Counter((*modules, "/mpexec/_protocol.py"))
    with mpexec.WorkerPool(1) as pool:
        slab = pool.empty((16, 4096), np.uint8)
        blocks = [np.ndarray((64, 16), np.float32, slab[i]) for i in range(16)]
        done = threading.Semaphore(0)

        def hook(outcome: Any) -> None:
            outcome.result()
            done.release()

        def call(i: int) -> None:
            out = {"out": (_codec.Writable(blocks[i]),)}
            counter.on = True
            pool.submit_hooked(_fill, ((i, i + 1),), out, None, hook)
            counter.on = False
            assert done.acquire(timeout=30)

        for i in range(8):  # warm: the function is sent, every cache filled
            call(i)
        counter.calls = 0
        sys.setprofile(counter)  # this thread only: the caller's side
        try:
            for i in range(8, 16):
                call(i)
        finally:
            sys.setprofile(None)
        blocks.clear()
        del slab
    assert counter.calls / 8 <= 7, counter.calls / 8  # 10 before, 6 now


def test_a_delivered_call_is_released_and_settled_in_one_frame() -> None:
    """The manager's delivery: ``Task.finish`` drops the call's arguments and settles its
    future in one frame (``release()`` then ``settle()`` before). Frames of ``_future`` a
    hooked call in the manager's thread, with the unit's ``_settle`` and the hook's
    ``result()``: 4 before, 3 now."""
    counter = _Counter(("/_pool/_future.py",))
    threading.setprofile(counter)  # the manager thread, started by the pool below
    try:
        with mpexec.WorkerPool(1) as pool:
            results: list[Any] = []
            call = _hooked_calls(pool, _fill_none, lambda i: {}, results)

            _warm_then_count(call, counter, this_thread=False)
            assert results == list(range(1, 17))
    finally:
        _unprofile_threads()
    # This thread runs unprofiled: the count is the manager's, and the outcome's readers.
    assert counter.calls / 8 <= 3, counter.calls / 8  # 4 before, 3 now


def _fill_none(chunk: tuple[int, int]) -> int:
    return chunk[1]
