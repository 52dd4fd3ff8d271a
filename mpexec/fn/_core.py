"""The ops of :mod:`mpexec.fn` (that package re-exports them; its sub-modules use them)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _arith, _codec
from .._errors import OpArgumentError, SerializationError
from .._graph import MAX_INPUTS, DataNode, Graph, Op, current_graph, loose_graph
from .._modes import WORKER_SOURCES, Device, OpKind, Reseed, SourceMode
from .._types import ScalarConstant, as_numpy_dtype


def python_function(
    *inputs: DataNode,
    function: Callable[..., Any],
    batch_processing: bool = False,
    num_outputs: int = 1,
    output_layouts: str | Sequence[str | None] | None = None,
    preserve: bool = False,
    seed: int = -1,
    device: str | None = "cpu",
    bytes_per_sample_hint: int | Sequence[int] = 0,
    name: str | None = None,
    stateful: bool = False,
    output_dtypes: Any = None,
    output_shapes: Any = None,
    reseed: str = "auto",
) -> Any:
    """Run ``function`` on the inputs, in the workers (DALI's ``fn.python_function``).

    Per sample (the default) the function gets one array per input and
    returns one array, or a tuple of exactly ``num_outputs`` arrays; with
    ``batch_processing=True`` it gets a list of arrays per input and returns,
    per output, a list of arrays or one array whose first axis is the batch.
    Inputs are read-only. A function taking an ``rng`` keyword gets a
    ``numpy.random.Generator`` seeded from (pipeline seed, op, iteration,
    sample); ``np.random`` and ``random`` give each call the draws of being
    reseeded the same way before it.

    The function is called once per sample, with one bounded exception.
    ``reseed="auto"`` (the default) declares it stateless: reseeding costs
    about 5 us, so once its calls in a worker have all been cheap (under
    ~50 us) and drawn nothing from ``np.random``/``random``, they run on the
    state as it is, and a call that then draws runs again, reseeded (once
    per worker; its later calls all reseed first). A function whose calls
    take longer, or that draws early, is never run twice. ``reseed="always"``
    reseeds before every call and never runs one twice (for a function with
    side effects: a file it claims, a counter, a log line); ``stateful=True``,
    ``preserve=True``, ``num_outputs=0``, GPU ops and every op of a pipeline
    or pool with a ``timeout`` imply it.

    ``stateful=True``: calls run in order on one worker and the op is never
    merged or pruned. ``preserve=True`` or ``num_outputs=0`` keep it from
    pruning. ``output_dtypes``/``output_shapes`` (one per output, or one
    for all; ``None`` or ``-1`` for any size) are checked; a dtype may be a
    ``types.DALIDataType``. Inputs are DataNodes or ``types.Constant``
    scalars. Returns a DataNode, a list of ``num_outputs`` DataNodes, or
    None for ``num_outputs=0``.
    """
    kw = dict(locals())
    del kw["inputs"]
    return _python_function(OpKind.PYTHON_FUNCTION, inputs, dlpack=False, **kw)


def dl_tensor_python_function(
    *inputs: DataNode,
    function: Callable[..., Any],
    batch_processing: bool = False,
    num_outputs: int = 1,
    output_layouts: str | Sequence[str | None] | None = None,
    preserve: bool = False,
    seed: int = -1,
    device: str | None = "cpu",
    bytes_per_sample_hint: int | Sequence[int] = 0,
    name: str | None = None,
    stateful: bool = False,
    output_dtypes: Any = None,
    output_shapes: Any = None,
    synchronize_stream: bool = True,
    reseed: str = "auto",
) -> Any:
    """:func:`python_function` for DLPack: inputs support ``__dlpack__`` and any
    DLPack producer may be returned (DALI's ``fn.dl_tensor_python_function``).
    On the CPU the inputs are NumPy arrays, which are DLPack producers.
    ``synchronize_stream`` is accepted for DALI's sake: a GPU op's inputs
    are always ready on its stream here.
    """
    kw = dict(locals())
    del kw["inputs"], kw["synchronize_stream"]
    return _python_function(OpKind.DL_TENSOR_PYTHON_FUNCTION, inputs, dlpack=True, **kw)


def _python_function(kind: OpKind, inputs: tuple[Any, ...], **kw: Any) -> Any:
    graph = graph_for(kind)
    name = kw["name"] if kw["name"] is not None else graph.unique_name(kind, kw["function"])
    what = f"fn.{kind} '{name}'"
    if not isinstance(name, str) or not name:
        raise TypeError(f"fn.{kind}: name must be a non-empty string, not {name!r}")
    function = kw["function"]
    if function is None or not callable(function):
        raise TypeError(f"{what}: function= must be a callable, not {type(function).__name__}")
    inputs = tuple(_constant_node(x, graph) if isinstance(x, ScalarConstant) else x for x in inputs)
    _check_inputs(what, inputs, graph)
    num_outputs = kw["num_outputs"]
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 0:
        raise ValueError(f"{what}: num_outputs must be an int >= 0, not {num_outputs!r}")
    device = _check_device(what, kw["device"], graph)
    seed = kw["seed"]
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < -1:
        raise ValueError(f"{what}: seed must be an int >= 0 (or -1 for derived), not {seed!r}")
    reseed = kw["reseed"]
    if not isinstance(reseed, str) or reseed not in set(Reseed):
        raise ValueError(
            f"{what}: reseed must be 'auto' (calls may be run again while cheap and "
            f"draw-free) or 'always' (reseed before every call, never run one twice), "
            f"not {reseed!r}"
        )
    if device is Device.CPU:  # a GPU op's function runs here, in this process
        _check_picklable(what, function, "function")
    op = Op(
        kind=kind,
        name=name,
        index=len(graph.ops),
        inputs=tuple(inputs),
        function=function,
        num_outputs=num_outputs,
        batch_processing=bool(kw["batch_processing"]),
        output_layouts=_layouts(what, kw["output_layouts"], num_outputs),
        preserve=bool(kw["preserve"]),
        seed=int(seed),
        device=device,
        bytes_per_sample_hint=_hint(kw["bytes_per_sample_hint"]),
        stateful=bool(kw["stateful"]),
        output_dtypes=_dtypes(what, kw["output_dtypes"], num_outputs),
        output_shapes=_shapes(what, kw["output_shapes"], num_outputs),
        dlpack=kw["dlpack"],
        reseed=Reseed(reseed),
    )
    return _outputs(graph.add(op, auto_named=kw["name"] is None))


def external_source(
    source: Any = None,
    num_outputs: int | None = None,
    *,
    batch: bool = True,
    cycle: bool | str | None = None,
    name: str | None = None,
    layout: str | Sequence[str | None] | None = None,
    dtype: Any = None,
    ndim: int | Sequence[int] | None = None,
    parallel: bool | None = None,
    batch_info: bool | None = False,
    prefetch_queue_depth: int | None = 1,
    device: str = "cpu",
    no_copy: bool | None = None,
    blocking: bool | None = None,
    bytes_per_sample_hint: int | Sequence[int] | None = None,
    cuda_stream: Any = None,
    use_copy_kernel: bool | None = None,
    repeat_last: bool = False,
) -> Any:
    """Data entering the pipeline (DALI's ``fn.external_source``).

    ``source`` may be:

    - a callable taking a :class:`SampleInfo`, with ``batch=False``: called
      once per sample **in the workers** (DALI's parallel external source);
    - a callable with ``batch=True``: called here, once per iteration, in
      order, with the iteration number (or a :class:`BatchInfo` with
      ``batch_info=True``, or nothing if it takes no argument);
    - an iterable, or a generator function: iterated here, in order; each
      item is a batch (``batch=True``) or one sample (``batch=False``);
      ``reset()`` starts it again (a generator function is called again);
    - None: data comes from ``pipe.feed_input(name, batch)``.

    ``StopIteration`` from a source ends the epoch: a last batch shorter than
    ``batch_size`` is returned as it is (``Pipeline(last_batch="drop")``
    drops it). With ``cycle=True`` (or ``"quiet"``) an iterable restarts
    instead of ending the epoch. ``num_outputs`` makes a source return a
    tuple of that many arrays per sample (or batch). ``dtype`` and ``ndim``,
    when given, are checked. ``parallel``, ``prefetch_queue_depth``,
    ``no_copy`` and ``blocking`` are accepted for DALI compatibility.
    """
    graph = graph_for("external_source")
    name_ = name if name is not None else graph.unique_name("external_source", source)
    what = f"fn.external_source '{name_}'"
    del prefetch_queue_depth, no_copy, blocking, bytes_per_sample_hint, cuda_stream
    del use_copy_kernel
    if repeat_last:
        raise ValueError(
            f"{what}: repeat_last=True (DALI's repeat of the last fed batch) is not "
            "supported: feed every batch with pipe.feed_input"
        )
    if cycle is None:  # DALI's default: the source ends the epoch, once
        cycle = False
    n: object = 1 if num_outputs is None else num_outputs
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what}: num_outputs must be an int >= 1, not {num_outputs!r}")
    if _check_device(what, device, graph) is Device.GPU:
        raise ValueError(
            f"{what}: device='gpu' sources are not supported; a source yields host "
            "arrays, and a GPU op that consumes them gets them on the device"
        )
    if cycle not in (False, True, "quiet", "no_quiet", "raise"):
        raise ValueError(f"{what}: cycle must be False, True, 'quiet' or 'raise', not {cycle!r}")
    mode = _source_mode(what, source, batch, parallel)
    if source is None and name is None:
        raise ValueError(
            f"{what}: a source without source= is fed by pipe.feed_input(name, data): "
            "give it a name="
        )
    if mode in (SourceMode.BATCH, SourceMode.WORKER_BATCH):
        source = _BatchCallable(source, bool(batch_info), graph.batch_size)
    elif mode is SourceMode.WORKER_ITER:
        source = _BatchIterable(source, graph.batch_size)
    if mode in WORKER_SOURCES:
        _check_picklable(what, source, "source")
    dtypes = None
    if dtype is not None:
        # One dtype for every output, or (DALI) a list of one per output.
        per_output = isinstance(dtype, (list, tuple))
        dtypes = _dtypes(what, dtype if per_output or n == 1 else [dtype] * n, n)
    shapes = None
    if ndim is not None:
        ndims: list[Any] = list(ndim) if isinstance(ndim, (list, tuple)) else [ndim] * n
        if len(ndims) != n:
            raise OpArgumentError(f"{what}: {len(ndims)} ndim given for {n} outputs")
        shapes = tuple((None,) * int(d) for d in ndims)
    op = Op(
        kind=OpKind.EXTERNAL_SOURCE,
        name=name_,
        index=len(graph.ops),
        inputs=(),
        function=source,
        num_outputs=n,
        batch_processing=bool(batch),
        output_layouts=_layouts(what, layout, n),
        output_dtypes=dtypes,
        output_shapes=shapes,
        source_mode=mode,
        cycle=cycle,
        # Read in order in one worker: pinned there, its calls in iteration order.
        stateful=mode is SourceMode.WORKER_ITER,
        parallel=bool(parallel),
    )
    return _outputs(graph.add(op, auto_named=name is None))


class _BatchCallable:
    """A batch source callable, called with what its signature asks for.

    ``batch_size``: the pipeline's, which a batch may not exceed (checked
    where it runs in the workers).
    """

    def __init__(self, function: Any, batch_info: bool, batch_size: int | None = None) -> None:
        self.function = function
        self.batch_info = batch_info
        self.takes_arg = _positional_params(function) > 0
        self.batch_size = batch_size

    def __call__(self, iteration: int, epoch: int) -> Any:
        from .._runtime import BatchInfo

        if self.batch_info:
            return self.function(BatchInfo(iteration, epoch))
        if self.takes_arg:
            return self.function(iteration)
        return self.function()


class _BatchIterable:
    """An iterable or generator function read in a worker (``parallel=True``, batch mode).

    ``open()`` starts a pass: the iterable itself (``iter()`` is taken of it),
    or a new generator from the generator function.
    """

    def __init__(self, source: Any, batch_size: int | None) -> None:
        self.source = source
        self.batch_size = batch_size

    def open(self) -> Any:
        return self.source() if inspect.isgeneratorfunction(self.source) else self.source


# ---------------------------------------------------------------- checks


def graph_for(kind: str) -> Graph:
    """The graph an op is added to: the one being defined, or (DALI 2) outside any
    definition, a loose one that a pipeline's ``set_outputs`` takes the op from."""
    del kind
    graph = current_graph()
    return loose_graph() if graph is None else graph


def _check_inputs(what: str, inputs: tuple[Any, ...], graph: Graph) -> None:
    if len(inputs) > MAX_INPUTS:
        raise ValueError(
            f"{what}: {len(inputs)} inputs given; at most {MAX_INPUTS} are allowed. "
            "Use batch_processing or combine inputs in an earlier op"
        )
    for i, x in enumerate(inputs):
        if isinstance(x, DataNode):
            graph.adopt(x)  # made outside any definition: this pipeline's now
            if x.op not in graph.ops:
                raise ValueError(f"{what}: input {i} ({x!r}) belongs to another pipeline")
            if x.op.num_outputs == 0:  # pragma: no cover - such ops return None
                raise ValueError(f"{what}: input {i} comes from an op with no outputs")
            continue
        if isinstance(x, (list, tuple)):
            # DALI's words, as its tests look for them.
            raise TypeError(
                f"{what}: input {i} is a {type(x).__name__}; Python operators do not support "
                "multiple input sets: pass each input as a separate positional argument: "
                "fn.python_function(*nodes, function=...)"
            )
        raise TypeError(
            f"{what}: input {i} is {type(x).__name__}, not a DataNode; inputs are outputs "
            "of other ops (or types.Constant scalars). Bind other constants into the "
            "function instead (functools.partial or a closure)"
        )


def _check_device(what: str, device: Any, graph: Graph | None = None) -> Device:
    """``device=`` (``"cpu"``, ``"gpu"`` or ``"cuda"``) as a :class:`Device`; a GPU op
    is checked here, where it is defined.

    No CuPy, no driver or no device is one clear error naming the op now,
    rather than a CUDA traceback at the first iteration.
    """
    if device in (Device.CPU, None):
        return Device.CPU
    if device == "mixed":
        raise ValueError(
            f"{what}: device='mixed' is DALI's decoding on the GPU: mpexec's ops run on the "
            "CPU (device='cpu') or on the GPU (device='gpu'); to keep DALI's GPU decoder, "
            "run it in DALI and call mpexec from there (mpexec.dali)"
        )
    if device not in (Device.GPU, "cuda"):
        raise ValueError(f"{what}: device must be 'cpu' or 'gpu', not {device!r}")
    from .. import _gpu  # CuPy is imported only from here on

    _gpu.require(what, None if graph is None else graph.device_id)
    return Device.GPU


def _check_picklable(what: str, function: Any, role: str) -> None:
    try:
        _codec.dump_value(function, role)
    except SerializationError as exc:
        raise SerializationError(
            f"{what}: its {role} must be sent to worker processes, but {exc}"
        ) from exc.__cause__


def _layouts(what: str, layouts: Any, n: int) -> tuple[str | None, ...]:
    if layouts is None:
        return (None,) * n
    if isinstance(layouts, str):
        return (layouts,) * n
    if not isinstance(layouts, (list, tuple)):
        raise TypeError(f"{what}: output_layouts must be a string or a list of strings")
    if len(layouts) > n:
        raise OpArgumentError(
            f"{what}: the length of output_layouts ({len(layouts)}) is greater than the "
            f"number of outputs ({n}); give at most one per output (a single string "
            "applies to all)"
        )
    for lay in layouts:
        if lay is not None and not isinstance(lay, str):
            raise TypeError(f"{what}: output_layouts holds {lay!r}; layouts are strings")
    return tuple(layouts) + (None,) * (n - len(layouts))


def _dtypes(what: str, dtypes: Any, n: int) -> tuple[np.dtype[Any] | None, ...] | None:
    if dtypes is None:
        return None
    items = list(dtypes) if isinstance(dtypes, (list, tuple)) else [dtypes] * n
    if len(items) != n:
        raise OpArgumentError(f"{what}: {len(items)} output_dtypes given for {n} outputs")
    out: list[np.dtype[Any] | None] = []
    for d in items:
        if d is None:
            out.append(None)
            continue
        try:
            out.append(as_numpy_dtype(d))  # NumPy, DALI's types enum, TensorFlow DTypes
        except TypeError as exc:
            raise TypeError(f"{what}: {d!r} is not a dtype ({exc})") from None
    return tuple(out)


def _shapes(what: str, shapes: Any, n: int) -> tuple[tuple[int | None, ...] | None, ...] | None:
    if shapes is None:
        return None
    single = isinstance(shapes, tuple) and all(s is None or isinstance(s, int) for s in shapes)
    items = [shapes] * n if single else list(shapes)
    if len(items) != n:
        raise OpArgumentError(f"{what}: {len(items)} output_shapes given for {n} outputs")
    out: list[tuple[int | None, ...] | None] = []
    for s in items:
        if s is None:
            out.append(None)
        elif isinstance(s, (list, tuple)) and all(d is None or isinstance(d, int) for d in s):
            out.append(tuple(s))
        else:
            raise TypeError(f"{what}: output shape {s!r} must be a tuple of ints or None")
    return tuple(out)


def _hint(hint: Any) -> int:
    if isinstance(hint, (list, tuple)):
        return max((int(h) for h in hint), default=0)
    return int(hint)


def _source_mode(what: str, source: Any, batch: bool, parallel: bool | None) -> SourceMode:
    """How a source gives its data; DALI's refusals (its words) of a source it cannot run.

    ``parallel=True`` runs a callable in the workers (per sample, or per batch
    with ``batch=True``), and an iterable or a generator function in one worker,
    which needs ``batch=True``. A per-sample callable always runs in the workers.
    """
    if source is None:
        return SourceMode.FEED
    generator = inspect.isgeneratorfunction(source)
    if generator or (not callable(source) and hasattr(source, "__iter__")):
        if isinstance(source, (str, bytes)):
            raise TypeError(f"{what}: source is a {type(source).__name__}, not an iterable")
        if parallel and not batch:
            kind = "a generator function" if generator else "an iterable"
            raise TypeError(
                f"{what}: Parallel external source with {kind} must be run in a batch mode "
                "(batch=True): each item is a batch, read in order in one worker"
            )
        return SourceMode.WORKER_ITER if parallel else SourceMode.ITER
    if callable(source):
        n = _positional_params(source)
        if n > 1:
            raise TypeError(
                f"{what}: The `source` callable must accept either 0 or 1 positional "
                "arguments to indicate whether it accepts the batch or sample indexing "
                "information. Found more than one positional argument, which is not allowed."
            )
        if parallel and n == 0:
            raise TypeError(
                f"{what}: Callable passed to External Source in parallel mode (when "
                "`parallel=True`) must accept exactly one argument: a SampleInfo with "
                "batch=False, or a BatchInfo or the iteration number with batch=True. Got a "
                "callable that does not accept arguments instead."
            )
        if not batch:
            return SourceMode.SAMPLE
        return SourceMode.WORKER_BATCH if parallel else SourceMode.BATCH
    raise TypeError(
        f"{what}: source must be a callable, an iterable, a generator function or None, "
        f"not {type(source).__name__}"
    )


def _positional_params(function: Any) -> int:
    try:
        params = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(
        1
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def _outputs(op: Op) -> Any:
    if op.num_outputs == 0:
        return None
    if op.num_outputs == 1:
        return op.outputs[0]
    return list(op.outputs)


# ---------------------------------------------------------------- constants


def constant(
    *,
    fdata: Any = None,
    idata: Any = None,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    layout: str | None = None,
    device: str | None = None,
    name: str | None = None,
    preserve: bool = False,
    bytes_per_sample_hint: int | Sequence[int] = 0,
) -> DataNode:
    """The same array for every sample (DALI's ``fn.constant``).

    ``fdata`` (float32 by default) or ``idata`` (int32 by default): a number
    or a list; ``shape`` reshapes it, or broadcasts a single value.
    """
    del preserve, bytes_per_sample_hint
    if (fdata is None) == (idata is None):
        raise ValueError("fn.constant: give exactly one of fdata= and idata=")
    data, default = (fdata, np.float32) if fdata is not None else (idata, np.int32)
    value = np.asarray(data, dtype=default if dtype is None else None).reshape(-1)
    return _constant(value, shape, dtype, layout, device, name)


def ones(
    *,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    layout: str | None = None,
    device: str | None = None,
    name: str | None = None,
    preserve: bool = False,
    bytes_per_sample_hint: int | Sequence[int] = 0,
) -> DataNode:
    """An array of ones per sample (DALI's ``fn.ones``; INT32 and shape ``()`` by default)."""
    del preserve, bytes_per_sample_hint
    return _constant(np.ones((), np.int32), shape or (), dtype, layout, device, name)


def zeros(
    *,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
    layout: str | None = None,
    device: str | None = None,
    name: str | None = None,
    preserve: bool = False,
    bytes_per_sample_hint: int | Sequence[int] = 0,
) -> DataNode:
    """An array of zeros per sample (DALI's ``fn.zeros``; INT32 and shape ``()`` by default)."""
    del preserve, bytes_per_sample_hint
    return _constant(np.zeros((), np.int32), shape or (), dtype, layout, device, name)


def _constant(
    value: np.ndarray[Any, Any],
    shape: Sequence[int] | None,
    dtype: Any,
    layout: str | None,
    device: str | None,
    name: str | None,
) -> DataNode:
    graph = graph_for("constant")
    name_ = name if name is not None else graph.unique_name("constant")
    what = f"fn.constant '{name_}'"
    if _check_device(what, device, graph) is Device.GPU:
        raise ValueError(f"{what}: constants are made on the CPU; a GPU op takes them as input")
    if dtype is not None:
        value = value.astype(as_numpy_dtype(dtype))
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        if value.size == int(np.prod(shape)):
            value = value.reshape(shape)
        elif value.size == 1:
            value = np.broadcast_to(value.reshape(()), shape)
        else:
            raise ValueError(f"{what}: {value.size} values cannot take the shape {shape}")
    out: DataNode = external_source(
        _arith.ConstantSource(value.copy(order="C")),
        batch=False,
        name=name_,
        layout=layout or None,
    )
    return out


def _constant_node(c: ScalarConstant, graph: Graph) -> DataNode:
    """A scalar constant used as an op's input: a constant op (DALI does the same)."""
    del graph  # the current one: _constant finds it
    return _constant(c.as_array(), None, None, None, None, None)
