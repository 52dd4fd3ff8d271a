"""The modes a pipeline's parts switch on, as enums whose members are their strings.

Public arguments take the strings (``device="gpu"``, ``last_batch="drop"``);
the code that defines an op turns them into these members once, and the code
that acts on them compares with members, so a misspelt mode is a NameError at
import, not a branch silently never taken. Each member *is* its string
(``Device.GPU == "gpu"``, same hash, prints as ``gpu``), so an op built with a
plain string still behaves the same.
"""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """A mode named by a string: equal to, hashed and printed as its value."""

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Device(Mode):
    """Where an op's function runs: in the workers (``cpu``) or on the GPU stage."""

    CPU = "cpu"
    GPU = "gpu"


class OpKind(Mode):
    """What an op of the graph is."""

    PYTHON_FUNCTION = "python_function"
    DL_TENSOR_PYTHON_FUNCTION = "dl_tensor_python_function"
    EXTERNAL_SOURCE = "external_source"
    # DALI's conditional execution (mpexec._conditionals): run by the scheduler itself.
    SPLIT = "_conditional.split"  # the samples of one branch of an `if` on a DataNode
    MERGE = "_conditional.merge"  # both branches' samples, back in the batch's order


class SourceMode(Mode):
    """How an ``external_source`` gives its data (empty for other ops)."""

    NONE = ""
    SAMPLE = "sample"  # a callable of SampleInfo, run in the workers
    BATCH = "batch"  # a callable of (iteration, epoch), run here
    ITER = "iter"  # an iterable or generator, read here
    FEED = "feed"  # batches given with pipe.feed_input
    # DALI's parallel batch mode (parallel=True, batch=True): run in the workers.
    WORKER_BATCH = "worker_batch"  # a callable of (iteration, epoch), in any worker
    WORKER_ITER = "worker_iter"  # an iterable or generator, read in order in one worker


#: The sources whose calls run in the workers (their op has a runner), not here.
WORKER_SOURCES = (SourceMode.SAMPLE, SourceMode.WORKER_BATCH, SourceMode.WORKER_ITER)


class CallKind(Mode):
    """How a runner calls an op's function over a chunk."""

    SAMPLE = "sample"  # once per sample, with its arrays
    BATCH = "batch"  # once, with lists of the chunk's samples
    SOURCE = "source"  # once per sample, with its SampleInfo (a per-sample source)


class LastBatch(Mode):
    """What an epoch's short last batch becomes."""

    PARTIAL = "partial"  # returned as it is
    DROP = "drop"  # dropped


class Reseed(Mode):
    """When an op's calls reseed ``np.random`` and ``random`` (``python_function(reseed=)``)."""

    AUTO = "auto"  # before every call, until calls prove cheap and draw-free (then speculate)
    ALWAYS = "always"  # before every call: a call is never run twice
