"""Several trials per GPU (``--trials-per-gpu N``): each reserves 1/N of a GPU and its share of
the node's cores, trains with as many threads as that share, and N run on each GPU at once,
never more; the start line says whether NVIDIA MPS runs on the node.

The fast tests check the sizing, the setting's sources and the MPS probe; the slow one runs a
study on a private Ray instance given fake GPUs (``num_gpus`` on a CPU machine) and reads
concurrency from the trials' own start and end records.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from icr.errors import UserError
from studies.connection import Cluster, Growth, NodeType, gpu_fraction, mps_state, trials_sharing
from studies.plan import MAX_TRIALS_PER_GPU, TRIALS_PER_GPU_VARIABLE, trials_per_gpu

from fakes import most_at_once, private_ray

ROOT = Path(__file__).resolve().parent.parent


# --- sizing ------------------------------------------------------------------------------------


def one_node(cpus: int, gpus: int) -> Cluster:
    return Cluster("a", None, cpus=cpus, gpus=gpus, nodes=1, started_here=True,
                   shapes=((float(cpus), float(gpus)),))


@pytest.mark.parametrize("trials", range(1, MAX_TRIALS_PER_GPU + 1))
def test_n_fractions_of_a_gpu_fit_on_it_at_ray_precision(trials: int) -> None:
    """Ray counts resources in units of 0.0001: N reservations of 1/N must add up to at most
    one GPU in those units, and N + 1 to more; the fraction names N again (the start line's
    trials per GPU, the trials at once)."""
    units = round(gpu_fraction(trials) * 10_000)
    assert trials * units <= 10_000 < (trials + 1) * units
    assert trials_sharing(gpu_fraction(trials)) == trials
    node = one_node(cpus=16, gpus=2)
    assert node.concurrency(node.trial_resources(trials_per_gpu=trials)) == 2 * trials


def test_a_trial_s_cpus_beyond_every_node_that_can_hold_it_are_refused() -> None:
    """Tune would leave such trials pending without a word (the study would wait forever)."""
    gpu_node = Cluster("a", None, cpus=40, gpus=1, nodes=2, started_here=False,
                       shapes=((8.0, 1.0), (32.0, 0.0)))
    assert gpu_node.trial_resources(cpus_per_trial=8) == {"cpu": 8, "gpu": 1}
    with pytest.raises(UserError, match="^--cpus-per-trial 9: the largest node that can hold a "
                                        "trial has 8 CPUs; give at most 8$"):
        gpu_node.trial_resources(cpus_per_trial=9)  # the 32-core node has no GPU
    growing = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False,
                      growth=Growth("cfg", (NodeType("g", 8, 1, 4), NodeType("g8", 96, 8, 0)), 4))
    with pytest.raises(UserError, match="has 8 CPUs"):  # g8 may not start (max_workers 0)
        growing.trial_resources(cpus_per_trial=16)
    stated = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False,
                     growth=Growth("--gpus", stated_gpus=8))  # no worker known yet: not checked
    assert stated.trial_resources(cpus_per_trial=16) == {"cpu": 16, "gpu": 1}


def test_the_cpu_share_comes_from_the_gpu_nodes_the_study_can_reach() -> None:
    growing = Cluster("a", None, cpus=0, gpus=0, nodes=1, started_here=False,
                      growth=Growth("cfg", (NodeType("g8", 4, 8, 0), NodeType("g", 8, 1, 4)), 4))
    assert growing.trial_resources() == {"cpu": 8, "gpu": 1}  # not g8's half core per GPU


def test_a_trial_reserves_its_share_of_a_gpu_and_of_the_nodes_cores() -> None:
    node = one_node(cpus=16, gpus=1)
    assert node.trial_resources() == {"cpu": 8, "gpu": 1}  # at most 8 cores a trial
    assert node.trial_resources(trials_per_gpu=2) == {"cpu": 8, "gpu": 0.5}
    assert node.trial_resources(trials_per_gpu=4) == {"cpu": 4, "gpu": 0.25}
    assert node.concurrency(node.trial_resources(trials_per_gpu=4)) == 4
    assert node.trial_resources(cpus_per_trial=3, trials_per_gpu=4) == {"cpu": 3, "gpu": 0.25}
    small = one_node(cpus=2, gpus=1)  # fewer cores than trials: hundredths of a core each
    assert small.trial_resources(trials_per_gpu=3) == {"cpu": 0.66, "gpu": 0.3333}
    assert small.concurrency(small.trial_resources(trials_per_gpu=3)) == 3
    eight = one_node(cpus=16, gpus=8)
    assert eight.trial_resources(trials_per_gpu=4) == {"cpu": 0.5, "gpu": 0.25}
    assert eight.concurrency(eight.trial_resources(trials_per_gpu=4)) == 32
    # The share is the node's, not the cluster's: a 4-core 1-GPU node beside a 60-core CPU node.
    mixed = Cluster("a", None, cpus=64, gpus=1, nodes=2, started_here=False,
                    shapes=((4.0, 1.0), (60.0, 0.0)))
    assert mixed.trial_resources(trials_per_gpu=2) == {"cpu": 2, "gpu": 0.5}
    cpu_only = one_node(cpus=4, gpus=0)  # no GPU: the setting changes nothing
    assert cpu_only.trial_resources(trials_per_gpu=4) == {"cpu": 1}


def test_the_start_line_says_the_share_and_mps() -> None:
    node = Cluster("a", None, cpus=16, gpus=2, nodes=1, started_here=True,
                   shapes=((16.0, 2.0),), mps="not running")
    line = node.describe(node.trial_resources(trials_per_gpu=4))
    assert line == ("Ray: 1 node(s), 16 CPUs, 2 GPUs; 1/4 of a GPU (4 trials per GPU) and 2 CPU(s) "
                    "per trial; 8 trial(s) at a time; MPS: not running (the trials time-share "
                    "each GPU; docs/gpu.md says how to start it)")
    assert node.describe(node.trial_resources()).endswith("; 2 trial(s) at a time; MPS: not running")


def test_the_estimate_counts_one_trial_per_gpu_and_says_when_the_study_shares_them() -> None:
    """--plan's step time is one trial's alone: trials sharing a GPU are not sped up by it."""
    from studies.estimate import trials_at_once

    shared = SimpleNamespace(trials_per_gpu=4, cpus_per_trial=None)
    assert trials_at_once(shared, gpus=8) == (
        8, "a cluster of 8 GPU(s): one trial per GPU (the study runs 4 per GPU; their shared "
           "speed is not calibrated)")
    alone = SimpleNamespace(trials_per_gpu=1, cpus_per_trial=None)
    assert trials_at_once(alone, gpus=8) == (8, "a cluster of 8 GPU(s): one trial per GPU")


def test_gpus_below_what_the_cluster_has_is_said_as_such() -> None:
    big = Cluster("a", None, cpus=64, gpus=8, nodes=2, started_here=False,
                  shapes=((32.0, 4.0), (32.0, 4.0)), growth=Growth("--gpus", stated_gpus=4))
    assert big.describe(big.trial_resources()) == (
        "Ray: 2 node(s), 64 CPUs, 8 GPUs; 8 GPUs now, sized for 4 (--gpus); one GPU and 8 CPU(s) "
        "per trial; 4 trial(s) at a time")


def test_trials_per_gpu_comes_from_the_flag_else_the_machines_setting() -> None:
    assert trials_per_gpu(None, {}) == 1
    assert trials_per_gpu(None, {TRIALS_PER_GPU_VARIABLE: "4"}) == 4
    assert trials_per_gpu(2, {TRIALS_PER_GPU_VARIABLE: "4"}) == 2
    for bad in ("0", "two", "1.5", "-1"):
        with pytest.raises(UserError, match=f"^{TRIALS_PER_GPU_VARIABLE}={bad}: give a whole"):
            trials_per_gpu(None, {TRIALS_PER_GPU_VARIABLE: bad})
    for bad in (0, MAX_TRIALS_PER_GPU + 1):
        with pytest.raises(UserError, match=f"^--trials-per-gpu {bad}: give 1 to 64 trials"):
            trials_per_gpu(bad, {})
    with pytest.raises(UserError, match=f"^{TRIALS_PER_GPU_VARIABLE}=65: give a whole"):
        trials_per_gpu(None, {TRIALS_PER_GPU_VARIABLE: "65"})


def test_a_bad_trials_per_gpu_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    env = {**os.environ, TRIALS_PER_GPU_VARIABLE: "many"}
    for args, extra, expected in (
        (["--trials-per-gpu", "0"], {}, "error: --trials-per-gpu 0: give 1 to 64 trials per GPU"),
        ([], env, f"error: {TRIALS_PER_GPU_VARIABLE}=many: give a whole number of trials per GPU"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "studies.run", "ltd_bound", "--smoke", "--workspace",
             str(tmp_path / "ws"), *args], cwd=ROOT, env=extra or None, capture_output=True,
            text=True, timeout=300)
        assert result.returncode == 2 and result.stderr.startswith(expected), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ws").exists()  # nothing written


# --- MPS ---------------------------------------------------------------------------------------


def test_mps_is_seen_by_its_daemon_or_its_pid_file(tmp_path: Path) -> None:
    """What the control daemon leaves (seen on an H200 machine): its process, and its pid file
    in the pipe folder while it runs; its ``control`` socket stays after it quits."""
    pipe_dir = tmp_path / "mps"
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    assert mps_state(environ) == "not running"
    pipe_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as control:  # what a daemon that quit leaves
        control.bind(str(pipe_dir / "control"))
        assert mps_state(environ) == "not running"
    (pipe_dir / "nvidia-cuda-mps-control.pid").write_text("548")  # a daemon elsewhere
    assert mps_state(environ) == \
        f"running (control daemon's pid file {pipe_dir / 'nvidia-cuda-mps-control.pid'})"
    # The daemon's process, its pipe folder elsewhere.
    daemon = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep"), daemon)
    proc = subprocess.Popen([str(daemon), "60"])
    try:
        state = mps_state({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "elsewhere")})
        assert state == f"running (control daemon pid {proc.pid})", state
    finally:
        proc.kill()
        proc.wait()


# --- N trials per (fake) GPU at once, never more -----------------------------------------------


@dataclass(frozen=True)
class TimedFit:
    """A fit that records, in ``folder``, when each call started and when it reported its last
    epoch (``time.monotonic``: one clock for every process of the machine), the GPU and CPUs
    Ray gave its trial and the threads torch trains with.

    A trial's work ends with its last report (Tune ends a stopped or finished trial there,
    without returning from ``fit``), and its reservation after it: each recorded interval lies
    inside the time its trial held its share of a GPU.
    """

    inner: Any
    folder: str

    def __call__(self, config: Any, reporter: Any = None, resume_from: Any = None,
                 **kwargs: Any) -> Any:
        import ray
        import torch

        path = Path(self.folder) / f"{os.getpid()}-{time.time_ns()}.json"
        record = {"start": time.monotonic(), "threads": torch.get_num_threads(),
                  "assigned": ray.get_runtime_context().get_assigned_resources(),
                  "device": os.environ.get("CUDA_VISIBLE_DEVICES")}
        path.write_text(json.dumps(record))

        def timed(report: Any) -> None:
            path.write_text(json.dumps({**record, "end": time.monotonic()}))
            reporter(report)

        return self.inner(config, timed, resume_from, **kwargs)


@pytest.fixture(scope="module")
def fake_gpu_cluster():
    with private_ray(num_cpus=8, num_gpus=2) as info:
        yield info


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_n_trials_run_on_each_fake_gpu_at_once_and_never_more(fake_gpu_cluster, tmp_path: Path,
                                                              capsys) -> None:
    from studies.catalog import Condition, Study
    from studies.pipeline import Backend
    from studies.run import main

    from fakes import FakeFit, fake_prepare

    gpus, per_gpu = 2, 2
    (tmp_path / "space.yaml").write_text("space:\n  objective.eta: {uniform: [0.05, 0.3]}\n")
    study = Study(name="shared", description="trials per GPU", space_file=str(tmp_path / "space.yaml"),
                  base={"train.warmup_epochs": 1, "train.finetune_epochs": 1},
                  conditions=(Condition("lagrangian", "L", {"objective.name": "lagrangian"}),),
                  budget=3 * gpus * per_gpu, seeds=1, grace_period=2)
    timed = tmp_path / "timed"
    timed.mkdir()
    # The barrier holds the first trials until gpus * per_gpu have started: they provably ran
    # at once. Each trial then works for two epochs of 0.5 s, so that a trial started beside
    # them beyond the limit would be seen running with them.
    fit = TimedFit(FakeFit(epoch_seconds=0.5, record_dir=str(tmp_path / "records"),
                           barrier=gpus * per_gpu), str(timed))
    rc = main(["shared", "--workspace", str(tmp_path / "ws"), "--trials-per-gpu", str(per_gpu)],
              backend=Backend(fit, fake_prepare), extra_studies={"shared": study})
    out = capsys.readouterr().out
    assert rc == 0, out
    start = next(line for line in out.splitlines() if line.startswith("Ray: "))
    print(start)
    assert start == ("Ray: 1 node(s), 8 CPUs, 2 GPUs; 1/2 of a GPU (2 trials per GPU) and 2 CPU(s) "
                     "per trial; 4 trial(s) at a time; MPS: not running (the trials time-share "
                     "each GPU; docs/gpu.md says how to start it)"), start
    calls = [json.loads(p.read_text()) for p in timed.glob("*.json")]
    assert len(calls) == 3 * gpus * per_gpu + 1  # the search trials and one confirmation run
    assert all("end" in c for c in calls)
    assert all(c["assigned"] == {"GPU": 0.5, "CPU": 2.0} and c["threads"] == 2 for c in calls), calls
    assert {c["device"] for c in calls} == {"0", "1"}
    assert most_at_once(calls) == gpus * per_gpu
    for device in ("0", "1"):
        assert most_at_once([c for c in calls if c["device"] == device]) == per_gpu, device
