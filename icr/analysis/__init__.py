"""Analyses of a trained model, run by ``fit`` after training on the best checkpoint.

``eval.analyses`` names them (comma-separated). Each is registered in :data:`ANALYSES` with the task
kind it runs on and the capabilities it needs (:mod:`icr.context`)::

    @ANALYSES.register("cocos", task="retrieval", needs=(Embeddings, RetrievalInputs))
    def cocos_analysis(*, context: TaskContext) -> Callable[[Path], dict[str, float]]: ...

:func:`icr.train.analyses.check_analyses` matches those declarations against a config (the platform
calls it for every condition when it plans a study; ``fit`` calls it again). The builder then gets a
:class:`~icr.context.TaskContext` holding exactly what it declared; building checks what only the
data can tell (a shapes folder without ``scenes.json``), before any training, and ``run(out_dir)``
returns the analysis' numbers (``dict[str, float]``, keys prefixed with the analysis' name) after
writing any files to ``out_dir``. ``fit`` puts both in the last epoch's report, so they land in the
run's MLflow record. An analysis may register ``check=`` (``(config) -> None``) for what its
declarations cannot say (COCOS needs a counter of the run's loss). A new analysis is one module here
with one ``@ANALYSES.register(...)`` builder.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from icr.registry import Registry

if TYPE_CHECKING:
    from icr.context import TaskContext

ANALYSES: Registry = Registry("analysis", package="icr.analysis", requires=("task", "needs"))

Analysis = Callable[[Path], dict[str, float]]


def build_analysis(name: str, context: TaskContext) -> Analysis:
    """The analysis ``name`` built on ``context``, restricted to the capabilities it declared."""
    return ANALYSES.build(name, context=context.only(name, ANALYSES.meta(name)["needs"]))


__all__ = ["ANALYSES", "Analysis", "build_analysis"]
