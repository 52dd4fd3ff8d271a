"""WorkerPool and shared memory at the edges: held results that outlive their
worker, what a worker can write, running out of memory, broadcast arrays."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
from typing import Any

import numpy as np
import pytest

import mpexec
import shm
from mpexec import WorkerPool, fn
from tests.conftest import memfd_count, run_python, wait_until

T = 30  # every .result() in this file is bounded by this
KiB = 1 << 10
BIG = 64 * KiB  # above the 16 KiB inline limit: travels by descriptor
PAGE = shm.platform_info().page_size

pytestmark = pytest.mark.usefixtures("no_leaks")


# ---------------------------------------------------------------- worker functions
def _arange(n: int) -> np.ndarray[Any, Any]:
    return np.arange(n, dtype=np.float64)


def _total(a: np.ndarray[Any, Any]) -> float:
    return float(a.sum())


def _die() -> None:
    os._exit(3)


def _pid() -> int:
    return os.getpid()


def _arena_maps(owner: int) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of every mapping here of ``owner``'s arena segments."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            if f"mpx-arena-{owner}" in line:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                found.append((lo, hi, perms))
    return found


def _fill_and_map(
    x: np.ndarray[Any, Any], out: np.ndarray[Any, Any], owner: int
) -> tuple[list[tuple[int, int, str]], int, int]:
    out[...] = 7
    return _arena_maps(owner), out.ctypes.data, x.ctypes.data


def _read_and_map(x: np.ndarray[Any, Any], owner: int) -> tuple[list[tuple[int, int, str]], int]:
    return _arena_maps(owner), x.ctypes.data


def _poke(x: np.ndarray[Any, Any]) -> None:
    # What a buggy C extension does: write through a raw pointer, flags or not.
    ctypes.memset(x.ctypes.data, 0xFF, 8)


# ---------------------------------------------------------------- held results (issue 17.4)
def _replace_worker(pool: WorkerPool) -> None:
    """Make the pool's only worker die and wait until its replacement answers."""
    old = pool.submit(_pid).result(T)
    with pytest.raises(mpexec.WorkerCrashedError):
        pool.submit(_die).result(T)
    assert pool.submit(_pid).result(T) != old


def test_held_result_still_travels_after_its_worker_was_replaced() -> None:
    n = BIG // 8 * 4
    with WorkerPool(1, restart=True) as pool:
        r = pool.submit(_arange, n).result(T)
        _replace_worker(pool)
        # Its memory is mapped only here now: it must be sent all the same.
        assert pool.submit(_total, r).result(T) == r.sum()
        assert pool.submit(_total, r[::2]).result(T) == r[::2].sum()
        assert pool.submit(_total, r[n // 2 :]).result(T) == r[n // 2 :].sum()
        # A result is the caller's to change: what travels is what it holds now.
        r[:] = 1.0
        assert pool.submit(_total, r).result(T) == n
        assert np.array_equal(pool.submit(np.negative, r).result(T), -r)


def test_held_pipeline_sample_travels_after_the_pipeline_closed() -> None:
    n = BIG // 8

    def source(info: Any) -> np.ndarray[Any, Any]:
        return np.full(n, info.idx_in_batch + 1, dtype=np.float64)

    @mpexec.pipeline_def(batch_size=2, num_workers=1, seed=1)
    def graph() -> Any:
        return fn.python_function(fn.external_source(source=source, batch=False), function=_neg)

    with graph() as pipe:
        (batch,) = pipe.run()
    held = batch[1]
    assert not held.flags.writeable
    with WorkerPool(1) as pool:
        before = pool.stats()
        for _ in range(2):
            assert pool.submit(_total, held).result(T) == -2.0 * n
            assert pool.submit(_total, held[::3]).result(T) == -2.0 * len(held[::3])
        # Copied (only what each view holds), and given back once the worker is done.
        copied = pool.stats().bytes_copied - before.bytes_copied
        assert copied == 2 * (held.nbytes + held[::3].nbytes)
        wait_until(lambda: pool.stats().arena.in_use == before.arena.in_use, T, "copies freed")


def _neg(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return -x


# ---------------------------------------------------------------- what a worker can write (17.5)
def test_a_writable_argument_is_mapped_alone_and_only_while_the_call_runs() -> None:
    with WorkerPool(1) as pool:
        x = pool.put(np.arange(3 * PAGE // 8, dtype=np.float64))
        out = pool.empty(2 * PAGE + 24, np.uint8)
        call = pool.submit(_fill_and_map, x, mpexec.writable(out), os.getpid())
        maps, out_at, x_at = call.result(T)
        assert (out == 7).all()
        writable = [m for m in maps if "w" in m[2]]
        # One writable mapping: just the pages ``out`` spans, nothing before or after.
        lo = out_at // PAGE * PAGE
        hi = -(-(out_at + out.nbytes) // PAGE) * PAGE
        assert writable == [(lo, hi, "rw-s")]
        # The read-only input lies in a read-only mapping.
        assert [m[2] for m in maps if m[0] <= x_at < m[1]] == ["r--s"]
        # Between calls nothing of the caller's is writable: the pages of
        # ``out`` stay mapped, inaccessible, for the next call that writes them.
        maps, x_at = pool.submit(_read_and_map, x, os.getpid()).result(T)
        assert [m for m in maps if "w" in m[2]] == []
        assert [m[2] for m in maps if m[0] <= x_at < m[1]] == ["r--s"]
        assert [m[2] for m in maps if m[0] <= out_at < m[1]] == ["---s"]
        # ... and the same pages written again reuse them, writable for that call only.
        out[...] = 0
        maps, again, _ = pool.submit(_fill_and_map, x, mpexec.writable(out), os.getpid()).result(T)
        assert (again, (out == 7).all()) == (out_at, True)
        assert [m for m in maps if "w" in m[2]] == [(lo, hi, "rw-s")]


_kept: list[np.ndarray[Any, Any]] = []  # in a worker: views a function kept


def _keep(out: np.ndarray[Any, Any]) -> None:
    _kept.append(out)  # kept past its call: a global, a closure, a cache, a thread
    out[...] = 1


def _write_kept(value: int) -> int:
    _kept[-1][...] = value  # a later call, which was not given ``out``
    return int(_kept[-1][0])


def test_a_writable_view_a_function_keeps_cannot_write_after_its_call() -> None:
    with WorkerPool(1, restart=True) as pool:
        out = pool.empty(2 * PAGE, np.uint8)
        assert pool.submit(_keep, mpexec.writable(out)).result(T) is None
        assert (out == 1).all()
        out[...] = 2  # the caller's again, once the call returned
        with pytest.raises(mpexec.WorkerCrashedError, match="SIGSEGV"):
            pool.submit(_write_kept, 9).result(T)
        assert (out == 2).all()
        # The same pages lent again are writable for that call, as before.
        assert pool.submit(_keep, mpexec.writable(out)).result(T) is None
        assert (out == 1).all()


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def _fill_counting_faults(out: np.ndarray[Any, Any], value: int) -> int:
    before = _minor_faults()
    out[...] = value
    return _minor_faults() - before


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_pages_written_call_after_call_stay_warm_in_the_worker() -> None:
    # A pipeline's output blocks come back to a worker call after call, each
    # time at another place of the pool's memory: every page of them used to
    # fault again (a fresh mapping each time), ~0.5-2 us a page.
    pages = 64
    with WorkerPool(1) as pool:
        blocks = [pool.empty(pages * PAGE, np.uint8) for _ in range(8)]
        first = [
            pool.submit(_fill_counting_faults, mpexec.writable(b), 1).result(T) for b in blocks
        ]
        assert min(first) >= pages  # the first write of each page faults it in
        for round_ in range(3):
            again = [
                pool.submit(_fill_counting_faults, mpexec.writable(b), round_).result(T)
                for b in blocks
            ]
            assert max(again) < 8, again  # not one fault a page: the pages stayed mapped
        assert all((b == 2).all() for b in blocks)


def _image_sized(n: int) -> np.ndarray[Any, Any]:
    return np.full(n, 3, np.uint8)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_worker_reuses_the_block_of_its_last_released_result() -> None:
    # Results are released by the caller once copied. Applied only when the
    # arena ran out, releases let every result take a fresh block until the
    # worker's segment wrapped: its whole segment faulted in, a page at a time.
    size = 600 * KiB
    with WorkerPool(1, worker_arena_size=256 << 20) as pool:
        for _ in range(10):
            pool.submit(_image_sized, size).result(T)
        before = pool.stats().worker_faults
        calls = 200  # 117 MiB of results: half the segment, were each block fresh
        for _ in range(calls):
            pool.submit(_image_sized, size).result(T)
        per_call = (pool.stats().worker_faults - before) / calls
        assert per_call < 5, per_call  # 150 pages a result: fresh blocks fault each


def _first(a: np.ndarray[Any, Any]) -> float:
    return float(a[0])


def test_releases_of_arguments_in_pool_memory_do_not_pile_up() -> None:
    # Calls on an array already in shared memory allocate nothing in the caller,
    # which read its release rings only when it allocated: the worker's releases
    # filled the ring (4,096), then piled up in the worker, one more a call, for
    # as long as such calls went on. The caller reads them when it shares too.
    with WorkerPool(1) as pool:
        x = pool.put(np.ones(BIG // 8))
        ring = pool._state.slots[0].arg_releases
        assert ring is not None
        for _ in range(ring.capacity + 100):
            assert pool.submit(_first, x).result(T) == 1.0
        assert ring.stats().occupancy <= 16, ring.stats()
        assert pool.stats().arena.exported <= 16


def _temporaries(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # An augmentation's shape of work: a few image-sized temporaries per call.
    a = x.astype(np.float32) * 0.5
    b = np.sqrt(a + 1.0)
    return (a + b)[::2, ::2].copy()


def _keeps_warm_memory() -> bool:
    from mpexec._host import keep_memory_warm

    return keep_memory_warm(1 << 20)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_warm_memory_keeps_a_pipelines_workers_from_faulting() -> None:
    with WorkerPool(1) as probe:
        if not probe.submit(_keeps_warm_memory).result(T):
            pytest.skip("malloc here is not glibc's (another libc, or an allocator preloaded)")
    image = np.ones((224, 224, 3), np.uint8)

    def per_sample(warm_memory: int) -> float:
        """Workers' faults a sample in the quietest of up to twenty stretches of 8 batches.

        A worker takes whichever samples come free, so until it has read and
        written every block the pipeline cycles through, a stretch still meets
        pages new to it (one batch's worth, ~5 faults a sample): one to three
        stretches on a quiet host, more under load (all ten of a run under the
        tox matrix once read 4.6).
        """
        with WorkerPool(2, warm_memory=warm_memory, results="view") as pool:
            pipe = mpexec.Pipeline(batch_size=16, pool=pool, prefetch_depth=2)
            with pipe:
                x = fn.external_source(source=lambda: [image] * 16)
                pipe.set_outputs(fn.python_function(x, function=_temporaries))
            stretches = []
            with pipe:
                for _ in range(8):
                    pipe.run()
                while len(stretches) < 20 and min(stretches, default=1.0) >= 1.0:
                    before = pipe.stats()
                    for _ in range(8):
                        pipe.run()
                    after = pipe.stats()
                    faults = after.worker_faults - before.worker_faults
                    stretches.append(faults / (after.samples - before.samples))
            return min(stretches)

    # glibc's defaults hand the temporaries back after every call: ~90 faults each
    # (down to 47 in the quietest stretch on a loaded host, base code included).
    cold = per_sample(0)
    assert cold > 30
    # Warm, the temporaries stay mapped: once the blocks are warm, no faults (0-1 on
    # a quiet host); a loaded host's stretches may each still meet one batch's new
    # pages (~5), which is still a tenth of the cold figure.
    assert per_sample(64 << 20) < 6


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")
def test_a_repeated_64_mib_call_faults_no_fresh_pages_in_the_worker() -> None:
    """``x * 2`` of 64 MiB, call after call: its result's pages are the last call's.

    Above glibc's largest mmap threshold (32 MiB), the result was a fresh
    mapping every call, zeroed page by page by the kernel and unmapped at
    ``free``: ~40% of the call. Now the default warm memory keeps it.
    """
    with WorkerPool(1) as probe:
        if not probe.submit(_keeps_warm_memory).result(T):
            pytest.skip("malloc here is not glibc's (another libc, or an allocator preloaded)")

    def faults_per_call(pool: WorkerPool) -> float:
        # The argument in one block of the pool's memory, call after call (a
        # plain array is copied into whichever block is free, and the worker
        # reads a block new to it when the last one's release is still on its way).
        x = pool.put(np.ones(16 << 20, np.float32))
        for _ in range(2):  # the first calls fault their blocks in once
            assert pool.submit(_double, x).result(T)[-1] == 2
        before = pool.stats().worker_faults
        for _ in range(4):
            got = pool.submit(_double, x).result(T)
            assert got[0] == 2
            del got
        faults = (pool.stats().worker_faults - before) / 4
        del x
        return faults

    with WorkerPool(1, warm_memory=0) as pool:
        cold = faults_per_call(pool)
    with WorkerPool(1) as pool:  # the default
        warm = faults_per_call(pool)
    # Cold, every page of the 64 MiB is new: at least one fault per 2 MiB
    # (transparent huge pages), 16,384 with 4 KiB pages.
    assert cold >= 32
    assert warm < 8


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _leave_a_free_block_under_a_live_one(n: int) -> tuple[int, int]:
    """A large temporary freed below a block that stays: the heap keeps it, free."""
    from mpexec._host import heap_free_bytes

    temp = np.ones(n, np.uint8)
    _kept.append(np.ones(1 << 20, np.uint8))  # after temp, in the heap: above it
    del temp
    return heap_free_bytes() or 0, _resident()


_kept: list[Any] = []


def _heap_free() -> int:
    from mpexec._host import heap_free_bytes

    return heap_free_bytes() or 0


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_warm_memory_hands_back_free_heap_blocks_past_its_bound() -> None:
    """malloc trims only the heap's free top; a freed block under a live one
    stays resident whatever its size, unless the worker hands it back past the bound."""
    with WorkerPool(1) as probe:
        if not probe.submit(_keeps_warm_memory).result(T) or not probe.submit(_heap_free).result(T):
            pytest.skip("malloc here is not glibc's, or glibc has no mallinfo2 (before 2.33)")
    n = 96 << 20
    with WorkerPool(1, warm_memory=48 << 20) as pool:
        free, resident = pool.submit(_leave_a_free_block_under_a_live_one, n).result(T)
        assert free >= n  # kept by malloc while the call ran, resident
        assert pool.submit(_resident).result(T) < resident - n // 2  # handed back after it


def test_warm_memory_is_off_where_another_malloc_was_preloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """jemalloc or tcmalloc preloaded (as in many ML images): glibc's mallopt and
    mallinfo2 still answer, for a heap nobody allocates from (seen on a 16-core GPU
    host: no faults without warm_memory, a heap that never held the 96 MiB block)."""
    import ctypes
    from types import SimpleNamespace

    from mpexec import _host

    if not _host.glibc_malloc():
        pytest.skip("malloc here is not glibc's")
    # The process's malloc is found first: stand another function in for a preloaded one.
    preloaded = SimpleNamespace(malloc=ctypes.CDLL(None).free)
    monkeypatch.setattr(_host, "_libc", lambda: preloaded)
    _host.glibc_malloc.cache_clear()
    try:
        assert not _host.glibc_malloc()
        assert not _host.keep_memory_warm(1 << 20)
        assert _host.heap_free_bytes() is None
    finally:
        _host.glibc_malloc.cache_clear()
    monkeypatch.undo()
    assert _host.glibc_malloc()


def test_warm_memory_must_be_a_byte_count() -> None:
    for bad in (-1, True, 1.5, "64M"):
        with pytest.raises(ValueError, match="warm_memory"):
            WorkerPool(0, warm_memory=bad)  # type: ignore[arg-type]


_stash: list[Any] = []


def _fill_and_keep(a: np.ndarray[Any, Any]) -> None:
    a[...] = 1
    _stash.append(a)  # a view that outlives its call (a user's cache, say)


def _write_after_dropping_a_neighbour(b: np.ndarray[Any, Any]) -> int:
    import gc

    _stash.clear()  # the neighbour's pages become inaccessible, but for the one it shares with b
    gc.collect()
    b[...] = 2
    return int(b.sum())


def test_writable_views_sharing_a_page_keep_it_while_either_lives() -> None:
    # Rows of one block written by one worker in two calls share the page at
    # their boundary: closing the first view must not take it from the second.
    with WorkerPool(1) as pool:
        out = pool.empty(4 * PAGE, np.uint8)
        cut = 2 * PAGE + 100
        pool.submit(_fill_and_keep, mpexec.writable(out[:cut])).result(T)
        total = pool.submit(_write_after_dropping_a_neighbour, mpexec.writable(out[cut:])).result(T)
        assert total == 2 * (out.size - cut)
        assert (out[:cut] == 1).all()
        assert (out[cut:] == 2).all()


def test_pool_buffers_have_their_pages_to_themselves() -> None:
    with WorkerPool(1) as pool:
        arrays = [pool.empty(n, np.uint8) for n in (1, 100, PAGE, PAGE + 1)]
        arrays += [pool.put(np.ones(n, np.uint8)) for n in (3, 5000)]
        pages = []
        for a in arrays:
            assert a.ctypes.data % PAGE == 0
            pages.append(range(a.ctypes.data // PAGE, -(-(a.ctypes.data + a.nbytes) // PAGE)))
        for i, p in enumerate(pages):
            for q in pages[i + 1 :]:
                assert not set(p) & set(q)


def test_a_raw_write_to_a_read_only_input_kills_the_worker_not_the_data() -> None:
    with WorkerPool(1, restart=True) as pool:
        x = pool.put(np.arange(BIG // 8, dtype=np.float64))
        out = pool.empty(BIG // 8)
        with pytest.raises(mpexec.WorkerCrashedError) as info:
            pool.submit(_poke_both, x, mpexec.writable(out)).result(T)
        assert info.value.exitcode == -signal.SIGSEGV
        assert np.array_equal(x, np.arange(BIG // 8, dtype=np.float64))
        # the writable one did take the write: it is the only memory a worker may change
        with pytest.raises(mpexec.WorkerCrashedError):
            pool.submit(_poke, x).result(T)
        assert np.array_equal(x, np.arange(BIG // 8, dtype=np.float64))


def _poke_both(x: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
    ctypes.memset(out.ctypes.data, 0, 8)
    _poke(x)


# ---------------------------------------------------------------- out of memory (17.7)
def _big(n: int) -> np.ndarray[Any, Any]:
    return np.ones(n, dtype=np.uint8)


def test_an_arena_at_its_cap_is_a_reservation_error_not_a_pickling_one() -> None:
    with WorkerPool(1, arena_size=1 << 20, arena_capacity=2 << 20) as pool:
        with pytest.raises(shm.ReservationError) as info:
            pool.submit(_total, np.ones(4 << 20, np.uint8))
        assert isinstance(info.value, MemoryError)
        assert not isinstance(info.value, mpexec.SerializationError)
        assert "cap" in str(info.value)
        # nothing was left behind: the pool works on
        assert pool.submit(_total, np.ones(1000)).result(T) == 1000


def test_memory_running_out_while_an_arena_grows_is_a_reservation_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with WorkerPool(1, arena_size=1 << 20) as pool:
        # The machine has no memory left for a new segment.
        monkeypatch.setattr("shm._segment.free_bytes", lambda backend: 1 << 20)
        with pytest.raises(shm.ReservationError, match="cannot reserve"):
            pool.submit(_total, np.ones(4 << 20, np.uint8))
        monkeypatch.undo()
        assert pool.submit(_total, np.ones(1000)).result(T) == 1000


def test_a_worker_out_of_shared_memory_reports_a_reservation_error() -> None:
    with WorkerPool(1, worker_arena_size=1 << 20) as pool:
        fut = pool.submit(_big_in_small_worker)
        with pytest.raises(shm.ReservationError):
            fut.result(T)
        assert pool.submit(_total, np.ones(10)).result(T) == 10


def _big_in_small_worker() -> Any:
    # The worker's arena must grow to send this result, and (as free_bytes
    # reports it) the machine has no memory left for that; this worker stays so.
    shm._segment.free_bytes = lambda backend: 1 << 20  # type: ignore[attr-defined]
    return np.ones(8 << 20, np.uint8)


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * PAGE


def _big_under_a_cap(n: int) -> np.ndarray[Any, Any]:
    # The result exists; this worker's address space then has no room to map
    # the arena segment that must carry it back.
    out = np.ones(n, np.uint8)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped_bytes() + (16 << 20), resource.RLIM_INFINITY))
    return out


def test_a_worker_out_of_address_space_reports_a_reservation_error() -> None:
    with WorkerPool(1) as pool:
        with pytest.raises(shm.ReservationError, match="RLIMIT_AS") as info:
            pool.submit(_big_under_a_cap, 256 << 20).result(T)
        assert isinstance(info.value, MemoryError)
        assert not isinstance(info.value, mpexec.SerializationError)


_CALLER_OUT_OF_ADDRESS_SPACE = """
import resource, sys
import numpy as np
import shm
from mpexec import WorkerPool

def total(a):
    return float(a.sum())

def big(n):
    return np.ones(n, np.uint8)

def mapped():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * shm.platform_info().page_size

def report(what, call):
    try:
        call()
    except BaseException as exc:
        print(what, type(exc).__name__, isinstance(exc, MemoryError), "RLIMIT_AS" in str(exc))
    else:
        print(what, "no error")

with WorkerPool(1) as pool:
    arg = np.ones(300 << 20, np.uint8)
    resource.setrlimit(resource.RLIMIT_AS, (mapped() + (100 << 20), resource.RLIM_INFINITY))
    report("argument", lambda: pool.submit(total, arg).result(30))
    report("empty", lambda: pool.empty(300 << 20, np.uint8))
    report("result", lambda: pool.submit(big, 256 << 20).result(30))
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
    print("after", pool.submit(total, np.ones(10)).result(30))
with WorkerPool(1, arena_size=1 << 20) as pool:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY))
    try:
        pool.empty(8 << 20, np.uint8)
    except shm.ReservationError as exc:
        print("fsize", "RLIMIT_FSIZE" in str(exc), "free" in str(exc))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
"""


def test_the_caller_out_of_address_space_or_file_size_gets_reservation_errors() -> None:
    # In a process of its own: the limits are process-wide.
    out = run_python("-c", _CALLER_OUT_OF_ADDRESS_SPACE).split("\n")
    assert out[:4] == [
        "argument ReservationError True True",
        "empty ReservationError True True",
        "result ReservationError True True",
        "after 10.0",
    ]
    # EFBIG names the file-size limit, not how much memory is free.
    assert out[4] == "fsize True False"


# ---------------------------------------------------------------- broadcasts (17.7)
def _describe(a: np.ndarray[Any, Any]) -> tuple[tuple[int, ...], tuple[int, ...], float, float]:
    return a.shape, a.strides, float(a[0]), float(a[-1])


def _broadcast(n: int) -> np.ndarray[Any, Any]:
    return np.broadcast_to(np.arange(4.0), (n, 4))


def test_a_broadcast_argument_sends_only_its_real_bytes() -> None:
    huge = np.broadcast_to(np.float64(1), (1 << 30,))  # 8 GiB that hold 8 bytes
    with WorkerPool(1) as pool:
        before = pool.stats()
        shape, strides, first, last = pool.submit(_describe, huge).result(T)
        after = pool.stats()
        assert shape == (1 << 30,)
        assert strides == (0,)
        assert (first, last) == (1.0, 1.0)
        assert after.bytes_copied - before.bytes_copied <= 64
        assert after.arena.peak - before.arena.peak <= 64
        rows = np.broadcast_to(np.arange(3000.0), (5000, 3000))  # 120 MB showing, 24 KB real
        assert pool.submit(_total, rows).result(T) == rows.sum()


def test_a_broadcast_result_arrives_as_a_broadcast() -> None:
    with WorkerPool(1) as pool:
        r = pool.submit(_broadcast, 1 << 20).result(T)
        assert r.shape == (1 << 20, 4)
        assert r.strides == (0, 8)
        assert not r.flags.writeable  # as NumPy's broadcast_to gives it
        assert np.array_equal(r[-1], np.arange(4.0))


# ---------------------------------------------------------------- reopening the fds (17.5)
def _try_writes(path: str, offset: int) -> list[str]:
    """Open ``path`` read-write, then try to write it and to map it writable."""
    import mmap

    outcomes = []
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return [f"open: {type(exc).__name__}"]
    try:
        try:
            os.pwrite(fd, b"\xff" * 8, offset)
            outcomes.append("pwrite: wrote")
        except OSError as exc:
            outcomes.append(f"pwrite: {type(exc).__name__}")
        try:
            m = mmap.mmap(fd, offset + PAGE, access=mmap.ACCESS_WRITE)
            m[offset : offset + 8] = b"\xff" * 8
            m.close()
            outcomes.append("mmap: wrote")
        except OSError as exc:
            outcomes.append(f"mmap: {type(exc).__name__}")
    finally:
        os.close(fd)
    return outcomes


def _reopen_and_write(x: np.ndarray[Any, Any]) -> list[str]:
    # What a determined function can do: reopen the caller's memory by its fd.
    from shm._views import find_anchor

    anchor = find_anchor(x)
    assert anchor is not None
    handle = anchor.keep.handle
    offset = anchor.address - anchor.keep.address + anchor.keep.offset
    return _try_writes(f"/proc/{handle.owner_pid}/fd/{handle.fd}", offset // PAGE * PAGE)


def _inherited_and_write(owner: int) -> list[str]:
    # Under the fork start method a worker holds copies of the caller's fds.
    outcomes = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(f"/memfd:mpx-arena-{owner}"):
            outcomes += _try_writes(f"/proc/self/fd/{name}", 0)
    return outcomes


@pytest.mark.skipif(
    shm.platform_info().backend != "memfd", reason="seals are a property of memfd segments"
)
def test_arguments_cannot_be_written_even_by_reopening_their_fd() -> None:
    original = np.arange(BIG // 8, dtype=np.float64)
    with WorkerPool(1) as pool:
        # Sent from private memory: copied into the pool's sealed segments.
        assert pool.submit(_reopen_and_write, original).result(T) == [
            "pwrite: PermissionError",
            "mmap: PermissionError",
        ]
        # pool.put() buffers may be passed writable(): their segments stay open.
        x = pool.put(original)
        assert pool.submit(_reopen_and_write, x).result(T) == ["pwrite: wrote", "mmap: wrote"]
        assert (x.view(np.uint8)[:8] == 0xFF).all()


@pytest.mark.skipif(
    shm.platform_info().backend != "memfd", reason="seals are a property of memfd segments"
)
def test_a_held_result_passed_to_another_worker_is_read_only_but_not_sealed() -> None:
    # docs/in-place-mutation.md, "Not prevented": a result lives in its worker's
    # unsealed arena (the caller maps it read-write). Another worker reads it
    # through a read-only mapping (a stray write faults), but deliberate code
    # there can reopen the producing worker's fd read-write and write it.
    with WorkerPool(2) as pool:
        held = pool.submit_call(_arange, (BIG // 8,), worker=0).result(T)
        assert held.flags.writeable  # the caller's to change
        first = held.copy()
        with pytest.raises(mpexec.WorkerCrashedError):
            pool.submit_call(_poke, (held,), worker=1).result(T)
        assert (held == first).all(), "a stray write reached a held result"
    with WorkerPool(2) as pool:
        held = pool.submit_call(_arange, (BIG // 8,), worker=0).result(T)
        outcomes = pool.submit_call(_reopen_and_write, (held,), worker=1).result(T)
        assert outcomes == ["pwrite: wrote", "mmap: wrote"]
        assert (held.view(np.uint8)[:8] == 0xFF).all()


@pytest.mark.skipif(
    shm.platform_info().backend != "memfd", reason="seals are a property of memfd segments"
)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.usefixtures("forkable")
def test_fds_a_forked_worker_inherits_cannot_write_the_arguments() -> None:
    with WorkerPool(1, start_method="fork") as pool:
        assert pool.submit(_total, np.ones(BIG)).result(T) == BIG  # something was shared
        outcomes = pool.submit(_inherited_and_write, os.getpid()).result(T)
    assert outcomes
    assert set(outcomes) == {"pwrite: PermissionError", "mmap: PermissionError"}


@pytest.mark.skipif(
    shm.platform_info().backend != "memfd", reason="ring mappings are counted by their memfds"
)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_shut_pool_lets_go_of_its_rings_while_it_is_still_referenced(
    method: str, request: pytest.FixtureRequest
) -> None:
    if method == "fork":
        request.getfixturevalue("forkable")
    # Before Python 3.13 a mapping holds a duplicate of its memfd: one open fd per ring
    # for as long as the mapping lives. Under fork the worker factory kept each slot,
    # and with it the rings' mappings, until the pool object itself was collected.
    rings = "/memfd:mpx-ring"
    before = memfd_count(prefix=rings)
    pool = WorkerPool(2, start_method=method)
    assert pool.submit(abs, -1).result(T) == 1
    pool.shutdown()
    wait_until(lambda: memfd_count(prefix=rings) == before, 5, "the rings' mappings to go")
    del pool
