"""A study with a cost beside its metric: the searcher tells Optuna both objectives of a full
trial (ASHA still stops on the metric alone), keeps them over a restore, and says so in --plan."""

from __future__ import annotations

import csv
import functools
from dataclasses import replace

import pytest

from studies.catalog import get_study
from studies.estimate import objectives
from studies.samplers import SpreadThenTPESampler
from studies.searcher import COST_ATTR, StudySearcher
from studies.space import ConditionalSpace, Domain
from studies.trials import KEY, TrialSpec

ETA = Domain("objective.eta", "uniform", (0.05, 0.3))
BASE = {"objective.name": "lagrangian", "decoder.name": "ltd"}


def searcher(log_path: str | None = None) -> StudySearcher:
    return StudySearcher(ConditionalSpace(BASE, (ETA,)),
                         functools.partial(TrialSpec.resolve, "lagrangian", BASE),
                         metric="val_rsum", mode="max", max_t=3, cost="epoch_time_s",
                         sampler=SpreadThenTPESampler(2, 0, ("objective.eta",)), log_path=log_path)


def run(s: StudySearcher, trial: str, epochs: int, costs: list[float]) -> float:
    eta = s.suggest(trial)[KEY].values["objective.eta"]
    for epoch in range(1, epochs + 1):
        s.on_trial_result(trial, {"val_rsum": 100.0 * eta + epoch, "epoch": epoch,
                                  "epoch_time_s": costs[epoch - 1]})
    s.on_trial_complete(trial, {"val_rsum": 100.0 * eta + epochs, "epoch": epochs})
    return 100.0 * eta + epochs


def test_a_full_trial_is_told_its_score_and_mean_cost_a_stopped_one_is_pruned(tmp_path):
    log = tmp_path / "log.csv"
    s = searcher(str(log))
    assert [d.name for d in s.study.directions] == ["MAXIMIZE", "MINIMIZE"]
    full = run(s, "a", 3, [1.0, 2.0, 6.0])
    run(s, "b", 1, [5.0])  # stopped by ASHA after one epoch
    for name in "cdef":  # past the quasi-random start: multi-objective TPE samples
        run(s, name, 3, [1.0, 1.0, 1.0])
    a, b = s.study.trials[:2]
    assert a.state.name == "COMPLETE" and a.values == [pytest.approx(full), pytest.approx(3.0)]
    assert a.intermediate_values == {}  # Optuna keeps none for two objectives
    assert b.state.name == "PRUNED" and b.values is None
    assert all(t.state.name == "COMPLETE" for t in s.study.trials[2:])
    rows = list(csv.DictReader(log.open()))
    assert float(rows[0]["cost"]) == pytest.approx(3.0) and rows[1]["cost"] == ""
    # a restored searcher holds both objectives of every trial
    s.save(str(tmp_path / "state.json"))
    again = searcher()
    again.restore(str(tmp_path / "state.json"))
    assert [t.values for t in again.study.trials] == [t.values for t in s.study.trials]
    assert again.study.trials[0].user_attrs[COST_ATTR] == {"1": 1.0, "2": 2.0, "3": 6.0}
    assert len(again.study.best_trials) >= 1


def test_a_full_trial_that_reported_no_cost_is_not_put_on_a_front():
    s = searcher()
    eta = s.suggest("a")[KEY].values["objective.eta"]
    for epoch in (1, 2, 3):
        s.on_trial_result("a", {"val_rsum": eta, "epoch": epoch})
    s.on_trial_complete("a", {"val_rsum": eta, "epoch": 3})
    assert s.study.trials[0].state.name == "FAIL"


def test_the_shipped_two_objective_study_states_both_in_its_plan():
    study = get_study("ltd_architectures")
    assert study.cost == "epoch_time_s"
    line = objectives(study)
    assert "maximise val_rsum and minimise epoch_time_s" in line and "ASHA stops" in line
    assert objectives(replace(study, cost="")) == "maximise val_rsum"
    with pytest.raises(ValueError, match="another metric"):
        replace(study, cost="val_rsum")
