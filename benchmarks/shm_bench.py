"""Shared memory against multiprocessing: ``shm.Ring`` and ``shm.Arena``.

Two measurements, each taken side by side in one run (the transports take
turns, round after round), so that their ratios hold on a noisy machine even
where absolute times do not:

ping-pong
    A 16 B or 100 B message to a child process and back. Transports: a pair of
    ``shm.Ring`` (``push`` / ``pop`` with a timeout and the peer watched);
    ``multiprocessing.Pipe`` with ``send_bytes`` / ``recv_bytes`` (blocking,
    its fastest use), the same with a bounded ``poll`` before each receive,
    and ``send`` / ``recv`` of a ``bytes`` object; ``multiprocessing.Queue``
    (``put`` / ``get`` with a timeout). Each sample is a batch of round trips
    timed with ``perf_counter_ns``, divided by the batch size.

handoff
    An array of 1 KiB to 256 MiB handed to a child process, and answered:

    - ``shm``: the array already lives in the parent's arena. The parent
      shares it (``Arena.share``), pickles the descriptor into a ring; the child
      opens it zero-copy (``shm.open_array``), reads both ends, drops the view
      (its release goes back through the arena's link ring) and pushes a 16 B
      ack; the parent pops the ack and applies releases (``Arena.collect``).
    - ``shm copy-in``: the same from a plain ndarray, which ``share`` copies
      into the arena each time (allocated, then freed once the child's
      release comes back): what handing over memory *not* in an arena costs.
    - ``pipe``: ``Connection.send(array)`` to a child that receives it
      (unpickled) and sends it back; the parent receives it: the array is
      pickled, copied through the pipe and unpickled both ways.

Every wait is bounded: rings and queues by timeouts (and a watched peer),
pipes by ``poll`` timeouts or, for the blocking Pipe variant, by a watchdog
that terminates the children (so that the blocked receive ends in EOF). Every
child is joined, or terminated, before :func:`run` returns.

Run with ``python -m benchmarks shm`` (``--quick`` for a smoke test).
"""

from __future__ import annotations

import gc
import math
import multiprocessing as mp
import pickle
import queue
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

import shm
from benchmarks._common import (
    RESULTS,
    KiB,
    MiB,
    Watchdog,
    cli,
    closing,
    fmt_size,
    fmt_time,
    git_state,
    host,
    log,
    table,
    targets_text,
    write,
)

NAME = "shm"
START_METHOD = "forkserver"


IDLE_S = 120.0  # a child gives up after waiting this long for its next message
OP_S = 10.0  # the parent's wait for one small reply
START_S = 60.0  # a child's start, imports included (the first one starts the forkserver)
STOP_S = 10.0  # joining the children at the end, before terminating them

READY = b"ready"
ACK = struct.Struct("<d")


# ============================================================ configuration
@dataclass(frozen=True)
class Config:
    quick: bool
    # ping-pong
    message_sizes: tuple[int, ...]
    round_trips: int  # per (message size, transport), after warm-up
    batch: int  # round trips per timed sample
    rounds: int  # the transports take turns this many times
    warmup: int  # round trips per (message size, transport), untimed
    # handoff: array size -> pipe (and copy-in) iterations; shm iterations
    handoff_sizes: tuple[tuple[int, int], ...]
    shm_iterations: int
    deadline_s: float  # per section, enforced by the watchdog


FULL = Config(
    quick=False,
    message_sizes=(16, 100),
    round_trips=20_000,
    batch=20,
    rounds=20,
    warmup=1_000,
    handoff_sizes=(
        (1 * KiB, 200),
        (64 * KiB, 200),
        (1 * MiB, 100),
        (16 * MiB, 20),
        (64 * MiB, 10),
        (256 * MiB, 5),
    ),
    shm_iterations=200,
    deadline_s=600.0,
)

QUICK = Config(
    quick=True,
    message_sizes=(16, 100),
    round_trips=2_000,
    batch=20,
    rounds=5,
    warmup=200,
    handoff_sizes=((1 * KiB, 30), (64 * KiB, 30), (1 * MiB, 20), (16 * MiB, 5)),
    shm_iterations=30,
    deadline_s=120.0,
)

# Targets, checked in the summary.
TARGET_PINGPONG = 1.0  # pipe/ring round-trip time, for each message size
TARGET_HANDOFF_RATIO = 20.0  # pipe/shm at the largest array
TARGET_FLATNESS = 3.0  # shm time at the largest array / at the smallest


# ============================================================ children
def _parent_watch() -> list[Any]:
    """The parent process, for a ring's ``watch=``: its exit ends our waits."""
    parent = mp.parent_process()
    return [] if parent is None else [parent]


def _ring_echo(inbox: shm.Ring, outbox: shm.Ring) -> None:
    watch = _parent_watch()
    try:
        outbox.push(READY, IDLE_S, watch)
        while True:
            try:
                msg = inbox.pop(IDLE_S, watch)
            except shm.RingClosedError:  # the parent closed it, or died
                return
            outbox.push(msg, IDLE_S, watch)
    finally:
        inbox.close()
        outbox.close()


def _pipe_bytes_echo(conn: Connection, bounded: bool) -> None:
    # Unbounded: recv_bytes ends in EOFError when the parent closes its end or dies.
    with conn:
        conn.send_bytes(READY)
        while True:
            if bounded and not conn.poll(IDLE_S):
                raise TimeoutError(f"no message from the parent in {IDLE_S} s")
            try:
                msg = conn.recv_bytes()
            except EOFError:
                return
            conn.send_bytes(msg)


def _pipe_object_echo(conn: Connection) -> None:
    with conn:
        conn.send(READY)
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            conn.send(msg)


def _queue_echo(inbox: Any, outbox: Any) -> None:
    outbox.put(READY)
    while True:
        try:
            msg = inbox.get(timeout=IDLE_S)
        except queue.Empty:
            raise TimeoutError(f"no message from the parent in {IDLE_S} s") from None
        if msg is None:
            return
        outbox.put(msg)


def _arena_reader(inbox: shm.Ring, outbox: shm.Ring, link: shm.Ring, arena_id: int) -> None:
    """Open each descriptor, read both ends of the array, drop it, ack the sum."""
    watch = _parent_watch()
    shm.set_release_route(arena_id, link)
    try:
        outbox.push(READY, IDLE_S, watch)
        while True:
            try:
                rec = inbox.pop(IDLE_S, watch)
            except shm.RingClosedError:
                return
            view = shm.open_array(pickle.loads(rec))
            total = float(view.flat[0]) + float(view.flat[-1])
            del view  # the release goes back through the link ring now
            outbox.push(ACK.pack(total), IDLE_S, watch)
    finally:
        shm.flush_releases()
        shm.set_release_route(arena_id, None)
        for ring in (inbox, outbox, link):
            ring.close()


def _pipe_array_echo(conn: Connection) -> None:
    with conn:
        conn.send_bytes(READY)
        while conn.poll(IDLE_S):
            try:
                arr = conn.recv()
            except EOFError:
                return
            conn.send(arr)
            del arr
        raise TimeoutError(f"no array from the parent in {IDLE_S} s")


# ============================================================ process hygiene
class Children:
    """Every child process of a section; all joined (or terminated) on close."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.procs: list[BaseProcess] = []
        self._lock = threading.Lock()

    def start(self, name: str, target: Callable[..., None], *args: Any) -> BaseProcess:
        proc = self.ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        with self._lock:
            self.procs.append(proc)
        return proc

    def terminate(self) -> None:
        with self._lock:
            procs = list(self.procs)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()

    def close(self, grace: float = STOP_S) -> list[str]:
        """Join every child within ``grace`` s, then terminate, then kill; report."""
        problems = []
        deadline = time.monotonic() + grace
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                problems.append(f"{proc.name} did not exit in {grace} s: terminated")
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
            if proc.exitcode != 0:
                problems.append(f"{proc.name} exited with code {proc.exitcode}")
            if proc.exitcode is not None:
                proc.close()
        self.procs.clear()
        return problems


# ============================================================ statistics
def summarize(samples_ns: list[float]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {
        "median_us": float(np.median(a)),
        "p90_us": float(np.percentile(a, 90)),
        "min_us": float(a.min()),
        "mean_us": float(a.mean()),
        "samples": len(a),
    }


# ============================================================ ping-pong
class Transport:
    key: str
    label: str

    def batch(self, msg: bytes, n: int) -> int:
        """Time ``n`` round trips of ``msg``; ns in all."""
        raise NotImplementedError

    def stop(self) -> None:
        """Tell the child to exit (it then does so on its own)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release this side's resources, once the child has exited."""


class RingTransport(Transport):
    key, label = "ring", "shm.Ring push/pop"

    def __init__(self, children: Children) -> None:
        self.req, self.rep = shm.Ring(), shm.Ring()
        self.proc = children.start("ring-echo", _ring_echo, self.req, self.rep)
        self.watch = [self.proc]
        if self.rep.pop(START_S, self.watch) != READY:
            raise RuntimeError("ring echo child sent a bad greeting")

    def batch(self, msg: bytes, n: int) -> int:
        push, pop, watch = self.req.push, self.rep.pop, self.watch
        reply = b""
        t0 = time.perf_counter_ns()
        for _ in range(n):
            push(msg, OP_S, watch)
            reply = pop(OP_S, watch)
        dt = time.perf_counter_ns() - t0
        if reply != msg:
            raise RuntimeError("ring echo returned a different message")
        return dt

    def stop(self) -> None:
        self.req.close_producer()

    def close(self) -> None:
        self.req.close()
        self.rep.close()


class _PipeTransport(Transport):
    def __init__(self, children: Children, target: Callable[..., None], *args: Any) -> None:
        self.conn, child_conn = children.ctx.Pipe()
        self.proc = children.start(f"{self.key}-echo", target, child_conn, *args)
        child_conn.close()  # so that the child's exit reads as EOF here
        if not self.conn.poll(START_S):
            raise TimeoutError(f"{self.label} echo child did not start in {START_S} s")
        self.conn.recv_bytes()

    def stop(self) -> None:
        self.conn.close()


class PipeBytesTransport(_PipeTransport):
    key, label = "pipe_bytes", "Pipe send_bytes/recv_bytes"

    def __init__(self, children: Children) -> None:
        super().__init__(children, _pipe_bytes_echo, False)

    def batch(self, msg: bytes, n: int) -> int:
        send, recv = self.conn.send_bytes, self.conn.recv_bytes
        reply = b""
        t0 = time.perf_counter_ns()
        for _ in range(n):
            send(msg)
            reply = recv()  # bounded by the watchdog: see the module docstring
        dt = time.perf_counter_ns() - t0
        if reply != msg:
            raise RuntimeError("pipe echo returned a different message")
        return dt


class PipeBytesPollTransport(_PipeTransport):
    key, label = "pipe_bytes_poll", "Pipe poll(timeout)+recv_bytes"

    def __init__(self, children: Children) -> None:
        super().__init__(children, _pipe_bytes_echo, True)

    def batch(self, msg: bytes, n: int) -> int:
        send, poll, recv = self.conn.send_bytes, self.conn.poll, self.conn.recv_bytes
        reply = b""
        t0 = time.perf_counter_ns()
        for _ in range(n):
            send(msg)
            if not poll(OP_S):
                raise TimeoutError(f"no reply from the pipe echo child in {OP_S} s")
            reply = recv()
        dt = time.perf_counter_ns() - t0
        if reply != msg:
            raise RuntimeError("pipe echo returned a different message")
        return dt


class PipeObjectTransport(_PipeTransport):
    key, label = "pipe_object", "Pipe send/recv (pickled bytes)"

    def __init__(self, children: Children) -> None:
        super().__init__(children, _pipe_object_echo)

    def batch(self, msg: bytes, n: int) -> int:
        send, recv = self.conn.send, self.conn.recv
        reply = b""
        t0 = time.perf_counter_ns()
        for _ in range(n):
            send(msg)
            reply = recv()  # bounded by the watchdog
        dt = time.perf_counter_ns() - t0
        if reply != msg:
            raise RuntimeError("pipe echo returned a different message")
        return dt


class QueueTransport(Transport):
    key, label = "queue", "Queue put/get(timeout)"

    def __init__(self, children: Children) -> None:
        ctx: Any = children.ctx
        self.req, self.rep = ctx.Queue(), ctx.Queue()
        self.proc = children.start("queue-echo", _queue_echo, self.req, self.rep)
        if self.rep.get(timeout=START_S) != READY:
            raise RuntimeError("queue echo child sent a bad greeting")

    def batch(self, msg: bytes, n: int) -> int:
        put, get = self.req.put, self.rep.get
        reply = b""
        t0 = time.perf_counter_ns()
        for _ in range(n):
            put(msg)
            reply = get(timeout=OP_S)
        dt = time.perf_counter_ns() - t0
        if reply != msg:
            raise RuntimeError("queue echo returned a different message")
        return dt

    def stop(self) -> None:
        self.req.put(None)

    def close(self) -> None:
        for q in (self.req, self.rep):
            q.close()
            q.join_thread()


TRANSPORTS: tuple[type[Transport], ...] = (
    RingTransport,
    PipeBytesTransport,
    PipeBytesPollTransport,
    PipeObjectTransport,
    QueueTransport,
)


def bench_pingpong(ctx: Any, cfg: Config, problems: list[str]) -> dict[str, Any]:
    children = Children(ctx)
    transports: list[Transport] = []
    per_round = max(1, cfg.round_trips // (cfg.batch * cfg.rounds))
    samples: dict[tuple[int, str], list[float]] = {}
    with Watchdog(children.terminate, cfg.deadline_s, "ping-pong") as dog:
        try:
            # (If a start fails, those made so far are stopped below; its child is joined.)
            transports.extend(cls(children) for cls in TRANSPORTS)
            msgs = {n: bytes((7 * i + 1) % 256 for i in range(n)) for n in cfg.message_sizes}
            for n, msg in msgs.items():
                for t in transports:
                    t.batch(msg, cfg.warmup)
                    samples[n, t.key] = []
            for r in range(cfg.rounds):
                # Rotate who goes first, so that no transport always follows another.
                k = r % len(transports)
                order = transports[k:] + transports[:k]
                for n, msg in msgs.items():
                    for t in order:
                        s = samples[n, t.key]
                        for _ in range(per_round):
                            s.append(t.batch(msg, cfg.batch) / cfg.batch)
                log(f"  ping-pong round {r + 1}/{cfg.rounds}")
        except (EOFError, OSError, shm.SharedMemoryError) as exc:
            dog.check(exc)
            raise
        finally:
            for t in transports:
                try:
                    t.stop()
                except Exception as exc:
                    problems.append(f"stopping {t.label}: {exc!r}")
            problems.extend(children.close())
            for t in transports:
                t.close()
    results: dict[str, Any] = {
        "round_trips": per_round * cfg.batch * cfg.rounds,
        "batch": cfg.batch,
        "rounds": cfg.rounds,
        "transports": {t.key: t.label for t in transports},
        "by_size": {},
    }
    for n in cfg.message_sizes:
        ring = summarize(samples[n, "ring"])
        row: dict[str, Any] = {}
        for t in transports:
            s = summarize(samples[n, t.key])
            s["vs_ring"] = s["median_us"] / ring["median_us"]
            row[t.key] = s
        results["by_size"][str(n)] = row
    return results


def pingpong_table(res: dict[str, Any]) -> str:
    rows = []
    for n, row in res["by_size"].items():
        for key, s in row.items():
            rows.append(
                [
                    f"{n} B",
                    res["transports"][key],
                    fmt_time(s["median_us"]),
                    fmt_time(s["p90_us"]),
                    f"{s['vs_ring']:.2f}x",
                ]
            )
    head = (
        f"Ping-pong round trip ({res['round_trips']} round trips per row after warm-up; "
        f"samples are batches of {res['batch']}, taken in {res['rounds']} interleaved rounds)\n"
        "time/ring > 1.00x: the ring is faster\n\n"
    )
    return head + table(
        ["msg", "transport", "median", "p90", "time/ring"], rows, right={0, 2, 3, 4}
    )


# ============================================================ handoff
def _round64(n: int) -> int:
    return -(-n // 64) * 64


def bench_handoff(ctx: Any, cfg: Config, problems: list[str]) -> dict[str, Any]:
    sizes = [s for s, _ in cfg.handoff_sizes]
    resident = sum(_round64(s) for s in sizes)
    # Room for the resident arrays and two copy-in arrays (one being released).
    segment = -(-(resident + 2 * max(sizes) + MiB) // MiB) * MiB
    arena = shm.Arena(segment_size=segment, capacity=2 * segment, name="bench")
    link = arena.link()
    req, rep = shm.Ring(16, 1024), shm.Ring(16, 64)
    children = Children(ctx)
    conn: Connection | None = None
    results: dict[str, Any] = {
        "arena_segment_size": segment,
        "resident_bytes": resident,
        "by_size": {},
        "arena_after_size": {},
    }
    with Watchdog(children.terminate, cfg.deadline_s, "handoff") as dog:
        try:
            reader = children.start("arena-reader", _arena_reader, req, rep, link, arena.id)
            conn, child_conn = ctx.Pipe()
            children.start("pipe-array-echo", _pipe_array_echo, child_conn)
            child_conn.close()
            watch = [reader]
            if rep.pop(START_S, watch) != READY:
                raise RuntimeError("arena reader sent a bad greeting")
            if not conn.poll(START_S):
                raise TimeoutError(f"pipe echo child did not start in {START_S} s")
            conn.recv_bytes()

            # The arena arrays, allocated and filled (every page touched) before timing.
            arrays = {}
            for size in sizes:
                a = arena.empty(size // 4, np.float32, tag=fmt_size(size))
                a.fill(1.0)
                a[-1] = 2.0
                arrays[size] = a
            del a

            links = _Handoff(arena, req, rep, watch, conn)
            for size, iters in cfg.handoff_sizes:
                gc.collect()
                arr = arrays[size]
                results["by_size"][str(size)] = _handoff_size(links, arr, size, iters, cfg)
                results["arena_after_size"][str(size)] = _arena_after(arena)
            del arrays, arr
            gc.collect()
            # Every reference the child held must come back, and nothing else stay.
            deadline = time.monotonic() + OP_S
            while arena.stats().exported and time.monotonic() < deadline:
                shm.wait([link], timeout=0.05)
            final = arena.stats()
            results["arena_final"] = {
                k: v for k, v in asdict(final).items() if k not in ("links", "name")
            }
            results["arena_final_text"] = str(final)
        except (EOFError, OSError, shm.SharedMemoryError) as exc:
            dog.check(exc)
            raise
        finally:
            try:
                req.close_producer()
            except Exception as exc:
                problems.append(f"stopping the arena reader: {exc!r}")
            if conn is not None:
                conn.close()
            problems.extend(children.close())
            req.close()
            rep.close()
            arena.close()  # closes the link ring too
    _flatness(results)
    return results


class _Handoff:
    """One array handed over each way: through the arena (a descriptor on a ring to a
    reader child) and through a Pipe (pickled, to an echo child)."""

    def __init__(
        self,
        arena: shm.Arena,
        req: shm.Ring,
        rep: shm.Ring,
        watch: list[Any],
        conn: Connection,
    ) -> None:
        self.arena, self.req, self.rep, self.watch, self.conn = arena, req, rep, watch, conn

    def shm_once(self, arr: np.ndarray[Any, Any], i: int) -> int:
        arr[0] = i  # a fresh value each time: the child must see this write
        t0 = time.perf_counter_ns()
        desc = self.arena.share(arr)
        self.req.push(pickle.dumps(desc), OP_S, self.watch)
        ack = self.rep.pop(OP_S, self.watch)
        self.arena.collect()
        dt = time.perf_counter_ns() - t0
        if ACK.unpack(ack)[0] != i + 2.0:
            raise RuntimeError(f"child read {ACK.unpack(ack)[0]}, expected {i + 2.0}")
        return dt

    def pipe_once(self, arr: np.ndarray[Any, Any], i: int) -> int:
        arr[0] = i
        limit = OP_S + arr.nbytes / (20 * MiB)  # >= 20 MiB/s each way
        t0 = time.perf_counter_ns()
        self.conn.send(arr)  # bounded by the watchdog
        if not self.conn.poll(limit):
            raise TimeoutError(f"array of {arr.nbytes} B not back in {limit:.0f} s")
        back = self.conn.recv()
        dt = time.perf_counter_ns() - t0
        if back[0] != i or back[-1] != 2.0:
            raise RuntimeError("the array came back different")
        del back
        return dt


def _handoff_size(
    links: _Handoff, arr: np.ndarray[Any, Any], size: int, iters: int, cfg: Config
) -> dict[str, Any]:
    """One size's round trips: the arena's array, a plain one copied in, the Pipe."""
    plain = np.ones(size // 4, np.float32)  # not in the arena
    plain[-1] = 2.0
    per_round = max(1, math.ceil(cfg.shm_iterations / iters))
    t_shm: list[float] = []
    t_copy: list[float] = []
    t_pipe: list[float] = []
    warm = 2 if size >= 16 * MiB else 10
    for i in range(warm):
        links.shm_once(arr, i)
        links.shm_once(plain, i)
        links.pipe_once(plain, i)
    for i in range(iters):
        # Alternate who goes first.
        if i % 2:
            t_pipe.append(links.pipe_once(plain, i))
        t_shm.extend(links.shm_once(arr, i * per_round + j) for j in range(per_round))
        t_copy.append(links.shm_once(plain, i))
        if not i % 2:
            t_pipe.append(links.pipe_once(plain, i))
    del plain
    s_shm, s_copy, s_pipe = summarize(t_shm), summarize(t_copy), summarize(t_pipe)
    log(
        f"  handoff {fmt_size(size)}: shm {fmt_time(s_shm['median_us'])}, "
        f"copy-in {fmt_time(s_copy['median_us'])}, "
        f"pipe {fmt_time(s_pipe['median_us'])}"
    )
    return {
        "shm": s_shm,
        "shm_copy_in": s_copy,
        "pipe": s_pipe,
        "pipe_over_shm": s_pipe["median_us"] / s_shm["median_us"],
        "pipe_over_shm_copy_in": s_pipe["median_us"] / s_copy["median_us"],
    }


def _arena_after(arena: shm.Arena) -> dict[str, Any]:
    st = arena.stats()
    return {
        "in_use": st.in_use,
        "peak": st.peak,
        "reserved": st.reserved,
        "exported": st.exported,
        "releases_received": st.releases_received,
    }


def _flatness(results: dict[str, Any]) -> None:
    """The largest size's median over the smallest's: 1.0 when size costs nothing."""
    sizes_done = [int(s) for s in results["by_size"]]
    big, small = max(sizes_done), min(sizes_done)
    results["largest"], results["smallest"] = big, small
    results["flatness"] = (
        results["by_size"][str(big)]["shm"]["median_us"]
        / results["by_size"][str(small)]["shm"]["median_us"]
    )


def handoff_table(res: dict[str, Any]) -> str:
    rows = []
    for size, r in res["by_size"].items():
        rows.append(
            [
                fmt_size(int(size)),
                fmt_time(r["shm"]["median_us"]),
                fmt_time(r["shm"]["p90_us"]),
                fmt_time(r["shm_copy_in"]["median_us"]),
                fmt_time(r["pipe"]["median_us"]),
                fmt_time(r["pipe"]["p90_us"]),
                f"{r['pipe_over_shm']:.1f}x",
                f"{r['pipe_over_shm_copy_in']:.1f}x",
                f"{r['shm']['samples']}/{r['pipe']['samples']}",
            ]
        )
    head = (
        "Array handoff round trip (float32; shm: descriptor to the child, zero-copy view, "
        "16 B ack;\ncopy-in: the same from a plain ndarray, copied into the arena each time; "
        "pipe: the array\nsent to the child and back, pickled both ways)\n\n"
    )
    foot = (
        f"\n\nflatness: shm at {fmt_size(res['largest'])} / shm at {fmt_size(res['smallest'])}"
        f" = {res['flatness']:.2f}x\narena at the end: {res['arena_final_text']}"
    )
    return (
        head
        + table(
            [
                "size",
                "shm median",
                "shm p90",
                "copy-in median",
                "pipe median",
                "pipe p90",
                "pipe/shm",
                "pipe/copy-in",
                "n shm/pipe",
            ],
            rows,
        )
        + foot
    )


# ============================================================ targets
def evaluate(pp: dict[str, Any] | None, ho: dict[str, Any] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, op: str, target: float, note: str = "") -> None:
        ok = value is not None and (value >= target if op == ">=" else value <= target)
        out.append(
            {
                "target": what,
                "value": value,
                "op": op,
                "threshold": target,
                "pass": ok,
                "note": note,
            }
        )

    if pp is not None:
        for n, row in pp["by_size"].items():
            add(
                f"ping-pong {n} B: Pipe bytes / ring",
                row["pipe_bytes"]["vs_ring"],
                ">=",
                TARGET_PINGPONG,
            )
            add(
                f"ping-pong {n} B: Pipe poll+bytes / ring (both bounded)",
                row["pipe_bytes_poll"]["vs_ring"],
                ">=",
                TARGET_PINGPONG,
            )
    if ho is not None:
        big, small = ho["largest"], ho["smallest"]
        note = "" if big >= 256 * MiB else "target defined at 256 MiB"
        add(
            f"handoff {fmt_size(big)}: pipe / shm",
            ho["by_size"][str(big)]["pipe_over_shm"],
            ">=",
            TARGET_HANDOFF_RATIO,
            note,
        )
        add(
            f"handoff flatness: shm {fmt_size(big)} / {fmt_size(small)}",
            ho["flatness"],
            "<=",
            TARGET_FLATNESS,
            note,
        )
        fin = ho.get("arena_final", {})
        bounded = (
            fin.get("in_use") == 0
            and fin.get("exported") == 0
            and fin.get("segments") == 1
            and fin.get("peak", math.inf) <= ho["arena_segment_size"]
        )
        out.append(
            {
                "target": "arena bounded: all released, one segment, peak <= segment",
                "value": None,
                "op": "",
                "threshold": None,
                "pass": bounded,
                "note": "",
            }
        )
    return out


# ============================================================ environment
def environment() -> dict[str, Any]:
    info = shm.platform_info()
    env: dict[str, Any] = {
        **host(),
        "start_method": START_METHOD,
        "shm_backend": info.backend,
        "eventfd": info.eventfd,
        "page_size": info.page_size,
    }
    env["git_commit"], env["git_dirty"] = git_state("shm")
    return env


# ============================================================ entry points
@contextmanager
def _section(name: str, errors: list[str]) -> Iterator[None]:
    log(f"[{NAME}] {name} ...")
    t0 = time.monotonic()
    try:
        yield
    except Exception:
        errors.append(f"{name}: {traceback.format_exc()}")
        log(f"[{NAME}] {name} FAILED:\n{traceback.format_exc()}")
    else:
        log(f"[{NAME}] {name} done in {time.monotonic() - t0:.1f} s")


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    """Run the benchmark, print its tables, write ``shm.json`` and ``shm.md``."""
    cfg = QUICK if quick else FULL
    ctx = mp.get_context(START_METHOD)
    if hasattr(ctx, "set_forkserver_preload"):
        ctx.set_forkserver_preload(["numpy", "shm"])
    errors: list[str] = []
    problems: list[str] = []  # cleanup trouble: children that had to be killed, ...
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment(),
        "config": asdict(cfg),
    }
    pp = ho = None
    with _section("ping-pong", errors):
        pp = bench_pingpong(ctx, cfg, problems)
    with _section("handoff", errors):
        ho = bench_handoff(ctx, cfg, problems)
    leftovers = [p.name for p in mp.active_children()]
    if leftovers:
        problems.append(f"child processes left running: {leftovers}")
    result.update(
        pingpong=pp,
        handoff=ho,
        targets=evaluate(pp, ho),
        problems=problems,
        errors=errors,
        duration_s=round(time.monotonic() - t0, 1),
    )
    text = report(result)
    print(text, flush=True)
    write(NAME, result, text, out_dir, "transports")
    return result


def report(result: dict[str, Any]) -> str:
    env = result["environment"]
    parts = [
        (
            f"shm benchmark{' (quick)' if result['quick'] else ''}: Python {env['python']}, "
            f"numpy {env['numpy']}, {env['cpus_usable']} usable CPUs, {env['start_method']}, "
            f"{env['shm_backend']} segments, load average at start {env['loadavg_at_start']}"
        )
    ]
    if result["pingpong"] is not None:
        parts.append(pingpong_table(result["pingpong"]))
    if result["handoff"] is not None:
        parts.append(handoff_table(result["handoff"]))
    parts.append(targets_text(result["targets"]))
    return closing(parts, result, ("problems", "errors"))


def main(argv: list[str] | None = None) -> int:
    return cli("shm_bench", run, argv)


if __name__ == "__main__":
    sys.exit(main())
