"""The thread waiting for the next batch takes its unit's result itself (issue 37).

At 2 workers the main process wakes for nearly every batch, with cold caches:
the manager thread woke on the done ring, ran the chunk's hook, then woke the
consumer blocked in ``run()``. Now the consumer reads the worker's done ring
that holds its next batch (``mpexec._pool.read_unit``), the manager standing
aside, so one thread wakes a batch. These check that the consumer does, that a
Ctrl-C landing anywhere in ``run()`` loses no batch, and that a worker killed
while the consumer reads its ring ends the run with a clear error.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any
from unittest import mock

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._scheduler import Scheduler

pytestmark = pytest.mark.usefixtures("no_leaks")

T = 60  # bound of every wait in this file


def _slow_batch(samples: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
    time.sleep(0.005)  # the consumer is there first: it waits for every batch
    return [x * 2 for x in samples]


def _index(info: Any) -> np.ndarray[Any, Any]:
    return np.array([info.idx_in_epoch], np.int64)


def test_the_consumer_thread_takes_its_batches_itself(no_leaks: None) -> None:
    @mpexec.pipeline_def(batch_size=8, num_workers=2, seed=1)
    def graph() -> Any:
        return fn.python_function(
            fn.external_source(source=_index, batch=False),
            function=_slow_batch,
            batch_processing=True,
        )

    hooked = Scheduler._on_chunk
    settled_in: list[int] = []

    def on_chunk(self: Scheduler, *args: Any) -> None:
        settled_in.append(threading.get_ident())
        hooked(self, *args)

    with graph() as pipe, mock.patch.object(Scheduler, "_on_chunk", on_chunk):
        got = [pipe.run()[0].as_array().ravel().tolist() for _ in range(16)]
        mine = settled_in.count(threading.get_ident())  # (closing cancels the rest here)
    assert got == [[2 * (8 * k + i) for i in range(8)] for k in range(16)]
    # The manager still delivers what comes while the consumer reads the other
    # worker's ring; before, it delivered every one.
    assert mine >= 8, (mine, len(settled_in))


_CHILD_CTRL_C = """
import os, signal, threading, time
import numpy as np
import mpexec
from mpexec import fn

def slow(x):
    time.sleep(0.001)
    return x + 1

stop = threading.Event()
armed = [False]  # set only inside the try below; a plain list: no lock to interrupt

def on_sigint(signum, frame):
    # One KeyboardInterrupt per arming, only where the loop's try catches it.
    if armed[0]:
        armed[0] = False
        raise KeyboardInterrupt

def interrupter():
    while not stop.wait(0.004):
        os.kill(os.getpid(), signal.SIGINT)

@mpexec.pipeline_def(batch_size=4, num_workers=2, seed=1)
def graph():
    index = fn.external_source(source=lambda info: np.full(3, info.idx_in_epoch), batch=False)
    return fn.python_function(index, function=slow)

if __name__ == "__main__":
    signal.signal(signal.SIGINT, on_sigint)
    sender = threading.Thread(target=interrupter)
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


def test_ctrl_c_in_run_loses_no_batch() -> None:
    # The consumer now delivers results itself: a KeyboardInterrupt between
    # taking a record and settling its unit would lose that batch (the next
    # run() would wait for it forever). The child's main thread is ours to give
    # a SIGINT handler.
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD_CTRL_C],
        capture_output=True,
        text=True,
        timeout=2 * T,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    interrupted, batches = map(int, proc.stdout.split())
    assert interrupted > 0, "no interrupt landed in run(): the test tested nothing"
    assert batches > 0
