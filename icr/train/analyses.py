"""Whether an analysis can run on a configuration, decided from the registries alone.

An analysis registers the task kind it runs on and the capabilities it needs
(:mod:`icr.analysis`), a task and a dataset those they provide (:mod:`icr.context`);
:func:`check_analyses` matches them for a config before anything runs (the platform for every
condition of a study, ``fit`` again). It lives beside the task registry it reads; an analysis
imports no more of the training package than the inputs type of the task it analyses
(``icr.train.retrieval_data.RetrievalInputs``).
"""

from __future__ import annotations

from collections.abc import Iterable

from icr.analysis import ANALYSES
from icr.config import ExperimentConfig, split_list
from icr.context import Capability
from icr.data.datasets import DATASETS
from icr.errors import ConfigError
from icr.train.tasks import TASKS

__all__ = ["check_analyses", "providers"]


def check_analyses(config: ExperimentConfig, names: Iterable[str] = ()) -> None:
    """Every analysis of ``names`` and of ``eval.analyses`` can run on ``config``: its task kind is
    ``task.name`` and the task and the dataset provide all it needs.

    Raises:
        ConfigError: one line naming the analysis, the condition's task (and dataset), what is
            missing, and the fix.
    """
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


def providers(capability: type[Capability]) -> list[str]:
    """The config choices that provide ``capability``: ``task.name=...``, ``data.dataset=...``."""
    return ([f"task.name={t}" for t in TASKS if capability in TASKS.meta(t)["provides"]]
            + [f"data.dataset={d}" for d in DATASETS
               if capability in DATASETS.meta(d).get("provides", ())])
