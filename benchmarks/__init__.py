"""Benchmarks of mpexec and its shared-memory layer (not shipped with the package).

Run every benchmark with ``python -m benchmarks``, one of them with
``python -m benchmarks shm``, and a shortened smoke-test version with
``--quick``. Each benchmark prints a plain-text table and writes
``benchmarks/results/<name>.json`` and ``<name>.md`` (``<name>-quick.*`` for
``--quick`` runs, which are not kept in git).

Benchmarks report *ratios* of transports measured side by side in one run:
they hold on a noisy machine, where absolute times do not.

``python -m benchmarks peers`` compares mpexec with the peers that are
installed (PyTorch, TensorFlow, Grain, loky, DALI: ``tox -e bench`` installs
them); it installs nothing itself, and reports a missing peer as skipped.
``python -m benchmarks gpu`` needs CuPy and a CUDA GPU, and says so when skipped;
``python -m benchmarks dali`` (mpexec inside a real DALI pipeline) needs DALI.
"""

from __future__ import annotations

#: Benchmark name -> module; each module has ``run(quick, out_dir) -> dict``.
BENCHMARKS: dict[str, str] = {
    "shm": "benchmarks.shm_bench",
    "pool": "benchmarks.pool_bench",
    "peers": "benchmarks.peers_bench",
    "gpu": "benchmarks.gpu_bench",
    "ray": "benchmarks.ray_bench",
    "tf": "benchmarks.tf_bench",
    "startup": "benchmarks.startup_bench",
    "mainload": "benchmarks.mainload_bench",
    "dali": "benchmarks.dali_bench",
    "conditionals": "benchmarks.conditionals_bench",
    "dispatch": "benchmarks.dispatch_bench",
}

__all__ = ["BENCHMARKS"]
