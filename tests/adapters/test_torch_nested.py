"""Nested tensors in a worker's batch reach the caller as torch's loader delivers them.

PyTorch's ``test_nested_tensor_multiprocessing_context_*`` (its
``test_dataloader.py``) failed with ours: a nested tensor of the strided
layout has ``layout == torch.strided`` and a NumPy dtype, so the batch's wire
took it for a plain tensor and asked it for ``.numpy()`` ("NestedTensorImpl
doesn't support sizes"). torch's queue sends a nested tensor's buffer and
rebuilds it as a copy (``_nested_view_from_buffer_copy``): the caller's is a
nested tensor of its own memory, as it is here.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

from mpexec import torch as mt  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("no_leaks"),
    # torch warns once per process that the strided layout's API is a prototype.
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning"),
]

LAYOUTS = [torch.strided, torch.jagged]


def _nested(i: int, layout: Any, n: int = 5) -> Any:
    g = torch.Generator().manual_seed(i)
    return torch.nested.nested_tensor(
        [torch.randn(n, generator=g), torch.randn(n // 2 + 1, generator=g)], layout=layout
    )


def _as_list(batch: list[Any]) -> list[Any]:
    """A user's collate_fn for nested samples (the default one refuses them, as torch's)."""
    return batch


def _dict_of(batch: list[Any]) -> dict[str, Any]:
    """A nested tensor beside a plain one in the same batch."""
    return {"nested": list(batch), "plain": torch.stack([b.values() for b in batch])}


def _parts(nt: Any) -> list[Any]:
    return list(nt.unbind())


def _assert_same_nested(got: Any, want: Any) -> None:
    assert got.is_nested
    assert got.layout == want.layout
    assert type(got) is type(want)
    parts, wanted = _parts(got), _parts(want)
    assert len(parts) == len(wanted)
    for a, b in zip(parts, wanted, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["strided", "jagged"])
def test_nested_tensor_batches_arrive_nested_as_torchs(layout: Any) -> None:
    dataset = [_nested(i, layout) for i in range(6)]
    got: dict[str, list[Any]] = {}
    for name, cls in (("torch", TorchLoader), ("mpexec", mt.DataLoader)):
        loader = cls(dataset, batch_size=2, num_workers=2, collate_fn=_as_list)
        got[name] = [nt for batch in loader for nt in batch]
    for ours, theirs, sample in zip(got["mpexec"], got["torch"], dataset, strict=True):
        _assert_same_nested(ours, sample)
        _assert_same_nested(ours, theirs)
        # torch's queue rebuilds a nested tensor as a copy: not shared memory.
        assert ours.is_shared() == theirs.is_shared() is False


def test_nested_tensor_beside_a_plain_tensor_in_one_batch() -> None:
    # 4096 + 2049 floats a sample: the plain batch is past 16 KiB, so shared memory.
    dataset = [_nested(i, torch.strided, 4096) for i in range(4)]
    loader = mt.DataLoader(dataset, batch_size=2, num_workers=2, collate_fn=_dict_of)
    batches = list(loader)
    assert len(batches) == 2
    for k, batch in enumerate(batches):
        for j, nt in enumerate(batch["nested"]):
            _assert_same_nested(nt, dataset[2 * k + j])
        want = torch.stack([dataset[2 * k + j].values() for j in range(2)])
        assert torch.equal(batch["plain"], want)
        assert batch["plain"].is_shared()  # the plain tensor still comes by shared memory


def test_default_collate_refuses_nested_tensors_with_torchs_error() -> None:
    dataset = [_nested(i, torch.strided) for i in range(4)]
    loader = mt.DataLoader(dataset, batch_size=1, num_workers=2)
    with pytest.raises(RuntimeError, match="not currently supported by the default collate_fn"):
        next(iter(loader))
