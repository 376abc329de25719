"""Node loss: a trial on a killed node resumes from its checkpoint on the node that is left.

A two-node Ray cluster on loopback (a head and a worker node, each started with ``ray start``,
1 CPU each, their own ports and temp folders), Tune storage on a local folder (both nodes run on
this machine, so they share its disk). Two trials of four epochs run at once, one per node; both
hold before epoch 3 until the test lets them go. The test kills the worker node's raylet while
its trial holds (its epoch-2 checkpoint is saved), then lets the trials go: the head's trial
finishes, the lost trial starts again on the head from epoch 2, not from 0.

Each scenario's driver runs in a child Python (:func:`run_scenario`), not in the test session:
Ray ends a driver with exit code 1, without a Python exception, when it loses the node it is
attached to, and in the session's own process that would end every remaining test silently.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from studies import connection, launcher, processes, storage
from studies.frameworks import tune as tune_adapter
from studies.trials import trial_label

HERE = Path(__file__).resolve().parent
EPOCHS, HOLD_AFTER = 4, 2
# A killed node's raylet refuses the GCS's health checks at once, so it is declared dead after
# 10 checks a second apart (about 10 s, instead of Ray's 15-30 s). A live node that answers slowly
# (each check may take 5 s) is declared dead only after about a minute of silence: a machine
# starved of CPU must not lose the head node, and with it the driver, by mistake.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                      "health_check_timeout_ms": 5000, "health_check_failure_threshold": 10}
# Hang guards only, not timings: on a virtual machine whose host takes most of its CPU (80 % steal
# measured), starting and stopping a two-node cluster alone takes about two minutes.
CLUSTER_TEST_TIMEOUT = 900


def run_scenario(name: str, tmp_path: Path) -> None:
    """Run this module's function ``name(tmp_path)`` in a child Python and fail with its output
    if it fails (an assertion's traceback, Ray's last words, or a hang)."""
    code = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(HERE)!r}); "
            f"import test_cluster_nodes as m; m.{name}(Path({str(tmp_path)!r}))")
    try:
        child = subprocess.run([sys.executable, "-c", code], cwd=HERE.parent, capture_output=True,
                               text=True, timeout=CLUSTER_TEST_TIMEOUT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{name} did not end within {CLUSTER_TEST_TIMEOUT} s:\n"
                    f"{_tail(hung.stdout)}\n{_tail(hung.stderr)}")
    assert child.returncode == 0, (f"{name} exited with {child.returncode}:\n"
                                   f"{_tail(child.stdout)}\n{_tail(child.stderr)}")


def _tail(text: str | bytes | None, chars: int = 6000) -> str:
    text = text.decode(errors="replace") if isinstance(text, bytes) else (text or "")
    return text[-chars:]


def epochs(config: dict) -> None:
    """A fake trial: one report and checkpoint per epoch; holds before epoch HOLD_AFTER + 1."""
    import ray
    from ray import tune

    gate, name = Path(config["gate"]), config["name"]
    start = 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            start = json.loads((Path(folder) / "state.json").read_text())["epoch"]
    node = ray.get_runtime_context().get_node_id()
    with open(gate / f"{name}.starts", "a") as out:
        out.write(json.dumps({"node": node, "start": start, "pid": os.getpid()}) + "\n")
    for epoch in range(start + 1, EPOCHS + 1):
        while epoch > HOLD_AFTER and not (gate / "go").exists():
            time.sleep(0.05)  # waits for the test, not for time
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "state.json").write_text(json.dumps({"epoch": epoch}))
            tune.report({"epoch": epoch, "start": start},
                        checkpoint=tune.Checkpoint.from_directory(folder))
        (gate / f"{name}.{epoch}").touch()  # reported, and its checkpoint is in storage


def starts(gate: Path, name: str) -> list[dict]:
    path = gate / f"{name}.starts"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kill_worker_node_when_its_trial_holds(gate: Path, worker: launcher.LocalInstance,
                                          worker_node: str, done: threading.Event) -> None:
    """Watcher: once the trial on the worker node saved epoch 2, SIGKILL that node's raylet.

    The trials go on only when the node is dead for the cluster and the trial's process is gone:
    a worker process outlives its raylet for a moment and could otherwise finish the trial.
    """
    import psutil
    import ray

    while not done.is_set():
        on_worker = [(name, run) for name in ("a", "b") for run in starts(gate, name)
                     if run["node"] == worker_node]
        if on_worker and (gate / f"{on_worker[0][0]}.{HOLD_AFTER}").exists():
            name, run = on_worker[0]
            (gate / "lost").write_text(name)
            for proc in processes.family(worker.marker, worker.temp_dir):
                if proc.name() == "raylet":
                    proc.send_signal(signal.SIGKILL)
            while not done.is_set() and (psutil.pid_exists(run["pid"]) or any(
                    n["Alive"] for n in ray.nodes() if n["NodeID"] == worker_node)):
                time.sleep(0.05)
            (gate / "go").touch()
            return
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TEST_TIMEOUT + 60)
def test_a_trial_on_a_lost_node_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    run_scenario("lost_node_trial", tmp_path)


def lost_node_trial(tmp_path: Path) -> None:
    import ray
    from ray import tune

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    gate = tmp_path / "gate"
    gate.mkdir()
    head = launcher.start_head(num_cpus=1, dashboard=False, system_config=FAST_HEALTH_CHECKS)
    worker = None
    try:
        worker = launcher.start_node(head.address, num_cpus=1)
        cluster = connection.connect(head.address)
        assert (cluster.nodes, cluster.hosts) == (2, 1)
        storage.check_storage(str(tmp_path / "ray"), cluster.nodes, hosts=cluster.hosts)
        nodes = [n for n in ray.nodes() if n["Alive"]]
        assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
        worker_node = next(n["NodeID"] for n in nodes
                           if n["RayletSocketName"].startswith(str(worker.temp_dir)))

        done = threading.Event()
        watcher = threading.Thread(target=kill_worker_node_when_its_trial_holds,
                                   args=(gate, worker, worker_node, done), daemon=True)
        watcher.start()
        tuner = tune.Tuner(
            tune_adapter.labelled_trainable(tune.with_resources(epochs, {"cpu": 1}), trial_label),
            param_space={"gate": str(gate), "name": tune.grid_search(["a", "b"])},
            run_config=tune.RunConfig(name="node-loss", storage_path=str(tmp_path / "ray"),
                                      failure_config=tune.FailureConfig(max_failures=2),
                                      verbose=0),
        )
        try:
            grid = tuner.fit()
        finally:
            done.set()
            watcher.join()
        assert (gate / "lost").exists(), "no trial ran on the worker node"
        lost = (gate / "lost").read_text()
        kept = "b" if lost == "a" else "a"
        assert grid.num_errors == 0 and all(r.metrics["epoch"] == EPOCHS for r in grid)
        runs = starts(gate, lost)
        assert [r["start"] for r in runs] == [0, HOLD_AFTER]  # resumed, not from scratch
        assert runs[0]["node"] == worker_node and runs[1]["node"] != worker_node
        assert [r["start"] for r in starts(gate, kept)] == [0]  # the other trial never stopped
        alive = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(alive) == 1 and alive[0] != worker_node  # (a node retried at start is dead too)
    finally:
        ray.shutdown()
        for instance in (worker, head):
            if instance is not None:
                launcher.stop_instance(instance)
    assert not processes.family(head.marker, head.temp_dir)
    assert not processes.family(worker.marker, worker.temp_dir)


STUDY_SPACE = "conditions:\n  lagrangian:\n    objective.eta: {uniform: [0.05, 0.3]}\n"


def _records(folder: Path) -> list[dict]:
    return [{**json.loads(p.read_text()), "pid": int(p.stem.split("-")[0])}
            for p in sorted(folder.glob("*.json"))]


@pytest.mark.slow
@pytest.mark.timeout(CLUSTER_TEST_TIMEOUT + 60)
def test_a_study_survives_a_lost_node_without_duplicating_runs(tmp_path: Path) -> None:
    """The whole pipeline on a two-node cluster: a trial's node dies mid-trial; the study
    completes, that trial resumes from its checkpoint on the head, and MLflow has one run per
    trial, each epoch recorded once."""
    run_scenario("lost_node_study", tmp_path)


def lost_node_study(tmp_path: Path) -> None:
    import ray  # before psutil: Ray ships the psutil it uses
    from mlflow.tracking import MlflowClient

    from studies.catalog import Condition, Study
    from studies.pipeline import Backend
    from studies.run import main

    from fakes import FakeFit, fake_prepare

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    gate, records = tmp_path / "gate", tmp_path / "records"
    gate.mkdir()
    (tmp_path / "space.yaml").write_text(STUDY_SPACE)
    study = Study(name="nodes", description="node loss", space_file=str(tmp_path / "space.yaml"),
                  base={"train.warmup_epochs": 2, "train.finetune_epochs": 2},
                  conditions=(Condition("lagrangian", "L", {"objective.name": "lagrangian"}),),
                  budget=2, startup_trials=2, seeds=1, grace_period=4, max_failures=2)
    fit = FakeFit(record_dir=str(records), gate=str(gate), hold_after=HOLD_AFTER)
    head = launcher.start_head(num_cpus=1, dashboard=False, system_config=FAST_HEALTH_CHECKS)
    worker = None
    done = threading.Event()
    import psutil

    try:
        worker = launcher.start_node(head.address, num_cpus=1)

        def kill_when_held() -> None:
            while not done.is_set():
                members = {p.pid for p in processes.family(worker.marker, worker.temp_dir)}
                held = [r for r in _records(records) if r["pid"] in members
                        and r["epochs_run"] + r["resumed_after"] >= HOLD_AFTER]
                if held:
                    for proc in processes.family(worker.marker, worker.temp_dir):
                        if proc.name() == "raylet":
                            proc.send_signal(signal.SIGKILL)
                    while not done.is_set() and psutil.pid_exists(held[0]["pid"]):
                        time.sleep(0.05)
                    (gate / "lost").write_text(str(held[0]["pid"]))
                    (gate / "go").touch()
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=kill_when_held, daemon=True)
        watcher.start()
        rc = main(["nodes", "--workspace", str(tmp_path / "ws"), "--address", head.address,
                   "--storage", str(tmp_path / "ray")],
                  backend=Backend(fit, fake_prepare), extra_studies={"nodes": study})
        done.set()
        watcher.join()
        assert rc == 0
        assert (gate / "lost").exists(), "no trial ran on the worker node"
        resumed = [r for r in _records(records) if r["resumed_after"] > 0]
        assert resumed and all(r["resumed_after"] == HOLD_AFTER for r in resumed)
        client = MlflowClient(f"sqlite:///{tmp_path / 'ws' / 'mlflow.db'}")
        experiment = client.get_experiment_by_name("nodes")
        trials = [r for r in client.search_runs([experiment.experiment_id])
                  if r.data.tags.get("icr.role") == "trial"]
        assert len(trials) == 3  # 2 search trials + 1 confirmation run, none twice
        assert len({r.data.tags["tune_trial_id"] for r in trials}) == 3
        for run in trials:
            steps = [m.step for m in client.get_metric_history(run.info.run_id, "epoch")]
            assert sorted(steps) == [1, 2, 3, 4] and run.info.status == "FINISHED"
    finally:
        done.set()
        ray.shutdown()
        for instance in (worker, head):
            if instance is not None:
                launcher.stop_instance(instance)
