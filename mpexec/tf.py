"""TensorFlow back-end: a pipeline as a ``tf.data.Dataset``.

Not to be confused with mpexec's TF-compatible entry points (``mpexec.py_func``
and friends, in ``_tf.py``), which never import TensorFlow; this module does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

try:
    import tensorflow as tf
except ImportError as _exc:  # pragma: no cover - exercised without TensorFlow installed
    raise ImportError(
        "mpexec.tf needs TensorFlow, which is not installed: pip install 'mpexec[tf]'"
    ) from _exc

import numpy as np

from ._batch import Batch
from ._pipeline import Pipeline

__all__ = ["dataset", "element_spec"]


def dataset(pipe: Pipeline) -> Any:
    """A ``tf.data.Dataset`` of the pipeline's iterations, one tuple of tensors each.

    Its ``element_spec`` is :func:`element_spec`: from the outputs' declared
    ``output_dtypes``/``output_shapes`` where every output declares both, else
    from the pipeline's first iteration (which is kept and yielded first).
    Every iteration of the dataset after the first starts a new epoch of the
    pipeline (``pipe.reset()``). Outputs must be dense (one shape per batch).
    """
    first: list[tuple[Batch, ...]] = []
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
    epochs = [0]

    def generate() -> Iterator[tuple[np.ndarray[Any, Any], ...]]:
        if epochs[0] > 0 or not first:
            if epochs[0] > 0:
                pipe.reset()
            source: Iterator[tuple[Batch, ...]] = iter(pipe)
        else:
            source = _chain(first.pop(), pipe)
        epochs[0] += 1
        for outputs in source:
            yield tuple(_dense(b, i) for i, b in enumerate(outputs))

    return tf.data.Dataset.from_generator(generate, output_signature=spec)


def element_spec(pipe: Pipeline) -> tuple[Any, ...] | None:
    """The ``tf.TensorSpec`` of each output, from its op's declarations; None if undeclared.

    The first dimension (the batch) is None: the last batch of an epoch may be
    short. A declared dimension of None or -1 stays None.
    """
    return _declared_spec(pipe)


def _declared_spec(pipe: Pipeline) -> tuple[Any, ...] | None:
    pipe.build()
    graph = pipe._graph  # noqa: SLF001 - the pipeline's graph has no public face yet
    assert graph is not None
    specs = []
    for node in graph.outputs:
        op = node.op
        if op.output_dtypes is None or op.output_shapes is None:
            return None
        dtype, shape = op.output_dtypes[node.index], op.output_shapes[node.index]
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


def _chain(first: tuple[Batch, ...], pipe: Pipeline) -> Iterator[tuple[Batch, ...]]:
    yield first
    yield from pipe
