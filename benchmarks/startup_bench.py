"""Start-up: how long until the first result, for a pool, a pipeline and a DataLoader.

Every figure comes from a fresh interpreter (``python -c``), so that imports,
fork servers and first mappings are paid as a user's script pays them; the
probes take turns, round after round (the one going first rotating), and
each system's median and spread are reported with the ratio to its peer
measured in the same rounds.

pool
    ``import mpexec`` and the loading of ``mpexec.WorkerPool`` (which
    ``import mpexec`` defers to first use); then ``WorkerPool(2)`` until both workers answered,
    plus its first round trip (``submit(echo).result()``); then a second and
    a third pool in the same process ("later pools": what a test suite or a
    notebook pays again). For each start method: fork, forkserver, spawn.
    ``concurrent.futures.ProcessPoolExecutor(2)`` is the peer (its workers
    start lazily: its first round trip includes them).

pipeline
    A two-op pipeline (per-sample ``external_source``, ``python_function``) of
    light samples: from ``pipeline_def`` to the first batch (build, workers,
    first iteration), and the second batch.

dataloader
    ``mpexec.torch.DataLoader`` and ``torch.utils.data.DataLoader`` with the
    same map-style data set (light samples: the start is what is measured),
    ``num_workers=2``, not persistent: the time from ``iter(loader)`` to the
    first batch, for each of three epochs (each epoch starts its workers
    anew, in both). Needs torch; skipped without it.

at scale (``SCALE_WORKERS``, 64)
    ``WorkerPool(64)``, a 64-worker pipeline, ``mpexec.torch.DataLoader`` and
    torch's ``DataLoader`` with 64 workers (the host's default start method
    for ours, torch's own default, fork, for torch's): the time to the first
    result (pool: started and answered; pipeline: from ``pipeline_def`` to the
    first batch; loaders: ``iter`` to the first batch), then, with the workers
    idle, each worker's PSS and USS (what the worker alone holds), the fds
    each worker has open (mean and the largest: a count that grows with the
    worker's index means each worker holds something of every earlier one,
    O(W^2) in all), the main process's fds and the PSS of the whole tree
    (main, workers, fork server). Also ``WorkerPool(64)`` under ``fork``.

Run with ``python -m benchmarks startup`` (``--quick``: fewer rounds).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, cli, fmt_time, log, stamp, table, write

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("fork", "forkserver", "spawn")
PROBE_TIMEOUT = 120.0

# Each probe prints one JSON line: name -> seconds. They run in a fresh
# interpreter whose working directory is the checkout (so ``benchmarks`` imports).
_POOL_PROBE = """
import time
t0 = time.perf_counter()
import mpexec
mpexec.WorkerPool  # its modules load on first use: part of the import here
t_import = time.perf_counter() - t0
from benchmarks._workloads import echo
out = {"import mpexec": t_import}
for i in range(3):
    t0 = time.perf_counter()
    pool = mpexec.WorkerPool(2, start_method=METHOD)
    t_up = time.perf_counter() - t0
    pool.submit(echo, 1).result(60)
    t_first = time.perf_counter() - t0
    pool.shutdown()
    label = "first pool" if i == 0 else "later pool"
    out.setdefault(label + ": started", []).append(t_up)
    out.setdefault(label + ": first result", []).append(t_first)
print("RESULT " + json.dumps({k: min(v) if isinstance(v, list) else v for k, v in out.items()}))
"""

_PPE_PROBE = """
import time, multiprocessing
from concurrent.futures import ProcessPoolExecutor
from benchmarks._workloads import echo
out = {}
for i in range(3):
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(METHOD))
    pool.submit(echo, 1).result(60)
    t_first = time.perf_counter() - t0
    pool.shutdown()
    label = "first pool" if i == 0 else "later pool"
    out.setdefault(label + ": first result", []).append(t_first)
print("RESULT " + json.dumps({k: min(v) for k, v in out.items()}))
"""

_PIPELINE_PROBE = """
import time
t0 = time.perf_counter()
import mpexec
from mpexec import fn
from benchmarks import _workloads as wl

@mpexec.pipeline_def(batch_size=wl.LIGHT_BATCH, num_workers=2, seed=1, start_method=METHOD)
def light():
    x, i = fn.external_source(source=lambda info: wl.light_load(info.idx_in_epoch),
                              batch=False, num_outputs=2)
    return fn.python_function(x, i, function=wl.light_transform)

with light() as pipe:
    pipe.run()
    t_first = time.perf_counter() - t0
    t1 = time.perf_counter()
    pipe.run()
    t_second = time.perf_counter() - t1
print("RESULT " + json.dumps({"first batch (import included)": t_first,
                              "second batch": t_second}))
"""

_LOADER_PROBE = """
import time
import torch
import torch.utils.data as tud
from benchmarks import _workloads as wl

class Light(tud.Dataset):
    def __len__(self):
        return 16 * wl.LIGHT_BATCH
    def __getitem__(self, i):
        return torch.from_numpy(wl.light_load(i)[0])

if SYSTEM == "mpexec":
    from mpexec.torch import DataLoader
else:
    DataLoader = tud.DataLoader
loader = DataLoader(Light(), batch_size=wl.LIGHT_BATCH, num_workers=2)
out = {}
for epoch in range(3):
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    out[f"epoch {epoch}: first batch"] = time.perf_counter() - t0
    for _ in it:
        pass
    del it
print("RESULT " + json.dumps(out))
"""


_SCALE_PROBE = """
import os, time, psutil
WORKERS = int(WORKERS)

def tree():
    me = psutil.Process()
    kids = me.children(recursive=True)
    parents = {p.ppid() for p in kids}
    # Workers: the leaves (a fork server or a resource tracker has children, or is
    # not a worker: both are counted in the tree's total, not per worker).
    # (A forked worker's command line is its parent's: a fork server's, or this one's.)
    helper = lambda p: p.cmdline()[-1:] and p.cmdline()[-1].startswith(
        "from multiprocessing.resource_tracker"
    )
    workers = [p for p in kids if p.pid not in parents and not helper(p)]
    return me, kids, workers

def measure(t_first):
    me, kids, workers = tree()
    info = {p.pid: p.memory_full_info() for p in [me, *kids]}
    fds = [p.num_fds() for p in workers]
    n = max(len(workers), 1)
    return {
        "first result": t_first,
        "workers": len(workers),
        "PSS per worker": sum(info[p.pid].pss for p in workers) / n,
        "USS per worker": sum(info[p.pid].uss for p in workers) / n,
        "fds per worker": sum(fds) / n,
        "fds per worker, largest": max(fds, default=0),
        "main fds": me.num_fds(),
        "PSS of the tree": sum(m.pss for m in info.values()),
    }

def settle():
    time.sleep(0.5)  # a benchmark, not a test: let the workers go idle

import mpexec
from benchmarks import _workloads as wl
if SYSTEM == "pool":
    t0 = time.perf_counter()
    pool = mpexec.WorkerPool(WORKERS, start_method=METHOD or None)
    pool.submit(wl.echo, 1).result(120)
    t = time.perf_counter() - t0
    settle()
    out = measure(t)
    pool.shutdown()
elif SYSTEM == "pipeline":
    from mpexec import fn
    t0 = time.perf_counter()

    @mpexec.pipeline_def(batch_size=wl.LIGHT_BATCH, num_workers=WORKERS, seed=1)
    def light():
        x, i = fn.external_source(source=lambda info: wl.light_load(info.idx_in_epoch),
                                  batch=False, num_outputs=2)
        return fn.python_function(x, i, function=wl.light_transform)

    with light() as pipe:
        pipe.run()
        t = time.perf_counter() - t0
        settle()
        out = measure(t)
else:
    import torch
    import torch.utils.data as tud

    class Light(tud.Dataset):
        def __len__(self):
            return 4 * WORKERS * wl.LIGHT_BATCH
        def __getitem__(self, i):
            return torch.from_numpy(wl.light_load(i)[0])

    if SYSTEM == "mpexec.torch":
        from mpexec.torch import DataLoader
    else:
        DataLoader = tud.DataLoader
    loader = DataLoader(Light(), batch_size=wl.LIGHT_BATCH, num_workers=WORKERS)
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    t = time.perf_counter() - t0
    settle()
    out = measure(t)
    del it
print("RESULT " + json.dumps(out))
"""

#: The worker count of the "at scale" figures.
SCALE_WORKERS = 64


def _scale_probes(quick: bool) -> dict[str, tuple[str, dict[str, str]]]:
    """System label -> (probe code, names) for the "at scale" figures."""
    w = str(SCALE_WORKERS)
    probes = {
        f"WorkerPool({w})": (_SCALE_PROBE, {"SYSTEM": "pool", "WORKERS": w, "METHOD": ""}),
        f"pipeline, {w} workers": (
            _SCALE_PROBE,
            {"SYSTEM": "pipeline", "WORKERS": w, "METHOD": ""},
        ),
    }
    if not quick:
        probes[f"WorkerPool({w}), fork"] = (
            _SCALE_PROBE,
            {"SYSTEM": "pool", "WORKERS": w, "METHOD": "fork"},
        )
    if _have_torch():
        probes[f"mpexec.torch.DataLoader, {w} workers"] = (
            _SCALE_PROBE,
            {"SYSTEM": "mpexec.torch", "WORKERS": w, "METHOD": ""},
        )
        probes[f"torch DataLoader, {w} workers"] = (
            _SCALE_PROBE,
            {"SYSTEM": "torch", "WORKERS": w, "METHOD": ""},
        )
    return probes


def _scale_rows(res: dict[str, dict[str, dict[str, float]]]) -> list[list[str]]:
    mib = 1 << 20
    rows = []
    for name, figs in res.items():
        if "first result" not in figs:
            continue
        t = figs["first result"]

        def med(key: str, scale: float = 1.0, fmt: str = "{:.1f}", figs: Any = figs) -> str:
            return fmt.format(figs[key]["median"] / scale) if key in figs else "-"

        rows.append(
            [
                name,
                (
                    f"{fmt_time(t['median'] * 1e6)} ({fmt_time(t['min'] * 1e6)}-"
                    f"{fmt_time(t['max'] * 1e6)})"
                ),
                med("workers", fmt="{:.0f}"),
                med("PSS per worker", mib),
                med("USS per worker", mib),
                med("fds per worker"),
                med("fds per worker, largest", fmt="{:.0f}"),
                med("main fds", fmt="{:.0f}"),
                med("PSS of the tree", mib, "{:.0f}"),
            ]
        )
    return rows


def _probe(code: str, **names: str) -> dict[str, float]:
    """Run ``code`` in a fresh interpreter with ``names`` bound; its RESULT line."""
    prologue = "import json\n" + "".join(f"{k} = {v!r}\n" for k, v in names.items())
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return {k: float(v) for k, v in json.loads(line[7:]).items()}
    raise RuntimeError(f"probe failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


def _have_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def _probes(quick: bool) -> dict[str, tuple[str, dict[str, str]]]:
    """System label -> (probe code, names it is run with)."""
    methods = ("forkserver",) if quick else METHODS
    probes: dict[str, tuple[str, dict[str, str]]] = {}
    for m in methods:
        probes[f"mpexec WorkerPool ({m})"] = (_POOL_PROBE, {"METHOD": m})
        probes[f"ProcessPoolExecutor ({m})"] = (_PPE_PROBE, {"METHOD": m})
        probes[f"mpexec pipeline ({m})"] = (_PIPELINE_PROBE, {"METHOD": m})
    if _have_torch():
        probes["mpexec.torch.DataLoader"] = (_LOADER_PROBE, {"SYSTEM": "mpexec"})
        probes["torch DataLoader"] = (_LOADER_PROBE, {"SYSTEM": "torch"})
    return probes


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _ratio_rows(res: dict[str, dict[str, dict[str, float]]]) -> list[list[str]]:
    """Ours over the peer's median, for every figure both report."""
    pairs = [(f"mpexec WorkerPool ({m})", f"ProcessPoolExecutor ({m})") for m in METHODS]
    pairs.append(("mpexec.torch.DataLoader", "torch DataLoader"))
    rows = []
    for ours, peer in pairs:
        if ours not in res or peer not in res:
            continue
        for what, s in res[ours].items():
            if what in res[peer]:
                p = res[peer][what]
                rows.append(
                    [
                        ours,
                        what,
                        fmt_time(s["median"] * 1e6),
                        fmt_time(p["median"] * 1e6),
                        f"{s['median'] / p['median']:.2f}x",
                    ]
                )
    return rows


def _rounds(
    probes: dict[str, Any], rounds: int, errors: list[str], done: str
) -> dict[str, dict[str, list[float]]]:
    """Each probe once a round, the order rotated each round; what each measured, in lists."""
    names = list(probes)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            code, bound = probes[name]
            try:
                got = _probe(code, **bound)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                errors.append(f"{name}: {exc}")
                log(f"[startup] {name}: {exc}")
                continue
            for what, value in got.items():
                samples[name].setdefault(what, []).append(value)
        log(f"[startup] {done.format(r=r + 1)}")
    return samples


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    rounds = 2 if quick else 5
    probes = _probes(quick)
    errors: list[str] = []
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    samples = _rounds(probes, rounds, errors, "round {r}/" + f"{rounds} done")
    scale = _scale_probes(quick)
    scale_samples = _rounds(scale, 2 if quick else 3, errors, "at scale: round {r} done")
    res = {n: {w: _summary(v) for w, v in figs.items()} for n, figs in samples.items()}
    scale_res = {n: {w: _summary(v) for w, v in figs.items()} for n, figs in scale_samples.items()}
    result: dict[str, Any] = stamp(quick)
    result["env"].update(
        load_before=load_before,
        load_after=os.getloadavg(),
        seconds=time.perf_counter() - t_start,
    )
    result |= {
        "rounds": rounds,
        "systems": res,
        "at_scale": scale_res,
        "errors": errors,
    }
    rows = [
        [
            name,
            what,
            fmt_time(s["median"] * 1e6),
            fmt_time(s["min"] * 1e6),
            fmt_time(s["max"] * 1e6),
        ]
        for name, figs in res.items()
        for what, s in figs.items()
    ]
    text = (
        f"Start-up, {rounds} rounds, each probe in a fresh interpreter "
        f"(load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after)\n\n"
        + table(["system", "figure", "median", "min", "max"], rows, right={2, 3, 4})
        + "\n\nOurs against the peer (medians of the same rounds)\n\n"
        + table(["ours", "figure", "ours", "peer", "ratio"], _ratio_rows(res), right={2, 3, 4})
        + f"\n\nAt scale: {SCALE_WORKERS} workers, idle after the first result (medians; "
        "MiB; fds: mean over the workers and the largest)\n\n"
        + table(
            [
                "system",
                "first result (min-max)",
                "workers",
                "PSS/worker",
                "USS/worker",
                "fds/worker",
                "largest",
                "main fds",
                "tree PSS",
            ],
            _scale_rows(scale_res),
        )
        + "\n"
        + ("".join(f"\nerror: {e}" for e in errors))
    )
    print(text)
    write("startup", result, text, out_dir, "start-up times of each system")
    return result


def main(argv: list[str] | None = None) -> int:
    return cli("startup_bench", run, argv)


if __name__ == "__main__":
    sys.exit(main())
