"""Modes are enums whose members are their strings (mpexec/_modes.py)."""

from __future__ import annotations

import pickle

import pytest

import mpexec
from mpexec import fn
from mpexec._modes import CallKind, Device, LastBatch, OpKind, SourceMode


@pytest.mark.parametrize("member", [*Device, *OpKind, *SourceMode, *CallKind, *LastBatch])
def test_a_member_is_its_string(member: Device) -> None:
    value = member.value
    assert member == value
    assert hash(member) == hash(value)
    assert {value: 1}[member] == 1
    assert {member: 1}[value] == 1
    assert str(member) == f"{member}" == f"{member:>0}" == value
    assert type(member)(value) is member
    assert pickle.loads(pickle.dumps(member)) is member


def test_public_arguments_take_the_strings_and_ops_hold_the_members() -> None:
    pipe = mpexec.Pipeline(batch_size=2, num_workers=0, seed=0, last_batch="drop")
    with pipe:
        src = fn.external_source(source=[[1.0], [2.0], [3.0]], batch=False, name="src")
        pipe.set_outputs(fn.python_function(src, function=lambda x: x * 2, device="cpu"))
    assert pipe._graph is not None
    source, op = pipe._graph.ops
    assert source.kind is OpKind.EXTERNAL_SOURCE
    assert source.source_mode is SourceMode.ITER
    assert op.kind is OpKind.PYTHON_FUNCTION
    assert op.device is Device.CPU
    with pipe:
        (out,) = pipe.run()
        assert [float(x[0]) for x in out] == [2.0, 4.0]
        with pytest.raises(StopIteration):
            pipe.run()  # the short last batch is dropped
    with pytest.raises(ValueError, match="last_batch must be 'partial' or 'drop', not 'pad'"):
        mpexec.Pipeline(batch_size=2, last_batch="pad")
