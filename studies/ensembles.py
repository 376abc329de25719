"""Ensembles in the report step: a condition's confirmation runs evaluated as one model.

VSE-infinity and VSE+2AD report ensembles that average the similarity matrices of several trained
models (docs/reference-code.md section 3). Here the members are a condition's finished confirmation runs
(their seeds): each best checkpoint embeds the test split, the matrices are averaged
(:func:`icr.ensemble.average_similarity`) and scored with every retrieval metric under the test
split's protocols (:func:`icr.train.evaluation.split_metrics`), and the result is
logged as its own MLflow child run (phase ``ensemble``) whose tags name its members, so the
table's ensemble row is traceable like every other.

The members' checkpoints are read where Tune keeps them (the ``checkpoint`` tag of each run: a
local folder, or an ``s3://`` / ``gs://`` URI) through Tune's ``Checkpoint``, which downloads a
remote one. A study running on Ray evaluates its ensemble as a Ray task
(:func:`ray_evaluator`): on the driver's node when the checkpoints are on its disk, anywhere in
the cluster (on a GPU when it has GPUs) when they are on shared storage. A report rebuilt without
Ray (``python -m studies.report``) evaluates it in-process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path

import ray
from ray import tune
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from icr.workspace import Workspace
from studies.runs import RunSet
from studies.tracking import PARENT_TAG, Tracker

# Evaluates the members (their checkpoints' locations) in a workspace: test metrics.
Evaluator = Callable[[Sequence[str], str], dict[str, float]]


def evaluate_members(checkpoints: Sequence[str], workspace: str) -> dict[str, float]:
    """The test metrics of the models at ``checkpoints`` as one ensemble (their test similarity
    matrices averaged), each read through Tune's ``Checkpoint`` (a remote one is downloaded)."""
    import torch  # lazy: keeps torch off python -m studies.report (this runs in a Ray task)

    from icr.ensemble import average_similarity  # lazy: keeps torch off python -m studies.report
    from icr.train import load_run  # lazy: keeps torch off python -m studies.report
    from icr.train.evaluation import split_metrics  # lazy: keeps torch off studies.report

    root = Workspace.resolve(workspace)
    embeddings, task = [], None
    for location in checkpoints:
        with contextlib.ExitStack() as stack:
            folder = stack.enter_context(tune.Checkpoint(location).as_directory())
            task = load_run(Path(folder), workspace=root)
            with torch.no_grad():
                embeddings.append(task.embed_split("test"))
    return split_metrics(average_similarity(embeddings), task.data, "test")  # COCO: 5K and 1K


def ray_evaluator(storage: str, gpus: int) -> Evaluator:
    """:func:`evaluate_members` as a Ray task, with one GPU when the cluster has GPUs. Tune
    storage on a local path (``storage``) puts it on the driver's node when that node can run it
    (the path is on its disk; on a multi-host cluster it is a shared file system that every node
    mounts, :func:`studies.storage.check_storage`); on S3 or GCS Ray places it anywhere."""
    options: dict = {"num_cpus": 1, "num_gpus": 1 if gpus else 0}
    if "://" not in storage:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=True)
    task = ray.remote(evaluate_members).options(**options)

    def evaluate(checkpoints: Sequence[str], workspace: str) -> dict[str, float]:
        return ray.get(task.remote(list(checkpoints), workspace))

    return evaluate


def ensemble_of(
    runs: RunSet, condition: str, tracker: Tracker, parent_id: str, workspace: Workspace,
    evaluate: Evaluator = evaluate_members,
) -> dict[str, float] | None:
    """The test metrics of ``condition``'s confirmation runs as one ensemble (logged once)."""
    done = runs.where(phase="ensemble", condition=condition, status="FINISHED")
    if not done.empty:  # a rebuilt report reuses the ensemble run
        return {k[5:]: v for k, v in done.iloc[0].items() if str(k).startswith("test_")}
    members = runs.where(phase="confirm", status="FINISHED", condition=condition)
    checkpoints = [p for p in members.get("checkpoint", []) if isinstance(p, str) and p]
    if len(checkpoints) < 2:
        return None
    metrics = evaluate(checkpoints, str(workspace.root))
    tags = {PARENT_TAG: parent_id, "phase": "ensemble", "condition": condition,
            "icr.role": "ensemble", "members": ",".join(members["run_id"]),
            "member_seeds": ",".join(str(s) for s in members["seed"])}
    run_id = tracker.create_run(f"{condition} ensemble of {len(checkpoints)}", tags)
    tracker.log_metrics(run_id, {f"test_{k}": v for k, v in metrics.items()}, step=0)
    tracker.finish(run_id)
    return metrics
