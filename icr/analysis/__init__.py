"""Analyses of a trained model, run by ``fit`` after training on the best checkpoint.

``eval.analyses`` names them (comma-separated). Each is registered in :data:`ANALYSES` with the task
kind it runs on and the capabilities it needs (:mod:`icr.context`)::

    @ANALYSES.register("cocos", task="retrieval", needs=(Embeddings, RetrievalInputs))
    def cocos_analysis(*, context: TaskContext) -> Callable[[Path], dict[str, float]]: ...

:func:`check_analyses` matches those declarations against a config (the platform calls it for
every condition when it plans a study; ``fit`` calls it again). The builder then gets a
:class:`~icr.context.TaskContext` holding exactly what it declared; building checks what only the
data can tell (a shapes folder without ``scenes.json``), before any training, and ``run(out_dir)``
returns the analysis' numbers (``dict[str, float]``, keys prefixed with the analysis' name) after
writing any files to ``out_dir``. ``fit`` puts both in the last epoch's report, so they land in the
run's MLflow record. An analysis may register ``check=`` (``(config) -> None``) for what its
declarations cannot say (COCOS needs a counter of the run's loss). A new analysis is one module here
with one ``@ANALYSES.register(...)`` builder.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from icr.errors import ConfigError
from icr.registry import Registry

if TYPE_CHECKING:
    from icr.config import ExperimentConfig
    from icr.context import TaskContext

ANALYSES: Registry = Registry("analysis", package="icr.analysis", requires=("task", "needs"))

Analysis = Callable[[Path], dict[str, float]]


def check_analyses(config: ExperimentConfig, names: Iterable[str] = ()) -> None:
    """Every analysis of ``names`` and of ``eval.analyses`` can run on ``config``: its task kind is
    ``task.name`` and the task and the dataset provide all it needs.

    Raises:
        ConfigError: one line naming the analysis, the condition's task (and dataset), what is
            missing, and the fix.
    """
    from icr.config import split_list
    from icr.context import providers
    from icr.data.datasets import DATASETS
    from icr.train.tasks import TASKS

    task, dataset = config.task.name, config.data.dataset
    provided = set(TASKS.meta(task)["provides"]) | set(DATASETS.meta(dataset).get("provides", ()))
    for name in dict.fromkeys([*names, *split_list(config.eval.analyses)]):
        meta = ANALYSES.meta(name)
        if meta["task"] != task:
            raise ConfigError(f"eval.analyses={name} runs on a {meta['task']} task, but this "
                              f"condition trains task.name={task}; drop {name} or use "
                              f"task.name={meta['task']}")
        for need in meta["needs"]:
            if need not in provided:
                fix = " or ".join(p for p in providers(need) if p != f"task.name={task}")
                raise ConfigError(f"eval.analyses={name} needs {need.__name__} ({need.about}), "
                                  f"which task.name={task} with data.dataset={dataset} does not "
                                  f"provide; use {fix or 'another task'}, or drop {name}")
        if "check" in meta:
            meta["check"](config)


def build_analysis(name: str, context: TaskContext) -> Analysis:
    """The analysis ``name`` built on ``context``, restricted to the capabilities it declared."""
    return ANALYSES.build(name, context=context.only(name, ANALYSES.meta(name)["needs"]))


__all__ = ["ANALYSES", "Analysis", "build_analysis", "check_analyses"]
