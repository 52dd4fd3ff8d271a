"""``mpexec.WorkerPool`` against ``ProcessPoolExecutor``, ``multiprocessing.Pool`` and loky.

Each measurement is taken side by side in one run (the systems take
turns, round after round, and the one that goes first rotates), so that their
ratios hold on a noisy machine even where absolute times do not. Every pool
has two workers and starts them with ``forkserver`` (loky too, when it is
installed; without it, loky is reported as skipped).

round trip
    ``echo(x)`` of 16 float64 (the function returns its input), one call at a
    time: submit, wait for the result. Each call is timed on its own
    (``perf_counter_ns``); median and p90 per system.

array
    ``x * 2`` of a 64 MiB float32 array, answered with an array of the same
    size, one call at a time: (a) from a plain ndarray, for every system;
    (b) mpexec with the input already in the pool's shared memory
    (``pool.put``); (c) ``x * 2`` inline in the main process; (d) mpexec with
    the input put and the output in the pool's memory too: the function
    writes it there (``np.multiply(x, 2, out=out)``, ``out`` passed as
    ``mpexec.writable``), so no copy is made either way; (e) DALI's
    in-process ``fn.python_function`` from the plain ndarray, where DALI is
    installed (run as in the medium section). Each system's
    answer is checked in full before timing (every element, and the sum), and
    a few elements of every timed answer; each answer is dropped before the
    next call.

medium arrays
    ``x + 1`` of a float32 array of 64 KiB and of 1 MiB, one call at a time,
    each timed, beside a trivial call (``echo`` of 16 float64) on the same
    pool in the same rounds: mpexec with the argument copied in (a plain
    ndarray) and with it ``pool.put`` first; and DALI's in-process
    ``fn.python_function`` (a CPU pipeline, ``device_id=None``, batch size 1,
    run synchronously: ``feed_input``, ``run``, ``as_array``), where DALI is
    installed. The kinds take turns, the one going first rotating; the
    ratios to the trivial call and to DALI are the figures. Every answer is
    checked (a few elements; every element before timing).

augment
    A Python-heavy augmentation of 224x224x3 uint8 images (a random crop and
    flip, then, row by row, a brightness ramp and noise from a pure-Python
    generator, so that the GIL is held most of the time; ~10 ms an image
    here): ``map`` over N images with a seed per image, for serial (the main
    process), each pool's ``map`` (``imap`` for ``multiprocessing.Pool``),
    and a ceiling: two bare processes that already hold half of the images
    each (no transfers, no scheduling), which shows what the machine allows.
    Throughput in images/s per round; every system's output is compared with
    the serial one, image by image, in every round.

Every wait is bounded: each result by a timeout, each section by a watchdog
that kills the section's worker processes (so that a blocked wait ends in an
error), each pool's shutdown by a timed join of the thread doing it. After a
section, every worker it started must be gone (terminated, then killed, and
reported, if not); at the end no child process, mpexec manager thread or
file descriptor may be left over (but for the few segments of dead workers'
arenas that ``shm`` keeps mapped on purpose). The CPU time other processes
used during each section is reported too: on a shared machine it explains
absolute times, and a parallel speedup that cannot happen.

Run with ``python -m benchmarks pool`` (``--quick`` for a smoke test).
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import hashlib
import math
import multiprocessing as mp
import multiprocessing.forkserver
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import mpexec
import shm
from benchmarks._common import (
    RESULTS,
    Watchdog,
    cli,
    closing,
    fmt_time,
    git_state,
    host,
    log,
    table,
    targets_text,
    write,
)
from mpexec._cpuload import CpuMeter
from shm._views import KEEP_MAPPED

NAME = "pool"
START_METHOD = "forkserver"
WORKERS = 2

MiB = 1 << 20

OP_S = 30.0  # one call's result (a 64 MiB array pickled both ways included)
START_S = 60.0  # a pool's start and first call (the first one starts the forkserver)
STOP_S = 15.0  # a pool's shutdown, before its workers are terminated
IDLE_S = 600.0  # a bare worker gives up after waiting this long for its next order

ROUND_TRIP_FLOATS = 16
SMALL_CHUNK = 64  # map(chunksize=...) of the small-calls section
ARRAY_BYTES = 64 * MiB
IMAGE_SHAPE = (224, 224, 3)
CROP = 192


# ============================================================ configuration
@dataclass(frozen=True)
class Config:
    quick: bool
    # round trip
    rt_rounds: int  # the systems take turns this many times
    rt_calls: int  # calls per system per round, each timed
    rt_warmup: int  # calls per system, untimed
    # array
    array_rounds: int
    array_fast_per_round: int  # samples per round of mpexec (a), (b) and inline
    array_slow_per_round: int  # samples per round of the pickling peers
    # small calls
    small_calls: int  # calls per map() in chunks
    small_rounds: int
    # medium arrays
    medium_rounds: int
    medium_calls: int  # calls per kind per round, each timed
    # augment
    aug_images: int
    aug_rounds: int
    deadline_s: float  # per section, enforced by the watchdog


FULL = Config(
    quick=False,
    rt_rounds=30,
    rt_calls=100,
    rt_warmup=200,
    array_rounds=12,
    array_fast_per_round=3,
    array_slow_per_round=1,
    small_calls=20_000,
    small_rounds=5,
    medium_rounds=20,
    medium_calls=50,
    aug_images=64,
    aug_rounds=12,
    deadline_s=600.0,
)

QUICK = Config(
    quick=True,
    rt_rounds=5,
    rt_calls=40,
    rt_warmup=50,
    array_rounds=3,
    array_fast_per_round=2,
    array_slow_per_round=1,
    small_calls=4_000,
    small_rounds=2,
    medium_rounds=4,
    medium_calls=20,
    aug_images=16,
    aug_rounds=3,
    deadline_s=120.0,
)

# Targets, checked in the summary.
TARGET_RT_US = 50.0  # mpexec round trip median, us
TARGET_RT_VS_PPE = 10.0  # ProcessPoolExecutor / mpexec round trip
TARGET_ARRAY_VS_PPE = 15.0  # ProcessPoolExecutor (a) / mpexec (a), 64 MiB
TARGET_SHARED_VS_INLINE = 1.3  # mpexec (b) / inline (c), 64 MiB
TARGET_AUG_SPEEDUP = 1.9  # mpexec images/s / serial images/s
TARGET_MEDIUM_VS_TRIVIAL = 2.0  # mpexec 64 KiB call / trivial call, same run
TARGET_MEDIUM_VS_DALI = 1.0  # DALI in-process python_function / mpexec, 64 KiB and 1 MiB
TARGET_ARRAY_PLAIN_VS_DALI = 1.0  # DALI in-process (e) / mpexec (a), 64 MiB
TARGET_ARRAY_PUT_VS_DALI = 1.3  # DALI in-process (e) / mpexec (b), 64 MiB
MEDIUM_SIZES = (64 << 10, 1 << 20)


# ============================================================ worker functions
def echo(x: Any) -> Any:
    """The trivial call: returns its input."""
    return x


def double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def add_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x + np.float32(1)


def double_into(x: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.multiply(x, 2, out=out)


def augment(image: np.ndarray[Any, Any], seed: int) -> np.ndarray[Any, Any]:
    """Random crop and flip, then per-row brightness and noise, in Python.

    Deterministic in ``(image, seed)``. The noise comes from a linear
    congruential generator in pure Python, one value per pixel column, so
    that most of the time goes to the interpreter (and the GIL).
    """
    rng = np.random.default_rng(seed)
    h, w, _ = image.shape
    top = int(rng.integers(0, h - CROP + 1))
    left = int(rng.integers(0, w - CROP + 1))
    crop = image[top : top + CROP, left : left + CROP]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    gain = float(rng.uniform(0.8, 1.2))
    bias = float(rng.uniform(-16.0, 16.0))
    state = int(rng.integers(1, 1 << 31))
    out = np.empty((CROP, CROP, 3), np.uint8)
    for i in range(CROP):
        t = i / (CROP - 1) - 0.5
        row_gain = gain * (1.0 - 0.25 * t * t)
        noise = []
        for _ in range(CROP):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            noise.append((state >> 16) % 9 - 4)
        row = crop[i].astype(np.float32) * row_gain
        row += np.asarray(noise, np.float32)[:, None] + bias
        np.clip(row, 0.0, 255.0, out=row)
        out[i] = np.rint(row)
    return out


def _star(packed: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    """``fn(*args)`` for ``multiprocessing.Pool.imap``, which passes one argument."""
    fn, args = packed
    return fn(*args)


def digest(outputs: Iterable[np.ndarray[Any, Any]]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for out in outputs:
        h.update(out.tobytes())
    return h.hexdigest()


def _bare_worker(conn: Connection, images: list[Any], seeds: list[int]) -> None:
    """Augment the same images each time the parent says so; answer a digest."""
    with conn:
        conn.send("ready")
        while conn.poll(IDLE_S):
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            conn.send(digest(augment(img, seed) for img, seed in zip(images, seeds, strict=True)))
        raise TimeoutError(f"no message from the parent in {IDLE_S} s")


# ============================================================ process hygiene
def _descendants() -> dict[int, psutil.Process]:
    """This process's descendants (forkserver children included), by pid."""
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def _is_helper(proc: psutil.Process) -> bool:
    """The forkserver and resource trackers: shared by every pool, and kept.

    They are children of this process; the forkserver's own children (the
    workers it forks, which share its command line) are not helpers.
    """
    try:
        if proc.ppid() != os.getpid():
            return False
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return ("forkserver" in cmd and "main(" in cmd) or "resource_tracker" in cmd


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(procs: list[psutil.Process], grace: float, what: str) -> list[str]:
    """Wait up to ``grace`` s for ``procs`` to exit; terminate, then kill, the rest."""
    problems = []
    deadline = time.monotonic() + grace
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for action in ("terminate", "kill"):
        alive = [p for p in procs if _alive(p)]
        if not alive:
            break
        problems.append(f"{what}: {len(alive)} worker(s) still running after shutdown: {action}")
        for p in alive:
            with suppress(psutil.Error):
                getattr(p, action)()
        psutil.wait_procs(alive, timeout=3.0)
    return problems


def _bounded(fn: Callable[[], object], seconds: float, what: str) -> str | None:
    """Run ``fn`` in a thread, wait up to ``seconds``; a problem if it fails or hangs."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name=f"bounded {what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return f"{what} did not return in {seconds:.0f} s"
    if failure:
        return f"{what} raised {failure[0]!r}"
    return None


# ============================================================ the systems
class System:
    """A pool of ``WORKERS`` processes: call one function, or map one."""

    key: str
    label: str

    def __init__(self) -> None:
        self.procs: list[psutil.Process] = []
        self.start_s = math.nan

    def start(self) -> None:
        """Start the pool and its workers; learn their processes."""
        before = _descendants()
        t0 = time.perf_counter()
        self._start()
        self.call(echo, 0, timeout=START_S)
        self.start_s = time.perf_counter() - t0
        # Calls that overlap, so that every worker is up (ProcessPoolExecutor
        # starts them one at a time, as calls find no idle one).
        self.map(time.sleep, [0.05] * (2 * WORKERS), timeout=START_S)
        after = _descendants()
        self.procs = [p for pid, p in after.items() if pid not in before and not _is_helper(p)]
        if len(self.procs) < WORKERS:
            raise RuntimeError(f"{self.label}: {len(self.procs)} workers, not {WORKERS}")

    def _start(self) -> None:
        raise NotImplementedError

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = OP_S) -> Any:
        raise NotImplementedError

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float) -> list[Any]:
        raise NotImplementedError

    def map_chunked(
        self, fn: Callable[..., Any], items: list[Any], chunksize: int, timeout: float
    ) -> list[Any]:
        """``fn`` over ``items``, ``chunksize`` calls per task, in the pool's own idiom."""
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def close(self) -> list[str]:
        """Shut the pool down (bounded), then make sure its workers are gone."""
        problems = []
        trouble = _bounded(self._shutdown, STOP_S, f"{self.label} shutdown")
        if trouble:
            problems.append(trouble)
            trouble = _bounded(self._force, STOP_S, f"{self.label} forced shutdown")
            if trouble:
                problems.append(trouble)
        problems.extend(_reap(self.procs, STOP_S, self.label))
        return problems

    def _force(self) -> None:
        """Stop the pool without waiting for anything, after ``_shutdown`` hung."""

    def kill(self) -> None:
        """The watchdog's last resort: kill the workers, so that waits end in errors."""
        for p in self.procs:
            with suppress(psutil.Error):
                p.kill()


class MpexecSystem(System):
    key, label = "mpexec", "mpexec WorkerPool"

    def _start(self) -> None:
        self.pool = mpexec.WorkerPool(WORKERS, start_method=START_METHOD)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = OP_S) -> Any:
        return self.pool.submit(fn, *args).result(timeout)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float) -> list[Any]:
        return list(self.pool.map(fn, *iterables, timeout=timeout))

    def map_chunked(
        self, fn: Callable[..., Any], items: list[Any], chunksize: int, timeout: float
    ) -> list[Any]:
        return list(self.pool.map(fn, items, chunksize=chunksize, timeout=timeout))

    def _shutdown(self) -> None:
        self.pool.shutdown(wait=True)

    def _force(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class ExecutorSystem(System):
    key, label = "ppe", "ProcessPoolExecutor"

    def _start(self) -> None:
        self.pool: cf.Executor = cf.ProcessPoolExecutor(
            WORKERS, mp_context=mp.get_context(START_METHOD)
        )

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = OP_S) -> Any:
        return self.pool.submit(fn, *args).result(timeout)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float) -> list[Any]:
        return list(self.pool.map(fn, *iterables, timeout=timeout))

    def map_chunked(
        self, fn: Callable[..., Any], items: list[Any], chunksize: int, timeout: float
    ) -> list[Any]:
        return list(self.pool.map(fn, items, chunksize=chunksize, timeout=timeout))

    def _shutdown(self) -> None:
        self.pool.shutdown(wait=True)


class LokySystem(ExecutorSystem):
    key, label = "loky", "loky reusable executor"

    def _start(self) -> None:
        import loky

        # timeout: idle seconds before loky retires a worker (10 by default):
        # longer than any section, so that no worker restarts between rounds.
        self.pool = loky.get_reusable_executor(
            max_workers=WORKERS, context=START_METHOD, timeout=3600, reuse=False
        )


class MpPoolSystem(System):
    key, label = "mp_pool", "multiprocessing.Pool"

    def _start(self) -> None:
        self.pool = mp.get_context(START_METHOD).Pool(WORKERS)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = OP_S) -> Any:
        return self.pool.apply_async(fn, args).get(timeout)

    def map(self, fn: Callable[..., Any], *iterables: Iterable[Any], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        it = self.pool.imap(_star, ((fn, args) for args in zip(*iterables, strict=True)))
        out = []
        while True:
            try:
                out.append(it.next(max(0.0, deadline - time.monotonic())))
            except StopIteration:
                return out

    def map_chunked(
        self, fn: Callable[..., Any], items: list[Any], chunksize: int, timeout: float
    ) -> list[Any]:
        # imap() with chunks yields from a plain generator, which takes no timeout.
        return list(self.pool.map_async(fn, items, chunksize=chunksize).get(timeout))

    def _shutdown(self) -> None:
        self.pool.close()
        self.pool.join()

    def _force(self) -> None:
        self.pool.terminate()


class BareProcesses(System):
    """The ceiling for any pool of ``WORKERS``: plain processes, no transfers.

    Each holds its share of the images from the start (a static split) and,
    when told, augments them all and answers a digest of its outputs.
    """

    key, label = "bare", f"{WORKERS} bare processes, static split (ceiling)"

    def __init__(self, images: list[Any], seeds: list[int]) -> None:
        super().__init__()
        self.images, self.seeds = images, seeds
        self.conns: list[Connection] = []
        self.mp_procs: list[Any] = []

    def shares(self) -> list[tuple[list[Any], list[int]]]:
        return [(self.images[k::WORKERS], self.seeds[k::WORKERS]) for k in range(WORKERS)]

    def start(self) -> None:
        ctx = mp.get_context(START_METHOD)
        before = _descendants()
        t0 = time.perf_counter()
        for k, (images, seeds) in enumerate(self.shares()):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_bare_worker, args=(child, images, seeds), name=f"bare-{k}", daemon=True
            )
            proc.start()
            child.close()  # so that the child's exit reads as EOF here
            self.conns.append(conn)
            self.mp_procs.append(proc)
        for conn in self.conns:
            if not conn.poll(START_S):
                raise TimeoutError(f"a bare process did not start in {START_S} s")
            conn.recv()
        self.start_s = time.perf_counter() - t0
        after = _descendants()
        self.procs = [p for pid, p in after.items() if pid not in before and not _is_helper(p)]

    def run(self, timeout: float) -> list[str]:
        """Every process augments its share; their digests, in order."""
        deadline = time.monotonic() + timeout
        for conn in self.conns:
            conn.send(True)
        out = []
        for conn in self.conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"a bare process did not answer in {timeout:.0f} s")
            out.append(conn.recv())
        return out

    def _shutdown(self) -> None:
        for conn in self.conns:
            with suppress(OSError):
                conn.send(None)
            conn.close()
        deadline = time.monotonic() + STOP_S
        for proc in self.mp_procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> list[str]:
        problems = super().close()
        for proc in self.mp_procs:
            proc.join(1.0)  # after a kill
            if proc.exitcode != 0:
                problems.append(f"{proc.name} exited with code {proc.exitcode}")
        return problems


def loky_status() -> tuple[bool, str]:
    """Whether loky can be imported here, and its version or why not."""
    try:
        import loky
    except Exception as exc:
        return False, f"import loky failed: {type(exc).__name__}: {exc}"
    return True, str(getattr(loky, "__version__", "?"))


def system_classes() -> list[type[System]]:
    classes: list[type[System]] = [MpexecSystem, ExecutorSystem, MpPoolSystem]
    if loky_status()[0]:
        classes.append(LokySystem)
    return classes


@contextmanager
def running(
    systems: list[System], deadline_s: float, what: str, problems: list[str]
) -> Iterator[None]:
    """Start ``systems`` under a watchdog; close every one of them on the way out.

    Then no process the section started may be left running.
    """
    started: list[System] = []
    before = _descendants()
    try:
        with Watchdog(lambda: [s.kill() for s in systems], deadline_s, what) as dog:
            try:
                for s in systems:
                    started.append(s)
                    s.start()
                    log(f"  {s.label}: {len(s.procs)} workers started in {s.start_s:.2f} s")
                yield
            except BaseException as exc:
                dog.check(exc)  # an overrun explains the failure it caused
                raise
        dog.check()
    finally:
        for s in started:
            problems.extend(s.close())
        stray = [
            p
            for pid, p in _descendants().items()
            if pid not in before and _alive(p) and not _is_helper(p)
        ]
        if stray:
            problems.append(f"{what}: processes left running after every pool closed: {stray}")
            problems.extend(_reap(stray, 1.0, what))


# ============================================================ statistics
def stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "min": float(a.min()),
        "max": float(a.max()),
        "mean": float(a.mean()),
        "samples": len(a),
    }


def fmt_ms(ms: float) -> str:
    return fmt_time(ms * 1e3)


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` starting at position ``r``: who goes first changes every round."""
    k = r % len(items)
    return items[k:] + items[:k]


# ============================================================ round trip
def bench_round_trip(cfg: Config, problems: list[str]) -> dict[str, Any]:
    systems = [cls() for cls in system_classes()]
    x = np.arange(ROUND_TRIP_FLOATS, dtype=np.float64)
    samples: dict[str, list[float]] = {s.key: [] for s in systems}

    def batch(s: System, n: int, out: list[float] | None) -> None:
        call = s.call
        for _ in range(n):
            t0 = time.perf_counter_ns()
            r = call(echo, x)
            dt = time.perf_counter_ns() - t0
            if out is not None:
                out.append(dt / 1e3)
            if not (isinstance(r, np.ndarray) and np.array_equal(r, x)):
                raise RuntimeError(f"{s.label} echoed {r!r}, not the 16 floats")

    with running(systems, cfg.deadline_s, "round trip", problems):
        for s in systems:
            batch(s, cfg.rt_warmup, None)
        for r in range(cfg.rt_rounds):
            for s in rotated(systems, r):
                batch(s, cfg.rt_calls, samples[s.key])
            if (r + 1) % 5 == 0 or r + 1 == cfg.rt_rounds:
                log(f"  round trip: round {r + 1}/{cfg.rt_rounds}")
    base = float(np.median(samples["mpexec"]))
    by_system = {}
    for s in systems:
        st = stats(samples[s.key])
        st["vs_mpexec"] = st["median"] / base
        by_system[s.key] = {"label": s.label, "start_s": s.start_s, "us": st}
    return {
        "payload": f"{ROUND_TRIP_FLOATS} float64 ndarray",
        "calls_per_system": cfg.rt_rounds * cfg.rt_calls,
        "rounds": cfg.rt_rounds,
        "by_system": by_system,
    }


def round_trip_table(res: dict[str, Any], skipped: list[str]) -> str:
    rows = []
    for row in res["by_system"].values():
        st = row["us"]
        rows.append(
            [
                row["label"],
                fmt_time(st["median"]),
                fmt_time(st["p90"]),
                fmt_time(st["p10"]),
                f"{st['vs_mpexec']:.2f}x",
                str(st["samples"]),
            ]
        )
    rows.extend([label, "skipped", "", "", "", ""] for label in skipped)
    head = (
        f"Round trip of a trivial call (echo of {res['payload']}; {res['calls_per_system']} "
        f"calls per system, each timed, in {res['rounds']} interleaved rounds)\n"
        "time/mpexec > 1.00x: mpexec is faster\n\n"
    )
    return head + table(["system", "median", "p90", "p10", "time/mpexec", "n"], rows)


# ============================================================ small calls
def bench_small_calls(cfg: Config, problems: list[str]) -> dict[str, Any]:
    """Many trivial calls through ``map``: one task per call, and in chunks."""
    systems = [cls() for cls in system_classes()]
    items = [np.full(ROUND_TRIP_FLOATS, i, np.float64) for i in range(cfg.small_calls)]
    alone = items[: max(1, cfg.small_calls // 10)]  # one task per call: slow, so fewer
    runs = [(s, SMALL_CHUNK, items) for s in systems]
    runs.insert(1, (systems[0], 1, alone))  # mpexec without chunks, for the contrast
    samples: dict[tuple[str, int], list[float]] = {(s.key, cs): [] for s, cs, _ in runs}

    def once(s: System, chunksize: int, xs: list[Any], out: list[float] | None) -> None:
        t0 = time.perf_counter_ns()
        got = s.map_chunked(echo, xs, chunksize, OP_S)
        dt = time.perf_counter_ns() - t0
        if out is not None:
            out.append(dt / 1e3 / len(xs))
        if len(got) != len(xs) or any(float(g[0]) != i for i, g in enumerate(got)):
            raise RuntimeError(f"{s.label}: map(chunksize={chunksize}) gave wrong results")

    with running(systems, cfg.deadline_s, "small calls", problems):
        for s, cs, xs in runs:
            once(s, cs, xs[: len(xs) // 4], None)  # warm-up
        for r in range(cfg.small_rounds):
            for s, cs, xs in rotated(runs, r):
                once(s, cs, xs, samples[s.key, cs])
            log(f"  small calls: round {r + 1}/{cfg.small_rounds}")
    base = float(np.median(samples["mpexec", SMALL_CHUNK]))
    rows = []
    for s, cs, xs in runs:
        st = stats(samples[s.key, cs])
        st["vs_mpexec"] = st["median"] / base
        rows.append({"key": s.key, "label": s.label, "chunksize": cs, "calls": len(xs), "us": st})
    return {"payload": f"{ROUND_TRIP_FLOATS} float64 ndarray", "rows": rows}


def small_calls_table(res: dict[str, Any], skipped: list[str]) -> str:
    rows = [
        [
            row["label"],
            str(row["chunksize"]),
            fmt_time(row["us"]["median"]),
            fmt_time(row["us"]["p10"]),
            fmt_time(row["us"]["p90"]),
            f"{row['us']['vs_mpexec']:.2f}x",
            str(row["calls"]),
        ]
        for row in res["rows"]
    ]
    rows.extend([label, "", "skipped", "", "", "", ""] for label in skipped)
    head = (
        f"Many small calls through map (echo of a {res['payload']}, each call its own array); "
        f"time per call, median over interleaved rounds\n"
        f"time/mpexec > 1.00x: mpexec with chunksize={SMALL_CHUNK} is faster\n\n"
    )
    cols = ["system", "chunksize", "per call", "p10", "p90", "time/mpexec", "calls per map"]
    return head + table(cols, rows)


# ============================================================ medium arrays
def _dali_add_one() -> tuple[Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]], str]:
    """``add_one`` through DALI's in-process ``fn.python_function``, and DALI's version."""
    return _dali_in_process(add_one)


def _dali_in_process(
    function: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]],
) -> tuple[Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]], str]:
    """``function`` through DALI's in-process ``fn.python_function``, and DALI's version.

    A CPU pipeline (``device_id=None``), batch size 1, run synchronously:
    ``feed_input``, ``run``, ``as_array``.
    """
    import nvidia.dali.fn as dfn
    from nvidia import dali

    pipe = dali.Pipeline(
        batch_size=1,
        num_threads=1,
        device_id=None,
        exec_async=False,
        exec_pipelined=False,
        prefetch_queue_depth=1,
    )
    with pipe:
        x = dfn.external_source(name="x", batch=True, no_copy=False)
        pipe.set_outputs(dfn.python_function(x, function=function))
    pipe.build()

    def call(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        pipe.feed_input("x", [a])
        (out,) = pipe.run()
        return out.as_array()[0]  # type: ignore[no-any-return]

    return call, str(dali.__version__)


def bench_medium(cfg: Config, problems: list[str]) -> dict[str, Any]:
    """``x + 1`` on 64 KiB and 1 MiB: mpexec (copied in, put) beside a trivial call and DALI."""
    system = MpexecSystem()
    trivial = np.arange(ROUND_TRIP_FLOATS, dtype=np.float64)
    dali_call: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]] | None = None
    try:
        dali_call, dali_version = _dali_add_one()
    except Exception as exc:  # not installed, or no CPU pipeline here
        dali_version = f"skipped: {type(exc).__name__}: {exc}"
    with running([system], cfg.deadline_s, "medium arrays", problems):
        pool = system.pool
        kinds: list[tuple[str, int, Callable[[], Any], np.ndarray[Any, Any] | None]] = [
            ("trivial", 0, lambda: pool.submit(echo, trivial).result(OP_S), None)
        ]
        for size in MEDIUM_SIZES:
            x = (np.arange(size // 4, dtype=np.int64) % 1021).astype(np.float32)
            put = pool.put(x)
            want = x + np.float32(1)
            kinds.append(("plain", size, partial(pool.submit, add_one, x), want))
            kinds.append(("put", size, partial(pool.submit, add_one, put), want))
            if dali_call is not None:
                kinds.append(("dali", size, partial(dali_call, x), want))
        samples: dict[tuple[str, int], list[float]] = {(k, n): [] for k, n, _, _ in kinds}

        def once(kind: str, call: Callable[[], Any], want: Any, out: list[float] | None) -> None:
            t0 = time.perf_counter_ns()
            r = call()
            if kind in ("plain", "put"):
                r = r.result(OP_S)
            dt = time.perf_counter_ns() - t0
            if out is not None:
                out.append(dt / 1e3)
            if want is None:
                ok = isinstance(r, np.ndarray) and np.array_equal(r, trivial)
            else:
                ok = r.shape == want.shape and r[0] == want[0] and r[-1] == want[-1]
            if not ok:
                raise RuntimeError(f"{kind}: wrong answer {r!r}")

        for kind, size, call, want in kinds:  # warm-up, and every element checked once
            for _ in range(cfg.medium_calls):
                once(kind, call, want, None)
            if want is not None:
                got = call()
                got = got.result(OP_S) if kind != "dali" else got
                if not np.array_equal(got, want):
                    raise RuntimeError(f"{kind} {size} B: wrong result")
                del got
        for r in range(cfg.medium_rounds):
            for kind, size, call, want in rotated(kinds, r):
                for _ in range(cfg.medium_calls):
                    once(kind, call, want, samples[kind, size])
            if (r + 1) % 5 == 0 or r + 1 == cfg.medium_rounds:
                log(f"  medium arrays: round {r + 1}/{cfg.medium_rounds}")
        kinds.clear()  # let go of the pool's arrays before it shuts down
    base = float(np.median(samples["trivial", 0]))
    rows = []
    for (kind, size), values in samples.items():
        st = stats(values)
        st["vs_trivial"] = st["median"] / base
        rows.append({"kind": kind, "bytes": size, "us": st})
    by = {(row["kind"], row["bytes"]): row["us"]["median"] for row in rows}
    ratios: dict[str, float] = {}
    for size in MEDIUM_SIZES:
        for kind in ("plain", "put"):
            ratios[f"{kind}_{size}_over_trivial"] = by[kind, size] / base
            if ("dali", size) in by:
                ratios[f"dali_{size}_over_{kind}"] = by["dali", size] / by[kind, size]
    return {
        "rows": rows,
        "ratios": ratios,
        "dali": dali_version,
        "calls_per_kind": cfg.medium_rounds * cfg.medium_calls,
        "rounds": cfg.medium_rounds,
    }


def _size_text(n: int) -> str:
    return "-" if n == 0 else f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def medium_table(res: dict[str, Any]) -> str:
    labels = {
        "trivial": "mpexec trivial call (echo of 16 float64)",
        "plain": "mpexec, argument copied in",
        "put": "mpexec, argument pool.put",
        "dali": "DALI fn.python_function, in-process",
    }
    rows = [
        [
            labels[row["kind"]],
            _size_text(row["bytes"]),
            fmt_time(row["us"]["median"]),
            fmt_time(row["us"]["p10"]),
            fmt_time(row["us"]["p90"]),
            f"{row['us']['vs_trivial']:.2f}x",
        ]
        for row in res["rows"]
    ]
    head = (
        f"Medium arrays: x + 1 on float32, one call at a time ({res['calls_per_kind']} calls "
        f"per kind, each timed, in {res['rounds']} interleaved rounds; DALI "
        f"{res['dali']})\n\n"
    )
    return head + table(["call", "array", "median", "p10", "p90", "time/trivial"], rows)


# ============================================================ array
def bench_array(cfg: Config, problems: list[str]) -> dict[str, Any]:
    systems = [cls() for cls in system_classes()]
    n = ARRAY_BYTES // 4
    x = (np.arange(n, dtype=np.int64) % 1021).astype(np.float32)
    expected = x * 2
    want_sum = float(expected.sum(dtype=np.float64))
    probe = np.array([0, 1, 1020, 1021, n // 2, n // 3 + 7, n - 2, n - 1])
    want_probe = expected[probe]
    del expected
    results: dict[str, Any] = {"array": f"{ARRAY_BYTES // MiB} MiB float32", "cases": {}}
    dali_call: Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]] | None = None
    try:
        dali_call, results["dali"] = _dali_in_process(double)
    except Exception as exc:  # not installed, or no CPU pipeline here
        results["dali"] = f"skipped: {type(exc).__name__}: {exc}"
    mpexec_sys = systems[0]
    assert isinstance(mpexec_sys, MpexecSystem)

    def check(r: Any, what: str, full: bool) -> None:
        if not isinstance(r, np.ndarray) or r.shape != x.shape or r.dtype != x.dtype:
            raise RuntimeError(f"{what}: got {type(r).__name__} {getattr(r, 'shape', '')}")
        if not np.array_equal(r[probe], want_probe):
            raise RuntimeError(f"{what}: wrong elements {r[probe]} (want {want_probe})")
        if full:
            got = float(r.sum(dtype=np.float64))
            if got != want_sum or not np.array_equal(r, x * 2):
                raise RuntimeError(f"{what}: wrong result (sum {got}, want {want_sum})")

    with running(systems, cfg.deadline_s, "array", problems):
        # dropped at the end of the section
        held = {"shared": mpexec_sys.pool.put(x), "out": mpexec_sys.pool.empty(n, np.float32)}
        try:
            # (key, label, one call, samples per round)
            cases: list[tuple[str, str, Callable[[], Any], int]] = [
                (
                    "mpexec_a",
                    "mpexec (a) plain ndarray in",
                    lambda: mpexec_sys.call(double, x),
                    cfg.array_fast_per_round,
                ),
                (
                    "mpexec_b",
                    "mpexec (b) input in pool memory (put)",
                    lambda: mpexec_sys.call(double, held["shared"]),
                    cfg.array_fast_per_round,
                ),
                (
                    "inline",
                    "inline x * 2 (c), main process",
                    lambda: double(x),
                    cfg.array_fast_per_round,
                ),
                (
                    "mpexec_d",
                    "mpexec (d) input put, output written in pool memory (writable)",
                    lambda: mpexec_sys.call(
                        double_into, held["shared"], mpexec.writable(held["out"])
                    ),
                    cfg.array_fast_per_round,
                ),
            ]
            if dali_call is not None:
                cases.append(
                    (
                        "dali",
                        "DALI fn.python_function, in-process (e), plain ndarray in",
                        partial(dali_call, x),
                        cfg.array_fast_per_round,
                    )
                )
            cases.extend(
                (f"{s.key}_a", f"{s.label} (a)", _caller(s, x), cfg.array_slow_per_round)
                for s in systems[1:]
            )
            samples: dict[str, list[float]] = {key: [] for key, *_ in cases}
            # Verify every case in full, which warms it up too.
            for key, label, once, _ in cases:
                held["out"][:] = 0  # (d) must write every element
                r = once()
                check(r, label, full=True)
                del r
                log(f"  array: {key} verified")
            for rnd in range(cfg.array_rounds):
                for key, label, once, per_round in rotated(cases, rnd):
                    for _ in range(per_round):
                        t0 = time.perf_counter_ns()
                        r = once()
                        dt = time.perf_counter_ns() - t0
                        check(r, label, full=False)
                        del r  # dropped before the next call
                        samples[key].append(dt / 1e6)
                log(f"  array: round {rnd + 1}/{cfg.array_rounds}")
            labels = {key: label for key, label, *_ in cases}
        finally:
            held.clear()
            gc.collect()
        # The workers hand back the pool's memory as the releases reach them:
        # give them a moment (a wait, bounded), then everything must be back.
        end = time.monotonic() + 2.0
        while (st := mpexec_sys.pool.stats()).arena.exported and time.monotonic() < end:
            time.sleep(0.01)
        results["mpexec_stats"] = {
            "submitted": st.submitted,
            "completed": st.completed,
            "failed": st.failed,
            "bytes_shared": st.bytes_shared,
            "bytes_copied": st.bytes_copied,
            "arena_in_use": st.arena.in_use,
            "arena_reserved": st.arena.reserved,
            "arena_peak": st.arena.peak,
            "arena_exported": st.arena.exported,
            "arena_text": str(st.arena),
        }
        if st.arena.in_use or st.arena.exported:
            problems.append(f"array: mpexec pool arena not empty after the section: {st.arena}")
    base = float(np.median(samples["mpexec_a"]))
    for key, vals in samples.items():
        s = stats(vals)
        s["vs_mpexec_a"] = s["median"] / base
        results["cases"][key] = {"label": labels[key], "ms": s}
    med = {k: v["ms"]["median"] for k, v in results["cases"].items()}
    results["ratios"] = {
        "ppe_a_over_mpexec_a": med["ppe_a"] / med["mpexec_a"],
        "mpexec_b_over_inline": med["mpexec_b"] / med["inline"],
        "mpexec_d_over_inline": med["mpexec_d"] / med["inline"],
        "mpexec_a_over_inline": med["mpexec_a"] / med["inline"],
    }
    if "dali" in med:
        results["ratios"]["dali_over_mpexec_a"] = med["dali"] / med["mpexec_a"]
        results["ratios"]["dali_over_mpexec_b"] = med["dali"] / med["mpexec_b"]
    results["rounds"] = cfg.array_rounds
    return results


def _caller(s: System, x: np.ndarray[Any, Any]) -> Callable[[], Any]:
    return lambda: s.call(double, x)


def array_table(res: dict[str, Any], skipped: list[str]) -> str:
    rows = []
    for c in res["cases"].values():
        st = c["ms"]
        rows.append(
            [
                c["label"],
                fmt_ms(st["median"]),
                f"{fmt_ms(st['p10'])} - {fmt_ms(st['p90'])}",
                f"{st['vs_mpexec_a']:.2f}x",
                str(st["samples"]),
            ]
        )
    rows.extend([f"{label} (a)", "skipped", "", "", ""] for label in skipped)
    r = res["ratios"]
    ms = res["mpexec_stats"]
    head = (
        f"Array in, array out: x * 2 of a {res['array']} array, answered with one of the same "
        f"size\n(one call at a time; {res['rounds']} interleaved rounds; every answer checked; "
        "time/mpexec(a) > 1.00x: mpexec (a) is faster)\n\n"
    )
    foot = (
        f"\n\nProcessPoolExecutor (a) / mpexec (a) = {r['ppe_a_over_mpexec_a']:.1f}x; "
        f"mpexec (b) / inline (c) = {r['mpexec_b_over_inline']:.2f}x; "
        f"mpexec (d) / inline (c) = {r['mpexec_d_over_inline']:.2f}x; "
        f"mpexec (a) / inline (c) = {r['mpexec_a_over_inline']:.2f}x\n"
        + (
            f"DALI in-process (e) / mpexec (a) = {r['dali_over_mpexec_a']:.2f}x; "
            f"DALI in-process (e) / mpexec (b) = {r['dali_over_mpexec_b']:.2f}x\n"
            if "dali_over_mpexec_a" in r
            else f"DALI in-process (e): {res.get('dali', 'not run')}\n"
        )
        + f"DALI {res.get('dali', '-')}\n"
        f"mpexec pool: {ms['bytes_shared'] / MiB:.0f} MiB passed through shared memory, "
        f"{ms['bytes_copied'] / MiB:.0f} MiB of it copied in (inputs not in the pool's arena)\n"
        f"pool arena after the section: {ms['arena_text']}"
    )
    return (
        head
        + table(["case", "median", "p10 - p90", "time/mpexec(a)", "n"], rows, right={1, 3, 4})
        + foot
    )


# ============================================================ augment
def bench_augment(cfg: Config, problems: list[str]) -> dict[str, Any]:
    systems = [cls() for cls in system_classes()]
    rng = np.random.default_rng(20261123)
    images = [rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8) for _ in range(cfg.aug_images)]
    seeds = [1000 + i for i in range(cfg.aug_images)]
    t0 = time.perf_counter()
    reference = [augment(img, seed) for img, seed in zip(images, seeds, strict=True)]
    log(
        f"  augment: reference outputs, {1e3 * (time.perf_counter() - t0) / len(images):.1f} ms "
        "an image"
    )
    limit = OP_S + 2.0 * len(images)  # 2 s an image at worst
    bare = BareProcesses(images, seeds)
    bare_digests = [digest(reference[k::WORKERS]) for k in range(WORKERS)]

    def same(outs: list[Any], label: str) -> None:
        if len(outs) != len(reference):
            raise RuntimeError(f"{label}: {len(outs)} outputs for {len(reference)} images")
        for i, (got, want) in enumerate(zip(outs, reference, strict=True)):
            if not (isinstance(got, np.ndarray) and np.array_equal(got, want)):
                raise RuntimeError(f"{label}: image {i} differs from the serial output")

    def serial() -> list[Any]:
        return [augment(img, seed) for img, seed in zip(images, seeds, strict=True)]

    def same_digests(outs: list[Any], label: str) -> None:
        if outs != bare_digests:
            raise RuntimeError(f"{label}: outputs differ from the serial ones")

    # (key, label, one map over every image, its check)
    entries: list[tuple[str, str, Callable[[], list[Any]], Callable[[list[Any], str], None]]]
    entries = [("serial", "serial (main process)", serial, same)]
    entries.extend(
        (s.key, f"{s.label} map", _mapper(s, images, seeds, limit), same) for s in systems
    )
    entries.append((bare.key, bare.label, lambda: bare.run(limit), same_digests))
    labels = {key: label for key, label, *_ in entries}
    labels["mp_pool"] = "multiprocessing.Pool imap"
    rates: dict[str, list[float]] = {key: [] for key, *_ in entries}
    with running([*systems, bare], cfg.deadline_s, "augment", problems):
        for key, _, once, check in entries[1:]:
            check(once(), labels[key])  # verified, and warm
        for rnd in range(cfg.aug_rounds):
            for key, _, once, check in rotated(entries, rnd):
                t0 = time.perf_counter_ns()
                outs = once()
                dt = time.perf_counter_ns() - t0
                check(outs, labels[key])
                del outs
                rates[key].append(len(images) / (dt / 1e9))
            log(f"  augment: round {rnd + 1}/{cfg.aug_rounds}")
    base = float(np.median(rates["serial"]))
    by_system = {}
    for key, vals in rates.items():
        st = stats(vals)
        st["vs_serial"] = st["median"] / base
        by_system[key] = {"label": labels[key], "images_per_s": st, "identical": True}
    return {
        "images": len(images),
        "image_shape": list(IMAGE_SHAPE),
        "output_shape": [CROP, CROP, 3],
        "rounds": cfg.aug_rounds,
        "serial_ms_per_image": 1e3 / base,
        "by_system": by_system,
    }


def _mapper(
    s: System, images: list[Any], seeds: list[int], limit: float
) -> Callable[[], list[Any]]:
    return lambda: s.map(augment, images, seeds, timeout=limit)


def augment_table(res: dict[str, Any], skipped: list[str]) -> str:
    rows = []
    for row in res["by_system"].values():
        st = row["images_per_s"]
        rows.append(
            [
                row["label"],
                f"{st['median']:.1f}",
                f"{st['min']:.1f} - {st['max']:.1f}",
                f"{st['vs_serial']:.2f}x",
                "yes" if row["identical"] else "NO",
                str(st["samples"]),
            ]
        )
    rows.extend([f"{label} map", "skipped", "", "", "", ""] for label in skipped)
    shape = "x".join(map(str, res["image_shape"]))
    head = (
        f"Augmentation throughput: {res['images']} uint8 images of {shape} (random crop "
        f"to {res['output_shape'][0]}, flip, per-row\nbrightness and noise in Python; "
        f"{res['serial_ms_per_image']:.1f} ms an image serially), {WORKERS} workers per pool, "
        f"{res['rounds']} interleaved rounds\nidentical: every output equal to the serial one "
        "in every round; ceiling: the same work split\nbetween bare processes that hold their "
        "images already (no transfers, no scheduling): what this machine allows\n\n"
    )
    return head + table(
        ["system", "images/s median", "min - max", "vs serial", "identical", "rounds"],
        rows,
        right={1, 2, 3, 5},
    )


# ============================================================ targets
def evaluate(
    rt: dict[str, Any] | None,
    ar: dict[str, Any] | None,
    au: dict[str, Any] | None,
    md: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(
        what: str, value: float | None, op: str, target: float, unit: str, note: str = ""
    ) -> None:
        ok = value is not None and (value >= target if op == ">=" else value <= target)
        out.append(
            {
                "target": what,
                "value": value,
                "op": op,
                "threshold": target,
                "unit": unit,
                "pass": ok,
                "note": note,
            }
        )

    if rt is not None:
        by = rt["by_system"]
        add("round trip: mpexec median", by["mpexec"]["us"]["median"], "<=", TARGET_RT_US, "us")
        add(
            "round trip: ProcessPoolExecutor / mpexec (median)",
            by["ppe"]["us"]["vs_mpexec"],
            ">=",
            TARGET_RT_VS_PPE,
            "x",
        )
    if ar is not None:
        add(
            f"array {ar['array']}: ProcessPoolExecutor (a) / mpexec (a)",
            ar["ratios"]["ppe_a_over_mpexec_a"],
            ">=",
            TARGET_ARRAY_VS_PPE,
            "x",
        )
        add(
            f"array {ar['array']}: mpexec (b) put / inline (c)",
            ar["ratios"]["mpexec_b_over_inline"],
            "<=",
            TARGET_SHARED_VS_INLINE,
            "x",
        )
        add(
            f"array {ar['array']}: mpexec (d) put, writable out / inline (c)",
            ar["ratios"]["mpexec_d_over_inline"],
            "<=",
            TARGET_SHARED_VS_INLINE,
            "x",
            "(b) with the output written into pool memory by the function",
        )
        for key, how, target in (
            ("a", "plain ndarray", TARGET_ARRAY_PLAIN_VS_DALI),
            ("b", "put", TARGET_ARRAY_PUT_VS_DALI),
        ):
            ratio = ar["ratios"].get(f"dali_over_mpexec_{key}")
            add(
                f"array {ar['array']}: DALI in-process (e) / mpexec ({key}) {how}",
                ratio,
                ">=",
                target,
                "x",
                "" if ratio is not None else f"DALI {ar.get('dali')}",
            )
    if md is not None:
        ratios = md["ratios"]
        for kind, how in (("plain", "copied in"), ("put", "pool.put")):
            add(
                f"medium 64 KiB, argument {how}: mpexec / trivial call",
                ratios[f"{kind}_{64 << 10}_over_trivial"],
                "<=",
                TARGET_MEDIUM_VS_TRIVIAL,
                "x",
            )
        for size in MEDIUM_SIZES:
            for kind, how in (("plain", "copied in"), ("put", "pool.put")):
                add(
                    f"medium {_size_text(size)}: DALI in-process / mpexec, argument {how}",
                    ratios.get(f"dali_{size}_over_{kind}"),
                    ">=",
                    TARGET_MEDIUM_VS_DALI,
                    "x",
                    "" if f"dali_{size}_over_{kind}" in ratios else f"DALI {md['dali']}",
                )
    if au is not None:
        add(
            "augment: mpexec images/s / serial",
            au["by_system"]["mpexec"]["images_per_s"]["vs_serial"],
            ">=",
            TARGET_AUG_SPEEDUP,
            "x",
            f"ceiling here ({WORKERS} bare processes): "
            f"{au['by_system']['bare']['images_per_s']['vs_serial']:.2f}x",
        )
    return out


# ============================================================ environment
def environment() -> dict[str, Any]:
    info = shm.platform_info()
    has_loky, loky_info = loky_status()
    env: dict[str, Any] = {
        **host(),
        "mpexec": mpexec.__version__,
        "loky": loky_info if has_loky else None,
        "loky_skipped": None if has_loky else loky_info,
        "start_method": START_METHOD,
        "workers_per_pool": WORKERS,
        "shm_backend": info.backend,
    }
    env["git_commit"], env["git_dirty"] = git_state("mpexec", "shm")
    return env


# ============================================================ entry points
@contextmanager
def _section(name: str, errors: list[str], load: dict[str, Any]) -> Iterator[None]:
    """Run a section; record its failure, and the CPU other processes used meanwhile
    (steal included: ``steal_share`` is how much of ``other_share`` it was)."""
    log(f"[{NAME}] {name} ...")
    meter = CpuMeter()
    try:
        yield
    except Exception:
        errors.append(f"{name}: {traceback.format_exc()}")
        log(f"[{NAME}] {name} FAILED:\n{traceback.format_exc()}")
    else:
        log(f"[{NAME}] {name} done in {meter.stop().wall_s:.1f} s")
    finally:
        used = meter.stop()
        load[name] = {
            "wall_s": used.wall_s,
            "own_cpu_s": used.own_cpu_s,
            "other_cpu_s": used.other_cpu_s,
            "other_share": used.other_share,
            "steal_share": used.steal_share,
        }


def _open_fds() -> dict[int, str]:
    """This process's file descriptors and what they point to (Linux), else {}."""
    out = {}
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        with suppress(OSError):
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return out


def _foreign_arena_maps() -> tuple[int, int]:
    """Segments of other processes' arenas still mapped here: (count, bytes)."""
    own = f"mpx-arena-{os.getpid()} "
    spans: dict[str, int] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "mpx-arena-" not in line or own in line:
                    continue
                fields = line.split()
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                inode = fields[4]
                spans[inode] = spans.get(inode, 0) + hi - lo
    except OSError:
        return 0, 0
    return len(spans), sum(spans.values())


def hygiene(baseline: dict[int, psutil.Process], fds_before: dict[int, str]) -> dict[str, Any]:
    """Processes, threads and file descriptors that outlived their pools.

    Expected: the forkserver and resource tracker, shared by every pool; and
    the last few segments of dead workers' arenas, which ``shm`` keeps mapped
    on purpose (``KEEP_MAPPED``; each mapping holds a file descriptor).
    """
    gc.collect()
    problems = []
    children = [p.name for p in mp.active_children()]
    if children:
        problems.append(f"multiprocessing children left running: {children}")
    stray = [
        p
        for pid, p in _descendants().items()
        if pid not in baseline and _alive(p) and not _is_helper(p)
    ]
    if stray:
        problems.append(f"processes left running: {[(p.pid, p.name()) for p in stray]}")
        problems.extend(_reap(stray, 1.0, "left over"))
    threads = [t.name for t in threading.enumerate() if t.name.startswith("mpexec")]
    if threads:
        problems.append(f"mpexec threads left running: {threads}")
    fds_after = _open_fds()
    new = [t for fd, t in fds_after.items() if fds_before.get(fd) != t]
    arena_fds = [t for t in new if "mpx-arena-" in t]
    other_fds = [t for t in new if "mpx-arena-" not in t]
    if other_fds:
        problems.append(f"file descriptors left open: {sorted(other_fds)}")
    if len(arena_fds) > KEEP_MAPPED:
        problems.append(
            f"{len(arena_fds)} arena segments of other processes still open, "
            f"more than shm keeps on purpose ({KEEP_MAPPED})"
        )
    maps, mapped = _foreign_arena_maps()
    return {
        "problems": problems,
        "fds_before": len(fds_before),
        "fds_after": len(fds_after),
        "foreign_arena_fds": len(arena_fds),
        "foreign_arena_mappings": maps,
        "foreign_arena_mapped_bytes": mapped,
        "keep_mapped": KEEP_MAPPED,
        "loadavg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def hygiene_text(h: dict[str, Any]) -> str:
    return (
        f"After the sections: no pool left; {h['fds_before']} file descriptors before, "
        f"{h['fds_after']} after, of which {h['foreign_arena_fds']} hold segments of dead "
        f"workers' arenas\n({h['foreign_arena_mappings']} mapped, "
        f"{h['foreign_arena_mapped_bytes'] / MiB:.0f} MiB; shm keeps up to {h['keep_mapped']} "
        "mapped on purpose); load average at the end "
        f"{[round(x, 2) for x in h['loadavg_at_end'] or []]}"
    )


def load_text(load: dict[str, Any], cpus: int | None) -> str:
    shares = ", ".join(
        f"{name} {100 * v['other_share']:.0f}% (steal {100 * v['steal_share']:.0f}%)"
        for name, v in load.items()
        if v["other_share"] is not None
    )
    return (
        f"CPU used by other processes on this machine during each section, as a share of "
        f"its {cpus} CPUs: {shares}"
    )


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run the benchmark, print its tables, write ``pool.json`` and ``pool.md``."""
    cfg = QUICK if quick else FULL
    ctx = mp.get_context(START_METHOD)
    if hasattr(ctx, "set_forkserver_preload"):
        ctx.set_forkserver_preload(["numpy", "mpexec", "benchmarks.pool_bench"])
        multiprocessing.forkserver.ensure_running()  # so that it is no section's child
    # The first pool starts helpers that live as long as this process, each holding a
    # pipe open: multiprocessing's resource tracker and mpexec's own fork server. One
    # pool started and shut before the fds are counted keeps them off the leftovers.
    with mpexec.WorkerPool(1, start_method=START_METHOD) as warm:
        warm.submit(echo, 0).result(START_S)
    errors: list[str] = []
    problems: list[str] = []  # cleanup trouble: workers that had to be killed, leftovers
    t0 = time.monotonic()
    env = environment()
    result: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": env,
        "config": asdict(cfg),
    }
    gc.collect()
    baseline, fds_before = _descendants(), _open_fds()
    rt = sc = md = ar = au = None
    load: dict[str, Any] = {}  # CPU used by other processes, per section
    with _section("round trip", errors, load):
        rt = bench_round_trip(cfg, problems)
    with _section("small calls", errors, load):
        sc = bench_small_calls(cfg, problems)
    with _section("medium arrays", errors, load):
        md = bench_medium(cfg, problems)
    with _section("array", errors, load):
        ar = bench_array(cfg, problems)
    with _section("augment", errors, load):
        au = bench_augment(cfg, problems)
    hyg = hygiene(baseline, fds_before)
    problems.extend(hyg.pop("problems"))
    result.update(
        round_trip=rt,
        small_calls=sc,
        medium=md,
        array=ar,
        augment=au,
        skipped={"loky": env["loky_skipped"]} if env["loky_skipped"] else {},
        targets=evaluate(rt, ar, au, md),
        hygiene=hyg,
        machine_load=load,
        problems=problems,
        errors=errors,
        duration_s=round(time.monotonic() - t0, 1),
    )
    text = report(result)
    print(text, flush=True)
    write(NAME, result, text, out_dir, "systems")
    return result


def report(result: dict[str, Any]) -> str:
    env = result["environment"]
    loky = f"loky {env['loky']}" if env["loky"] else "no loky"
    parts = [
        (
            f"pool benchmark{' (quick)' if result['quick'] else ''}: Python {env['python']}, "
            f"numpy {env['numpy']}, mpexec {env['mpexec']}, {loky}; "
            f"{env['cpus_usable']} usable CPUs, {env['start_method']}, "
            f"{env['workers_per_pool']} workers per pool, {env['shm_backend']} segments, "
            f"load average at start {[round(x, 2) for x in env['loadavg_at_start'] or []]}"
        )
    ]
    labels = {
        cls.key: cls.label for cls in (MpexecSystem, ExecutorSystem, MpPoolSystem, LokySystem)
    }
    skipped = [labels[key] for key in result["skipped"]]
    parts.extend(
        f"skipped: {labels[key]}, {why} (not measured)" for key, why in result["skipped"].items()
    )
    if result["round_trip"] is not None:
        parts.append(round_trip_table(result["round_trip"], skipped))
    if result.get("small_calls") is not None:
        parts.append(small_calls_table(result["small_calls"], skipped))
    if result.get("medium") is not None:
        parts.append(medium_table(result["medium"]))
    if result["array"] is not None:
        parts.append(array_table(result["array"], skipped))
    if result["augment"] is not None:
        parts.append(augment_table(result["augment"], skipped))
    parts.append(targets_text(result["targets"]))
    parts.append(hygiene_text(result["hygiene"]))
    parts.append(load_text(result["machine_load"], env["cpus"]))
    return closing(parts, result, ("problems", "errors"))


def main(argv: list[str] | None = None) -> int:
    return cli("pool_bench", run, argv)


if __name__ == "__main__":
    sys.exit(main())
