"""End to end on Ray with the fake ``fit``: a study warm-started from an earlier one, and a study
with a second objective whose report's Pareto front is runs in MLflow."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from studies.insight import FRONT_TAG
from studies.pipeline import Backend
from studies.run import main
from studies.warm_start import SOURCE_RUN_TAG, SOURCE_TAG

from fakes import FakeFit, fake_prepare, fake_study

pytestmark = pytest.mark.slow  # whole studies on Ray: make test-all and CI run them


def parent_of(run_dir: Path) -> str:
    return json.loads((run_dir / "state.json").read_text())["parent_run_id"]


def test_a_warm_started_study_observes_the_earlier_trials_and_trains_none_again(
        cluster, tmp_path: Path, capsys) -> None:
    workspace = tmp_path / "ws"
    study = fake_study(tmp_path, budget=6, conditions=("lagrangian",))
    backend = Backend(FakeFit(epoch_seconds=0.05), fake_prepare)
    args = ["fake", "--workspace", str(workspace), "--seeds", "1"]
    assert main(args, backend=backend, extra_studies={"fake": study}) == 0
    first = next((workspace / "ray" / "fake").iterdir())
    earlier = pd.read_csv(first / "search-lagrangian.optuna.csv")
    capsys.readouterr()

    assert main([*args, "--warm-start", "fake", "--budget", "3"], backend=backend,
                extra_studies={"fake": study}) == 0
    out = capsys.readouterr().out
    assert "warm start from fake in sqlite:///" in out
    assert f"lagrangian: {len(earlier)} observation(s)" in out and "none trained again" in out
    second = max((workspace / "ray" / "fake").iterdir(), key=lambda p: p.name)
    assert second != first
    log = pd.read_csv(second / "search-lagrangian.optuna.csv")
    observed, own = log.iloc[:len(earlier)], log.iloc[len(earlier):]
    # the earlier trials, as they ended, are the new study's first trials; none has a Tune trial
    assert observed["tune_trial_id"].isna().all() and len(own) == 3
    def ended(frame: pd.DataFrame) -> list[tuple[float, str]]:
        return sorted(zip(frame["objective.eta"].round(9), frame["state"], strict=True))

    assert ended(observed) == ended(earlier)
    # none trained again: the new runs are the 3 new trials, none at an earlier value
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    parent = client.get_run(parent_of(second))
    assert parent.data.tags[SOURCE_RUN_TAG] == parent_of(first)
    assert parent.data.tags[SOURCE_TAG].startswith("fake in sqlite:///")
    runs = pd.read_csv(workspace / "reports" / "fake" / "trials.csv")
    mine = runs[runs["phase"] == "search"]
    assert len(mine) == 3  # the report counts only this study's own runs
    assert not set(mine["objective.eta"].round(9)) & set(earlier["objective.eta"].round(9))
    best = earlier[earlier["state"] == "COMPLETE"]["value"].max()
    assert log[log["state"] == "COMPLETE"]["value"].max() >= best


def test_a_two_objective_study_reports_its_pareto_front_as_runs(cluster, tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    study = replace(fake_study(tmp_path, budget=6), cost="epoch_time_s")
    fit = FakeFit(epoch_seconds=0.05, seconds_per_eta=10.0)  # dearer with a larger eta
    rc = main(["fake", "--workspace", str(workspace), "--seeds", "1"],
              backend=Backend(fit, fake_prepare), extra_studies={"fake": study})
    assert rc == 0
    run_dir = next((workspace / "ray" / "fake").iterdir())
    log = pd.read_csv(run_dir / "search-lagrangian.optuna.csv")
    complete = log[log["state"] == "COMPLETE"]
    assert complete["cost"].notna().all() and len(complete) >= 1  # both objectives told
    report = workspace / "reports" / "fake"
    assert (report / "pareto.png").stat().st_size > 5000
    text = (report / "search_space.md").read_text()
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fake")
    tagged = {r.info.run_id for r in client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.{FRONT_TAG} = 'true'")}
    assert tagged and all(f"`{run}`" in text for run in tagged)
    front = text[text.index("### Quality against cost"):]  # not the importance table above it
    table = [line for line in front.splitlines() if line.startswith("| ") and "`" in line]
    assert len(table) == len(tagged)  # every point of the table is a tagged run, and only those
    # the front is the brute-force one over every full-budget run (the fake's cost is constant
    # over a run's epochs, so its last value is its mean)
    runs = pd.read_csv(report / "trials.csv")
    full = runs[(runs["status"] == "FINISHED") & (runs["budget_complete"].astype(str).str.lower() == "true")]
    points = list(zip(full["val_rsum"], full["epoch_time_s"], strict=True))
    front = {run for run, (v, c) in zip(full["run_id"], points, strict=True)
             if not any(v2 >= v and c2 <= c and (v2 > v or c2 < c) for v2, c2 in points)}
    assert tagged == front
