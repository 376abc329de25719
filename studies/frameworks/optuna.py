"""Optuna behaviour of one version that the platform works around (tested with Optuna 5.0.0, the
version constraints.txt locks).

:class:`GridOnceSampler`: Optuna's ``GridSampler`` stops its study when the grid is exhausted
(``study.stop()`` in its ``after_trial``), which Optuna allows only inside ``Study.optimize``;
the platform drives Optuna with ``ask``/``tell`` from Ray Tune (:mod:`studies.searcher`), and
Tune ends the search itself after ``num_samples`` trials (the grid's size). The override relies
on ``after_trial`` doing nothing else that a search needs, which is true of the tested version.

:func:`trials_to_json`, :func:`study_from_json`: a study's trials as data and back, so that a
searcher's state is never a pickle (:mod:`studies.searcher`). Rebuilding a study with its trial
numbers and live trials uses its storage through two private attributes of Optuna 5.0.0's
``Study`` (``study._storage``, ``study._study_id``: the storage API's ``create_new_trial`` with a
template trial); another version without them is one line naming both versions.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import distribution_to_json, json_to_distribution
from optuna.samplers import BaseSampler, GridSampler
from optuna.study import Study
from optuna.trial import FrozenTrial, Trial, TrialState

from studies.frameworks import reaching

TESTED_VERSION = "5.0.0"


class GridOnceSampler(GridSampler):
    """Optuna's GridSampler for a search that Tune ends: every point once, in a seeded order."""

    def after_trial(self, study: Study, trial: FrozenTrial, state: Any, values: Any) -> None:
        return None


# --- a study as data: saved and restored without pickle ------------------------------------------


def trials_to_json(study: Study) -> list[dict[str, Any]]:
    """Every trial of ``study`` as JSON-able data (its distributions in Optuna's own JSON)."""
    return [{
        "number": t.number, "state": t.state.name, "values": t.values,
        "params": t.params, "distributions": {k: distribution_to_json(d)
                                              for k, d in t.distributions.items()},
        "intermediate_values": {str(step): value for step, value in t.intermediate_values.items()},
        "user_attrs": t.user_attrs, "system_attrs": t.system_attrs,
        "datetime_start": t.datetime_start.isoformat() if t.datetime_start else None,
        "datetime_complete": t.datetime_complete.isoformat() if t.datetime_complete else None,
    } for t in study.get_trials(deepcopy=False)]


def study_from_json(trials: list[dict[str, Any]], directions: str | Sequence[str],
                    sampler: BaseSampler) -> tuple[Study, dict[int, Trial]]:
    """A new in-memory study holding ``trials`` (as :func:`trials_to_json` wrote them), with
    their numbers (one objective per direction), and each as a live :class:`optuna.trial.Trial` (number -> trial), so that a
    running one can still report and be told.

    Raises:
        ValueError, KeyError, TypeError: data not of that shape (never executed: read as data).
    """
    directions = [directions] if isinstance(directions, str) else list(directions)
    study = optuna.create_study(directions=directions, sampler=sampler)
    with reaching("optuna", optuna.__version__, TESTED_VERSION, "Study._storage, Study._study_id"):
        storage, study_id = study._storage, study._study_id
    live = {}
    for number, data in enumerate(sorted(trials, key=lambda t: t["number"])):
        if data["number"] != number:
            raise ValueError(f"trial numbers are not 0..{len(trials) - 1}")
        frozen = FrozenTrial(
            number=number, state=TrialState[data["state"]], value=None,
            values=None if data["values"] is None else [float(v) for v in data["values"]],
            datetime_start=_when(data["datetime_start"]),
            datetime_complete=_when(data["datetime_complete"]),
            params=dict(data["params"]),
            distributions={k: json_to_distribution(v) for k, v in data["distributions"].items()},
            user_attrs=dict(data["user_attrs"]), system_attrs=dict(data["system_attrs"]),
            intermediate_values={int(k): float(v) for k, v in data["intermediate_values"].items()},
            trial_id=-1)
        trial_id = storage.create_new_trial(study_id, template_trial=frozen)
        live[number] = Trial(study, trial_id)
    return study, live


def _when(text: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(text) if text is not None else None
