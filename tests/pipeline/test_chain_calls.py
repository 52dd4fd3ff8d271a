"""A chained sample runs its ops' steps and nothing else in Python (issue 37).

At 64-128 sleeping workers on 2 cores the bound is the workers' own CPU a
sample, and code run right after a worker wakes runs cold: every Python call
between two of a function's calls counts. A chain of a source and one op cost
18.3 Python calls a sample: the ops' own steps (``_call``, reseeding, the
draw check, the function), plus ``_invoke`` and ``_sample_outputs`` a call,
a list comprehension for the read-only view the next op gets, and a generator
step in ``write_columns`` looking for rows written early where none can be.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest

from mpexec import _runtime
from mpexec._runtime import ChainRunner, Chunk, OpRunner, SampleInfo


def _source(info: SampleInfo) -> np.ndarray[Any, Any]:
    return np.full(4, info.idx_in_epoch, np.float32)


def _double(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x * 2


def _python_calls(fn: Any) -> Counter[str]:
    """Python calls by name while ``fn`` runs, less NumPy's own (``np.full``, and before
    NumPy 1.25 the Python dispatchers of C functions such as ``np.copyto``)."""
    calls: Counter[str] = Counter()
    numpy_dir = os.path.dirname(np.__file__)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not frame.f_code.co_filename.startswith(numpy_dir):
            calls[frame.f_code.co_name] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _chain() -> ChainRunner:
    return ChainRunner(
        [OpRunner("src", _source, "source", 1, 1), OpRunner("dbl", _double, "sample", 1, 2)],
        [(), (0,)],
    )


@pytest.mark.parametrize("slow", [True, False], ids=["reseeded", "speculative"])
def test_a_chained_sample_makes_no_python_call_beyond_its_ops_steps(
    slow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every call "slow": the runners reseed before each call and time it (the
    # mainload op's path: 2 ms calls); else cheap ones speculate after a streak.
    if slow:
        monkeypatch.setattr(_runtime, "_CHEAP_SECONDS", 0.0)
    n = 32
    chain = _chain()
    block = np.empty((n, 4), np.float32)
    for it in range(_runtime._CHEAP_STREAK + 1):  # past the streak: speculating where cheap
        chain(Chunk(0, it, 0, n, it * n), out=(block,))
    it = _runtime._CHEAP_STREAK + 1
    result: list[Any] = []
    calls = _python_calls(lambda: result.append(chain(Chunk(0, it, 0, n, it * n), out=(block,))))
    assert result[0].written == (True,)
    want = np.repeat(2 * np.arange(it * n, it * n + n, dtype=np.float32)[:, None], 4, axis=1)
    np.testing.assert_array_equal(block, want)
    per_sample = {name: c / n for name, c in calls.items() if c >= n}
    assert "_invoke" not in per_sample, per_sample
    assert "_sample_outputs" not in per_sample, per_sample
    assert "<listcomp>" not in per_sample, per_sample
    assert "<genexpr>" not in per_sample, per_sample
    assert sum(calls.values()) / n < (12 if slow else 10), per_sample  # 17.3 and 13.3 before


def test_a_chain_counts_each_ops_bytes_in_and_out() -> None:
    """An op's input bytes are the op before it's outputs, counted once (per_op)."""
    n = 8
    result = _chain()(Chunk(0, 0, 0, n, 0), out=(np.empty((n, 4), np.float32),))
    (_, src_in, src_out), (_, dbl_in, dbl_out) = result.per_op
    assert (src_in, src_out, dbl_in, dbl_out) == (0, 16 * n, 16 * n, 16 * n)


def test_a_chain_fed_one_input_column_takes_each_sample_without_a_list() -> None:
    """A chain whose head takes one input column: a sample's arguments are one index."""
    n = 32
    chain = ChainRunner(
        [OpRunner("dbl", _double, "sample", 1, 1), OpRunner("dbl2", _double, "sample", 1, 2)],
        [(0,), (0,)],
    )
    column = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
    column.setflags(write=False)
    block = np.empty((n, 4), np.float32)
    chain(Chunk(0, 0, 0, n, 0), column, out=(block,))
    calls = _python_calls(lambda: chain(Chunk(0, 1, 0, n, n), column, out=(block,)))
    np.testing.assert_array_equal(block, 4 * column)
    assert calls["<listcomp>"] < n, calls  # was one a sample
