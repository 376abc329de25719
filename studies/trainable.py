"""The Ray Tune trainable: the only module where Ray meets ``icr``.

A trial's Tune config is small and flat: ``condition`` (the row of the table it belongs to) and the
dotted keys that the searcher sampled (or, for confirmation runs, ``train.seed``). Everything else
the trial needs travels once, through the object store, as a :class:`TrialJob`: the validated flat
overrides of each condition and the workspace. The trainable builds the ``ExperimentConfig`` once,
calls ``fit`` with a reporter that forwards each :class:`~icr.train.EpochReport` to
``ray.tune.report`` with its checkpoint, and resumes after a failure or a restored study.

A reported epoch is a checkpointed epoch. Tune saves its experiment state (each trial's last
checkpoint) in the background, so a driver killed at the wrong moment leaves a state that lags
what the driver had recorded: restored from it, a trial would train again an epoch that MLflow
holds, and go on from another model. So the driver marks each checkpoint with the result it
came with before recording that result (:class:`MarkReported`), and a trial continues after the
newest marked checkpoint of its folder (:func:`resume_point`), never older than Tune's own:
every epoch MLflow holds is one a restored trial continues after, and the record matches the run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune

from icr.config import ExperimentConfig, Scalar, from_flat, to_flat, used_keys
from icr.train.seam import EpochReport
from icr.workspace import Workspace
from studies import ray_adapter

FitFn = Callable[..., Any]  # the signature of icr.train.fit


@dataclass(frozen=True)
class TrialJob:
    """What every trial of one Tuner shares: the study, the phase and each condition's overrides."""

    study: str
    phase: str  # "search" or "confirm"
    workspace: str
    conditions: Mapping[str, Mapping[str, Scalar]]  # condition -> flat overrides (validated)
    chosen: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict)  # winners' values
    experiment: str = ""  # where Tune keeps the experiment (its trials' folders)

    def config(self, trial_config: Mapping[str, Any]) -> ExperimentConfig:
        """The trial's config: the condition's overrides, then its own (sampled) dotted keys."""
        own = {k: v for k, v in trial_config.items() if "." in k}
        return from_flat({**self.conditions[trial_config["condition"]], **own})

    def params(self, trial_config: Mapping[str, Any]) -> dict[str, Scalar]:
        """The keys the trial's configuration uses, with their values: what MLflow records."""
        config = self.config(trial_config)
        flat = to_flat(config)
        return {key: flat[key] for key in used_keys(config)}

    def shown(self, trial_config: Mapping[str, Any]) -> dict[str, Scalar]:
        """What tells the trial apart in its run's name: the condition's chosen values (a
        confirmation run's winner) and the trial's own (sampled values, seed)."""
        own = {k: v for k, v in trial_config.items() if "." in k}
        return {**self.chosen.get(trial_config["condition"], {}), **own}

    def seed(self, trial_config: Mapping[str, Any]) -> int:
        return int(trial_config.get("train.seed",
                                    self.conditions[trial_config["condition"]].get("train.seed", 0)))


def tune_record(report: EpochReport) -> dict[str, Any]:
    """An :class:`EpochReport` as a Tune result (its metrics at the top, for ASHA and Optuna)."""
    return {**report.metrics, "trajectory": list(report.trajectory),
            "artifacts": list(report.artifacts), "final": report.final}


def default_fit() -> FitFn:
    from icr.train import fit

    return fit


def run_trial(trial_config: dict[str, Any], *, job: TrialJob, fit: FitFn | None = None) -> None:
    """Train one trial; Tune calls this in a worker process."""
    fit = fit or default_fit()
    config = job.config(trial_config)
    _use_assigned_cpus()

    def reporter(report: EpochReport) -> None:
        checkpoint = tune.Checkpoint.from_directory(report.checkpoint) if report.checkpoint else None
        tune.report(tune_record(report), checkpoint=checkpoint)

    # fit's working folder stays out of Tune's trial folder, which Tune syncs to storage while
    # fit rewrites its checkpoint; Tune copies each reported checkpoint itself.
    trial_id = tune.get_context().get_trial_id()
    with tempfile.TemporaryDirectory(prefix=f"icr-trial-{trial_id}-") as run_dir:
        kwargs = {"workspace": Workspace.resolve(job.workspace), "run_dir": Path(run_dir)}
        resume_from, ended = resume_point(job, Path(run_dir) / "resume")
        if not ended:
            fit(config, reporter, resume_from, **kwargs)


def resume_point(job: TrialJob, local: Path) -> tuple[Path | None, bool]:
    """Where this trial continues, and whether it had ended there (its last epoch).

    Returns a local copy of the trial's newest marked checkpoint (of Tune's own when none is
    marked: a study started before marks), or ``None`` to start from scratch. A marked
    checkpoint newer than Tune's is one Tune's saved state lost: it is reported again with the
    result it was marked with (a copy, which Tune persists and registers, and the driver marks
    and records where it had not), then the marks of the trial's other checkpoints are removed,
    since Tune writes its next checkpoints into folders of its own numbering, theirs included.
    """
    registered = tune.get_checkpoint()
    marked = ray_adapter.marked_checkpoints(ray_adapter.trial_folder(job.experiment)) \
        if job.experiment else []
    newest = max(marked, key=lambda pair: pair[1]["epoch"], default=None)
    if newest is None or (registered is not None and _same(registered, newest[0])):
        if registered is None:
            return None, False
        registered.to_directory(str(local))
        return local, bool(newest and newest[1].get("final"))
    checkpoint, record = newest
    checkpoint.to_directory(str(local))
    copy = tune.Checkpoint.from_directory(str(local))
    copy.set_metadata({})  # unmarked until the driver marks the folder Tune copies it into
    tune.report(dict(record), checkpoint=copy)
    persisted = tune.get_checkpoint()  # where Tune put the copy
    for other, _ in marked:
        if persisted is None or not _same(other, persisted):
            ray_adapter.unmark(other)
    return local, bool(record.get("final"))


def _same(a: tune.Checkpoint, b: tune.Checkpoint) -> bool:
    return a.path.rstrip("/") == b.path.rstrip("/")


class MarkReported(tune.Callback):
    """Marks each checkpoint a trial reports with the result it came with. It must come before
    the MLflow callback, which records a result that came with a checkpoint only after this
    (see the module docstring)."""

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
        result = trial.last_result or {}
        if "epoch" in result:
            ray_adapter.mark(checkpoint, result)


def _use_assigned_cpus() -> None:
    """Let torch use the CPUs Ray reserved for the trial (Ray sets OMP_NUM_THREADS to them)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    import torch

    torch.set_num_threads(max(1, int(cpus or torch.get_num_threads())))
