"""Where torchdata's StatefulDataLoader suite, read for behaviour, found ours apart.

torchdata's ``TestSingleIterCalled_shard0`` reads its private state layout
(so it fails with ours by design, docs/loaders.md), but what it checks is
behaviour: resuming calls ``iter(dataset)`` once per worker, and once in the
caller with ``num_workers=0``. There ours called it twice: torch's
single-process iterator makes its fetcher (``iter(dataset)``) as it is built,
and the resume made the iterator again over the restored dataset.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec import torch as mt  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")


class CountsIters(torch.utils.data.IterableDataset):  # type: ignore[misc]
    """Each sample says how many times its dataset object had ``__iter__`` called."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.iter_calls = 0
        self.loaded: Any = None

    def __iter__(self) -> Any:
        self.iter_calls += 1
        info = torch.utils.data.get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        calls = self.iter_calls
        return iter([(i, calls, self.loaded) for i in range(first, self.n, step)])

    def state_dict(self) -> dict[str, int]:
        return {"iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.loaded = state["iter_calls"]  # what __iter__ then sees: loaded before it


def _as_list(batch: list[Any]) -> list[Any]:
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_resumed_iterable_dataset_is_iterated_once_per_worker(num_workers: int) -> None:
    dataset = CountsIters(24)
    loader = mt.DataLoader(dataset, batch_size=2, num_workers=num_workers, collate_fn=_as_list)
    it = iter(loader)
    first = [next(it) for _ in range(4)]
    assert {calls for batch in first for _, calls, _ in batch} == {1}
    state = loader.state_dict()
    del it
    resumed = mt.DataLoader(dataset, batch_size=2, num_workers=num_workers, collate_fn=_as_list)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert rest
    # The caller's dataset goes on (its second iter()); a new worker's copy is iterated once.
    want = 2 if num_workers == 0 else 1
    assert {calls for batch in rest for _, calls, _ in batch} == {want}
    # And its state was loaded before that iter() (torchdata's order, and the workers').
    assert {loaded for batch in rest for _, _, loaded in batch} == {1}
