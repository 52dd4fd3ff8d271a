"""How many iterations an epoch has, from the sources' lengths (mpexec.tf's cardinality)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import fn
from mpexec._graph import Graph, epoch_iterations


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __call__(self, info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        if info.idx_in_epoch >= self.n:
            raise StopIteration
        return np.zeros(2)


def unsized(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    return np.zeros(2)


def samples() -> Iterator[np.ndarray[Any, Any]]:
    yield np.zeros(2)


def graph_of(*sources: dict[str, Any]) -> Graph:
    pipe = mpexec.Pipeline(batch_size=4, num_workers=0)
    with pipe:
        nodes = [fn.external_source(**kw) for kw in sources]
        pipe.set_outputs(*nodes)
    graph = pipe._graph
    assert graph is not None
    return graph


@pytest.mark.parametrize(
    ("sources", "drop", "want"),
    [
        ([{"source": Sized(10), "batch": False}], False, 3),
        ([{"source": Sized(10), "batch": False}], True, 2),
        ([{"source": Sized(8), "batch": False}], False, 2),
        ([{"source": [np.zeros(2)] * 9, "batch": False}], False, 3),  # a list of samples
        ([{"source": [[np.zeros(2)] * 4] * 5}], False, 5),  # a list of batches
        ([{"source": Sized(10), "batch": False}, {"source": Sized(30), "batch": False}], False, 3),
        ([{"source": Sized(30), "batch": False}, {"source": [[np.zeros(2)] * 4] * 2}], False, 2),
        # a source that starts again never ends the epoch: the other one does
        (
            [
                {"source": [np.zeros(2)] * 3, "batch": False, "cycle": True},
                {"source": Sized(6), "batch": False},
            ],
            False,
            2,
        ),
        ([{"source": unsized, "batch": False}], False, None),  # no len()
        ([{"source": samples, "batch": False}], False, None),  # a generator function
        ([{"source": Sized(10), "batch": False}, {"source": unsized, "batch": False}], False, None),
        ([{"source": lambda i: [np.zeros(2)] * 4}], False, None),  # a batch callable
        ([{"source": [np.zeros(2)] * 3, "batch": False, "cycle": True}], False, None),  # endless
        ([{"name": "fed"}], False, None),  # feed_input
    ],
)
def test_epoch_iterations(sources: list[dict[str, Any]], drop: bool, want: int | None) -> None:
    assert epoch_iterations(graph_of(*sources), 4, drop) == want
