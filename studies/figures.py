"""Figures a study declares: functions of its runs' metrics and histories.

A :class:`Figure` names a file and draws on one matplotlib Axes from a :class:`~studies.runs.RunSet`
(returning False when its runs hold nothing to draw, so no empty file is written). The builders
here cover what the papers plot: a metric per epoch per condition (convergence, LTD Figure 3's
validation rsum), a per-step series per value of a searched key (lambda and L_rec per eta), a final
metric against a searched key, and a per-step series per condition (AdOpt's K, COCOS over training).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from studies.runs import RunSet

Draw = Callable[["RunSet", Any], bool]


@dataclass(frozen=True)
class Figure:
    """``<name>.png`` of a study's report, drawn by ``draw(runs, ax)``."""

    name: str
    title: str
    draw: Draw
    log_y: bool = False


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def metric_per_epoch(metric: str = "val_rsum", ylabel: str = "validation rsum") -> Draw:
    """Every run's ``metric`` per epoch, one colour per condition; confirmation runs solid,
    search trials dashed (an ASHA-stopped trial is a short dashed line)."""

    def draw(runs: RunSet, ax: Any) -> bool:
        conditions = list(dict.fromkeys(runs.frame.get("condition", [])))
        seen: set[str] = set()
        for _, run in runs.frame.iterrows():
            epochs, values = runs.history(run["run_id"], metric)
            if not epochs:
                continue
            confirm = run["phase"] == "confirm"
            label = f"{run['condition']} ({run['phase']})"
            ax.plot(epochs, values, color=f"C{conditions.index(run['condition']) % 10}",
                    marker=".", lw=1.8 if confirm else 0.8, alpha=1.0 if confirm else 0.5,
                    ls="-" if confirm else "--", label=None if label in seen else label)
            seen.add(label)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        _legend(ax)
        return bool(seen)

    return draw


def series_by_value(
    series: str, key: str, condition: str, *, phase: str = "search", floor: float | None = None,
    reference: str | None = None, ylabel: str = "", bound: bool = False,
) -> Draw:
    """A per-step series (``trajectory/<series>``) of each run of ``condition``, coloured by the
    value of the searched ``key`` (LTD Figure 3: lambda and L_rec per eta). ``floor`` clips values
    from below (for a log scale); ``reference`` draws that condition's runs in grey for comparison;
    with ``bound`` each run's value of ``key`` is drawn as a dotted line in its colour (the series
    is bounded by it: L_rec <= eta)."""

    def draw(runs: RunSet, ax: Any) -> bool:
        import matplotlib

        rows = runs.where(phase=phase, condition=condition)
        if rows.empty or key not in rows:
            return False
        rows = rows.sort_values(key)
        norm = matplotlib.colors.Normalize(rows[key].min(), rows[key].max() + 1e-12)
        cmap = matplotlib.colormaps["viridis"]
        drawn = False
        for _, run in rows.iterrows():
            steps, values = runs.history(run["run_id"], f"trajectory/{series}")
            if not steps:
                continue
            if floor is not None:
                values = [max(v, floor) for v in values]
            color = cmap(norm(run[key]))
            ax.plot(steps, values, color=color, lw=1.2, marker="." if len(steps) < 30 else None,
                    label=f"{key.split('.')[-1]}={run[key]:.3g}")
            if bound:
                ax.axhline(run[key], color=color, lw=0.6, ls=":")
            drawn = True
        for _, run in runs.where(phase=phase, condition=reference).iterrows() if reference else ():
            steps, values = runs.history(run["run_id"], f"trajectory/{series}")
            ax.plot(steps, values, color="0.5", lw=1.0, ls="--", label=reference)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel or series)
        _legend(ax)
        return drawn

    return draw


def metric_vs_value(metric: str, key: str, condition: str, *, phase: str = "search",
                    ylabel: str = "") -> Draw:
    """The best value of ``metric`` of each run of ``condition`` against its searched ``key``;
    full-budget trials as dots, trials stopped early or failed as crosses."""

    def draw(runs: RunSet, ax: Any) -> bool:
        rows = runs.where(phase=phase, condition=condition)
        if rows.empty or key not in rows:
            return False
        for full, marker, label in ((True, "o", "full budget"), (False, "x", "stopped early / failed")):
            part = rows[(rows["budget_complete"] == "true") == full]
            best = [max(runs.history(r, metric)[1] or [math.nan]) for r in part["run_id"]]
            ax.scatter(part[key], best, marker=marker, label=label)
        ax.set_xlabel(key)
        ax.set_ylabel(ylabel or f"best {metric}")
        _legend(ax)
        return True

    return draw


def series_per_condition(series: str, *, phase: str = "confirm", ylabel: str = "",
                         metric: bool = False) -> Draw:
    """A per-step series (``trajectory/<series>``), or with ``metric=True`` a per-epoch metric, of
    every run of ``phase``, one colour per condition (AdOpt's K, COCOS counts over training)."""

    def draw(runs: RunSet, ax: Any) -> bool:
        rows = runs.where(phase=phase)
        conditions = list(dict.fromkeys(rows.get("condition", [])))
        key = series if metric else f"trajectory/{series}"
        seen: set[str] = set()
        for _, run in rows.iterrows():
            steps, values = runs.history(run["run_id"], key)
            if not steps:
                continue
            ax.plot(steps, values, color=f"C{conditions.index(run['condition']) % 10}", lw=1.0,
                    alpha=0.8, label=None if run["condition"] in seen else run["condition"])
            seen.add(run["condition"])
        ax.set_xlabel("epoch" if metric else "training step")
        ax.set_ylabel(ylabel or series)
        _legend(ax)
        return bool(seen)

    return draw


def render(figure: Figure, runs: RunSet, path: Any) -> bool:
    """Draw ``figure`` to ``path`` (PNG); False (no file) when it had nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    try:
        if not figure.draw(runs, ax):
            return False
        if figure.log_y:
            ax.set_yscale("log")
        ax.set_title(textwrap.fill(figure.title, 70), fontsize=10)  # long titles wrap, not clip
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        return True
    finally:
        plt.close(fig)
