"""Ray Tune runs of a study: the search of a condition and the confirmation of the winners.

Search: per condition, one Tuner with ASHA on epochs and Optuna (quasi-random start, then TPE;
:mod:`studies.samplers`) over the condition's domains, ``budget`` trials, the same ``max_t``.
The space is sampled define-by-run (:class:`studies.space.ConditionalSpace`): a trial draws
only the keys its configuration uses. ASHA stops weak trials at its rungs;
:class:`~studies.searcher.StudySearcher` tells Optuna those trials were PRUNED (Ray's
OptunaSearch tells it COMPLETE with the early value, which biases TPE towards configurations
that merely start fast). A condition with nothing to search runs no search.

Confirm: one Tuner over the grid (condition x seed), so the confirmation runs of all conditions
share the cluster; each run trains the full budget with ``eval.test=true`` and the study's
analyses. The seeds (1000, 1001, ...) are never those of the search trials.

An interrupted Tuner is continued with ``Tuner.restore``: finished trials are kept, unfinished ones
resume from their last checkpoint, and the MLflow callback finds their runs again. A trial that
failed around its training (a lost worker or node, every retry) stops the phase
(:class:`~studies.signals.StudyIncomplete`); continued, it resumes from its last checkpoint. A Tuner
interrupted before Tune first saved it whole (before its first save, or while Ray copied the
saved state to the storage) is started over (:func:`saved_by_tune`).
"""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from tqdm.auto import tqdm

from studies import storage
from studies.failures import error_line, failed_in_training
from studies.frameworks.optuna import GridOnceSampler
from studies.frameworks.ray import pending_nodes
from studies.frameworks.tune import (
    EpochCsvLogger,
    EpochJsonLogger,
    labelled_trainable,
    newest_searcher_state,
    quiet_retried_syncs,
    saved_by_tune,
    sigint_handler_restored,
    trial_error,
)
from studies.progress import (
    DONE,
    INTERVAL_S,
    RUNNING,
    WAITING,
    Progress,
    TrialView,
    describe_wait,
    say_now,
)
from studies.samplers import SpreadThenTPESampler
from studies.searcher import StudySearcher, read_state
from studies.session import Session
from studies.signals import StudyIncomplete
from studies.space import ConditionalSpace, grid_points
from studies.tracking import PARENT_TAG, MlflowTrialCallback
from studies.trainable import StopWhenUnreadable, TrialJob, run_trial, unreadable_stops
from studies.trials import (
    KEY,
    EpochLedger,
    TrialSpec,
    epochs_of,
    full_budget,
    spec_of,
    trial_label,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialRecord:
    """The end of one Tune trial, as selection and the summary need it."""

    trial_id: str
    spec: TrialSpec  # what the trial trained
    metrics: dict[str, Any]  # the last reported result
    error: str  # the one-line cause of a failure, '' if none
    own_failure: bool = True  # a failure raised by its training (not a lost worker, say)

    @property
    def condition(self) -> str:
        return self.spec.condition

    @property
    def epochs(self) -> int:
        return epochs_of(self.metrics)

    @property
    def label(self) -> str:
        return trial_label(self.trial_id, {KEY: self.spec})


class ProgressCallback(tune.Callback):
    """What the driver shows while a Tuner runs: at each trial's end a line saying how it ended,
    and the status line of :class:`~studies.progress.Progress` at each trial's end and at least
    every ``interval`` seconds (Tune calls ``on_step_end`` at every turn of its loop, about ten
    times a second, also while no result arrives). In a terminal the status is a tqdm bar of
    the trials, refreshed every second, instead of lines. A trial is named as everywhere else
    (:func:`studies.trials.trial_label`; its best score beside the trial's name).
    """

    def __init__(self, progress: Progress, *, say: Callable[[str], None] = say_now,
                 interval: float = INTERVAL_S, bar: bool = False,
                 resources: Mapping[str, float] | None = None) -> None:
        self.progress = progress
        self.say = say
        self.interval = interval
        self.bar = bar
        self.resources = dict(resources or {})  # what each trial asks (named while one waits)
        self._last = progress.clock()
        self._ended: set[str] = set()
        self._timed = EpochLedger()  # trial id -> its last epoch (timed here, or restored)
        self._tqdm: Any = None
        self._seeded = False

    def __getstate__(self) -> dict[str, Any]:
        # Pickled into Tune's experiment (a restored Tuner gets it back): the clock and the
        # output of this driver stay here; a restored one gets fresh ones.
        fresh = Progress(self.progress.title, self.progress.expected, self.progress.max_epochs,
                         self.progress.metric, self.progress.mode, self.progress.slots,
                         groups=self.progress.groups, named_after=self.progress.named_after)
        return {**self.__dict__, "progress": fresh, "say": say_now, "_tqdm": None, "_last": 0.0,
                "_ended": set(), "_timed": EpochLedger()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.progress.started = self._last = self.progress.clock()
        self._seeded = False

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        spec = spec_of(trial.config)
        if self._timed.knows(trial.trial_id) and not self._timed.admit(trial.trial_id,
                                                                       epochs_of(result)):
            # the epoch a restored trial continues after, reported again
            # (studies.trainable.resume_point): no epoch's time
            self.progress.on_score(trial.trial_id, result, spec.name)
            return
        self.progress.on_result(trial.trial_id, result, spec.name, spec.condition)

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._timed.open(trial.trial_id, epochs_of(trial.last_result))
        self.progress.on_start(trial.trial_id)

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        if not self._seeded:  # a restored Tuner's trials come with their last results
            self._seeded = True
            for trial in trials:
                self.progress.on_score(trial.trial_id, trial.last_result or {},
                                       spec_of(trial.config).name)
        due = 1.0 if self.bar else self.interval
        if self.progress.clock() - self._last >= due:
            self._status(trials)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        result = trial.last_result or {}
        epochs = epochs_of(result)
        ended = "full budget" if full_budget(epochs, self.progress.max_epochs) else "stopped by ASHA"
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
            self.progress.on_trial_end(epochs_of(trial.last_result))
        self._write(f"  {trial_label(trial.trial_id, trial.config)}: {how}")

    def _status(self, trials: list) -> None:
        self._last = self.progress.clock()
        states = [self._state(t) for t in trials]
        line = self.progress.line(states, self._waits_for)
        if not self.bar:
            self._write(line)
            return
        if self._tqdm is None:
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
        epochs = epochs_of(trial.last_result)
        group = spec_of(trial.config).condition
        if trial.trial_id in self._ended or trial.status in ("TERMINATED", "ERROR"):
            return TrialView(trial.trial_id, DONE, epochs, group)
        state = RUNNING if trial.status == "RUNNING" else WAITING
        label = trial_label(trial.trial_id, trial.config)
        return TrialView(trial.trial_id, state, epochs, group, label)

    def _waits_for(self) -> str:
        """What a trial that waits to start waits for (:func:`studies.progress.describe_wait`)."""
        return describe_wait(self.resources, ray.cluster_resources(), ray.available_resources(),
                             pending_nodes())


def run_tuner(
    session: Session, name: str, job: TrialJob, conditions: tuple[str, ...],
    param_space: dict[str, Any], tune_config: tune.TuneConfig, expected: int, title: str,
) -> list[TrialRecord]:
    """Run (or continue) the Tune experiment ``name`` of this study run: ``expected`` trials of
    ``conditions``; ``title`` heads its status lines. Returns every trial's end.

    Raises:
        Interrupted: a stop signal came.
        StudyIncomplete: Tune returned without every trial ended (:func:`check_ended`), or a
            trial failed outside its training (:func:`trial_records`).
    """
    trainable = labelled_trainable(tune.with_resources(  # the dashboard names each trial's actor
        tune.with_parameters(run_trial, job=job, fit=session.fit), session.resources
    ), trial_label)
    tuner = restore_tuner(session, name, trainable, param_space)
    if tuner is None:
        callbacks = tuner_callbacks(session, name, job.phase, conditions, title, expected)
        tuner = new_tuner(session, name, trainable, param_space, tune_config, callbacks)
    quiet_retried_syncs()
    session.check_stop()
    with sigint_handler_restored(lambda: session.stops.note(signal.SIGINT)), unreadable_stops():
        grid = tuner.fit()
    session.check_stop()  # Tune stopped on a stop signal and returned normally
    check_ended(grid, expected, title)
    return trial_records(grid, session.experiment_path(name), title)


def restore_tuner(session: Session, name: str, trainable: type,
                  param_space: dict[str, Any]) -> tune.Tuner | None:
    """The experiment ``name`` restored; ``None`` when there is none to restore. One that Tune
    never saved whole is discarded first (:func:`start_over`). A trial that failed is continued
    from its last checkpoint: one whose training failed fails again where it did; one lost
    around it (a worker, a node) gets its retry."""
    path = session.experiment_path(name)
    if tune.Tuner.can_restore(path) and not saved_by_tune(path):
        start_over(session, name, path)
    if not tune.Tuner.can_restore(path):
        return None
    log.info("continuing the Tune experiment %s", path)
    state = newest_searcher_state(path)
    if state is not None:
        read_state(state)  # one line naming it if it is not the JSON a searcher writes
    where, filesystem = storage.tune_storage(path)
    return tune.Tuner.restore(where, trainable, param_space=param_space, storage_filesystem=filesystem,
                              resume_unfinished=True, resume_errored=True)


def new_tuner(session: Session, name: str, trainable: type, param_space: dict[str, Any],
              tune_config: tune.TuneConfig, callbacks: list[tune.Callback]) -> tune.Tuner:
    """A new Tuner of experiment ``name`` in the study run's storage: one checkpoint kept per
    trial, the study's retries of a lost trial."""
    where, filesystem = storage.tune_storage(session.storage_path)
    run_config = tune.RunConfig(
        name=name,
        storage_path=where,
        storage_filesystem=filesystem,
        failure_config=tune.FailureConfig(max_failures=session.plan.study.max_failures),
        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
        callbacks=callbacks,
        verbose=session.verbose,
    )
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config,
                      run_config=run_config)


def tuner_callbacks(session: Session, name: str, phase: str, conditions: tuple[str, ...],
                    title: str, expected: int) -> list[tune.Callback]:
    """What a Tuner's trials leave on the driver: their MLflow runs, the status lines, and
    Tune's JSON and CSV logs (what ResultGrid reads), not its TensorBoard logger, which cannot
    log an epoch's trajectory rows (Tune's automatic loggers are off: set_quiet_environment)."""
    plan = session.plan
    recorder = MlflowTrialCallback(
        session.tracker, session.parent_id, {**session.tags, "phase": phase, "tune_experiment": name},
        session.fingerprints, {c.name: c.config.epochs for c in plan.conditions},
        plan.storage_root,
    )
    # StopWhenUnreadable first: a trial whose node cannot read its data is not a failed run
    return [StopWhenUnreadable(session.experiment_path(name)), recorder,
            progress_callback(session, conditions, title, expected),
            EpochJsonLogger(), EpochCsvLogger()]


def check_ended(grid: tune.ResultGrid, expected: int, title: str) -> None:
    """Every one of the ``expected`` trials of the Tuner ended: Tune holds it TERMINATED (it ran
    its budget, ASHA stopped it, or it had ended under an earlier driver) or ERROR.

    Not whether its last result is marked ``done``: a Tune 2.60 controller restored from a
    state saved while a trial's STOP was queued (ASHA stopped it as its checkpoint was being
    saved, and the driver was killed before the trial was saved as ended) stops that trial
    again on its first result, which is not marked ``done``; the trial ended, and the phase
    goes on. A stop signal is no business of this check: it raised Interrupted before.

    Raises:
        StudyIncomplete: Tune returned with a trial not ended and no stop signal came.
    """
    ended = grid.num_terminated + grid.num_errors
    if ended < max(expected, len(grid)):
        raise StudyIncomplete(
            f"Tune returned with {max(expected, len(grid)) - ended} of {max(expected, len(grid))} "
            f"trial(s) of {title} not ended; run the same command again to continue them")


def trial_records(grid: tune.ResultGrid, path: str, title: str) -> list[TrialRecord]:
    """Each trial of a finished Tuner (experiment ``path``) as a :class:`TrialRecord`.

    Raises:
        StudyIncomplete: a trial failed outside its training (every retry): the phase is not
            done; run again, such trials continue from their checkpoints.
    """
    configs = {}
    if any(result.config is None for result in grid):  # a trial failed before its first result
        configs = {str(t.path): t.config for t in tune.ExperimentAnalysis(path).trials}
    records = [_record(result, configs) for result in grid]
    lost = [r for r in records if r.error and not r.own_failure]
    if lost:
        raise StudyIncomplete(
            f"{len(lost)} trial(s) of {title} failed outside their training ({lost[0].label}: "
            f"{lost[0].error}); run the same command again to continue them")
    return records


def _record(result: Any, configs: Mapping[str, dict[str, Any]]) -> TrialRecord:
    """A trial that ended, as a TrialRecord. The config of a trial that failed before its first
    result is not in its result: ``configs`` has it (trial folder -> config)."""
    metrics = dict(result.metrics or {})
    trial_id = metrics.get("trial_id") or Path(str(result.path)).name
    error = error_line(result.error) if result.error is not None else ""
    config = result.config or configs[str(result.path)]
    return TrialRecord(str(trial_id), spec_of(config), metrics, error,
                       own_failure=failed_in_training(result.error))


def progress_callback(session: Session, conditions: tuple[str, ...], title: str,
                      expected: int) -> ProgressCallback:
    """The status lines of a Tuner over ``conditions``."""
    plan, options = session.plan, session.progress
    epochs = max(plan.condition(c).config.epochs for c in conditions)
    # Every condition plans as many trials (a search has one; a confirmation, the seeds).
    groups = dict.fromkeys(conditions, expected // len(conditions))
    progress = Progress(title, expected, epochs, plan.study.metric, plan.study.mode,
                        session.concurrency, options.clock, groups, options.named_after)
    return ProgressCallback(progress, say=options.say, interval=options.interval,
                            bar=options.use_bar(), resources=session.resources)


def start_over(session: Session, name: str, path: str) -> None:
    """Discard a Tune experiment that Tune never saved whole: its folder, and the MLflow runs its
    trials opened before the driver died (Tune does not know them, so they would never finish
    and the new trials would duplicate them)."""
    lost = session.tracker.find_runs(
        f"tags.`{PARENT_TAG}` = '{session.parent_id}' and tags.tune_experiment = '{name}'")
    log.info("the Tune experiment %s was never saved whole; starting it over (%d run(s) discarded)",
             path, len(lost))
    for run in lost:
        session.tracker.client.delete_run(run.info.run_id)
    storage.remove_folder(path)


def search(session: Session, condition: str) -> list[TrialRecord]:
    """ASHA + Optuna over the condition's domains."""
    plan = session.plan
    cond = plan.condition(condition)
    study = plan.study
    name = f"search-{condition}"
    job = TrialJob(study.name, "search", str(plan.workspace.root),
                   experiment=session.experiment_path(name), data=session.data)
    grid = grid_points(cond.domains)
    trials = cond.trials(plan.budget)
    sampler = (GridOnceSampler(grid, seed=study.searcher_seed) if grid is not None else
               SpreadThenTPESampler(plan.startup_trials, study.searcher_seed, tuple(cond.domains)))
    searcher = StudySearcher(
        ConditionalSpace(cond.flat, tuple(cond.domains.values())),
        functools.partial(TrialSpec.resolve, condition, cond.flat),
        metric=study.metric, mode=study.mode, sampler=sampler, max_t=cond.config.epochs,
        log_path=str(session.run_dir / f"search-{condition}.optuna.csv"), cost=study.cost,
    )
    if plan.warm is not None:  # an earlier study's trials, observed before the first is asked for
        searcher.study.add_trials(plan.warm.trials(condition, cond.domains, bool(study.cost)))
    scheduler = ASHAScheduler(
        time_attr="epoch", max_t=cond.config.epochs, grace_period=study.grace_period,
        reduction_factor=study.reduction_factor,
    ) if plan.early_stopping else FIFOScheduler()  # a paper's grid trains every point to the end
    tune_config = tune.TuneConfig(
        metric=study.metric, mode=study.mode, search_alg=searcher, scheduler=scheduler,
        num_samples=trials, max_concurrent_trials=session.concurrency,
    )
    return run_tuner(session, name, job, (condition,), {}, tune_config, trials,
                     f"search {condition}")


def confirm(session: Session, winners: Mapping[str, Mapping[str, Any]]) -> list[TrialRecord]:
    """Each condition's winner (its sampled values) re-trained with the fresh seeds, tested once.

    The runs are listed in the plan's condition order, then the seeds' order, whatever the order
    of ``winners`` (state.json gives them back sorted by name): Tune keeps in a grid trial's
    saved config only the index of its value in the grid (a placeholder, as a TrialSpec is not a
    primitive), and a restored Tuner resolves every trial against the grid it is given again.
    Listed in another order, a resumed confirmation would continue each unfinished seed under
    another condition's spec.
    """
    plan = session.plan
    if not winners or not plan.seeds:
        return []
    analyses = {"eval.analyses": ",".join(plan.analyses)} if plan.analyses else {}
    chosen = sorted((plan.condition(name) for name in winners), key=plan.conditions.index)
    specs = [TrialSpec.resolve(c.name, {**c.flat, "eval.test": True, **analyses},
                               {**winners[c.name], "train.seed": seed})
             for c in chosen for seed in plan.seeds]
    job = TrialJob(plan.study.name, "confirm", str(plan.workspace.root),
                   experiment=session.experiment_path("confirm"), data=session.data)
    tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=session.concurrency)
    return run_tuner(session, "confirm", job, tuple(winners), {KEY: tune.grid_search(specs)},
                     tune_config, expected=len(specs), title="confirm")
