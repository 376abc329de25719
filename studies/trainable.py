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
holds, and go on from another model. So the driver marks each checkpoint with the result it
came with before recording that result (:class:`MarkReported`), and a trial continues after the
newest marked checkpoint of its folder (:func:`resume_point`), never older than Tune's own:
every epoch MLflow holds is one a restored trial continues after, and the record matches the run.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray
from ray import tune

from icr.train.seam import EpochReport
from icr.workspace import Workspace
from studies.frameworks.tune import BOOKKEEPING, trial_folder
from studies.trials import spec_of

FitFn = Callable[..., Any]  # the signature of icr.train.fit
REPORTED = "icr_reported"  # a checkpoint's metadata key: the result the driver recorded with it


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


def default_fit() -> FitFn:
    from icr.train import fit

    return fit


def run_trial(trial_config: dict[str, Any], *, job: TrialJob, fit: FitFn | None = None) -> None:
    """Train one trial; Tune calls this in a worker process."""
    fit = fit or default_fit()
    config = spec_of(trial_config).config
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
    copy.set_metadata({})  # unmarked until the driver marks the folder Tune copies it into
    tune.report(dict(record), checkpoint=copy)
    persisted = tune.get_checkpoint()  # where Tune put the copy
    for other, _ in marked:
        if persisted is None or not _same(other, persisted):
            unmark(other)
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
            mark(checkpoint, result)


def _use_assigned_cpus() -> None:
    """Let torch use the CPUs Ray reserved for the trial (Ray sets OMP_NUM_THREADS to them)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    import torch

    torch.set_num_threads(max(1, int(cpus or torch.get_num_threads())))


# --- checkpoint marks: the result a checkpoint was recorded with ------------------------------


def mark(checkpoint: tune.Checkpoint, result: Mapping[str, Any]) -> None:
    """Write into a persisted checkpoint the result it came with (Tune's bookkeeping left out)."""
    checkpoint.set_metadata({REPORTED: {k: v for k, v in result.items() if k not in BOOKKEEPING}})


def unmark(checkpoint: tune.Checkpoint) -> None:
    with contextlib.suppress(OSError):
        checkpoint.set_metadata({})


def marked_checkpoints(folder: str) -> list[tuple[tune.Checkpoint, dict[str, Any]]]:
    """The checkpoints in a trial's folder that carry a mark, with the result each was marked
    with (a mark that cannot be read, e.g. half written, counts as none)."""
    fs, path = _filesystem(folder)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    found = []
    for info in infos:
        if info.type != pyarrow.fs.FileType.Directory or not info.base_name.startswith("checkpoint_"):
            continue
        checkpoint = tune.Checkpoint(info.path, filesystem=fs)
        try:
            record = checkpoint.get_metadata().get(REPORTED)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("epoch"), int | float):
            found.append((checkpoint, record))
    return found


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    if "://" in uri:
        return pyarrow.fs.FileSystem.from_uri(uri)
    return pyarrow.fs.LocalFileSystem(), str(Path(uri).absolute())
