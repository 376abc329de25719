"""The Ray Tune trainable: the only module where Ray meets ``icr``.

A trial's Tune config is one object, its :class:`~studies.trials.TrialSpec` (key ``trial``):
the config it trains, resolved once on the driver. What every trial of a Tuner shares (the
workspace, where Tune keeps the experiment) travels once through the object store as a
:class:`TrialJob`. The trainable calls ``fit`` with the spec's config and a reporter that
forwards each :class:`~icr.train.EpochReport` to ``ray.tune.report`` with its checkpoint, and
resumes after a failure or a restored study.

A reported epoch is a checkpointed epoch. Tune saves its experiment state (each trial's last
checkpoint) in the background, so a driver killed at the wrong moment leaves a state that lags
what the driver had recorded: restored from it, a trial would train again an epoch that MLflow
holds and go on from another model, or (one checkpoint kept) fail, its saved checkpoint deleted
since. So each checkpoint carries the result it came with (its *mark*), written by the trial into
the checkpoint before Tune copies it to storage, with the size of every file, so that a copy cut
short by a kill is not taken for one (:mod:`studies.marks`); the driver records the result
only once its checkpoint carries it (:meth:`studies.tracking.MlflowTrialCallback.on_checkpoint`,
which marks a checkpoint that came without a mark); and a trial continues after
the newest whole marked checkpoint of its folder (:func:`resume_point`), never older than Tune's
own, also when Tune's is gone (:func:`studies.frameworks.tune.labelled_trainable`): every epoch
MLflow holds is one a restored trial continues after, and the record matches the run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray import tune

import icr.train
from icr.train.seam import EpochReport
from icr.workspace import Workspace
from studies.frameworks.tune import trial_folder
from studies.marks import mark, marked_checkpoints, unmark
from studies.trials import spec_of

FitFn = Callable[..., Any]  # the signature of icr.train.fit
FAILED_IN_TRAINING = "icr_failed_in_training"  # set on an exception that fit raised
_IN_REPORT = "icr_in_report"  # set on an exception that reporting an epoch raised


@dataclass(frozen=True)
class TrialJob:
    """What every trial of one Tuner shares."""

    study: str
    phase: str  # "search" or "confirm"
    workspace: str
    experiment: str = ""  # where Tune keeps the experiment (its trials' folders)


def tune_record(report: EpochReport) -> dict[str, Any]:
    """An :class:`EpochReport` as a Tune result (its metrics at the top, for ASHA and Optuna)."""
    return {**report.metrics, "trajectory": list(report.trajectory),
            "artifacts": list(report.artifacts), "final": report.final}


def run_trial(trial_config: dict[str, Any], *, job: TrialJob, fit: FitFn | None = None) -> None:
    """Train one trial; Tune calls this in a worker process."""
    fit = fit or icr.train.fit
    config = spec_of(trial_config).config
    _use_assigned_cpus()

    def reporter(report: EpochReport) -> None:
        record = tune_record(report)
        checkpoint = None
        try:
            if report.checkpoint:
                checkpoint = tune.Checkpoint.from_directory(report.checkpoint)
                mark(checkpoint, record)  # before Tune copies it to storage: the copy carries it
            tune.report(record, checkpoint=checkpoint)
        except Exception as exc:  # storage, Tune: not the training's own failure
            setattr(exc, _IN_REPORT, True)
            raise

    # fit's working folder stays out of Tune's trial folder, which Tune syncs to storage while
    # fit rewrites its checkpoint; Tune copies each reported checkpoint itself.
    trial_id = tune.get_context().get_trial_id()
    with tempfile.TemporaryDirectory(prefix=f"icr-trial-{trial_id}-") as run_dir:
        kwargs = {"workspace": Workspace.resolve(job.workspace), "run_dir": Path(run_dir)}
        resume_from, ended = resume_point(job, Path(run_dir) / "resume")
        if not ended:
            try:
                fit(config, reporter, resume_from, **kwargs)
            except Exception as exc:
                if not getattr(exc, _IN_REPORT, False):
                    setattr(exc, FAILED_IN_TRAINING, True)  # travels with it to the driver
                raise


def failed_in_training(error: BaseException | None) -> bool:
    """Whether the error that ended a trial (as Tune gives it on the driver) was raised by its
    training (``fit``: a non-finite loss, a config that cannot train, a bug in a model) rather
    than around it (a lost worker or node, Tune restoring it, storage): only the former is the
    trial's own failure, which a report states; the others are retried."""
    seen = set()
    while isinstance(error, BaseException) and id(error) not in seen:
        if getattr(error, FAILED_IN_TRAINING, False):
            return True
        seen.add(id(error))
        error = getattr(error, "cause", None) or error.__cause__  # RayTaskError keeps .cause
    return False


def resume_point(job: TrialJob, local: Path) -> tuple[Path | None, bool]:
    """Where this trial continues, and whether it had ended there (its last epoch).

    Returns a local copy of the trial's newest whole marked checkpoint (of Tune's own when none
    is marked: a study started before marks), or ``None`` to start from scratch. A marked
    checkpoint newer than Tune's, or one left when Tune's is gone (Tune gives none then), is
    one Tune's saved state lost: it is reported again with the result it was marked with (a
    copy, which Tune persists and registers, and the driver records where it had not), then
    the marks of the trial's other checkpoints are removed, since Tune writes its next
    checkpoints into folders of its own numbering, theirs included.
    """
    registered = tune.get_checkpoint()
    marked = marked_checkpoints(trial_folder(job.experiment)) \
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
    mark(copy, record)
    tune.report(dict(record), checkpoint=copy)
    persisted = tune.get_checkpoint()  # where Tune put the copy
    for other, _ in marked:
        if persisted is None or not _same(other, persisted):
            unmark(other)
    return local, bool(record.get("final"))


def _same(a: tune.Checkpoint, b: tune.Checkpoint) -> bool:
    return a.path.rstrip("/") == b.path.rstrip("/")


class MarkReported(tune.Callback):
    """Does nothing: the name a Tune experiment saved before its driver's MLflow callback marked
    checkpoints itself holds among its pickled callbacks, so that such an experiment restores.
    A checkpoint without a mark is marked, then recorded, by
    :meth:`studies.tracking.MlflowTrialCallback.on_checkpoint`."""


def _use_assigned_cpus() -> None:
    """Let torch use the CPUs Ray reserved for the trial (Ray sets OMP_NUM_THREADS to them)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    torch.set_num_threads(max(1, int(cpus or torch.get_num_threads())))
