"""Chains: per-sample ops run inside the call of the op they feed (the scheduler's plan).

An op whose only consumer is the next per-sample op of the same executor runs
in that op's unit (a :class:`~mpexec._runtime.ChainRunner`): its values stay in
the worker, and the chain costs the main process one unit a chunk, not one an
op. A per-sample source run by the workers may head a chain, and a stateless
batch op may end one headed by the pipeline's one source (a
:class:`~mpexec._source_runners.SourceBatchRunner`: the samples read and the
batch made in one call). Worked out once, when the :class:`Scheduler` is built;
the chain's last op stands for it (``members``), the others are ``absorbed``.
"""

from __future__ import annotations

from ._executors import UnitExecutor
from ._iterations import OpState
from ._modes import SourceMode
from ._runtime import ChainRunner
from ._source_runners import SourceBatchRunner


def fuse_chains(
    ops: list[OpState],
    consumers: list[list[int]],
    outputs: set[int],
    executor: UnitExecutor,
    drop: bool,
) -> None:
    """Run per-sample ops that only feed the next one inside its call.

    ``consumers``: per op, the positions of the ops that wait for it;
    ``outputs``: the positions of the pipeline's outputs; ``executor``: the
    pipeline's (a chain never spans two); ``drop``: ``last_batch="drop"``.
    """
    pos = {id(s.op): s.pos for s in ops}

    def chainable(s: OpState) -> bool:
        op = s.op
        return (
            not (op.is_source or op.batch_processing or op.stateful)
            and s.runner is not None
            and s.executor is executor  # not across executors (GPU ops)
        )

    def batch_tail(s: OpState) -> bool:
        """A stateless batch op that may end a chain headed by a per-sample source.

        Only where that source is the pipeline's one source (another could
        end the epoch sooner, and the batch op would see samples past it),
        and outside the branches of an ``if`` on a DataNode (a branch's
        samples are picked here, from its predicate).
        """
        return (
            batch_in_workers(s, executor)
            and s.runner is not None
            and s.op.scope is None
            and len(sources) == 1
        )

    sources = [s for s in ops if s.op.is_source]
    for s in ops:
        tail = batch_tail(s)
        if not (chainable(s) or tail) or not s.op.inputs or s.op.num_outputs == 0:
            continue
        producers = {id(n.op) for n in s.op.inputs}
        if len(producers) != 1:
            continue
        p = ops[pos[id(s.op.inputs[0].op)]]
        # A per-sample source in the workers may head a chain too: its ops
        # then run before the batch size is known, on samples a StopIteration
        # may drop (they are stateless: the waste is one partial chunk).
        # A batch op ends such a chain only: it needs its samples in one call.
        if tail:
            head_ok = p.members[0].op.source_mode == SourceMode.SAMPLE
        else:
            head_ok = chainable(p) or p.op.source_mode == SourceMode.SAMPLE
        if (
            head_ok
            and consumers[p.pos] == [s.pos]
            and p.pos not in outputs
            and not (p.op.is_source and len(s.op.inputs) != p.op.num_outputs)
        ):
            s.members = [*p.members, s]
            s.source = p.source
            s.inputs = p.inputs
            s.waits = p.waits
            for m in p.members:
                m.absorbed = True
                m.chain = s  # its calls and samples: counted by s's units
    for s in ops:
        if len(s.members) > 1 and not s.absorbed:
            picks = [tuple(n.index for n in m.op.inputs) for m in s.members]
            if s.op.batch_processing:
                s.runner = _source_batch_runner(s, picks, drop)
            else:
                s.runner = ChainRunner([m.runner for m in s.members], picks)


def _source_batch_runner(s: OpState, picks: list[tuple[int, ...]], drop: bool) -> SourceBatchRunner:
    """The runner of batch op ``s`` fused with the per-sample source chain before it."""
    head = s.members[:-1]
    runner = head[0].runner
    if len(head) > 1:
        runner = ChainRunner([m.runner for m in head], picks[:-1])
    previous = head[-1].op.num_outputs
    pick = None if picks[-1] == tuple(range(previous)) else picks[-1]
    return SourceBatchRunner(runner, s.runner, pick, head[-1].op.describe(), drop)


def batch_in_workers(s: OpState, executor: UnitExecutor) -> bool:
    """``s`` is a stateless batch op run by the pipeline's executor (its workers)."""
    op = s.op
    return op.batch_processing and not (op.is_source or op.stateful) and s.executor is executor
