"""What runs inside a worker for one op: seeding, sample info, calls, output checks.

The scheduler sends each op to the workers once, as an :class:`OpRunner`
(the pool caches it by identity), then calls it on chunks of samples. A
chunk's result is plain data the scheduler can assemble into batches.
Everything here runs the same inline (``num_workers=0``), so the checks and
the randomness are identical whichever process runs a call.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import resource
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._errors import InputMutatedError, OpOutputError
from ._globalrandom import GlobalRandom
from ._modes import CallKind
from ._rngseeds import RngSeeds
from ._tracebacks import pack_error


class SampleInfo(NamedTuple):
    """Where a per-sample call is: DALI's ``SampleInfo``.

    ``iteration`` counts iterations within the epoch.
    """

    idx_in_epoch: int
    idx_in_batch: int
    iteration: int
    epoch_idx: int


class BatchInfo(NamedTuple):
    """Where a batch call is: DALI's ``BatchInfo``."""

    iteration: int
    epoch_idx: int


_current: SampleInfo | BatchInfo | None = None

# SampleInfo(...) without its Python-level __new__: half the cost, once per sample.
_new_tuple: Any = tuple.__new__

_globals = GlobalRandom()

#: A call this fast costs about what reseeding does: only such calls may be speculative.
_CHEAP_SECONDS = 50e-6
#: Cheap, draw-free calls in a row (each reseeded) before a runner speculates.
_CHEAP_STREAK = 8

_perf = time.perf_counter


def reseed(np_seed: int, py_seed: int) -> None:
    """Reseed ``np.random`` and ``random`` for a call that always reseeds (GPU ops)."""
    _globals.reseed(np_seed, py_seed)


def sample_info() -> SampleInfo | BatchInfo | None:
    """Inside a pipeline op's call: where it is; None elsewhere."""
    return _current


def set_call_info(info: SampleInfo | BatchInfo | None) -> None:
    """What :func:`sample_info` returns from now on (for runners outside this module)."""
    global _current
    _current = info


@dataclass(frozen=True)
class Chunk:
    """One call of an op's runner: an iteration's samples ``start .. start+count``."""

    epoch: int
    iteration: int
    start: int  # index in the batch of the first sample
    count: int
    epoch_start: int  # index in the epoch of sample 0 of this batch
    # The batch indices of its samples where they are not start..start+count: an
    # op in a branch of an `if` on a DataNode runs on that branch's samples only.
    rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ChunkResult:
    """Per output, its column of the chunk (a list of arrays), and what it cost.

    A per-sample op's column holds one array per sample; a batch op's, its
    samples of the whole batch. A column the call wrote into its ``out``
    block is None (``written[i]`` is True): only the rows' count travels.
    """

    outputs: tuple[Any, ...]
    count: int  # samples computed (a source may stop early)
    seconds: float
    pid: int
    stop: int | None = None  # a source ended the epoch at this sample (batch index)
    per_op: tuple[tuple[float, int, int], ...] = ()  # a ChainRunner's (s, in, out) per op
    written: tuple[bool, ...] = ()
    faults: int = 0  # minor page faults the running thread took (Linux; else 0)
    cpu: float = 0.0  # the running thread's CPU seconds (per-sample runners; else 0)


def thread_faults() -> int:
    """Minor page faults of the calling thread so far (0 where not measurable)."""
    return _getrusage(_RUSAGE_THREAD).ru_minflt if _RUSAGE_THREAD is not None else 0


_getrusage = resource.getrusage
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def write_columns(
    rows: list[tuple[Any, ...]], n: int, out: tuple[Any, ...], early: bool = True
) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
    """The chunk's per-sample outputs as ``n`` columns, written into ``out`` where they fit.

    ``out[i]`` (or None) holds a row per sample of output ``i``, in the block
    of the whole batch: where every sample of the chunk has its shape and
    dtype, the rows are stacked into it in one copy and the column is None;
    otherwise (a sample departs from the learned shape) the column is the
    arrays, and the scheduler falls back to them. ``early``: :func:`row_writer`
    may have written rows already (False: no row is None, none is looked for).
    """
    columns: list[Any] = []
    written: list[bool] = []
    count = len(rows)
    for i in range(n):
        column = [r[i] for r in rows]
        block = out[i] if out else None
        if early and block is not None and count and any(v is None for v in column):
            # Rows :func:`row_writer` wrote as they were made (None): the rest join them.
            if _write_rest(column, block):
                columns.append(None)
                written.append(True)
            else:
                columns.append([block[j].copy() if v is None else v for j, v in enumerate(column)])
                written.append(False)
            continue
        if block is not None and count and write_block(column, block[:count]):
            columns.append(None)
            written.append(True)
            continue
        columns.append(column)
        written.append(False)
    return tuple(columns), tuple(written)


def _write_rest(column: list[Any], block: np.ndarray[Any, Any]) -> bool:
    """Copy ``column``'s rows not yet written (not None) into ``block``; False if one departs."""
    rest = [(j, v) for j, v in enumerate(column) if v is not None]
    row = block.shape[1:]
    if any(v.shape != row or v.dtype != block.dtype for _, v in rest):
        return False
    for j, v in rest:
        np.copyto(block[j], v, casting="no")
    return True


#: A per-sample output row this large is copied into its batch block as soon as it
#: is made, while still in the CPU's caches: copied at the chunk's end, after the
#: chunk's other samples, it is read back from memory (the demo's 600 KB images:
#: 53 us an image at the end, 12 as made). Smaller rows go in one copy at the end.
EARLY_ROW_BYTES = 64 << 10


def row_writer(out: tuple[Any, ...]) -> Callable[[tuple[Any, ...], int], tuple[Any, ...]] | None:
    """What writes a sample's large outputs into ``out`` as they are made; None: none to.

    The function takes a sample's outputs and its index ``j`` in the chunk,
    copies each output that has its block's row shape and dtype (a block of
    rows of :data:`EARLY_ROW_BYTES` or more) into row ``j``, and returns the
    outputs with those replaced by None; :func:`write_columns` completes them.
    """
    big = [
        (i, block)
        for i, block in enumerate(out)
        if block is not None
        and block.ndim > 1
        and block.flags.c_contiguous
        and block.itemsize * math.prod(block.shape[1:]) >= EARLY_ROW_BYTES
    ]
    if not big:
        return None

    def put(values: tuple[Any, ...], j: int) -> tuple[Any, ...]:
        for i, block in big:
            v = values[i]
            if (
                j < len(block)
                and type(v) is np.ndarray
                and v.shape == block.shape[1:]
                and v.dtype == block.dtype
            ):
                np.copyto(block[j], v, casting="no")
                values = (*values[:i], None, *values[i + 1 :])
        return values

    return put


_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(z: int) -> int:
    """SplitMix64's finalizer on a Python int (a 64-bit bijection, well mixed)."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """:func:`_mix_int` on a uint64 array (NumPy's array arithmetic wraps, silently)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    out: np.ndarray[Any, Any] = z ^ (z >> np.uint64(31))
    return out


def call_seeds(
    entropy: int,
    epoch: int,
    iteration: int,
    first: int,
    count: int,
    keys: Sequence[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Seeds of ``np.random`` and ``random`` for ``count`` calls of one op, at once.

    Call ``k`` of an iteration (``k = sample + 1``; 0 for a batch call) gets
    seeds that depend only on (entropy, epoch, iteration, k): a counter-based
    hash, computed for a whole chunk in a few array operations instead of a
    ``SeedSequence`` per call (which cost more than a light op itself).
    ``np.random`` takes 32 bits (its cheap legacy seeding), ``random`` 64.
    ``keys``: the calls' ``k`` where they are not ``first .. first+count``.
    """
    key = _mix_int((entropy >> 64) ^ _mix_int(entropy))
    key = _mix_int(key ^ _mix_int(epoch ^ _mix_int(iteration + _GOLDEN)))
    if keys is None:
        ks = np.arange(first, first + count, dtype=np.uint64)
    else:
        ks = np.asarray(keys, dtype=np.uint64)
    h = _mix_array(ks * np.uint64(_GOLDEN) + np.uint64(key))
    h2 = _mix_array(h ^ np.uint64(_mix_int(key + 1)))
    return (h >> np.uint64(32)).tolist(), h2.tolist()


def sample_seeds(entropy: int, chunk: Chunk) -> tuple[list[int], list[int]]:
    """:func:`call_seeds` of a chunk's per-sample calls: ``k`` is the sample's batch index + 1.

    A sample keeps its seeds inside a branch of an ``if`` on a DataNode
    (``chunk.rows``): an op there draws what it would for that sample unsplit.
    """
    if chunk.rows is None:
        return call_seeds(entropy, chunk.epoch, chunk.iteration, chunk.start + 1, chunk.count)
    return call_seeds(entropy, chunk.epoch, chunk.iteration, 0, 0, sample_keys(chunk))


def chain_seeds(entropies: Sequence[int], chunk: Chunk) -> list[tuple[list[int], list[int]]]:
    """:func:`sample_seeds` of each of a chain's ops over one chunk, in one pass of arrays.

    The same values, op by op; the array operations (~20 us a chunk) run
    once for the chain instead of once an op.
    """
    where = _mix_int(chunk.epoch ^ _mix_int(chunk.iteration + _GOLDEN))
    keys = [_mix_int(_mix_int((e >> 64) ^ _mix_int(e)) ^ where) for e in entropies]
    ks = np.asarray(sample_keys(chunk), dtype=np.uint64)
    h = _mix_array(ks * np.uint64(_GOLDEN) + np.array(keys, dtype=np.uint64)[:, None])
    h2 = _mix_array(h ^ np.array([_mix_int(k + 1) for k in keys], dtype=np.uint64)[:, None])
    return list(zip((h >> np.uint64(32)).tolist(), h2.tolist(), strict=True))


def sample_keys(chunk: Chunk) -> Sequence[int]:
    """The ``k`` of each of a chunk's per-sample calls: its sample's index in the batch + 1."""
    if chunk.rows is None:
        return range(chunk.start + 1, chunk.start + chunk.count + 1)
    return [b + 1 for b in chunk.rows]


def each_sample(
    chunk: Chunk,
    inputs: Sequence[Sequence[Any]],
    source: bool,
    call: Callable[[tuple[Any, ...], int, int], Any],
) -> tuple[list[Any], int | None]:
    """The per-sample loop of every runner (CPU, chained, GPU): one row per sample.

    For sample ``j`` of the chunk (``b``, its index in the batch), sets what
    :func:`sample_info` returns, takes the sample's arguments (its
    ``SampleInfo`` for a ``source``, else row ``j`` of each input column) and
    appends ``call(args, j, b)``. A ``source`` that raises StopIteration ends
    the epoch at that sample: returns (rows, ``b``); else (rows, None).
    """
    global _current
    rows = []
    stop = None
    iteration, epoch, first, start = chunk.iteration, chunk.epoch, chunk.epoch_start, chunk.start
    where = chunk.rows  # a branch's samples: their indices in the batch
    single = inputs[0] if len(inputs) == 1 and not source else None  # no list a sample
    try:
        for j in range(chunk.count):
            b = start + j if where is None else where[j]
            info = _current = _new_tuple(SampleInfo, (first + b, b, iteration, epoch))
            if source:
                args = (info,)
            elif single is not None:
                args = (single[j],)
            else:
                args = tuple([x[j] for x in inputs])
            try:
                rows.append(call(args, j, b))
            except StopIteration:
                if not source:
                    raise
                stop = b
                break
    finally:
        _current = None
    return rows, stop


def derive_seed(pipeline_seed: int, op_index: int, op_seed: int) -> int:
    """The entropy of an op's randomness: its own seed, or one from its position."""
    if op_seed != -1:
        return int(op_seed)
    state = np.random.SeedSequence([pipeline_seed, op_index]).generate_state(2, np.uint64)
    return int(state[0]) << 64 | int(state[1])


class OpRunner:
    """An op's function and declaration, shipped once to each worker.

    ``kind``: a :class:`CallKind` (or its string): ``"sample"`` (one call per
    sample), ``"batch"`` (one call with lists), ``"source"`` (a per-sample
    source callable taking SampleInfo).
    ``repeatable``: a call may run twice (see :meth:`_call`); False for
    stateful ops, ops kept for their side effects, ``reseed="always"`` and
    calls under a timeout.
    """

    def __init__(
        self,
        name: str,
        function: Any,
        kind: CallKind | str,
        num_outputs: int,
        entropy: int,
        output_dtypes: tuple[np.dtype[Any] | None, ...] | None = None,
        output_shapes: tuple[tuple[int | None, ...] | None, ...] | None = None,
        dlpack: bool = False,
        debug: bool = False,
        repeatable: bool = True,
    ) -> None:
        self.name = name
        self.function = function
        self.kind = CallKind(kind)
        self.num_outputs = num_outputs
        self.entropy = entropy
        self.output_dtypes = output_dtypes
        self.output_shapes = output_shapes
        # On the CPU a DLPack op's inputs go as they are (NumPy arrays are DLPack
        # producers already); its outputs are converted as every op's (_array).
        self.dlpack = dlpack
        self.debug = debug
        self.takes_rng = takes_keyword(function, "rng")
        self._seeds = RngSeeds(entropy) if self.takes_rng else None
        # Calls with nothing around them but the reseeding, and outputs with no
        # declaration to check, take a short path (most ops of most pipelines).
        self._plain = not (self.takes_rng or self.debug)
        self._unchecked = self.output_dtypes is None and self.output_shapes is None
        self._one_unchecked = self._unchecked and num_outputs == 1
        # Reseed before every call, for good: a call that may not run twice (stateful
        # ops, ops kept for their side effects, reseed="always", under a timeout)
        # cannot be speculative, nor one whose function drew (_globalrandom.GlobalRandom).
        self._always = not repeatable
        self._streak = 0  # cheap, draw-free reseeded calls in a row
        self._speculate = False  # after _CHEAP_STREAK of them: call on the state as it is
        self._where = (0, 0)  # (epoch, iteration) of the chunk running: rng's key

    def __call__(self, chunk: Chunk, *inputs: Any, out: tuple[Any, ...] = ()) -> ChunkResult:
        """Run the chunk; ``out``: per output, an array to write its rows into, or None."""
        global _current
        t0, c0 = time.perf_counter(), time.thread_time()
        faults = thread_faults()
        stop = None
        self._where = (chunk.epoch, chunk.iteration)
        _globals.known = False  # anything may have drawn since the last chunk (the caller)
        if self.kind is CallKind.BATCH:
            (np_seed,), (py_seed,) = call_seeds(self.entropy, chunk.epoch, chunk.iteration, 0, 1)
            # A batch function gets lists of samples, also of a batch held as one block.
            inputs = tuple(list(x) if isinstance(x, np.ndarray) else x for x in inputs)
            _current = BatchInfo(chunk.iteration, chunk.epoch)
            try:
                t = _perf()
                outputs = self._call(inputs, None, np_seed, py_seed)
                self._pace(_perf() - t, 1)
            finally:
                _current = None
            count = len(inputs[0]) if inputs else chunk.count
            columns, written = self._batch_outputs(outputs, count, out)
        else:
            np_seeds, py_seeds = sample_seeds(self.entropy, chunk)
            if self._seeds is not None:  # every call's rng, hashed at once
                self._seeds.prepare(self._where, sample_keys(chunk))
            call, outputs_of = self._call, self._sample_outputs
            put = row_writer(out)

            plain = self._one_unchecked

            def one(args: tuple[Any, ...], j: int, b: int) -> tuple[Any, ...]:
                got = call(args, b, np_seeds[j], py_seeds[j])
                # _sample_outputs' common case, without a call of its own.
                if plain and type(got) is np.ndarray and not got.dtype.hasobject:
                    values = (got,)
                else:
                    values = outputs_of(got, b)
                return values if put is None else put(values, j)

            t = _perf()
            rows, stop = each_sample(chunk, inputs, self.kind is CallKind.SOURCE, one)
            self._pace(_perf() - t, len(rows))
            count = len(rows)
            columns, written = write_columns(rows, self.num_outputs, out, put is not None)
        seconds = time.perf_counter() - t0
        faults = thread_faults() - faults
        return ChunkResult(
            columns,
            count,
            seconds,
            os.getpid(),
            stop,
            written=written,
            faults=faults,
            cpu=time.thread_time() - c0,
        )

    # ------------------------------------------------------------ calling
    def _call(self, args: tuple[Any, ...], sample: int | None, np_seed: int, py_seed: int) -> Any:
        """One call, as if global random state were reseeded from :func:`call_seeds` first.

        See ``_globalrandom.GlobalRandom``. A runner reseeds before each call and
        times it; after :data:`_CHEAP_STREAK` cheap calls in a row that drew
        nothing it speculates: while nothing has drawn from the global
        generators since they were last reseeded, a call runs on that state,
        and runs again reseeded if it drew from them (then the runner
        reseeds before every call for good). Speculative calls are not timed
        one by one (that cost a light op 3%): :meth:`_pace` ends the
        speculation after a chunk whose calls were no longer cheap.
        ``sample``: the index in the batch, None for a batch call.
        """
        g = _globals
        if self._speculate and (g.known or g.fresh()):
            try:  # on the state as it is
                result = self.function(*args) if self._plain else self._invoke(args, sample)
            except Exception as exc:
                if g.fresh():  # drew nothing: its error stands
                    _mark(exc, sample)
                    raise
            else:
                if g.fresh():
                    g.known = True
                    return result
            # It drew: run it again reseeded, and reseed before its calls from now on.
            self._speculate = False
            self._always = True
        g.reseed(np_seed, py_seed)
        if self._always or not g.watch:
            return self._invoke(args, sample)
        t = _perf()
        if self._plain:  # _invoke's plain call, without a call of its own
            try:
                result = self.function(*args)
            except Exception as exc:
                _mark(exc, sample)
                raise
        else:
            result = self._invoke(args, sample)
        if not g.fresh():  # it draws: speculating would run its calls twice
            self._always = True
        elif _perf() - t < _CHEAP_SECONDS:
            g.known = True
            self._streak += 1
            self._speculate = self._streak >= _CHEAP_STREAK
        else:
            g.known = True
            self._streak = 0
        return result

    def _pace(self, seconds: float, calls: int) -> None:
        """After a chunk of ``calls`` that took ``seconds``: stop speculating if not cheap.

        The streak of cheap reseeded calls starts over, so a function whose
        calls grew slow (larger inputs) is not run twice when it next draws.
        """
        if self._speculate and seconds > calls * _CHEAP_SECONDS:
            self._speculate = False
            self._streak = 0

    def _invoke(self, args: tuple[Any, ...], sample: int | None) -> Any:
        """The function's call: with ``rng`` and debug checks as declared."""
        if self._plain:
            try:
                return self.function(*args)
            except Exception as exc:
                _mark(exc, sample)
                raise
        kwargs = {}
        if self._seeds is not None:  # the function takes ``rng``
            seq = self._seeds.seq(self._where, 0 if sample is None else sample + 1)
            kwargs["rng"] = np.random.Generator(np.random.PCG64(seq))
        sums = _checksums(args) if self.debug else None
        try:
            return self.function(*args, **kwargs)
        except Exception as exc:
            _mark(exc, sample)
            raise
        finally:
            if sums is not None:
                self._check_unchanged(args, sums, sample)

    def _check_unchanged(self, args: tuple[Any, ...], sums: list[int], sample: int | None) -> None:
        for i, (a, s) in enumerate(zip(args, _checksums(args), strict=True)):
            if s != sums[i]:
                where = "" if sample is None else f" (sample {sample})"
                raise InputMutatedError(
                    f"function {_qualname(self.function)} of op '{self.name}' changed its "
                    f"input {i} in place{where}. Inputs are shared, read-only buffers: other "
                    "ops and later iterations may read the same bytes, so writing to them "
                    "makes results nondeterministic. Copy first (np.array(x)) and modify "
                    "the copy"
                )
            del a

    # ------------------------------------------------------------ outputs
    def _split(self, out: Any) -> tuple[Any, ...]:
        n = self.num_outputs
        if n == 0:
            return ()
        if n == 1:
            if self.kind is not CallKind.SAMPLE or not isinstance(out, (tuple, list)):
                return (out,)
            # DALI's rule: a tuple or list returned is the op's outputs, never
            # one array to stack (which would hide a num_outputs mistake).
            if len(out) != 1:
                raise OpOutputError(
                    f"op '{self.name}' has num_outputs=1, but its function returned a "
                    f"{type(out).__name__} of {len(out)} values: a tuple or list is read as "
                    f"the op's outputs. Return one array (np.stack(...) to combine them), "
                    f"or declare num_outputs={len(out)}"
                )
            return (out[0],)
        # "must be a tuple", "Unexpected number of outputs": DALI's words, which code
        # ported from DALI (and DALI's own tests) look for.
        if not isinstance(out, (tuple, list)):
            raise OpOutputError(
                f"op '{self.name}' has num_outputs={n}, so its function's result must be a "
                f"tuple of {n} outputs; it returned {type(out).__name__}"
            )
        if len(out) != n:
            raise OpOutputError(
                f"Unexpected number of outputs from op '{self.name}': got {len(out)}, expected "
                f"{n}. Its function returned {len(out)} outputs, but num_outputs={n}: the "
                f"result must be a tuple of {n} outputs"
            )
        return tuple(out)

    def _sample_outputs(self, out: Any, sample: int) -> tuple[Any, ...]:
        if self._one_unchecked:  # the common case, checked in a few attribute reads
            if type(out) is np.ndarray and not out.dtype.hasobject:
                return (out,)
        elif self._unchecked and type(out) is tuple and len(out) == self.num_outputs != 1:
            for v in out:
                if type(v) is not np.ndarray or v.dtype.hasobject:
                    break
            else:
                return out
        return tuple(
            self._checked(self._array(v, i, sample), i, sample)
            for i, v in enumerate(self._split(out))
        )

    def _batch_outputs(
        self, result: Any, size: int, out: tuple[Any, ...]
    ) -> tuple[tuple[Any, ...], tuple[bool, ...]]:
        columns: list[Any] = []
        written = [False] * len(out)
        for i, v in enumerate(self._split(result)):
            block = out[i] if out else None
            if isinstance(v, np.ndarray) or hasattr(v, "__dlpack__"):
                dense = self._array(v, i, None)
                if dense.ndim == 0 or dense.shape[0] != size:
                    raise OpOutputError(
                        f"output {i} of batch op '{self.name}' is one array of shape "
                        f"{dense.shape}; a batch output needs its first dimension to be the "
                        f"batch size {size} (or return a list of {size} arrays)"
                    )
                if block is not None and dense.shape == block.shape and dense.dtype == block.dtype:
                    if size:
                        self._checked(dense[0], i, 0)  # every row has row 0's shape and dtype
                    np.copyto(block, dense, casting="no")
                    written[i] = True
                    columns.append(None)
                    continue
                samples = list(dense)
            elif isinstance(v, (list, tuple)):
                if len(v) != size:
                    raise OpOutputError(
                        f"output {i} of batch op '{self.name}' holds {len(v)} samples; "
                        f"the batch has {size}"
                    )
                samples = [self._array(s, i, j) for j, s in enumerate(v)]
            else:
                raise OpOutputError(
                    f"output {i} of batch op '{self.name}' is {type(v).__name__}; a batch "
                    "op returns, per output, a list of arrays (one per sample) or one array "
                    "whose first dimension is the batch size"
                )
            for j, s in enumerate(samples):
                self._checked(s, i, j)
            check_consistent(f"op '{self.name}'", i, samples)
            if block is not None and write_block(samples, block):
                written[i] = True
                columns.append(None)
            else:
                columns.append(samples)
        return tuple(columns), tuple(written)

    def _array(self, value: Any, i: int, sample: int | None) -> np.ndarray[Any, Any]:
        if isinstance(value, np.ndarray):
            arr = value
        elif hasattr(value, "__dlpack__") and not isinstance(value, (bytes, str)):
            arr = np_from_dlpack(value)
        else:
            arr = np.asarray(value)
        if arr.dtype.hasobject and not is_string_array(arr):
            where = "" if sample is None else f" for sample {sample}"
            raise OpOutputError(
                f"output {i} of op '{self.name}'{where} is an array of Python objects "
                f"(from {type(value).__name__}); return numeric arrays, or arrays of "
                "strings (bytes or str)"
            )
        return arr

    def _checked(self, arr: np.ndarray[Any, Any], i: int, sample: int | None) -> Any:
        dtypes, shapes = self.output_dtypes, self.output_shapes
        where = "" if sample is None else f" for sample {sample}"
        if dtypes is not None and dtypes[i] is not None and arr.dtype != dtypes[i]:
            raise OpOutputError(
                f"output {i} of op '{self.name}'{where} is {arr.dtype}, but output_dtypes "
                f"declares {dtypes[i]}"
            )
        shape = shapes[i] if shapes is not None else None
        if shape is not None and not _shape_matches(arr, shape):
            raise OpOutputError(
                f"output {i} of op '{self.name}'{where} has shape {arr.shape}, but "
                f"output_shapes declares {shape}"
            )
        return arr


def is_string_array(arr: np.ndarray[Any, Any]) -> bool:
    """An object array holding only ``bytes``/``str``: it travels pickled."""
    return arr.dtype == object and all(isinstance(v, (bytes, str)) for v in arr.flat)


def same_kind_of_sample(a: Any, b: Any) -> bool:
    """One rank and dtype; byte and text strings may differ in length."""
    if a.ndim != b.ndim:
        return False
    return bool(a.dtype == b.dtype or (a.dtype.kind in "SU" and a.dtype.kind == b.dtype.kind))


class ChainRunner:
    """Per-sample ops that feed only each other, run back to back in one call.

    A chain ``decode -> crop -> flip`` costs one round trip per chunk instead
    of three, and its intermediate arrays never leave the worker. Each op
    keeps its own seed and checks, so results equal those of separate calls.
    """

    def __init__(self, runners: list[OpRunner], picks: list[tuple[int, ...]]) -> None:
        self.runners = runners
        self.picks = picks  # per op: which outputs of the previous one it takes

    def __call__(self, chunk: Chunk, *inputs: Any, out: tuple[Any, ...] = ()) -> ChunkResult:
        """Run the chunk through every op; ``out`` as :meth:`OpRunner.__call__`."""
        t0, c0 = time.perf_counter(), time.thread_time()
        faults = thread_faults()
        spent = [[0.0, 0, 0] for _ in self.runners]
        source = self.runners[0].kind is CallKind.SOURCE
        seeds = chain_seeds([r.entropy for r in self.runners], chunk)
        keys = sample_keys(chunk)
        for r in self.runners:
            r._where = (chunk.epoch, chunk.iteration)  # noqa: SLF001 - a chain runs its runners' steps
            if r._seeds is not None:  # noqa: SLF001 - as above
                r._seeds.prepare(r._where, keys)  # noqa: SLF001 - as above
        _globals.known = False  # anything may have drawn since the last chunk (the caller)
        # Per op: (index, its runner's call and output check, its seeds, its stats,
        # which outputs of the op before it takes (None: all, in order), whether its
        # outputs feed another op, whether it has one output, and one undeclared).
        last = len(self.runners) - 1
        steps = [
            (
                k,
                r._call,  # noqa: SLF001 - a chain runs its runners' steps (same module)
                r._sample_outputs,  # noqa: SLF001 - as above
                *seeds[k],
                spent[k],
                None if not k or p == tuple(range(self.runners[k - 1].num_outputs)) else p,
                k != last,
                r.num_outputs == 1,
                r._one_unchecked,  # noqa: SLF001 - as above
            )
            for k, (r, p) in enumerate(zip(self.runners, self.picks, strict=True))
        ]
        perf = time.perf_counter
        put = row_writer(out)
        # An op's input bytes are the bytes of the op before it's outputs, where it
        # takes them all (filled in once the chunk is done): counted for the head,
        # and where an op picks, only.
        counted_in = source

        def one(values: tuple[Any, ...], j: int, b: int) -> tuple[Any, ...]:
            k = 0
            try:
                if not counted_in:
                    nbytes = 0
                    for v in values:
                        nbytes += v.nbytes
                    spent[0][1] += nbytes
                t = perf()
                for (
                    k,
                    call,
                    outputs_of,
                    np_seeds,
                    py_seeds,
                    counts,
                    pick,
                    feeds,
                    single,
                    plain,
                ) in steps:
                    if pick is not None:
                        values = tuple([values[i] for i in pick])
                        nbytes = 0
                        for v in values:
                            nbytes += v.nbytes
                        counts[1] += nbytes
                    try:
                        got = call(values, b, np_seeds[j], py_seeds[j])
                    except StopIteration as exc:
                        if k:  # not the source's end: the loop must not take it for one
                            with contextlib.suppress(AttributeError):
                                exc.mpexec_op = self.runners[k].name  # type: ignore[attr-defined]
                            raise _Passed(exc) from None
                        raise
                    # _sample_outputs' common case, without a call of its own.
                    if plain and type(got) is np.ndarray and not got.dtype.hasobject:
                        values = (got,)
                    else:
                        values = outputs_of(got, b)
                    if single:
                        v = values[0]
                        if feeds:  # the next op gets it as its input: a read-only view
                            v = v.view()
                            v.setflags(False)  # (write=False, positionally: half the cost)
                            values = (v,)
                        nbytes = v.nbytes
                    else:
                        if feeds:
                            values = tuple([v.view() for v in values])
                            for v in values:
                                v.setflags(False)
                        nbytes = 0
                        for v in values:
                            nbytes += v.nbytes
                    now = perf()
                    counts[0] += now - t
                    t = now
                    counts[2] += nbytes
            except BaseException as exc:
                with contextlib.suppress(AttributeError):
                    exc.mpexec_op = self.runners[k].name  # type: ignore[attr-defined]
                raise
            return values if put is None else put(values, j)

        try:
            rows, stop = each_sample(chunk, inputs, source, one)
        except _Passed as passed:
            raise passed.args[0] from None
        for k in range(1, len(steps)):
            if steps[k][6] is None:
                spent[k][1] = spent[k - 1][2]
        per_op = tuple((float(c[0]), int(c[1]), int(c[2])) for c in spent)
        for r, c in zip(self.runners, spent, strict=True):
            r._pace(c[0], len(rows))  # noqa: SLF001 - as above
        count = len(rows)
        columns, written = write_columns(rows, self.runners[-1].num_outputs, out, put is not None)
        seconds = time.perf_counter() - t0
        faults = thread_faults() - faults
        cpu = time.thread_time() - c0
        return ChunkResult(columns, count, seconds, os.getpid(), stop, per_op, written, faults, cpu)


class _Passed(Exception):
    """Carries a chained op's StopIteration through :func:`each_sample` unchanged."""


def nbytes(column: Any) -> int:
    """Bytes of a column: one array, or a list of them (None: nothing)."""
    if column is None:
        return 0
    if isinstance(column, np.ndarray):
        return int(column.nbytes)
    return sum(int(a.nbytes) for a in column)


def write_block(samples: list[Any], block: np.ndarray[Any, Any]) -> bool:
    """Stack ``samples`` into ``block`` if each has its row's shape and dtype; else False.

    One ``concatenate`` into the block seen as one long run of rows: a
    quarter of what ``np.stack`` costs for small samples (it reshapes each).
    """
    shape = block.shape[1:]
    if len(samples) != len(block) or {a.shape for a in samples} != {shape}:
        return False
    if not shape:  # scalars: nothing to concatenate along
        if {a.dtype for a in samples} != {block.dtype}:
            return False
        np.stack(samples, out=block)
        return True
    if not block.flags.c_contiguous:  # not a block of ours: the arrays go instead
        return False
    flat = block.reshape(-1, *shape[1:])  # of a contiguous block: a view, never a copy
    try:
        np.concatenate(samples, out=flat, casting="no")
    except TypeError:  # a sample's dtype departs (checked before anything is written)
        return False
    return True


def check_consistent(what: str, i: int, samples: Sequence[Any]) -> None:
    """Every sample of output ``i`` of ``what`` (an op) has one dtype and one rank."""
    if not samples:
        return
    first = samples[0]
    for j, s in enumerate(samples):
        if not same_kind_of_sample(s, first):
            raise OpOutputError(
                f"output {i} of {what} is inconsistent across the batch: sample 0 is "
                f"{first.dtype} of rank {first.ndim}, sample {j} is {s.dtype} of rank "
                f"{s.ndim}; every sample of an output needs one dtype and one rank"
            )


def _shape_matches(arr: np.ndarray[Any, Any], shape: tuple[int | None, ...]) -> bool:
    if arr.ndim != len(shape):
        return False
    return all(
        want is None or want < 0 or want == got for got, want in zip(arr.shape, shape, strict=True)
    )


def _mark(exc: BaseException, sample: int | None) -> None:
    # Travels with the pickled exception (BaseException pickles its __dict__).
    with contextlib.suppress(AttributeError):  # exceptions with __slots__
        exc.mpexec_sample = sample  # type: ignore[attr-defined]


def _checksums(args: tuple[Any, ...]) -> list[int]:
    sums = []
    for a in args:
        if isinstance(a, np.ndarray):
            sums.append(zlib.crc32(a.tobytes()))
        elif isinstance(a, list):
            sums.append(sum(zlib.crc32(np.asarray(x).tobytes()) for x in a))
        else:
            sums.append(0)
    return sums


#: ``np.from_dlpack`` (NumPy 1.22 called it ``np._from_dlpack``).
np_from_dlpack: Any = getattr(np, "from_dlpack", None) or getattr(np, "_from_dlpack", None)


def takes_keyword(function: Any, name: str) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _qualname(function: Any) -> str:
    return getattr(function, "__qualname__", None) or type(function).__qualname__


# Several iterations a unit (issue 37, see _grouping): here, where a pipeline's
# runners are, so a worker's first such call imports nothing (a module imported then
# held every worker back at the first grouped epoch's start: 2-40 ms each).
@dataclass(frozen=True)
class Chunks:
    """Whole batches of consecutive iterations of one epoch, for a :class:`ManyRunner`.

    A frozen record of numbers: it travels in the codec's fixed layout, with the
    batches' ``out`` blocks flattened, ``width`` a batch.
    """

    epoch: int
    iterations: tuple[int, ...]
    counts: tuple[int, ...]
    epoch_starts: tuple[int, ...]
    width: int


class ManyRunner:
    """Runs several iterations' units of one op in one call.

    Each runs in order on its inputs (``inputs``, one tuple per iteration; None:
    it has none) into its ``out`` blocks; a failed one's answer is its packed error
    (bytes), so each iteration fails alone.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.pickled: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # The pool pickles a function for each worker it first goes to: at 64 workers,
        # 64 x ~60 µs of the main process at the first grouped epoch's start (its ramp).
        if self.pickled is None:
            import cloudpickle  # (the main process has it; a worker needs only pickle)

            self.pickled = bytes(cloudpickle.dumps(self.runner, protocol=5))
        return _many_runner, (self.pickled,)

    def __call__(
        self, many: Chunks, inputs: tuple[Any, ...] | None = None, out: tuple[Any, ...] = ()
    ) -> tuple[Any, ...]:
        runner = self.runner
        width = many.width
        answers: list[Any] = []
        for i, index in enumerate(many.iterations):
            chunk = Chunk(many.epoch, index, 0, many.counts[i], many.epoch_starts[i])
            rows = inputs[i] if inputs is not None else ()
            try:
                answers.append(runner(chunk, *rows, out=out[i * width : (i + 1) * width]))
            except Exception as exc:
                answers.append(pack_error(exc))
        return tuple(answers)


def _many_runner(pickled: bytes) -> ManyRunner:
    import pickle  # (loaded in every worker: it unpickles its calls)

    return ManyRunner(pickle.loads(pickled))
