"""Recording in MLflow: the platform's recorder (MLflow's public ``log_batch``, called by one
thread) writes every record once, on a local store and on an MLflow server; a store that the
installed MLflow cannot open is refused in one line."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from icr.config import ExperimentConfig
from icr.errors import UserError
from studies.failures import error_line, failed_in_training
from studies.tracking import (
    ERROR_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    MAX_TAG_BYTES,
    MlflowTrialCallback,
    Tracker,
    check_store,
    epoch_metrics,
    step_tags,
)
from studies.trials import KEY, TrialSpec, run_name, trial_label

from servers import loopback_server, served_artifacts

ROOT = Path(__file__).resolve().parents[1]


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


def _snapshot(client: MlflowClient, run_id: str, timestamps: bool = True) -> tuple[dict, dict]:
    """Every key's history (sorted) and latest value, NaN as "nan" (NaN != NaN)."""
    metrics = client.get_run(run_id).data.metrics
    history = {k: sorted(((m.step, m.timestamp) if timestamps else (m.step,))
                         + ("nan" if math.isnan(m.value) else m.value,)
                         for m in client.get_metric_history(run_id, k)) for k in metrics}
    latest = {k: "nan" if math.isnan(v) else v for k, v in metrics.items()}
    return history, latest


def test_the_recorder_records_what_log_batch_records(tmp_path, monkeypatch):
    """The recorder's queue (records merged per run) leaves the store as MLflow's synchronous
    log_batch of each record does: history and latest values, with MLflow's rule for the latest
    (greatest step, timestamp, value) and NaN / inf as it stores them."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    now = int(time.time() * 1000)
    ours = tracker.create_run("ours", {})
    theirs = tracker.create_run("theirs", {})
    for batch in _batches(now):
        tracker.log_batch(ours, batch)
        tracker.client.log_batch(theirs, metrics=batch, synchronous=True)
    assert tracker.flush() == 0
    assert _snapshot(tracker.client, ours) == _snapshot(tracker.client, theirs)
    history, latest = _snapshot(tracker.client, ours)
    assert latest["val_rsum"] == 120.0 and latest["late"] == 3.0 and latest["odd"] > 1e300
    assert latest["trajectory/loss"] == pytest.approx(-1.7976931348623157e308)
    assert len(history["trajectory/loss"]) == 4


def test_a_record_logged_twice_is_not_doubled(tmp_path, monkeypatch):
    """An epoch recorded again after a resume: MLflow's dedup keeps one copy."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    run = tracker.create_run("r", {})
    batch = _batches(int(time.time() * 1000))[0]
    tracker.log_batch(run, batch)
    tracker.flush()
    tracker.log_batch(run, batch)  # the same rows again: no error, nothing doubled
    assert tracker.flush() == 0
    assert len(tracker.client.get_metric_history(run, "trajectory/loss")) == 2


def test_a_record_that_cannot_be_written_is_an_error_line(tmp_path, monkeypatch, caplog):
    """A queued record MLflow refuses (its run was deleted) is not lost silently: flush says how
    many records of which run were not recorded, in one line, and the tracker goes on."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    gone, kept = tracker.create_run("gone", {}), tracker.create_run("kept", {})
    tracker.client.delete_run(gone)
    now = int(time.time() * 1000)
    tracker.log_batch(gone, [Metric("val_rsum", 1.0, now, 1)])
    tracker.log_batch(kept, [Metric("val_rsum", 2.0, now, 1)])
    with caplog.at_level(logging.ERROR, logger="studies.tracking"):
        assert tracker.flush() == 1
    (line,) = [r.getMessage() for r in caplog.records if r.name == "studies.tracking"]
    assert line.startswith(f"MLflow did not record 1 epoch record(s) of run {gone}: ")
    assert "\n" not in line and "active" in line  # MLflow's cause: the run is not active
    assert tracker.client.get_run(kept).data.metrics == {"val_rsum": 2.0}


def test_a_run_is_finished_with_every_record_it_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t")
    run = tracker.create_run("r", {})
    now = int(time.time() * 1000)
    for epoch in range(1, 6):
        tracker.log_batch(run, [Metric("epoch", epoch, now + epoch, epoch)])
    tracker.finish(run)
    fresh = MlflowClient(tracker.tracking_uri)  # another reader, as the report or the UI
    assert fresh.get_run(run).info.status == "FINISHED"
    assert [m.step for m in fresh.get_metric_history(run, "epoch")] == [1, 2, 3, 4, 5]


def test_records_queued_while_one_is_written_are_merged_per_run(tracker, monkeypatch):
    """The first record is held in its log_batch until 59 more (of three runs) are queued: they
    are written in the next pass, one log_batch per run, each run's records in their order."""
    calls, writing, queued = [], threading.Event(), threading.Event()
    log_batch = tracker.client.log_batch

    def held_first(run_id, metrics, synchronous):
        calls.append((run_id, [m.step for m in metrics]))
        if len(calls) == 1:
            writing.set()
            assert queued.wait(timeout=60)
        return log_batch(run_id, metrics=metrics, synchronous=synchronous)

    runs = [tracker.create_run(f"r{i}", {}) for i in range(3)]
    monkeypatch.setattr(tracker.client, "log_batch", held_first)
    now = int(time.time() * 1000)
    records = [(run, Metric("val_rsum", 10.0 * i + epoch, now, epoch))
               for epoch in range(1, 21) for i, run in enumerate(runs)]
    tracker.log_batch(records[0][0], [records[0][1]])
    assert writing.wait(timeout=60)  # the writer is inside its first call
    for run, metric in records[1:]:
        tracker.log_batch(run, [metric])
    queued.set()
    assert tracker.flush() == 0
    assert calls == [(runs[0], [1]), (runs[1], list(range(1, 21))),
                     (runs[2], list(range(1, 21))), (runs[0], list(range(2, 21)))]
    for i, run in enumerate(runs):
        assert tracker.client.get_run(run).data.metrics == {"val_rsum": 10.0 * i + 20}
        assert len(tracker.client.get_metric_history(run, "val_rsum")) == 20


@pytest.mark.slow  # a Python that imports MLflow and Ray Tune: 5 s, 30 s on a loaded machine
def test_a_driver_that_exits_writes_what_it_queued(tmp_path):
    """No flush, no finish: the interpreter's exit waits for the writer (not a daemon thread)."""
    db = tmp_path / "mlflow.db"
    run = Tracker(f"sqlite:///{db}", "t").create_run("r", {})
    script = ("import sys; from mlflow.entities import Metric; from studies.tracking import Tracker\n"
              "t = Tracker(sys.argv[1], 't')\n"
              "for e in range(1, 51): t.log_batch(sys.argv[2], [Metric('epoch', e, 0, e)])\n")
    subprocess.run([sys.executable, "-c", script, f"sqlite:///{db}", run], check=True,
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert len(MlflowClient(f"sqlite:///{db}").get_metric_history(run, "epoch")) == 50


# --- a store the installed MLflow cannot open ---------------------------------------------------


def test_a_store_at_another_schema_is_refused_in_one_line(tmp_path):
    """MLflow refuses a store at another schema revision than its own; the platform says so in
    one line before Ray starts (the revision is set by hand, as another MLflow would leave it)."""
    db = tmp_path / "mlflow.db"
    # Made through another spelling of the path: MLflow keeps the store it opened per URI, and
    # check_store must open this one afresh, as a new driver does.
    Tracker(f"sqlite:///{tmp_path}/./mlflow.db", "t").create_run("r", {})
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = '0a1b2c3d4e5f'")
    with pytest.raises(UserError) as refused:
        check_store(f"sqlite:///{db}")
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"the MLflow store {db} cannot be opened by the "
                                                "installed mlflow ")
    assert "0a1b2c3d4e5f" in line
    check_store("http://127.0.0.1:5000")  # a server's store is the server's business


def test_mlflow_internals_are_reached_only_in_the_adapter():
    """``grep -rnE '_tracking_client|SqlAlchemyStore|mlflow\\.store' studies icr`` finds only
    studies/frameworks/ (issue 19)."""
    pattern = re.compile(r"_tracking_client|SqlAlchemyStore|mlflow\.store")
    found = [f"{path.relative_to(ROOT)}:{number}"
             for package in ("studies", "icr") for path in sorted((ROOT / package).rglob("*.py"))
             if "frameworks" not in path.relative_to(ROOT).parts
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []


def test_a_tag_of_the_documented_length_is_kept_whole(tracker):
    """``MAX_TAG_BYTES`` (MLflow's REST API reference) is within what the installed MLflow's
    store keeps: a description of that many bytes, in one- or two-byte characters, comes back
    whole."""
    run = tracker.create_run("r", {})
    for value in ("x" * MAX_TAG_BYTES, "\u00b1" * (MAX_TAG_BYTES // 2)):
        assert len(value.encode("utf-8")) == MAX_TAG_BYTES
        tracker.set_tags(run, {"mlflow.note.content": value})
        assert tracker.client.get_run(run).data.tags["mlflow.note.content"] == value


def test_a_failed_run_continued_loses_its_error_tag(tracker):
    """text_encoder on shapes-4: two confirmation runs failed, were continued by the next
    command and finished, and their runs still named the old failure in trials.csv."""
    parent = tracker.create_run("study", {"icr.role": "study"})
    run = tracker.child_run(parent, "t0", "bert seed=1000", {"icr.role": "trial"}, {})
    tracker.set_tags(run, {ERROR_TAG: "ConfigError: resume was written with another config"})
    tracker.finish(run, "FAILED")
    assert tracker.child_run(parent, "t0", "bert seed=1000", {"icr.role": "trial"}, {}) == run
    found = tracker.client.get_run(run)
    assert found.info.status == "RUNNING" and ERROR_TAG not in found.data.tags
    assert tracker.child_run(parent, "t0", "bert seed=1000", {}, {}) == run  # no tag: nothing to remove


# --- the same trial recorded on a local store and on an MLflow server -------------------------


def _trial_config(eta: float) -> dict:
    """A trial's Tune config: its spec (the params include one longer than MLflow's limit)."""
    params = {"objective.eta": eta, "loss.tau": 0.05, "note": "x" * 600}
    return {KEY: TrialSpec("lag", {"objective.eta": eta}, ExperimentConfig(), params)}


def _record_a_study(tracker: Tracker) -> None:
    """Two trials through the Tune callback (fake trials, no Ray): run creation, three epochs
    each (NaN included, trajectory rows), one epoch replayed after a restore, then the end."""
    parent = tracker.create_run("study", {"icr.role": "study"}, {"budget": 2})
    callback = MlflowTrialCallback(tracker, parent, {"study": "t"}, {"lag": "fp"}, {"lag": 3})
    trials = [SimpleNamespace(trial_id=f"t{i}", last_result={"epoch": 3},
                              config=_trial_config(0.1 * (i + 1))) for i in range(2)]
    for trial in trials:
        callback.on_trial_start(0, trials, trial)
    for epoch in (1, 2, 3, 3):  # epoch 3 again: a result replayed after a restore
        for i, trial in enumerate(trials):
            result = {"epoch": epoch, "val_rsum": 100.0 * i + epoch, "odd": math.nan,
                      "done": False, "trial_id": trial.trial_id, "artifacts": [], "final": False,
                      "trajectory": [{"step": 10 * epoch + r, "epoch": epoch, "loss": 1.0 / (r + 1),
                                      "lambda": 0.5 * r} for r in range(3)]}
            callback.on_trial_result(0, trials, trial, result)
    for trial in trials:
        callback.on_trial_complete(0, trials, trial)
    callback.on_experiment_end(trials)
    tracker.finish(parent)


def test_an_epoch_with_a_checkpoint_is_recorded_once_tune_saved_the_checkpoint(tracker, tmp_path):
    """An epoch that came with a checkpoint is not recorded when its result arrives but when
    Tune has saved the checkpoint (the trial marked it before): the run then holds the epoch
    and names the checkpoint, which the driver leaves as the trial marked it."""
    from ray import tune

    from studies.frameworks.tune import CHECKPOINT_DIR
    from studies.trainable import mark, mark_of

    parent = tracker.create_run("study", {"icr.role": "study"})
    callback = MlflowTrialCallback(tracker, parent, {"study": "t"}, {"lag": "fp"}, {"lag": 3})
    trial = SimpleNamespace(trial_id="t0", config=_trial_config(0.1), last_result=None)
    folder = tmp_path / "checkpoint_000001"
    folder.mkdir()
    (folder / "model.pt").write_bytes(b"weights")
    checkpoint = tune.Checkpoint.from_directory(str(folder))
    result = {"epoch": 1, "val_rsum": 101.0, "trial_id": "t0", "training_iteration": 1,
              CHECKPOINT_DIR: "checkpoint_000001", "trajectory": [], "artifacts": [],
              "final": False}
    mark(checkpoint, result)  # the trial's mark, written before Tune copied the checkpoint
    marked = mark_of(checkpoint)
    trial.last_result = result
    callback.on_trial_result(0, [trial], trial, result)
    run_id = callback.run_id(trial)
    assert tracker.flush() == 0 and tracker.client.get_run(run_id).data.metrics == {}

    callback.on_checkpoint(0, [trial], trial, checkpoint)
    assert tracker.flush() == 0
    assert tracker.client.get_run(run_id).data.metrics == {"epoch": 1.0, "val_rsum": 101.0}
    assert tracker.client.get_run(run_id).data.tags["checkpoint"] == checkpoint.path
    assert mark_of(checkpoint) == marked == {"epoch": 1, "val_rsum": 101.0, "trajectory": [],
                                             "artifacts": [], "final": False}


def test_an_epoch_s_analyses_are_stored_in_its_run_s_artifacts(tracker, tmp_path):
    """The files an epoch names (``artifacts``: its analyses) are copied from its checkpoint
    into the run's artifacts, each in its folder, where the UI serves the workspace's from."""
    from ray import tune

    from studies.frameworks.tune import CHECKPOINT_DIR

    parent = tracker.create_run("study", {"icr.role": "study"})
    callback = MlflowTrialCallback(tracker, parent, {"study": "t"}, {"lag": "fp"}, {"lag": 3})
    folder = tmp_path / "checkpoint_000001"
    (folder / "analysis").mkdir(parents=True)
    (folder / "analysis" / "cocos.json").write_text("{}")
    (folder / "probe.csv").write_text("a\n")
    result = {"epoch": 1, "val_rsum": 101.0, CHECKPOINT_DIR: "checkpoint_000001",
              "trajectory": [], "artifacts": ["analysis/cocos.json", "probe.csv"], "final": False}
    trial = SimpleNamespace(trial_id="t0", config=_trial_config(0.1), last_result=result)
    callback.on_checkpoint(0, [trial], trial, tune.Checkpoint.from_directory(str(folder)))
    assert served_artifacts(tracker.client, callback.run_id(trial), tmp_path / "artifacts") == {
        "analysis/cocos.json", "probe.csv"}


def test_a_mark_without_the_sizes_of_its_files_is_no_mark(tmp_path):
    """A checkpoint counts as marked only with the sizes of its files in its mark: one whose
    mark lacks them is not resumed from."""
    from ray import tune

    from studies.trainable import FILES, REPORTED, mark, mark_of, marked_checkpoints

    folder = tmp_path / "trial" / "checkpoint_000000"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(b"weights")
    checkpoint = tune.Checkpoint.from_directory(str(folder))
    mark(checkpoint, {"epoch": 1})
    assert mark_of(checkpoint) == {"epoch": 1}
    assert set(checkpoint.get_metadata()) == {REPORTED, FILES}
    checkpoint.set_metadata({REPORTED: {"epoch": 1}})
    assert mark_of(checkpoint) is None and marked_checkpoints(str(tmp_path / "trial")) == []


def _recorded(tracker: Tracker) -> dict:
    """What a study's runs hold, by run name (run ids and timestamps differ from store to store),
    read by a client of its own."""
    client = MlflowClient(tracker.tracking_uri)
    runs = {}
    for run in client.search_runs([tracker.experiment_id]):
        tags = {k: v for k, v in run.data.tags.items() if k != "mlflow.parentRunId"}
        runs[run.info.run_name] = (run.info.status, run.data.params, tags,
                                   _snapshot(client, run.info.run_id, timestamps=False))
    return runs


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``mlflow server`` on loopback over a fresh sqlite store, stopped after this module."""
    folder = tmp_path_factory.mktemp("server")
    with loopback_server(f"sqlite:///{folder / 'server.db'}", folder) as url:
        yield url


@pytest.mark.slow
def test_a_study_is_recorded_alike_on_a_local_store_and_on_an_mlflow_server(tmp_path, mlflow_server):
    local = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", tmp_path / "mlartifacts")
    remote = Tracker(mlflow_server, "t", tmp_path / "server-artifacts")
    _record_a_study(local)
    _record_a_study(remote)
    on_disk, on_server = _recorded(local), _recorded(remote)
    assert on_server == on_disk
    status, params, tags, (history, latest) = on_disk["lag eta=0.1"]
    assert status == "FINISHED" and params["note"] == "x" * 500 and tags["budget_complete"] == "true"
    assert latest == {"epoch": 3.0, "val_rsum": 3.0, "odd": "nan", "trajectory/loss": 1 / 3,
                      "trajectory/lambda": 1.0}
    assert history["val_rsum"] == [(1, 1.0), (2, 2.0), (3, 3.0)]  # the replayed epoch: once
    assert len(history["trajectory/loss"]) == 9


@pytest.mark.slow
def test_the_loopback_server_is_stopped_with_its_workers(tmp_path):
    """The server the benchmark and the tests start is gone when its block ends, its workers
    with it, also when the block fails."""
    with pytest.raises(RuntimeError, match="inside"), loopback_server(
            f"sqlite:///{tmp_path / 's.db'}", tmp_path, workers=2) as url:
        assert MlflowClient(url).search_experiments()  # it answers
        found = subprocess.run(["pgrep", "-f", f"port {url.rsplit(':', 1)[1]}"],
                               capture_output=True, text=True).stdout.split()
        groups = {os.getpgid(int(pid)) for pid in found} - {os.getpgrp()}
        assert len(groups) == 1  # the server's own group: the server, uvicorn, its workers
        raise RuntimeError("inside")
    (group,) = groups
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)  # no process of that group is left


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


def test_a_trial_has_one_name_in_the_dashboard_the_status_lines_and_mlflow():
    spec = TrialSpec.resolve("lagrangian", {"decoder.name": "ltd"},
                             {"objective.eta": 0.123456, "loss.name": "infonce"})
    assert spec.name == str(spec) == "lagrangian eta=0.123 name=infonce"  # run name, Tune's tag
    assert trial_label("a1_00002", {KEY: spec}) == "trial a1_00002 [lagrangian eta=0.123 name=infonce]"
    assert trial_label("a1_00003", {}) == "trial a1_00003"


class _RayTaskError(Exception):
    """Ray's error on the driver: the worker's exception as ``.cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray task failed: {cause}")
        self.cause = cause


def test_the_cause_chain_gives_the_innermost_line_and_whether_training_raised_it():
    inner = ValueError("loss is nan\nat step 3")
    inner.icr_failed_in_training = True  # as run_trial marks what fit raised
    try:
        raise RuntimeError("wrapped") from inner
    except RuntimeError as wrapped:
        error = _RayTaskError(wrapped)
    assert error_line(error) == "ValueError: at step 3"
    assert failed_in_training(error)
    assert not failed_in_training(_RayTaskError(RuntimeError("worker lost")))
    assert not failed_in_training(None)
    looped = RuntimeError("a")
    looped.__cause__ = RuntimeError("b")
    looped.__cause__.__cause__ = looped  # a cycle ends the walk
    assert error_line(looped) == "RuntimeError: b" and not failed_in_training(looped)


def _workspace_tracker(workspace, name: str = "t") -> Tracker:
    """A tracker as a study opens it: the workspace's sqlite store, artifacts beside it."""
    return Tracker(f"sqlite:///{workspace / 'mlflow.db'}", name, workspace / "mlartifacts")


def test_the_experiment_opens_on_its_runs_in_mlflow_3(tracker):
    """MLflow 3's UI opens an experiment tagged custom_model_development on its runs table (and
    one without the tag on the GenAI traces page)."""
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"


def _workspace_with_a_report(root: Path, note: Path) -> tuple[Tracker, str]:
    """A workspace whose study logged ``note`` into a run's ``report``."""
    root.mkdir(parents=True)
    tracker = _workspace_tracker(root)
    run_id = tracker.create_run("r", {})
    tracker.log_artifacts(run_id, note, "report")
    tracker.client.set_terminated(run_id)
    return tracker, run_id


def test_a_copied_workspace_writes_its_artifacts_into_itself(tmp_path, monkeypatch):
    """MLflow records a file:// artifact location as an absolute path: the workspace's
    experiment is located mlflow-artifacts:/<name> instead, so a copy of a workspace finds its
    experiment again, holds the copied artifacts and writes new ones into itself, not into the
    original (which is left as it was)."""
    import shutil

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    note = tmp_path / "note.txt"
    note.write_text("kept")
    original = tmp_path / "a" / "ws"
    tracker, run_id = _workspace_with_a_report(original, note)
    copy = tmp_path / "b" / "copy"
    shutil.copytree(original, copy)
    before = sorted(p.relative_to(original) for p in original.rglob("*"))

    copied = _workspace_tracker(copy)
    assert copied.experiment_id == tracker.experiment_id
    assert copied.client.get_experiment(copied.experiment_id).artifact_location == \
        "mlflow-artifacts:/t"
    later = tmp_path / "later"
    (later / "figures").mkdir(parents=True)
    (later / "figures" / "curve.png").write_bytes(b"png")
    copied.log_artifacts(run_id, later, "report")  # a folder's files, as log_artifacts does
    assert served_artifacts(copied.client, run_id, copy / "mlartifacts") == {
        "report/note.txt", "report/figures/curve.png"}
    assert sorted(p.relative_to(original) for p in original.rglob("*")) == before


@pytest.mark.slow
def test_a_moved_workspace_s_artifacts_are_served_from_it(tmp_path, monkeypatch):
    """A workspace moved elsewhere (the original removed), served as the docs tell users
    (``mlflow ui``, i.e. ``mlflow server``, over its store with ``--artifacts-destination
    <workspace>/mlartifacts``), lists and serves its runs' artifacts through MLflow's REST API:
    its public client against the server, and the ``get-artifact`` endpoint the UI fetches."""
    import shutil
    import urllib.request

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    note = tmp_path / "note.txt"
    note.write_text("kept")
    original = tmp_path / "a" / "ws"
    _, run_id = _workspace_with_a_report(original, note)
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(original, moved)
    with loopback_server(f"sqlite:///{moved / 'mlflow.db'}", tmp_path / "ui",
                         artifacts=str(moved / "mlartifacts")) as url:
        client = MlflowClient(url)
        assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/note.txt"]
        local = client.download_artifacts(run_id, "report/note.txt", str(tmp_path / "out"))
        assert Path(local).read_text() == "kept"
        with urllib.request.urlopen(f"{url}/get-artifact?path=report/note.txt&run_uuid={run_id}",
                                    timeout=30) as reply:
            assert reply.read() == b"kept"


def test_a_moved_workspace_with_an_absolute_artifact_location_is_refused(tmp_path, monkeypatch):
    """An experiment created before locations were served (an absolute file:// path) in a
    workspace since moved would have MLflow write into the original's folder: refused in one
    line naming the folder."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}").create_experiment(
        "t", artifact_location=(tmp_path / "old" / "mlartifacts" / "t").as_uri())
    with pytest.raises(UserError, match=re.escape(str(tmp_path / "old" / "mlartifacts" / "t"))):
        assert _workspace_tracker(workspace).experiment_id
    MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}").create_experiment(
        "here", artifact_location=(workspace / "mlartifacts" / "here").as_uri())
    assert _workspace_tracker(workspace, "here").experiment_id  # in this workspace: used


def test_a_store_shared_by_workspaces_keeps_each_one_s_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    store = f"sqlite:///{tmp_path / 'shared' / 'mlflow.db'}"
    (tmp_path / "shared").mkdir()
    first = Tracker(store, "first", tmp_path / "one" / "mlartifacts")
    location = first.client.get_experiment(first.experiment_id).artifact_location
    second = Tracker(store, "first", tmp_path / "two" / "mlartifacts")
    assert second.experiment_id == first.experiment_id
    assert second.client.get_experiment(first.experiment_id).artifact_location == location


def test_a_run_says_how_its_steps_ran_and_when_they_fell_back(tracker):
    """The steps' mode (studies.trainable.tune_record's ``steps``) as the run's tags, written
    again when it changes (a capture that failed in epoch 2), and the counts as metrics."""
    parent = tracker.create_run("study", {"icr.role": "study"})
    callback = MlflowTrialCallback(tracker, parent, {"study": "t"}, {"lag": "fp"}, {"lag": 3})
    trial = SimpleNamespace(trial_id="t0", config=_trial_config(0.1), last_result=None)
    captured = {"mode": "captured", "shapes": ["tokens 128x16", "tokens 128x24"], "reason": "",
                "fell_back": False}
    failed = {"mode": "eager", "shapes": [], "reason": "capture failed: operation not permitted",
              "fell_back": True}
    for epoch, steps, counts in ((1, captured, (94, 6)), (2, failed, (0, 100))):
        callback.on_trial_result(0, [trial], trial, {
            "epoch": epoch, "val_rsum": 100.0, "trajectory": [], "artifacts": [], "final": False,
            "steps": steps, "steps_captured": counts[0], "steps_eager": counts[1]})
        tags = tracker.client.get_run(callback.run_id(trial)).data.tags
        assert tags["steps.mode"] == steps["mode"] and tags["steps.reason"] == steps["reason"]
        assert tags["steps.fell_back"] == str(steps["fell_back"]).lower()
    assert tracker.flush() == 0
    history = tracker.client.get_metric_history(callback.run_id(trial), "steps_eager")
    assert sorted((m.step, m.value) for m in history) == [(1, 6.0), (2, 100.0)]
    assert step_tags({"epoch": 1}) == {}
    assert step_tags({"steps": captured})["steps.shapes"] == "tokens 128x16; tokens 128x24"


class _LoggedTrial:
    """A trial as Tune's result-file loggers see it (fake, no Ray): hashable, with the driver's
    staging folder, where the loggers write, and its folder in the storage, from which they
    restore their files when Tune's saved state gives the trial a checkpoint."""

    def __init__(self, trial_id: str, staging: Path, storage: Path, config: dict,
                 checkpoint: object = None) -> None:
        import pyarrow.fs

        self.trial_id, self.local_path, self.config = trial_id, str(staging), config
        self.checkpoint, self.last_result = checkpoint, None
        self.storage = SimpleNamespace(trial_fs_path=str(storage),
                                       storage_filesystem=pyarrow.fs.LocalFileSystem())
        self.init_local_path()

    def init_local_path(self) -> None:
        Path(self.local_path).mkdir(parents=True, exist_ok=True)

    def __hash__(self) -> int:
        return hash(self.trial_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LoggedTrial) and other.trial_id == self.trial_id


@pytest.mark.parametrize(("in_mlflow", "in_file"), [((1, 2), (1,)), ((1,), (1, 2))],
                         ids=["mlflow-ahead", "file-ahead"])
def test_a_replayed_epoch_reaches_each_store_that_lacks_it(tracker, tmp_path, in_mlflow, in_file):
    """A driver killed between two writes of an epoch leaves MLflow and Tune's result file at
    different epochs: MLflow's record is written when Tune has saved the epoch's checkpoint,
    the file's row when its result arrives, and the file reaches the storage only with Tune's
    background copy. The restored trial reports its resume point's epoch (2) again; each store
    writes it only where it lacks it, so neither store's last epoch can stand for the other's.
    A new driver's loggers read the files Tune copies back from the storage when they open
    them (``progress.csv`` got epoch 2 twice when its last epoch was read before)."""
    from studies.frameworks.tune import EpochCsvLogger, EpochJsonLogger

    parent = tracker.create_run("study", {"icr.role": "study"})
    storage = tmp_path / "storage"
    storage.mkdir()
    trial = _LoggedTrial("t0", tmp_path / "staging-1", storage, _trial_config(0.1))

    def result(epoch: int) -> dict:
        return {"epoch": epoch, "val_rsum": 100.0 + epoch, "trajectory": [], "artifacts": [],
                "final": False}

    def driver() -> tuple[MlflowTrialCallback, EpochJsonLogger, EpochCsvLogger]:
        return (MlflowTrialCallback(tracker, parent, {"study": "t"}, {"lag": "fp"}, {"lag": 3}),
                EpochJsonLogger(), EpochCsvLogger())

    recorder, json_log, csv_log = driver()  # the killed driver: each store got what it got
    for epoch in range(1, 3):
        if epoch in in_file:
            json_log.on_trial_result(0, [trial], trial, result(epoch))
            csv_log.on_trial_result(0, [trial], trial, result(epoch))
        if epoch in in_mlflow:
            recorder.on_trial_result(0, [trial], trial, result(epoch))
    for logger in (json_log, csv_log):
        logger.on_trial_error(0, [trial], trial)
    assert tracker.flush() == 0
    for name in ("result.json", "progress.csv"):  # Tune's background copy to the storage
        shutil.copy(Path(trial.local_path) / name, storage / name)

    # The next driver: a staging folder of its own, the trial restored with a checkpoint (so
    # the loggers copy their files back from the storage), and the replayed epoch.
    trial = _LoggedTrial("t0", tmp_path / "staging-2", storage, _trial_config(0.1), "checkpoint")
    recorder, json_log, csv_log = driver()
    for callback in (recorder, json_log, csv_log):
        callback.on_trial_start(0, [trial], trial)
        callback.on_trial_result(0, [trial], trial, result(2))
    for logger in (json_log, csv_log):
        logger.on_trial_complete(0, [trial], trial)
    assert tracker.flush() == 0
    history = tracker.client.get_metric_history(recorder.run_id(trial), "val_rsum")
    assert sorted((m.step, m.value) for m in history) == [(1, 101.0), (2, 102.0)]
    rows = (Path(trial.local_path) / "result.json").read_text().splitlines()
    assert [json.loads(row)["epoch"] for row in rows] == [1, 2]
    progress = (Path(trial.local_path) / "progress.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in progress] == ["epoch", "1", "2"]
