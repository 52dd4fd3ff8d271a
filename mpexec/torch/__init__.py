"""PyTorch back-end: a drop-in ``DataLoader`` over mpexec's workers; pipelines as tensors.

::

    caller (main process)                         shared memory           worker i (WorkerPool)
    ---------------------                         -------------           ---------------------
    __iter__: torch's sampler, generator and      dataset copy, seeded
      base seed (torch's own _BaseDataLoaderIter)                         as torch seeds it;
    task k: a batch of indices  --- task ring i (round robin, pinned) --> get_worker_info() set
                                                                          dataset[idx] ...
                                                                          collate_fn: torch's
                                                  worker arena i  <------ stack writes there,
                                                                          then unmaps the pages
    tensors over those pages, mapped by  <------ descriptors --- done ring i  (no copy, no pickle)
      torch's allocator (is_shared())

Batch ``k`` goes to worker ``k mod n`` (skipping workers whose iterable
dataset ended), exactly as in ``torch.utils.data.DataLoader``, so the same
sampler and generator give the same batches, bit for bit. The caller's
tensors map the worker's arena pages: they stay valid for as long as they
are held, after the loader and its workers are gone. The loader keeps an
epoch's progress (for ``state_dict()``), never its iterator: dropping the
iterator stops the epoch's workers.

The rooms, by the process they run in (docs/architecture.md):

- the caller: ``_loader`` (the ``DataLoader``), ``_epoch`` and ``_iterator``
  (an epoch's iterators), ``_state`` (the resume-state format), ``_stats``,
  ``_processes`` (the loader's pool, started and stopped), ``_convert``
  (``iterate`` / ``to_torch`` over a pipeline);
- the workers: ``_fetch`` (a worker's config and fork registry, its setup,
  its two fetchers, collation into its arena);
- both: ``_tensors`` (tensors over shared memory, on the wire and mapped by
  torch), ``_compat`` (every reach into torch's private names).

Importing this package imports torch (``mpexec`` itself never does), and
nothing else: each public name loads its room on first access (PEP 562), so
a worker, which imports ``_fetch`` alone, loads no caller room.
"""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

try:
    import torch as _torch  # noqa: F401 - torch missing: the install hint, here
except ImportError as _exc:  # pragma: no cover - exercised without torch installed
    from .._extras import missing_message as _missing

    raise ImportError(_missing("torch", _exc)) from _exc

if _TYPE_CHECKING:  # the same names, imported for type checkers; at run time see __getattr__
    from ._convert import iterate, to_torch
    from ._loader import DataLoader
    from ._stats import LoaderStats

#: Where each public name lives, loaded on first access.
_WHERE = {
    "DataLoader": "_loader",
    "LoaderStats": "_stats",
    "iterate": "_convert",
    "to_torch": "_convert",
}

__all__ = ["DataLoader", "LoaderStats", "iterate", "to_torch"]


def __getattr__(name: str) -> _Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # found once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
