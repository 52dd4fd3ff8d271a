"""``mpexec.ray.RayPool`` against the local ``mpexec.WorkerPool``: what going through Ray costs.

Both pools have two workers on this machine: the local pool's, and those of
the one agent a ``RayPool`` starts on a local Ray instance of one node
(``ray.init(num_cpus=2)``). Every figure is taken side by side in one run
(the systems take turns, round after round, the one going first rotating),
so that the ratios hold on a loaded machine where absolute times do not.

round trip
    ``echo(x)`` of 16 float64, and of a 600 KB float32 array (an augmented
    image's size; it goes through Ray's object store both ways), one call at
    a time: submit, wait. Each call is timed on its own; median and p90 per
    system. Besides the two pools, a bare Ray actor that runs the function
    itself (``ray.get(actor.call.remote(fn, x))``): what Ray alone costs. With
    it, the driver's CPU time per call (``time.process_time`` of this process, every thread of it:
    Ray's own threads included), which is what bounds a driver that feeds
    many nodes.

augment
    Workload 1 of ``python -m benchmarks peers`` (a 256x256x3 image made from
    its index, cropped, flipped, jittered and noised in Python, normalised
    to 224x224x3 float32: ~600 KB out per image): ``map`` over N indices for
    serial (here), the local pool and the RayPool, with ``chunksize`` 1 and
    8. Images/s per round, and the driver's CPU time per image; every output
    is compared with the serial one, image by image, in every round.

pipeline
    The same images through a pipeline (a per-sample ``external_source``
    giving (image, index), then ``fn.python_function(augment)``, batch size
    8, prefetch depth 2) run with ``pool=`` the local pool and the RayPool:
    images/s per epoch and the driver's CPU time per image; outputs compared
    with the serial ones.

The model of docs/ray.md (throughput against nodes; where the driver becomes
the bottleneck) is computed from these figures and printed at the end.

Run with ``python -m benchmarks ray`` (``--quick`` for a smoke test); needs
Ray (``pip install -e ".[ray]"``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

import mpexec
from benchmarks import _workloads as wl
from benchmarks._common import RESULTS, cli, closing, fmt_time, log, stamp, table, write

WORKERS = 2
RESULT_TIMEOUT = 120.0  # seconds any one result may take


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min": ordered[0],
        "max": ordered[-1],
        "samples": len(ordered),
    }


def _rotations(systems: list[str], rounds: int) -> Iterator[list[str]]:
    for r in range(rounds):
        k = r % len(systems)
        yield systems[k:] + systems[:k]


class _BareRay:
    """A bare Ray actor that runs the function itself: what Ray alone costs a call."""

    def __init__(self) -> None:
        import ray

        @ray.remote(num_cpus=0)
        class Runner:
            def call(self, fn: Callable[..., Any], *args: Any) -> Any:
                return fn(*args)

        self._ray = ray
        self._actor = Runner.remote()  # type: ignore[attr-defined]

    def submit(self, fn: Callable[..., Any], *args: Any) -> _BareResult:
        return _BareResult(self._ray, self._actor.call.remote(fn, *args))

    def close(self) -> None:
        self._ray.kill(self._actor)


class _BareResult:
    def __init__(self, ray: Any, ref: Any) -> None:
        self._ray, self._ref = ray, ref

    def result(self, timeout: float) -> Any:
        return self._ray.get(self._ref, timeout=timeout)


def round_trip(systems: dict[str, Any], rounds: int, calls: int, x: Any) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    for system in systems.values():  # warm up: functions cached, connections made
        for _ in range(20):
            system.submit(wl.echo, x).result(RESULT_TIMEOUT)
    for order in _rotations(list(systems), rounds):
        for name in order:
            system = systems[name]
            c0 = time.process_time()
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                out = system.submit(wl.echo, x).result(RESULT_TIMEOUT)
                times[name].append((time.perf_counter_ns() - t0) / 1e3)
                del out
            cpu[name].append((time.process_time() - c0) / calls * 1e6)
    out = {
        name: {"us": _stats(times[name]), "driver_cpu_us": _stats(cpu[name])} for name in systems
    }
    base = out["local pool"]["us"]["median"]
    for row in out.values():
        row["vs_local"] = row["us"]["median"] / base
    return out


def augment(
    pools: dict[str, Executor], n: int, rounds: int, chunksizes: tuple[int, ...]
) -> dict[str, Any]:
    reference = [wl.digest(wl.process_sample(i)) for i in range(n)]
    runs: dict[str, Callable[[], list[Any]]] = {
        "serial (here)": lambda: [wl.process_sample(i) for i in range(n)]
    }
    for name, pool in pools.items():
        for cs in chunksizes:
            runs[f"{name}, chunksize {cs}"] = lambda pool=pool, cs=cs: list(
                pool.map(wl.process_sample, range(n), chunksize=cs, timeout=RESULT_TIMEOUT)
            )
    rates: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    identical = dict.fromkeys(runs, True)
    for run in runs.values():  # warm up
        run()
    for order in _rotations(list(runs), rounds):
        for key in order:
            c0, t0 = time.process_time(), time.perf_counter()
            images = runs[key]()
            rates[key].append(n / (time.perf_counter() - t0))
            cpu[key].append((time.process_time() - c0) / n * 1e6)
            identical[key] &= [wl.digest(a) for a in images] == reference
    serial = statistics.median(rates["serial (here)"])
    out: dict[str, Any] = {"serial_images_per_s": serial, "images": n, "by_system": {}}
    for key in runs:
        st = _stats(rates[key])
        out["by_system"][key] = {
            "images_per_s": st,
            "vs_serial": st["median"] / serial,
            "driver_cpu_us_per_image": _stats(cpu[key]),
            "identical": identical[key],
        }
    return out


class _Source:
    """``(image, index)`` of sample ``i`` for ``i < n``: the pipeline's per-sample source."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: mpexec.SampleInfo) -> Any:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return wl.load_sample(info.idx_in_epoch)


def pipeline(pools: dict[str, Executor], n: int, rounds: int) -> dict[str, Any]:
    from mpexec import fn

    reference = [wl.digest(wl.process_sample(i)) for i in range(n)]
    pipes = {}
    for name, pool in pools.items():

        @mpexec.pipeline_def(batch_size=8, seed=1, prefetch_depth=2, pool=pool)
        def graph() -> Any:
            data, index = fn.external_source(source=_Source(n), batch=False, num_outputs=2)
            return fn.python_function(data, index, function=wl.augment)

        pipes[name] = graph()
        pipes[name].build()
    rates: dict[str, list[float]] = {k: [] for k in pipes}
    cpu: dict[str, list[float]] = {k: [] for k in pipes}
    identical = dict.fromkeys(pipes, True)
    try:
        for order in _rotations(list(pipes), rounds + 1):
            for name in order:
                pipe = pipes[name]
                c0, t0 = time.process_time(), time.perf_counter()
                images = [a for (batch,) in pipe for a in batch]
                rates[name].append(n / (time.perf_counter() - t0))
                cpu[name].append((time.process_time() - c0) / n * 1e6)
                pipe.reset()
                identical[name] &= [wl.digest(a) for a in images] == reference
                del images
    finally:
        for pipe in pipes.values():
            pipe.close()
    out: dict[str, Any] = {"images": n, "by_system": {}}
    for name in pipes:
        st = _stats(rates[name][1:])  # the first epoch warms up
        out["by_system"][f"pipeline on {name}"] = {
            "images_per_s": st,
            "driver_cpu_us_per_image": _stats(cpu[name][1:]),
            "identical": identical[name],
        }
    return out


def model(aug: dict[str, Any], pl: dict[str, Any]) -> dict[str, Any]:
    """Throughput against workers from the measured figures (docs/ray.md explains it).

    A worker spends ``w`` CPU seconds per image (the serial run's CPU time);
    the driver spends ``c`` per image, so one driver core dispatches and
    collects at most ``1 / c`` images/s. Throughput with W workers is about
    ``min(W / w, 1 / c)``: the driver is the bottleneck past ``W* = w / c``
    workers. Both are CPU times, so the ratio holds on a loaded machine.
    """
    w_us = aug["by_system"]["serial (here)"]["driver_cpu_us_per_image"]["median"]
    rows = {}
    configs = {k: v for k, v in aug["by_system"].items() if k.startswith("RayPool")}
    configs.update(pl["by_system"])
    for key, row in configs.items():
        c_us = row["driver_cpu_us_per_image"]["median"]
        rows[key] = {
            "driver_cpu_us_per_image": c_us,
            "driver_limit_images_per_s": 1e6 / c_us,
            "workers_at_the_limit": w_us / c_us,
        }
    return {"worker_cpu_us_per_image": w_us, "by_system": rows}


def run(quick: bool = False, out_dir: Path = RESULTS) -> dict[str, Any]:
    try:
        import ray

        from mpexec.ray import RayPool
    except ImportError as exc:
        log(f"[ray] skipped (not installed): {exc}")
        return {"quick": quick, "skipped": str(exc), "errors": []}

    rounds, calls, n = (3, 100, 16) if quick else (7, 300, 64)
    load_before = os.getloadavg()
    result: dict[str, Any] = {
        **stamp(quick, numpy=np.__version__, ray=ray.__version__, mpexec=mpexec.__version__),
        "errors": [],
    }
    t_start = time.perf_counter()
    with ExitStack() as stack:
        ray.init(
            address="local",  # a fresh instance, even where another runs
            num_cpus=WORKERS,
            include_dashboard=False,
            object_store_memory=256 << 20,
            log_to_driver=False,
            # The agents import the workloads from this checkout, as the driver does.
            runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}},
        )
        stack.callback(ray.shutdown)
        pools: dict[str, Executor] = {
            "local pool": stack.enter_context(mpexec.WorkerPool(WORKERS)),
            "RayPool": stack.enter_context(RayPool(workers_per_node=WORKERS)),
        }
        try:
            log("[ray] round trip")
            bare = _BareRay()
            stack.callback(bare.close)
            systems = {**pools, "bare Ray actor": bare}
            small = np.arange(16, dtype=np.float64)
            result["round_trip"] = round_trip(systems, rounds, calls, small)
            big = np.ones((wl.CROP, wl.CROP, wl.CHANNELS), np.float32)  # 600 KB
            result["round_trip_600k"] = round_trip(systems, rounds, calls // 3, big)
            log("[ray] augment")
            result["augment"] = augment(pools, n, rounds, (1, 8))
            log("[ray] pipeline")
            result["pipeline"] = pipeline(pools, n, rounds)
            result["model"] = model(result["augment"], result["pipeline"])
        except Exception as exc:
            result["errors"].append(f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
    result["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    result["duration_s"] = round(time.perf_counter() - t_start, 1)
    text = report(result)
    print(text)
    write("ray", result, text, out_dir, "the RayPool and the local WorkerPool")
    return result


def report(result: dict[str, Any]) -> str:
    env = result["env"]
    load = result["load_avg"]
    parts = [
        (
            f"RayPool vs WorkerPool, {WORKERS} workers each; Python {env['python']}, Ray "
            f"{env['ray']}, {env['cpus']} CPUs; load average {load['before'][0]:.1f} before, "
            f"{load['after'][0]:.1f} after"
        )
    ]
    for key, what in (("round_trip", "16 float64"), ("round_trip_600k", "600 KB float32")):
        rt = result.get(key)
        if not rt:
            continue
        rows = [
            [
                name,
                fmt_time(row["us"]["median"]),
                fmt_time(row["us"]["p90"]),
                f"{row['vs_local']:.2f}x",
                fmt_time(row["driver_cpu_us"]["median"]),
            ]
            for name, row in rt.items()
        ]
        parts.append(
            f"Round trip, echo of {what}, one call at a time\n\n"
            + table(["system", "median", "p90", "vs local", "driver CPU/call"], rows)
        )
    aug = result.get("augment")
    if aug:
        rows = []
        for key, row in aug["by_system"].items():
            st = row["images_per_s"]
            rows.append(
                [
                    key,
                    f"{st['median']:.1f}",
                    f"{st['min']:.1f} - {st['max']:.1f}",
                    f"{row['vs_serial']:.2f}x",
                    fmt_time(row["driver_cpu_us_per_image"]["median"]),
                    "yes" if row["identical"] else "NO",
                ]
            )
        parts.append(
            f"Augment, map over {aug['images']} images (224x224x3 float32 out)\n\n"
            + table(
                ["system", "images/s", "range", "vs serial", "driver CPU/image", "identical"],
                rows,
            )
        )
    pl = result.get("pipeline")
    if pl:
        rows = [
            [
                key,
                f"{row['images_per_s']['median']:.1f}",
                f"{row['images_per_s']['min']:.1f} - {row['images_per_s']['max']:.1f}",
                fmt_time(row["driver_cpu_us_per_image"]["median"]),
                "yes" if row["identical"] else "NO",
            ]
            for key, row in pl["by_system"].items()
        ]
        parts.append(
            f"Pipeline, {pl['images']} images an epoch, batch size 8\n\n"
            + table(["system", "images/s", "range", "driver CPU/image", "identical"], rows)
        )
    m = result.get("model")
    if m:
        rows = [
            [
                key,
                fmt_time(row["driver_cpu_us_per_image"]),
                f"{row['driver_limit_images_per_s']:.0f}",
                f"{row['workers_at_the_limit']:.0f}",
            ]
            for key, row in m["by_system"].items()
            if "local" not in key
        ]
        parts.append(
            "Model (docs/ray.md): a worker spends "
            f"{fmt_time(m['worker_cpu_us_per_image'])} CPU an image; one driver core "
            "saturates at 1 / (driver CPU per image),\nwhich that many workers reach\n\n"
            + table(["system", "driver CPU/image", "driver limit, images/s", "workers"], rows)
        )
    return closing(parts, result)


def main(argv: list[str] | None = None) -> int:
    return cli("ray_bench", run, argv)


if __name__ == "__main__":
    sys.exit(main())
