"""The report's ensemble row: a condition's runs evaluated as one model, logged as an MLflow run."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from icr.config import from_flat
from icr.metrics import retrieval_metrics
from icr.train import fit, load_run
from studies.ensembles import ensemble_of
from studies.runs import RunSet
from studies.tracking import Tracker

TINY = {"data.preset": "tiny", "model.embed_dim": 16, "text.hidden_dim": 16,
        "train.batch_size": 16, "train.warmup_epochs": 1, "train.finetune_epochs": 0,
        "train.swa_bn_batches": 2, "eval.batch_size": 64}


@pytest.mark.slow
def test_an_ensemble_averages_its_members_similarities(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    rows = []
    for seed in (1000, 1001):
        result = fit(from_flat({**TINY, "train.seed": seed}), workspace=workspace,
                     run_dir=tmp_path / f"run{seed}")
        rows.append({"run_id": f"r{seed}", "phase": "confirm", "status": "FINISHED",
                     "condition": "bl", "seed": seed, "checkpoint": str(result.checkpoint_dir)})
    runs = RunSet(pd.DataFrame(rows), lambda run_id, key: ([], []))
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "t", tmp_path / "artifacts")
    parent = tracker.create_run("parent", {})
    metrics = ensemble_of(runs, "bl", tracker, parent, workspace)

    # By hand: each member's test similarities, averaged, scored.
    members = [load_run(row["checkpoint"], workspace=workspace) for row in rows]
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
