"""MLflow as a lab runs it: a tracking server on PostgreSQL with its artifacts on S3, and
database tracking URIs whose driver is an extra.

The fast tests check the refusal of a database URI whose driver is missing (before the data is
prepared or Ray starts) and where an experiment's artifacts go. The slow one starts, on
127.0.0.1 and stopped by PID when it ends (:mod:`servers`), PostgreSQL (``initdb`` into a
temporary folder from Debian's ``postgresql`` package; as the ``postgres`` user when run as
root), moto's S3 server and ``mlflow server --backend-store-uri postgresql+psycopg://...
--artifacts-destination s3://...``, runs ``ltd_bound --smoke --tracking-uri http://...`` there,
and fetches its report back through the server's artifact API.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from icr.errors import UserError
from studies.tracking import check_database_driver, serves_artifacts

ROOT = Path(__file__).resolve().parent.parent


def test_a_server_keeps_the_artifacts_a_local_store_leaves_in_the_workspace() -> None:
    assert serves_artifacts("http://127.0.0.1:5000") and serves_artifacts("https://mlflow.lab")
    assert serves_artifacts("databricks://profile")
    assert not serves_artifacts("sqlite:////ws/mlflow.db")
    assert not serves_artifacts("postgresql://u@db.lab/mlflow")


@pytest.mark.parametrize(("uri", "missing", "fix"), [
    ("postgresql://mlflow:s3cret@db.lab/mlflow", "psycopg",
     "pip install 'icr-studies[postgres]'"),
    ("postgresql+psycopg://mlflow@db.lab/mlflow", "psycopg",
     "pip install 'icr-studies[postgres]'"),
    ("postgresql+psycopg2://mlflow@db.lab/mlflow", "psycopg2",
     "install psycopg2, or write postgresql://... and pip install 'icr-studies[postgres]'"),
    ("mysql://mlflow@db.lab/mlflow", "MySQLdb",
     "install MySQLdb, or write mysql+pymysql://... and pip install 'icr-studies[mysql]'"),
    ("mysql+pymysql://mlflow@db.lab/mlflow", "pymysql", "pip install 'icr-studies[mysql]'"),
])
def test_a_database_uri_without_its_driver_is_refused_naming_the_extra(
        uri, missing, fix, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: its import fails
    with pytest.raises(UserError) as refused:
        check_database_driver(uri)
    shown = uri.replace("s3cret", "***")  # the password is never printed
    assert str(refused.value) == f"--tracking-uri {shown}: its driver {missing} is not installed; {fix}"


def test_a_database_uri_with_its_driver_passes() -> None:
    pytest.importorskip("psycopg")
    check_database_driver("postgresql://mlflow@db.lab/mlflow")  # nothing is connected to
    check_database_driver("sqlite:////ws/mlflow.db")
    check_database_driver("http://127.0.0.1:5000")


def test_a_study_on_a_database_without_its_driver_stops_before_data_and_ray(
        tmp_path: Path, monkeypatch, capsys) -> None:
    from studies import connection
    from studies.pipeline import Backend
    from studies.run import main

    from fakes import FakeFit, fake_study

    prepared = []
    monkeypatch.setitem(sys.modules, "psycopg", None)
    monkeypatch.setattr(connection, "connect", lambda *a, **k: pytest.fail("Ray started"))
    uri = "postgresql://mlflow@127.0.0.1:1/mlflow"
    rc = main(["fake", "--workspace", str(tmp_path / "ws"), "--tracking-uri", uri],
              backend=Backend(FakeFit(), lambda config, ws: prepared.append(config)),
              extra_studies={"fake": fake_study(tmp_path)})
    assert rc == 2
    assert capsys.readouterr().err == (f"error: --tracking-uri {uri}: its driver psycopg is not "
                                       "installed; pip install 'icr-studies[postgres]'\n")
    assert prepared == []


# --- the real parts, on loopback ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_a_smoke_study_tracked_on_a_server_on_postgresql_keeps_its_report_in_the_bucket(
        tmp_path: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    from servers import S3_CREDENTIALS, loopback_server, postgres_server, s3_server

    for name, value in S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with s3_server(tmp_path / "s3") as s3, postgres_server() as database:
        # The server reaches the S3 server through MLFLOW_S3_ENDPOINT_URL (boto3's client).
        monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3.endpoint)
        artifacts = f"s3://{s3.bucket}/mlflow"
        with loopback_server(database, tmp_path / "mlflow", artifacts=artifacts) as url:
            monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL")  # the driver goes through the server
            workspace = tmp_path / "ws"
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "studies.run", "ltd_bound", "--smoke", "--workspace",
                 str(workspace), "--tracking-uri", url, "--no-dashboard"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                text=True, timeout=1500)
            took = time.monotonic() - started
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            assert "Traceback" not in done.stderr, done.stderr[-3000:]

            client = MlflowClient(url)
            experiment = client.get_experiment_by_name("ltd_bound-smoke")
            assert experiment.artifact_location.startswith("mlflow-artifacts:"), \
                experiment.artifact_location  # the server's store, not a file:// of the driver
            runs = client.search_runs([experiment.experiment_id], max_results=1000)
            assert runs and all(r.info.status == "FINISHED" for r in runs)
            (study,) = [r for r in runs if r.data.tags.get("icr.role") == "study"]
            names = {f.path for f in client.list_artifacts(study.info.run_id, "report")}
            assert "report/table1.md" in names, names
            fetched = Path(client.download_artifacts(study.info.run_id, "report/table1.md",
                                                     str(tmp_path / "fetched")))
            report = workspace / "reports" / "ltd_bound-smoke" / "table1.md"
            assert fetched.read_text() == report.read_text()
        keys = s3.keys("mlflow/")
        assert any(k.endswith("/report/table1.md") for k in keys), keys
        assert not (workspace / "mlartifacts").exists()  # nothing left on the driver's disk
    print(f"lab tracking: ltd_bound --smoke on mlflow server (PostgreSQL, artifacts on S3): "
          f"rc 0 in {took:.0f} s, {len(runs)} runs FINISHED, {len(keys)} objects in the bucket")
