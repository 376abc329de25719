"""Figures a study declares: functions of its runs' metrics and histories.

A :class:`Figure` names a file and draws on one matplotlib Axes from a :class:`~studies.runs.RunSet`
(returning False when its runs hold nothing to draw, so no empty file is written). The builders
here cover what the papers plot: a metric per epoch per condition (convergence, LTD Figure 3's
validation rsum), a per-step series per value of a searched key (lambda and L_rec per eta), a final
metric against a searched key, and a per-step series per condition (AdOpt's K, COCOS over training).

What a reviewer needs to read them: repeated runs of one condition (its confirmation seeds) are one
line, their mean, with a band from the lowest to the highest seed; epochs are integers; the values
of a searched key get colours spread evenly over a sequential map by rank, so neighbouring values
differ visibly; the value a condition chose (the one its confirmation runs were trained with) is
marked; trials ASHA stopped are drawn where they stopped, not mixed into the scale of full ones; and
a log axis shows only the values that are there (a series that reaches 0 stops, and its legend says
at which step).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from studies.runs import RunSet

Draw = Callable[["RunSet", Any], bool]
SEQUENTIAL = "viridis"  # the map the values of a searched key are coloured from
_RANGE = (0.0, 0.9)  # of the map: its brightest yellow is hard to see on white


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


def _integer_ticks(ax: Any) -> None:
    # lazy: keeps matplotlib off the command line's start (this module is in its imports)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def rank_colours(values: Sequence[float]) -> dict[float, tuple[float, float, float, float]]:
    """A colour per distinct value, evenly spaced by rank over :data:`SEQUENTIAL`: neighbouring
    values differ by the same step of the map whatever their numeric gap."""
    import matplotlib  # lazy: keeps matplotlib off the command line's start

    distinct = sorted(set(values))
    cmap = matplotlib.colormaps[SEQUENTIAL]
    spread = np.linspace(*_RANGE, max(len(distinct), 2))[: len(distinct)]
    if len(distinct) == 1:
        spread = np.array([0.5 * sum(_RANGE)])
    return {v: cmap(float(x)) for v, x in zip(distinct, spread, strict=True)}


def mean_band(histories: Sequence[tuple[Sequence[int], Sequence[float]]]
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Mean, lowest and highest of several runs' series at each x any of them has.

    Returns:
        ``(x, mean, low, high)``, each ``(X,)``; at an x only some runs reached (one seed stopped
        early), the statistics are over those runs.
    """
    xs = np.array(sorted({x for steps, _ in histories for x in steps}), dtype=float)
    table = np.full((len(histories), len(xs)), np.nan)
    where = {x: i for i, x in enumerate(xs)}
    for r, (steps, values) in enumerate(histories):
        for x, v in zip(steps, values, strict=True):
            table[r, where[float(x)]] = v
    return xs, np.nanmean(table, axis=0), np.nanmin(table, axis=0), np.nanmax(table, axis=0)


def _conditions(runs: RunSet) -> list[str]:
    return list(dict.fromkeys(runs.frame.get("condition", [])))


def metric_per_epoch(metric: str = "val_rsum", ylabel: str = "validation rsum") -> Draw:
    """``metric`` per epoch, one colour per condition: the confirmation runs as their mean with a
    band over the seeds, the search trials as thin dashed lines (an ASHA-stopped trial is a short
    one)."""

    def draw(runs: RunSet, ax: Any) -> bool:
        conditions = _conditions(runs)
        drawn = False
        for c, condition in enumerate(conditions):
            colour = f"C{c % 10}"
            confirm = [runs.history(r, metric) for r in runs.where(phase="confirm",
                                                                    condition=condition)["run_id"]]
            confirm = [h for h in confirm if h[0]]
            if confirm:
                x, mean, low, high = mean_band(confirm)
                ax.plot(x, mean, color=colour, lw=1.8, marker=".",
                        label=f"{condition} (confirm, mean of {len(confirm)})")
                if len(confirm) > 1:
                    ax.fill_between(x, low, high, color=colour, alpha=0.2, lw=0)
                drawn = True
            label = f"{condition} (search)"
            for run_id in runs.where(phase="search", condition=condition)["run_id"]:
                steps, values = runs.history(run_id, metric)
                if steps:
                    ax.plot(steps, values, color=colour, lw=0.7, alpha=0.45, ls="--", label=label)
                    label, drawn = None, True
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        _integer_ticks(ax)
        _legend(ax)
        return drawn

    return draw


def _positive_segments(steps: Sequence[int], values: Sequence[float]
                       ) -> tuple[list[float], list[float], int | None]:
    """The series with its non-positive points masked (NaN: the line breaks there) and the first
    step at which it is not positive (``None`` if never)."""
    masked = [v if v > 0 else math.nan for v in values]
    first = next((s for s, v in zip(steps, values, strict=True) if v <= 0), None)
    return list(steps), masked, first


def series_by_value(
    series: str, key: str, condition: str, *, phase: str = "search", log: bool = False,
    reference: str | None = None, bound: bool = False, ylabel: str = "",
) -> Draw:
    """A per-step series (``trajectory/<series>``) of each run of ``condition``, coloured by the
    rank of its searched ``key`` (LTD Figure 3: lambda and L_rec per eta).

    ``log``: for a log axis: points at or below 0 are not drawn (no invented values), and the
    legend says at which step the series first reached 0. ``bound``: the run's value of ``key`` is
    a bound on the series (eta on L_rec), drawn as a dotted line of the same colour.
    ``reference``: that condition's runs in grey for comparison.
    """

    def draw(runs: RunSet, ax: Any) -> bool:
        rows = runs.where(phase=phase, condition=condition)
        if rows.empty or key not in rows:
            return False
        rows = rows.sort_values(key)
        colours = rank_colours(rows[key].tolist())
        name = key.split(".")[-1]
        drawn = False
        for _, run in rows.iterrows():
            steps, values = runs.history(run["run_id"], f"trajectory/{series}")
            if not steps:
                continue
            label = f"{name}={run[key]:.3g}"
            if log:
                steps, values, zero = _positive_segments(steps, values)
                if zero is not None:
                    label += f" (0 from step {zero})"
            colour = colours[run[key]]
            ax.plot(steps, values, color=colour, lw=1.2, marker="." if len(steps) < 30 else None,
                    label=label)
            if bound:
                ax.axhline(run[key], color=colour, lw=0.6, ls=":")
            drawn = True
        for _, run in runs.where(phase=phase, condition=reference).iterrows() if reference else ():
            steps, values = runs.history(run["run_id"], f"trajectory/{series}")
            ax.plot(steps, values, color="0.5", lw=1.0, ls="--", label=reference)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel or series)
        _legend(ax)
        return drawn

    return draw


def chosen_value(runs: RunSet, key: str, condition: str) -> float | str | None:
    """The value of ``key`` the condition's confirmation runs were trained with (its selection):
    a number, or the name of a component for a choice among components (``loss.name``)."""
    values = runs.where(phase="confirm", condition=condition)
    values = values[key].dropna().unique() if key in values else []
    if len(values) != 1:
        return None
    try:
        return float(values[0])
    except (TypeError, ValueError):
        return str(values[0])


def _positions(values: pd.Series, ax: Any) -> pd.Series:
    """Where each value of a searched key goes on the x axis: itself when numeric; for a choice
    among components (``loss.name``), the name's place in sorted order, the names as ticks."""
    numeric = pd.to_numeric(values, errors="coerce")
    if numeric.notna().all():
        return numeric
    names = sorted(values.astype(str).unique())
    ax.set_xticks(range(len(names)), names)
    return values.astype(str).map({name: float(i) for i, name in enumerate(names)})


def metric_vs_value(metric: str, key: str, condition: str, *, phase: str = "search",
                    ylabel: str = "") -> Draw:
    """The best value of ``metric`` of each full-budget run of ``condition`` against its searched
    ``key``, the value the condition chose marked with a star; trials stopped early or failed are
    crosses on the x axis, labelled with the epoch they reached, so their short-run values do not
    set the scale."""

    def draw(runs: RunSet, ax: Any) -> bool:
        rows = runs.where(phase=phase, condition=condition)
        if rows.empty or key not in rows:
            return False
        x = _positions(rows[key], ax)
        full = rows[rows["budget_complete"] == "true"]
        full_x = x[full.index]
        best = [max(runs.history(r, metric)[1] or [math.nan]) for r in full["run_id"]]
        ax.scatter(full_x, best, marker="o", label="full budget")
        chosen = chosen_value(runs, key, condition)
        if chosen is not None and len(full):
            if isinstance(chosen, float):
                at = int(np.argmin(np.abs(full_x.to_numpy(dtype=float) - chosen)))
                text = f"{chosen:.3g}"
            else:  # a component's name: the first full-budget trial that chose it
                named = np.flatnonzero(full[key].astype(str).to_numpy() == chosen)
                at, text = (int(named[0]) if len(named) else None), chosen
            if at is not None:
                ax.scatter([full_x.iloc[at]], [best[at]], marker="*", s=160, color="C3",
                           zorder=3, label=f"chosen: {key.split('.')[-1]}={text}")
        stopped = rows[rows["budget_complete"] != "true"]
        if len(stopped):
            transform = ax.get_xaxis_transform()  # x in data, y in axes fractions
            ax.scatter(x[stopped.index], [0.03] * len(stopped), marker="x", color="C1",
                       transform=transform, clip_on=False, label="stopped early / failed")
            for value, epochs in zip(x[stopped.index], stopped["epochs"], strict=True):
                ax.annotate(f"e{epochs}" if epochs not in ("", None) else "failed",
                            (value, 0.03), xycoords=transform, xytext=(0, 6),
                            textcoords="offset points", fontsize=6, ha="center")
            # points drawn in axes fractions do not widen the x axis: their x values must, or a
            # trial stopped outside the full-budget ones' range is drawn off the figure
            ax.update_datalim(np.column_stack([x[stopped.index].to_numpy(dtype=float),
                                               np.zeros(len(stopped))]), updatey=False)
            ax.autoscale_view()
        ax.set_xlabel(key)
        ax.set_ylabel(ylabel or f"best {metric}")
        _legend(ax)
        return True

    return draw


def series_per_condition(series: str, *, phase: str = "confirm", ylabel: str = "",
                         metric: bool = False) -> Draw:
    """A per-step series (``trajectory/<series>``), or with ``metric=True`` a per-epoch metric, of
    the runs of ``phase``, one colour per condition: the runs' mean with a band from the lowest to
    the highest (AdOpt's K, COCOS counts over training)."""

    def draw(runs: RunSet, ax: Any) -> bool:
        rows = runs.where(phase=phase)
        key = series if metric else f"trajectory/{series}"
        drawn = False
        for c, condition in enumerate(dict.fromkeys(rows.get("condition", []))):
            histories = [runs.history(r, key) for r in rows[rows["condition"] == condition]["run_id"]]
            histories = [h for h in histories if h[0]]
            if not histories:
                continue
            x, mean, low, high = mean_band(histories)
            colour = f"C{c % 10}"
            label = condition if len(histories) == 1 else f"{condition} (mean of {len(histories)})"
            ax.plot(x, mean, color=colour, lw=1.2, label=label)
            if len(histories) > 1:
                ax.fill_between(x, low, high, color=colour, alpha=0.2, lw=0)
            drawn = True
        ax.set_xlabel("epoch" if metric else "training step")
        if metric:
            _integer_ticks(ax)
        ax.set_ylabel(ylabel or series)
        _legend(ax)
        return drawn

    return draw


def render(figure: Figure, runs: RunSet, path: Any) -> bool:
    """Draw ``figure`` to ``path`` (PNG); False (no file) when it had nothing to draw."""
    import matplotlib  # lazy: keeps matplotlib off the command line's start

    matplotlib.use("Agg")  # no display: before pyplot is imported
    import matplotlib.pyplot as plt  # lazy: keeps matplotlib off the command line's start

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
