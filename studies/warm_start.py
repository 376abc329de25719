"""``--warm-start STUDY``: a new search that starts from an earlier study's trials.

The earlier study's search trials, as its MLflow runs recorded them, become observations of the
new search's Optuna study (``optuna.trial.create_trial``, added with ``Study.add_trials`` before
the first trial is asked for): a trial that ran the full budget as COMPLETE with its last score,
one ASHA stopped as PRUNED with its per-epoch scores (TPE reads them), a failed one not at all.
Nothing is trained again: the observations only shape where the sampler looks, and the quasi-random
start counts them (:class:`~studies.samplers.SpreadThenTPESampler` goes by trial number). The new
study's runs are its own: its tables, selection and report count only the trials it trained.

An observation keeps the keys the new condition searches, with the values its run recorded (a
key it did not search but trained at a fixed value counts at that value, so a rerun with one more
searched key starts from the earlier trials); a trial with a value outside the new domains is
dropped, and one line says how many. Conditions are matched by name; a condition searched over a
grid trains every point anyway and takes no observation.

``STUDY`` is a study in this workspace's tracking store (its key: ``ltd_bound``,
``ltd_bound-smoke``; a study's name alone also finds the run of this run's recipe), or the path
of another workspace (its study of the same key). The earlier study's newest finished run is
read. Every problem (no such study, a damaged store, no searched key in common) is one line
before anything is written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from icr.config import Scalar
from icr.errors import UserError
from icr.workspace import sqlite_file
from studies.runs import load_runs
from studies.space import Domain, grid_points
from studies.space_analysis import COMPLETE, FAIL, contains, distribution, search_trials
from studies.tracking import Tracker, check_store

if TYPE_CHECKING:
    from studies.plan import StudyPlan

SOURCE_TAG = "warm_start"  # the parent run's tag: where its observations came from
SOURCE_RUN_TAG = "warm_start_run"  # the source study's parent run id
OBSERVED_ATTR = "warm_start_run"  # an observation's user attribute: the MLflow run it was


@dataclass(frozen=True)
class Observation:
    """One earlier trial as the new search sees it."""

    run_id: str
    state: str  # COMPLETE or PRUNED
    params: dict[str, Scalar]
    value: float | None  # its last score (COMPLETE)
    cost: float | None  # its second objective, if the study has one
    scores: dict[int, float] = field(default_factory=dict)  # epoch -> score


@dataclass(frozen=True)
class WarmStart:
    """An earlier study's trials, per condition of the new study, ready to be observed."""

    source: str  # "ltd_bound-smoke in sqlite:///...": what the parent run's tag records
    run_id: str  # the earlier study's parent run
    observations: Mapping[str, tuple[Observation, ...]]
    dropped: Mapping[str, int]  # per condition: trials with a value outside the new domains

    def describe(self) -> list[str]:
        """What each condition takes, one line each (``--plan`` and the start of a run)."""
        lines = [f"warm start from {self.source} (run {self.run_id}):"]
        for condition, observed in self.observations.items():
            full = sum(o.state == COMPLETE for o in observed)
            line = (f"  {condition}: {len(observed)} observation(s) ({full} full budget, "
                    f"{len(observed) - full} stopped early), none trained again")
            if self.dropped.get(condition):
                line += (f"; {self.dropped[condition]} trial(s) dropped: a value outside this "
                         "study's domains")
            lines.append(line)
        return lines

    def trials(self, condition: str, domains: Mapping[str, Domain], multi: bool
               ) -> list[optuna.trial.FrozenTrial]:
        """The condition's observations as Optuna trials of a study over ``domains`` (with the
        cost as a second value when ``multi``; Optuna keeps no intermediate values then)."""
        out = []
        for o in self.observations.get(condition, ()):
            values = None
            if o.state == COMPLETE:
                values = [o.value, o.cost] if multi else [o.value]
            out.append(optuna.trial.create_trial(
                state=optuna.trial.TrialState[o.state], values=values,
                params=dict(o.params),
                distributions={k: distribution(domains[k]) for k in o.params},
                intermediate_values={} if multi else dict(o.scores),
                user_attrs={OBSERVED_ATTR: o.run_id}))
        return out

    def tags(self) -> dict[str, str]:
        return {SOURCE_TAG: self.source, SOURCE_RUN_TAG: self.run_id}


def load_warm_start(spec: str, plan: StudyPlan) -> WarmStart:
    """The earlier study ``spec`` names, read for ``plan`` (module docstring).

    Raises:
        UserError: one line, when there is no such study or finished run, its store is damaged,
            or it searched no key the new study searches.
    """
    uri, keys = _source(spec, plan)
    check_store(uri)
    tracker = Tracker(uri, keys[0])
    try:
        found = [k for k in keys if tracker.client.get_experiment_by_name(k) is not None]
    except Exception as exc:  # a store MLflow cannot open: one line, not its traceback
        raise UserError(f"--warm-start {spec}: cannot read the study store {uri} "
                        f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    if not found:
        raise UserError(f"--warm-start {spec}: no study {' or '.join(dict.fromkeys(keys))} in {uri}; "
                        "give a study this workspace ran, or another workspace's folder")
    tracker = Tracker(uri, found[0])
    parents = [r for r in tracker.find_runs("tags.`icr.role` = 'study'")
               if r.info.status == "FINISHED"]
    if not parents:
        raise UserError(f"--warm-start {spec}: study {found[0]} in {uri} has no finished run yet")
    parent = max(parents, key=lambda r: r.info.start_time)
    searched = {k for name, v in parent.data.tags.items() if name.startswith("searched.")
                for k in v.split(",") if k}
    wanted = {k for c in plan.conditions for k in c.domains}
    if not searched & wanted:
        raise UserError(
            f"--warm-start {spec}: study {found[0]} searched {', '.join(sorted(searched)) or 'nothing'}, "
            f"none of the keys this study searches ({', '.join(sorted(wanted))}); nothing to start from")
    runs = load_runs(tracker, parent.info.run_id)
    observations, dropped = {}, {}
    for condition in plan.conditions:
        if not condition.domains or grid_points(condition.domains) is not None:
            continue
        observations[condition.name], dropped[condition.name] = _observe(
            runs, condition.name, condition.domains, plan.study.metric, plan.study.cost)
    return WarmStart(f"{found[0]} in {uri}", parent.info.run_id, observations, dropped)


def _source(spec: str, plan: StudyPlan) -> tuple[str, list[str]]:
    """The tracking URI and the study keys (in the order tried) that ``spec`` names."""
    path = Path(spec).expanduser()
    if "/" in spec or path.is_dir():
        db = path / "mlflow.db"
        if not db.is_file():
            raise UserError(f"--warm-start {spec}: no study store there ({db} does not exist); "
                            "give another workspace's folder, or a study's name")
        return f"sqlite:///{db.resolve()}", [plan.key]
    keys = [spec]
    if plan.recipe_name != "embedded":
        keys.append(f"{spec}-{plan.recipe_name}")
    db = sqlite_file(plan.tracking_uri)
    if db is not None and not db.is_file():  # MLflow would create it: nothing is written here
        raise UserError(f"--warm-start {spec}: no study {' or '.join(keys)} in {plan.tracking_uri} "
                        "(it holds no study yet); give a study this workspace ran, or another "
                        "workspace's folder")
    return plan.tracking_uri, keys


def _observe(runs: Any, condition: str, domains: Mapping[str, Domain], metric: str,
             cost: str) -> tuple[tuple[Observation, ...], int]:
    """The observations of one condition and how many trials were dropped."""
    kept, dropped = [], 0
    for trial in search_trials(runs, condition, metric, domains, cost):
        if trial.state == FAIL or (trial.state == COMPLETE and trial.value is None):
            continue
        if cost and trial.state == COMPLETE and trial.cost is None:
            dropped += 1
            continue
        if not all(contains(domains[k], v) for k, v in trial.params.items()):
            dropped += 1
            continue
        scores = dict(zip(*runs.history(trial.run_id, metric), strict=True))
        scores = {int(e): float(s) for e, s in scores.items() if math.isfinite(s)}
        kept.append(Observation(trial.run_id, trial.state, trial.params, trial.value, trial.cost,
                                scores))
    return tuple(kept), dropped

