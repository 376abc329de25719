"""One GPU per trial: on a Ray instance with 4 fake GPUs, concurrent trials see distinct GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from studies.catalog import Condition, Study
from studies.pipeline import Backend
from studies.run import main

from fakes import FakeFit, fake_prepare, private_ray


@pytest.fixture(scope="module")
def gpu_cluster():
    with private_ray(num_cpus=4, num_gpus=4) as info:
        yield info


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_concurrent_trials_each_get_one_distinct_gpu(gpu_cluster, tmp_path: Path) -> None:
    assert gpu_cluster.gpus == 4
    resources = gpu_cluster.trial_resources()
    assert resources == {"cpu": 1, "gpu": 1} and gpu_cluster.concurrency(resources) == 4
    (tmp_path / "space.yaml").write_text("space:\n  objective.eta: {uniform: [0.05, 0.3]}\n")
    study = Study(
        name="gpu", description="pinning", space_file=str(tmp_path / "space.yaml"),
        base={"train.warmup_epochs": 1, "train.finetune_epochs": 1},
        conditions=(Condition("lagrangian", "L", {"objective.name": "lagrangian"}),),
        budget=4, seeds=1, grace_period=2,
    )
    records = tmp_path / "records"
    # The barrier holds each trial until all four have started: they provably run at once.
    fit = FakeFit(record_dir=str(records), barrier=4)
    rc = main(["gpu", "--workspace", str(tmp_path / "ws")], backend=Backend(fit, fake_prepare),
              extra_studies={"gpu": study})
    assert rc == 0
    # The 4 search trials (held at the barrier together), then the confirmation run.
    files = sorted(records.glob("*.json"), key=lambda p: int(p.stem.split("-")[1]))
    calls = [json.loads(p.read_text()) for p in files][:4]
    assert len(files) == 5
    devices = [c["cuda_visible_devices"] for c in calls]
    assert all(d is not None and len(d.split(",")) == 1 for d in devices), devices
    assert len(set(devices)) == 4, devices
