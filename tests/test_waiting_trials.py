"""A trial that waits to start for longer than a few minutes is named in the status line with
what it waits for: the resources it asks, what the cluster has, the autoscaler's pending nodes.

A fake clock for the line itself; a private Ray instance with one fake GPU for the trial that
asks for two (the threshold set low there: the test waits for the line, never for a time).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from studies.frameworks.ray import pending_in_report
from studies.progress import DONE, RUNNING, WAITING, Progress, TrialView, describe_wait
from studies.trials import KEY, TrialSpec
from studies.tuning import ProgressCallback


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def view(trial_id: str, state: str) -> TrialView:
    return TrialView(trial_id, state, label=f"trial {trial_id} [lagrangian eta=0.1]")


def test_a_trial_is_named_once_it_has_waited_past_the_threshold() -> None:
    clock, asked = Clock(), []
    progress = Progress("search lagrangian", expected=3, max_epochs=2, metric="val_rsum",
                        clock=clock, named_after=180.0)

    def waits_for() -> str:
        asked.append(clock.now)
        return "GPU 1 each; the cluster has GPU 0; no autoscaler adds nodes to it"

    trials = [view("a", RUNNING), view("b", WAITING), view("c", WAITING)]
    assert "waiting" not in progress.line(trials, waits_for)  # b and c seen waiting from now
    clock.now += 179.0
    assert "waiting" not in progress.line(trials, waits_for) and asked == []  # not asked yet
    clock.now += 1.0
    line = progress.line(trials, waits_for)
    assert line.endswith("; waiting 3m00s: trial b [lagrangian eta=0.1], trial c [lagrangian "
                         "eta=0.1] for GPU 1 each; the cluster has GPU 0; no autoscaler adds "
                         "nodes to it")
    # b starts and ends, c still waits; a new trial d is timed from the line that first saw it
    clock.now += 60.0
    trials = [view("a", RUNNING), view("b", DONE), view("c", WAITING), view("d", WAITING)]
    line = progress.line(trials, waits_for)
    assert "; waiting 4m00s: trial c [lagrangian eta=0.1] for GPU 1" in line and "trial d" not in line
    clock.now += 180.0
    assert "waiting 7m00s: trial c [lagrangian eta=0.1], trial d " in progress.line(trials, waits_for)


def test_many_waiting_trials_are_named_three_and_counted() -> None:
    clock = Clock()
    progress = Progress("confirm", expected=6, max_epochs=2, metric="val_rsum", clock=clock,
                        named_after=1.0)
    trials = [view(str(i), WAITING) for i in range(5)]
    progress.line(trials)
    clock.now += 1.0
    line = progress.line(trials)
    assert line.endswith("; waiting 0m01s: trial 0 [lagrangian eta=0.1], trial 1 [lagrangian "
                         "eta=0.1], trial 2 [lagrangian eta=0.1] and 2 more")


def test_what_trials_wait_for_names_the_resources_asked_held_and_pending() -> None:
    assert describe_wait({"CPU": 1, "GPU": 1, "memory": 0}, {"CPU": 2.0, "memory": 5e9},
                         {"CPU": 2.0}, ["worker_gpu", "worker_gpu", "worker_big"]) == (
        "CPU 1, GPU 1 each; the cluster has CPU 2 (2 free), GPU 0; its autoscaler is adding "
        "worker_gpu x2, worker_big x1")
    assert describe_wait({"CPU": 2, "GPU": 0.5}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 6.0}, []) == (
        "CPU 2, GPU 0.5 each; the cluster has CPU 8 (6 free), GPU 1 (0 free); its autoscaler is "
        "adding no node")


def test_the_pending_nodes_of_an_autoscaler_v1_report() -> None:
    """``ray status``'s "Pending" of a v1 report: launches requested, nodes not joined yet (the
    fake autoscaler that lost both GPU workers kept them here)."""
    report = {"pending_launches": {"worker_gpu": 2}, "active_nodes": {"head": 1},
              "pending_nodes": [["127.0.0.5", "worker_cpu", "waiting-for-ssh"]]}
    assert pending_in_report(report) == ["worker_gpu", "worker_gpu", "worker_cpu"]
    assert pending_in_report({}) == []


def hold(config: dict) -> None:
    """A trainable that never needs to run: the trial asks for more GPUs than the cluster has."""
    raise AssertionError("a trial that asked for 2 GPUs on a 1-GPU cluster started")


class Seen(Exception):
    """The line the test waited for came: it ends the Tuner (raised from a Tune callback)."""


def test_a_trial_asking_for_a_gpu_the_cluster_lacks_is_named_with_what_it_waits_for(
        tmp_path: Path) -> None:
    from ray import tune

    from fakes import private_ray

    lines: list[tuple[float, str]] = []

    def say(line: str) -> None:
        lines.append((time.monotonic(), line))
        if "waiting" in line:
            raise Seen(line)

    spec = TrialSpec.resolve("lagrangian", {}, {"objective.eta": 0.1})
    asked = {"CPU": 1, "GPU": 2}
    progress = Progress("search lagrangian", 1, 2, "val_rsum", named_after=1.0)
    callback = ProgressCallback(progress, say=say, interval=0.25, resources=asked)
    with private_ray(num_cpus=1, num_gpus=1):
        tuner = tune.Tuner(
            tune.with_resources(hold, asked), param_space={KEY: spec},
            run_config=tune.RunConfig(storage_path=str(tmp_path), name="waits",
                                      callbacks=[callback], verbose=0))
        with pytest.raises(Seen):
            tuner.fit()
    (first, _), (named, line) = lines[0], lines[-1]
    print(f"named {named - first:.2f} s after the first status line ({len(lines)} lines)")
    assert line.startswith("search lagrangian: 0 done, 0 running, 1 left; "), line
    assert re.search(r"; waiting \dm\d\ds: trial \w+ \[lagrangian eta=0.1\] for CPU 1, GPU 2 "
                     r"each; the cluster has CPU 1 \(1 free\), GPU 1 \(1 free\); its autoscaler "
                     r"is adding no node$", line), line  # `ray start --head` runs one, with no node types
