"""In-place mutation of shared buffers: how it goes wrong, and what mpexec does.

Run: ``python docs/examples/in_place_mutation.py``. It shows

1. a recycled output slot (what a framework that reuses buffers does): a batch
   the user still holds changes under them;
2. two functions sharing one input, one writing into it: the other's result
   depends on which ran first — and when they run concurrently, on timing;
3. mpexec: inputs are read-only, held outputs never change, and ``debug=True``
   names a function that forced its way in (``setflags``).
"""

from __future__ import annotations

import threading

import numpy as np

import mpexec
from mpexec import fn


def recycled_slots() -> None:
    """A producer with two reusable buffers, like a prefetch queue of depth 2."""
    slots = [np.empty(4, np.int64) for _ in range(2)]
    held = []
    for i in range(3):
        out = slots[i % 2]  # slot reused every second iteration
        out[:] = i
        held.append(out)
    # The user kept iteration 0's output; iteration 2 wrote into the same slot.
    print("1. recycled slot: iteration 0 now reads", held[0], "(was [0 0 0 0])")


def center(x: np.ndarray) -> np.ndarray:
    """Subtracts the mean in place: wrong when ``x`` is shared."""
    x -= x.mean()
    return x


def centered_copy(x: np.ndarray) -> np.ndarray:
    """The fix: write into a new array."""
    return x - x.mean()


def total(x: np.ndarray) -> float:
    return float(x.sum())


def racing_consumers(trials: int = 200) -> None:
    """Two consumers of one buffer, one mutating it, run concurrently."""
    seen = set()
    for _ in range(trials):
        shared = np.arange(200_000, dtype=np.float64)
        result: dict[str, float] = {}
        a = threading.Thread(target=center, args=(shared,))
        b = threading.Thread(
            target=lambda x, out: out.setdefault("sum", total(x)), args=(shared, result)
        )
        a.start()
        b.start()
        a.join()
        b.join()
        seen.add(round(result["sum"]))
    print(f"2. racing consumers: {len(seen)} different sums of the same input in {trials} runs")


def sneaky_center(x: np.ndarray) -> np.ndarray:
    # Forcing a way past the read-only flag: possible only where the memory
    # itself is writable (num_workers=0); in a worker the mapping is read-only.
    chain = [x]
    while isinstance(chain[-1].base, np.ndarray):
        chain.append(chain[-1].base)
    for a in reversed(chain):
        a.setflags(write=True)
    x -= x.mean()
    return x


def ramp(info: mpexec.SampleInfo) -> np.ndarray:
    return np.arange(8, dtype=np.float64) + info.idx_in_epoch


def mpexec_rules() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0, debug=True)
    def pipe_def() -> tuple[mpexec.DataNode, ...]:
        x = fn.external_source(source=ramp, batch=False)
        return fn.python_function(x, function=sneaky_center), x

    with pipe_def() as pipe:
        try:
            pipe.run()
        except mpexec.InputMutatedError as exc:
            print("3. debug=True caught it:", str(exc).split(". ")[0])

    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)
    def safe_def() -> tuple[mpexec.DataNode, ...]:
        x = fn.external_source(source=ramp, batch=False)
        return fn.python_function(x, function=center), x

    with safe_def() as pipe:
        try:
            pipe.run()
        except ValueError as exc:  # numpy: "output array is read-only"
            print("   an in-place write to an input fails:", exc)

    @mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)
    def fixed_def() -> tuple[mpexec.DataNode, ...]:
        x = fn.external_source(source=ramp, batch=False)
        return fn.python_function(x, function=centered_copy), x

    with fixed_def() as pipe:
        first = pipe.run()
        kept = first[1].as_array().copy()
        for _ in range(20):
            pipe.run()
        assert np.array_equal(first[1].as_array(), kept)
        print("   a held batch is unchanged after 20 more iterations")


if __name__ == "__main__":
    recycled_slots()
    racing_consumers()
    mpexec_rules()
