"""The demo's control: this host's own ceiling, timed in every round beside the pipeline.

As many plain processes as the pipeline has workers, each a loop over its
share of the image set with the serial loop's functions, malloc settings and
warm-up: what the host gives that many processes of this work, with no
library between them, in the same round as the pipeline's epoch.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import resource
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from ._demo_images import U8, augment_one, sample_digest, warm_up_serial
from ._host import keep_memory_warm

#: How long the plain processes may take to start, and one of them a round, before the
#: demo stops with an error (a pass over the default set takes about a second).
PLAIN_START_S = 120.0
PLAIN_ROUND_S = 600.0


def _plain_process(
    conn: Connection, encoded: list[U8], seed: int, warm_images: int, warm_memory: int
) -> None:
    """A plain process of the ceiling: the serial loop's malloc and warm-up, then a loop
    over each round's share ``(first, stop)``; answers its digests, CPU seconds and faults."""
    keep_memory_warm(warm_memory)
    warm_up_serial(encoded, seed, warm_images)
    conn.send("ready")
    while (share := conn.recv()) is not None:
        first, stop = share
        cpu0 = time.process_time()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        digests = [
            bytes(sample_digest(augment_one(encoded[i], seed, i))) for i in range(first, stop)
        ]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
        conn.send((digests, time.process_time() - cpu0, faults))


class PlainProcesses:
    """This host's own ceiling in a round: ``count`` plain processes, each a loop over its
    share of the set, with the serial loop's functions, malloc settings and warm-up.

    Started with ``spawn`` (before anything of the pipeline, nothing but this
    code in them) and kept for every round, so a round times the loops alone.
    The digests they answer, joined in order, must be the serial loop's: the
    same work, checked.
    """

    def __init__(
        self, encoded: Sequence[U8], seed: int, count: int, warm_images: int, warm_memory: int
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.count = count
        self.images = len(encoded)
        self.digest = ""
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        start = time.perf_counter()
        try:
            for _ in range(count):
                here, there = ctx.Pipe()
                proc = ctx.Process(
                    target=_plain_process,
                    args=(there, list(encoded), seed, warm_images, warm_memory),
                    name="mpexec-demo-plain",
                    daemon=True,
                )
                proc.start()
                there.close()
                self._conns.append(here)
                self._procs.append(proc)
            for conn, started in zip(self._conns, self._procs, strict=True):
                self._answer(conn, started, PLAIN_START_S)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.perf_counter() - start

    @staticmethod
    def _gone(proc: Any) -> RuntimeError:
        proc.join(1.0)
        return RuntimeError(f"a plain process of the demo's ceiling exited: {proc.exitcode}")

    def _answer(self, conn: Connection, proc: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while not conn.poll(0.1):
            if not proc.is_alive():
                raise self._gone(proc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"a plain process of the demo's ceiling took over {timeout} s")
        try:
            return conn.recv()
        except (EOFError, OSError):
            raise self._gone(proc) from None

    def round(self) -> tuple[float, float, int]:
        """One pass over the set, split among the processes: its wall seconds, the
        processes' CPU seconds and their page faults."""
        bounds = [self.images * k // self.count for k in range(self.count + 1)]
        wall0 = time.perf_counter()
        for k, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            try:
                conn.send((bounds[k], bounds[k + 1]))
            except OSError:
                raise self._gone(proc) from None
        answers = [
            self._answer(c, p, PLAIN_ROUND_S) for c, p in zip(self._conns, self._procs, strict=True)
        ]
        wall = time.perf_counter() - wall0
        digest = hashlib.sha1(usedforsecurity=False)
        for digests, _, _ in answers:
            for d in digests:
                digest.update(d)
        self.digest = digest.hexdigest()
        return wall, sum(a[1] for a in answers), sum(a[2] for a in answers)

    def close(self) -> None:
        """Stop and reap the processes (bounded: a stuck one is killed)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
