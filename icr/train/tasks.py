"""What ``fit`` can train (``task.name``): each task is a training state behind one protocol.

``fit`` (:mod:`icr.train.loop`) owns the loop for every task: epochs, validation, the best
checkpoint, the test evaluation, the analyses and the per-epoch report. A task only knows how to
train one epoch and evaluate a split: :class:`Task`. Retrieval (:mod:`icr.train.retrieval`) and
grounding (:mod:`icr.grounding.train`) register here; a task claims the config sections only it
uses (``reads=("loss.*", ...)``), so a grounding run records no retrieval keys, and declares what it
offers the analyses (``provides=``, :mod:`icr.context`), so a study is checked before it starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from icr.context import Capability
from icr.data.datasets import load_source
from icr.registry import Registry

# A task registers ``provides=`` (the capability types of its ``capabilities()``) and ``prepare=``.
TASKS: Registry = Registry("task", package=("icr.train", "icr.grounding"),
                           requires=("provides", "prepare"))


class Task(Protocol):
    """A training run's state and the steps that change it.

    Attributes:
        epochs: how many epochs the run trains.
        selection_metric: the validation metric (higher is better) that picks the best epoch,
            e.g. ``rsum`` for retrieval, ``pointing`` for grounding.
        data: the prepared data (the analyses read it).
    """

    epochs: int
    selection_metric: str
    data: Any

    def train_epoch(self, epoch: int, progress: bool = False, timer: Any = None
                    ) -> dict[str, float]:
        """Train epoch ``epoch`` (0-based); return the means of its loss terms (``train_*``).
        ``timer`` (a :class:`~icr.train.timing.StepTimer`) is told each step's end."""

    def take_trajectory(self) -> list[dict[str, float]]:
        """The per-step rows recorded since the last call (and forget them)."""

    # Optional: ``step_modes() -> StepModes``, how the steps since its last call ran (captured
    # as CUDA graphs or eager, and why); the loop puts it in the epoch's report when the task has it.

    def evaluate(self, split: str) -> dict[str, float]:
        """Every metric of ``split`` with the current weights."""

    def metrics(self) -> dict[str, float]:
        """State worth recording after an epoch: ``lr``, the objective's (``lambda``)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (weights, optimiser, schedule, objective)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def model_state(self) -> dict[str, torch.Tensor]:
        """The weights alone (CPU copies): what the best checkpoint keeps."""

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def eval(self) -> None:
        """Put the models in evaluation mode (for analyses)."""

    def capabilities(self) -> tuple[Capability, ...]:
        """What the task offers its analyses: instances of the types it registered as
        ``provides=``, and what its dataset provides
        (:meth:`icr.data.datasets.DatasetSource.capabilities`)."""


def build_task(config: Any, workspace: Any, device: torch.device) -> Task:
    """The task ``config.task.name`` with its data prepared, ready to train."""
    return TASKS.build(config.task.name, config=config, workspace=workspace, device=device)


def check(config: Any) -> None:
    """Cheap checks of a task's configuration and input files (the task registers ``check=``),
    run on the driver before anything starts; ConfigError / DataError name the culprit."""
    checker = TASKS.meta(config.task.name).get("check")
    if checker is not None:
        checker(config)


def check_data(config: Any, workspace: Any) -> tuple[str, ...]:
    """Every file a run of ``config`` will read, checked without preparing it (``--plan``): the
    task registers ``check_data=`` (``(config, workspace) -> lines``); without one, its dataset
    is loaded as its loader reads it. Returns the lines preparation will print (which files serve
    each split, the test's protocols); a problem is a DataError naming the file and the fix."""
    checker = TASKS.meta(config.task.name).get("check_data")
    if checker is not None:
        return checker(config, workspace)
    return load_source(config, workspace).notes


@dataclass(frozen=True)
class Prepared:
    """What preparing a configuration's data tells the driver.

    Attributes:
        fingerprint: identifies the data (files and split contents), for tracking.
        train_captions: training captions an epoch can draw from (grounding: those with phrases).
        train_images: training images (with at least one caption).
        root: the dataset's folder, where the driver may read what names the data (the
            embedded benchmark's manifest); ``None`` when there is no such folder.
        notes: what the preparation chose, one line each (which files serve validation and
            test, which protocols the test split is reported with), for the driver to print.
    """

    fingerprint: str
    train_captions: int
    train_images: int
    root: Path | None = None
    notes: tuple[str, ...] = ()


def prepare(config: Any, workspace: Any) -> Prepared:
    """Prepare (and cache) everything the task's trials will read; what the data holds.

    A task registers its preparation as ``prepare=`` (``(config, workspace) -> Prepared``): the
    platform calls it once per distinct data configuration on the driver, before any trial, so a
    bad file fails there and the trials find every cache ready.
    """
    return TASKS.meta(config.task.name)["prepare"](config, workspace)


def check_fits(config: Any, data: Prepared) -> None:
    """The checks a trial makes against the size of its data, made on the driver.

    A task registers them as ``fits=`` (``(config, prepared) -> None``, ConfigError naming the
    key): the same functions its training calls (e.g. the steps of an epoch), so a value that
    cannot work for the dataset (``train.batch_size`` above the captions of an epoch) stops the
    study before it starts instead of failing every trial.
    """
    fits = TASKS.meta(config.task.name).get("fits")
    if fits is not None:
        fits(config, data)

