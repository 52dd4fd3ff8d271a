"""The one per-sample loop every runner shares (mpexec/_runtime.py, ``each_sample``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec._runtime import ChainRunner, Chunk, OpRunner


def _source_of(n: int) -> Any:
    def source(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
        assert mpexec.sample_info() == info
        if info.idx_in_epoch >= n:
            raise StopIteration
        return np.full(2, info.idx_in_epoch, np.float32)

    return source


def _stops_at_one(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    if x[0] == 1:
        raise StopIteration  # not a source: an error of this op, never an epoch's end
    return x


@pytest.mark.parametrize("chained", [False, True])
def test_a_sources_stop_ends_the_chunk_at_that_sample(chained: bool) -> None:
    src = OpRunner("src", _source_of(7), "source", 1, 5)
    runner: Any = src
    if chained:
        runner = ChainRunner([src, OpRunner("id", lambda x: x + 0, "sample", 1, 6)], [(), (0,)])
    result = runner(Chunk(0, 1, 0, 4, 4))  # samples 4..7 of the epoch: 7 is past the end
    assert result.stop == 3
    assert result.count == 3
    assert [float(a[0]) for a in result.outputs[0]] == [4.0, 5.0, 6.0]
    assert mpexec.sample_info() is None


def test_a_chained_ops_stop_iteration_is_its_error_not_the_sources_end() -> None:
    src = OpRunner("src", _source_of(10), "source", 1, 5)
    chain = ChainRunner([src, OpRunner("stops", _stops_at_one, "sample", 1, 6)], [(), (0,)])
    with pytest.raises(StopIteration) as info:
        chain(Chunk(0, 0, 0, 4, 0))
    assert info.value.mpexec_op == "stops"  # type: ignore[attr-defined]
    assert info.value.mpexec_sample == 1  # type: ignore[attr-defined]
    assert mpexec.sample_info() is None


def test_an_ops_stop_iteration_is_its_error() -> None:
    op = OpRunner("stops", _stops_at_one, "sample", 1, 6)
    rows = [np.full(2, i, np.float32) for i in range(3)]
    with pytest.raises(StopIteration) as info:
        op(Chunk(0, 0, 0, 3, 0), rows)
    assert info.value.mpexec_sample == 1  # type: ignore[attr-defined]
    assert mpexec.sample_info() is None
