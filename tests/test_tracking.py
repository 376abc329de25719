"""Recording in MLflow: the one-transaction epoch record equals MLflow's own ``log_batch``."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from studies.tracking import (
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    Tracker,
    epoch_metrics,
    error_line,
)
from studies.trials import run_name


@pytest.fixture()
def tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", tmp_path / "artifacts")


def _batches(now: int) -> list[list[Metric]]:
    """Three records: rising steps, a step logged again later with another value, NaN and inf,
    and an older value that must not replace the latest."""
    first = [Metric("val_rsum", 100.0, now, 1), Metric("trajectory/loss", 2.0, now, 10),
             Metric("trajectory/loss", 1.5, now, 20), Metric("odd", math.nan, now, 1)]
    second = [Metric("val_rsum", 120.0, now + 5, 2), Metric("trajectory/loss", 1.2, now + 5, 30),
              Metric("odd", math.inf, now + 5, 2), Metric("late", 7.0, now + 5, 3)]
    third = [Metric("val_rsum", 90.0, now + 9, 1), Metric("late", 3.0, now + 9, 3),
             Metric("trajectory/loss", -math.inf, now + 9, 40)]
    return [first, second, third]


def _snapshot(client: MlflowClient, run_id: str) -> tuple[dict, dict]:
    metrics = client.get_run(run_id).data.metrics
    keys = sorted(metrics)
    history = {k: sorted((m.step, m.timestamp, m.value if not math.isnan(m.value) else "nan")
                         for m in client.get_metric_history(run_id, k)) for k in keys}
    latest = {k: "nan" if math.isnan(v) else v for k, v in metrics.items()}
    return history, latest


def test_one_transaction_records_what_log_batch_records(tracker):
    now = int(time.time() * 1000)
    ours = tracker.create_run("ours", {})
    theirs = tracker.create_run("theirs", {})
    for batch in _batches(now):
        tracker.log_batch(ours, batch)
        tracker.client.log_batch(theirs, metrics=batch)
    assert _snapshot(tracker.client, ours) == _snapshot(tracker.client, theirs)
    history, latest = _snapshot(tracker.client, ours)
    assert latest["val_rsum"] == 120.0 and latest["late"] == 3.0 and latest["odd"] > 1e300
    assert len(history["trajectory/loss"]) == 4


def test_a_record_logged_twice_falls_back_to_mlflows_dedup(tracker):
    now = int(time.time() * 1000)
    run = tracker.create_run("r", {})
    batch = _batches(now)[0]
    tracker.log_batch(run, batch)
    tracker.log_batch(run, batch)  # the same rows again: no error, nothing doubled
    assert len(tracker.client.get_metric_history(run, "trajectory/loss")) == 2


def test_an_epoch_record_becomes_metrics_and_trajectory():
    result = {"epoch": 2, "val_rsum": 150.0, "lambda": 3.0, "done": False, "trial_id": "x",
              "final": False, "artifacts": [],
              "trajectory": [{"step": 20, "epoch": 2, "loss": 1.0, "L_con": 0.5}]}
    metrics = {(m.key, m.step): m.value for m in epoch_metrics(result, 0)}
    assert metrics == {("epoch", 2): 2.0, ("val_rsum", 2): 150.0, ("lambda", 2): 3.0,
                       ("trajectory/loss", 20): 1.0, ("trajectory/L_con", 20): 0.5}


def test_error_line_and_run_name():
    text = "Failure # 1\nTraceback ...\nicr.errors.TrainingError: non-finite loss at epoch 2\n"
    assert error_line(text) == "TrainingError: non-finite loss at epoch 2"
    assert error_line(ValueError("bad\nvalue")) == "ValueError: value"
    assert error_line(None).startswith("the trial failed without an error")
    assert run_name("lagrangian", {"objective.eta": 0.11234, "train.seed": 1000}) == \
        "lagrangian eta=0.112 seed=1000"


def test_a_failed_trial_s_error_is_read_before_tune_copies_it_to_the_storage(tmp_path, monkeypatch) -> None:
    """Tune writes the error into the driver's staging folder and copies it to the storage later;
    the callbacks run in between and must still name the cause."""
    from ray.train._internal import storage as ray_storage
    from ray.train._internal.storage import StorageContext

    # The staging folder lives in the Ray session's folder; no Ray instance is needed for it here.
    monkeypatch.setattr(ray_storage, "_get_ray_train_session_dir", lambda: str(tmp_path / "session"))
    from ray.tune.experiment import Trial

    from icr.errors import TrainingError
    from studies.frameworks.tune import trial_error

    storage = StorageContext(storage_path=str(tmp_path / "storage"), experiment_dir_name="exp",
                             trial_dir_name="trial_0")
    trial = Trial("trainable", stub=True, storage=storage)
    trial.init_local_path()
    trial.handle_error(TrainingError("non-finite loss at epoch 2"))
    assert trial.get_error() is None  # not copied to the storage yet
    assert error_line(trial_error(trial)).endswith("non-finite loss at epoch 2")


def _workspace_tracker(workspace, name: str = "t") -> Tracker:
    """A tracker as a study opens it: the workspace's sqlite store, artifacts beside it."""
    return Tracker(f"sqlite:///{workspace / 'mlflow.db'}", name, workspace / "mlartifacts")


def test_the_experiment_opens_on_its_runs_in_mlflow_3(tracker):
    """MLflow 3's UI opens an experiment tagged custom_model_development on its runs table (and
    one without the tag on the GenAI traces page); an experiment made before the tag gets it."""
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    old = tracker.client.create_experiment("old")
    assert EXPERIMENT_KIND_TAG not in tracker.client.get_experiment(old).tags
    reopened = Tracker(tracker.tracking_uri, "old", tracker.artifact_root)
    assert reopened.experiment_id == old
    assert tracker.client.get_experiment(old).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_a_copied_workspace_reads_its_own_artifacts(tmp_path, monkeypatch):
    """MLflow records artifact locations as absolute paths: a copy of a workspace (its original
    then removed) must still list and read its runs' artifacts, through MLflow's own client."""
    import shutil

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    original = tmp_path / "a" / "ws"
    original.mkdir(parents=True)
    tracker = _workspace_tracker(original)
    run_id = tracker.create_run("r", {})
    note = tmp_path / "note.txt"
    note.write_text("kept")
    tracker.client.log_artifact(run_id, str(note), artifact_path="report")
    tracker.client.set_terminated(run_id)
    copy = tmp_path / "b" / "moved"
    shutil.copytree(original, copy)
    shutil.rmtree(original)

    moved = _workspace_tracker(copy)
    assert moved.experiment_id == tracker.experiment_id
    client = MlflowClient(moved.tracking_uri)  # a fresh client, as the UI or a notebook has
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/note.txt"]
    local = client.download_artifacts(run_id, "report/note.txt", str(tmp_path / "out"))
    assert Path(local).read_text() == "kept"
    assert client.get_run(run_id).info.artifact_uri.startswith((copy / "mlartifacts").as_uri())


def test_a_store_shared_by_workspaces_keeps_each_one_s_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    store = f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}"
    (tmp_path / "shared").mkdir()
    first = Tracker(store, "first", tmp_path / "one" / "mlartifacts")
    location = first.client.get_experiment(first.experiment_id).artifact_location
    second = Tracker(store, "first", tmp_path / "two" / "mlartifacts")
    assert second.experiment_id == first.experiment_id
    assert second.client.get_experiment(first.experiment_id).artifact_location == location
