"""One config per trial: resolved once on the driver, shipped with the trial, read by all.

A trial is its condition (the row of the study's tables), the values that tell it apart from the
condition's other trials (what the searcher drew, or a confirmation run's winning values and its
seed) and, resolved from those once, its validated :class:`~icr.config.ExperimentConfig` and the
MLflow params it records: the keys its configuration uses (:func:`icr.config.used_keys`), with
their values. :class:`TrialSpec.resolve` is the one place where that happens. The searcher
resolves a search trial as soon as it has drawn its values (:mod:`studies.searcher`), the
confirmation resolves each (condition, seed) before its Tuner starts (:mod:`studies.tuning`);
Tune ships the spec to the worker in the trial's config (key :data:`KEY`), where the trainable
trains ``spec.config``, and the driver's recorder logs ``spec.params``: nobody builds it again.

A trial has one name, :func:`run_name` (``lagrangian eta=0.112``, ``dual seed=1001``): its
MLflow run's name, Tune's tag and folder, the best trial in a status line, the winner a search
chose; with Tune's trial id, :func:`trial_label` (``trial 8e58e_00000 [lagrangian eta=0.112]``)
names it in the driver's lines and as its actor's Repr in Ray's dashboard
(:func:`studies.frameworks.tune.labelled_trainable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from icr.config import ExperimentConfig, Scalar, from_flat, to_flat, used_keys

KEY = "trial"  # the key of a trial's TrialSpec in its Tune config


@dataclass(frozen=True)
class TrialSpec:
    """A trial, resolved.

    Attributes:
        condition: the condition (row) the trial belongs to.
        values: the dotted keys that tell it apart (sampled values; a winner's values and
            ``train.seed``), applied over the condition's overrides.
        config: the validated config it trains.
        params: the keys ``config`` uses, with their values: what MLflow records.
    """

    condition: str
    values: Mapping[str, Scalar]
    config: ExperimentConfig
    params: Mapping[str, Scalar]

    @classmethod
    def resolve(cls, condition: str, overrides: Mapping[str, Scalar],
                values: Mapping[str, Scalar]) -> TrialSpec:
        """The trial of ``condition`` (its flat ``overrides``) given ``values``: validated once."""
        config = from_flat({**overrides, **values})
        flat = to_flat(config)
        return cls(condition, dict(values), config, {key: flat[key] for key in used_keys(config)})

    @property
    def seed(self) -> int:
        return self.config.train.seed

    @property
    def name(self) -> str:
        """``lagrangian eta=0.112`` / ``dual seed=1001``: the condition and its values."""
        return run_name(self.condition, self.values)

    def __str__(self) -> str:  # how Tune names the trial (its tag and folder)
        return self.name


def run_name(condition: str, values: Mapping[str, Any]) -> str:
    """``lagrangian eta=0.112`` / ``dual seed=1001``: the condition and what the trial chose."""
    shown = " ".join(f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float)
                     else f"{k.split('.')[-1]}={v}" for k, v in values.items())
    return f"{condition} {shown}".strip()


def trial_label(trial_id: str, config: Mapping[str, Any]) -> str:
    """``trial 8e58e_00000 [lagrangian eta=0.112]``: Tune's trial id and the name of the trial
    whose Tune config is ``config`` (just the id before Tune has given it its spec)."""
    spec = config.get(KEY)
    return f"trial {trial_id}" if spec is None else f"trial {trial_id} [{spec.name}]"


def spec_of(config: Mapping[str, Any]) -> TrialSpec:
    """The TrialSpec in a trial's Tune config."""
    return config[KEY]


def epochs_of(result: Mapping[str, Any] | None) -> int:
    """The epochs a trial has reported: its (last) result's ``epoch``, 0 before the first."""
    return int((result or {}).get("epoch", 0))


def full_budget(epochs: int, max_epochs: int) -> bool:
    """Whether a trial that reported ``epochs`` ran its condition's full budget: what selection
    requires, the searcher tells Optuna (COMPLETE, else PRUNED) and a run's tags record (an
    ASHA-stopped trial did not)."""
    return epochs >= max_epochs


class EpochLedger:
    """Each epoch of a trial once in a store of its epochs: the one rule that keeps an epoch
    from being recorded twice, for every store that records one (MLflow's run,
    :class:`studies.tracking.MlflowTrialCallback`; Tune's result files,
    :class:`studies.frameworks.tune.EpochJsonLogger` and ``EpochCsvLogger``; Optuna's
    intermediate values, :class:`studies.searcher.StudySearcher`).

    A killed driver leaves the stores at different epochs: each is written at its own moment
    (MLflow when Tune has saved the epoch's checkpoint, the result files when its result
    arrives, copied to the storage in the background, Optuna's trials with the searcher's saved
    state), and a trial cannot see which of them lack an epoch. So a restored trial always
    reports the epoch it continues after again (:func:`studies.trainable.resume_point`), and a
    store writes an epoch only above the last one it holds: read from the store itself when the
    store first meets the trial (:meth:`open`), then kept here.
    """

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # a trial's key in its store -> its last epoch there

    def knows(self, key: str) -> bool:
        return key in self._last

    def open(self, key: str, last: float) -> None:
        """Keep ``key``, whose store holds its epochs up to ``last`` (-inf or 0: none)."""
        self._last[key] = last

    def admit(self, key: str, epoch: float) -> bool:
        """Whether the store lacks ``epoch`` of ``key`` (opened); if so, it is taken as written."""
        if epoch <= self._last[key]:
            return False
        self._last[key] = epoch
        return True

    def close(self, key: str) -> None:
        """Forget ``key``: opened again, its last epoch is read from the store again."""
        self._last.pop(key, None)
