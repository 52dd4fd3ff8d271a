"""Turning call arguments and results into ring records, arrays by reference.

Values are pickled (protocol 5), but every ndarray is pulled out of the stream
by ``reducer_override`` and replaced by a reference (a call of ``_ref`` on it,
which :func:`decode` resolves):

- arrays already in the sender's arena (but for views of 1 KiB or less), and
  any larger than ``inline_max``, by an :class:`shm.ArrayDescriptor` (the
  receiver maps the same bytes); a view of another process's arena is
  forwarded as it is, not copied;
- small arrays by their bytes, which the receiver wraps without a copy.

So tuples, lists, dicts and user objects holding arrays are walked by pickle
itself, and an array is never pickled. Functions go through cloudpickle, so
lambdas, closures and local functions work. Anything that cannot be pickled
raises :class:`~mpexec.SerializationError` naming where it sits
(``args[1]['mask']``), in the caller, before anything is sent.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import marshal
import operator
import pickle
import struct
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

import shm

from ._errors import SerializationError

#: Arrays up to this size travel inside the record rather than through the arena.
INLINE_MAX = 16 << 10
#: Arrays already in shared memory travel by descriptor, in place, unless this
#: small: sending, opening and releasing a descriptor costs ~4x a copy of 1 KiB.
VIEW_INLINE_MAX = 1 << 10

# An array's reference is one bytes object, its kind in the last byte.
_SHARED, _INLINE, _WRITABLE, _CLASS = 0, 1, 2, 3
_SHARED_TAG, _WRITABLE_TAG, _CLASS_TAG = bytes([_SHARED]), bytes([_WRITABLE]), bytes([_CLASS])
#: Workers never import the caller's ``__main__`` (see ``_launch``), so what it
#: defines goes by value. A class goes as a reference too: its cloudpickle,
#: made once per class here and loaded once per process there (cloudpickle
#: gives the receiver back the sender's own class when it sent it first). A
#: value naming anything else of ``__main__`` is pickled again by cloudpickle.
#: In a process multiprocessing started with spawn or forkserver (a user's
#: ``mp.Process``, ``torch.multiprocessing.spawn``, Lightning's ``ddp_spawn``),
#: the parent's script runs as ``__mp_main__`` and its classes and functions
#: carry that name: the same rule holds for them.
_MAIN = "__main__"
_SPAWNED_MAIN = "__mp_main__"
_MAINS = frozenset({_MAIN, _SPAWNED_MAIN})
_MAIN_BYTES = _MAIN.encode()
_SPAWNED_MAIN_BYTES = _SPAWNED_MAIN.encode()
_class_refs: weakref.WeakKeyDictionary[type, tuple[bytes, int]] = weakref.WeakKeyDictionary()
_classes: dict[bytes, type] = {}
#: An inline array is its data, then a "meta" (ndim, shape, dtype code), then
#: this tail: the meta's length and the kind. The data comes first so that the
#: array the receiver wraps in place is aligned; metas are cached both ways, as
#: one shape and dtype recur call after call.
_INLINE_TAIL = struct.Struct("<IB")  # a structured dtype's pickle may pass 64 KiB
_metas: dict[tuple[tuple[int, ...], np.dtype[Any]], bytes] = {}
_parsed: dict[bytes, tuple[tuple[int, ...], np.dtype[Any]]] = {}
_CACHE_MAX = 1024


def _inline_ref(array: np.ndarray[Any, Any]) -> bytes:
    """``array``'s bytes, shape and dtype, in one bytes object."""
    key = (array.shape, array.dtype)
    meta = _metas.get(key)
    if meta is None:
        meta = _meta(*key)
        if len(_metas) < _CACHE_MAX:
            _metas[key] = meta
    return b"".join((array.tobytes(), meta, _INLINE_TAIL.pack(len(meta), _INLINE)))


def _meta(shape: tuple[int, ...], dtype: np.dtype[Any]) -> bytes:
    return struct.pack(f"<B{len(shape)}q", len(shape), *shape) + shm.dtype_code(dtype)


def _inline_array(ref: bytes, writable: bool) -> np.ndarray[Any, Any]:
    """The array :func:`_inline_ref` described: a view of ``ref``, or of a copy if writable."""
    size, _ = _INLINE_TAIL.unpack_from(ref, len(ref) - _INLINE_TAIL.size)
    end = len(ref) - _INLINE_TAIL.size - size
    meta = ref[end : end + size]
    parsed = _parsed.get(meta)
    if parsed is None:
        nd = meta[0]
        parsed = struct.unpack_from(f"<{nd}q", meta, 1), shm.dtype_from_code(meta[1 + 8 * nd :])
        if len(_parsed) < _CACHE_MAX:
            _parsed[meta] = parsed
    shape, dtype = parsed
    array: np.ndarray[Any, Any] = np.ndarray(
        shape, dtype, bytearray(ref[:end]) if writable else ref
    )
    return array


class Writable:
    """An argument the function may write to: see :func:`mpexec.writable`."""

    __slots__ = ("array", "desc", "packed")

    def __init__(self, array: np.ndarray[Any, Any], desc: Any = None, packed: bytes = b"") -> None:
        self.array = array
        # Where the pool described ``array`` once (a pipeline's block, when cut): its
        # descriptor and that packed, shared again with no look at the array.
        self.desc = desc
        self.packed = packed

    def __repr__(self) -> str:
        return f"mpexec.writable(<{self.array.dtype} array {self.array.shape}>)"


def writable(array: np.ndarray[Any, Any]) -> Writable:
    """Pass ``array`` to a worker's function writable: its writes land in ``array``.

    Arguments reach functions read-only; this one is a writable view of the same
    memory instead, so a function can fill an output buffer the caller owns
    (``np.multiply(x, 2, out=out)``) and nothing is copied back. ``array`` must
    live in the pool's shared memory (``pool.empty()``, ``pool.put()``), and the
    caller must leave it alone until the call is done. Inline (``num_workers=0``)
    the function gets ``array`` itself.
    """
    if type(array) is not np.ndarray:
        raise TypeError(f"writable() takes a numpy.ndarray, not {type(array).__name__}")
    if not array.flags.writeable:
        raise ValueError("writable() got a read-only array")
    if array.dtype.hasobject:
        raise TypeError("writable() cannot share an array of Python objects")
    return Writable(array)


_NOT_SHARED = (
    "writable() needs an array in the pool's shared memory (from pool.empty() "
    "or pool.put()): a worker cannot write to this process's private memory"
)


class _Refs(pickle.Pickler):
    """Pickles a value with its arrays by reference; what it shared, to give back.

    ``reducer_override``, not ``persistent_id``: pickle offers every object it
    writes to ``persistent_id`` (a chunk of 64 calls ``(i,)``: 130 Python calls,
    21 of its 29 µs), but only those it cannot write itself to
    ``reducer_override`` (ints, floats, strings, bytes, tuples, lists and
    dicts never reach it).
    """

    def __init__(
        self,
        file: io.BytesIO,
        arena: shm.Arena | None,
        peer: shm.Ring | None,
        inline_max: int,
        owner: shm.Arena | None = None,
        booked: list[shm.ArrayDescriptor] | None = None,
    ) -> None:
        super().__init__(file, protocol=5)
        self.arena = arena
        self.owner = owner or arena  # where writable() arrays must live
        self.peer = peer
        self.inline_max = inline_max
        # Each descriptor is added as its reference is counted (share's ``into``).
        self.shared: list[shm.ArrayDescriptor] = [] if booked is None else booked
        self.bytes_shared = 0
        self.bytes_copied = 0
        self.names_main = False  # a function of __main__ was met: cloudpickle it all
        self.classes: set[type] = set()  # classes of __main__ sent by reference
        self.main_in_refs = 0  # how often their refs mention __main__

    def reducer_override(self, obj: Any) -> Any:
        # Called only for objects pickle does not write itself (not for ints,
        # strings, tuples, lists, dicts: a chunk's numbers and tuples cost no
        # Python call). An array (or a class of __main__) is written as a call
        # of _ref on its reference, which decode() resolves (see _Unpickler).
        # What has no reference (a record, its class, _ref itself: 3 of a
        # pipeline unit's 4 objects here) is told apart without reference().
        t = type(obj)
        if t is not np.ndarray and t is not Writable:
            if not (t is types.FunctionType or isinstance(obj, type)):
                return NotImplemented
            if obj.__module__ not in _MAINS:
                return NotImplemented
        ref = self.reference(obj)
        return NotImplemented if ref is None else (_ref, (ref,))

    def reference(self, obj: Any) -> bytes | None:
        """``obj``'s reference (an array, writable(), a class of __main__), or None."""
        if type(obj) is Writable:
            return self._writable(obj.array)
        if type(obj) is not np.ndarray or obj.dtype.hasobject:
            if isinstance(obj, type) and obj.__module__ in _MAINS:
                ref, mentions = _class_ref(obj)
                if obj not in self.classes:  # pickle writes the same ref once
                    self.classes.add(obj)
                    self.main_in_refs += mentions
                return ref
            if type(obj) is types.FunctionType and obj.__module__ in _MAINS:
                self.names_main = True
            return None
        if self.arena is None and obj.nbytes > self.inline_max:
            self.bytes_shared += obj.nbytes  # what it would share
            return _SHARED_TAG  # only checking that the rest pickles: no bytes needed
        return _array_ref(self, obj)

    def _writable(self, array: np.ndarray[Any, Any]) -> bytes:
        arena = self.arena
        owner = self.owner
        if arena is not None and owner is arena:
            # Checked and shared in one step (a pipeline's unit passes its block so).
            desc = arena.share_own(array, self.peer, self.shared)
        elif owner is not None and not owner.owns(array):
            desc = None
        elif arena is None:
            return _WRITABLE_TAG  # checking only
        else:
            desc = arena.share(array, "", self.peer, self.shared)
        if desc is None:
            raise SerializationError(_NOT_SHARED)
        self.bytes_shared += array.nbytes
        return desc.pack() + _WRITABLE_TAG

    def undo(self) -> None:
        _give_back(self)
        self.classes.clear()
        self.main_in_refs = 0


def _array_ref(refs: _Refs | _Shared, obj: np.ndarray[Any, Any]) -> bytes:
    """An array's reference: inline bytes, or a descriptor of it in ``refs.arena`` (booked)."""
    arena = refs.arena
    if arena is not None and (
        obj.nbytes > refs.inline_max or (obj.nbytes > VIEW_INLINE_MAX and arena.owns(obj))
    ):
        return _shared_ref(refs, arena, obj)
    return _inline_ref(obj)


def _shared_ref(refs: _Refs | _Shared, arena: shm.Arena, obj: np.ndarray[Any, Any]) -> bytes:
    """``obj`` shared in ``arena`` for ``refs.peer``: its descriptor's reference (booked)."""
    # Views of other processes' arenas are forwarded, not copied.
    copied = arena.bytes_copied
    desc = arena.share(obj, "", refs.peer, refs.shared)  # (booked in refs.shared)
    # What share() copied: a broadcast's real bytes; an imported view
    # whose owner is gone is copied too.
    refs.bytes_copied += arena.bytes_copied - copied
    refs.bytes_shared += obj.nbytes
    return desc.pack() + _SHARED_TAG


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(self, file: io.BytesIO, refs: _Refs) -> None:
        super().__init__(file, protocol=5)
        self._refs = refs

    def reducer_override(self, obj: Any) -> Any:
        ref = self._refs.reference(obj)
        if ref is None:
            return super().reducer_override(obj)
        return (_ref, (ref,))


def _mentions_main(data: bytes) -> int:
    """How often ``data`` names a main module (``__main__`` or ``__mp_main__``)."""
    return data.count(_MAIN_BYTES) + data.count(_SPAWNED_MAIN_BYTES)


def spawned_main_by_value() -> None:
    """Make cloudpickle send what ``__mp_main__`` defines by value, as it does ``__main__``'s.

    In a process multiprocessing started with spawn or forkserver, the parent's
    script is loaded as ``__mp_main__`` (and is also ``sys.modules["__main__"]``).
    cloudpickle pickles only ``__main__``'s classes and functions by value, so
    without this they would go by reference to a module mpexec's workers never
    import. Registered once, for the process: that module is this process's
    main script, and anything pickled from it needs the same treatment.
    """
    module = sys.modules.get(_SPAWNED_MAIN)
    if module is None or module.__name__ in cloudpickle.list_registry_pickle_by_value():
        return
    cloudpickle.register_pickle_by_value(module)


def _class_ref(cls: type) -> tuple[bytes, int]:
    """A reference to a class of ``__main__`` (its cloudpickle, made once); its mentions of it."""
    cached = _class_refs.get(cls)
    if cached is None:
        spawned_main_by_value()
        ref = bytes(cloudpickle.dumps(cls, protocol=5)) + _CLASS_TAG
        cached = _class_refs[cls] = (ref, _mentions_main(ref))
    return cached


def _load_class(pid: bytes) -> type:
    cls = _classes.get(pid)
    if cls is None:
        cls = cloudpickle.loads(memoryview(pid)[:-1])
        if len(_classes) < _CACHE_MAX:
            _classes[pid] = cls
    return cls


def _load_ref(writable: bool, shared_ok: bool, pid: bytes) -> Any:
    """The array (or class) a reference names: see :func:`decode`."""
    kind = pid[-1]
    if kind == _INLINE:
        return _inline_array(pid, writable)
    if kind == _CLASS:
        return _load_class(pid)
    desc = shm.ArrayDescriptor.unpack(memoryview(pid)[:-1])
    if kind == _WRITABLE:
        # Mapped alone: a stray write reaches only this array's pages (which
        # pool.empty()/put() give it to itself), never an input's.
        view = shm.open_array(desc, writable=True, alone=True)
        _lent.append(view)
        return view
    arr = shm.open_array(desc, writable=writable)
    if desc.readonly and writable and not shared_ok and not _broadcast(desc):
        # A view of memory others read (a function returned its input):
        # the caller was promised an array of its own. (A broadcast view is
        # read-only in NumPy too: copying would only materialise it.)
        return arr.copy()
    return arr


#: Writable views that decode() opened (arguments passed writable()): lent for one
#: call. The worker revokes them when the call is over (revoke_lent).
_lent: list[np.ndarray[Any, Any]] = []


def revoke_lent() -> None:
    """Make the writable views decode() lent inaccessible: the call that got them is over.

    A function that kept one (in a global, a closure, a thread) would
    otherwise write the caller's array in a later call that never received
    it; now such a write faults.
    """
    while _lent:
        shm.revoke(_lent.pop())


def _broadcast(desc: shm.ArrayDescriptor) -> bool:
    return any(st == 0 and n > 1 for n, st in zip(desc.shape, desc.strides, strict=False))


def _ref(ref: bytes) -> Any:
    """What an encoded value calls on each reference; :func:`decode` puts ``_load_ref`` there."""
    raise SerializationError("an mpexec array reference can only be read by mpexec's decode()")


def _unpickler(writable: bool, shared_ok: bool) -> type[pickle.Unpickler]:
    load = functools.partial(_load_ref, writable, shared_ok)

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            # Once a value (pickle memoizes the name), not once a reference.
            if name == "_ref" and module == __name__:
                return load
            return super().find_class(module, name)

    return Unpickler


_UNPICKLERS = {(w, ok): _unpickler(w, ok) for w in (False, True) for ok in (False, True)}


class Encoded:
    """An encoded value: its bytes, and what its arrays cost to send."""

    __slots__ = ("bytes_copied", "bytes_shared", "data", "refs")

    def __init__(self, data: bytes, refs: _Refs | _Shared) -> None:
        self.data = data
        self.refs = refs
        self.bytes_shared = refs.bytes_shared
        self.bytes_copied = refs.bytes_copied


def encode_call(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    arena: shm.Arena | None,
    peer: shm.Ring | None = None,
    inline_max: int = INLINE_MAX,
    owner: shm.Arena | None = None,
    booked: list[shm.ArrayDescriptor] | None = None,
) -> Encoded:
    """Encode a call's arguments; a failure names ``args[i]`` or ``kwargs['k']``.

    ``owner``: the arena ``writable()`` arrays must be in, when ``arena`` is
    None (checking that a call can be encoded, without sharing anything).
    ``booked``: the caller's list of what the encoding shares, each descriptor
    added as its reference is counted, so that a caller cut off from the
    result (a Ctrl-C as this returns) can still give them back (:func:`give_back`).
    A failure here gives them back itself.
    A call of one record and its ``out`` blocks (a pipeline's unit) goes in a
    fixed layout, without pickle (see :func:`_encode_unit`).
    """
    if (
        arena is not None
        and len(args) == 1
        and (not kwargs or (len(kwargs) == 1 and "out" in kwargs))
        and (owner is None or owner is arena)
        and _unit_fields.get(type(args[0]), _UNKNOWN) is not None
    ):
        enc = _encode_unit(args[0], kwargs, arena, peer, booked)
        if enc is not None:
            return enc
    if arena is not None and not kwargs and (owner is None or owner is arena):
        enc = _encode_plain(args, _ARGS, arena, peer, inline_max, booked)
        if enc is not None:
            return enc
    return encode(
        (args, kwargs), arena, peer, "the arguments", inline_max, _call_parts, owner, booked
    )


def encode_result(
    value: Any, arena: shm.Arena, peer: shm.Ring | None, inline_max: int = INLINE_MAX
) -> Encoded:
    """A call's result, as :func:`encode` would, its arrays by reference; an array, or a
    tuple of arrays, in the plain layout (see :func:`_encode_plain`)."""
    t = type(value)
    enc = None
    if t is np.ndarray:
        enc = _encode_plain((value,), _ONE, arena, peer, inline_max)
    elif t is tuple:
        enc = _encode_plain(value, _TUPLE, arena, peer, inline_max)
    if enc is not None:
        return enc
    return encode(value, arena, peer, "the result", inline_max)


# ---------------------------------------------------------------- plain arrays: a fixed layout
#
# A call of a known function on arrays only (a TF op's body hands over its
# inputs so), and a result that is an array or a tuple of arrays, go without
# pickle: pickling them ran a pickler's set-up, ``reducer_override`` and
# :func:`_Refs.reference` per array, and a scan of the bytes for ``__main__``;
# reading them back, an unpickler and its ``find_class``. The body::
#
#     0x02 | u8 form (args, one value, a tuple) | u16 arrays
#     | per array: u32 reference length | its reference (as pickle's, see _load_ref)
#
# Only exact ndarrays of a dtype without objects, each met once (pickle would
# hand the same array back as one object), take it; anything else is pickled.

_PLAIN = 2
_PLAIN_HEAD = struct.Struct("<BBH")
_REF_LEN = struct.Struct("<I")
_ARGS, _ONE, _TUPLE = 0, 1, 2


class _Shared:
    """What a plain encoding shared (as :class:`_Refs` books it), to give back on failure."""

    __slots__ = ("arena", "bytes_copied", "bytes_shared", "inline_max", "peer", "shared")

    def __init__(
        self,
        arena: shm.Arena | None,
        peer: shm.Ring | None,
        inline_max: int,
        booked: list[shm.ArrayDescriptor] | None = None,
    ) -> None:
        self.arena = arena
        self.peer = peer
        self.inline_max = inline_max
        self.shared: list[shm.ArrayDescriptor] = [] if booked is None else booked
        self.bytes_shared = 0
        self.bytes_copied = 0

    def undo(self) -> None:
        _give_back(self)


def _give_back(refs: _Refs | _Shared) -> None:
    """Unshare what an encoding shared (it failed, or its call was never sent)."""
    give_back(refs.arena, refs.shared, refs.peer)
    refs.bytes_shared = refs.bytes_copied = 0


def give_back(
    arena: shm.Arena | None, booked: list[shm.ArrayDescriptor], peer: shm.Ring | None
) -> None:
    """Unshare every descriptor ``booked`` (by an encoding, see ``encode_call``), one by
    one off the list: a Ctrl-C meanwhile leaves the rest for a second call."""
    if arena is None:
        booked.clear()
        return
    while booked:
        arena.unshare_last(booked, peer)


#: A plain encoding's bookkeeping when it shared nothing (its arrays went inline).
_NOTHING_SHARED = _Shared(None, None, 0)


def _encode_plain(
    arrays: tuple[Any, ...],
    form: int,
    arena: shm.Arena,
    peer: shm.Ring | None,
    inline_max: int,
    booked: list[shm.ArrayDescriptor] | None = None,
) -> Encoded | None:
    """``arrays`` in the plain layout; None: not all plain arrays (pickle them)."""
    n = len(arrays)
    if n > 8:
        return None  # rare; the duplicate check below is quadratic
    for i, a in enumerate(arrays):  # loops, not helpers: no Python call an array
        if type(a) is not np.ndarray or a.dtype.hasobject:
            return None
        for j in range(i):
            if arrays[j] is a:
                return None
    refs = _NOTHING_SHARED
    parts = [_PLAIN_HEAD.pack(_PLAIN, form, n)]
    try:
        for a in arrays:
            size = a.nbytes
            if size > inline_max or (size > VIEW_INLINE_MAX and arena.owns(a)):
                if refs is _NOTHING_SHARED:
                    refs = _Shared(arena, peer, inline_max, booked)
                ref = _shared_ref(refs, arena, a)  # (_array_ref's test made above: once)
            else:
                ref = _inline_ref(a)
            parts.append(_REF_LEN.pack(len(ref)))
            parts.append(ref)
    except BaseException:
        refs.undo()
        raise
    return Encoded(b"".join(parts), refs)


def _decode_plain(data: bytes | memoryview, writable: bool, shared_ok: bool) -> Any:
    """The value :func:`_encode_plain` wrote: ``(args, {})``, an array, or a tuple."""
    _, form, n = _PLAIN_HEAD.unpack_from(data, 0)
    pos = _PLAIN_HEAD.size
    values = []
    for _ in range(n):
        (size,) = _REF_LEN.unpack_from(data, pos)
        pos += _REF_LEN.size
        values.append(_load_ref(writable, shared_ok, bytes(data[pos : pos + size])))
        pos += size
    if form == _ONE:
        return values[0]
    if form == _ARGS:
        return tuple(values), {}
    return tuple(values)


# ---------------------------------------------------------------- units: a fixed layout
#
# A pipeline sends call after call of one shape: ``(chunk,)`` and ``out=(block
# rows, writable, ...)``, where a chunk is a frozen dataclass of numbers and
# tuples of them. Pickling that ran 11 Python calls in the caller (the
# pickler's set-up, ``reducer_override`` for the record, its class, the
# writable and ``_ref``, the reference, the scan for ``__main__``); this layout
# runs none but the share of each block. The body::
#
#     0x01 | u8 outs (0xFF: no ``out``) | u16 class-name length | u32 values length
#     | class name ("module:qualname") | marshal of the fields' values
#     | per out: u16 descriptor length (0: None) | the packed descriptor
#
# A pickle starts with 0x80, so :func:`decode` tells them apart by the first
# byte. Only fields of exact ints, floats, booleans, strings and None, and
# tuples of numbers, go this way (marshal would write a NumPy number, a buffer,
# as bytes): any other record is pickled. Main and workers run the same
# interpreter, whose marshal format they share.

_UNIT = 1
_UNIT_HEAD = struct.Struct("<BBHI")
_NO_OUT = 0xFF
_DESC_LEN = struct.Struct("<H")
_UNKNOWN: Any = object()
#: The exact types of a unit's fields that go this way (a tuple's: numbers and None).
_NUMBERS = frozenset({int, float, bool, type(None)})
_SCALARS = _NUMBERS | {str}
#: class -> (its name, a getter of its fields' values, their names), or None:
#: not such a record. And class name -> the same, on the receiving side.
_UnitKind = tuple[bytes, Callable[[Any], Any], tuple[str, ...]]
_unit_fields: dict[type, _UnitKind | None] = {}
_unit_classes: dict[bytes, tuple[type, tuple[str, ...]]] = {}


def _unit_kind(cls: type) -> _UnitKind | None:
    """What writes ``cls``'s instances in the fixed layout; None: they are pickled.

    One of mpexec's own records: a frozen dataclass without slots, importable by
    name (not local), that pickles as any dataclass does (its fields, nothing of
    its own). A user's dataclass is always pickled: its ``__post_init__`` may
    keep attributes that are no field, or a base class may pickle it its own way,
    and only pickle knows.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if (
        params is None
        or not params.frozen
        or "__slots__" in cls.__dict__
        or not cls.__module__.startswith("mpexec.")
        or "<locals>" in cls.__qualname__
        or any(m in cls.__dict__ for m in ("__reduce__", "__reduce_ex__", "__getstate__"))
    ):
        return None
    names = tuple(f.name for f in dataclasses.fields(cls))
    if not names:
        return None
    getter = operator.attrgetter(*names)
    get: Callable[[Any], Any] = getter if len(names) > 1 else (lambda obj: (getter(obj),))
    return f"{cls.__module__}:{cls.__qualname__}".encode(), get, names


def _encode_unit(
    record: Any,
    kwargs: dict[str, Any],
    arena: shm.Arena,
    peer: shm.Ring | None,
    booked: list[shm.ArrayDescriptor] | None = None,
) -> Encoded | None:
    """A unit's call in the fixed layout; None: it does not fit (pickle it)."""
    cls = type(record)
    kind = _unit_fields.get(cls, _UNKNOWN)
    if kind is _UNKNOWN:
        kind = _unit_kind(cls)
        if len(_unit_fields) < _CACHE_MAX:  # classes made on the fly are not all kept
            _unit_fields[cls] = kind
    if kind is None:
        return None
    name, get, names = kind
    if len(record.__dict__) != len(names):
        return None  # attributes that are no field: pickle keeps them
    fields = get(record)
    # Every field a plain scalar (a unit's chunk, nearly always): one look in C, where
    # the loop below runs ~9 bytecodes a field.
    if not _SCALARS.issuperset(map(type, fields)):
        for v in fields:  # loops, not a helper: no Python call a unit
            if type(v) not in _SCALARS:
                if type(v) is not tuple:
                    return None  # marshal would write a NumPy number (a buffer) as bytes
                for x in v:
                    if type(x) not in _NUMBERS:
                        return None
    values = marshal.dumps(fields)
    outs = kwargs.get("out", _UNKNOWN)
    if outs is _UNKNOWN:
        n = _NO_OUT
    elif type(outs) is tuple and len(outs) < _NO_OUT:
        n = len(outs)
        for o in outs:
            if o is not None and type(o) is not Writable:
                return None
    else:
        return None
    refs = _NOTHING_SHARED
    parts = [_UNIT_HEAD.pack(_UNIT, n, len(name), len(values)), name, values]
    if n != _NO_OUT:
        # Its bookkeeping alone, not a pickler's (~70 bytecodes a unit less).
        refs = _Shared(arena, peer, -1, booked)
        try:  # (a failure, or a Ctrl-C, gives back what the blocks before it shared)
            for o in outs:
                if o is None:
                    parts.append(_DESC_LEN.pack(0))
                    continue
                desc = o.desc  # (each share booked in refs.shared)
                if desc is not None and arena.share_described(desc, peer, refs.shared):
                    packed = o.packed
                else:
                    desc = arena.share_own(o.array, peer, refs.shared)
                    if desc is None:
                        raise SerializationError(_NOT_SHARED)  # noqa: TRY301 - the rest back
                    packed = desc.pack()
                refs.bytes_shared += o.array.nbytes
                parts.append(_DESC_LEN.pack(len(packed)))
                parts.append(packed)
        except BaseException:
            refs.undo()
            raise
    return Encoded(b"".join(parts), refs)


def _decode_unit(data: bytes | memoryview) -> Any:
    """The call :func:`_encode_unit` wrote: ``((record,), kwargs)``; blocks lent writable."""
    _, n, name_len, values_len = _UNIT_HEAD.unpack_from(data, 0)
    pos = _UNIT_HEAD.size
    name = bytes(data[pos : pos + name_len])
    pos += name_len
    kind = _unit_classes.get(name)
    if kind is None:
        module, _, qualname = name.decode().partition(":")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        found = _unit_kind(cls) if isinstance(cls, type) else None
        if found is None or found[0] != name:
            raise SerializationError(f"{name.decode()} is not a record a call can carry")
        kind = (cls, found[2])
        if len(_unit_classes) < _CACHE_MAX:
            _unit_classes[name] = kind
    cls, names = kind
    record = cls.__new__(cls)
    record.__dict__.update(zip(names, marshal.loads(data[pos : pos + values_len]), strict=True))
    pos += values_len
    if n == _NO_OUT:
        return (record,), {}
    outs: list[Any] = []
    for _ in range(n):
        (size,) = _DESC_LEN.unpack_from(data, pos)
        pos += _DESC_LEN.size
        if not size:
            outs.append(None)
            continue
        desc = shm.ArrayDescriptor.unpack(data[pos : pos + size])
        pos += size
        # As _load_ref's writable kind: mapped alone, lent for this call only.
        view = shm.open_array(desc, writable=True, alone=True)
        _lent.append(view)
        outs.append(view)
    return (record,), {"out": tuple(outs)}


def _call_parts(value: tuple[tuple[Any, ...], dict[str, Any]]) -> list[tuple[Any, str]]:
    args, kwargs = value
    parts = [(v, f"args[{i}]") for i, v in enumerate(args)]
    return parts + [(v, f"kwargs[{k!r}]") for k, v in kwargs.items()]


def encode(
    value: Any,
    arena: shm.Arena | None,
    peer: shm.Ring | None = None,
    what: str = "value",
    inline_max: int = INLINE_MAX,
    parts: Callable[[Any], list[tuple[Any, str]]] | None = None,
    owner: shm.Arena | None = None,
    booked: list[shm.ArrayDescriptor] | None = None,
) -> Encoded:
    """Pickle ``value`` with its arrays by reference; SerializationError if it cannot.

    ``parts(value)``: the pieces of ``value`` and their names, where a failure
    is looked for first (default: ``value`` itself, named ``what``).
    """
    buf = io.BytesIO()
    refs = _Refs(buf, arena, peer, inline_max, owner, booked)
    try:
        refs.dump(value)
        data = buf.getvalue()
        # Anything else pickle names in __main__ (its classes went by reference).
        by_value = refs.names_main or _mentions_main(data) > refs.main_in_refs
    except (SerializationError, MemoryError, shm.SharedMemoryError):
        # Ours, naming the problem already, or shared memory that ran out or
        # broke while an array was shared (shm.ReservationError is a
        # MemoryError): not a pickling problem, so no fallback and no disguise.
        refs.undo()
        raise
    except Exception:
        by_value = True
    except BaseException:  # (a Ctrl-C: what was shared goes back)
        refs.undo()
        raise
    if by_value:
        refs.undo()
        spawned_main_by_value()
        buf = io.BytesIO()
        try:
            _CloudPickler(buf, refs).dump(value)
        except Exception as exc:
            refs.undo()
            pieces = parts(value) if parts is not None else []
            bad = next((p for p in pieces if not _picklable(p[0])), (value, what))
            raise SerializationError(describe_unpicklable(bad[0], bad[1], exc)) from exc
        except BaseException:
            refs.undo()
            raise
        data = buf.getvalue()
    return Encoded(data, refs)


def check(value: Any, what: str = "value") -> int:
    """The bytes of ``value``'s arrays; SerializationError if it cannot be encoded.

    Nothing is shared or copied: the arrays are counted, the rest pickled
    (as :func:`encode` would, with the same fallback to cloudpickle).
    """
    return encode(value, None, None, what, inline_max=-1).bytes_shared


def decode(data: bytes | memoryview, writable: bool = False, shared_ok: bool = False) -> Any:
    """The value :func:`encode` pickled; its arrays are views, read-only unless asked.

    ``writable`` arrays that arrive as read-only shared views (forwarded) are
    copied, unless ``shared_ok`` says read-only views will do.
    """
    tag = data[0]
    if tag == _PLAIN:
        return _decode_plain(data, writable, shared_ok)
    if tag == _UNIT:
        return _decode_unit(data)
    # No reference of ours in it (a pipeline unit's result): pickle's own loads,
    # whose class look-ups run no Python call (the Unpickler's find_class does).
    raw: object = data if isinstance(data, bytes) else data.obj
    if type(raw) is bytes and b"_ref" not in raw:
        return pickle.loads(data)
    return _UNPICKLERS[writable, shared_ok](io.BytesIO(data)).load()


def dump_value(value: Any, what: str = "function") -> bytes:
    """Functions by value where they must be (lambdas, closures), by reference otherwise."""
    spawned_main_by_value()
    try:
        return bytes(cloudpickle.dumps(value, protocol=5))
    except Exception as exc:
        raise SerializationError(describe_unpicklable(value, what, exc)) from exc


def _picklable(obj: Any) -> bool:
    try:
        _CloudPickler(io.BytesIO(), _Refs(io.BytesIO(), None, None, -1)).dump(obj)
    except Exception:
        return False
    return True


def _children(obj: Any, path: str) -> list[tuple[Any, str]]:
    if isinstance(obj, (list, tuple)):
        return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return [(v, f"{path}[{k!r}]") for k, v in obj.items()]
    if isinstance(obj, (set, frozenset)):
        return [(v, f"{path} (an element)") for v in obj]
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        return [(v, f"{path}.{k}") for k, v in attrs.items()]
    return []


def describe_unpicklable(value: Any, what: str, exc: BaseException) -> str:
    """Name the innermost part of ``value`` that cannot be pickled, and why."""
    node, path, depth = value, what, 0
    while depth < 64:
        bad = next((c for c in _children(node, path) if not _picklable(c[0])), None)
        if bad is None:
            break
        node, path = bad
        depth += 1
    return (
        f"cannot pickle {path}: {type(node).__module__}.{type(node).__qualname__} "
        f"object {_short_repr(node)} cannot be pickled ({type(exc).__name__}: {exc}). "
        "Pass data that pickles (arrays, numbers, strings, containers of them), or create "
        "the object inside the function or in worker_init"
    )


def _short_repr(obj: Any) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
