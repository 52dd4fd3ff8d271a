"""Building on WorkerPool: pinned calls for per-worker state, views, share, status.

A tiny "loader" over the pool's public low-level seam (docs/pool.md, "Building on
the pool"): each worker keeps a running total of what it was given, so the calls
for one stream of data are pinned to one worker and run there in order.

Run it: ``python docs/examples/building_on_the_pool.py``.
"""

from __future__ import annotations

import numpy as np

import mpexec

_total = 0.0  # per worker process: the state a pinned stream of calls builds up


def accumulate(block: np.ndarray) -> tuple[float, np.ndarray]:
    """Add ``block`` to this worker's total; the total so far, and the block's halves."""
    global _total
    _total += float(block.sum())
    return _total, block[: len(block) // 2]  # a view of the caller's shared memory


def main() -> None:
    data = np.arange(40_000, dtype=np.float64)
    with mpexec.WorkerPool(num_workers=2, seed=0) as pool:
        shared = pool.share(data)  # one copy into shared memory, read-only
        blocks = np.split(shared, 8)
        # Stream i % 2 always goes to worker i % 2: its calls run in order there.
        futures = [
            pool.submit_call(accumulate, (b,), worker=i % 2, view=True)
            for i, b in enumerate(blocks)
        ]
        results = [f.result(timeout=60) for f in futures]

        for stream in (0, 1):
            mine = blocks[stream::2]
            totals = [r[0] for r in results[stream::2]]
            expected = np.cumsum([b.sum() for b in mine])
            assert np.allclose(totals, expected), (totals, expected)
        half = results[0][1]
        assert not half.flags.writeable  # view=True: a read-only view, not a copy
        assert np.array_equal(half, blocks[0][: len(blocks[0]) // 2])
        assert pool.status.usable
        print(f"totals per worker: {results[-2][0]:.0f}, {results[-1][0]:.0f}")
    assert pool.status.state == "closed"


if __name__ == "__main__":
    main()
