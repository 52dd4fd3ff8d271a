"""Resuming mpexec.torch.DataLoader as PyTorch users do: torchdata's API and its edges.

A state taken at the end of a persistent-workers epoch, a state read back
before the resumed epoch starts, a resume that must leave the program's
random generator alone, ``snapshot_every_n_steps``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpexec import torch as mt  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_leaks")


def _gen(seed: int) -> Any:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _batches(loader: Any, n: int | None = None) -> list[list[int]]:
    out = []
    for b in loader:
        out.append(b.tolist())
        if n is not None and len(out) == n:
            break
    return out


def test_state_at_a_persistent_epochs_end_resumes_the_next_epoch() -> None:
    """New workers for a kept ones' epoch draw no base seed: the sampler's order is kept."""

    def make() -> Any:
        return mt.DataLoader(
            list(range(24)),
            batch_size=4,
            shuffle=True,
            generator=_gen(7),
            num_workers=2,
            persistent_workers=True,
        )

    loader = make()
    _batches(loader)
    state = loader.state_dict()
    assert state["fresh"] is False
    want = _batches(loader)  # the next epoch, on the kept workers
    resumed = make()
    resumed.load_state_dict(state)
    assert _batches(resumed) == want
    assert _batches(resumed) == _batches(loader)  # and the one after


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_read_back_before_the_resumed_epoch_is_the_state_loaded(num_workers: int) -> None:
    def make() -> Any:
        return mt.DataLoader(
            list(range(40)), batch_size=4, shuffle=True, generator=_gen(3), num_workers=num_workers
        )

    loader = make()
    it = iter(loader)
    done = [next(it).tolist() for _ in range(3)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    assert len(done) + len(rest) == 10
    first = make()
    first.load_state_dict(state)
    again = first.state_dict()  # nothing iterated since: where the loaded state was
    assert again == state
    second = make()
    second.load_state_dict(again)
    assert _batches(second) == rest  # 7 batches, not a new epoch of 10


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_without_a_generator_leaves_the_programs_rng_alone(num_workers: int) -> None:
    def make() -> Any:
        return mt.DataLoader(list(range(30)), batch_size=3, shuffle=True, num_workers=num_workers)

    torch.manual_seed(5)
    loader = make()
    full = [_batches(loader) for _ in range(3)]
    torch.manual_seed(5)
    loader = make()
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    del it, loader
    for program_seed in (1234, 999):
        torch.manual_seed(program_seed)
        expected_draw = torch.rand(4)
        torch.manual_seed(program_seed)
        resumed = make()
        resumed.load_state_dict(state)
        got = [_batches(resumed) for _ in range(3)]
        # The loader's own stream: the rest of that epoch, then the same later epochs.
        assert got == [full[0][4:], full[1], full[2]]
        # The program's generator: as the program seeded it, untouched by the loader.
        assert torch.equal(torch.rand(4), expected_draw)


def test_snapshot_every_n_steps_is_accepted_and_changes_nothing() -> None:
    a = mt.DataLoader(list(range(10)), batch_size=2, snapshot_every_n_steps=5)
    b = mt.DataLoader(list(range(10)), batch_size=2, snapshot_every_n_steps=None)
    assert a.snapshot_every_n_steps == 5
    assert _batches(a) == _batches(b)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="snapshot_every_n_steps"):
            mt.DataLoader(list(range(10)), snapshot_every_n_steps=bad)


# ------------------------------------------------------------------ the Stateful protocol
class Counting(torch.utils.data.IterableDataset):  # type: ignore[misc]
    """Its own position and epoch (torchdata's Stateful protocol): resumes from them."""

    def __init__(self, per_worker: int) -> None:
        self.per_worker = per_worker
        self.i = 0
        self.epoch = 0
        self.resume_at: int | None = None

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid = info.id if info is not None else 0
        start, self.resume_at = self.resume_at or 0, None
        self.i = start
        for k in range(start, self.per_worker):
            self.i = k + 1
            yield (wid, k, self.epoch)
        self.i = 0
        self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at, self.epoch = state["i"], state["epoch"]


def _counting_loader(num_workers: int, persistent: bool = False) -> Any:
    return mt.DataLoader(
        Counting(5),
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=persistent,
        collate_fn=lambda x: x,
    )


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_datasets_own_state_resumes_it_mid_epoch(num_workers: int) -> None:
    """Its position and its epoch (the second here) come back, per worker: no replay."""
    loader = _counting_loader(num_workers, persistent=num_workers > 0)
    list(loader)
    it = iter(loader)
    head = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = list(it)
    assert {s[2] for s in head + rest} == {1}
    assert state["workers"]  # each worker's dataset state, after its last batch consumed
    resumed = _counting_loader(num_workers, persistent=num_workers > 0)
    resumed.load_state_dict(state)
    assert list(resumed) == rest


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, True)])
def test_a_datasets_epoch_goes_on_after_a_resume_between_epochs(
    num_workers: int, persistent: bool
) -> None:
    loader = _counting_loader(num_workers, persistent)
    list(loader)
    state = loader.state_dict()  # between epochs: the datasets that go on are in epoch 1
    want = list(loader)
    assert {s[2] for s in want} == {1}
    resumed = _counting_loader(num_workers, persistent)
    resumed.load_state_dict(state)
    assert list(resumed) == want
    assert {s[2] for s in list(resumed)} == {2}


class RandomMap(torch.utils.data.Dataset):  # type: ignore[misc]
    """Samples drawn from its worker's torch generator; its state is that generator's."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> int:
        return int(torch.randint(1000, (1,)))

    def state_dict(self) -> dict[str, Any]:
        return {"g": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["g"])


@pytest.mark.parametrize("persistent", [False, True])
def test_a_map_datasets_state_in_its_workers_resumes_its_draws(persistent: bool) -> None:
    def make() -> Any:
        return mt.DataLoader(
            RandomMap(),
            batch_size=2,
            num_workers=2,
            generator=_gen(11),
            persistent_workers=persistent,
        )

    loader = make()
    it = iter(loader)
    head = [next(it).tolist() for _ in range(5)]
    state = loader.state_dict()
    rest = [b.tolist() for b in it]
    assert len(head) + len(rest) == 12
    resumed = make()
    resumed.load_state_dict(state)
    assert _batches(resumed) == rest  # new workers draw on from their datasets' states


class EpochSampler(torch.utils.data.Sampler):  # type: ignore[misc]
    """A sampler whose order depends on its own epoch count (Stateful)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0

    def __iter__(self) -> Any:
        order = [(i * (self.epoch + 1)) % self.n for i in range(self.n)]
        self.epoch += 1
        return iter(order)

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = state["epoch"]


def test_a_stateful_samplers_state_is_saved_and_restored() -> None:
    def make() -> Any:
        return mt.DataLoader(list(range(7)), batch_size=2, sampler=EpochSampler(7), num_workers=2)

    loader = make()
    list(loader)  # epoch 0
    it = iter(loader)  # epoch 1: its order is the sampler's epoch 1
    head = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["samplers"] == {"sampler": {"epoch": 1}}  # as the epoch began
    rest = [b.tolist() for b in it]
    resumed = make()
    resumed.load_state_dict(state)
    assert _batches(resumed) == rest
    assert head + rest != _batches(make())  # epoch 0's order is another one
