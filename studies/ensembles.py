"""Ensembles in the report step: a condition's confirmation runs evaluated as one model.

VSE-infinity and VSE+2AD report ensembles that average the similarity matrices of several trained
models (REFERENCE_NOTES section 3). Here the members are a condition's finished confirmation runs
(their seeds): each best checkpoint embeds the test split, the matrices are averaged
(:func:`icr.ensemble.evaluate_ensemble`) and scored with every retrieval metric, and the result is
logged as its own MLflow child run (phase ``ensemble``) whose tags name its members, so the
table's ensemble row is traceable like every other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from icr.ensemble import evaluate_ensemble
from icr.train import load_run
from icr.workspace import Workspace
from studies.runs import RunSet
from studies.tracking import PARENT_TAG, Tracker


def ensemble_of(
    runs: RunSet, condition: str, tracker: Tracker, parent_id: str, workspace: Workspace,
) -> dict[str, float] | None:
    """The test metrics of ``condition``'s confirmation runs as one ensemble (logged once)."""
    done = runs.where(phase="ensemble", condition=condition, status="FINISHED")
    if not done.empty:  # a rebuilt report reuses the ensemble run
        return {k[5:]: v for k, v in done.iloc[0].items() if str(k).startswith("test_")}
    members = runs.where(phase="confirm", status="FINISHED", condition=condition)
    paths = [Path(p) for p in members.get("checkpoint", []) if isinstance(p, str) and p]
    if len(paths) < 2 or not all(p.is_dir() for p in paths):
        return None  # fewer than two members, or checkpoints on remote storage
    tasks = [load_run(path, workspace=workspace) for path in paths]
    with torch.no_grad():
        embeddings = [task.embed_split("test") for task in tasks]
    data = tasks[0].data
    assets = data.eval_assets["test"]
    metrics = evaluate_ensemble(
        embeddings, torch.as_tensor(data.splits["test"].caption_image),
        relevance=assets.relevance, extended_i2t=assets.extended_i2t,
        extended_t2i=assets.extended_t2i,
    )
    tags = {PARENT_TAG: parent_id, "phase": "ensemble", "condition": condition,
            "icr.role": "ensemble", "members": ",".join(members["run_id"]),
            "member_seeds": ",".join(str(s) for s in members["seed"])}
    run_id = tracker.create_run(f"{condition} ensemble of {len(paths)}", tags)
    tracker.log_metrics(run_id, {f"test_{k}": v for k, v in metrics.items()}, step=0)
    tracker.finish(run_id)
    return metrics
