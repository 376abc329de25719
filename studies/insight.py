"""The report's section on what each searched condition's search learned about its space.

For every condition that searched (the parent run's ``searched.<condition>`` tag), from its
search runs in MLflow (:mod:`studies.space_analysis`):

- ``importance_<condition>.png`` and a table in ``search_space.md``: each searched key's share of
  the validation objective's variance (or the line saying why there is no estimate), logged on
  the parent run as ``importance.<condition>.<key>`` (and ``importance_spread.<...>``);
- ``parallel_<condition>.png``: every trial through its values (:mod:`studies.space_figures`);
- for a study with a ``cost``: ``pareto.png`` and the table of the study's Pareto front (every
  full-budget run of every condition); the front's runs are tagged ``pareto_front=true``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from studies.catalog import Study
from studies.figures import render
from studies.runs import RunSet
from studies.space_analysis import (
    domains_from_tags,
    estimate_importance,
    front_markdown,
    importance_markdown,
    importance_metrics,
    observed_domains,
    search_trials,
    study_front,
)
from studies.space_figures import importance_figure, parallel_figure, pareto_figure

FRONT_TAG = "pareto_front"  # "true" on the runs of a condition's Pareto front
SECTION = "search_space.md"


@dataclass
class Insight:
    """What :func:`write_insight` wrote: the section's Markdown, the parent run's metrics, and
    the runs on a Pareto front."""

    markdown: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    front_runs: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


def write_insight(study: Study, runs: RunSet, tags: dict[str, str], out: Path) -> Insight:
    """Write the section's files into ``out`` for each searched condition of the study run."""
    insight = Insight()
    parts = []
    for condition in study.conditions:
        keys = [k for k in tags.get(f"searched.{condition.name}", "").split(",") if k]
        if not keys or runs.where(phase="search", condition=condition.name).empty:
            continue
        trials = search_trials(runs, condition.name, study.metric, keys, study.cost)
        domains = domains_from_tags(tags, condition.name) or observed_domains(
            {k: [t.params.get(k) for t in trials] for k in keys})
        domains = {k: domains[k] for k in keys if k in domains}
        importance = estimate_importance(trials, domains, study.mode, condition.name,
                                         evaluator=study.importance)
        parts.append(importance_markdown(importance, condition.label))
        insight.metrics.update(importance_metrics(importance))
        figures = [importance_figure(importance, condition.label),
                   parallel_figure(condition.name, condition.label, trials, domains,
                                   study.metric, study.mode)]
        for figure in figures:
            if render(figure, runs, out / f"{figure.name}.png"):
                insight.files.append(f"{figure.name}.png")
    if study.cost:
        front = study_front(runs, [c.name for c in study.conditions], study.metric, study.cost,
                            study.mode)
        parts.append(front_markdown(front, study.mode))
        insight.front_runs += [front.trials[i].run_id for i in front.front]
        figure = pareto_figure(front, study.mode)
        if render(figure, runs, out / f"{figure.name}.png"):
            insight.files.append(f"{figure.name}.png")
    if parts:
        insight.markdown = "## What the search learned about its space\n\n" + "\n".join(parts)
        (out / SECTION).write_text(insight.markdown, encoding="utf-8")
        insight.files.append(SECTION)
    return insight
