"""mpexec side by side with its peers, in one run: ``python -m benchmarks peers``.

Workloads (the functions are in ``benchmarks/_workloads.py``, the same for every
system; each system is driven in its own idiom by ``benchmarks/_peers.py``):

1. augment: CPU-bound augmentation of N deterministic 256x256x3 uint8 images
   (random crop to 224, flip, brightness and contrast jitter in float32, a
   pure-Python noise field, normalisation), batches of 64, by mpexec (a
   pipeline, and ``WorkerPool.map``), PyTorch's DataLoader, tf.data with
   ``tf.numpy_function``, DALI's ``fn.python_function`` and its parallel
   ``external_source``, Grain, ``multiprocessing.Pool.imap``, loky, threads
   and serially. Throughput in images/s, and peak memory.
2. jpeg: workload 1 on real JPEGs. Nine files, made in each process from a
   photograph that ships with matplotlib (``sample_data/grace_hopper.jpg``:
   three 512x512 windows, each at 256, 384 and 512 px, Pillow at quality 90);
   sample i is the encoded bytes of file i % 9, which every system's op
   decodes with Pillow (to 256x256x3 uint8) and augments as in workload 1.
   Each system runs it as it runs workload 1, with the bytes where the image
   was (DALI too: its own ``fn.decoders.image`` would give other pixels than
   Pillow's, and the values must be the same in every system). Skipped, with
   the reason, where Pillow or matplotlib is missing.
3. overhead: the round trip of a trivial call on 16 float64.
4. transfer: ``x + 1`` of one float32 array, 1 KiB to 256 MiB (16 MiB with
   ``--quick``), answered with an array of the same size.
5. scaling: workload 1's throughput against the worker count, 1 to the CPUs
   this process may use, for mpexec and the two fastest peers of workload 1.
6. light: the per-item cost. Sample i is ``x + 1`` on 16 float32 (made from
   the index), batches of 256, measured as workload 1 (checked against serial,
   interleaved epochs); mpexec runs it as a pipeline per sample and with the
   op in batch mode (``batch_processing=True``), against PyTorch's
   DataLoader, DALI's parallel ``external_source`` and Grain.

How it measures:

- Every system runs in a process of its own (a *child*), which imports only
  its own library. A child that fails or hangs is reported with its error
  and killed; the run goes on. Each phase has a watchdog
  (``_common.Watchdog``) and every wait a timeout.
- Before anything is timed, each system runs alone and its output is
  compared with the serial result (a digest of every batch, or every element
  of every array): a system that differs is reported as failed, not timed.
  Meanwhile a thread samples the proportional set size (PSS) of the child's
  whole process tree: the peak is the system's memory.
- Then every verified system is started again, all at once, and they take
  turns, round after round, the first one rotating; ratios taken this way
  hold on a noisy machine where absolute figures do not. Each timed epoch's
  batches are checked against the serial result on a strided sample.
- The CPU time that other processes used meanwhile is reported for each
  phase: figures from a busy machine are flagged.

Results: ``benchmarks/results/peers.{json,md}`` and PNG plots (``-quick``
for ``--quick``), and for a full run ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks import _peers
from benchmarks import _workloads as wl
from benchmarks._common import (
    RESULTS,
    Watchdog,
    fmt_size,
    fmt_time,
    git_state,
    log,
    targets_text,
    usable_cpus,
)
from mpexec._cpuload import CpuMeter

NAME = "peers"
ROOT = Path(__file__).resolve().parent.parent
KiB, MiB = 1 << 10, 1 << 20

WORKERS = 2  # workers per system in workloads 1, 3 and 4 (the targets' setting)
START_S = 180.0  # a child's imports and set-up (TensorFlow takes a while)
QUIT_S = 30.0

# Targets, checked in the summary.
TARGET_AUG_VS_SERIAL = 1.9
TARGET_AUG_VS_PEERS = 1.0
TARGET_CALL_US = 50.0
TARGET_CALL_VS_PEER = 10.0
TARGET_TRANSFER_VS_PEER = 1.3  # at 64 MiB
TARGET_TRANSFER_FLAT = 1.3  # mpexec (put) / inline at the largest size: no copies
TARGET_MEMORY_VS_PEER = 1.0
TARGET_LIGHT_VS_TORCH = 1.0  # per-sample pipeline / PyTorch DataLoader, samples/s
TARGET_LIGHT_BATCH_VS_TORCH = 1.2  # batch-mode pipeline / PyTorch DataLoader
TARGET_BATCH_VS_PER_SAMPLE = 1.0  # a batch op never loses to the same op per sample
TARGET_AUG4_VS_DALI = 1.1  # workload 1b: pipeline / DALI parallel external_source
TARGET_POOL_VS_PIPELINE = 0.95  # workload 1b: WorkerPool.map within 5% of the pipeline
# Workload 1b: workers' minor faults a sample (augment4 alone, warmed, in a loop: 0;
# the serial row's count is the benchmark's loop, batches stacked included).
TARGET_WORKER_FAULTS = 5.0
TARGET_TORCH_LOADER = 1.1  # mpexec.torch.DataLoader / torch's, throughput (workloads 1, 2)
TARGET_TORCH_LOADER_PSS = 0.7  # and peak PSS


# ============================================================ configuration
@dataclass(frozen=True)
class Config:
    quick: bool
    images: int
    aug_rounds: int
    call_rounds: int
    call_per_round: int
    call_warmup: int
    sizes: tuple[int, ...]
    transfer_rounds: int
    transfer_budget_s: float  # per system, size and round
    scaling_rounds: int
    jpeg_images: int  # at least a batch per worker: DataLoader and Grain hand out batches
    jpeg_rounds: int
    light_samples: int
    light_rounds: int
    workloads: tuple[str, ...] = (
        "augment",
        "augment4",
        "jpeg",
        "overhead",
        "transfer",
        "scaling",
        "light",
    )
    systems: tuple[str, ...] = ()  # only these (keys), if any

    def calls_for(self, size: int) -> int:
        """Timed calls per system, size and round."""
        per = {KiB: 40, 64 * KiB: 30, MiB: 20, 16 * MiB: 6, 64 * MiB: 3}.get(size, 1)
        return max(1, per // 2) if self.quick else per


SIZES = (KiB, 64 * KiB, MiB, 16 * MiB, 64 * MiB, 256 * MiB)

FULL = Config(
    quick=False,
    images=512,
    aug_rounds=5,
    call_rounds=20,
    call_per_round=100,
    call_warmup=300,
    sizes=SIZES,
    transfer_rounds=5,
    transfer_budget_s=10.0,
    scaling_rounds=3,
    jpeg_images=256,
    jpeg_rounds=2,  # workload 2 adds about 4 minutes on 2 CPUs
    light_samples=256 * 200,
    light_rounds=5,
)
QUICK = Config(
    quick=True,
    images=128,
    aug_rounds=3,
    call_rounds=4,
    call_per_round=30,
    call_warmup=50,
    sizes=SIZES[:4],
    transfer_rounds=3,
    transfer_budget_s=4.0,
    scaling_rounds=2,
    jpeg_images=128,
    jpeg_rounds=2,
    light_samples=256 * 40,
    light_rounds=3,
)


def jpeg_config(cfg: Config) -> Config:
    """Workload 2's settings in workload 1's terms: its images, and its timed epochs."""
    return replace(cfg, images=cfg.jpeg_images, aug_rounds=cfg.jpeg_rounds)


def light_config(cfg: Config) -> Config:
    """Workload 6's settings in workload 1's terms."""
    return replace(cfg, images=cfg.light_samples, aug_rounds=cfg.light_rounds)


def epoch_timeout(cfg: Config) -> float:
    """Seconds one epoch of workload 1 may take (a quarter of a second an image)."""
    return 60.0 + 0.25 * cfg.images


# ============================================================ children
class ChildError(RuntimeError):
    """A child failed, timed out or died; the message says which, with its stderr."""


class Child:
    """One system in a process of its own, answering JSON commands (``_peers.serve``)."""

    def __init__(self, workload: str, system: str, workers: int, images: int = 0) -> None:
        self.spec = {"workload": workload, "system": system, "workers": workers, "n": images}
        self.what = f"{workload}/{system}/{workers}w"
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._buf = b""
        self.killed = ""  # why this side killed it, if it did
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed by close()

    def start(self) -> dict[str, Any]:
        env = dict(os.environ)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks._peers", json.dumps(self.spec)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
            start_new_session=True,  # its own process group: killed as one
        )
        self.info = self._reply(START_S, "start")
        return self.info

    def ask(self, timeout: float, **msg: Any) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as exc:
            why = f" (killed: {self.killed})" if self.killed else ""
            raise ChildError(
                f"{self.what}: cannot send {msg['cmd']}: {exc}{why}{self.tail()}"
            ) from exc
        return self._reply(timeout, msg["cmd"])

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill(f"no answer to {what} in {timeout:.0f} s")
                    raise ChildError(f"{self.what}: no answer to {what} in {timeout:.0f} s")
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    code = self.proc.wait(5.0)
                    why = f", killed: {self.killed}" if self.killed else ""
                    raise ChildError(
                        f"{self.what}: exited (code {code}{why}) during {what}{self.tail()}"
                    )
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise ChildError(f"{self.what}: {what} failed:\n{reply.get('error', '?')}")
        return reply

    def tail(self, lines: int = 25) -> str:
        """The end of the child's standard error, for an error message."""
        with suppress(OSError, ValueError):
            self._stderr.seek(0)
            text = self._stderr.read().decode(errors="replace").strip().splitlines()
            if text:
                return "\n  stderr: ...\n  " + "\n  ".join(text[-lines:])
        return ""

    def tree(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self, why: str = "") -> None:
        """Kill the child's whole process tree (its group, and any that left it)."""
        self.killed = self.killed or why or "killed"
        procs = self.tree()
        if self.proc is not None:
            with suppress(OSError):
                os.killpg(self.proc.pid, 9)
        for p in procs:
            with suppress(psutil.Error):
                p.kill()

    def close(self) -> list[str]:
        """Quit (bounded), then make sure no process of the child's tree is left."""
        problems: list[str] = []
        if self.proc is None:
            return problems
        procs = self.tree()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(0.5 if self.killed or not self.info else 0.0)
        if self.proc.poll() is None and not self.killed:
            try:
                self.ask(QUIT_S, cmd="quit")
                self.proc.wait(QUIT_S)
            except (ChildError, subprocess.TimeoutExpired) as exc:
                problems.append(f"{self.what}: did not quit cleanly ({exc}); killed")
                self.kill()
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        if self.proc.stdin is not None:
            with suppress(OSError):
                self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        _, alive = psutil.wait_procs(procs, timeout=5.0)
        if alive:
            problems.append(
                f"{self.what}: {len(alive)} process(es) left after quitting: killed "
                f"{[p.pid for p in alive]}"
            )
            for p in alive:
                with suppress(psutil.Error):
                    p.kill()
            psutil.wait_procs(alive, timeout=5.0)
        self._stderr.close()
        return problems


class PssSampler:
    """Samples the total PSS of a process tree from a thread; ``peak`` in bytes."""

    def __init__(self, child: Child, interval: float = 0.05) -> None:
        self.child = child
        self.interval = interval
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pss sampler", daemon=True)

    def sample(self) -> None:
        total = 0
        for p in self.child.tree():
            with suppress(psutil.Error):
                total += p.memory_full_info().pss
        self.peak = max(self.peak, total)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> PssSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.sample()


# ============================================================ results of a system
@dataclass
class Entry:
    """One system in one workload: its status, and what was measured."""

    key: str
    label: str
    status: str = "pending"  # ok | skipped | failed
    why: str = ""  # the skip reason or the error
    version: str = ""
    start_method: str = ""
    setup_s: float | None = None
    peak_pss: int | None = None
    samples: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)  # workers' minor faults a sample, per epoch
    by_size: dict[str, list[float]] = field(default_factory=dict)
    multiprocess: bool = True
    mpexec: bool = False

    def fail(self, why: str) -> None:
        if self.status != "failed":
            self.status, self.why = "failed", why
            log(f"[{NAME}]   {self.label}: FAILED\n{why}")


def entries_for(workload: str, cfg: Config) -> list[Entry]:
    out = []
    for s in _peers.CATALOGUE[workload]:
        if cfg.systems and s.key not in cfg.systems and s.key not in ("serial", "inline"):
            continue
        e = Entry(s.key, s.label, multiprocess=s.multiprocess, mpexec=s.mpexec)
        why = _peers.availability(s.requires)
        if why:
            e.status, e.why = "skipped", why
        out.append(e)
    return out


def live(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.status in ("pending", "ok")]


# ============================================================ statistics
def stats(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(a)),
        "min": float(a.min()),
        "max": float(a.max()),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "samples": len(a),
    }


def rotated(items: list[Any], r: int) -> list[Any]:
    """``items`` starting at position ``r``: who goes first changes every round."""
    if not items:
        return items
    k = r % len(items)
    return items[k:] + items[:k]


# ============================================================ phases
def _close_all(children: dict[str, Child], problems: list[str]) -> None:
    for child in children.values():
        problems.extend(child.close())


def verify_alone(
    workload: str,
    entries: list[Entry],
    workers: int,
    cfg: Config,
    check: Callable[[Child, Entry], None],
    problems: list[str],
) -> None:
    """Each system alone: start it, check its output (sampling its memory), close it."""
    for e in live(entries):
        child = Child(workload, e.key, workers, cfg.images)
        deadline = START_S + 4 * epoch_timeout(cfg) + 300.0
        log(f"[{NAME}] {workload}: verifying {e.label} ...")
        why = f"its verification overran {deadline:.0f} s (watchdog)"
        with Watchdog(partial(child.kill, why), deadline, f"verifying {e.label}") as dog:
            try:
                info = child.start()
                e.version = info.get("version", "")
                e.start_method = info.get("start_method", "")
                e.setup_s = info.get("setup_s")
                with PssSampler(child) as mem:
                    check(child, e)
                e.peak_pss = mem.peak
                if e.status == "pending":
                    e.status = "ok"
            except Exception as exc:
                e.fail(_why(exc, dog))
        problems.extend(child.close())


def _why(exc: BaseException, dog: Watchdog | None = None) -> str:
    if dog is not None and dog.fired:
        return f"overran its {dog.seconds:.0f} s deadline and was killed: {exc}"
    if isinstance(exc, ChildError):
        return str(exc)
    return "".join(traceback.format_exception(exc)).strip()


@contextmanager
def started(
    workload: str,
    entries: list[Entry],
    workers: int,
    cfg: Config,
    deadline: float,
    problems: list[str],
) -> Iterator[dict[str, Child]]:
    """Start every verified system at once, under a watchdog; close them all on the way out."""
    children: dict[str, Child] = {}
    why = f"the {workload} timing phase overran its {deadline:.0f} s deadline (watchdog)"

    def everything() -> None:
        for c in list(children.values()):
            c.kill(why)

    try:
        with Watchdog(everything, deadline, f"{workload} timing") as dog:
            for e in live(entries):
                child = children[e.key] = Child(workload, e.key, workers, cfg.images)
                try:
                    child.start()
                except Exception as exc:
                    e.fail(_why(exc, dog))
                    problems.extend(children.pop(e.key).close())
            yield children
        if dog.fired:
            problems.append(why + ": the systems still running were killed")
    finally:
        _close_all(children, problems)


def ask(children: dict[str, Child], e: Entry, timeout: float, **msg: Any) -> dict[str, Any] | None:
    """A command to a system's child; on failure, the system fails and its child goes."""
    child = children.get(e.key)
    if child is None or e.status == "failed":
        return None
    try:
        return child.ask(timeout, **msg)
    except Exception as exc:
        e.fail(_why(exc))
        child.kill()
        return None


# ============================================================ workload 1
def reference(cfg: Config, workload: str = "augment") -> dict[str, Any]:
    """The serial result: a digest of each batch, and of its strided sample."""
    t0 = time.perf_counter()
    full, subs = [], []
    for b in wl.batches_of(cfg.images, wl.PER_SAMPLE[workload].batch_size):
        batch = wl.process_batch(b, workload)
        full.append(wl.digest(batch))
        subs.append(wl.digest(batch.reshape(-1)[:: _peers.SUB_STRIDE]))
    seconds = time.perf_counter() - t0
    log(
        f"[{NAME}] {workload} reference: {cfg.images} images, "
        f"{1e3 * seconds / cfg.images:.1f} ms an image"
    )
    return {"digests": full, "subs": subs, "ms_per_image": 1e3 * seconds / cfg.images}


def bench_augment(
    cfg: Config,
    ref: dict[str, Any],
    workers: int,
    problems: list[str],
    keys: list[str] | None = None,
    workload: str = "augment",
) -> list[Entry]:
    """Workload 1, or 2 (``workload="jpeg"``, ``cfg`` from :func:`jpeg_config`)."""
    entries = entries_for(workload, cfg)
    if keys is not None:
        entries = [e for e in entries if e.key in keys]
    timeout = epoch_timeout(cfg)

    def check(child: Child, e: Entry) -> None:
        reply = child.ask(timeout, cmd="verify")
        if reply["digests"] != ref["digests"]:
            bad = [
                i
                for i, (a, b) in enumerate(zip(reply["digests"], ref["digests"], strict=False))
                if a != b
            ]
            e.fail(
                f"output differs from the serial result (batches {bad}, "
                f"{len(reply['digests'])} batches for {len(ref['digests'])})"
            )

    if keys is None:  # the main run: verified alone first, with memory
        verify_alone(workload, entries, workers, cfg, check, problems)
    deadline = (len(entries) + 1) * (START_S + (cfg.aug_rounds + 2) * timeout)
    with started(workload, entries, workers, cfg, deadline, problems) as children:
        for e in live(entries):  # a warm-up epoch, checked in full
            reply = ask(children, e, timeout, cmd="verify")
            if reply is not None and reply["digests"] != ref["digests"]:
                e.fail("output differs from the serial result (warm-up epoch)")
        for r in range(cfg.aug_rounds):
            for e in rotated(live(entries), r):
                reply = ask(children, e, timeout, cmd="epoch")
                if reply is None:
                    continue
                if reply["subs"] != ref["subs"]:
                    e.fail(f"output differs from the serial result (timed epoch {r + 1})")
                    continue
                e.samples.append(cfg.images / reply["seconds"])
                if "faults" in reply:
                    e.faults.append(reply["faults"] / cfg.images)
            log(f"[{NAME}] {workload} ({workers} workers): round {r + 1}/{cfg.aug_rounds}")
    for e in live(entries):
        e.status = "ok" if e.samples else e.status
    return entries


# ============================================================ workload 2
def bench_jpeg(cfg: Config, problems: list[str]) -> dict[str, Any]:
    """Workload 1's measurement over JPEGs decoded by Pillow, or why it was skipped."""
    why = wl.jpeg_unavailable()
    if why:
        log(f"[{NAME}] jpeg: {why}")
        return {"skipped": why}
    jcfg = jpeg_config(cfg)
    dataset = wl.jpeg_dataset()
    ref = reference(jcfg, "jpeg")
    entries = bench_augment(jcfg, ref, WORKERS, problems, workload="jpeg")
    return {**summarize_augment(entries), "dataset": dataset, "reference": ref}


def bench_augment4(cfg: Config, problems: list[str]) -> dict[str, Any]:
    """Workload 1b: workload 1 at 3-4 ms a sample, where page faults weigh more."""
    ref = reference(cfg, "augment4")
    entries = bench_augment(cfg, ref, WORKERS, problems, workload="augment4")
    return {**summarize_augment(entries), "reference": ref}


# ============================================================ workload 6
def bench_light(cfg: Config, problems: list[str]) -> dict[str, Any]:
    """Workload 6: light ops, per sample and in batch mode, against the loaders."""
    lcfg = light_config(cfg)
    ref = reference(lcfg, "light")
    entries = bench_augment(lcfg, ref, WORKERS, problems, workload="light")
    return {**summarize_augment(entries), "reference": ref}


# ============================================================ workload 3
def bench_overhead(cfg: Config, problems: list[str]) -> list[Entry]:
    entries = entries_for("overhead", cfg)

    def check(child: Child, e: Entry) -> None:
        child.ask(60.0, cmd="verify", calls=20)

    verify_alone("overhead", entries, WORKERS, cfg, check, problems)
    timeout = 60.0 + cfg.call_per_round * 0.1
    deadline = (len(entries) + 1) * START_S + cfg.call_rounds * len(entries) * timeout
    with started("overhead", entries, WORKERS, cfg, deadline, problems) as children:
        for e in live(entries):
            ask(children, e, timeout * 3, cmd="time", calls=cfg.call_warmup)
        for r in range(cfg.call_rounds):
            for e in rotated(live(entries), r):
                reply = ask(children, e, timeout, cmd="time", calls=cfg.call_per_round)
                if reply is not None:
                    e.samples.extend(reply["us"])
        log(f"[{NAME}] overhead: {cfg.call_rounds} rounds")
    return entries


# ============================================================ workload 4
def bench_transfer(cfg: Config, problems: list[str]) -> list[Entry]:
    entries = entries_for("transfer", cfg)
    timeout = 120.0

    def check(child: Child, e: Entry) -> None:
        for size in cfg.sizes:
            child.ask(timeout + size / MiB, cmd="verify", size=size)

    verify_alone("transfer", entries, WORKERS, cfg, check, problems)
    per_size = cfg.transfer_rounds * len(entries) * (cfg.transfer_budget_s + timeout)
    deadline = (len(entries) + 1) * START_S + len(cfg.sizes) * per_size
    with started("transfer", entries, WORKERS, cfg, deadline, problems) as children:
        for size in cfg.sizes:
            key = str(size)
            limit = timeout + size / MiB
            for e in live(entries):  # input made (and put), one untimed call
                ask(children, e, limit, cmd="verify", size=size)
            for r in range(cfg.transfer_rounds):
                for e in rotated(live(entries), r):
                    reply = ask(
                        children,
                        e,
                        limit * cfg.calls_for(size),
                        cmd="time",
                        size=size,
                        calls=cfg.calls_for(size),
                        budget_s=cfg.transfer_budget_s,
                    )
                    if reply is not None:
                        e.by_size.setdefault(key, []).extend(reply["ms"])
            log(f"[{NAME}] transfer: {fmt_size(size)} done")
    return entries


# ============================================================ workload 5
def worker_counts(cpus: int) -> list[int]:
    counts = list(range(1, min(cpus, 4) + 1))
    w = 8
    while w < cpus:
        counts.append(w)
        w *= 2
    if cpus not in counts:
        counts.append(cpus)
    return counts


def scaling_systems(augment: list[Entry]) -> list[Entry]:
    """The faster mpexec system and the two fastest peers of workload 1."""
    ok = [e for e in augment if e.status == "ok" and e.samples and e.key != "serial"]
    ok.sort(key=lambda e: -float(np.median(e.samples)))
    mine = [e for e in ok if e.mpexec][:1]
    peers = [e for e in ok if not e.mpexec][:2]
    return mine + peers


def bench_scaling(
    cfg: Config, ref: dict[str, Any], augment: list[Entry], cpus: int, problems: list[str]
) -> dict[str, Any]:
    chosen = scaling_systems(augment)
    keys = [e.key for e in chosen]
    counts = worker_counts(cpus)
    scfg = Config(**{**asdict(cfg), "aug_rounds": cfg.scaling_rounds})
    curves: dict[str, dict[str, Any]] = {
        e.key: {"label": e.label, "by_workers": {}} for e in chosen
    }
    for w in counts:
        log(f"[{NAME}] scaling: {w} worker(s): {', '.join(keys)}")
        for e in bench_augment(scfg, ref, w, problems, keys=keys):
            curve = curves[e.key]["by_workers"]
            curve[str(w)] = (
                {"status": "ok", "images_per_s": stats(e.samples)}
                if e.status == "ok" and e.samples
                else {"status": e.status, "why": e.why}
            )
    return {"workers": counts, "systems": curves}


# ============================================================ environment
def _cpu_model() -> str:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    import mpexec

    versions = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "psutil": psutil.__version__,
        "mpexec": mpexec.__version__,
    }
    for module in ("torch", "tensorflow", "grain", "loky", "joblib", "nvidia.dali", "matplotlib"):
        versions[module] = _peers.installed_version(module)
    commit, dirty = git_state("mpexec", "shm", "benchmarks")
    return {
        "versions": versions,
        "implementation": platform.python_implementation(),
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "memory_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "workers": WORKERS,
        "batch_size": wl.BATCH_SIZE,
        "git_commit": commit,
        "git_dirty": dirty,
    }


@contextmanager
def section(name: str, errors: list[str], load: dict[str, Any]) -> Iterator[None]:
    """Run a workload; record its failure, and the CPU that other processes used meanwhile."""
    log(f"[{NAME}] {name} ...")
    meter = CpuMeter()
    try:
        yield
    except Exception:
        errors.append(f"{name}: {traceback.format_exc()}")
        log(f"[{NAME}] {name} FAILED:\n{traceback.format_exc()}")
    finally:
        used = meter.stop()
        load[name] = {"wall_s": round(used.wall_s, 1), "other_share": used.other_share}
        log(f"[{NAME}] {name} done in {used.wall_s:.1f} s")


# ============================================================ summaries
def entry_json(e: Entry) -> dict[str, Any]:
    d = asdict(e)
    d.pop("samples")
    d.pop("by_size")
    d.pop("faults")
    if e.faults:
        d["faults_per_sample"] = stats(e.faults)
    return d


def summarize_augment(entries: list[Entry]) -> dict[str, Any]:
    rows = {}
    for e in entries:
        row = entry_json(e)
        if e.status == "ok" and e.samples:
            row["images_per_s"] = stats(e.samples)
        rows[e.key] = row
    ok = {k: r for k, r in rows.items() if "images_per_s" in r}
    serial = ok.get("serial", {}).get("images_per_s", {}).get("median")
    peers = {k: r for k, r in ok.items() if not r["mpexec"] and k != "serial"}
    best = max(peers, key=lambda k: peers[k]["images_per_s"]["median"], default=None)
    best_rate = peers[best]["images_per_s"]["median"] if best else None
    best_pss = peers[best]["peak_pss"] if best else None
    for r in ok.values():
        m = r["images_per_s"]["median"]
        r["vs_serial"] = m / serial if serial else None
        r["vs_best_peer"] = m / best_rate if best_rate else None
        r["pss_vs_best_peer"] = r["peak_pss"] / best_pss if best_pss and r.get("peak_pss") else None
    lowest = min(
        (k for k in peers if peers[k].get("peak_pss")),
        key=lambda k: peers[k]["peak_pss"],
        default=None,
    )
    return {"by_system": rows, "best_peer": best, "lowest_memory_peer": lowest}


def summarize_overhead(entries: list[Entry]) -> dict[str, Any]:
    rows = {}
    for e in entries:
        row = entry_json(e)
        if e.status == "ok" and e.samples:
            row["us"] = stats(e.samples)
        rows[e.key] = row
    ok = {k: r for k, r in rows.items() if "us" in r}
    inline = ok.get("inline", {}).get("us", {}).get("median")
    peers = {k: r for k, r in ok.items() if r["multiprocess"] and not r["mpexec"]}
    best = min(peers, key=lambda k: peers[k]["us"]["median"], default=None)
    best_us = peers[best]["us"]["median"] if best else None
    for r in ok.values():
        m = r["us"]["median"]
        r["vs_inline"] = m / inline if inline else None
        r["best_peer_over_this"] = best_us / m if best_us else None
    return {"by_system": rows, "best_peer": best, "payload": "16 float64 (128 bytes)"}


def summarize_transfer(entries: list[Entry], sizes: tuple[int, ...]) -> dict[str, Any]:
    rows = {}
    for e in entries:
        row = entry_json(e)
        row["ms"] = {k: stats(v) for k, v in e.by_size.items() if v}
        rows[e.key] = row
    best: dict[str, str | None] = {}
    for size in map(str, sizes):
        have = {
            k: r["ms"][size]["median"]
            for k, r in rows.items()
            if size in r["ms"] and r["status"] == "ok"
        }
        peers = {k: v for k, v in have.items() if not rows[k]["mpexec"] and k != "inline"}
        best[size] = min(peers, key=lambda k: peers[k], default=None)
        for k, v in have.items():
            st = rows[k]["ms"][size]
            st["vs_inline"] = v / have["inline"] if "inline" in have else None
            b = best[size]
            st["best_peer_over_this"] = peers[b] / v if b else None
    return {"by_system": rows, "best_peer": best, "sizes": list(sizes), "dtype": "float32"}


# ============================================================ targets
#: What a step of :func:`evaluate` records a target with (see ``_Targets.add``).
_Add = Callable[[str, float | None, str, float, str, str], None]


class _Targets:
    """The targets' verdicts, in the order they are added."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(
        self, what: str, value: float | None, op: str, want: float, unit: str, note: str
    ) -> None:
        ok = value is not None and (value >= want if op == ">=" else value <= want)
        self.rows.append(
            {
                "target": what,
                "value": value,
                "op": op,
                "threshold": want,
                "unit": unit,
                "pass": ok,
                "note": note,
            }
        )


def evaluate(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each workload's targets against what ``res`` measured (one step per workload)."""
    targets = _Targets()
    for step in (
        _augment_targets,
        _augment4_targets,
        _light_targets,
        _loader_targets,
        _overhead_targets,
        _transfer_targets,
    ):
        step(res, targets.add)
    return targets.rows


def _augment_targets(res: dict[str, Any], add: _Add) -> None:
    """Workload 1: the augment pipeline and pool against serial, the peers, their memory."""
    aug = res.get("augment")
    if aug:
        rows = aug["by_system"]
        best = aug["best_peer"]
        for key in ("mpexec_pipeline", "mpexec_pool"):
            r = rows.get(key, {})
            label = r.get("label", key)
            add(
                f"1 augment: {label} / serial ({WORKERS} workers)",
                r.get("vs_serial"),
                ">=",
                TARGET_AUG_VS_SERIAL,
                "x",
                r.get("why", "") if r.get("status") != "ok" else "",
            )
            add(
                f"1 augment: {label} / best peer",
                r.get("vs_best_peer"),
                ">=",
                TARGET_AUG_VS_PEERS,
                "x",
                f"best peer: {rows[best]['label']}" if best else "no peer measured",
            )
            low = aug.get("lowest_memory_peer")
            note = f"best peer (fastest): {rows[best]['label']}" if best else "no peer measured"
            if low and r.get("peak_pss"):
                note += (
                    f"; vs the smallest, {rows[low]['label']}: "
                    f"{r['peak_pss'] / rows[low]['peak_pss']:.2f}x"
                )
            add(
                f"memory: {label} peak PSS / best peer's",
                r.get("pss_vs_best_peer"),
                "<=",
                TARGET_MEMORY_VS_PEER,
                "x",
                note,
            )


def _augment4_targets(res: dict[str, Any], add: _Add) -> None:
    """Workload 1b (3-4 ms a sample): against DALI, the pool against the pipeline, faults."""
    a4 = res.get("augment4")
    if a4:
        rows = a4["by_system"]

        def rate(key: str) -> float | None:
            return rows.get(key, {}).get("images_per_s", {}).get("median")  # type: ignore[no-any-return]

        pipe, dali, pool = rate("mpexec_pipeline"), rate("dali_parallel"), rate("mpexec_pool")
        add(
            "1b augment (3-4 ms): mpexec pipeline / DALI parallel external_source",
            pipe / dali if pipe and dali else None,
            ">=",
            TARGET_AUG4_VS_DALI,
            "x",
            "" if dali else "DALI not measured",
        )
        add(
            "1b augment (3-4 ms): WorkerPool.map / mpexec pipeline",
            pool / pipe if pool and pipe else None,
            ">=",
            TARGET_POOL_VS_PIPELINE,
            "x",
            "",
        )
        for key in ("mpexec_pipeline", "mpexec_pool"):
            if key not in rows:
                continue  # not in this run's --systems
            add(
                f"1b augment: {rows.get(key, {}).get('label', key)}, workers' minor faults"
                " a sample",
                rows.get(key, {}).get("faults_per_sample", {}).get("median"),
                "<=",
                TARGET_WORKER_FAULTS,
                " faults",
                "the function alone, warmed, in a loop: 0",
            )


def _light_targets(res: dict[str, Any], add: _Add) -> None:
    """Workload 6 (light samples): against PyTorch, batch mode against per sample."""
    lt = res.get("light")
    if lt:
        rows = lt["by_system"]
        torch_rate = rows.get("torch", {}).get("images_per_s", {}).get("median")
        for key, want in (
            ("mpexec_pipeline", TARGET_LIGHT_VS_TORCH),
            ("mpexec_pipeline_batch", TARGET_LIGHT_BATCH_VS_TORCH),
        ):
            r = rows.get(key, {})
            rate = r.get("images_per_s", {}).get("median")
            add(
                f"6 light: {r.get('label', key)} / PyTorch DataLoader (samples/s)",
                rate / torch_rate if rate and torch_rate else None,
                ">=",
                want,
                "x",
                "" if torch_rate else "PyTorch not measured",
            )
        per_sample = rows.get("mpexec_pipeline", {}).get("images_per_s", {}).get("median")
        batch = rows.get("mpexec_pipeline_batch", {}).get("images_per_s", {}).get("median")
        add(
            "6 light: mpexec pipeline, batch mode / per sample",
            batch / per_sample if batch and per_sample else None,
            ">=",
            TARGET_BATCH_VS_PER_SAMPLE,
            "x",
            "",
        )


def _loader_targets(res: dict[str, Any], add: _Add) -> None:
    """Workloads 1 and 2: mpexec.torch.DataLoader against PyTorch's (speed, memory)."""
    for name, number in (("augment", 1), ("jpeg", 2)):
        section = res.get(name)
        if not section or "skipped" in section:  # workload 2 without Pillow
            continue
        rows = section["by_system"]
        warm = rows.get("mpexec_torch_warm", {}).get("images_per_s", {}).get("median")
        base = rows.get("torch", {}).get("images_per_s", {}).get("median")
        if "mpexec_torch_warm" in rows:
            add(
                f"{number} {name}: mpexec.torch.DataLoader, warm_batches / PyTorch DataLoader",
                warm / base if warm and base else None,
                ">=",
                TARGET_TORCH_LOADER,
                "x",
                rows["mpexec_torch_warm"].get("why", ""),
            )
        if "mpexec_torch" not in rows:
            continue  # not in this run's --systems
        ours, torch = rows.get("mpexec_torch", {}), rows.get("torch", {})
        rate = ours.get("images_per_s", {}).get("median")
        base = torch.get("images_per_s", {}).get("median")
        note = ours.get("why", "") or torch.get("why", "")
        add(
            f"{number} {name}: mpexec.torch.DataLoader / PyTorch DataLoader ({WORKERS} workers)",
            rate / base if rate and base else None,
            ">=",
            TARGET_TORCH_LOADER,
            "x",
            note,
        )
        pss, base_pss = ours.get("peak_pss"), torch.get("peak_pss")
        add(
            f"{number} {name}: mpexec.torch.DataLoader peak PSS / PyTorch DataLoader's",
            pss / base_pss if pss and base_pss else None,
            "<=",
            TARGET_TORCH_LOADER_PSS,
            "x",
            note,
        )


def _overhead_targets(res: dict[str, Any], add: _Add) -> None:
    """Workload 3: a call's round trip, against the best multi-process peer."""
    ov = res.get("overhead")
    if ov:
        r = ov["by_system"].get("mpexec_pool", {})
        best = ov["best_peer"]
        add(
            "3 overhead: mpexec WorkerPool.submit round trip, median",
            r.get("us", {}).get("median"),
            "<=",
            TARGET_CALL_US,
            "us",
            "",
        )
        add(
            "3 overhead: best multi-process peer / mpexec",
            r.get("best_peer_over_this"),
            ">=",
            TARGET_CALL_VS_PEER,
            "x",
            f"best: {ov['by_system'][best]['label']}" if best else "no peer measured",
        )


def _transfer_targets(res: dict[str, Any], add: _Add) -> None:
    """Workload 4: moving arrays, against the peers and flat in size."""
    tr = res.get("transfer")
    if tr:
        rows = tr["by_system"]
        at = str(64 * MiB)
        if at in tr["best_peer"]:
            a = rows.get("mpexec_pool", {}).get("ms", {}).get(at, {})
            b = rows.get("mpexec_put", {}).get("ms", {}).get(at, {})
            best = tr["best_peer"][at]
            note = f"best: {rows[best]['label']}" if best else "no peer measured"
            if b.get("best_peer_over_this"):
                note += f"; with the input put: {b['best_peer_over_this']:.2f}x"
            add(
                "4 transfer 64 MiB: best peer / mpexec (plain ndarray in)",
                a.get("best_peer_over_this"),
                ">=",
                TARGET_TRANSFER_VS_PEER,
                "x",
                note,
            )
        largest = str(max(tr["sizes"]))
        b = rows.get("mpexec_put", {}).get("ms", {}).get(largest, {})
        add(
            f"4 transfer flat in size: mpexec (put) / inline at {fmt_size(int(largest))}",
            b.get("vs_inline"),
            "<=",
            TARGET_TRANSFER_FLAT,
            "x",
            "the call costs what x + 1 costs: no copies",
        )


# ============================================================ report
IDIOMS = """\
How each system runs (`benchmarks/_peers.py`; the functions are `benchmarks/_workloads.py`):

- mpexec pipeline: `fn.external_source(source=..., batch=False, num_outputs=2)` gives
  (image, index) in the workers, `fn.python_function(image, index, function=augment)`
  augments; `Batch.as_array()`. mpexec WorkerPool: `map(process_sample, range(N))`.
- PyTorch: `DataLoader(map-style data set, batch_size=64, num_workers=w,
  persistent_workers=True)`, default collation. tf.data: `Dataset.range(N).map(
  numpy_function(process_sample), num_parallel_calls=w, deterministic=True).batch(64)`.
- DALI `fn.python_function`: a per-sample `external_source`, then `python_function`, both
  in the main process (`exec_async=False, exec_pipelined=False`, CPU only). DALI parallel
  `external_source`: the whole sample in `py_num_workers=w` workers (fork).
- Grain: `MapDataset.source(...).map(augment).batch(64).to_iter_dataset().mp_prefetch(
  num_workers=w)`; each epoch's iterator starts its workers.
- `multiprocessing.Pool(w).imap`, loky's reusable executor `map`, `ThreadPoolExecutor(w)
  .map` over `process_sample`: the batches are stacked in the main process. Start
  methods are each library's default.
- Workload 2: each system as in workload 1, with a JPEG's bytes (1-D uint8) where the
  image was: sources and data sets give (bytes, index) and the op is `decode_augment`
  (Pillow, then `augment`); map-style systems run `jpeg_sample`. DALI too: its own
  `fn.decoders.image` decodes and resizes otherwise than Pillow, and every system's
  values must equal the serial ones.
- Workload 4: DALI runs `x + 1` in the main process (`feed_input`, `python_function`): no
  process boundary. Grain has no call-with-an-array API: each call iterates a one-element
  data set through one worker, whose start it includes.
- Every batch of every system must equal the serial one (per-sample randomness comes
  from the sample index only), or the system is reported as failed."""


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, padded so that it reads in a terminal too."""
    cells = [headers, *rows]
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"

    return "\n".join(
        [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
        + [line(r) for r in rows]
    )


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def _mib(b: int | None) -> str:
    return "" if not b else f"{b / MiB:.0f}"


def _status_row(r: dict[str, Any], width: int) -> list[str]:
    why = r["why"].strip().splitlines()
    text = r["why"] if r["status"] == "skipped" else f"failed: {why[-1] if why else '?'}"
    return [r["label"], text[:160]] + [""] * (width - 2)


def throughput_md(
    aug: dict[str, Any],
    cfg: Config,
    heading: str,
    what: str,
    batch_size: int = wl.BATCH_SIZE,
    unit: str = "images",
) -> str:
    """The table of workload 1, 2 or 6: images (samples)/s, ratios, and memory."""
    rows = []
    headers = [
        "system",
        f"{unit}/s (median)",
        "min - max",
        "vs serial",
        "vs best peer",
        "peak PSS MiB",
        "PSS vs best peer",
        "start",
        "set-up s",
        "faults a sample",
    ]
    for r in sorted(
        aug["by_system"].values(),
        key=lambda r: -r.get("images_per_s", {}).get("median", -1.0),
    ):
        if "images_per_s" not in r:
            rows.append(_status_row(r, len(headers)))
            continue
        st = r["images_per_s"]
        rows.append(
            [
                r["label"],
                f"{st['median']:,.1f}",
                f"{st['min']:,.1f} - {st['max']:,.1f}",
                _x(r["vs_serial"]),
                _x(r["vs_best_peer"]),
                _mib(r["peak_pss"]),
                _x(r["pss_vs_best_peer"]),
                r["start_method"],
                "" if r["setup_s"] is None else f"{r['setup_s']:.1f}",
                f"{r['faults_per_sample']['median']:.1f}" if r.get("faults_per_sample") else "",
            ]
        )
    best = aug["best_peer"]
    serial = aug["by_system"].get("serial", {}).get("images_per_s", {}).get("median")
    per_image = (
        f"{1e6 / serial:.1f} us {'an image' if unit == 'images' else 'a sample'} serially"
        if serial
        else "serial not measured"
    )
    return (
        f"### {heading} ({what}, batches of {batch_size}, {WORKERS} workers)\n\n"
        f"{per_image.capitalize()}. "
        f"Every system's batches were compared with the serial ones before timing (all "
        f"equal, or the system is marked failed); {cfg.aug_rounds} interleaved epochs each. "
        f"Best peer: {aug['by_system'][best]['label'] if best else 'none measured'}. "
        "Peak PSS: all processes of the system, sampled while it verified alone. "
        "Faults a sample: the minor page faults of the processes the system started "
        "(of the benchmark's own process for the serial row, stacking batches included) "
        "over a timed epoch, per sample, median of the epochs.\n\n" + md_table(headers, rows)
    )


def augment_md(aug: dict[str, Any], cfg: Config) -> str:
    what = f"{cfg.images} images of 256x256x3 uint8 -> 224x224x3 float32"
    return throughput_md(aug, cfg, "1. Augmentation", what)


def jpeg_md(jp: dict[str, Any], cfg: Config) -> str:
    heading = "2. JPEG decoding and augmentation"
    if "skipped" in jp:
        why = jp["skipped"]
        return f"### {heading}\n\n{why[:1].upper()}{why[1:]}."
    d = jp["dataset"]
    what = (
        f"{cfg.images} samples of {d['files']} JPEGs made of {d['source']}: "
        f"{'/'.join(map(str, d['sizes']))} px squares at quality {d['quality']}, "
        f"{d['mean_bytes'] / KiB:.0f} KiB on average; Pillow {d['pillow']}"
        + (f" (libjpeg-turbo {d['libjpeg_turbo']})" if d["libjpeg_turbo"] else "")
        + " decodes to 256x256x3 uint8, workload 1 augments -> 224x224x3 float32"
    )
    return throughput_md(jp, cfg, heading, what)


def augment4_md(aug: dict[str, Any], cfg: Config) -> str:
    what = (
        f"{cfg.images} images of 256x256x3 uint8 -> 224x224x3 float32, "
        "workload 1 with a noise value per 4 pixels"
    )
    return throughput_md(aug, cfg, "1b. Augmentation at 3-4 ms a sample", what)


def light_md(lt: dict[str, Any], cfg: Config) -> str:
    what = f"{cfg.images} samples of 16 float32, x + 1"
    return throughput_md(lt, cfg, "6. Light ops", what, wl.LIGHT_BATCH, "samples")


def overhead_md(ov: dict[str, Any], cfg: Config) -> str:
    headers = ["system", "median", "p10 - p90", "vs inline", "best peer / this", "start", "n"]
    rows = []
    for r in ov["by_system"].values():
        if "us" not in r:
            rows.append(_status_row(r, len(headers)))
            continue
        st = r["us"]
        rows.append(
            [
                r["label"],
                fmt_time(st["median"]),
                f"{fmt_time(st['p10'])} - {fmt_time(st['p90'])}",
                _x(r["vs_inline"]),
                _x(r["best_peer_over_this"]),
                r["start_method"],
                str(st["samples"]),
            ]
        )
    return (
        f"### 3. Per-call overhead (echo of {ov['payload']}, one call at a time, each timed; "
        f"{cfg.call_rounds} interleaved rounds)\n\n"
        "best peer / this > 1.00x: this is faster than the fastest multi-process peer.\n\n"
        + md_table(headers, rows)
    )


def _ms(ms: float) -> str:
    return fmt_time(ms * 1e3)


def transfer_md(tr: dict[str, Any]) -> str:
    sizes = [str(s) for s in tr["sizes"]]
    headers = ["system", *(fmt_size(int(s)) for s in sizes)]
    rows, ratio_rows = [], []
    for key, r in tr["by_system"].items():
        if r["status"] != "ok" or not r["ms"]:
            rows.append(_status_row(r, len(headers) + 1))
            continue
        cells, ratios = [r["label"]], [r["label"]]
        for s in sizes:
            st = r["ms"].get(s)
            if st is None:
                cells.append("")
                ratios.append("")
                continue
            cells.append(f"{_ms(st['median'])} ({_ms(st['min'])} - {_ms(st['max'])})")
            ratios.append(f"{_x(st['vs_inline'])} / {_x(st['best_peer_over_this'])}")
        rows.append([*cells, _mib(r["peak_pss"])])
        if key != "inline":
            ratio_rows.append(ratios)
    return (
        "### 4. Transfer (x + 1 of one float32 array, answered with one of the same size; "
        "one call at a time)\n\n"
        "Median time per call (min - max); every answer checked (in full before timing, "
        "then on probes). Peak PSS: all processes of the system, while it verified every "
        "size alone.\n\n"
        + md_table([*headers, "peak PSS MiB"], rows)
        + "\n\nRatios per size: time / inline (the work itself), then best peer's time / "
        "this (> 1.00x: faster than the fastest peer at that size).\n\n"
        + md_table(headers, ratio_rows)
    )


def scaling_md(sc: dict[str, Any], serial: float | None) -> str:
    counts = [str(w) for w in sc["workers"]]
    headers = ["system", *(f"{w} worker{'s' if w != '1' else ''}" for w in counts)]
    rows = []
    for curve in sc["systems"].values():
        cells = [curve["label"]]
        for w in counts:
            pt = curve["by_workers"].get(w, {})
            if pt.get("status") != "ok":
                cells.append(pt.get("status", ""))
                continue
            m = pt["images_per_s"]["median"]
            cells.append(f"{m:.1f}" + (f" ({m / serial:.2f}x)" if serial else ""))
        rows.append(cells)
    return "### 5. Scaling (workload 1: images/s, median, and the ratio to serial)\n\n" + (
        md_table(headers, rows) if rows else "no system to scale (none measured)"
    )


def report(res: dict[str, Any], cfg: Config) -> str:
    env = res["environment"]
    v = env["versions"]
    parts = [
        f"## peers benchmark{' (quick run)' if cfg.quick else ''}",
        f"{env['cpu_model']}, {env['cpus']} CPUs ({env['cpus_usable']} usable), "
        f"{env['memory_gib']} GiB; {env['os']}; Python {v['python']} "
        f"({env['implementation']}); numpy {v['numpy']}; mpexec {v['mpexec']}; "
        + "; ".join(
            f"{m}: {v[m] or 'not installed'}"
            for m in ("torch", "tensorflow", "grain", "loky", "joblib", "nvidia.dali")
        )
        + f". Load average at start {[round(x, 2) for x in env['loadavg_at_start'] or []]}.",
    ]
    busy = {k: s for k, s in res["machine_load"].items() if (s["other_share"] or 0) > 0.1}
    if busy:
        parts.append(
            "**The machine was busy**: other processes used "
            + ", ".join(f"{100 * s['other_share']:.0f}% during {k}" for k, s in busy.items())
            + " of the machine's CPU time: absolute figures, and speed-ups, are unreliable."
        )
    if res.get("augment"):
        parts.append(augment_md(res["augment"], cfg))
    if res.get("augment4"):
        parts.append(augment4_md(res["augment4"], cfg))
    if res.get("jpeg"):
        parts.append(jpeg_md(res["jpeg"], jpeg_config(cfg)))
    if res.get("light"):
        parts.append(light_md(res["light"], light_config(cfg)))
    if res.get("overhead"):
        parts.append(overhead_md(res["overhead"], cfg))
    if res.get("transfer"):
        parts.append(transfer_md(res["transfer"]))
    if res.get("scaling"):
        serial = (
            res.get("augment", {})
            .get("by_system", {})
            .get("serial", {})
            .get("images_per_s", {})
            .get("median")
        )
        parts.append(scaling_md(res["scaling"], serial))
    parts.append("```text\n" + targets_text(res["targets"]) + "\n```")
    if res.get("transfer") and str(64 * MiB) not in res["transfer"]["best_peer"]:
        parts.append(
            "The 64 MiB transfer target is not checked: this run stopped at "
            f"{fmt_size(max(res['transfer']['sizes']))}."
        )
    parts.append(IDIOMS)
    if res["plots"]:
        parts.append("Plots: " + ", ".join(f"[{p}]({p})" for p in res["plots"]))
    elif res["plots_note"]:
        parts.append(f"Plots: {res['plots_note']}")
    parts.extend(
        f"{kind}:\n\n" + "\n".join(f"- {p}" for p in res[kind])
        for kind in ("problems", "errors")
        if res[kind]
    )
    parts.append(f"Took {res['duration_s']} s.")
    return "\n\n".join(parts) + "\n"


# ============================================================ plots
def plots(res: dict[str, Any], out_dir: Path, suffix: str) -> tuple[list[str], str]:
    """PNG plots with matplotlib, where it is installed: (file names, or why none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return [], f"skipped (matplotlib not installed: {type(exc).__name__}: {exc})"
    names: list[str] = []
    aug = res.get("augment")
    for key, title, name in (
        ("augment", "Workload 1: augmentation", "peers-throughput"),
        ("jpeg", "Workload 2: JPEG decoding and augmentation", "peers-jpeg"),
    ):
        ok = [r for r in res.get(key, {}).get("by_system", {}).values() if "images_per_s" in r]
        ok.sort(key=lambda r: r["images_per_s"]["median"])
        if ok:
            fig, ax = plt.subplots(figsize=(8, 0.45 * len(ok) + 1.5))
            med = [r["images_per_s"]["median"] for r in ok]
            lo = [m - r["images_per_s"]["min"] for m, r in zip(med, ok, strict=True)]
            hi = [r["images_per_s"]["max"] - m for m, r in zip(med, ok, strict=True)]
            colors = ["tab:orange" if r["mpexec"] else "tab:blue" for r in ok]
            ax.barh([r["label"] for r in ok], med, xerr=[lo, hi], color=colors)
            serial = res[key]["by_system"].get("serial", {}).get("images_per_s", {}).get("median")
            if serial:
                ax.axvline(serial, color="gray", linestyle=":", label="serial")
                ax.axvline(serial * WORKERS, color="gray", linestyle="--", label="serial x workers")
                ax.legend(fontsize=8, loc="lower right")
            ax.set_xlabel("images/s (median, min-max)")
            ax.set_title(f"{title}, {WORKERS} workers")
            fig.tight_layout()
            names.append(_save(fig, out_dir, f"{name}{suffix}.png"))
            plt.close(fig)
    tr = res.get("transfer")
    if tr:
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in tr["by_system"].values():
            pts = sorted((int(s), st["median"]) for s, st in r["ms"].items())
            if pts and r["status"] == "ok":
                style = "-o" if r["mpexec"] else ("--" if r["key"] == "inline" else "-s")
                ax.loglog(*zip(*pts, strict=True), style, label=r["label"], markersize=4)
        ax.set_xlabel("array size (bytes)")
        ax.set_ylabel("time per call (ms, median)")
        ax.set_title("Workload 4: one array in, one out")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        names.append(_save(fig, out_dir, f"peers-transfer{suffix}.png"))
        plt.close(fig)
    sc = res.get("scaling")
    if sc and sc["systems"]:
        fig, ax = plt.subplots(figsize=(7, 5))
        for curve in sc["systems"].values():
            pts = [
                (int(w), p["images_per_s"]["median"])
                for w, p in curve["by_workers"].items()
                if p.get("status") == "ok"
            ]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), "-o", label=curve["label"])
        serial = (
            (aug or {}).get("by_system", {}).get("serial", {}).get("images_per_s", {}).get("median")
        )
        if serial:
            ws = sc["workers"]
            ax.plot(ws, [serial * w for w in ws], ":", color="gray", label="linear from serial")
        ax.set_xticks(sc["workers"])
        ax.set_xlabel("workers")
        ax.set_ylabel("images/s (median)")
        ax.set_title("Workload 5: scaling")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        names.append(_save(fig, out_dir, f"peers-scaling{suffix}.png"))
        plt.close(fig)
    return names, ""


def _save(fig: Any, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=110)
    return name


# ============================================================ entry points
def run(
    quick: bool = False,
    out_dir: Path = RESULTS,
    workloads: tuple[str, ...] | None = None,
    systems: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """Run the benchmark, print its report, write ``peers.json``, ``peers.md`` and plots."""
    cfg = QUICK if quick else FULL
    if workloads:
        cfg = Config(**{**asdict(cfg), "workloads": tuple(workloads)})
    if systems:
        cfg = Config(**{**asdict(cfg), "systems": tuple(systems)})
    t0 = time.monotonic()
    errors: list[str] = []
    problems: list[str] = []
    load: dict[str, Any] = {}
    env = environment()
    res: dict[str, Any] = {
        "benchmark": NAME,
        "quick": quick,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": env,
        "config": asdict(cfg),
    }
    augment: list[Entry] = []
    ref = None
    if "augment" in cfg.workloads:
        ref = reference(cfg)
        res["reference"] = ref
    if "augment" in cfg.workloads:
        with section("augment", errors, load):
            augment = bench_augment(cfg, ref or {}, WORKERS, problems)
            res["augment"] = summarize_augment(augment)
    if "augment4" in cfg.workloads:
        with section("augment4", errors, load):
            res["augment4"] = bench_augment4(cfg, problems)
    if "jpeg" in cfg.workloads:
        with section("jpeg", errors, load):
            res["jpeg"] = bench_jpeg(cfg, problems)
    if "light" in cfg.workloads:
        with section("light", errors, load):
            res["light"] = bench_light(cfg, problems)
    if "overhead" in cfg.workloads:
        with section("overhead", errors, load):
            res["overhead"] = summarize_overhead(bench_overhead(cfg, problems))
    if "transfer" in cfg.workloads:
        with section("transfer", errors, load):
            res["transfer"] = summarize_transfer(bench_transfer(cfg, problems), cfg.sizes)
    if "scaling" in cfg.workloads and augment:
        with section("scaling", errors, load):
            res["scaling"] = bench_scaling(cfg, ref or {}, augment, usable_cpus(), problems)
    elif "scaling" in cfg.workloads:
        problems.append("scaling not run: it scales the systems of workload 1 (augment)")
    res["targets"] = evaluate(res)
    res["machine_load"] = load
    res["problems"] = problems
    res["errors"] = errors
    env["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if quick else ""
    res["plots"], res["plots_note"] = plots(res, out_dir, suffix)
    res["duration_s"] = round(time.monotonic() - t0, 1)
    text = report(res, cfg)
    print(text, flush=True)
    write_results(res, text, out_dir, suffix, cfg)
    return res


def write_results(res: dict[str, Any], text: str, out_dir: Path, suffix: str, cfg: Config) -> None:
    stem = f"{NAME}{suffix}"
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(
        f"# peers benchmark{' (quick run)' if cfg.quick else ''}\n\n"
        f"Written by `python -m benchmarks peers{' --quick' if cfg.quick else ''}` on "
        f"{res['date_utc']}; numbers and settings in [{stem}.json]({stem}.json). Ratios "
        "compare systems measured side by side in the same run.\n\n" + text
    )
    log(f"[{NAME}] wrote {stem}.json and {stem}.md in {out_dir}")
    full = not cfg.quick and set(cfg.workloads) == set(FULL.workloads) and not cfg.systems
    if full:
        target = (out_dir.parent if out_dir == RESULTS else out_dir) / "RESULTS.md"
        rel = os.path.relpath(out_dir, target.parent)
        pics = "\n".join(f"![{p}]({rel}/{p})" for p in res["plots"])
        target.write_text(
            "# mpexec against its peers: latest full run\n\n"
            f"Written by `python -m benchmarks peers` on {res['date_utc']} (git "
            f"{res['environment']['git_commit']}"
            f"{', with uncommitted changes' if res['environment']['git_dirty'] else ''}); "
            f"every number is in [{rel}/{stem}.json]({rel}/{stem}.json). Install the peers "
            "with `tox -e bench` (or `pip install -e .[bench]`), then run it again to "
            "reproduce; `python -m benchmarks peers --quick` for a smoke test. Only the "
            "ratios travel between machines.\n\n"
            + text.replace("](peers", f"]({rel}/peers")
            + ("\n" + pics + "\n" if pics else "")
        )
        log(f"[{NAME}] wrote {target}")


def _names(choices: list[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x for x in text.split(",") if x)
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}"
            )
        return names

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The peers benchmark's own options (``python -m benchmarks`` has them too)."""
    systems = sorted({s.key for systems in _peers.CATALOGUE.values() for s in systems})
    parser.add_argument(
        "--workloads",
        type=_names(list(FULL.workloads)),
        default=None,
        help=f"peers only: a comma-separated subset of {','.join(FULL.workloads)}",
    )
    parser.add_argument(
        "--systems",
        type=_names(systems),
        default=None,
        help=f"peers only: a comma-separated subset of {','.join(systems)} "
        "(serial and inline always run)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers_bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    res = run(args.quick, args.out, args.workloads, args.systems)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
