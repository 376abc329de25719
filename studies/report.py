"""Report: a study's declared tables and figures, from its MLflow runs.

``python -m studies.report NAME`` (also the last step of ``studies.run``) reads the study's parent
run and its child runs from MLflow (:mod:`studies.runs`), so every number in the report is
traceable to a run, and writes ``<workspace>/reports/<key>/``:

- per declared table (:mod:`studies.tables`): ``<table>.md`` and ``<table>.tex``, one row per
  condition (of the table's ``rows``) over its finished confirmation runs (mean ± std over seeds,
  Welch's t-test against the baseline row, Holm-Bonferroni over the table's tests); a condition
  none of whose runs finished says why in its row; under the table, the data fingerprint its
  runs trained on (the embedded benchmark's manifest's); ``<table>_vs_baseline.md`` / ``.tex``:
  each row's difference to the baseline with its 95 % Welch-Satterthwaite confidence interval;
- ``trials.csv``: every trial (search and confirmation) with its recorded params, final metrics
  and, for a failed one, the one-line cause;
- the declared figures (:mod:`studies.figures`), ``<figure>.png``;
- per searched condition, what its search learned about its space (:mod:`studies.insight`):
  the searched keys' importance, every trial in parallel coordinates and, for a study with a
  second objective, the Pareto front (``search_space.md`` and its figures);

logs them as artifacts of the parent run, puts the tables that fit (MLflow's tag limit) in the
parent run's description and the per-condition mean and std of every table cell among its metrics
(``report/<condition>.<metric>.mean`` and ``.std``: one chart section in the MLflow UI).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from icr.errors import UserError
from icr.workspace import Workspace
from studies.catalog import Study, get_study
from studies.ensembles import Evaluator, ensemble_of, evaluate_members
from studies.figures import render
from studies.insight import FRONT_TAG, write_insight
from studies.runs import RunSet, load_runs
from studies.tables import (
    Table,
    differences_latex,
    differences_markdown,
    has_differences,
    protocol_tables,
    summarize,
    to_latex,
    to_markdown,
)
from studies.tracking import MAX_TAG_BYTES, Tracker

DESCRIPTION_TAG = "mlflow.note.content"  # what the MLflow UI shows as a run's description
SUMMARY_PREFIX = "report"  # the parent run's metrics of the tables' cells: report/<condition>/...


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


def row_labels(study: Study, runs: RunSet, searched: dict[str, list[str]]) -> dict[str, str]:
    """Each condition's label, with the values its winner was confirmed with (``eta=0.229``)."""
    labels = {}
    for condition in study.conditions:
        confirm = runs.where(phase="confirm", condition=condition.name)
        values = [f"{key.split('.')[-1]}={_fmt(confirm[key].iloc[0])}"
                  for key in searched.get(condition.name, [])
                  if not confirm.empty and key in confirm and pd.notna(confirm[key].iloc[0])]
        labels[condition.name] = condition.label + (f" ({', '.join(values)})" if values else "")
    return labels


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def add_ensemble(study: Study, runs: RunSet, tracker: Tracker, parent_id: str,
                 workspace: Workspace, evaluate: Evaluator | None = None) -> bool:
    """Evaluate the best condition (the mean test value of the study's metric, e.g. test_rsum)
    as an ensemble of its seeds (``evaluate``: where; in-process by default); True if logged."""
    metric = "test_" + study.metric.removeprefix("val_")
    finished = runs.finished("confirm")
    if finished.empty or metric not in finished:
        return False
    means = finished.groupby("condition")[metric].mean()
    best = means.idxmax() if study.mode == "max" else means.idxmin()

    return ensemble_of(runs, best, tracker, parent_id, workspace,
                       evaluate or evaluate_members) is not None


def failure_notes(study: Study, runs: RunSet) -> list[str]:
    """One line per condition whose confirmation runs did not all finish: which failed and why
    (the runs' error lines), so a short ``n`` or a row of dashes is never left unexplained."""
    notes = []
    for condition in study.conditions:
        finished = runs.where(phase="confirm", status="FINISHED", condition=condition.name)
        attempted = runs.where(phase="confirm", condition=condition.name)
        if not finished.empty:
            failed = attempted[attempted["status"] != "FINISHED"]
            if not failed.empty:
                seeds = ", ".join(str(s) for s in sorted(failed.get("seed", [])))
                errors = sorted({e for e in failed.get("error", []) if e}) or ["no error recorded"]
                notes.append(f"- {condition.label}: {len(failed)} of {len(attempted)} confirmation "
                             f"runs did not finish (seed {seeds}): {'; '.join(errors[:3])}")
            continue
        searched = runs.where(phase="search", condition=condition.name)
        errors = sorted({e for e in pd.concat([attempted, searched]).get("error", []) if e})
        if errors:
            why = "; ".join(errors[:3])
        elif attempted.empty and not searched.empty:
            why = "no search trial ran the full budget, so there was no winner to confirm"
        else:
            why = "no confirmation run"
        notes.append(f"- {condition.label}: no finished run: {why}")
    return notes


def data_notes(study: Study, tags: dict[str, str]) -> list[str]:
    """The line under each table naming the data the study trained on: the data fingerprint it
    recorded per condition (``data_fingerprint.<condition>``; the embedded benchmark's is its
    manifest's, the same on every CPU), one for all conditions when they share it."""
    prints = {c.label: tags[f"data_fingerprint.{c.name}"] for c in study.conditions
              if tags.get(f"data_fingerprint.{c.name}")}
    if not prints:
        return []
    if len(set(prints.values())) == 1:
        return [f"Data fingerprint `{next(iter(prints.values()))}`."]
    return ["Data fingerprints: " + "; ".join(f"{label} `{f}`" for label, f in prints.items()) + "."]


def table_frame(table: Table, study: Study, runs: RunSet, labels: dict[str, str]
                ) -> tuple[pd.DataFrame, list[str], dict[str, str]]:
    """The runs a table summarises (the finished confirmation runs, then an ensemble row per
    ensemble run, then the table's reference rows), their condition order and row labels."""
    finished = runs.finished("confirm")
    order = [c.name for c in study.conditions if table.rows is None or c.name in table.rows]
    if table.rows is not None:
        finished = finished[finished["condition"].isin(order)] if not finished.empty else finished
    labels = dict(labels)
    for _, ensemble in runs.finished("ensemble").iterrows():  # a row per ensemble run
        name, members = f"ensemble:{ensemble['condition']}", str(ensemble["members"]).split(",")
        finished = pd.concat([finished, ensemble.to_frame().T.assign(condition=name)],
                             ignore_index=True)
        labels[name] = f"ensemble of the {len(members)} runs of {labels[ensemble['condition']]}"
        order.append(name)
    frames = [finished]
    for label, prefix, replacement in table.references:
        ref = pd.DataFrame({"condition": [label] * len(finished)})
        for column in table.columns:
            source = column.key.replace(prefix, replacement, 1)
            if source in finished:
                ref[column.key] = finished[source].to_numpy()
        frames.append(ref)
        order.append(label)
    frame = pd.concat(frames, ignore_index=True) if not finished.empty else \
        pd.DataFrame({"condition": []})
    return frame, order, labels


def write_table(table: Table, study: Study, runs: RunSet, labels: dict[str, str],
                notes: list[str], out: Path, data: Sequence[str] = ()) -> tuple[str, dict[str, float]]:
    """Write ``<table>.md`` / ``.tex``; return the Markdown and the cells as parent-run metrics.
    ``notes`` (why runs are missing) and ``data`` (:func:`data_notes`) go under the table."""
    frame, order, labels = table_frame(table, study, runs, labels)
    rows = summarize(frame, table, order, labels)
    markdown = to_markdown(rows, table) + "".join("\n" + "\n".join(lines) + "\n"
                                                  for lines in (notes, data) if lines)
    (out / f"{table.name}.md").write_text(markdown, encoding="utf-8")
    (out / f"{table.name}.tex").write_text(to_latex(rows, table) + "".join(f"% {line}\n" for line in data),
                                           encoding="utf-8")
    if has_differences(rows, table):
        differences = differences_markdown(rows, table)
        (out / f"{table.name}_vs_baseline.md").write_text(differences, encoding="utf-8")
        (out / f"{table.name}_vs_baseline.tex").write_text(differences_latex(rows, table),
                                                           encoding="utf-8")
        markdown += "\n" + differences
    metrics = {}
    for row in rows:
        name = re.sub(r"[^\w\-./: ]", "", row.condition).strip()  # MLflow's metric-name alphabet
        for key, cell in row.cells.items():
            if cell.n and math.isfinite(cell.mean):
                metrics[summary_metric(name, key, "mean")] = _clean(cell.mean)
                if cell.n > 1:
                    metrics[summary_metric(name, key, "std")] = _clean(cell.std)
    return markdown, metrics


def summary_metric(condition: str, key: str, statistic: str) -> str:
    """The parent run's metric of one table cell: ``report/lagrangian.test_rsum.mean``. MLflow
    3.17's UI makes a chart section per name prefix before the *last* ``/``
    (``benchmarks/mlflow_ui_check.py`` checks it in a headless Chromium), so the name has
    exactly one: the report's aggregates form one section, ``report``, beside the trials' own (a
    ``/`` inside a metric's own name, e.g. ``negatives/true_negative``, becomes ``.``)."""
    return f"{SUMMARY_PREFIX}/{condition}.{key.replace('/', '.')}.{statistic}"


def _clean(value: float) -> float:
    """A mean or std as the MLflow UI shows it to a reader: 3 decimals (42.79999999999999 ->
    42.8, 22.8377500339 -> 22.838), already finer than the tables' 1 decimal; the trials' own
    metrics, from which every aggregate is recomputed, keep full precision."""
    return round(float(value), 3)


def build_report(study: Study, tracker: Tracker, out: Path, parent_id: str | None = None,
                 workspace: Workspace | None = None, evaluate: Evaluator | None = None) -> Path:
    """Write the report of the study's latest (or the given) parent run; log it to MLflow.

    ``evaluate``: where an ensemble row's members are evaluated (:mod:`studies.ensembles`: a Ray
    task during a study, in-process by default)."""
    parent = find_parent(tracker, parent_id)
    runs = load_runs(tracker, parent.info.run_id)
    if runs.frame.empty:
        raise UserError(f"the study run {parent.info.run_id} has no trial yet")
    if study.ensemble and workspace is not None and add_ensemble(
            study, runs, tracker, parent.info.run_id, workspace, evaluate):
        runs = load_runs(tracker, parent.info.run_id)
    tags = parent.data.tags
    searched = {c.name: [k for k in tags.get(f"searched.{c.name}", "").split(",") if k]
                for c in study.conditions}
    out.mkdir(parents=True, exist_ok=True)
    runs.frame.to_csv(out / "trials.csv", index=False)
    labels = row_labels(study, runs, searched)
    notes, data = failure_notes(study, runs), data_notes(study, tags)
    description, summary = [], {}
    tables = protocol_tables(study.tables, runs.frame)  # COCO: each with its 5-fold 1K table
    for table in tables:
        markdown, metrics = write_table(table, study, runs, labels, notes, out, data)
        description.append(markdown)
        summary.update(metrics)
    for figure in study.figures:
        render(figure, runs, out / f"{figure.name}.png")
    run_id = parent.info.run_id
    insight = write_insight(study, runs, tags, out)
    summary.update(insight.metrics)
    for front_run in insight.front_runs:
        tracker.set_tags(front_run, {FRONT_TAG: "true"})
    tracker.set_tags(run_id, {DESCRIPTION_TAG: fit_description(description, tables)})
    tracker.log_metrics(run_id, summary, step=0)
    tracker.log_artifacts(run_id, out, "report")
    return out


def fit_description(tables: list[str], declared: Sequence[Table]) -> str:
    """The tables, in order, that fit in a run's description: a tag value of at most
    ``MAX_TAG_BYTES`` UTF-8 bytes, the length every MLflow store keeps whole (past its own limit
    a store cuts the tag mid-row or refuses it); the others are named as the report's
    artifacts."""
    limit = MAX_TAG_BYTES - 200  # room for the line naming the others
    kept: list[str] = []
    for markdown in tables:
        if len("\n\n".join([*kept, markdown]).encode("utf-8")) > limit:
            break
        kept.append(markdown)
    left = [f"`report/{t.name}.md`" for t in declared[len(kept):]]
    if left:
        kept.append(f"More tables among this run's artifacts: {', '.join(left)}.")
    return "\n\n".join(kept)


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    parser = argparse.ArgumentParser(prog="python -m studies.report",
                                     description="Rebuild a study's report from MLflow.")
    parser.add_argument("name", help="study name (add -smoke for a --smoke run)")
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default the workspace sqlite store)")
    parser.add_argument("--run-id", help="the study's parent MLflow run (default: the latest)")
    args = parser.parse_args(argv)

    try:
        study = get_study(args.name.removesuffix("-smoke"))
        workspace = Workspace.resolve(args.workspace)
        tracker = Tracker(args.tracking_uri or workspace.mlflow_uri, args.name, workspace.mlartifacts)
        out = build_report(study, tracker, workspace.reports / args.name, args.run_id, workspace)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {out}")
    for table in study.tables:
        for name in (table.name, f"{table.name}_1k"):  # COCO: its 5-fold 1K table too
            if (out / f"{name}.md").is_file():
                print((out / f"{name}.md").read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
