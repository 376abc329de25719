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
since. So the trial writes into each checkpoint, before Tune copies it to storage, the result it
comes with and the size of every file (its *mark*, :func:`mark`), so that a copy cut short by a
kill is not taken for a marked one; the driver records an epoch that came with a checkpoint
once Tune has saved the checkpoint, mark included
(:meth:`studies.tracking.MlflowTrialCallback.on_checkpoint`); and a trial continues after the
newest whole marked checkpoint of its folder (:func:`resume_point`), also when Tune's saved
state names an older one or one that is gone (:func:`studies.frameworks.tune.labelled_trainable`):
every epoch MLflow holds is one a restored trial continues after, and the record matches the run.

A trial first checks that its node reads what it needs (:func:`check_readable`): the study's
Tune storage and its data. A node that cannot (a worker without the shared mount) stops the
study with one line naming the node and the path (:class:`StopWhenUnreadable`), instead of a
training failure that Tune retries and the report counts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray
import torch
from ray import tune

import icr.train
from icr.config import ExperimentConfig, local_paths, remote_paths
from icr.data.remote import fetch
from icr.errors import UserError
from icr.train.seam import EpochReport
from icr.workspace import Workspace
from studies import storage
from studies.failures import FAILED_IN_TRAINING, NodeCannotRead, node_cannot_read
from studies.frameworks.tune import (
    BOOKKEEPING,
    METADATA_FILE,
    raised_in_callback,
    trial_exception,
    trial_folder,
)
from studies.trials import spec_of

FitFn = Callable[..., Any]  # the signature of icr.train.fit
_IN_REPORT = "icr_in_report"  # set on an exception that reporting an epoch raised
# Written by the driver into an experiment's storage folder when a Tuner starts
# (StopWhenUnreadable.setup): a node that sees it shares the driver's storage.
STORAGE_MARKER = "icr-storage-marker"
REPORTED = "icr_reported"  # a checkpoint's metadata key: the result it was reported with
FILES = "icr_files"  # a checkpoint's metadata key: its files and their sizes, when it was reported


@dataclass(frozen=True)
class TrialJob:
    """What every trial of one Tuner shares."""

    study: str
    phase: str  # "search" or "confirm"
    workspace: str
    experiment: str  # where Tune keeps the experiment (its trials' folders)
    data: Mapping[str, str] = field(default_factory=dict)  # condition -> its prepared data folder


def tune_record(report: EpochReport) -> dict[str, Any]:
    """An :class:`EpochReport` as a Tune result (its metrics at the top, for ASHA and Optuna);
    how its steps ran as ``steps_captured`` / ``steps_eager`` and ``steps`` (mode, shapes,
    reason, fell_back)."""
    record = {**report.metrics, "trajectory": list(report.trajectory),
              "artifacts": list(report.artifacts), "final": report.final}
    if report.steps is not None:
        s = report.steps
        record.update(steps_captured=s.captured, steps_eager=s.eager,
                      steps={"mode": s.mode, "shapes": list(s.shapes), "reason": s.reason,
                             "fell_back": s.fell_back})
    return record


def run_trial(trial_config: dict[str, Any], *, job: TrialJob, fit: FitFn | None = None) -> None:
    """Train one trial; Tune calls this in a worker process."""
    fit = fit or icr.train.fit
    spec = spec_of(trial_config)
    config = spec.config
    check_readable(job, config, spec.condition)
    _use_assigned_cpus()

    def reporter(report: EpochReport) -> None:
        """Mark the epoch's checkpoint with its result, then hand both to Tune."""
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


# --- what a trial's node must read ------------------------------------------------------------


def check_readable(job: TrialJob, config: ExperimentConfig, condition: str) -> None:
    """Raise :class:`NodeCannotRead` unless this node reads the study's Tune storage (the
    marker the driver wrote into the experiment's folder, :func:`storage_marker`) and the
    trial's data: its condition's data folder as the driver prepared it, and every local file
    or folder its configuration names (:func:`icr.config.local_paths`); a folder given by URI
    (``data.precomp_dir=s3://...``) is first copied into this node's cache, once per node
    (:func:`icr.data.remote.fetch`). Checked before the trial looks for a checkpoint to resume
    from: one that cannot see the storage would start over."""
    problem = storage_problem(job.experiment)
    if problem:
        raise NodeCannotRead(
            f"{node_name()} cannot read the study's Tune storage {job.experiment} ({problem}); "
            "give every node the same storage: --storage s3://BUCKET/PATH, or a shared file "
            "system mounted at the same path on every node (docs/clusters.md)")
    for key, uri in remote_paths(config).items():
        try:
            fetch(uri, Workspace.resolve(job.workspace).cache)
        except UserError as exc:
            raise NodeCannotRead(f"{node_name()} cannot copy {key}: {exc}") from None
    paths = {"the prepared data folder": job.data.get(condition, ""),
             **{key: str(path) for key, path in local_paths(config).items()}}
    for what, path in paths.items():
        problem = path_problem(path) if path else ""
        if problem:
            raise NodeCannotRead(
                f"{node_name()} cannot read {what} {path} ({problem}); mount the data at the "
                "same path on every node, as on the driver (docs/clusters.md)")


def node_name() -> str:
    """This node as a person finds it: ``node IP (hostname)``."""
    return f"node {ray.util.get_node_ip_address()} ({socket.gethostname()})"


def path_problem(path: str) -> str:
    """Why ``path`` (a local file or folder) cannot be read here; '' when it can. A folder is
    listed and a file opened, so that a stale network mount fails here, not in training."""
    try:
        if os.path.isdir(path):
            with os.scandir(path) as entries:
                next(entries, None)
        else:
            with open(path, "rb"):
                pass
    except FileNotFoundError:
        return "no such file or folder on this node"
    except PermissionError:
        return "permission denied"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


def storage_marker(experiment: str) -> str:
    """The file that the driver writes into an experiment's storage folder when its Tuner
    starts (:class:`StopWhenUnreadable`): a node that sees it shares the driver's storage."""
    return storage.join(experiment, STORAGE_MARKER)


def write_storage_marker(experiment: str) -> None:
    """Write :func:`storage_marker` of ``experiment`` (a folder or a URI), its folder too."""
    fs, marker = storage.filesystem(storage_marker(experiment))
    fs.create_dir(marker.rpartition("/")[0], recursive=True)
    with fs.open_output_stream(marker) as out:
        out.write(b"written by the study's driver when its Tuner started\n")


def storage_problem(experiment: str) -> str:
    """Why this node does not see the Tune storage of ``experiment`` as the driver wrote it;
    '' when it does."""
    fs, marker = storage.filesystem(storage_marker(experiment))
    try:
        info = fs.get_file_info(marker)
    except OSError as exc:  # credentials, an endpoint that does not answer
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if info.type == pyarrow.fs.FileType.NotFound:
        return "the marker the study's driver wrote there is not found from this node"
    return ""


class StopWhenUnreadable(tune.Callback):
    """Stops the Tuner when a trial ended with :class:`NodeCannotRead`.

    Left to Tune, such a trial is retried (``FailureConfig.max_failures``), maybe on a node
    that reads the data, which hides the one that does not, then counted as a failed run.
    Raised from this callback (called by Tune before its retry, or when no retry is left), the
    error ends ``Tuner.fit`` as a driver stopped at that moment ends it: Tune stops the trials,
    its saved state and the MLflow runs stay as they were, and the same command continues
    the study once every node reads what it needs. It must come before the MLflow callback,
    which would record the run as failed.

    ``experiment``: the Tuner's experiment folder (or URI), where :meth:`setup` writes the
    marker that :func:`check_readable` looks for on the trial's node before the trials start.
    """

    def __init__(self, experiment: str | None = None) -> None:
        self.experiment = experiment

    def setup(self, stop: Any = None, num_samples: int | None = None,
              total_num_samples: int | None = None, **info: Any) -> None:
        if self.experiment is not None:
            write_storage_marker(self.experiment)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._stop_if_unreadable(trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._stop_if_unreadable(trial)

    @staticmethod
    def _stop_if_unreadable(trial: Any) -> None:
        unreadable = node_cannot_read(trial_exception(trial))
        if unreadable is not None:
            raise NodeCannotRead(str(unreadable))


@contextlib.contextmanager
def unreadable_stops() -> Iterator[None]:
    """Around ``Tuner.fit``: the :class:`NodeCannotRead` that :class:`StopWhenUnreadable` raised
    comes out as itself (one line, exit code 2), not as Tune's wrapping of it."""
    try:
        yield
    except Exception as exc:
        unreadable = node_cannot_read(raised_in_callback(exc))
        if unreadable is None:
            raise
        raise NodeCannotRead(str(unreadable)) from None


def resume_point(job: TrialJob, local: Path) -> tuple[Path | None, bool]:
    """Where this trial continues, and whether it had ended there (its last epoch).

    Returns a local copy of the trial's newest whole marked checkpoint, or ``None`` to start
    from scratch. One that Tune did not give (``tune.get_checkpoint()``: the one its saved
    state names, ``None`` when that one is gone) is one Tune's saved state lost: it is reported
    again with the result it was marked with (a copy, which Tune persists and registers, and
    the driver records where it had not), then the marks of the trial's other checkpoints are
    removed, since Tune writes its next checkpoints into folders of its own numbering, theirs
    included.

    One that Tune did give is reported again too, without a checkpoint: a store of the trial's
    epochs may lack it, and the trial cannot see which. MLflow's record is written once Tune
    has saved the checkpoint, Tune's result files reach the storage with its background copy,
    in parallel with its saved state: a driver killed in between leaves a state naming the
    checkpoint beside a result file that ends before it (seen on S3), or an MLflow run that
    does. Each store writes the epoch where it lacks it (:class:`studies.trials.EpochLedger`).
    """
    folder = trial_folder(job.experiment)
    marked = marked_checkpoints(folder)
    if not marked:
        return None, False
    checkpoint, record = max(marked, key=lambda pair: pair[1]["epoch"])
    checkpoint.to_directory(str(local))
    registered = tune.get_checkpoint()
    if registered is None or not _same(registered, checkpoint):
        copy = tune.Checkpoint.from_directory(str(local))
        mark(copy, record)
        tune.report(dict(record), checkpoint=copy)
        persisted = tune.get_checkpoint()  # where Tune put the copy
        for other, _ in marked:
            if persisted is None or not _same(other, persisted):
                unmark(other)
    else:
        tune.report(dict(record))
    return local, bool(record.get("final"))


def _same(a: tune.Checkpoint, b: tune.Checkpoint) -> bool:
    return a.path.rstrip("/") == b.path.rstrip("/")


def _use_assigned_cpus() -> None:
    """Let torch use the CPUs Ray reserved for the trial (Ray sets OMP_NUM_THREADS to them)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, int(cpus)))
    torch.set_num_threads(max(1, int(cpus or torch.get_num_threads())))


# --- checkpoint marks: the result a checkpoint was reported with, written into it -------------


def mark(checkpoint: tune.Checkpoint, result: Mapping[str, Any]) -> None:
    """Write into a checkpoint the result it comes with (Tune's bookkeeping left out) and the
    size of each of its files."""
    checkpoint.set_metadata({REPORTED: {k: v for k, v in result.items() if k not in BOOKKEEPING},
                             FILES: _file_sizes(checkpoint)})


def unmark(checkpoint: tune.Checkpoint) -> None:
    with contextlib.suppress(OSError):
        checkpoint.set_metadata({})


def marked_checkpoints(folder: str) -> list[tuple[tune.Checkpoint, dict[str, Any]]]:
    """The checkpoints in a trial's folder that carry a mark, with the result each was marked
    with. A mark that cannot be read (e.g. half written) counts as none, and so does one whose
    checkpoint lacks a file it lists or holds it at another size (a copy cut short)."""
    fs, path = storage.filesystem(folder)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    found = []
    for info in infos:
        if info.type != pyarrow.fs.FileType.Directory or not info.base_name.startswith("checkpoint_"):
            continue
        checkpoint = tune.Checkpoint(info.path, filesystem=fs)
        record = mark_of(checkpoint)
        if record is not None:
            found.append((checkpoint, record))
    return found


def mark_of(checkpoint: tune.Checkpoint) -> dict[str, Any] | None:
    """The result a whole checkpoint was marked with; ``None`` when unmarked or not whole."""
    try:
        metadata = checkpoint.get_metadata()
        record, files = metadata.get(REPORTED), metadata.get(FILES)
        whole = isinstance(files, dict) and files == _file_sizes(checkpoint)
    except (OSError, ValueError, AttributeError):
        return None
    if whole and isinstance(record, dict) and isinstance(record.get("epoch"), int | float):
        return record
    return None


def _file_sizes(checkpoint: tune.Checkpoint) -> dict[str, int]:
    """Each file of a checkpoint (its path inside it) and its size; the mark itself left out."""
    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    return {info.path[len(root) + 1:]: info.size for info in infos
            if info.type == pyarrow.fs.FileType.File and info.base_name != METADATA_FILE}
