"""A study on an autoscaling cluster: sized for the GPUs the cluster can reach, not the ones it has.

The fast tests check the sizing against the node types of ``cluster.yaml`` and of small
configs (the most GPUs against a brute-force search), and how the autoscaler's config is found.

The slow one runs ``studies.run ltd_bound --smoke --address ...`` on Ray's fake multi-node
autoscaler (``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=FILE``, provider
``fake_multinode``): a head with no CPU for trials, and ``cluster.yaml``'s one-GPU worker type,
smaller (1 CPU) and fewer (at most 2), with ``min_workers: 0``; the provider starts each worker
as real Ray processes on 127.0.0.1 with the resources its type declares (its GPU a label). The
study must make the autoscaler add GPU workers, every trial must reserve a GPU and run on one,
the trial whose node is lost in its last epoch must continue from its checkpoint on another node
with nothing lost or trained twice (the chaos test's checks), and the workers must go back
within the idle timeout. The test starts the head with :func:`studies.launcher.start_head`
and stops exactly the processes it started (the family of its marker, which the autoscaler's
workers inherit), never every Ray process of the machine.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from studies import launcher, processes
from studies.connection import Cluster, Growth, NodeType, growth_from_config
from studies.frameworks import ray as ray_internals

from fakes import most_at_once

ROOT = Path(__file__).resolve().parent.parent


def cluster_yaml() -> dict:
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


# --- sizing from the autoscaler's node types ---------------------------------------------------


def test_a_study_joining_cluster_yaml_is_sized_for_the_gpus_it_can_reach() -> None:
    """cluster.yaml: at most 8 workers of worker_gpu1 (1 GPU, 16 CPUs, up to 8) and worker_gpu4
    (4 GPUs, 48 CPUs, up to 2): the most GPUs are 2 x 4 + 6 x 1 = 14; a trial takes the fewest
    CPUs per GPU (12), at most 8."""
    growth = growth_from_config(cluster_yaml(), "cluster.yaml")
    joined = Cluster("10.0.0.5:6379", None, cpus=0, gpus=0, nodes=1, started_here=False,
                     shapes=((0.0, 0.0),), growth=growth)
    assert joined.reachable_gpus == 14
    resources = joined.trial_resources()
    assert resources == {"cpu": 8, "gpu": 1} and joined.concurrency(resources) == 14
    assert joined.describe(resources) == (
        "Ray: 1 node(s), 0 CPUs, 0 GPUs; autoscaling: 0 of up to 14 GPUs now, worker_gpu4 x2, "
        "worker_gpu1 x6 (cluster.yaml); one GPU and 8 CPU(s) per trial; 14 trial(s) at a time")
    shared = joined.trial_resources(trials_per_gpu=4)
    assert shared == {"cpu": 3, "gpu": 0.25} and joined.concurrency(shared) == 56
    # GPUs already up count among those the autoscaler can reach, not beside them.
    grown = replace(joined, cpus=56, gpus=5, nodes=3, shapes=((0.0, 0.0), (48.0, 4.0), (8.0, 1.0)))
    assert grown.reachable_gpus == 14 and grown.describe(resources).startswith(
        "Ray: 3 node(s), 56 CPUs, 5 GPUs; autoscaling: 5 of up to 14 GPUs now")


def test_a_cluster_that_cannot_add_a_gpu_runs_cpu_trials_and_says_so() -> None:
    config = cluster_yaml()
    config["available_node_types"] = {
        "head_cpu": config["available_node_types"]["head_cpu"],
        "worker_cpu": {"resources": {"CPU": 16}, "min_workers": 0, "max_workers": 3,
                       "node_config": {}}}
    joined = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False,
                     growth=growth_from_config(config, "its config"))
    resources = joined.trial_resources()
    assert resources == {"cpu": 1} and joined.concurrency(resources) == 48
    assert joined.describe(resources) == (
        "Ray: 1 node(s), 0 CPUs, 0 GPUs; autoscaling: 0 of up to 48 CPUs now, worker_cpu x3 "
        "(its config); no GPU in the cluster and none its autoscaler can add: CPU-only trials, "
        "1 CPU(s) each; 48 trial(s) at a time")
    alone = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False)  # no config found
    assert alone.describe(alone.trial_resources()).endswith(
        "CPU-only trials, 1 CPU(s) each (no autoscaler config on this node: --gpus N sizes the "
        "study for the GPUs the cluster can add); 1 trial(s) at a time")


def test_gpus_stated_outright_size_the_study() -> None:
    joined = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False,
                     growth=Growth("--gpus", stated_gpus=8))
    resources = joined.trial_resources(trials_per_gpu=2)
    assert resources == {"cpu": 1, "gpu": 0.5} and joined.concurrency(resources) == 16
    assert "; 0 of up to 8 GPUs now (--gpus 8); 1/2 of a GPU" in joined.describe(resources)


def test_a_node_type_without_a_limit_leaves_the_study_sized_for_the_gpus_now() -> None:
    growth = Growth("its config", (NodeType("gpu", 8, 1, None),), max_workers=None)
    joined = Cluster("a", None, cpus=8, gpus=1, nodes=2, started_here=False,
                     shapes=((0.0, 0.0), (8.0, 1.0)), growth=growth)
    resources = joined.trial_resources()
    assert joined.reachable_gpus == 1 and joined.concurrency(resources) == 1
    assert "autoscaling: gpu xany without a limit (its config); sized for the 1 GPUs now: " \
           "--gpus N sizes it for N" in joined.describe(resources)


def brute_force_most(growth: Growth, resource: str) -> float:
    """The most of ``resource`` over every count of every node type within the limits."""
    ranges = [range(kind.max_workers + 1) for kind in growth.node_types]
    best = 0.0
    for counts in itertools.product(*ranges):
        if growth.max_workers is not None and sum(counts) > growth.max_workers:
            continue
        best = max(best, sum(getattr(k, resource) * n for k, n in zip(growth.node_types, counts,
                                                                      strict=True)))
    head = growth.head[1] if resource == "gpus" else growth.head[0]
    return head + best


def test_the_most_gpus_and_cpus_match_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(300):
        kinds = tuple(NodeType(f"t{i}", rng.choice([0, 1, 4, 8, 48]), rng.choice([0, 1, 2, 4, 8]),
                               rng.randint(0, 4)) for i in range(rng.randint(1, 4)))
        growth = Growth("random", kinds, rng.choice([None, 0, 1, 2, 3, 5, 8]),
                        (rng.choice([0, 4]), rng.choice([0, 1])))
        for resource in ("gpus", "cpus"):
            assert growth.most(resource) == brute_force_most(growth, resource), (growth, resource)


def test_the_autoscalers_config_is_found_by_its_gcs_address(tmp_path: Path) -> None:
    """A process with the autoscaler's command line (Ray's monitor.py, its GCS address, a config
    path relative to its folder) stands in for it."""
    (tmp_path / "autoscaling.yaml").write_text("max_workers: 1\n")
    script = os.path.join("ray", ray_internals.MONITOR_SCRIPTS[0])
    monitor = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", f"/opt/{script}",
         f"{ray_internals.MONITOR_GCS_OPTION}127.0.0.1:45678",
         f"{ray_internals.MONITOR_CONFIG_OPTION}autoscaling.yaml"], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not psutil.Process(monitor.pid).cmdline()[3:]:
            time.sleep(0.05)  # waits for the process to start, not for time
        found = tmp_path / "autoscaling.yaml"
        assert ray_internals.autoscaler_config_file("127.0.0.1:45678") == found
        own = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for address in own[:1]:  # the same head through another of this machine's addresses
            assert ray_internals.autoscaler_config_file(f"{address}:45678") == found
        # another machine's cluster on the same port (192.0.2.0/24 is for documentation only)
        assert ray_internals.autoscaler_config_file("192.0.2.1:45678") is None
        assert ray_internals.autoscaler_config_file("127.0.0.1:45679") is None
    finally:
        monitor.kill()
        monitor.wait()


def test_gpus_goes_with_plan_or_address(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "studies.run", "ltd_bound", "--smoke", "--gpus", "8",
         "--workspace", str(tmp_path / "ws")], cwd=ROOT, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 2
    assert result.stderr == "error: --gpus N goes with --plan or --address, N >= 1\n"
    assert not (tmp_path / "ws").exists()


# --- a study on Ray's fake autoscaler ----------------------------------------------------------

IDLE_TIMEOUT_MINUTES = 0.25
SCALE_DOWN_GRACE_S = 60  # beyond the idle timeout: the autoscaler's rounds on a loaded machine
STUDY_TIMEOUT_S = 2400  # a hang guard for the smoke study, not a timing
# A killed node's raylet refuses the GCS's health checks at once: declared dead in about 10 s.
FAST_HEALTH_CHECKS = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 1000,
                      "health_check_timeout_ms": 5000, "health_check_failure_threshold": 10}
FAKE_PROVIDER = {"type": "fake_multinode", "use_node_id_as_ip": True,
                 "disable_node_updaters": True, "disable_launch_config_check": True}

# The driver: `studies.run` with the real fit, held and recorded (HeldFit). Guarded as a main
# module: the benchmark's generator starts its workers with `spawn`, which imports it again.
DRIVER = """
if __name__ == "__main__":
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as `python -m studies.run` does
    import os, sys
    from pathlib import Path
    from studies.pipeline import Backend
    from studies.run import leave, main
    from test_autoscaling import HeldFit
    root = Path(os.environ["ICR_CHAOS_STUDY_DIR"])
    fit = HeldFit(str(root / "calls"), str(root / "gate"), barrier=2)
    leave(main(sys.argv[1:], backend=Backend(fit)))
"""


def fake_cluster_config(port: int) -> dict:
    """cluster.yaml's head (no CPU for trials) and its one-GPU worker type, smaller and fewer,
    for the fake provider (whose head node type is ``ray.head.default``); the fields the
    autoscaler reads without filling in defaults, as `ray up` writes them."""
    source = cluster_yaml()
    types = source["available_node_types"]
    worker = types["worker_gpu1"]
    assert worker["min_workers"] == 0 and worker["resources"]["GPU"] == 1
    return {
        "cluster_name": "icr-fake", "max_workers": 2, "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "provider": {**FAKE_PROVIDER, "gcs_address": f"127.0.0.1:{port}"}, "auth": {},
        "available_node_types": {
            "ray.head.default": {"resources": types[source["head_node_type"]]["resources"],
                                 "node_config": {}, "max_workers": 0},
            "worker_gpu1": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {},
                            "min_workers": 0, "max_workers": 2}},
        "head_node_type": "ray.head.default", "docker": {}, "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": []}


@dataclass(frozen=True)
class HeldFit:
    """The real fit, each call recorded in ``calls``: its trial's folder, its process and the
    raylet it runs under, the resources Ray gave it, whether it resumed, when it started, and
    each epoch it reported with that epoch's training steps (written before Tune has it: Tune
    ends a trial at its last report, and the call never returns from it).

    The first ``barrier`` calls wait until that many have started (they provably ran at once).
    The first call to finish training its last epoch holds before reporting it (``held``)
    until the file ``<gate>/go`` exists: the test takes its node away meanwhile, so the trial is
    lost after its last checkpoint and before its end.
    """

    calls: str
    gate: str
    barrier: int = 0

    def __call__(self, config: Any, reporter: Any, resume_from: Any = None, **kwargs: Any) -> Any:
        import ray

        from icr.train import fit

        calls, gate = Path(self.calls), Path(self.gate)
        calls.mkdir(parents=True, exist_ok=True)
        path = calls / f"{os.getpid()}-{time.time_ns()}.json"
        record = {"start": time.monotonic(), "pid": os.getpid(), "raylet": os.getppid(),
                  "run_dir": str(kwargs.get("run_dir", "")), "resumed": resume_from is not None,
                  "assigned": ray.get_runtime_context().get_assigned_resources(),
                  "epochs": [], "steps": []}
        path.write_text(json.dumps(record))
        deadline = time.monotonic() + 600
        while len(list(calls.glob("*.json"))) < self.barrier and time.monotonic() < deadline:
            time.sleep(0.05)  # waits for the other trial, not for time

        def held(report: Any) -> None:
            record["end"] = time.monotonic()
            if report.final and _claim(gate / "held", str(os.getpid())):
                path.write_text(json.dumps({**record, "held": report.epoch}))
                while not (gate / "go").exists():
                    time.sleep(0.05)  # held by the test, not timed
            record["epochs"].append(report.epoch)
            record["steps"] += [row["step"] for row in report.trajectory]
            path.write_text(json.dumps(record))
            reporter(report)

        return fit(config, held, resume_from, **kwargs)


def _claim(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text`` unless it exists (one process of many wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return True


class Watcher:
    """In a thread: notes every worker raylet the autoscaler starts (under the autoscaler, not
    the head's launcher) and when it was first seen, and takes away the node of the held trial:
    SIGKILL to its raylet and every process under it, as a lost machine loses them; then lets
    the trial go (it is gone)."""

    def __init__(self, head: launcher.LocalInstance, gate: Path) -> None:
        self.head, self.gate = head, gate
        self.workers: dict[int, float] = {}  # worker raylet pid -> first seen (time.monotonic)
        self.gone: dict[int, float] = {}  # worker raylet pid -> first seen gone
        self.lost: dict[str, Any] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def worker_raylets(self) -> list[psutil.Process]:
        found = []
        for proc in processes.family(self.head.marker, self.head.temp_dir):
            try:
                if proc.name() == "raylet" and proc.ppid() != self.head.launcher.pid:
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def note_workers(self) -> None:
        """Each worker raylet seen now, and each seen before that is gone, with when."""
        now, running = time.monotonic(), {r.pid for r in self.worker_raylets()}
        for pid in running:
            self.workers.setdefault(pid, now)
        for pid in set(self.workers) - running:
            self.gone.setdefault(pid, now)

    def run(self) -> None:
        while not self.done.is_set():
            self.note_workers()
            held = self.gate / "held"
            if not self.lost and held.exists() and held.read_text():
                self.take_node_of(int(held.read_text()))
            time.sleep(0.1)  # polls the processes, not a timing

    def take_node_of(self, pid: int) -> None:
        raylet = psutil.Process(pid).parent()
        if raylet.pid not in self.workers:  # the test fails on it; the study goes on
            self.lost = {"pid": pid, "raylet": None, "at": time.monotonic()}
            (self.gate / "go").touch()
            return
        for proc in [raylet, *raylet.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        self.lost = {"pid": pid, "raylet": raylet.pid, "at": time.monotonic()}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.05)  # waits for the process to end, not for time
        (self.gate / "go").touch()

    def wait_for_no_workers(self, timeout: float) -> float | None:
        """Seconds until no worker raylet runs (``None``: some still ran after ``timeout``)."""
        start = time.monotonic()
        while time.monotonic() < start + timeout:
            if not self.worker_raylets():
                return time.monotonic() - start
            time.sleep(0.2)  # waits for the autoscaler, not for time
        return None


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a killed process that its parent has not reaped yet does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
@pytest.mark.timeout(STUDY_TIMEOUT_S + 600)
def test_a_study_grows_an_autoscaling_cluster_survives_a_lost_node_and_lets_it_shrink(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import test_studies_chaos as chaos

    monkeypatch.setattr(chaos, "RUN_TIMEOUT_S", STUDY_TIMEOUT_S)
    port = launcher.free_port()
    config = tmp_path / "autoscaling.yaml"
    config.write_text(yaml.safe_dump(fake_cluster_config(port)))
    gate = tmp_path / "gate"
    head = launcher.start_head(
        num_cpus=0, dashboard=False, system_config=FAST_HEALTH_CHECKS,
        autoscaling=launcher.Autoscaling(config, port, {
            "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "10"}))
    watcher = Watcher(head, gate)
    try:
        watcher.thread.start()
        (tmp_path / "driver.py").write_text(DRIVER)

        class OnTheCluster(chaos.Campaign):
            def command(self) -> list[str]:
                return [*super().command(), "--address", head.address]

        campaign = OnTheCluster(chaos.SMOKE, tmp_path, seed=0)  # ltd_bound --smoke
        run = campaign.run(tmp_path / "records")
        assert run.rc == 0, run.text[-3000:]
        scaled_down = watcher.wait_for_no_workers(60 * IDLE_TIMEOUT_MINUTES + SCALE_DOWN_GRACE_S)
        watcher.done.set()
        watcher.thread.join()
        start_line = next(line for _, line in run.lines if line.startswith("Ray: "))
        started = run.first(lambda line: line.startswith("Ray: "))
        print(start_line)
        assert start_line == (
            f"Ray: 1 node(s), 0 CPUs, 0 GPUs; autoscaling: 0 of up to 2 GPUs now, worker_gpu1 x2 "
            f"(the autoscaler's config {config}); one GPU and 1 CPU(s) per trial; "
            "2 trial(s) at a time")

        # Every planned run in MLflow once, each epoch once, the report whole (the chaos checks).
        chaos.check_instant(campaign, set(), [run], [[]], [], None)

        # Every trial reserved a GPU and ran on a worker the autoscaler added.
        calls = [json.loads(p.read_text()) for p in (tmp_path / "calls").glob("*.json")]
        for call in calls:
            assert call["assigned"] == {"GPU": 1.0, "CPU": 1.0}, call
            assert call["raylet"] in watcher.workers, call
        # The lost trial: its first call reported epoch 1 and was lost before reporting epoch 2;
        # a second call, on another node, continued after epoch 1 and reported epoch 2; each
        # training step in one of them only.
        assert watcher.lost and watcher.lost["raylet"], "no trial was held on a worker node"
        lost = next(c for c in calls if c["pid"] == watcher.lost["pid"])
        resumed = [c for c in calls if _trial(c) == _trial(lost) and c is not lost]
        assert len(resumed) == 1, resumed
        resumed = resumed[0]
        assert (lost["epochs"], lost["held"], resumed["resumed"], resumed["epochs"]) == \
            ([1], 2, True, [2]), (lost, resumed)
        assert lost["steps"] and resumed["steps"] and not set(lost["steps"]) & set(resumed["steps"])
        assert resumed["raylet"] != watcher.lost["raylet"]

        at_once = most_at_once([{**c, "end": c.get("end", watcher.lost["at"])} for c in calls])
        assert at_once == 2
        # The workers go back once idle: the last within the idle timeout of the last trial's end.
        assert scaled_down is not None, "worker nodes still ran after the idle timeout"
        last_end = max(c.get("end", watcher.lost["at"]) for c in calls)
        back = max(watcher.gone.values()) - last_end
        assert back <= 60 * IDLE_TIMEOUT_MINUTES + SCALE_DOWN_GRACE_S, back
        print(f"autoscaling: first worker {min(watcher.workers.values()) - started:.1f} s after "
              f"the start line; {len(watcher.workers)} worker node(s) started; {at_once} trials "
              f"at once; the lost trial resumed on another node "
              f"{resumed['start'] - watcher.lost['at']:.1f} s after its node was lost, after "
              f"epoch 1; the last worker went back {back:.1f} s after the last trial's end "
              f"(idle timeout {60 * IDLE_TIMEOUT_MINUTES:.0f} s); the study took "
              f"{run.ended - run.started:.0f} s")
    finally:
        watcher.done.set()
        launcher.stop_instance(head)
    assert not processes.family(head.marker, head.temp_dir)


def _trial(call: dict) -> str:
    """The Tune trial id of a call, from its working folder (``icr-trial-<id>-...``)."""
    return re.search(r"icr-trial-(\w+?)-", call["run_dir"]).group(1)
