"""mpexec.numpy_function in a tf.data map: TensorFlow's op, the function in a worker.

Swap ``tf.numpy_function`` for ``mpexec.numpy_function`` and the map's calls run in
mpexec's worker processes, each with its own GIL, so ``num_parallel_calls=2`` means
two calls at once. Needs TensorFlow: pip install -e ".[tf]" in a checkout of mpexec.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def augment(i: np.int64) -> np.ndarray:
    """A CPU-bound Python function of the sample index: what a map runs."""
    rng = np.random.default_rng(int(i))
    image = rng.random((32, 32), dtype=np.float32)
    return np.flip(image, axis=int(i) % 2).copy()


def main() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import tensorflow as tf
    except ImportError as exc:
        print(f'skipping the example: {exc} (pip install -e ".[tf]" in a checkout of mpexec)')
        return
    import mpexec

    with mpexec.WorkerPool(2) as pool:
        mpexec.set_default_pool(pool)  # else a pool with a worker per CPU, made on first use
        ds = (
            tf.data.Dataset.range(256)
            .map(  # was: tf.numpy_function(augment, [i], tf.float32)
                lambda i: mpexec.numpy_function(augment, [i], tf.float32),
                num_parallel_calls=2,
            )
            .map(lambda x: tf.ensure_shape(x, [32, 32]))  # its shape is unknown, as TF's
            .batch(64)
        )
        for batch in ds:
            assert isinstance(batch, tf.Tensor)
            assert batch.shape == (64, 32, 32)
        want = augment(np.int64(255))
        np.testing.assert_array_equal(batch[-1].numpy(), want)
        print(f"4 batches of {tuple(batch.shape)} float32 from {len(pool.pids)} workers")
        mpexec.set_default_pool(None)


if __name__ == "__main__":
    main()
    sys.exit(0)
