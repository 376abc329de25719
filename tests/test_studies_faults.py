"""Faults a campaign of kills, signals, bad inputs and corrupt files found (issue 20), each
reproduced here as the user met it; these need no Ray (the ones that do are in
test_studies_pipeline.py, test_studies_cli.py and test_ray_cluster.py).

Each run here is refused before Ray starts: ``ray.is_initialized()`` stays false.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray

from icr.errors import UserError
from studies import processes, records
from studies.pipeline import Backend
from studies.run import main
from studies.session import DriverLock

from fakes import FakeFit, fake_prepare
from fakes import fake_study as pipeline_study


def fake_study(tmp_path: Path, space: str | None = None):
    study = pipeline_study(tmp_path, budget=2, conditions=("lagrangian",))
    if space is not None:
        (tmp_path / "space.yaml").write_text(space)
    return study


def run(tmp_path: Path, *args: str, prepare=fake_prepare, space: str | None = None) -> int:
    return main(["fake", "--workspace", str(tmp_path / "ws"), *args],
                backend=Backend(FakeFit(), prepare),
                extra_studies={"fake": fake_study(tmp_path, space)})


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


class Prepared:
    """A fake preparation that notes that it ran."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __call__(self, config, workspace):
        self.flag.touch()
        return fake_prepare(config, workspace)


# --- 1. a value that cannot work for the dataset -------------------------------------------------


def test_a_batch_larger_than_an_epoch_is_refused_before_ray_and_mlflow(tmp_path: Path, capsys) -> None:
    """`studies.run ltd_bound --smoke --set train.batch_size=100000000` started Ray and 7 MLflow
    runs whose trials all failed with the worker's ConfigError."""
    assert run(tmp_path, "--set", "train.batch_size=100000000") == 2
    assert one_error_line(capsys) == ("error: train.batch_size=100000000 exceeds the 20000 "
                                      "training captions of an epoch; lower train.batch_size")
    workspace = tmp_path / "ws"
    assert not (workspace / "mlflow.db").exists() and not (workspace / "ray").exists()
    assert not ray.is_initialized()


def test_a_searched_domain_that_can_draw_an_impossible_value_is_refused(tmp_path: Path, capsys) -> None:
    space = """
space:
  loss.tau: 0.05
conditions:
  lagrangian:
    objective.eta: {uniform: [0.05, 0.3]}
    train.batch_size: {int: [64, 30000]}
"""
    assert run(tmp_path, space=space) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {tmp_path / 'space.yaml'}: condition lagrangian searches ")
    assert "train.batch_size ~ int [64, 30000]" in line
    assert ("which holds a value that cannot work: train.batch_size=30000 exceeds the 20000 "
            "training captions") in line
    assert line.endswith("(narrow the domain in the space file)")
    assert not (tmp_path / "ws" / "mlflow.db").exists() and not ray.is_initialized()


def test_the_driver_checks_the_sampler_the_worker_uses(tmp_path: Path, capsys) -> None:
    """With image batches the epoch counts images (4000 here), not captions."""
    assert run(tmp_path, "--set", "train.sampler=images", "train.batch_size=5000") == 2
    assert "train.batch_size=5000 exceeds the 4000 training images of an epoch" in one_error_line(capsys)


# --- 2. an unreadable or incomplete record of a killed driver's Ray instance -----------------------


@pytest.mark.parametrize("text", ["{}", "garbage {", "[1, 2]", '{"marker": 3}'])
def test_a_record_that_names_no_process_is_removed_when_no_instance_runs(
        tmp_path: Path, monkeypatch, caplog, text: str) -> None:
    """`{}` gave an 18-line traceback ending in KeyError: 'driver'."""
    record = tmp_path / "locks" / "fake.ray.json"
    record.parent.mkdir()
    record.write_text(text)
    monkeypatch.setattr(processes, "instance_markers", lambda: {}, raising=False)
    assert records.stop_recorded_instance(record) == []
    assert not record.exists()
    assert f"removed the unreadable Ray instance record {record}" in caplog.text


def test_a_record_that_names_no_process_is_refused_with_what_to_do_while_instances_run(
        tmp_path: Path, monkeypatch) -> None:
    record = tmp_path / "locks" / "fake.ray.json"
    record.parent.mkdir()
    record.write_text("garbage {")
    monkeypatch.setattr(processes, "instance_markers", lambda: {"m": [11, 12]}, raising=False)
    with pytest.raises(UserError) as error:
        records.stop_recorded_instance(record)
    message = str(error.value)
    assert "\n" not in message and str(record) in message and "not JSON" in message
    assert "PIDs 11 12" in message and "removing the record is safe if none of them" in message
    assert f"rm {record}" in message and record.exists()


def test_an_incomplete_record_stops_what_it_still_names(tmp_path: Path, caplog) -> None:
    import subprocess
    import sys

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        entry = processes.describe([sleeper.pid])[0]
        record = tmp_path / "fake.ray.json"
        record.write_text(json.dumps({"processes": [entry]}))  # no marker, driver, launcher
        assert records.stop_recorded_instance(record) == [sleeper.pid]
        assert sleeper.wait(timeout=30) is not None
        assert not record.exists() and "was incomplete" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_record_never_names_a_folder_outside_ray_s_own(tmp_path: Path, monkeypatch) -> None:
    """A damaged record's temp folder (here /tmp) must not select every process with a file
    open there."""
    record = tmp_path / "fake.ray.json"
    record.write_text(json.dumps({"temp_dir": "/tmp"}))
    monkeypatch.setattr(processes, "instance_markers", lambda: {}, raising=False)
    monkeypatch.setattr(processes, "stop_family", lambda *a, **k: pytest.fail("stopped a family"))
    assert records.stop_recorded_instance(record) == []


def test_the_driver_handles_an_empty_record_before_it_prepares(tmp_path: Path, monkeypatch, capsys) -> None:
    record = tmp_path / "ws" / "locks" / "fake.ray.json"
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    monkeypatch.setattr(processes, "instance_markers", lambda: {}, raising=False)

    def prepare(config, workspace):
        raise UserError("prepared")  # stops the run here: the record was handled before

    assert run(tmp_path, prepare=prepare) == 2
    assert one_error_line(capsys) == "error: prepared"
    assert not record.exists()


# --- 3. a damaged MLflow store -------------------------------------------------------------------


def test_a_truncated_mlflow_store_is_refused_before_ray(tmp_path: Path, capsys) -> None:
    """Half of mlflow.db: Ray started, then 90 lines ending in `database disk image is
    malformed`."""
    from studies.tracking import Tracker

    db = tmp_path / "ws" / "mlflow.db"
    db.parent.mkdir(parents=True)
    tracker = Tracker(f"sqlite:///{db}", "fake")
    run_id = tracker.create_run("r", {"a": "b"}, {f"p{i}": i for i in range(300)})
    tracker.log_metrics(run_id, {f"m{i}": float(i) for i in range(300)}, step=1)
    tracker.flush()  # every record on disk before the file is cut
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 2])
    capsys.readouterr()  # MLflow's lines while the store was made
    prepared = tmp_path / "prepared"
    assert run(tmp_path, prepare=Prepared(prepared)) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: the MLflow store {db} is damaged (")
    assert f"mv {db} {db}.damaged" in line and "run the same command again" in line
    assert not prepared.exists() and not ray.is_initialized()


def test_a_file_that_is_not_a_database_is_refused(tmp_path: Path, capsys) -> None:
    db = tmp_path / "ws" / "mlflow.db"
    db.parent.mkdir(parents=True)
    db.write_text("not a database, " * 100)
    assert run(tmp_path) == 2
    assert f"error: the MLflow store {db} is damaged (file is not a database)" in one_error_line(capsys)


# --- 7. a second driver of a running study ---------------------------------------------------------


def test_a_second_driver_is_refused_before_it_prepares_data(tmp_path: Path, capsys) -> None:
    """It was refused only after 31-40 s of data preparation."""
    prepared = tmp_path / "prepared"
    with DriverLock(tmp_path / "ws", "fake"):
        assert run(tmp_path, prepare=Prepared(prepared)) == 2
    line = one_error_line(capsys)
    assert "study fake is already running" in line
    assert not prepared.exists()


def test_a_store_another_study_is_writing_is_not_called_damaged(tmp_path: Path) -> None:
    import sqlite3

    from studies.tracking import check_store

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE t (x INTEGER)")
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")  # as a long write transaction of another driver
    try:
        check_store(f"sqlite:///{db}", busy_timeout=0.1)  # busy, not damaged: no UserError
    finally:
        writer.execute("ROLLBACK")
        writer.close()
