"""The report's ensemble row: a condition's runs evaluated as one model, logged as an MLflow run."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from icr.config import from_flat
from icr.metrics import retrieval_metrics
from icr.train import fit, load_run
from studies.ensembles import ensemble_of, ray_evaluator
from studies.runs import RunSet
from studies.tracking import Tracker, checkpoint_location

TINY = {"data.preset": "tiny", "model.embed_dim": 16, "text.hidden_dim": 16,
        "train.batch_size": 16, "train.warmup_epochs": 1, "train.finetune_epochs": 0,
        "train.swa_bn_batches": 2, "eval.batch_size": 64}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in-process", "ray task"])
def test_an_ensemble_averages_its_members_similarities(workspace, tmp_path, monkeypatch, where):
    """In-process (a rebuilt report) and as the Ray task a study runs, reading its members'
    checkpoints through Tune's Checkpoint (here from file:// URIs, as it reads s3:// ones)."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    rows = []
    for seed in (1000, 1001):
        result = fit(from_flat({**TINY, "train.seed": seed}), workspace=workspace,
                     run_dir=tmp_path / f"run{seed}")
        rows.append({"run_id": f"r{seed}", "phase": "confirm", "status": "FINISHED",
                     "condition": "bl", "seed": seed,
                     "checkpoint": Path(result.checkpoint_dir).resolve().as_uri()})
    runs = RunSet(pd.DataFrame(rows), lambda run_id, key: ([], []))
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", tmp_path / "artifacts")
    parent = tracker.create_run("parent", {})
    if where == "ray task":
        from studies import connection

        cluster = connection.connect(num_cpus=1, dashboard=False)
        try:
            metrics = ensemble_of(runs, "bl", tracker, parent, workspace,
                                  ray_evaluator(str(tmp_path / "ray"), cluster.gpus))
        finally:
            connection.disconnect(cluster)
    else:
        metrics = ensemble_of(runs, "bl", tracker, parent, workspace)

    # By hand: each member's test similarities, averaged, scored.
    members = [load_run(tmp_path / f"run{seed}" / "checkpoint", workspace=workspace)
               for seed in (1000, 1001)]
    sims = torch.stack([img @ cap.t() for img, cap in (m.embed_split("test") for m in members)])
    data = members[0].data
    assets = data.eval_assets["test"]
    expected = retrieval_metrics(sims.mean(0), torch.as_tensor(data.splits["test"].caption_image),
                                 relevance=assets.relevance, extended_i2t=assets.extended_i2t,
                                 extended_t2i=assets.extended_t2i)
    assert metrics == pytest.approx(expected, rel=1e-6, abs=1e-6)

    (logged,) = tracker.find_runs("tags.phase = 'ensemble'")
    assert logged.data.tags["members"] == "r1000,r1001"
    assert logged.data.metrics["test_rsum"] == pytest.approx(expected["rsum"])
    # A rebuilt report finds the ensemble run instead of logging a second one.
    done = pd.DataFrame([{"run_id": logged.info.run_id, "phase": "ensemble", "status": "FINISHED",
                          "condition": "bl", "test_rsum": expected["rsum"]}])
    again = ensemble_of(RunSet(pd.concat([runs.frame, done]), runs.read_history), "bl", tracker,
                        parent, workspace)
    assert again == {"rsum": pytest.approx(expected["rsum"])}
    assert len(tracker.find_runs("tags.phase = 'ensemble'")) == 1


def test_a_checkpoint_on_remote_storage_is_tagged_with_its_uri() -> None:
    """What the ensembles and analyses read back: a folder on a local or shared disk, else a
    URI any node can open (pyarrow's S3 and GCS file systems give paths without a scheme)."""
    from types import SimpleNamespace

    def checkpoint(kind: str, path: str) -> SimpleNamespace:
        return SimpleNamespace(filesystem=SimpleNamespace(type_name=kind), path=path)

    assert checkpoint_location(checkpoint("local", "/ws/ray/c/checkpoint_000003")) == \
        "/ws/ray/c/checkpoint_000003"
    assert checkpoint_location(checkpoint("s3", "bucket/icr/c/checkpoint_000003")) == \
        "s3://bucket/icr/c/checkpoint_000003"
    assert checkpoint_location(checkpoint("gcs", "bucket/c")) == "gcs://bucket/c"
