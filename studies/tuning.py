"""Ray Tune runs of a study: the search of a condition and the confirmation of the winners.

Search: per condition, one Tuner with ASHA on epochs and Optuna (quasi-random start, then TPE;
:mod:`studies.samplers`) over the condition's domains, ``budget`` trials, the same ``max_t``.
The space is sampled define-by-run (:class:`studies.space.ConditionalSpace`): a trial draws
only the keys its configuration uses. ASHA stops weak trials at its rungs; :class:`PrunedAwareOptunaSearch` tells Optuna those trials
were PRUNED (Ray's OptunaSearch tells it COMPLETE with the early value, which biases TPE towards
configurations that merely start fast). A condition with nothing to search runs no search.

Confirm: one Tuner over the grid (condition x seed), so the confirmation runs of all conditions
share the cluster; each run trains the full budget with ``eval.test=true`` and the study's
analyses. The seeds (1000, 1001, ...) are never those of the search trials.

An interrupted Tuner is continued with ``Tuner.restore``: finished trials are kept, unfinished ones
resume from their last checkpoint, and the MLflow callback finds their runs again. A Tuner
interrupted before Tune first saved it is started over (:func:`saved_by_tune`).
"""

from __future__ import annotations

import csv
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import TrialState
from ray import tune
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

from studies.ray_adapter import labelled_trainable
from studies.samplers import SpreadThenTPESampler
from studies.session import Interrupted, Session
from studies.space import ConditionalSpace
from studies.tracking import PARENT_TAG, MlflowTrialCallback, error_line, run_name, trial_error
from studies.trainable import TrialJob, run_trial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialRecord:
    """The end of one Tune trial, as selection and the summary need it."""

    trial_id: str
    condition: str
    config: dict[str, Any]  # the Tune config: condition and the sampled keys
    metrics: dict[str, Any]  # the last reported result
    error: str  # the one-line cause of a failure, '' if none

    @property
    def epochs(self) -> int:
        return int(self.metrics.get("epoch", 0))


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


class RetriedSyncFilter(logging.Filter):
    """Drops Ray's traceback for a background state copy that met a file being rewritten.

    Ray copies Tune's staging folder to the storage in the background while Tune keeps saving its
    state there, each file an atomic write through a ``tmp-`` file. A copy that lists such a file
    before its rename fails with FileNotFoundError; Ray logs a warning with the traceback, and the
    next save copies the folder again (the last copy, at the end of ``fit``, is waited for). That
    one case is logged at debug level; every other message of Ray's syncer passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if (message.startswith("Last sync command failed") and "FileNotFoundError" in message
                and "tmp-" in message):
            log.debug("Tune's background copy met a state file being rewritten; it copies again")
            return False
        return True


def quiet_retried_syncs() -> None:
    """Install :class:`RetriedSyncFilter` on Ray's syncer logger (once)."""
    syncer = logging.getLogger("ray.train._internal.syncer")
    if not any(isinstance(f, RetriedSyncFilter) for f in syncer.filters):
        syncer.addFilter(RetriedSyncFilter())


class ProgressCallback(tune.Callback):
    """One line per finished trial (Tune's own tables are behind ``--verbose``)."""

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
        print(f"  {_name(trial)}: FAILED: {error_line(trial_error(trial))}", flush=True)


def _name(trial: Any) -> str:
    sampled = {k: v for k, v in trial.config.items() if "." in k}
    return f"trial {trial.trial_id} [{run_name(trial.config['condition'], sampled)}]"


def run_tuner(
    session: Session, name: str, job: TrialJob, param_space: dict[str, Any],
    tune_config: tune.TuneConfig, expected: int,
) -> list[TrialRecord]:
    """Run (or continue) the Tune experiment ``name`` of this study run (``expected`` trials)."""
    plan = session.plan
    trainable = labelled_trainable(tune.with_resources(  # the dashboard names each trial's actor
        tune.with_parameters(run_trial, job=job, fit=session.fit), session.resources
    ))
    path = session.experiment_path(name)
    if tune.Tuner.can_restore(path) and not saved_by_tune(Path(path)):
        start_over(session, name, Path(path))
    if tune.Tuner.can_restore(path):
        log.info("continuing the Tune experiment %s", path)
        tuner = tune.Tuner.restore(path, trainable, param_space=param_space,
                                   resume_unfinished=True, resume_errored=False)
    else:
        callback = MlflowTrialCallback(
            session.tracker, session.parent_id, job,
            {**session.tags, "phase": job.phase, "tune_experiment": name},
            session.fingerprints, plan.max_epochs,
        )
        run_config = tune.RunConfig(
            name=name,
            storage_path=session.storage_path,
            failure_config=tune.FailureConfig(max_failures=plan.study.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            # Tune's JSON and CSV logs (what ResultGrid reads), not its TensorBoard logger, which
            # cannot log an epoch's trajectory rows (auto loggers are off: set_quiet_environment).
            callbacks=[callback, ProgressCallback(plan.max_epochs, plan.study.metric),
                       JsonLoggerCallback(), CSVLoggerCallback()],
            verbose=session.verbose,
        )
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config,
                           run_config=run_config)
    quiet_retried_syncs()
    grid = tuner.fit()
    if len(grid) < expected or grid.num_terminated + grid.num_errors < len(grid):
        # Tune returns normally after Ctrl-C, with its state saved: stop here, resumable.
        raise Interrupted(f"the study was interrupted during {name}; run the same command again "
                          f"to continue it (state in {session.run_dir})")
    records = []
    for result in grid:
        metrics = dict(result.metrics or {})
        trial_id = metrics.get("trial_id") or Path(str(result.path)).name
        error = error_line(result.error) if result.error is not None else ""
        records.append(TrialRecord(str(trial_id), result.config["condition"], dict(result.config),
                                   metrics, error))
    return records


def saved_by_tune(path: Path) -> bool:
    """Whether Tune saved experiment ``path`` (its trials and its search algorithm) at least once.

    ``Tuner.can_restore`` asks only for ``tuner.pkl``, which the Tuner writes when it is built,
    before ``fit`` saves anything, and which holds no ``param_space``. A driver killed in that
    window leaves an experiment that "restores" as a new one without the param_space: trials
    without their ``condition``. Tune writes the trials' state first and the search algorithm's
    next (``search_gen_state-*`` for a searcher, ``basic-variant-state-*`` for a grid).
    """
    searcher = any(path.glob("search_gen_state-*.json")) or any(path.glob("basic-variant-state-*.json"))
    return any(path.glob("experiment_state-*.json")) and searcher


def start_over(session: Session, name: str, path: Path) -> None:
    """Discard a Tune experiment that Tune never saved: its folder, and the MLflow runs its
    trials opened before the driver died (Tune does not know them, so they would never finish
    and the new trials would duplicate them)."""
    lost = session.tracker.find_runs(
        f"tags.`{PARENT_TAG}` = '{session.parent_id}' and tags.tune_experiment = '{name}'")
    log.info("the Tune experiment %s was never saved; starting it over (%d run(s) discarded)",
             path, len(lost))
    for run in lost:
        session.tracker.client.delete_run(run.info.run_id)
    shutil.rmtree(path)


def search(session: Session, condition: str) -> list[TrialRecord]:
    """ASHA + Optuna over the condition's domains."""
    plan = session.plan
    cond = plan.condition(condition)
    study = plan.study
    job = TrialJob(study.name, "search", str(plan.workspace.root), {condition: cond.flat})
    sampler = SpreadThenTPESampler(min(study.startup_trials, plan.budget), study.searcher_seed,
                                   tuple(cond.domains))
    searcher = PrunedAwareOptunaSearch(
        space=ConditionalSpace(cond.flat, tuple(cond.domains.values())),
        metric=study.metric, mode=study.mode, sampler=sampler, time_attr="epoch",
        max_t=plan.max_epochs, log_path=str(session.run_dir / f"search-{condition}.optuna.csv"),
    )
    scheduler = ASHAScheduler(
        time_attr="epoch", max_t=plan.max_epochs, grace_period=study.grace_period,
        reduction_factor=study.reduction_factor,
    )
    tune_config = tune.TuneConfig(
        metric=study.metric, mode=study.mode, search_alg=searcher, scheduler=scheduler,
        num_samples=plan.budget, max_concurrent_trials=session.concurrency,
    )
    return run_tuner(session, f"search-{condition}", job, {"condition": condition}, tune_config,
                     plan.budget)


def confirm(session: Session, winners: Mapping[str, Mapping[str, Any]]) -> list[TrialRecord]:
    """Each condition's winner (its sampled values) re-trained with the fresh seeds, tested once."""
    plan = session.plan
    if not winners or not plan.seeds:
        return []
    analyses = {"eval.analyses": ",".join(plan.study.analyses)} if plan.study.analyses else {}
    conditions = {name: {**plan.condition(name).flat, **sampled, "eval.test": True, **analyses}
                  for name, sampled in winners.items()}
    job = TrialJob(plan.study.name, "confirm", str(plan.workspace.root), conditions,
                   {name: dict(sampled) for name, sampled in winners.items()})
    param_space = {"condition": tune.grid_search(list(conditions)),
                   "train.seed": tune.grid_search(list(plan.seeds))}
    tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=session.concurrency)
    return run_tuner(session, "confirm", job, param_space, tune_config,
                     expected=len(conditions) * len(plan.seeds))
