"""A Ctrl-C landing anywhere in ``run()`` loses no batch.

``run()`` took its iteration out of the window, launched the next ones and
counted it before returning it: a ``KeyboardInterrupt`` raised in between (a
SIGINT's handler runs in the main thread between any two bytecodes) lost that
batch, and the next ``run()`` returned the one after it (2 of 4 runs of this
test on the code before). Now ``run()`` hands its iteration out in its last
statements, with no call between them and the return; the next ``run()``
takes it out of the window.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import _pipeline, fn
from tests.conftest import SIGINT_STORM, run_python

pytestmark = pytest.mark.usefixtures("no_leaks")

T = 60  # bound of every wait in this file


_CHILD_CTRL_C = (
    SIGINT_STORM
    + """
import numpy as np
import mpexec
from mpexec import fn

def slow(x):
    time.sleep(0.001)
    return x + 1

@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=1)
def graph():
    index = fn.external_source(source=lambda info: np.full(3, info.idx_in_epoch), batch=False)
    return fn.python_function(index, function=slow)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupter, args=(0.004,))
    interrupted = batches = 0
    with graph() as pipe:
        sender.start()
        end = time.monotonic() + 2
        while time.monotonic() < end:
            try:
                armed[0] = True
                (out,) = pipe.run()
                armed[0] = False
            except KeyboardInterrupt:
                interrupted += 1
                continue
            got = out.as_array()[:, 0].tolist()
            # No batch lost or repeated: run() after an interrupt gives the same one.
            assert got == [4 * batches + i + 1 for i in range(4)], (got, batches)
            batches += 1
        stop.set()
        sender.join(30)
        assert signal.getsignal(signal.SIGINT) is on_sigint
    print(interrupted, batches)
"""
)


def test_ctrl_c_in_run_loses_no_batch() -> None:
    # The child's main thread is ours to give a SIGINT handler.
    interrupted, batches = map(int, run_python("-c", _CHILD_CTRL_C, timeout=2 * T).split())
    assert interrupted > 0, "no interrupt landed in run(): the test tested nothing"
    assert batches > 0


def _plus_one(x: np.ndarray) -> np.ndarray:
    return x + 1


@pytest.mark.parametrize("workers", [0, 2])
def test_a_ctrl_c_after_the_scheduler_handed_the_batch_out_keeps_it(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The last window of run(): its output checks, after the scheduler has handed
    # the batch out. An interrupt there (forced, not left to a storm's luck) must
    # leave the batch for the next run(), not skip to the one after it.
    @mpexec.pipeline_def(
        batch_size=4, num_workers=workers, seed=1, output_dtype=np.int64, prefetch_depth=2
    )
    def graph() -> Any:
        index = fn.external_source(
            source=lambda info: np.full(3, info.idx_in_epoch, np.int64), batch=False
        )
        return fn.python_function(index, function=_plus_one)

    checks = _pipeline.check_outputs
    interrupts = [1]

    def interrupted_once(result: Any, wanted: Any) -> None:
        if interrupts[0]:
            interrupts[0] -= 1
            raise KeyboardInterrupt
        checks(result, wanted)

    monkeypatch.setattr(_pipeline, "check_outputs", interrupted_once)
    with graph() as pipe:
        with pytest.raises(KeyboardInterrupt):
            pipe.run()
        firsts = [pipe.run()[0].as_array()[:, 0].tolist() for _ in range(3)]
        assert firsts == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
        assert pipe.stats().samples == 12
