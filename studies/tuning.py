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
import functools
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import TrialState
from ray import tune
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.optuna import OptunaSearch

from studies.progress import DONE, INTERVAL_S, RUNNING, WAITING, Progress, TrialView, say_now
from studies.ray_adapter import labelled_trainable
from studies.samplers import GridOnceSampler, SpreadThenTPESampler
from studies.session import Interrupted, Session
from studies.space import ConditionalSpace, grid_points
from studies.tracking import PARENT_TAG, MlflowTrialCallback, error_line, run_name, trial_error
from studies.trainable import MarkReported, TrialJob, run_trial

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
    """What the driver shows while a Tuner runs: at each trial's end a line saying how it ended,
    and the status line of :class:`~studies.progress.Progress` at each trial's end and at least
    every ``interval`` seconds (Tune calls ``on_step_end`` at every turn of its loop, about ten
    times a second, also while no result arrives). In a terminal the status is a tqdm bar of
    the trials, refreshed every second, instead of lines.
    """

    def __init__(self, progress: Progress, *, say: Callable[[str], None] = say_now,
                 interval: float = INTERVAL_S, bar: bool = False,
                 describe: Callable[[Mapping[str, Any]], str] | None = None) -> None:
        self.progress = progress
        self.say = say
        self.interval = interval
        self.bar = bar
        self.describe = describe or sampled_values  # a trial's config -> what tells it apart
        self._last = progress.clock()
        self._ended: set[str] = set()
        self._tqdm: Any = None
        self._seeded = False

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into Tune's experiment (a restored Tuner gets it back): the clock and the
        # output of this driver stay here; a restored one gets fresh ones.
        fresh = Progress(self.progress.title, self.progress.expected, self.progress.max_epochs,
                         self.progress.metric, self.progress.mode, self.progress.slots)
        return {**self.__dict__, "progress": fresh, "say": say_now, "_tqdm": None, "_last": 0.0,
                "_ended": set()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.progress.started = self._last = self.progress.clock()
        self._seeded = False

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        self.progress.on_result(trial.trial_id, result, self._values(trial))

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if not self._seeded:  # a restored Tuner's trials come with their last results
            self._seeded = True
            for trial in trials:
                self.progress.on_score(trial.trial_id, trial.last_result or {}, self._values(trial))
        due = 1.0 if self.bar else self.interval
        if self.progress.clock() - self._last >= due:
            self._status(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        result = trial.last_result or {}
        epochs = int(result.get("epoch", 0))
        ended = "full budget" if epochs >= self.progress.max_epochs else "stopped by ASHA"
        self._ended_line(trial, f"{epochs} epoch(s), {self.progress.metric} "
                                f"{result.get(self.progress.metric, float('nan')):.2f} ({ended})")
        self._status(trials)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._ended_line(trial, f"FAILED: {error_line(trial_error(trial))}")
        self._status(trials)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def _ended_line(self, trial: Any, how: str) -> None:
        if trial.trial_id not in self._ended:
            self._ended.add(trial.trial_id)
            self.progress.on_trial_end(int((trial.last_result or {}).get("epoch", 0)))
        self._write(f"  {_name(trial)}: {how}")

    def _status(self, trials: list) -> None:
        self._last = self.progress.clock()
        states = [self._state(t) for t in trials]
        line = self.progress.line(states)
        if not self.bar:
            self._write(line)
            return
        if self._tqdm is None:
            from tqdm.auto import tqdm

            self._tqdm = tqdm(total=self.progress.expected, desc=self.progress.title, unit="trial",
                              bar_format="{desc} {n}/{total} trials |{bar}| {postfix}")
        self._tqdm.n = sum(s.state == DONE for s in states)
        self._tqdm.set_postfix_str(line.split(": ", 1)[1].split("; ", 1)[-1])

    def _write(self, line: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(line)
        else:
            self.say(line)

    def _state(self, trial: Any) -> TrialView:
        epochs = int((trial.last_result or {}).get("epoch", 0))
        if trial.trial_id in self._ended or trial.status in ("TERMINATED", "ERROR"):
            return TrialView(trial.trial_id, DONE, epochs)
        return TrialView(trial.trial_id, RUNNING if trial.status == "RUNNING" else WAITING, epochs)

    def _values(self, trial: Any) -> str:
        return self.describe(trial.config)


def sampled_values(config: Mapping[str, Any]) -> str:
    """``objective.eta=0.237``: the dotted keys of a Tune config (what a trial sampled)."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in config.items() if "." in k)


def _name(trial: Any) -> str:
    sampled = {k: v for k, v in trial.config.items() if "." in k}
    return f"trial {trial.trial_id} [{run_name(trial.config['condition'], sampled)}]"


def run_tuner(
    session: Session, name: str, job: TrialJob, param_space: dict[str, Any],
    tune_config: tune.TuneConfig, expected: int, title: str,
) -> list[TrialRecord]:
    """Run (or continue) the Tune experiment ``name`` of this study run (``expected`` trials;
    ``title`` heads its status lines)."""
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
            session.fingerprints, {c.name: c.config.epochs for c in plan.conditions},
        )
        run_config = tune.RunConfig(
            name=name,
            storage_path=session.storage_path,
            failure_config=tune.FailureConfig(max_failures=plan.study.max_failures),
            checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
            # Tune's JSON and CSV logs (what ResultGrid reads), not its TensorBoard logger, which
            # cannot log an epoch's trajectory rows (auto loggers are off: set_quiet_environment).
            # MarkReported before the MLflow callback: a checkpoint is marked before its result
            # is recorded (studies.trainable).
            callbacks=[MarkReported(), callback, progress_callback(session, job, title, expected),
                       JsonLoggerCallback(), CSVLoggerCallback()],
            verbose=session.verbose,
        )
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config,
                           run_config=run_config)
    quiet_retried_syncs()
    session.check_stop()
    grid = tuner.fit()
    session.check_stop()  # Tune stopped on a stop signal and returned normally
    ended = [r for r in grid if r.error is not None or (r.metrics or {}).get("done")]
    if len(ended) < expected or len(ended) < len(grid):
        # Tune returns normally after Ctrl-C, with its state saved: stop here, resumable. A
        # trial it stopped then is TERMINATED too, but without its last result marked done.
        log.info("the Tune experiment %s was interrupted (state in %s)", name, session.run_dir)
        raise Interrupted()
    configs = {}
    if any(result.config is None for result in grid):  # a trial failed before its first result
        configs = {str(t.path): t.config for t in tune.ExperimentAnalysis(path).trials}
    return [_record(result, configs) for result in grid]


def _record(result: Any, configs: Mapping[str, dict[str, Any]]) -> TrialRecord:
    """A trial that ended, as a TrialRecord. The config of a trial that failed before its first
    result is not in its result: ``configs`` has it (trial folder -> config)."""
    metrics = dict(result.metrics or {})
    trial_id = metrics.get("trial_id") or Path(str(result.path)).name
    error = error_line(result.error) if result.error is not None else ""
    config = dict(result.config or configs.get(str(result.path)) or {})
    return TrialRecord(str(trial_id), str(config.get("condition", "")), config, metrics, error)


def progress_callback(session: Session, job: TrialJob, title: str, expected: int) -> ProgressCallback:
    """The status lines of a Tuner: a search's best shows its sampled values, a confirmation's
    its condition, the winner's values and the seed."""
    plan, options = session.plan, session.progress
    epochs = max(plan.condition(c).config.epochs for c in job.conditions)
    progress = Progress(title, expected, epochs, plan.study.metric, plan.study.mode,
                        session.concurrency, options.clock)
    describe = sampled_values
    if job.phase == "confirm":
        describe = functools.partial(_confirmation_values, job)
    return ProgressCallback(progress, say=options.say, interval=options.interval,
                            bar=options.use_bar(), describe=describe)


def _confirmation_values(job: TrialJob, config: Mapping[str, Any]) -> str:
    return ", ".join(filter(None, [str(config.get("condition")), sampled_values(job.shown(config))]))


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
    name = f"search-{condition}"
    job = TrialJob(study.name, "search", str(plan.workspace.root), {condition: cond.flat},
                   experiment=session.experiment_path(name))
    grid = grid_points(cond.domains)
    trials = cond.trials(plan.budget)
    sampler = (GridOnceSampler(grid, seed=study.searcher_seed) if grid is not None else
               SpreadThenTPESampler(plan.startup_trials, study.searcher_seed, tuple(cond.domains)))
    searcher = PrunedAwareOptunaSearch(
        space=ConditionalSpace(cond.flat, tuple(cond.domains.values())),
        metric=study.metric, mode=study.mode, sampler=sampler, time_attr="epoch",
        max_t=cond.config.epochs, log_path=str(session.run_dir / f"search-{condition}.optuna.csv"),
    )
    scheduler = ASHAScheduler(
        time_attr="epoch", max_t=cond.config.epochs, grace_period=study.grace_period,
        reduction_factor=study.reduction_factor,
    ) if plan.early_stopping else FIFOScheduler()  # a paper's grid trains every point to the end
    tune_config = tune.TuneConfig(
        metric=study.metric, mode=study.mode, search_alg=searcher, scheduler=scheduler,
        num_samples=trials, max_concurrent_trials=session.concurrency,
    )
    return run_tuner(session, name, job, {"condition": condition}, tune_config, trials,
                     f"search {condition}")


def confirm(session: Session, winners: Mapping[str, Mapping[str, Any]]) -> list[TrialRecord]:
    """Each condition's winner (its sampled values) re-trained with the fresh seeds, tested once."""
    plan = session.plan
    if not winners or not plan.seeds:
        return []
    analyses = {"eval.analyses": ",".join(plan.analyses)} if plan.analyses else {}
    conditions = {name: {**plan.condition(name).flat, **sampled, "eval.test": True, **analyses}
                  for name, sampled in winners.items()}
    job = TrialJob(plan.study.name, "confirm", str(plan.workspace.root), conditions,
                   {name: dict(sampled) for name, sampled in winners.items()},
                   experiment=session.experiment_path("confirm"))
    param_space = {"condition": tune.grid_search(list(conditions)),
                   "train.seed": tune.grid_search(list(plan.seeds))}
    tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=session.concurrency)
    return run_tuner(session, "confirm", job, param_space, tune_config,
                     expected=len(conditions) * len(plan.seeds), title="confirm")
