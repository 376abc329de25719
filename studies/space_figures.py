"""Figures of a condition's search as a whole: every trial through its values (parallel
coordinates), the searched keys' importance, and quality against cost (the Pareto front).

Each is a :class:`~studies.figures.Figure` drawn by :func:`studies.figures.render`, from the
trials and estimates of :mod:`studies.space_analysis` (matplotlib, as the report's other
figures: a PNG that needs no browser).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from studies.figures import SEQUENTIAL, Figure
from studies.space import Domain
from studies.space_analysis import COMPLETE, FAIL, PRUNED, Front, Importance, SearchTrial

if TYPE_CHECKING:
    from studies.runs import RunSet

# a stopped or failed trial of a one-key search is a point: its marker must show on its own
PRUNED_STYLE = {"color": "0.55", "lw": 0.9, "ls": "--", "alpha": 0.8, "marker": "o", "ms": 4}
FAILED_STYLE = {"color": "C3", "lw": 0.9, "ls": ":", "alpha": 0.9, "marker": "x", "ms": 6}


def axis_position(domain: Domain, value: Any) -> float:
    """Where ``value`` sits on its key's axis, in [0, 1]: a choice at its place among the
    choices, a number at its place in the range (on a log scale for a log-uniform key);
    NaN when the trial did not use the key."""
    if value is None:
        return math.nan
    if domain.kind in ("choice", "grid"):
        choices = list(domain.values)
        return choices.index(value) / max(len(choices) - 1, 1) if value in choices else math.nan
    low, high = (float(v) for v in domain.values)
    value = float(value)
    if domain.kind == "loguniform":
        low, high, value = math.log(low), math.log(high), math.log(value)
    return (value - low) / (high - low) if high > low else 0.5


def _axis_labels(domain: Domain) -> list[tuple[float, str]]:
    if domain.kind in ("choice", "grid"):
        return [(axis_position(domain, v), str(v)) for v in domain.values]
    low, high = domain.values
    middle = math.sqrt(low * high) if domain.kind == "loguniform" else (low + high) / 2
    return [(axis_position(domain, v), f"{v:.3g}") for v in (low, middle, high)]


def parallel_coordinates(trials: Sequence[SearchTrial], domains: Mapping[str, Domain],
                         metric: str, mode: str) -> Any:
    """Draw every trial as a line through its values of the searched keys (one vertical axis
    each, choices labelled) to the objective's axis. A full-budget trial is coloured by its
    objective; a trial ASHA stopped (grey, dashed) and a failed one (red, dotted) end at the last
    key's axis, as their early values are not on the full trials' scale. A key a trial's
    configuration does not use leaves a gap in its line."""

    def draw(runs: RunSet, ax: Any) -> bool:
        import matplotlib  # lazy: keeps matplotlib off the command line's start

        if not trials or not domains:
            return False
        keys = list(domains)
        full = [t for t in trials if t.state == COMPLETE and t.value is not None]
        values = [t.value for t in full]
        low, high = (min(values), max(values)) if values else (0.0, 1.0)
        norm = matplotlib.colors.Normalize(low, high if high > low else low + 1.0)
        cmap = matplotlib.colormaps[SEQUENTIAL]
        xs = np.arange(len(keys) + 1)
        for t in sorted(trials, key=lambda t: (t.state == COMPLETE, t.value or 0.0)):
            ys = [axis_position(domains[k], t.params.get(k)) for k in keys]
            if t.state == COMPLETE and t.value is not None:
                ax.plot(xs, ys + [norm(t.value)], color=cmap(norm(t.value)), lw=1.6, marker="o",
                        ms=3)
            else:
                ax.plot(xs[:-1], ys, **(FAILED_STYLE if t.state == FAIL else PRUNED_STYLE))
        for i, key in enumerate(keys):
            ax.axvline(i, color="0.2", lw=0.8)
            for y, text in _axis_labels(domains[key]):
                ax.text(i + 0.03, y, text, fontsize=7, va="center")
        ax.axvline(len(keys), color="0.2", lw=0.8)
        for y, value in ((0.0, low), (1.0, high)) if values else ():
            ax.text(len(keys) + 0.03, y, f"{value:.1f}", fontsize=7, va="center")
        ax.set_xticks(xs, [*keys, metric], fontsize=8)
        ax.set_xlim(-0.1, len(keys) + 0.5)
        ax.set_ylim(-0.05, 1.05)
        ax.set_yticks([])
        counts = {s: sum(t.state == s for t in trials) for s in (COMPLETE, PRUNED, FAIL)}
        handles = [matplotlib.lines.Line2D([], [], color=cmap(0.6), lw=1.6,
                                           label=f"full budget ({counts[COMPLETE]})")]
        handles += [matplotlib.lines.Line2D([], [], label=f"stopped by ASHA ({counts[PRUNED]})",
                                            **PRUNED_STYLE)] if counts[PRUNED] else []
        handles += [matplotlib.lines.Line2D([], [], label=f"failed ({counts[FAIL]})",
                                            **FAILED_STYLE)] if counts[FAIL] else []
        ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08),
                  ncol=len(handles), frameon=False)
        if values:
            bar = ax.figure.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                                     fraction=0.04, pad=0.01)
            bar.set_label(f"{metric} ({'higher' if mode == 'max' else 'lower'} is better)",
                          fontsize=7)
        return True

    return draw


def importance_bars(importance: Importance) -> Any:
    """Each key's importance as a bar with its spread over the estimator's seeds."""

    def draw(runs: RunSet, ax: Any) -> bool:
        if not importance.keys:
            return False
        keys = list(reversed(importance.keys))  # the most important on top
        labels = [k.key + (" *" if k.conditional else "") for k in keys]
        ax.barh(labels, [k.mean for k in keys], xerr=[k.std for k in keys], color="C0",
                capsize=3)
        ax.set_xlabel("share of the objective's variance")
        ax.set_xlim(0, max(1.0, max(k.mean + k.std for k in keys)))
        if any(k.conditional for k in keys):
            ax.text(1.0, -0.18, "* among the trials that use it", transform=ax.transAxes,
                    fontsize=7, ha="right")
        return True

    return draw


def pareto_plot(front: Front, mode: str) -> Any:
    """Every full-budget run at (cost, objective), one colour per condition, the Pareto front
    joined and each of its points labelled with its run's name."""

    def draw(runs: RunSet, ax: Any) -> bool:
        if not front.trials:
            return False
        for c, condition in enumerate(dict.fromkeys(t.condition for t in front.trials)):
            mine = [t for t in front.trials if t.condition == condition]
            ax.scatter([t.cost for t in mine], [t.value for t in mine], color=f"C{c % 10}",
                       s=18, alpha=0.7, label=condition)
        on = [front.trials[i] for i in front.front]
        step = "post" if mode == "max" else "pre"
        ax.step([t.cost for t in on], [t.value for t in on], where=step, color="0.2", lw=1.0)
        ax.scatter([t.cost for t in on], [t.value for t in on], facecolors="none",
                   edgecolors="0.1", s=70, lw=1.2, zorder=3, label=f"Pareto front ({len(on)})")
        for t in on:
            ax.annotate(t.name, (t.cost, t.value), xytext=(4, 4), textcoords="offset points",
                        fontsize=6)
        ax.set_xlabel(f"{front.cost} (mean over a run's epochs; lower is better)")
        ax.set_ylabel(f"{front.metric} ({'higher' if mode == 'max' else 'lower'} is better)")
        ax.legend(fontsize=7, loc="best")
        return True

    return draw


def parallel_figure(condition: str, label: str, trials: Sequence[SearchTrial],
                    domains: Mapping[str, Domain], metric: str, mode: str) -> Figure:
    return Figure(f"parallel_{condition}", f"Every search trial of {label}",
                  parallel_coordinates(trials, domains, metric, mode))


def importance_figure(importance: Importance, label: str) -> Figure:
    at = f" (scores after epoch {importance.epoch}, not the full budget)" if importance.epoch else ""
    return Figure(f"importance_{importance.condition}",
                  f"Importance of the searched keys: {label}{at}", importance_bars(importance))


def pareto_figure(front: Front, mode: str) -> Figure:
    return Figure("pareto", f"Quality against cost: {front.metric} and {front.cost}",
                  pareto_plot(front, mode))
