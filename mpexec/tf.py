"""TensorFlow back-end: a pipeline as a ``tf.data.Dataset``.

Not to be confused with mpexec's TF-compatible entry points (``mpexec.py_func``
and friends, in ``_pyfunc.py`` and ``_pyfunc_tf.py``); this module imports TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

try:
    import tensorflow as tf
except ImportError as _exc:  # pragma: no cover - exercised without TensorFlow installed
    from ._extras import missing_message

    raise ImportError(missing_message("tf", _exc)) from _exc

import numpy as np

from ._batch import Batch
from ._pipeline import Pipeline

__all__ = ["dataset", "element_spec", "epoch_length"]


def dataset(pipe: Pipeline) -> Any:
    """A ``tf.data.Dataset`` of the pipeline's iterations, one tuple of tensors each.

    Its ``element_spec`` is :func:`element_spec`: from the outputs' declared
    ``output_dtypes``/``output_shapes`` where every output declares both, else
    from the pipeline's first iteration (which is kept and yielded first).
    Every iteration of the dataset after the first starts a new epoch of the
    pipeline (``pipe.reset()``). Outputs must be dense (one shape per batch).

    Its cardinality is the epoch's iterations when the sources tell it (each
    has a ``len()``; see :func:`epoch_length`) and the pipeline stands at the
    start of an epoch, so Keras knows its steps per epoch; else unknown. An
    epoch that does not end where the lengths say is an error.

    No copy of a dense output: the dataset's tensors alias the batch's
    shared memory, which TensorFlow takes as it is when 64-byte aligned
    (mpexec's arenas are). An output made sample by sample is stacked once
    into one aligned block (``Batch.as_array``); an array small enough to
    have ridden inside a ring record (16 KiB or less) is not aligned, and
    TensorFlow copies it.
    """
    first: list[tuple[Batch, ...]] = []
    length = epoch_length(pipe) if pipe.state_dict()["iteration"] == 0 else None
    spec = _declared_spec(pipe)
    if spec is None:
        try:
            first.append(pipe.run())
        except StopIteration:
            raise ValueError(
                "the pipeline yields no iteration, so no element spec can be taken from "
                "one: declare output_dtypes and output_shapes on its outputs' ops"
            ) from None
        spec = _spec_of(first[0])
    peeked_at = _position(pipe)
    epochs = [0]

    def generate() -> Iterator[tuple[np.ndarray[Any, Any], ...]]:
        if first and epochs[0] == 0 and _position(pipe) == peeked_at:
            source: Iterator[tuple[Batch, ...]] = _chain(first.pop(), pipe)
        else:
            # The kept iteration is stale if the pipeline was read meanwhile: a new epoch.
            stale = bool(first)
            first.clear()
            if epochs[0] > 0 or stale:
                pipe.reset()
            source = iter(pipe)
        epochs[0] += 1
        for outputs in source:
            yield tuple(_dense(b, i) for i, b in enumerate(outputs))

    if length is None:
        return tf.data.Dataset.from_generator(generate, output_signature=spec)
    return _counted(generate, length, spec)


def _counted(
    generate: Callable[[], Iterator[tuple[np.ndarray[Any, Any], ...]]],
    length: int,
    spec: tuple[Any, ...],
) -> Any:
    """``length`` iterations a pass, each fetched by one ``numpy_function`` call.

    Half the per-batch cost of ``from_generator`` (which checks every element's
    structure in Python), and the cardinality is the range's. Iteration 0
    starts a pass; the last one also checks that the epoch ends there.
    """
    passes: list[Iterator[tuple[np.ndarray[Any, Any], ...]]] = []

    def fetch(i: np.int64) -> list[np.ndarray[Any, Any]]:
        if i == 0:
            passes[:] = [generate()]
        try:
            out = next(passes[0])
        except StopIteration:
            raise ValueError(
                f"the pipeline's epoch ended after {int(i)} iterations, but its sources' "
                f"len() says {length}"
                + (
                    " (an iterable source that does not cycle is read once, as in DALI: "
                    "pass cycle='raise' to read it again each epoch)"
                    if i == 0
                    else ""
                )
            ) from None
        if i == length - 1 and next(passes[0], None) is not None:
            raise ValueError(
                f"the pipeline's epoch goes on past {length} iterations, the number its "
                "sources' len() says"
            )
        return list(out)

    def element(i: Any) -> tuple[Any, ...]:
        tensors = tf.numpy_function(fetch, [i], [s.dtype for s in spec], stateful=True)
        for t, s in zip(tensors, spec, strict=True):
            t.set_shape(s.shape)
        return tuple(tensors)

    return tf.data.Dataset.range(length).map(element)


def epoch_length(pipe: Pipeline) -> int | None:
    """Iterations in one epoch of ``pipe``, if its sources' lengths tell; else None.

    Every source that can end the epoch needs a ``len()``: a callable taking
    ``SampleInfo`` with ``__len__`` (samples), a list or another sized
    iterable (samples, or batches with ``batch=True``). With
    ``last_batch="drop"`` a short last batch does not count.
    """
    pipe.build()
    return pipe.epoch_length()


def element_spec(pipe: Pipeline) -> tuple[Any, ...] | None:
    """The ``tf.TensorSpec`` of each output, from its op's declarations; None if undeclared.

    The first dimension (the batch) is None: the last batch of an epoch may be
    short. A declared dimension of None or -1 stays None.
    """
    return _declared_spec(pipe)


def _declared_spec(pipe: Pipeline) -> tuple[Any, ...] | None:
    specs = []
    pipe.build()
    for dtype, shape in pipe.declared_outputs():
        if dtype is None or shape is None:
            return None
        dims = [None if d is None or d < 0 else int(d) for d in shape]
        specs.append(tf.TensorSpec([None, *dims], tf.as_dtype(dtype)))
    return tuple(specs)


def _spec_of(outputs: tuple[Batch, ...]) -> tuple[Any, ...]:
    specs = []
    for i, b in enumerate(outputs):
        array = _dense(b, i)
        specs.append(tf.TensorSpec([None, *array.shape[1:]], tf.as_dtype(array.dtype)))
    return tuple(specs)


def _dense(batch: Batch, i: int) -> np.ndarray[Any, Any]:
    if not batch.is_dense():
        shapes = sorted(set(batch.shape()))[:4]
        raise ValueError(
            f"output {i} of the pipeline is ragged (sample shapes {shapes}): "
            "a tf.data element is one dense tensor per output; pad or crop to one shape"
        )
    return np.asarray(batch.as_array())


def _position(pipe: Pipeline) -> tuple[int, int]:
    state = pipe.state_dict()
    return int(state["epoch"]), int(state["iteration"])


def _chain(first: tuple[Batch, ...], pipe: Pipeline) -> Iterator[tuple[Batch, ...]]:
    yield first
    yield from pipe
