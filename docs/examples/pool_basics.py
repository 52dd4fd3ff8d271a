"""WorkerPool in a few lines: arrays in and out without copies, errors by type.

Run it: ``python docs/examples/pool_basics.py``.
"""

from __future__ import annotations

import numpy as np

import mpexec


def brighten(image: np.ndarray, gain: float) -> np.ndarray:
    # `image` is a read-only view of the caller's shared memory: compute, don't mutate.
    return np.clip(image.astype(np.float32) * gain, 0, 255).astype(np.uint8)


def main() -> None:
    with mpexec.WorkerPool(num_workers=2, seed=0) as pool:
        # Allocated in the pool's shared memory: reaches the workers with no copy at all.
        images = pool.empty((8, 224, 224, 3), np.uint8)
        images[:] = np.random.default_rng(0).integers(0, 200, images.shape, dtype=np.uint8)

        futures = [pool.submit(brighten, images[i], 1.2) for i in range(len(images))]
        out = [f.result(timeout=60) for f in futures]
        assert all(np.array_equal(o, brighten(images[i], 1.2)) for i, o in enumerate(out))

        # An output buffer in shared memory, written by the worker in place.
        out = pool.empty(images.shape, np.uint8)
        pool.submit(np.subtract, 255, images, out=mpexec.writable(out)).result(timeout=60)
        assert np.array_equal(out, 255 - images)

        # map: ordered, with a bounded number of calls in flight.
        means = list(pool.map(np.mean, images, prefetch=4))
        print("means:", np.round(means, 1))

        # Many tiny calls: map() sends them many to a task by itself (chunksize=None),
        # results still one per item, in order; chunksize=256 would fix the size.
        rows = images[0].reshape(-1, 3)  # 50,176 pixels
        before = pool.stats().submitted
        peaks = list(pool.map(np.max, rows))
        assert peaks == [int(p.max()) for p in rows]
        print(f"{len(rows)} calls in {pool.stats().submitted - before} tasks")

        # A user exception comes back as itself, with the worker's traceback as __cause__.
        try:
            pool.submit(np.reshape, images[0], (7, 7)).result(timeout=60)
        except ValueError as exc:
            print("ValueError from the worker:", exc)

        print(pool.stats())


if __name__ == "__main__":
    main()
