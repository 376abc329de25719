"""``--debug``: one trial in-process, without Ray (a debugger and breakpoints work).

The study's base config with a condition's overrides (searched keys at the middle of their
domain) and the ``--set`` overrides, trained by ``icr.train.fit`` with tqdm progress bars; each
epoch prints a line, and a metrics table closes the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from icr.config import ExperimentConfig, to_flat
from studies.plan import StudyPlan

SUMMARY_KEYS = (
    "rsum", "i2t_R_at_1", "i2t_R_at_5", "i2t_R_at_10", "t2i_R_at_1", "t2i_R_at_5", "t2i_R_at_10",
    "i2t_rprec", "t2i_nDCG_at_25", "i2t_medr", "t2i_medr",
)


def run_debug(
    plan: StudyPlan, condition: str | None, fit: Callable[..., Any] | None = None,
    say: Callable[[str], None] = print,
) -> list[dict[str, float]]:
    config = plan.debug_config(condition)
    if fit is None:
        from icr.train import fit
    _describe(plan, config, say)
    history: list[dict[str, float]] = []

    def reporter(metrics: dict[str, float], checkpoint_dir: Path | None) -> None:
        history.append(dict(metrics))
        parts = [f"epoch {int(metrics['epoch'])}/{config.epochs}",
                 f"val rsum {metrics.get('val_rsum', float('nan')):.2f}",
                 f"loss {metrics.get('train_loss', float('nan')):.4f}"]
        if "train_L_rec" in metrics:
            parts.append(f"L_rec {metrics['train_L_rec']:.4f}")
        if "lambda" in metrics:
            parts.append(f"lambda {metrics['lambda']:.4g}")
        parts.append(f"{metrics.get('epoch_time_s', 0):.1f}s")
        say("  ".join(parts))

    run_dir = plan.workspace.runs / f"debug-{plan.key}-{time.strftime('%Y%m%d-%H%M%S')}"
    fit(config, reporter, None, workspace=plan.workspace, run_dir=run_dir, progress=True)
    say(metrics_table(history))
    say(f"checkpoint: {run_dir}")
    return history


def _describe(plan: StudyPlan, config: ExperimentConfig, say: Callable[[str], None]) -> None:
    flat = to_flat(config)
    changed = {k: v for k, v in flat.items() if v != to_flat(ExperimentConfig())[k]}
    say(f"debug: study {plan.key}, one trial in-process, {config.epochs} epochs")
    say("  " + " ".join(f"{k}={v}" for k, v in sorted(changed.items())))


def metrics_table(history: list[dict[str, float]]) -> str:
    """The last epoch's validation (and test) metrics as a small fixed-width table."""
    if not history:
        return "no epoch ran"
    last = history[-1]
    splits = [s for s in ("val", "test") if any(k.startswith(f"{s}_") for k in last)]
    lines = [f"{'metric':<16}" + "".join(f"{s:>10}" for s in splits)]
    for key in SUMMARY_KEYS:
        if any(f"{s}_{key}" in last for s in splits):
            cells = "".join(
                f"{last[f'{s}_{key}']:>10.2f}" if f"{s}_{key}" in last else f"{'-':>10}"
                for s in splits
            )
            lines.append(f"{key:<16}{cells}")
    best = max(history, key=lambda h: h.get("val_rsum", float("-inf")))
    lines.append(f"best validation rsum {best.get('val_rsum', float('nan')):.2f} "
                 f"at epoch {int(best['epoch'])}")
    return "\n".join(lines)
