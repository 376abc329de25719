"""Faults a campaign of kills, signals, bad inputs and corrupt files found (issue 20), each
reproduced here as the user met it; these need no Ray (the ones that do are in
test_studies_pipeline.py, test_studies_cli.py and test_ray_cluster.py).

Each run here is refused before Ray starts: ``ray.is_initialized()`` stays false.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from icr.errors import UserError
from studies import launcher, processes, records
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
    assert f"the Ray instance record {record} was unreadable or incomplete" in caplog.text


SLEEPER = "import sys, time\nheld = open(sys.argv[1], 'w') if len(sys.argv) > 1 else None\n" \
          "print('up', flush=True)\ntime.sleep(600)\n"


@contextlib.contextmanager
def sleeper(marker: str | None = None, holding: Path | None = None) -> Iterator[subprocess.Popen]:
    """A process of this user that sleeps, with ``MARKER=marker`` in its environment and the
    file ``holding`` open, if given."""
    env = {k: v for k, v in os.environ.items() if k != processes.MARKER}
    env.update({processes.MARKER: marker} if marker else {})
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, *([str(holding)] if holding else [])],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_damaged_record_never_names_or_stops_another_study_s_processes(
        tmp_path: Path, caplog) -> None:
    """With a `{}` or garbage record in workspace A while a study ran in workspace B, the
    refusal named B's live Ray processes and suggested `kill -TERM` for them."""
    record = tmp_path / "a" / "locks" / "fake.ray.json"
    record.parent.mkdir(parents=True)
    record.write_text("garbage {")
    with sleeper("b0b0b0b0b0b0b0b0-0123") as b:  # a Ray process of B's study
        assert records.stop_recorded_instance(record) == []
        assert b.poll() is None and str(b.pid) not in caplog.text
    assert not record.exists() and "not JSON" in caplog.text


def test_a_damaged_record_stops_what_this_study_s_instances_left(tmp_path: Path) -> None:
    record = tmp_path / "a" / "locks" / "fake.ray.json"
    record.parent.mkdir(parents=True)
    record.write_text("{}")
    with sleeper(launcher.new_marker(records.owner_of(record))) as leftover, \
            sleeper("b0b0b0b0b0b0b0b0-0123") as other:
        assert records.stop_recorded_instance(record) == [leftover.pid]
        assert leftover.wait(timeout=30) is not None and other.poll() is None
    assert not record.exists()


def test_a_record_never_stops_a_process_or_deletes_a_folder_it_cannot_prove_its_own(
        tmp_path: Path, caplog) -> None:
    """A forged record whose temp_dir named an `icr-ray-*` folder made the driver kill an
    unrelated `sleep 600` that held a file open there, and delete the folder, saying nothing."""
    folder = Path(tempfile.mkdtemp(prefix=launcher.TEMP_PREFIX))
    record = tmp_path / "locks" / "fake.ray.json"
    record.parent.mkdir()
    try:
        with sleeper(holding=folder / "held.log") as held, sleeper("another-study") as other, \
                sleeper() as listed:
            for foreign in (True, False):  # another study's marker, then this one's: neither's folder
                marker = "another-study" if foreign else f"{records.owner_of(record)}-89ab"
                processes.write_record(record, {
                    "marker": marker, "temp_dir": str(folder),
                    "launcher": processes.describe([other.pid])[0], "driver": {},
                    "processes": processes.describe([held.pid, other.pid, listed.pid])})
                assert records.stop_recorded_instance(record) == []
                assert held.poll() is None and other.poll() is None and listed.poll() is None
                assert folder.is_dir() and not record.exists()
                warning = caplog.text.splitlines()[-1]
                assert f"the folder {folder} (not one this study made)" in warning
                assert ("the Ray instance another-study" in warning) == foreign
                for proc in (held, other, listed):
                    assert f"{proc.pid} (python" in warning
                caplog.clear()
    finally:
        shutil.rmtree(folder)


def test_a_record_s_own_instance_is_stopped_with_its_folder(tmp_path: Path) -> None:
    """What the record proves its own (the marker of this study, the folder made for it, the
    processes with a file open there) is stopped and removed; the rest is not touched."""
    record = tmp_path / "locks" / "fake.ray.json"
    record.parent.mkdir()
    marker = launcher.new_marker(records.owner_of(record))
    folder = launcher._new_temp_dir(marker)
    with sleeper(marker) as member, sleeper(holding=folder / "agent.log") as agent, \
            sleeper() as stranger:
        processes.write_record(record, {
            "marker": marker, "temp_dir": str(folder), "launcher": {}, "driver": {},
            "processes": processes.describe([member.pid, agent.pid])})
        assert sorted(records.stop_recorded_instance(record)) == sorted([member.pid, agent.pid])
        assert member.wait(timeout=30) is not None and agent.wait(timeout=30) is not None
        assert stranger.poll() is None and not folder.exists() and not record.exists()


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


KILLED_WRITER = """
import sqlite3, sys, time
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA cache_size=1")  # the transaction's pages go to the file: the journal is hot
con.execute("BEGIN")
for _ in range(20):
    con.execute("UPDATE metrics SET value = value + 1")
print("writing", flush=True)
time.sleep(600)
"""


def test_a_store_whose_writer_was_killed_mid_transaction_is_not_called_damaged(tmp_path: Path) -> None:
    """A driver killed by SIGKILL while MLflow wrote left a hot journal beside mlflow.db; the
    next run's read-only check could not roll it back ("attempt to write a readonly
    database") and called the store damaged (found by the chaos test)."""
    import signal
    import sqlite3

    from studies.tracking import Tracker, check_store

    db = tmp_path / "mlflow.db"
    tracker = Tracker(f"sqlite:///{db}", "fake")
    run_id = tracker.create_run("r", {"a": "b"})
    tracker.log_metrics(run_id, {f"m{i}": float(i) for i in range(300)}, step=1)
    tracker.flush()
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(db)], stdout=subprocess.PIPE,
                              text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert (tmp_path / "mlflow.db-journal").stat().st_size > 0
    check_store(f"sqlite:///{db}")  # no UserError
    with sqlite3.connect(db) as con:  # the killed transaction was rolled back
        assert con.execute("SELECT SUM(value) FROM metrics").fetchone()[0] == sum(range(300))


# --- 8. two of a new instance's ports the same ----------------------------------------------------


def test_the_ports_a_new_instance_is_given_are_distinct(monkeypatch) -> None:
    """A loss_search smoke died at start: Ray's client server and the autoscaler's metrics had
    both been given 26100, each port probed free on its own and released before the next was
    drawn, so the client server could not bind and its exit took the instance down. Drawn the
    same port twice, the launcher now takes another."""
    a, b = launcher.free_ports(2)
    draws = iter([a, a, b])
    monkeypatch.setattr(launcher.random, "randint", lambda low, high: next(draws))
    assert launcher.free_ports(2) == [a, b]
