"""TensorFlow's py_func family on mpexec: ``python docs/examples/tf_functions.py``.

The same calls as in TensorFlow, eagerly on NumPy arrays and inside a pipeline, with
TensorFlow's checks on what the function returns; TensorFlow itself is not needed.
"""

from __future__ import annotations

import numpy as np

import mpexec
from mpexec import contrib, fn


def my_func(x: np.ndarray) -> np.ndarray:
    # As in TF's docs: x is a NumPy array (read-only: compute a new one).
    return np.sinh(x)


def stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return x.mean(dtype=np.float32), x.max()


def tokenize(line: bytes) -> np.ndarray:
    # A string input arrives as bytes; str or bytes outputs come back as bytes.
    return np.array(line.decode().split())


def crop_and_mask(image: np.ndarray, box: dict[str, int], *, threshold: np.float32) -> dict:
    crop = image[box["top"] : box["top"] + 4, box["left"] : box["left"] + 4]
    return {"crop": crop, "mask": crop > threshold}


def read_sample(info: mpexec.SampleInfo) -> np.ndarray:
    return np.full((2, 3), info.idx_in_epoch, np.float32)


def eager() -> None:
    x = np.linspace(-1, 1, 5, dtype=np.float32)
    y = mpexec.py_func(my_func, [x], np.float32)  # one dtype: one array
    mean, peak = mpexec.numpy_function(stats, [x], [np.float32, np.float32])  # a list
    print("sinh:", np.round(y, 3), "mean:", mean, "max:", peak)

    words = mpexec.py_func(tokenize, ["the quick brown fox"], str)
    print("tokens:", words.tolist())  # an object array of bytes

    # TF's checks, in TF's words: the count first, then each dtype, with no casting.
    try:
        mpexec.numpy_function(lambda v: v.astype(np.float64) * 2, [x], np.float32, name="double")
    except TypeError as exc:
        print("TypeError:", exc)
    try:
        mpexec.py_func(stats, [x], np.float32)
    except ValueError as exc:
        print("ValueError:", exc)

    # py_function casts what numpy can cast with same_kind (float64 -> float32 here).
    z = mpexec.py_function(lambda v: v.astype(np.float64) * 2, [x], np.float32)
    print("py_function:", z.dtype, z)

    # contrib: nested structures in and out, shapes checked on every call.
    image = np.arange(64, dtype=np.float32).reshape(8, 8)
    out = contrib.py_func(
        crop_and_mask,
        args=[image, {"top": 2, "left": 3}],
        kwargs={"threshold": np.float32(30)},
        output_types={"crop": np.float32, "mask": bool},
        output_shapes={"crop": (4, 4), "mask": (None, 4)},
    )
    print("contrib:", out["crop"].shape, int(out["mask"].sum()), "pixels above 30")


@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=0)
def pipeline() -> tuple[mpexec.DataNode, ...]:
    sample = fn.external_source(source=read_sample, batch=False)
    # Per sample, like a tf.data map; stateful=False lets calls spread over the workers.
    scaled = mpexec.numpy_function(
        lambda s, k: s * k, [sample, np.float32(10)], np.float32, stateful=False
    )
    mean, _peak = mpexec.py_func(stats, [scaled], [np.float32, np.float32], stateful=False)
    return scaled, mean


def main() -> None:
    with mpexec.WorkerPool(2, seed=0) as pool:
        mpexec.set_default_pool(pool)  # eager calls run here; by default on a pool of their own
        try:
            eager()
        finally:
            mpexec.set_default_pool(None)
    with pipeline() as pipe:
        scaled, mean = pipe.run()
        print("pipeline:", scaled.as_array().shape, "means:", [float(m) for m in mean])


if __name__ == "__main__":
    main()
