"""Pipeline stats that do not mislead: ops named after their functions, summed columns
labelled as sums, and a reading guide under the table."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import mpexec
from mpexec import PipelineStats, fn


def read_sample(info: mpexec.SampleInfo) -> np.ndarray[Any, Any]:
    if info.idx_in_epoch >= 4:
        raise StopIteration
    return np.full(3, info.idx_in_epoch, np.float32)


def random_crop(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x[:2]


class Scale:
    def __call__(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        return x * 2


def _names(define: Any) -> list[str]:
    pipe = mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)(define)()
    with pipe:
        for _ in pipe:
            pass
        stats = pipe.stats()
    return [s.name for s in stats.ops]


def test_ops_are_named_after_their_functions() -> None:
    def define() -> Any:
        x = fn.external_source(source=read_sample, batch=False)
        a = fn.python_function(x, function=random_crop)
        b = fn.python_function(a, function=random_crop)
        c = fn.python_function(b, function=lambda v: v + 1)
        d = fn.python_function(c, function=functools.partial(random_crop))
        return fn.python_function(d, function=Scale())

    names = _names(define)
    assert names == [
        "read_sample",
        "random_crop",
        "random_crop_1",
        "python_function_2",  # a lambda has no name of its own
        "random_crop_2",
        "Scale",
    ]


def test_iterable_sources_and_given_names() -> None:
    def define() -> Any:
        x = fn.external_source(source=[[np.zeros(2)] * 2] * 2)
        y = fn.python_function(x, function=random_crop, name="crop")
        return fn.python_function(y, function=np.negative)

    assert _names(define) == ["external_source_0", "crop", "negative"]


def test_a_given_name_wins_over_a_chosen_one() -> None:
    def define() -> Any:
        x = fn.external_source(source=read_sample, batch=False)
        a = fn.python_function(x, function=random_crop)  # first called random_crop
        return fn.python_function(a, function=np.negative, name="random_crop")

    assert _names(define) == ["read_sample", "random_crop_1", "random_crop"]


def test_two_given_names_still_clash() -> None:
    @mpexec.pipeline_def(batch_size=2, num_workers=0)
    def define() -> Any:
        x = fn.external_source(source=read_sample, batch=False, name="a")
        return fn.python_function(x, function=random_crop, name="a")

    with pytest.raises(ValueError, match="two ops are named 'a'"):
        define().build()


def test_table_labels_sums_and_explains_itself() -> None:
    def define() -> Any:
        x = fn.external_source(source=read_sample, batch=False)
        return fn.python_function(x, function=random_crop)

    pipe = mpexec.pipeline_def(batch_size=2, num_workers=0, seed=0)(define)()
    with pipe:
        for _ in pipe:
            pass
        text = str(pipe.stats())
    lines = text.splitlines()
    head = lines[1].split()
    assert head[:2] == ["op", "calls"]
    assert "fn ms sum" in lines[1]
    assert "wait ms sum" in lines[1]
    assert "MiB copied" in lines[1]
    assert lines[2].split()[0] == "read_sample"
    assert lines[3].split()[0] == "random_crop"
    assert lines[-1] == PipelineStats.READING_GUIDE
    assert "sums over all calls on all workers" in lines[-1]
    assert "wall time" in lines[-1]
