"""Encoding a call runs Python code for the arrays in it, not for every number (issue 37).

pickle offers every object it writes to ``persistent_id``: a ``map`` chunk of
64 calls ``(i,)`` cost 130 Python calls in the main process, 21 of its 29 µs.
``reducer_override`` sees only what pickle cannot write itself.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest

import shm
from mpexec import WorkerPool, _codec
from mpexec._errors import SerializationError
from tests.conftest import counted_opcodes

T = 60  # seconds: a bound on every wait, never reached


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
        # A NumPy number in a field: pickled (a unit of plain numbers is not, below).
        args = (Chunk(np.int64(0), 3, 0, 64, 192, None),)
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


def _unit_call(arena: shm.Arena, out: Any, rows: Any = None) -> tuple[Any, dict[str, Any]]:
    from mpexec._runtime import Chunk

    return (Chunk(1, 3, 0, 64, 192, rows),), {"out": (_codec.Writable(out), None)}


def test_a_pipeline_units_call_encodes_without_pickle() -> None:
    """A unit's record and its blocks go in a fixed layout: no pickler a unit.

    Pickled, they ran 11 Python calls in the codec (the pickler's set-up,
    reducer_override for the record, its class, the Writable and ``_ref``, the
    reference, the scan for ``__main__``, ...); now 2 and the block's share.
    """
    with shm.Arena(1 << 20, name="fixed", sealed=True) as arena:
        peer = arena.link()
        out = arena.empty((64, 16), np.float32, peer_writable=True)
        args, kwargs = _unit_call(arena, out)
        _codec.encode_call(args, kwargs, arena, peer).refs.undo()  # warm the caches
        calls = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename == _codec.__file__:
                calls.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            enc = _codec.encode_call(args, kwargs, arena, peer)
        finally:
            sys.setprofile(None)
        assert len(calls) <= 4, calls  # 11 pickled
        assert enc.data[0] != 0x80  # not a pickle
        assert len(enc.refs.shared) == 1
        assert enc.bytes_shared == out.nbytes
        (chunk,), kw = _codec.decode(enc.data)
        assert chunk == args[0]
        written, none = kw["out"]
        assert none is None
        assert written.shape == (64, 16)
        assert written.flags.writeable
        written[:] = 5  # the worker's write lands in the caller's block
        del written, kw
        _codec.revoke_lent()
        assert (out == 5).all()
        assert arena.stats().exported == 0  # opened here: the view took the reference over


def _codec_frames(encode: Any) -> list[str]:
    """The names of the codec's Python frames while ``encode()`` runs, a method's as
    ``Class.name`` (``co_qualname`` is 3.11+: tox runs 3.10 too)."""
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename == _codec.__file__:
            me = frame.f_locals.get("self")
            frames.append(code.co_name if me is None else f"{type(me).__name__}.{code.co_name}")

    sys.setprofile(profile)
    try:
        encode()
    finally:
        sys.setprofile(None)
    return frames


def test_a_units_encoding_books_its_shares_without_a_pickler() -> None:
    """A unit's shares are booked in a ``_Shared``, not in a pickler made for nothing
    (``_Refs``: a Pickler and a BytesIO set up, ~70 bytecodes a unit), and a unit
    without blocks books nothing: 3 codec frames, 4 before."""
    from mpexec._runtime import Chunk

    with shm.Arena(1 << 20, name="books", sealed=True) as arena:
        peer = arena.link()
        out = arena.empty((64, 16), np.float32, peer_writable=True)
        args, kwargs = _unit_call(arena, out)
        _codec.encode_call(args, kwargs, arena, peer).refs.undo()  # warm the caches
        encoded: list[Any] = []
        frames = _codec_frames(
            lambda: encoded.append(_codec.encode_call(args, kwargs, arena, peer))
        )
        assert "_Refs.__init__" not in frames, frames
        assert len(encoded[0].refs.shared) == 1
        encoded[0].refs.undo()  # a push that failed gives the block's share back
        assert arena.stats().exported == 0
        bare = (Chunk(1, 3, 0, 64, 192, (4, 5)),)
        frames = _codec_frames(lambda: encoded.append(_codec.encode_call(bare, {}, arena, peer)))
        assert len(frames) <= 3, frames  # encode_call, _encode_unit, Encoded
        assert encoded[-1].data[0] != 0x80  # not a pickle
        assert not encoded[-1].refs.shared
        assert _codec.decode(encoded[-1].data) == (bare, {})


def test_units_round_trip_whatever_their_fields_and_outputs() -> None:
    from mpexec._runtime import Chunk

    with shm.Arena(1 << 20, name="fixed2", sealed=True) as arena:
        peer = arena.link()
        out = arena.empty((8, 4), np.float64, peer_writable=True)
        cases: list[tuple[tuple[Any, ...], dict[str, Any], bool]] = [
            ((Chunk(0, 1, 2, 3, 4, (5, 9, 11)),), {"out": (_codec.Writable(out),)}, True),
            ((Chunk(0, 1, 2, 3, 4),), {}, True),  # no out at all
            ((Chunk(0, 1, 2, 3, 4),), {"out": ()}, True),
            ((Chunk(0, 1, 2, 3, 4),), {"out": (None, None)}, True),
            # Pickled: a NumPy number (marshal would write it as bytes), an
            # out that is not a Writable, another keyword, two arguments.
            ((Chunk(0, 1, 2, 3, 4, (np.int64(5),)),), {}, False),
            ((Chunk(0, np.int32(1), 2, 3, 4),), {}, False),
            ((Chunk(0, 1, 2, 3, 4),), {"out": (np.zeros(3),)}, False),
            ((Chunk(0, 1, 2, 3, 4),), {"other": 1}, False),
            ((Chunk(0, 1, 2, 3, 4), 7), {}, False),
        ]
        for args, kwargs, fixed in cases:
            enc = _codec.encode_call(args, kwargs, arena, peer)
            assert (enc.data[0] != 0x80) is fixed, (args, kwargs)
            args_back, kw = _codec.decode(enc.data)
            assert args_back == args
            fields = zip(vars(args[0]).values(), vars(args_back[0]).values(), strict=True)
            assert all(type(field) is type(value) for field, value in fields)
            assert kw.keys() == kwargs.keys()
            if "out" in kwargs:
                assert len(kw["out"]) == len(kwargs["out"])
            del kw
            _codec.revoke_lent()
        assert arena.stats().exported == 0  # opened here: each view took its reference over


def test_a_units_block_outside_the_pools_memory_fails_sharing_nothing() -> None:
    with shm.Arena(1 << 20, name="fixed3", sealed=True) as arena:
        peer = arena.link()
        ours = arena.empty((8, 4), np.float64, peer_writable=True)
        args, _ = _unit_call(arena, ours)
        kwargs = {"out": (_codec.Writable(ours), _codec.Writable(np.zeros((8, 4))))}
        with pytest.raises(SerializationError, match="writable"):
            _codec.encode_call(args, kwargs, arena, peer)
        assert arena.stats().exported == 0  # the first block's share was taken back


def test_a_unit_is_decoded_where_its_records_module_is_not_loaded_yet() -> None:
    """The receiver imports the record's class by name (a worker, before any call)."""
    with shm.Arena(1 << 20, name="fixed4", sealed=True) as arena:
        out = arena.empty((8, 4), np.float64, peer_writable=True)
        args, kwargs = _unit_call(arena, out, rows=(2, 3))
        enc = _codec.encode_call(args, kwargs, arena, arena.link())
        saved = dict(_codec._unit_classes)
        _codec._unit_classes.clear()
        try:
            (chunk,), kw = _codec.decode(enc.data)
            assert chunk == args[0]
            del kw
            _codec.revoke_lent()
            with pytest.raises(AttributeError):
                _codec.decode(_renamed(enc.data, b"mpexec._runtime:Shunk"))
            with pytest.raises(SerializationError, match="not a record"):
                _codec.decode(_renamed(enc.data, b"mpexec._errors:SerializationError"))
        finally:
            _codec._unit_classes.update(saved)


def _renamed(data: bytes, name: bytes) -> bytes:
    """A unit's encoding with another class name in it."""
    tag, outs, size, values = _codec._UNIT_HEAD.unpack_from(data, 0)
    rest = data[_codec._UNIT_HEAD.size + size :]
    return _codec._UNIT_HEAD.pack(tag, outs, len(name), values) + name + rest


@dataclasses.dataclass(frozen=True)
class _UsersRecord:
    """A user's frozen record whose ``__post_init__`` keeps an attribute that is no field."""

    n: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "square", self.n * self.n)


def _square_of(record: _UsersRecord) -> int:
    return record.square  # type: ignore[attr-defined, no-any-return]


def test_a_users_frozen_record_is_pickled_whole() -> None:
    """Only mpexec's own records take the fixed layout: pickle keeps what else a user's has."""
    with shm.Arena(1 << 20, name="fixed5", sealed=True) as arena:
        enc = _codec.encode_call((_UsersRecord(7),), {}, arena, arena.link())
        assert enc.data[0] == 0x80  # a pickle
        (back,), _ = _codec.decode(enc.data)
        assert back.square == 49
    with WorkerPool(1) as pool:
        assert pool.submit(_square_of, _UsersRecord(6)).result(T) == 36


def _codec_calls(fn: Any) -> tuple[Any, list[str]]:
    """``fn()`` and the codec's Python functions it ran, by name."""
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename == _codec.__file__:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        value = fn()
    finally:
        sys.setprofile(None)
    return value, calls


def test_a_call_of_plain_arrays_goes_without_pickle() -> None:
    """A TF op's body hands a worker its inputs, arrays only: no pickler, no unpickler.

    Pickled, a call of one 0-d array ran 9 of the codec's Python functions (the
    pickler's set-up, reducer_override twice, the reference, the scan for
    ``__main__``, ...); now 4. Its decoding makes no unpickler (no find_class).
    """
    with shm.Arena(1 << 20, name="plain", sealed=True) as arena:
        peer = arena.link()
        index = np.asarray(np.int64(7))
        big = np.arange(_codec.INLINE_MAX // 4 + 1, dtype=np.float32)  # by descriptor
        _codec.encode_call((index,), {}, arena, peer).refs.undo()  # warm the caches
        enc, calls = _codec_calls(lambda: _codec.encode_call((index,), {}, arena, peer))
        assert enc.data[0] != 0x80, calls  # not a pickle
        assert len(calls) <= 4, calls
        (args, kwargs), calls = _codec_calls(lambda: _codec.decode(enc.data))
        assert len(calls) <= 4, calls
        assert "find_class" not in calls, calls
        assert kwargs == {}
        assert args[0].shape == ()
        assert args[0].dtype == np.int64
        assert args[0] == 7
        assert not args[0].flags.writeable

        enc = _codec.encode_call((index, big, np.zeros((0, 3))), {}, arena, peer)
        assert enc.data[0] != 0x80
        assert len(enc.refs.shared) == 1
        assert enc.bytes_shared == big.nbytes
        args, kwargs = _codec.decode(enc.data)
        assert kwargs == {}
        assert len(args) == 3
        np.testing.assert_array_equal(args[1], big)
        assert not args[1].flags.writeable
        assert args[2].shape == (0, 3)
        del args
        assert _codec.encode_call((), {}, arena, peer).data[0] != 0x80
        assert _codec.decode(_codec.encode_call((), {}, arena, peer).data) == ((), {})
        assert arena.stats().exported == 0  # opened here: the view took the reference over


def test_results_that_are_arrays_go_without_pickle_and_read_back_as_before() -> None:
    """A worker's result: an array, or a tuple of them, in the plain layout; read back
    as the unpickler read it (arrays of the caller's own, or views where allowed)."""
    with shm.Arena(1 << 20, name="plainr", sealed=True) as arena:
        peer = arena.link()
        small = np.arange(6, dtype=np.float32).reshape(2, 3)
        big = np.ones(_codec.INLINE_MAX // 8 + 1)
        _codec.encode_result(small, arena, peer)  # warm the caches
        enc, calls = _codec_calls(lambda: _codec.encode_result(small, arena, peer))
        assert len(calls) <= 4, calls  # pickled: 8
        for value in (small, big, (small, big), ()):
            enc = _codec.encode_result(value, arena, peer)
            assert enc.data[0] != 0x80, value
            back = _codec.decode(enc.data, True)
            if isinstance(value, tuple):
                assert type(back) is tuple
                assert len(back) == len(value)
                for got, want in zip(back, value, strict=True):
                    np.testing.assert_array_equal(got, want)
                    assert got.flags.writeable
            else:
                assert type(back) is np.ndarray
                np.testing.assert_array_equal(back, value)
                assert back.flags.writeable  # the caller's own
            del back
        # A view of memory others read (the worker's input) is copied unless views will do.
        shared = arena.put(np.arange(300, dtype=np.float64))
        shared.flags.writeable = False
        enc = _codec.encode_result(shared, arena, peer)
        assert enc.data[0] != 0x80
        assert _codec.decode(enc.data, True).flags.writeable  # a copy of the caller's own
        enc = _codec.encode_result(shared, arena, peer)
        assert not _codec.decode(enc.data, True, True).flags.writeable  # the view itself


def test_what_the_plain_layout_cannot_say_is_pickled() -> None:
    """The same array twice (pickle gives one object back), object arrays, subclasses,
    other values, keywords: pickled as before."""

    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    with shm.Arena(1 << 20, name="plainp", sealed=True) as arena:
        peer = arena.link()
        a = np.arange(3)
        cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
            ((a, a), {}),
            ((np.array([1, "x"], dtype=object),), {}),
            ((np.zeros(3).view(Sub),), {}),
            ((a, 3), {}),
            ((a,), {"k": a}),
        ]
        for args, kwargs in cases:
            enc = _codec.encode_call(args, kwargs, arena, peer)
            assert enc.data[0] == 0x80, args
        back, _ = _codec.decode(_codec.encode_call((a, a), {}, arena, peer).data)
        assert back[0] is back[1]
        for value in ((a, a), [a], {"a": a}, 3, None, np.zeros(2).view(Sub)):
            assert _codec.encode_result(value, arena, peer).data[0] == 0x80, value


def _pair(x: Any) -> tuple[Any, Any]:
    return x + 1, np.full(5000, 2.0)


def test_a_pool_runs_plain_calls_and_results() -> None:
    with WorkerPool(1) as pool:
        x = np.arange(4.0)
        np.testing.assert_array_equal(pool.submit(np.add, x, x).result(T), 2 * x)
        a, b = pool.run_call(_pair, (x,))
        np.testing.assert_array_equal(a, x + 1)
        assert b.shape == (5000,)
        assert (b == 2).all()
        assert pool.submit(np.sum, np.ones(10000)).result(T) == 10000


def test_a_fresh_result_is_copied_into_the_arena_in_few_calls() -> None:
    """A worker's every result of a heavy function (600 KB, its own bytes): encoded
    right after the function ran, its code and data out of the CPU's caches, where
    each Python call costs several times its warm cost. The arena's copy-in checked
    the arena, the peer, the rounding and the descriptor through helpers of a line:
    25 calls before, 16 now (the counted lambda's own call included)."""
    with shm.Arena(1 << 22, name="results") as arena:
        peer = arena.link()
        result = np.full((224, 224, 3), 1.5, np.float32)
        for _ in range(3):  # warm: the block is parked for the next result, caches filled
            _codec.encode_result(result, arena, peer).refs.undo()
        encoded = []
        calls = _python_calls(lambda: encoded.append(_codec.encode_result(result, arena, peer)))
        assert calls <= 17, calls  # 25 before, 16 now
        (desc,) = encoded[0].refs.shared
        view = shm.open_array(desc)  # takes the descriptor's reference over
        assert view.tolist() == result.tolist()
        del view
        arena.collect()
        assert arena.stats().exported == 0
        assert arena.stats().allocations == 0


def test_a_units_plain_fields_are_checked_without_a_loop_over_them() -> None:
    """A unit whose record's fields are all plain scalars (a chunk with no ``rows``) is
    checked with one look in C: ``_encode_unit`` runs 207 bytecodes for it (260 with
    the Python loop over its 6 fields before, ~9 bytecodes each). A field that is a tuple of
    numbers still goes the fixed way, and a NumPy number is still pickled."""
    from mpexec._runtime import Chunk

    with shm.Arena(1 << 20, name="fields", sealed=True) as arena:
        peer = arena.link()
        out = arena.empty((64, 16), np.float32, peer_writable=True)
        args = (Chunk(1, 3, 0, 64, 192),)
        kwargs = {"out": (_codec.Writable(out),)}
        _codec.encode_call(args, kwargs, arena, peer).refs.undo()  # warm the caches
        with counted_opcodes(lambda code: code is _codec._encode_unit.__code__) as ops:
            encoded = _codec.encode_call(args, kwargs, arena, peer)
        encoded.refs.undo()
        assert ops[0] <= 225, ops[0]
        for fields, fixed in (((4, 5),), True), (((np.int64(5),),), False):
            enc = _codec.encode_call((Chunk(1, 3, 0, 64, 192, *fields),), {}, arena, peer)
            assert (enc.data[0] != 0x80) is fixed
            assert _codec.decode(enc.data)[0][0].rows == fields[0]
        assert arena.stats().exported == 0
