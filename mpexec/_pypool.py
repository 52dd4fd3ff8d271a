"""DALI's ``Pipeline._py_pool``, for code (and DALI's tests) that reads it: the workers.

DALI keeps the Python workers of its parallel external source in a pool that
its own tests read to check nothing outlives a pipeline: ``pids()``, ``close()``
and the thread watching the workers (``pool._observer.thread``). A pipeline's
workers here are its :class:`WorkerPool`, whose manager thread watches them;
this is that pool under DALI's names, and nothing more.
"""

from __future__ import annotations

from typing import Any


class _Alive:
    """DALI's observer thread: alive while the pool's workers are watched (it runs)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def is_alive(self) -> bool:
        return bool(self._pool.status.state == "running")


class _Observer:
    def __init__(self, pool: Any) -> None:
        self.thread = _Alive(pool)


class _Pool:
    def __init__(self, pool: Any) -> None:
        self._observer = _Observer(pool)


class PyPool:
    """A pipeline's worker pool under DALI's names: ``pids()``, ``close()``, ``pool``.

    ``close()`` closes the pipeline, which stops the workers (DALI's stops its
    pool; the pipeline cannot run without it either way).
    """

    def __init__(self, pipeline: Any, pool: Any) -> None:
        self._pipeline = pipeline
        self._pids = list(pool.pids)
        self.pool = _Pool(pool)

    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return list(self._pids)

    def close(self) -> None:
        self._pipeline.close()
