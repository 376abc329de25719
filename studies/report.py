"""Report: the paper's table and figures of a study, from its MLflow runs.

``python -m studies.report NAME`` (also the last step of ``studies.run``) reads the study's parent
run and its child runs from MLflow, so every number in the report is traceable to a run, and
writes ``<workspace>/reports/<key>/``:

- ``table.md`` / ``table.tex``: per condition, mean +- std over the confirmation seeds of the test
  R@1/5/10 (i2t, t2i), R-precision (i2t), nDCG@25 (t2i) and rsum (LTD paper Table 1 layout);
- ``trials.csv``: every trial (search and confirmation) with its flat params and final metrics;
- ``lambda_per_eta.png`` (log scale), ``lrec_per_eta.png``, ``val_rsum_per_epoch.png``,
  ``best_val_rsum_vs_eta.png`` (LTD paper Figure 3);

and logs them as artifacts of the parent run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from icr.errors import UserError
from studies.tracking import PARENT_TAG, Tracker

# (metric suffix, header, direction): the columns of Table 1 of the LTD paper, plus rsum.
COLUMNS = (
    ("i2t_R_at_1", "R@1", "i2t"), ("i2t_R_at_5", "R@5", "i2t"), ("i2t_R_at_10", "R@10", "i2t"),
    ("i2t_rprec", "R-P", "i2t"),
    ("t2i_R_at_1", "R@1", "t2i"), ("t2i_R_at_5", "R@5", "t2i"), ("t2i_R_at_10", "R@10", "t2i"),
    ("t2i_nDCG_at_25", "nDCG@25", "t2i"), ("rsum", "rsum", ""),
)
ETA = "objective.eta"


# -- reading MLflow ---------------------------------------------------------------------------


def find_parent(tracker: Tracker, parent_id: str | None = None) -> Any:
    if parent_id:
        return tracker.client.get_run(parent_id)
    if tracker.client.get_experiment_by_name(tracker.experiment) is None:
        raise UserError(f"no MLflow experiment {tracker.experiment!r} in {tracker.tracking_uri}; "
                        f"run `python -m studies.run {tracker.experiment.removesuffix('-smoke')}` first")
    runs = tracker.find_runs("tags.`icr.role` = 'study'")
    if not runs:
        raise UserError(f"study {tracker.experiment!r} has no run in {tracker.tracking_uri}")
    return max(runs, key=lambda r: r.info.start_time)


def load_trials(tracker: Tracker, parent_id: str) -> pd.DataFrame:
    """One row per child run: identity, tags, every param, final metrics (not trajectories)."""
    rows = []
    for run in tracker.find_runs(f"tags.`{PARENT_TAG}` = '{parent_id}'"):
        tags = run.data.tags
        row: dict[str, Any] = {
            "run_id": run.info.run_id, "run_name": run.info.run_name, "status": run.info.status,
            "phase": tags.get("phase", ""), "condition": tags.get("condition", ""),
            "tune_trial_id": tags.get("tune_trial_id", ""), "seed": tags.get("seed", ""),
            "epochs": tags.get("epochs", ""), "budget_complete": tags.get("budget_complete", ""),
        }
        row.update({k: _number(v) for k, v in sorted(run.data.params.items())})
        row.update({k: v for k, v in sorted(run.data.metrics.items()) if "/" not in k})
        rows.append(row)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    return frame.sort_values(["phase", "condition", "run_name"], ignore_index=True)


def _number(value: str) -> Any:
    try:
        return float(value) if any(c in value for c in ".e") else int(value)
    except ValueError:
        return value


# -- the table --------------------------------------------------------------------------------


def table_rows(trials: pd.DataFrame, order: Sequence[str], labels: dict[str, str],
               searched: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Per condition: label, n seeds, and (mean, std) of each test column (None if absent)."""
    rows = []
    confirm = trials[(trials.get("phase") == "confirm") & (trials.get("status") == "FINISHED")] \
        if not trials.empty else trials
    for condition in order:
        runs = confirm[confirm["condition"] == condition] if not confirm.empty else confirm
        label = labels.get(condition, condition)
        values = [f"{k.split('.')[-1]}={_fmt_value(runs[k].iloc[0])}"
                  for k in searched.get(condition, []) if not runs.empty and k in runs]
        if values:
            label += f" ({', '.join(values)})"
        cells = {}
        for suffix, _, _ in COLUMNS:
            column = f"test_{suffix}"
            if runs.empty or column not in runs or runs[column].isna().all():
                cells[suffix] = None
            else:
                data = runs[column].dropna().astype(float)
                cells[suffix] = (data.mean(), data.std(ddof=1) if len(data) > 1 else 0.0)
        rows.append({"condition": condition, "label": label, "n": len(runs), "cells": cells})
    return rows


def _fmt_value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _best(rows: list[dict[str, Any]], suffix: str) -> float | None:
    means = [r["cells"][suffix][0] for r in rows if r["cells"][suffix] is not None]
    return max(means) if means else None


def _cells(rows: list[dict[str, Any]], row: dict[str, Any], mean_std: str, bold: str) -> list[str]:
    """A row's formatted ``mean +- std`` cells, the best mean of each column in bold."""
    cells = []
    for suffix, _, _ in COLUMNS:
        cell = row["cells"][suffix]
        if cell is None:
            cells.append("-")
            continue
        text = mean_std.format(*cell)
        cells.append(bold.format(text) if cell[0] == _best(rows, suffix) else text)
    return cells


def markdown_table(rows: list[dict[str, Any]], title: str) -> str:
    head = ["Condition", "n"] + [f"{d} {h}".strip() for _, h, d in COLUMNS]
    lines = [f"# {title}", "", "Test split, mean +- std over the confirmation seeds "
             "(best mean per column in bold).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = _cells(rows, row, "{:.1f} +- {:.1f}", "**{}**")
        lines.append(f"| {row['label']} | {row['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def latex_table(rows: list[dict[str, Any]], title: str) -> str:
    spec = "l" + "r" * len(COLUMNS)
    lines = [
        "% " + title, "\\begin{tabular}{" + spec + "}", "\\toprule",
        " & \\multicolumn{4}{c}{i2t} & \\multicolumn{4}{c}{t2i} & \\\\",
        "Condition & " + " & ".join(h for _, h, _ in COLUMNS) + " \\\\", "\\midrule",
    ]
    for row in rows:
        cells = _cells(rows, row, "{:.1f} $\\pm$ {:.1f}", "\\textbf{{{}}}")
        label = row["label"].replace("_", "\\_")
        lines.append(f"{label} & " + " & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


# -- the figures ------------------------------------------------------------------------------


def history(tracker: Tracker, run_id: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted((m.step, m.value) for m in tracker.client.get_metric_history(run_id, key))
    return [p[0] for p in points], [p[1] for p in points]


def write_figures(tracker: Tracker, trials: pd.DataFrame, order: Sequence[str], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    search = trials[trials["phase"] == "search"]
    lag = search[search.get("objective.name") == "lagrangian"] if ETA in search else search.iloc[:0]
    dual = search[search.get("objective.name") == "dual"] if "objective.name" in search else search.iloc[:0]
    if not lag.empty:
        norm = matplotlib.colors.Normalize(lag[ETA].min(), lag[ETA].max() + 1e-12)
        cmap = matplotlib.colormaps["viridis"]
        for key, name, ylabel, log in (
            ("trajectory/lambda", "lambda_per_eta.png", "lambda (log scale, 0 shown at 1e-3)", True),
            ("trajectory/L_rec", "lrec_per_eta.png", "L_rec", False),
        ):
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for _, run in lag.sort_values(ETA).iterrows():
                steps, values = history(tracker, run["run_id"], key)
                if log:
                    values = [max(v, 1e-3) for v in values]
                color = cmap(norm(run[ETA]))
                ax.plot(steps, values, color=color, lw=1.2, marker="." if len(steps) < 30 else None,
                        label=f"eta={run[ETA]:.3g}")
                if not log:
                    ax.axhline(run[ETA], color=color, lw=0.6, ls=":")
            if not log:
                for _, run in dual.iterrows():
                    steps, values = history(tracker, run["run_id"], key)
                    ax.plot(steps, values, color="0.5", lw=1.0, ls="--", label="dual")
            if log:
                ax.set_yscale("log")
            ax.set_xlabel("training step")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{key.split('/')[1]} during training, per eta (search trials)")
            _legend(ax)
            fig.tight_layout()
            fig.savefig(out / name, dpi=120)
            plt.close(fig)
            written.append(name)
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for full, marker in ((True, "o"), (False, "x")):
            part = lag[(lag["budget_complete"] == "true") == full]
            best = [max(history(tracker, r, "val_rsum")[1] or [math.nan]) for r in part["run_id"]]
            ax.scatter(part[ETA], best, marker=marker,
                       label="full budget" if full else "stopped early / failed")
        ax.set_xlabel("eta (bound on L_rec)")
        ax.set_ylabel("best validation rsum")
        ax.set_title("Best validation rsum against eta (search trials)")
        _legend(ax)
        fig.tight_layout()
        fig.savefig(out / "best_val_rsum_vs_eta.png", dpi=120)
        plt.close(fig)
        written.append("best_val_rsum_vs_eta.png")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    colors = {c: f"C{i}" for i, c in enumerate(order)}
    seen = set()
    for _, run in trials.iterrows():
        epochs, values = history(tracker, run["run_id"], "val_rsum")
        confirm = run["phase"] == "confirm"
        label = f"{run['condition']} ({run['phase']})"
        ax.plot(epochs, values, color=colors.get(run["condition"], "k"), marker=".",
                lw=1.8 if confirm else 0.8, alpha=1.0 if confirm else 0.5,
                ls="-" if confirm else "--", label=None if label in seen else label)
        seen.add(label)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation rsum")
    ax.set_title("Validation rsum per epoch")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(out / "val_rsum_per_epoch.png", dpi=120)
    plt.close(fig)
    written.append("val_rsum_per_epoch.png")
    return written


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


# -- the report -------------------------------------------------------------------------------


def build_report(tracker: Tracker, out: Path, parent_id: str | None = None) -> Path:
    """Write the report of the study's latest (or the given) parent run; log it to MLflow."""
    parent = find_parent(tracker, parent_id)
    tags = parent.data.tags
    trials = load_trials(tracker, parent.info.run_id)
    if trials.empty:
        raise UserError(f"the study run {parent.info.run_id} has no trial yet")
    order = [c for c in tags.get("conditions", "").split(",") if c] or sorted(trials["condition"].unique())
    labels = {c: tags.get(f"label.{c}", c) for c in order}
    searched = {c: [k for k in tags.get(f"searched.{c}", "").split(",") if k] for c in order}
    out.mkdir(parents=True, exist_ok=True)
    trials.to_csv(out / "trials.csv", index=False)
    rows = table_rows(trials, order, labels, searched)
    title = f"{tracker.experiment}: {tags.get('description', '')}".rstrip(": ")
    (out / "table.md").write_text(markdown_table(rows, title))
    (out / "table.tex").write_text(latex_table(rows, title))
    write_figures(tracker, trials, order, out)
    tracker.client.log_artifacts(parent.info.run_id, str(out), artifact_path="report")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    parser = argparse.ArgumentParser(prog="python -m studies.report", description=__doc__.split("\n")[0])
    parser.add_argument("name", help="study name (add -smoke for a --smoke run)")
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default the workspace sqlite store)")
    parser.add_argument("--run-id", help="the study's parent MLflow run (default: the latest)")
    args = parser.parse_args(argv)
    from icr.workspace import Workspace

    workspace = Workspace.resolve(args.workspace)
    tracker = Tracker(args.tracking_uri or workspace.mlflow_uri, args.name, workspace.root / "mlartifacts")
    try:
        out = build_report(tracker, workspace.reports / args.name, args.run_id)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {out}")
    print((out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
