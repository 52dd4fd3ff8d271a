"""RayPool: the WorkerPool's semantics over a Ray cluster, and a pipeline run on it.

Run it: ``python docs/examples/ray_basics.py`` (needs the extra: ``pip install -e ".[ray]"``
in a checkout of mpexec).
Here it starts a one-node Ray of its own; on a cluster, give ``RayPool`` the cluster's
address (or call ``ray.init`` first) and every node gets an agent.
"""

from __future__ import annotations

import sys

import numpy as np

import mpexec
from mpexec import fn


def brighten(image: np.ndarray, gain: float) -> np.ndarray:
    return np.clip(image.astype(np.float32) * gain, 0, 255).astype(np.uint8)


def read(info: mpexec.SampleInfo) -> np.ndarray:
    if info.idx_in_epoch >= 32:
        raise StopIteration
    return np.full((64, 64, 3), info.idx_in_epoch, np.uint8)


def jitter(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Randomness from the `rng` argument: the same on any worker of any node.
    return image.astype(np.float32) + rng.standard_normal(image.shape, np.float32)


@mpexec.pipeline_def(batch_size=8, seed=42)
def augment() -> mpexec.DataNode:
    return fn.python_function(fn.external_source(source=read, batch=False), function=jitter)


def epoch(pipe: mpexec.Pipeline) -> list[np.ndarray]:
    with pipe:
        return [np.array(a) for (batch,) in pipe for a in batch]


def main() -> None:
    try:
        from mpexec.ray import RayPool
    except ImportError as exc:
        print(f"skipping the example: {exc}")
        return

    # address="local": a Ray of our own (address=None would join a running one first).
    # The pool stops it again at the end, since it started it.
    ray_init = {"num_cpus": 2, "include_dashboard": False, "object_store_memory": 200 << 20}
    with RayPool(address="local", ray_init=ray_init) as pool:
        print(pool, "nodes:", len(pool.nodes))
        images = np.random.default_rng(0).integers(0, 200, (8, 64, 64, 3), dtype=np.uint8)

        # submit and map, as on a WorkerPool: results are arrays of the caller's own.
        out = pool.submit(brighten, images[0], 1.2).result(timeout=60)
        assert np.array_equal(out, brighten(images[0], 1.2))
        means = list(pool.map(np.mean, images, chunksize=2, timeout=60))
        print("means:", np.round(means, 1))

        # A user exception comes back as itself, the worker's traceback as __cause__.
        try:
            pool.submit(np.reshape, images[0], (7, 7)).result(timeout=60)
        except ValueError as exc:
            print("ValueError from a node:", exc)

        # A pipeline on the pool: bit-identical to the same pipeline run locally.
        on_ray = epoch(augment(pool=pool))
        local = epoch(augment(num_workers=2))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(on_ray, local, strict=True))
        print(f"pipeline: {len(on_ray)} samples, identical to the local run")
        print("nodes lost while running:", pool.lost_nodes)
        print(pool.stats())


if __name__ == "__main__":
    main()
    sys.exit(0)
