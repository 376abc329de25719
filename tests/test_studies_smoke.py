"""End to end with the real ``fit``: ``studies.run ltd_bound --smoke`` and ``--debug --smoke``."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from servers import served_artifacts

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", "studies.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_smoke_runs_the_whole_pipeline(tmp_path: Path) -> None:
    result = run_cli("ltd_bound", "--smoke", "--workspace", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "Ray dashboard: http://127.0.0.1:" in out and "get-auth-token" in out
    assert "MLflow UI:" in out and "search lagrangian" in out and "confirm:" in out
    report = tmp_path / "reports" / "ltd_bound-smoke"
    table = (report / "table1.md").read_text()
    for label in ("BL, L_con", "BL + LTD, L_dual (beta=1)", "BL + LTD, L_lag (eta="):
        assert label in table
    trials = pd.read_csv(report / "trials.csv")
    confirm = trials[trials["phase"] == "confirm"]
    assert len(confirm) == 6 and (confirm["status"] == "FINISHED").all()
    assert confirm["test_rsum"].notna().all() and confirm["test_t2i_nDCG_at_25"].notna().all()
    for figure in ("lambda_per_eta.png", "lrec_per_eta.png", "val_rsum_per_epoch.png",
                   "best_val_rsum_vs_eta.png"):
        assert (report / figure).stat().st_size > 1000
    run_dir = next((tmp_path / "ray" / "ltd_bound-smoke").iterdir())
    assert json.loads((run_dir / "state.json").read_text())["phase"] == "done"
    # every trial's MLflow run says how its steps ran: on the CPU eagerly, as meant (no CUDA)
    db = sqlite3.connect(tmp_path / "mlflow.db")
    trials_ = [r for (r,) in db.execute("select run_uuid from tags where key = 'icr.role' "
                                        "and value = 'trial'")]
    assert len(trials_) >= 6
    for run in trials_:
        tags = dict(db.execute("select key, value from tags where run_uuid = ?", (run,)))
        assert (tags["steps.mode"], tags["steps.reason"], tags["steps.fell_back"]) == \
            ("eager", "no CUDA", "false")
        eager = db.execute("select min(value) from metrics where run_uuid = ? and key = "
                           "'steps_eager'", (run,)).fetchone()[0]
        assert eager is not None and eager > 0


@pytest.mark.slow
def test_debug_smoke_trains_one_trial_in_process(tmp_path: Path) -> None:
    result = run_cli("ltd_bound", "--debug", "--smoke", "--workspace", str(tmp_path),
                     "--set", "objective.eta=0.1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 2/2" in result.stdout and "rsum" in result.stdout
    assert "best validation rsum" in result.stdout and "test" in result.stdout.split("metric")[-1]
    assert not (tmp_path / "ray").exists()  # no Ray


@pytest.mark.slow
def test_a_smoke_study_s_parent_run_holds_what_its_search_learned(tmp_path: Path) -> None:
    # 10 trials: about half of them reach the full 2 epochs past ASHA's rung at epoch 1, above
    # the 3 full-budget trials an importance over one key needs (smoke's own budget is 2)
    from mlflow.tracking import MlflowClient

    result = run_cli("ltd_bound", "--smoke", "--budget", "10", "--seeds", "1",
                     "--workspace", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = next((tmp_path / "ray" / "ltd_bound-smoke").iterdir())
    parent_id = json.loads((run_dir / "state.json").read_text())["parent_run_id"]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(parent_id)
    # one searched key: its share of the explained variance is all of it
    assert parent.data.metrics["importance.lagrangian.objective.eta"] == pytest.approx(1.0)
    assert "importance_spread.lagrangian.objective.eta" in parent.data.metrics
    artifacts = served_artifacts(client, parent_id, tmp_path / "mlartifacts")
    assert {"report/importance_lagrangian.png", "report/parallel_lagrangian.png",
            "report/search_space.md"} <= artifacts
    assert parent.data.tags["domains.lagrangian"] == '{"objective.eta": {"uniform": [0.05, 0.3]}}'
