"""``--debug``: one trial in-process, without Ray (a debugger and breakpoints work).

The study's base config with a condition's overrides (searched keys at the middle of their
domain) and the ``--set`` overrides, trained by ``icr.train.fit`` with tqdm progress bars; each
epoch prints a line, and the study's first table, val and test side by side, closes the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import icr.train
from icr.config import ExperimentConfig, to_flat, used_keys
from icr.train.seam import EpochReport
from icr.train.tasks import check_data
from studies.plan import StudyPlan
from studies.tables import protocol_tables, record_table


def run_debug(
    plan: StudyPlan, condition: str | None, fit: Callable[..., Any] | None = None,
    say: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    config = plan.debug_config(condition)
    fit = fit or icr.train.fit
    _describe(plan, config, say)
    history: list[dict[str, float]] = []

    def reporter(report: EpochReport) -> None:
        metrics = report.metrics
        history.append(dict(metrics))
        parts = [f"epoch {report.epoch}/{config.epochs}",
                 f"val {plan.study.metric.removeprefix('val_')} "
                 f"{metrics.get(plan.study.metric, float('nan')):.2f}",
                 f"loss {metrics.get('train_loss', float('nan')):.4f}"]
        parts += [f"{k} {metrics[k]:.4g}" for k in ("train_L_rec", "lambda") if k in metrics]
        parts.append(f"{metrics.get('epoch_time_s', 0):.1f}s")
        say("  ".join(parts))

    run_dir = plan.workspace.runs / f"debug-{plan.key}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = fit(config, reporter, None, workspace=plan.workspace, run_dir=run_dir, progress=True)
    if history:
        name = condition or plan.study.debug_condition or plan.conditions[-1].name
        for table in protocol_tables(plan.study.tables, history[-1]):  # COCO: 1K tables too
            if table.rows is None or name in table.rows:  # the tables that show this condition
                say(record_table(history[-1], table))
        say(f"best validation {plan.study.metric.removeprefix('val_')} at epoch {result.best_epoch}")
    else:
        say("no epoch ran")
    say(f"checkpoint: {run_dir}")
    return history


def _describe(plan: StudyPlan, config: ExperimentConfig, say: Callable[[str], None]) -> None:
    flat, default = to_flat(config), to_flat(ExperimentConfig())
    changed = {k: flat[k] for k in used_keys(config) if flat[k] != default[k]}
    say(f"debug: study {plan.key}, one trial in-process, {config.epochs} epochs")
    say("  " + " ".join(f"{k}={v}" for k, v in sorted(changed.items())))
    for line in check_data(config, plan.workspace):  # which files serve each split, protocols
        say(f"  {line}")
