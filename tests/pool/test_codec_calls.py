"""Encoding a call runs Python code for the arrays in it, not for every number (issue 37).

pickle offers every object it writes to ``persistent_id``: a ``map`` chunk of
64 calls ``(i,)`` cost 130 Python calls in the main process, 21 of its 29 µs.
``reducer_override`` sees only what pickle cannot write itself.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import shm
from mpexec import _codec


def _python_calls(fn: Any) -> int:
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_chunk_of_64_plain_calls_encodes_without_a_python_call_each() -> None:
    calls = tuple((i, float(i), f"s{i}", None) for i in range(64))
    _codec.encode_call((calls,), {}, None)  # warm caches
    n = _python_calls(lambda: _codec.encode_call((calls,), {}, None))
    assert n < 20, n  # was 64 x 5 + a few


def test_arrays_and_writable_ones_still_travel_by_reference() -> None:
    with shm.Arena(1 << 20, name="t", sealed=True) as arena:
        small = np.arange(5)
        big = arena.put(np.arange(10000, dtype=np.float64))
        out = arena.empty((3,), np.float32, peer_writable=True)
        args = ((small, big, small), {"x": [big]})
        enc = _codec.encode_call(args, {"out": _codec.writable(out)}, arena)
        assert len(enc.refs.shared) == 2  # big once (pickle memoizes it), out once
        (args_back, kw) = _codec.decode(enc.data)
        a, b, c = args_back[0]
        np.testing.assert_array_equal(a, small)
        np.testing.assert_array_equal(b, big)
        assert a is c  # one object, as pickle gives it
        assert not b.flags.writeable
        assert kw["out"].shape == (3,)
        assert kw["out"].flags.writeable
        del a, b, c, args_back, kw
        _codec.revoke_lent()


def test_a_pipeline_units_record_and_its_class_reach_no_reference_lookup() -> None:
    """A unit's arguments: its Chunk and its rows of the batch's block, writable.

    pickle offers reducer_override the Chunk, its class, the Writable and the
    ``_ref`` it is written as: only the Writable has a reference. The other three
    went through ``reference()`` too (3 calls a batch of the W=2 pipeline's ~310).
    """
    from mpexec._runtime import Chunk

    with shm.Arena(1 << 20, name="u", sealed=True) as arena:
        out = arena.empty((64, 16), np.float32, peer_writable=True)
        args = (Chunk(0, 3, 0, 64, 192, None),)
        kwargs = {"out": (_codec.Writable(out),)}
        looked_up = []
        reference = _codec._Refs.reference

        def spy(self: Any, obj: Any) -> Any:
            looked_up.append(type(obj).__name__)
            return reference(self, obj)

        _codec._Refs.reference = spy  # type: ignore[method-assign]
        try:
            enc = _codec.encode_call(args, kwargs, arena)
        finally:
            _codec._Refs.reference = reference  # type: ignore[method-assign]
        assert looked_up == ["Writable"]
        (chunk,), kw = _codec.decode(enc.data)
        assert chunk == args[0]
        assert kw["out"][0].shape == (64, 16)
        assert kw["out"][0].flags.writeable
        del kw
        _codec.revoke_lent()
