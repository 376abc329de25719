"""Optuna through its public API only (tested with Optuna 5.0.0, the version constraints.txt
locks); nothing here reaches a private name of Optuna.

:class:`GridOnceSampler`: every point of a grid once, in a seeded order, as a sampler written
against Optuna's public sampler interface (``BaseSampler``). Optuna's own ``GridSampler`` stops
its study when the grid is exhausted (``study.stop()`` in its ``after_trial``), which Optuna
allows only inside ``Study.optimize``; the platform drives Optuna with ``ask``/``tell`` from Ray
Tune (:mod:`studies.searcher`), and Tune ends the search itself after ``num_samples`` trials (the
grid's size). Which point a trial takes is read from the study's trials (their params), so the
sampler keeps no state of its own and a restored study continues its grid.

:func:`trials_to_json`, :func:`study_from_json`: a study's trials as data and back, so that a
searcher's state is never a pickle (:mod:`studies.searcher`). The study is rebuilt in a storage
made here (``InMemoryStorage``, whose ``create_new_trial`` takes a template trial: Optuna's
storage API), and its running trials come back live through ``Study.ask``, which hands out
waiting trials first.
"""

from __future__ import annotations

import datetime
import itertools
import random
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, distribution_to_json, json_to_distribution
from optuna.samplers import BaseSampler
from optuna.storages import InMemoryStorage
from optuna.study import Study
from optuna.trial import FrozenTrial, Trial, TrialState

TESTED_VERSION = "5.0.0"


class GridOnceSampler(BaseSampler):
    """Every point of ``search_space`` (name -> its values) once, in an order ``seed`` draws.

    A trial takes the first point, in that order, that no earlier trial of the study holds and
    that agrees with the values it has drawn so far (a trial of a conditional space draws only
    the names it uses); once every point is held, points are given again in the same order.
    """

    def __init__(self, search_space: Mapping[str, Sequence[Any]], seed: int | None = None) -> None:
        self.names = sorted(search_space)
        self.points = [dict(zip(self.names, values, strict=True))
                       for values in itertools.product(*(search_space[n] for n in self.names))]
        random.Random(seed).shuffle(self.points)

    def infer_relative_search_space(self, study: Study,
                                    trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if param_name not in self.names:
            raise ValueError(f"the grid has no parameter {param_name!r} (it has {self.names})")
        return self.points[self._point_of(study, trial)][param_name]

    def _point_of(self, study: Study, trial: FrozenTrial) -> int:
        """The index of the point ``trial`` takes: the earlier trials take theirs first."""
        held: set[int] = set()
        for other in study.get_trials(deepcopy=False):
            if other.number != trial.number and other.params:
                taken = self._first(other.params, held)
                if taken is not None:
                    held.add(taken)
        taken = self._first(trial.params, held)
        return taken if taken is not None else self._first(trial.params, set()) or 0

    def _first(self, params: Mapping[str, Any], held: set[int]) -> int | None:
        """The first point not in ``held`` that agrees with ``params`` on the grid's names."""
        return next((i for i, point in enumerate(self.points) if i not in held
                     and all(params[n] == point[n] for n in self.names if n in params)), None)


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
                    sampler: BaseSampler) -> tuple[Study, dict[int, Trial | FrozenTrial]]:
    """A new in-memory study holding ``trials`` (as :func:`trials_to_json` wrote them), with
    their numbers (one objective per direction), each trial by its number: a running one as a
    live :class:`optuna.trial.Trial`, so that it can still report and be told; another as the
    study's record of it.

    A running trial is stored waiting and taken back with ``Study.ask`` (which gives waiting
    trials first, and marks the start of its run anew).

    Raises:
        ValueError, KeyError, TypeError: data not of that shape (never executed: read as data).
    """
    directions = [directions] if isinstance(directions, str) else list(directions)
    storage = InMemoryStorage()
    study = optuna.create_study(storage=storage, directions=directions, sampler=sampler)
    study_id = storage.get_study_id_from_name(study.study_name)
    running = set()
    for number, data in enumerate(sorted(trials, key=lambda t: t["number"])):
        if data["number"] != number:
            raise ValueError(f"trial numbers are not 0..{len(trials) - 1}")
        state = TrialState[data["state"]]
        if state == TrialState.RUNNING:
            state = TrialState.WAITING
            running.add(number)
        frozen = FrozenTrial(
            number=number, state=state, value=None,
            values=None if data["values"] is None else [float(v) for v in data["values"]],
            datetime_start=_when(data["datetime_start"]),
            datetime_complete=_when(data["datetime_complete"]),
            params=dict(data["params"]),
            distributions={k: json_to_distribution(v) for k, v in data["distributions"].items()},
            user_attrs=dict(data["user_attrs"]), system_attrs=dict(data["system_attrs"]),
            intermediate_values={int(k): float(v) for k, v in data["intermediate_values"].items()},
            trial_id=-1)
        storage.create_new_trial(study_id, template_trial=frozen)
    live: dict[int, Trial | FrozenTrial] = {t.number: t for t in study.get_trials(deepcopy=False)}
    for _ in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        if not running - {n for n, t in live.items() if isinstance(t, Trial)}:
            break
        trial = study.ask()  # the waiting trial of the lowest number
        live[trial.number] = trial
    return study, live


def _when(text: str | None) -> datetime.datetime | None:
    return datetime.datetime.fromisoformat(text) if text is not None else None
