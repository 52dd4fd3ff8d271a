"""What :meth:`DataLoader.stats` reports, and the counters the loader's iterators keep.

Runs in the caller.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["Counters", "LoaderStats"]


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a :class:`DataLoader`'s work over its life (see :meth:`DataLoader.stats`)."""

    num_workers: int
    batches: int  # yielded
    failed: int  # raised the dataset's or collate_fn's error
    wait_s: float  # the caller's time in next(), waiting for batches (or making them)
    in_flight: int  # batches sent to workers and not yet yielded, now
    worker_busy_s: tuple[float, ...]  # per worker: time fetching and collating
    worker_batches: tuple[int, ...]  # per worker: batches made

    @property
    def wait_per_batch_s(self) -> float:
        return self.wait_s / self.batches if self.batches else 0.0

    def __str__(self) -> str:
        lines = [
            (
                f"{self.batches} batches ({self.failed} failed), {self.in_flight} in flight; "
                f"the caller waited {self.wait_s:.3f} s, "
                f"{self.wait_per_batch_s * 1e3:.2f} ms a batch"
            )
        ]
        for w, (busy, n) in enumerate(zip(self.worker_busy_s, self.worker_batches, strict=True)):
            per = busy / n * 1e3 if n else 0.0
            lines.append(f"worker {w}: {n} batches, busy {busy:.3f} s ({per:.2f} ms a batch)")
        return "\n".join(lines)


class Counters:
    """What :meth:`DataLoader.stats` reports, kept up to date by the loader's iterators."""

    def __init__(self) -> None:
        self.batches = 0
        self.failed = 0
        self.wait_s = 0.0
        self.busy_s: list[float] = []
        self.worker_batches: list[int] = []
        self._current: weakref.ref[Any] | None = None

    def current(self) -> Any:
        """The epoch's iterator now running, if it is still alive."""
        return self._current() if self._current is not None else None

    def running(self, it: Any) -> None:
        self._current = weakref.ref(it)

    def made(self, worker: int, busy: float) -> None:
        while len(self.busy_s) <= worker:
            self.busy_s.append(0.0)
            self.worker_batches.append(0)
        self.busy_s[worker] += busy
        self.worker_batches[worker] += 1

    def snapshot(self, num_workers: int, in_flight: int) -> LoaderStats:
        return LoaderStats(
            num_workers=num_workers,
            batches=self.batches,
            failed=self.failed,
            wait_s=self.wait_s,
            in_flight=in_flight,
            worker_busy_s=tuple(self.busy_s),
            worker_batches=tuple(self.worker_batches),
        )


# Shown and pickled under the public path (torch's test runner checks that a
# process's DataLoader is mpexec.torch's).
LoaderStats.__module__ = "mpexec.torch"
