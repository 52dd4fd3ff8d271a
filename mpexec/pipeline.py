"""DALI's ``nvidia.dali.pipeline`` for mpexec: ``Pipeline``, ``pipeline_def``, ``DataNode``,
``do_not_convert``.

``from mpexec.pipeline import Pipeline`` stands where ``from
nvidia.dali.pipeline import Pipeline`` stood; these are the same objects as
``mpexec.Pipeline`` and ``mpexec.pipeline_def``.
"""

from __future__ import annotations

from ._autograph import do_not_convert
from ._graph import DataNode
from ._pipeline import Pipeline, pipeline_def

__all__ = ["DataNode", "Pipeline", "do_not_convert", "pipeline_def"]
