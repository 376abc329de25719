"""The whole pipeline on Ray with a fast fake ``fit``: ASHA + Optuna, MLflow, failures, resume.

One private Ray instance (127.0.0.1, 2 CPUs) serves the module; a killed driver runs in a
subprocess that joins it by address.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from icr.config import key_specs
from studies.catalog import Recipe, Study
from studies.frameworks.tune import saved_by_tune
from studies.pipeline import Backend
from studies.run import main
from studies.trials import spec_of

from fakes import FakeFit, counting_config_builds, fake_prepare, fake_study
from servers import served_artifacts

ROOT = Path(__file__).resolve().parent.parent


def child_runs(workspace: Path, experiment: str = "fake") -> pd.DataFrame:
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    rows = []
    for run in client.search_runs([exp.experiment_id], max_results=1000):
        if run.data.tags.get("icr.role") != "trial":
            continue
        history = client.get_metric_history(run.info.run_id, "val_rsum")
        rows.append({"run_id": run.info.run_id, "run_name": run.info.run_name,
                     "status": run.info.status, **run.data.tags,
                     "steps": sorted(m.step for m in history),
                     "trajectory": len(client.get_metric_history(run.info.run_id, "trajectory/lambda")),
                     "params": dict(run.data.params)})
    return pd.DataFrame(rows)


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_fake_study_end_to_end(cluster, tmp_path: Path, capsys) -> None:
    workspace = tmp_path / "ws"
    fit = FakeFit(epoch_seconds=0.1, fail_on=(("train.seed", 1001),))
    rc = main(["fake", "--workspace", str(workspace)], backend=Backend(fit, fake_prepare),
              extra_studies={"fake": fake_study(tmp_path)})
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]  # a run failed: the last line says so
    assert last.startswith(f"report: {workspace / 'reports' / 'fake'} (2 of 12 runs failed in "
                           "training: "), last
    assert "seed=1001: TrainingError: non-finite loss at epoch 2" in last
    run_dir = next((workspace / "ray" / "fake").iterdir())
    state = json.loads((run_dir / "state.json").read_text())
    assert state["phase"] == "done" and set(state["winners"]) == {"contrastive", "lagrangian"}

    # ASHA stopped some trials; Optuna was told PRUNED for exactly those, COMPLETE for the others.
    optuna_log = pd.read_csv(run_dir / "search-lagrangian.optuna.csv")
    runs = child_runs(workspace)
    search = runs[(runs["phase"] == "search") & (runs["condition"] == "lagrangian")]
    assert len(search) == 6 == len(optuna_log)
    stopped = set(search[search["stopped_early"] == "true"]["tune_trial_id"])
    assert stopped, "ASHA stopped no trial"
    pruned = set(optuna_log[optuna_log["state"] == "PRUNED"]["tune_trial_id"])
    assert pruned == stopped
    assert set(optuna_log[optuna_log["state"] == "COMPLETE"]["tune_trial_id"]) == \
        set(search["tune_trial_id"]) - stopped
    winner = state["winners"]["lagrangian"]["trial_id"]
    assert winner not in stopped

    # One child run per trial with params, per-epoch metrics (step = epoch), trajectory and tags.
    assert runs["tune_trial_id"].is_unique
    full = runs[runs["budget_complete"] == "true"]
    assert all(steps == [1, 2, 3, 4] for steps in full["steps"])
    assert (runs[runs["condition"] == "lagrangian"]["trajectory"] > 0).all()
    for _, run in runs.iterrows():
        assert {"study", "condition", "seed", "git_commit", "data_fingerprint", "tune_trial_id"} <= set(run.index)
        assert run["data_fingerprint"] == "fake-default-0"
        assert len(run["params"]) < len(key_specs())  # only the keys its configuration uses
        assert ("objective.eta" in run["params"]) == (run["condition"] == "lagrangian")
        assert run["condition"] in run["run_name"]
    lag = runs[(runs["phase"] == "search") & (runs["condition"] == "lagrangian")]
    assert all(f"eta={float(p['objective.eta']):.3g}" in n
               for p, n in zip(lag["params"], lag["run_name"], strict=True))
    assert (runs[runs["condition"] == "contrastive"]["trajectory"] == 0).all()  # no lambda series

    # The confirmation runs: 2 conditions x 3 seeds, eval.test on; seed 1001 failed (FAILED in MLflow)
    confirm = runs[runs["phase"] == "confirm"]
    assert len(confirm) == 6 and set(confirm["seed"]) == {"1000", "1001", "1002"}
    assert all(p["eval.test"] == "True" for p in confirm["params"])
    failed = confirm[confirm["status"] == "FAILED"]
    assert set(failed["seed"]) == {"1001"}
    assert all(e.startswith("TrainingError: non-finite loss at epoch 2") for e in failed["error"])
    assert (confirm[confirm["seed"] != "1001"]["status"] == "FINISHED").all()
    from ray.tune import ExperimentAnalysis

    statuses = {(spec_of(t.config).condition, spec_of(t.config).seed): t.status
                for t in ExperimentAnalysis(str(run_dir / "confirm")).trials}
    assert {k for k, v in statuses.items() if v == "ERROR"} == {("contrastive", 1001), ("lagrangian", 1001)}

    # The report: tables, every trial, figures, logged to the parent run.
    report = workspace / "reports" / "fake"
    table = (report / "table1.md").read_text()
    assert "BL + LTD, L_lag (eta=" in table and "±" in table and "Welch" in table
    assert "1 of 3 confirmation runs did not finish (seed 1001): TrainingError: non-finite loss" in table
    assert "\\begin{tabular}" in (report / "table1.tex").read_text()
    assert "Holm-Bonferroni" in table  # the dagger's correction is named under the table
    differences = (report / "table1_vs_baseline.md").read_text()
    assert "Welch-Satterthwaite" in differences and "| BL + LTD, L_lag (eta=" in differences
    assert "tab:table1_vs_baseline" in (report / "table1_vs_baseline.tex").read_text()
    trials = pd.read_csv(report / "trials.csv")
    assert len(trials) == len(runs) and "objective.eta" in trials and "val_rsum" in trials
    assert trials["error"].fillna("").str.contains("non-finite loss").sum() == 2
    for figure in ("lambda_per_eta.png", "lrec_per_eta.png", "val_rsum_per_epoch.png",
                   "best_val_rsum_vs_eta.png"):
        assert (report / figure).stat().st_size > 1000
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    artifacts = served_artifacts(client, state["parent_run_id"], workspace / "mlartifacts")
    assert "report/table1.md" in artifacts and "report/lambda_per_eta.png" in artifacts
    parent = client.get_run(state["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert "BL + LTD, L_lag" in parent.data.tags["mlflow.note.content"]  # the table, as description
    assert parent.data.tags["mlflow.source.git.commit"] == parent.data.tags["git_commit"]
    assert "report/lagrangian.test_rsum.mean" in parent.data.metrics
    assert all(k.startswith("report/") and k.count("/") == 1 for k in parent.data.metrics
               if not k.startswith(("importance.", "importance_spread.", "importance_epoch.")))
    experiment = client.get_experiment_by_name("fake")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on runs


DRIVER = """
import sys
from pathlib import Path
from fakes import FakeFit, fake_prepare
from studies.pipeline import Backend
from studies.run import main
sys.path.insert(0, {tests!r})
from test_studies_pipeline import fake_study
study = fake_study(Path({tmp!r}), budget=6, conditions=("lagrangian",))
fit = FakeFit(epoch_seconds=0.6, record_dir={records!r})
sys.exit(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={{"fake": study}}))
"""


def finished_trials(db: Path) -> set[str]:
    """Tune ids of the FINISHED child runs, read from the store without migrating it.

    (An MlflowClient would run the schema migrations while the driver creates the store.)
    """
    if not db.exists():
        return set()
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            rows = con.execute(
                "SELECT t.value FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                "WHERE t.key = 'tune_trial_id' AND r.status = 'FINISHED'"
            ).fetchall()
    except sqlite3.Error:  # tables not created yet
        return set()
    return {r[0] for r in rows}


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_each_trial_s_config_is_built_once_on_the_driver(cluster, tmp_path: Path, monkeypatch) -> None:
    """One config per trial: the driver builds it once (the searcher when it draws the trial's
    values, the confirmation before its Tuner), the worker trains it and the recorder logs its
    params without building it again; the search space builds only its table of used keys,
    once per condition (one entry here: no component is chosen)."""
    import studies.pipeline

    records = tmp_path / "records"
    fit = FakeFit(epoch_seconds=0.05, record_dir=str(records), count_builds=True)
    builds: dict[str, int] = {}

    def counted(phase: str, run: Any) -> Any:
        def wrapper(*args: Any) -> Any:
            before = counter.count
            out = run(*args)
            builds[f"{phase} {args[1] if phase == 'search' else ''}".strip()] = counter.count - before
            return out
        return wrapper

    monkeypatch.setattr(studies.pipeline, "search", counted("search", studies.pipeline.search))
    monkeypatch.setattr(studies.pipeline, "confirm", counted("confirm", studies.pipeline.confirm))
    with counting_config_builds() as counter:
        rc = main(["fake", "--workspace", str(tmp_path / "ws"), "--budget", "3", "--seeds", "2"],
                  backend=Backend(fit, fake_prepare), extra_studies={"fake": fake_study(tmp_path)})
    assert rc == 0
    assert builds == {"search lagrangian": 3 + 1, "confirm": 2 * 2}
    worker_builds = [json.loads(f.read_text())["config_builds"] for f in records.glob("*.json")]
    assert len(worker_builds) == 3 + 4 and set(worker_builds) == {0}


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_resume_after_the_driver_is_killed(cluster, tmp_path: Path) -> None:
    workspace, records = tmp_path / "ws", tmp_path / "records"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), records=str(records)))
    args = ["fake", "--workspace", str(workspace), "--address", cluster.address, "--seeds", "1"]
    log = open(tmp_path / "driver.log", "w")  # noqa: SIM115 - closed with the driver
    driver = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    finished: set[str] = set()
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and driver.poll() is None:
            finished = finished_trials(workspace / "mlflow.db")
            if len(finished) >= 2:
                break
            time.sleep(0.2)
    finally:
        driver.kill()
        driver.wait()
        log.close()
    tail = (tmp_path / "driver.log").read_text()[-2000:]
    assert len(finished) >= 2, f"the driver did not finish two trials in time:\n{tail}"
    before = child_runs(workspace)
    assert (before["status"] == "RUNNING").any() or len(before) < 6  # killed mid-study

    rc = main([*args, "--resume"], backend=Backend(FakeFit(epoch_seconds=0.05, record_dir=str(records)),
                                                   fake_prepare),
              extra_studies={"fake": fake_study(tmp_path, budget=6, conditions=("lagrangian",))})
    assert rc == 0
    after = child_runs(workspace)
    search = after[after["phase"] == "search"]
    assert len(search) == 6 and after["tune_trial_id"].is_unique  # no duplicate MLflow run
    assert set(after["status"]) <= {"FINISHED", "FAILED"}
    assert all(len(s) == len(set(s)) for s in after["steps"])  # no epoch recorded twice
    calls = [json.loads(p.read_text()) for p in records.glob("*.json")]
    for trial_id in finished:  # a trial that had finished before the kill never trained again
        runs_of_trial = [c for c in calls if trial_id in c["run_dir"]]
        assert len(runs_of_trial) == 1, trial_id
    resumed = [c for c in calls if c["resumed_after"] > 0]
    assert all(c["epochs_run"] <= 4 - c["resumed_after"] for c in resumed)
    state = json.loads(next((workspace / "ray" / "fake").iterdir()).joinpath("state.json").read_text())
    assert state["phase"] == "done"
    assert (workspace / "reports" / "fake" / "table1.md").is_file()


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_a_tune_experiment_killed_before_its_first_save_starts_over(cluster, tmp_path: Path) -> None:
    """The Tuner writes tuner.pkl (no param_space in it) when it is built, and Tune saves the
    trials and the searcher only once ``fit`` runs: a driver killed in between left an
    experiment that Tune would restore as a new one whose trials have no ``condition``."""
    workspace = tmp_path / "ws"
    args = ["fake", "--workspace", str(workspace), "--seeds", "1"]

    def run(*extra: str) -> int:
        return main([*args, *extra], backend=Backend(FakeFit(epoch_seconds=0.05), fake_prepare),
                    extra_studies={"fake": fake_study(tmp_path, budget=3, conditions=("lagrangian",))})

    assert run() == 0
    # Back to the moment the confirmation Tuner was built: its folder holds tuner.pkl only, the
    # study is in its confirm phase, and the run its trial had opened is still RUNNING.
    run_dir = next((workspace / "ray" / "fake").iterdir())
    confirm = run_dir / "confirm"
    for path in confirm.iterdir():
        if path.name != "tuner.pkl":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    state = json.loads((run_dir / "state.json").read_text())
    (run_dir / "state.json").write_text(json.dumps({**state, "phase": "confirm"}))
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    lost = child_runs(workspace).query("phase == 'confirm'")["run_id"].tolist()
    assert len(lost) == 1
    client.update_run(lost[0], status="RUNNING")

    assert run("--resume") == 0
    runs = child_runs(workspace)
    confirmed = runs[runs["phase"] == "confirm"]
    assert len(confirmed) == 1 and lost[0] not in set(confirmed["run_id"])
    assert confirmed.iloc[0]["condition"] == "lagrangian" and confirmed.iloc[0]["status"] == "FINISHED"
    assert client.get_run(lost[0]).info.lifecycle_stage == "deleted"
    assert len(runs[runs["phase"] == "search"]) == 3  # the search was not touched
    assert json.loads((run_dir / "state.json").read_text())["phase"] == "done"


class StepClock:
    """A clock that advances one second each time it is read: 30 readings are 30 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.slow
def test_the_driver_shows_progress_while_no_result_arrives(cluster, tmp_path: Path) -> None:
    """A status line every 30 s (of a clock read at every turn of Tune's loop), also while the
    trials hold before their first epoch, and one at each trial's end with the right counts."""
    from studies.pipeline import run_study
    from studies.plan import Options, StudyPlan
    from studies.progress import ProgressOptions

    gate = tmp_path / "gate"
    gate.mkdir()
    lines: list[str] = []
    held: list[str] = []  # the status lines said while the trials held

    def say(line: str) -> None:
        lines.append(line)
        if (gate / "go").exists():
            return
        if line.startswith("search lagrangian: 0 done, 2 running, 1 left; "):
            held.append(line)
        if len(held) >= 2:  # two 30-s lines while no trial has reported: let them train
            (gate / "go").touch()

    study: Study = fake_study(tmp_path, budget=3, conditions=("lagrangian",))
    plan = StudyPlan.build(study, Options(workspace=str(tmp_path / "ws"), seeds=1))
    fit = FakeFit(epoch_seconds=0.05, gate=str(gate), hold_after=0)
    run_study(plan, Backend(fit, fake_prepare), say=say,
              progress=ProgressOptions(interval=30.0, say=say, clock=StepClock(), bar=False))

    search = lines[lines.index("search lagrangian: objective.eta ~ uniform [0.05, 0.3]") + 1:]
    search = search[:next(i for i, x in enumerate(search) if x.startswith("  3 trials:"))]
    status = [x for x in search if x.startswith("search lagrangian: ")]
    ends = [i for i, x in enumerate(search) if x.startswith("  trial ")]
    assert len(ends) == 3
    # Once they train, a line may come before the first trial's end, an epoch measured (seen
    # under load in CI): only the lines said while they held have no estimate.
    assert len(held) == 2 and all("the rest estimated after the first epoch" in x for x in held)
    assert all(search.index(x) < ends[0] for x in held)
    for k, i in enumerate(ends, start=1):  # each trial's end, then the status with it counted
        assert search[i + 1].startswith(f"search lagrangian: {k} done, "), search[i:i + 2]
        assert "best val_rsum " in search[i + 1] and "(lagrangian eta=" in search[i + 1]
    assert status[-1].startswith("search lagrangian: 3 done, 0 running, 0 left; best val_rsum ")
    confirm = [x for x in lines if x.startswith("confirm: ")]
    assert confirm[-1].startswith("confirm: 1 done, 0 running, 0 left; best val_rsum ")
    assert "(lagrangian eta=" in confirm[-1] and " seed=1000)" in confirm[-1]


SIGNALLED_DRIVER = """
import sys
from pathlib import Path
from fakes import FakeFit, fake_prepare
from studies.pipeline import Backend
from studies.run import main
sys.path.insert(0, {tests!r})
from test_studies_pipeline import fake_study
study = fake_study(Path({tmp!r}), budget=2, conditions=("lagrangian",))
fit = FakeFit(epoch_seconds=30.0, record_dir={records!r})  # trials that report nothing for 30 s
sys.exit(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={{"fake": study}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])  # SIGTERM: SIGHUP's handler
def test_a_stop_signal_while_trials_start_says_interrupted(cluster, tmp_path: Path, sig: int) -> None:
    """SIGINT or SIGHUP right after `A new study created`, or SIGTERM 2 s after it, gave rc 1
    and a traceback (`result.config["condition"]`: Tune had marked the trials it stopped
    TERMINATED, without a result)."""
    records = tmp_path / "records"
    script = tmp_path / "driver.py"
    script.write_text(SIGNALLED_DRIVER.format(tests=str(ROOT / "tests"), tmp=str(tmp_path),
                                              records=str(records)))
    args = ["fake", "--workspace", str(tmp_path / "ws"), "--address", cluster.address, "--seeds", "1"]
    driver = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    try:
        deadline = time.monotonic() + 180
        while len(list(records.glob("*.json"))) < 2 and driver.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)  # waits for both trials to start, not for time
        driver.send_signal(sig)
        out, err = driver.communicate(timeout=180)
    finally:
        driver.kill()
        driver.wait()
    assert len(list(records.glob("*.json"))) == 2, err[-3000:]
    assert driver.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted: run the same command again to continue"
    assert "Traceback" not in err


HELD_DRIVER = """
import sys
from pathlib import Path
from fakes import FakeFit, fake_prepare
from studies.pipeline import Backend
from studies.run import main
sys.path.insert(0, {tests!r})
from test_studies_pipeline import fake_study
study = fake_study(Path({tmp!r}), budget=2, conditions=("lagrangian",))
fit = FakeFit(epoch_seconds=1.0, record_dir={records!r}, gate={gate!r}, hold_after=0)
sys.exit(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={{"fake": study}}))
"""


def recorded_epochs(db: Path, phase: str = "") -> dict[str, int]:
    """Tune trial id -> the last epoch its MLflow run holds (read-only, as finished_trials);
    with ``phase``, that phase's runs only."""
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            rows = con.execute(
                "SELECT t.value, MAX(m.step) FROM metrics m JOIN tags t ON t.run_uuid = m.run_uuid "
                "JOIN tags p ON p.run_uuid = m.run_uuid WHERE m.key = 'epoch' "
                "AND t.key = 'tune_trial_id' AND p.key = 'phase' AND (? = '' OR p.value = ?) "
                "GROUP BY t.value", (phase, phase)).fetchall()
    except sqlite3.Error:
        return {}
    return {trial: int(epoch) for trial, epoch in rows}


def trial_of(call: dict) -> str:
    return re.search(r"icr-trial-(\w+?)-", call["run_dir"]).group(1)


@pytest.mark.slow
def test_a_trial_restored_from_a_lagging_tune_state_continues_after_its_recorded_epoch(
        cluster, tmp_path: Path) -> None:
    """SIGKILL of the driver 38 s into the search: a trial's epoch 1, recorded before the kill,
    was trained again after it, because Tune saves its experiment state (which holds each trial's
    checkpoint) to storage in the background and the kill came before that copy. Here Tune's
    state is put back to one saved before the first epoch, as such a kill leaves it; every
    trial must continue after the epoch MLflow holds for it, or after a later epoch whose
    checkpoint the trial had marked with its result before the kill (the driver may die between
    the trial's mark and its MLflow record; the chaos test allows the same), and no epoch may be
    recorded twice or lost."""
    workspace, records, gate = tmp_path / "ws", tmp_path / "records", tmp_path / "gate"
    gate.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(HELD_DRIVER.format(tests=str(ROOT / "tests"), tmp=str(tmp_path),
                                         records=str(records), gate=str(gate)))
    args = ["fake", "--workspace", str(workspace), "--address", cluster.address, "--seeds", "1"]
    log = open(tmp_path / "driver.log", "w")  # noqa: SIM115 - closed with the driver
    driver = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    deadline = time.monotonic() + 180
    try:
        # Both trials started and hold before their first epoch; Tune's state on storage has them,
        # saved whole: a copy taken while Tune writes its searcher's state after the trials' would
        # be an experiment never saved whole, which the platform starts over (test_frameworks_tune)
        saved, trials, copy = None, set(), tmp_path / "saved"
        while saved is None and driver.poll() is None and time.monotonic() < deadline:
            trials = {trial_of(json.loads(p.read_text())) for p in records.glob("*.json")}
            states = list(workspace.glob("ray/fake/*/search-lagrangian/experiment_state-*.json"))
            if len(trials) == 2 and states:
                experiment = states[0].parent
                taken = {p.name: p.read_bytes() for p in experiment.iterdir() if p.is_file()}
                shutil.rmtree(copy, ignore_errors=True)
                copy.mkdir()
                for name, data in taken.items():
                    (copy / name).write_bytes(data)
                newest = max(copy.glob("experiment_state-*.json"), default=None)
                if (saved_by_tune(copy) and newest is not None
                        and all(t in newest.read_text() for t in trials)):
                    saved = taken
            time.sleep(0.1)  # waits for the driver, not for time
        assert saved is not None, (tmp_path / "driver.log").read_text()[-3000:]
        (gate / "go").touch()
        while not recorded_epochs(workspace / "mlflow.db") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        driver.kill()
        driver.wait()
        log.close()
    recorded = recorded_epochs(workspace / "mlflow.db")
    assert recorded, (tmp_path / "driver.log").read_text()[-3000:]
    first_calls = set(records.glob("*.json"))
    for path in experiment.iterdir():  # Tune's state as the kill left it: from before epoch 1
        if path.is_file():
            path.unlink()
    for name, data in saved.items():
        (experiment / name).write_bytes(data)

    rc = main([*args, "--resume"], backend=Backend(FakeFit(epoch_seconds=0.05, record_dir=str(records)),
                                                   fake_prepare),
              extra_studies={"fake": fake_study(tmp_path, budget=2, conditions=("lagrangian",))})
    assert rc == 0
    again = [json.loads(p.read_text()) for p in set(records.glob("*.json")) - first_calls]
    search_again = {trial_of(c): c for c in again if trial_of(c) in trials}
    runs = child_runs(workspace)
    final = {row["tune_trial_id"]: row["steps"][-1] for _, row in runs.iterrows()}
    for trial in trials:
        if trial in search_again:  # it trained on from the epoch its run holds, not from before
            assert search_again[trial]["resumed_after"] >= recorded.get(trial, 0), (
                trial, recorded, search_again)
        else:  # it ended there (it had, or ASHA stopped it when its epoch came again)
            assert final[trial] == recorded[trial], (trial, recorded, final)
    assert runs["tune_trial_id"].is_unique and all(len(s) == len(set(s)) for s in runs["steps"])
    assert all(sorted(s) == list(range(1, len(s) + 1)) for s in runs["steps"])  # none lost
    full = runs[(runs["phase"] == "search") & (runs["budget_complete"] == "true")]
    assert all(steps == [1, 2, 3, 4] for steps in full["steps"])


CONFIRMING_DRIVER = """
import sys
from pathlib import Path
from fakes import FakeFit, fake_prepare
from studies.pipeline import Backend
from studies.run import main
sys.path.insert(0, {tests!r})
from test_studies_pipeline import fake_study
study = fake_study(Path({tmp!r}), budget=2, conditions=("lagrangian", "contrastive"))
fit = FakeFit(epoch_seconds=0.05, record_dir={records!r}, gate={gate!r}, hold_after=1,
              hold_on=(("eval.test", True),))  # the confirmation's runs wait after epoch 1
sys.exit(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={{"fake": study}}))
"""


@pytest.mark.slow
def test_a_confirmation_interrupted_and_resumed_trains_each_trial_s_own_condition(
        cluster, tmp_path: Path) -> None:
    """Tune saves a grid trial's TrialSpec as its index in the grid and, restored, resolves it
    against the grid it is given again; state.json gives the winners back sorted by name. With
    the conditions out of alphabetical order, a confirmation interrupted by Ctrl-C once went on
    training each unfinished seed under another condition's spec (in text_encoder, MiniLM's
    checkpoints under the bi-GRU's config)."""
    workspace, records, gate = tmp_path / "ws", tmp_path / "records", tmp_path / "gate"
    gate.mkdir()
    script = tmp_path / "driver.py"
    script.write_text(CONFIRMING_DRIVER.format(tests=str(ROOT / "tests"), tmp=str(tmp_path),
                                               records=str(records), gate=str(gate)))
    args = ["fake", "--workspace", str(workspace), "--address", cluster.address, "--seeds", "2"]
    driver = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    try:
        deadline = time.monotonic() + 180
        held: dict[str, int] = {}
        while len(held) < 2 and driver.poll() is None and time.monotonic() < deadline:
            held = recorded_epochs(workspace / "mlflow.db", phase="confirm")
            time.sleep(0.1)  # waits for two confirmation runs to hold after epoch 1, not for time
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=180)
    finally:
        driver.kill()
        driver.wait()
    assert len(held) == 2 and driver.returncode == 130, err[-3000:]

    rc = main([*args, "--resume"], backend=Backend(FakeFit(epoch_seconds=0.02, record_dir=str(records)),
                                                   fake_prepare),
              extra_studies={"fake": fake_study(tmp_path, budget=2, conditions=("lagrangian", "contrastive"))})
    assert rc == 0
    trained: dict[str, set[tuple[str, int]]] = {}
    for call in map(json.loads, map(Path.read_text, records.glob("*.json"))):
        trained.setdefault(trial_of(call), set()).add((call["objective"], call["seed"]))
    confirmed = child_runs(workspace).query("phase == 'confirm'")
    assert len(confirmed) == 4 and set(confirmed["status"]) == {"FINISHED"}
    pairs = [(row["params"]["objective.name"], int(row["params"]["train.seed"]))
             for _, row in confirmed.iterrows()]
    assert sorted(pairs) == [("contrastive", 1000), ("contrastive", 1001),
                             ("lagrangian", 1000), ("lagrangian", 1001)]
    for (_, row), pair in zip(confirmed.iterrows(), pairs, strict=True):
        assert trained[row["tune_trial_id"]] == {pair}, (row["tune_trial_id"], trained)


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_a_paper_recipe_trains_its_grid_to_the_end_with_each_condition_s_epochs(
        cluster, tmp_path: Path) -> None:
    """``--recipe paper``: a grid domain trains each point once (GridSampler through Tune), no
    trial is stopped early (FIFO), and a condition trains its own epochs (SmoothAP's 5x)."""
    (tmp_path / "paper.yaml").write_text(
        "space: {}\nconditions:\n  lagrangian:\n    objective.eta: {grid: [0.1, 0.2, 0.3]}\n")
    paper = Recipe("paper", "a test", {"train.warmup_epochs": 2, "train.finetune_epochs": 2,
                                       "eval.test": False},
                   conditions={"contrastive": {"train.finetune_epochs": 0}},
                   space_file=str(tmp_path / "paper.yaml"), seeds=1, early_stopping=False)
    study = replace(fake_study(tmp_path, budget=8), paper=paper)
    workspace = tmp_path / "ws"
    rc = main(["fake", "--recipe", "paper", "--workspace", str(workspace)],
              backend=Backend(FakeFit(epoch_seconds=0.05), fake_prepare), extra_studies={"fake": study})
    assert rc == 0
    runs = child_runs(workspace, "fake-paper")
    search = runs[runs["phase"] == "search"]
    assert sorted(float(p["objective.eta"]) for p in search["params"]) == [0.1, 0.2, 0.3]
    assert (search["budget_complete"] == "true").all() and (search["stopped_early"] == "false").all()
    assert all(steps == [1, 2, 3, 4] for steps in search["steps"])
    confirm = runs[runs["phase"] == "confirm"].set_index("condition")
    assert confirm.loc["contrastive", "steps"] == [1, 2]
    assert confirm.loc["lagrangian", "steps"] == [1, 2, 3, 4]
    assert (confirm["budget_complete"] == "true").all()


@pytest.mark.slow
def test_a_phase_whose_trials_all_ended_before_the_driver_died_resumes_to_the_end(
        cluster, tmp_path: Path) -> None:
    """A driver killed after Tune had saved every confirmation trial as TERMINATED, but before
    the phase was recorded: the resumed run got back those trials with their saved last results,
    which Tune never marks done, and said "interrupted" on every resume (ltd_probe, killed with
    its machine and resumed). Here the saved phase is put back to "confirm" after a finished run;
    the resume must report without training or recording anything twice."""
    workspace = tmp_path / "ws"
    args = ["fake", "--workspace", str(workspace), "--address", cluster.address, "--seeds", "2"]
    study = fake_study(tmp_path, budget=2, conditions=("lagrangian",))
    fit = FakeFit(epoch_seconds=0.05, record_dir=str(tmp_path / "records"))
    assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 0
    before = child_runs(workspace)
    calls = set((tmp_path / "records").glob("*.json"))
    (state_file,) = workspace.glob("ray/fake/*/state.json")
    state = json.loads(state_file.read_text())
    assert state["phase"] == "done"
    state_file.write_text(json.dumps({**state, "phase": "confirm"}))

    rc = main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study})
    assert rc == 0
    assert json.loads(state_file.read_text())["phase"] == "done"
    assert set((tmp_path / "records").glob("*.json")) == calls  # no trial trained again
    after = child_runs(workspace)
    assert len(after) == len(before) and after["tune_trial_id"].is_unique
    assert sorted(after[after["phase"] == "confirm"]["tune_trial_id"]) == sorted(
        before[before["phase"] == "confirm"]["tune_trial_id"])


def saved_with_checkpoint(experiment: Path, name: str) -> bool:
    """Whether Tune's saved state of ``experiment`` registers a checkpoint folder ``name`` (Tune
    keeps a trial's checkpoints pickled, as hex, in the JSON of its state)."""
    return any(name.encode().hex() in state.read_text()
               for state in experiment.glob("experiment_state-*.json"))


def result_epochs(trial_folder: Path) -> list[int]:
    """The epochs of the rows of a trial's result.json, in order."""
    return [json.loads(line)["epoch"] for line in
            (trial_folder / "result.json").read_text().splitlines() if line.strip()]


def progress_epochs(trial_folder: Path) -> list[int]:
    """The epochs of the rows of a trial's progress.csv, in order."""
    with open(trial_folder / "progress.csv", newline="") as f:
        return [int(float(row["epoch"])) for row in csv.DictReader(f)]


def test_a_trial_whose_saved_checkpoint_was_superseded_finishes_from_its_newest(
        cluster, tmp_path: Path) -> None:
    """SIGKILL of the driver as a confirmation run's last epoch was recorded: Tune's saved state
    still named the run's first checkpoint, which Tune had deleted when it registered the last
    one (one checkpoint kept). Restored, the trial failed with "Could not recover from checkpoint
    as it does not exist on storage anymore", its MLflow run (both epochs recorded) ended FAILED,
    the table's row had n=1 and the study exited 0; another time result.json got its last row
    twice. Here the study runs to its end while the state saved after epoch 1 is kept, then
    that state is put back, as such a kill leaves it."""
    import threading

    workspace, records, gate = tmp_path / "ws", tmp_path / "records", tmp_path / "gate"
    gate.mkdir()
    study = fake_study(tmp_path, budget=2, conditions=("contrastive",))
    (tmp_path / "space.yaml").write_text("space:\n  loss.tau: 0.05\n")  # nothing searched
    args = ["fake", "--workspace", str(workspace), "--seeds", "1",
            "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"]
    saved: dict[str, bytes] = {}
    ended = threading.Event()

    def keep_the_state_of_epoch_1() -> None:
        while not saved and not ended.is_set():
            for experiment in workspace.glob("ray/fake/*/confirm"):
                if saved_with_checkpoint(experiment, "checkpoint_000000"):
                    saved.update({p.name: p.read_bytes() for p in experiment.iterdir()
                                  if p.is_file()})
            time.sleep(0.05)  # waits for Tune's save, not for time
        (gate / "go").touch()

    watcher = threading.Thread(target=keep_the_state_of_epoch_1)
    watcher.start()
    fit = FakeFit(epoch_seconds=0.05, record_dir=str(records), gate=str(gate), hold_after=1)
    try:
        assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 0
    finally:
        ended.set()
        watcher.join()
    assert saved, "Tune never saved the state of epoch 1"
    (experiment,) = workspace.glob("ray/fake/*/confirm")
    (trial,) = (p for p in experiment.iterdir() if p.is_dir())
    assert [p.name for p in trial.glob("checkpoint_*")] == ["checkpoint_000001"]
    for path in experiment.iterdir():  # Tune's state as the kill left it: from after epoch 1
        if path.is_file():
            path.unlink()
    for name, data in saved.items():
        (experiment / name).write_bytes(data)
    state_file = experiment.parent / "state.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "phase": "confirm"}))
    calls = set(records.glob("*.json"))

    assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 0
    (run,) = child_runs(workspace).query("phase == 'confirm'").itertuples()
    assert run.status == "FINISHED" and run.steps == [1, 2]
    assert result_epochs(trial) == [1, 2] == progress_epochs(trial)  # no row twice
    assert set(records.glob("*.json")) == calls  # it had ended: nothing trained again
    assert "did not finish" not in (workspace / "reports" / "fake" / "table1.md").read_text()


def test_a_run_lost_outside_its_training_stops_the_study_until_it_is_run_again(
        cluster, tmp_path: Path, capsys) -> None:
    """A study exits 0 with fewer runs than planned only when a run failed in its own training
    (a diverging loss); a run whose worker was lost, every retry, left a report with n=1 and
    exit 0. Now that run stops the study (one line, exit 1) and the same command continues it."""
    workspace = tmp_path / "ws"
    study = fake_study(tmp_path, budget=2, conditions=("contrastive",))
    (tmp_path / "space.yaml").write_text("space:\n  loss.tau: 0.05\n")  # nothing searched
    args = ["fake", "--workspace", str(workspace), "--seeds", "2",
            "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"]
    # Its worker dies at epoch 2, on the first try and on Tune's retry (max_failures=1).
    fit = FakeFit(epoch_seconds=0.05, fail_on=(("train.seed", 1000),),
                  crash_dir=str(tmp_path / "crashes"), crashes=2)
    assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: 1 trial(s) of confirm failed outside their training (trial ")
    assert "[contrastive seed=1000]" in err[-1] and err[-1].endswith(
        "run the same command again to continue them")
    assert not (workspace / "reports" / "fake").exists()

    assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == \
        f"report: {workspace / 'reports' / 'fake'}"
    runs = child_runs(workspace)
    assert len(runs) == 2 and (runs["status"] == "FINISHED").all()
    assert all(steps == [1, 2] for steps in runs["steps"])


def test_ctrl_c_between_two_tuners_stops_the_study(cluster, tmp_path: Path) -> None:
    """Tune leaves its SIGINT handler installed when fit returns: a Ctrl-C as the confirmation
    began went to the finished search's handler, which stopped nothing, and the study ran to its
    end with exit code 0 (found by the chaos test)."""
    from studies.pipeline import run_study
    from studies.plan import Options, StudyPlan
    from studies.signals import Interrupted, StopSignals

    study = fake_study(tmp_path, budget=2, conditions=("lagrangian",))
    plan = StudyPlan.build(study, Options(workspace=str(tmp_path / "ws"), seeds=1))

    def say(line: str) -> None:
        if line.startswith("confirm: ") and " winner(s) " in line:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the confirmation begins

    with StopSignals() as stops, pytest.raises((Interrupted, KeyboardInterrupt)):
        run_study(plan, Backend(FakeFit(epoch_seconds=0.05), fake_prepare), say=say)
    assert stops.received == signal.SIGINT
    (state,) = (tmp_path / "ws").glob("ray/fake/*/state.json")
    assert json.loads(state.read_text())["phase"] == "confirm"  # continued by the next run
