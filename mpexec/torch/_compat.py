"""Every reach into torch's (and multiprocessing's) private names, in one room.

The loader extends ``torch.utils.data.DataLoader`` the way torch's own
loader is built: its base and single-process iterators, its worker seeding
and worker info, its dataset kinds, its fd-backed shared storage. None of it
has a public seam; each is named here once, so that a torch release that
moves one breaks this room alone (loky keeps its foreign internals in one
``backend/`` the same way). Imported in the caller and in the workers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import _utils as _torch_utils
from torch.utils.data import dataloader as _dl

#: torch's collation module (its ``default_collate_fn_map`` is documented as
#: the place to extend ``default_collate``) and its pin-memory helper.
collate = _torch_utils.collate
pin_memory = _torch_utils.pin_memory.pin_memory
_torch_worker = _torch_utils.worker

#: torch's map-style / iterable marker (``DatasetKind.Map``, ``.Iterable``).
DatasetKind = _dl._DatasetKind  # noqa: SLF001 - torch's map-style / iterable marker
#: torch's base iterator, which an epoch's iterator extends as torch's own do.
BaseIter = _dl._BaseDataLoaderIter  # noqa: SLF001 - torch's, subclassed as its loader does
#: torch's single-process iterator (``num_workers=0``), subclassed as its loader does.
SingleProcessIter = _dl._SingleProcessDataLoaderIter  # noqa: SLF001 - torch's, subclassed
#: torch's worker init for a datapipe: shards it across the workers, then the user's init.
sharding_worker_init_fn = _dl._sharding_worker_init_fn  # noqa: SLF001 - torch's, as its loader


def worker_seed_state(base_seed: int, index: int) -> Any:
    """torch's NumPy seed for worker ``index`` (what its workers pass to ``np.random.seed``)."""
    return _torch_worker._generate_state(base_seed, index)  # noqa: SLF001 - torch's worker seeding


def set_worker_info(index: int, num_workers: int, seed: int, dataset: Any) -> None:
    """What ``torch.utils.data.get_worker_info()`` returns in this process (no public setter)."""
    _torch_worker._worker_info = _torch_worker.WorkerInfo(  # noqa: SLF001 - torch's, as its workers
        id=index, num_workers=num_workers, seed=seed, dataset=dataset
    )


#: torch's fd-backed shared storage (``is_shared()``): ``(fd, size)``, ``size`` bytes of a
#: dup of ``fd``. Named, not wrapped: a Python call less a batch.
shared_fd_storage = torch.UntypedStorage._new_shared_fd_cpu  # noqa: SLF001 - torch's fd-backed storage


def process_popen(process: Any) -> Any:
    """multiprocessing's handle of a Process: it keeps the exit code after ``Process.close()``."""
    return process._popen  # noqa: SLF001 - multiprocessing's, read-only
