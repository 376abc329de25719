"""Search: per condition, Ray Tune with ASHA on epochs and Optuna TPE, recorded in MLflow.

Each condition is one Tuner with the same budget (``num_samples``) and the same ``max_t``. ASHA
stops weak trials at its rungs; :class:`PrunedAwareOptunaSearch` tells Optuna those trials were
PRUNED (Ray's OptunaSearch tells it COMPLETE with the early value, which biases TPE towards
configurations that merely start fast). A condition with nothing to search runs one trial.
An interrupted search is continued with ``Tuner.restore``: finished trials are kept, unfinished
ones resume from their last checkpoint, the MLflow callback finds their existing runs.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import TrialState
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

from studies.session import Interrupted, Session
from studies.space import Domain
from studies.tracking import MlflowTrialCallback
from studies.trainable import TrialJob, run_trial

log = logging.getLogger(__name__)


def tune_domain(domain: Domain) -> Any:
    """A space-file domain as a Tune domain (OptunaSearch converts it for Optuna)."""
    if domain.kind == "choice":
        return tune.choice(list(domain.values))
    low, high = domain.values
    if domain.kind == "uniform":
        return tune.uniform(low, high)
    if domain.kind == "loguniform":
        return tune.loguniform(low, high)
    return tune.randint(low, high + 1)  # Tune's upper bound is exclusive; ours is inclusive


class PrunedAwareOptunaSearch(OptunaSearch):
    """OptunaSearch that records ASHA-stopped trials as PRUNED and failed ones as FAIL.

    A trial is complete only when it reported ``time_attr >= max_t``; the value told to Optuna
    is then its last ``metric``. The state of every Optuna trial is written to ``log_path``.
    """

    def __init__(self, *args: Any, time_attr: str, max_t: int, log_path: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._time_attr = time_attr
        self._max_t = max_t
        self._log_path = log_path
        self._tune_ids: dict[int, str] = {}

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False) -> None:
        if trial_id in self._completed_trials or trial_id not in self._ot_trials:
            return
        ot_trial = self._ot_trials[trial_id]
        value = (result or {}).get(self.metric)
        reached = int((result or {}).get(self._time_attr, 0))
        if error or value is None:
            state, told = (TrialState.FAIL if error else TrialState.PRUNED), None
        elif reached < self._max_t:
            state, told = TrialState.PRUNED, None
            ot_trial.report(value, reached)  # the stopped rung's value, for TPE
        else:
            state, told = TrialState.COMPLETE, value
        try:
            self._ot_study.tell(ot_trial, told, state=state)
        except Exception as exc:  # e.g. a NaN value: Optuna refuses it, the trial stays FAIL
            log.warning("optuna could not record trial %s: %s", trial_id, exc)
        self._completed_trials.add(trial_id)
        self._tune_ids[ot_trial.number] = trial_id
        self._write_log()

    def _write_log(self) -> None:
        if not self._log_path:
            return
        rows = [
            {"number": t.number, "tune_trial_id": self._tune_ids.get(t.number, ""),
             "state": t.state.name, "value": t.value, **t.params}
            for t in self._ot_study.get_trials(deepcopy=False)
        ]
        fields = list(dict.fromkeys(k for row in rows for k in row))
        with open(self._log_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


class ProgressCallback(tune.Callback):
    """One line per finished trial (Tune's own tables are behind ``verbose=1``)."""

    def __init__(self, max_epochs: int, metric: str) -> None:
        self.max_epochs = max_epochs
        self.metric = metric

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        result = trial.last_result or {}
        epochs = int(result.get("epoch", 0))
        ended = "full budget" if epochs >= self.max_epochs else "stopped by ASHA"
        print(f"  {_name(trial)}: {epochs} epoch(s), {self.metric} "
              f"{result.get(self.metric, float('nan')):.2f} ({ended})", flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        error = str(trial.get_error() or "").strip().splitlines()
        print(f"  {_name(trial)}: FAILED: {error[-1] if error else 'unknown error'}", flush=True)


def _name(trial: Any) -> str:
    own = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in trial.config.items() if "." in k)
    return f"trial {trial.trial_id} [{trial.config['condition']}{' ' + own if own else ''}]"


@dataclass(frozen=True)
class TrialRecord:
    """The end of one Tune trial, as selection needs it."""

    trial_id: str
    condition: str
    config: dict[str, Any]  # the Tune config: condition and the sampled keys
    metrics: dict[str, Any]  # the last reported result
    error: bool

    @property
    def epochs(self) -> int:
        return int(self.metrics.get("epoch", 0))


def run_tuner(
    session: Session, name: str, job: TrialJob, param_space: dict[str, Any],
    tune_config: tune.TuneConfig, expected: int,
) -> list[TrialRecord]:
    """Run (or continue) the Tune experiment ``name`` of this study run (``expected`` trials)."""
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, job=job, fit=session.fit), session.resources
    )
    path = session.experiment_path(name)
    if tune.Tuner.can_restore(path):
        log.info("continuing the Tune experiment %s", path)
        tuner = tune.Tuner.restore(path, trainable, resume_unfinished=True, resume_errored=False)
    else:
        callback = MlflowTrialCallback(
            session.tracker, session.parent_id, job, {**session.tags, "phase": job.phase,
                                                      "tune_experiment": name},
            session.fingerprints, session.plan.max_epochs,
        )
        run_config = tune.RunConfig(
            name=name,
            storage_path=session.storage_path,
            failure_config=tune.FailureConfig(max_failures=session.plan.study.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            callbacks=[callback, ProgressCallback(session.plan.max_epochs, session.plan.study.metric)],
            verbose=session.verbose,
        )
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config,
                           run_config=run_config)
    grid = tuner.fit()
    if len(grid) < expected or grid.num_terminated + grid.num_errors < len(grid):
        # Tune returns normally after Ctrl-C, with its state saved: stop here, resumable.
        raise Interrupted(f"the study was interrupted during {name}; run the same command again "
                          f"to continue it (state in {session.run_dir})")
    records = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(str(result.path)).name
        records.append(TrialRecord(str(trial_id), result.config["condition"], dict(result.config),
                                   metrics, result.error is not None))
    return records


def search_condition(session: Session, condition: str) -> list[TrialRecord]:
    """ASHA + Optuna over the condition's domains (a condition without domains runs one trial)."""
    plan = session.plan
    cond = plan.condition(condition)
    study = plan.study
    job = TrialJob(study.name, "search", str(plan.workspace.root), {condition: cond.flat})
    space = {key: tune_domain(d) for key, d in cond.domains.items()}
    param_space = {"condition": condition, **space}
    if not space:
        tune_config = tune.TuneConfig(num_samples=1)
    else:
        searcher = PrunedAwareOptunaSearch(
            metric=study.metric, mode=study.mode, seed=study.searcher_seed,
            time_attr="epoch", max_t=plan.max_epochs,
            log_path=str(session.run_dir / f"search-{condition}.optuna.csv"),
        )
        scheduler = ASHAScheduler(
            time_attr="epoch", max_t=plan.max_epochs, grace_period=study.grace_period,
            reduction_factor=study.reduction_factor,
        )
        tune_config = tune.TuneConfig(
            metric=study.metric, mode=study.mode, search_alg=searcher, scheduler=scheduler,
            num_samples=plan.budget, max_concurrent_trials=session.concurrency,
        )
    expected = plan.budget if space else 1
    return run_tuner(session, f"search-{condition}", job, param_space, tune_config, expected)
