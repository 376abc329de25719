"""A condition's search: Optuna's ask-and-tell interface behind Ray Tune's ``Searcher``.

Tune asks for a trial (:meth:`StudySearcher.suggest`); Optuna's study gives one
(``study.ask``), the condition's define-by-run space draws its values
(:class:`~studies.space.ConditionalSpace`), and the trial is resolved once, there, on the driver
(:class:`~studies.trials.TrialSpec`) and handed to Tune as the trial's whole config. Each epoch's
score is reported to the Optuna trial (its intermediate values, which TPE reads for pruned
trials); at the end Optuna is told how the trial ended:

- COMPLETE with its last score when it reached ``max_t`` epochs;
- PRUNED when ASHA stopped it earlier (Ray's own ``OptunaSearch`` tells Optuna such a trial
  COMPLETED with its early score, which biases TPE towards configurations that merely start
  fast, docs/reference-code.md section 7);
- FAIL when it failed.

A study with a second objective (its ``cost``, a metric every epoch reports, e.g. the epoch's
seconds) makes the Optuna study two-objective: a COMPLETE trial is told its last score and the
mean of its epochs' cost, and TPE samples in its multi-objective mode (Optuna's MOTPE). ASHA still
stops trials on the score alone: Tune's schedulers rank one metric, and a rung that also weighed
cost would stop a slow trial whatever its score, before its score is known. Optuna keeps no
per-epoch values for a multi-objective trial (``Trial.report`` raises there), so its pruned trials
carry no intermediate values; TPE treats them as it treats any pruned trial without them. The
design is ours rather than Ray's ``OptunaSearch`` with a metric list, which would also tell
Optuna a stopped trial COMPLETE with its early values.

Tune's ``Searcher`` (``suggest``, ``on_trial_result``, ``on_trial_complete``, ``save``/``restore``
for ``Tuner.restore``) and Optuna's ``ask``/``tell`` are used. The searcher's state is JSON
(:data:`FORMAT`: its Optuna trials, and which Tune trial each is), read back as data, never
executed: the storage may be a bucket others can write (:func:`read_state`). Every Optuna
trial's state is written to ``log_path`` (CSV) as it ends.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher

from icr.errors import UserError
from studies import storage
from studies.frameworks.optuna import study_from_json, trials_to_json
from studies.space import ConditionalSpace
from studies.space_analysis import quiet_optuna
from studies.trials import KEY, EpochLedger, TrialSpec, full_budget

log = logging.getLogger(__name__)

FORMAT = "icr-studies searcher state 1"  # the "format" field of a searcher's saved state
COST_ATTR = "cost_per_epoch"  # a multi-objective trial's user attribute: epoch -> its cost


class StudySearcher(Searcher):
    """Optuna's study over a condition's space, as a Tune searcher.

    Args:
        space: the condition's define-by-run space (draws only the keys a trial uses).
        resolve: turns a trial's drawn values into its :class:`TrialSpec`.
        metric, mode: what is optimised (``val_rsum``, ``max``).
        sampler: Optuna's sampler (:mod:`studies.samplers`).
        max_t: a trial's full budget in ``time_attr`` units (epochs).
        log_path: where every Optuna trial's state is written (CSV), or ``None``.
        cost: a second objective to minimise (a reported metric, its mean over the trial's
            epochs), or '' for one objective.
    """

    def __init__(self, space: ConditionalSpace, resolve: Callable[[Mapping[str, Any]], TrialSpec],
                 *, metric: str, mode: str, sampler: optuna.samplers.BaseSampler, max_t: int,
                 time_attr: str = "epoch", log_path: str | None = None, cost: str = "") -> None:
        super().__init__(metric=metric, mode=mode)
        self.space = space
        self.resolve = resolve
        self.max_t = max_t
        self.time_attr = time_attr
        self.log_path = log_path
        self.cost = cost
        self.directions = ["maximize" if mode == "max" else "minimize"] + (["minimize"] if cost else [])
        with quiet_optuna():  # the status line says what is searched
            self.study = optuna.create_study(directions=self.directions, sampler=sampler)
        # Tune trial id -> its Optuna trial (live while it runs; after a restore, an ended one is
        # the study's record of it)
        self.trials: dict[str, optuna.trial.Trial | optuna.trial.FrozenTrial] = {}
        self.ended: dict[int, str] = {}  # Optuna trial number -> Tune trial id, once told
        self.reported = EpochLedger()  # Tune trial id -> its last step reported to Optuna

    def suggest(self, trial_id: str) -> dict[str, Any] | None:
        if trial_id not in self.trials:
            trial = self.study.ask()
            self.space(trial)
            self.trials[trial_id] = trial
        return {KEY: self.resolve(dict(self.trials[trial_id].params))}

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        value, step = result.get(self.metric), result.get(self.time_attr)
        trial = self.trials.get(trial_id)
        if trial is None or trial.number in self.ended or not _finite(value) or step is None:
            return
        if self.cost:  # Optuna keeps no per-epoch values of a multi-objective trial
            spent = result.get(self.cost)
            if _finite(spent):
                trial.set_user_attr(COST_ATTR, {**trial.user_attrs.get(COST_ATTR, {}),
                                                str(int(step)): float(spent)})
            return
        if not self.reported.knows(trial_id):  # Optuna's values, restored with the searcher
            told = self.study.get_trials(deepcopy=False)[trial.number].intermediate_values
            self.reported.open(trial_id, max(told, default=-math.inf))
        if self.reported.admit(trial_id, int(step)):  # not an epoch reported again after a restore
            trial.report(float(value), int(step))

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        trial = self.trials.get(trial_id)
        if trial is None or trial.number in self.ended:
            return
        value = (result or {}).get(self.metric)
        reached = int((result or {}).get(self.time_attr, 0))
        if error or not _finite(value):
            state, told = (TrialState.FAIL if error else TrialState.PRUNED), None
        elif not full_budget(reached, self.max_t):
            state, told = TrialState.PRUNED, None  # stopped by ASHA: its reports stay, for TPE
        elif self.cost:
            spent = list(trial.user_attrs.get(COST_ATTR, {}).values())
            state, told = ((TrialState.COMPLETE, [float(value), sum(spent) / len(spent)]) if spent
                           else (TrialState.FAIL, None))  # no cost reported: not on any front
        else:
            state, told = TrialState.COMPLETE, float(value)
        self.study.tell(trial, told, state=state)
        self.ended[trial.number] = trial_id
        self._write_log()

    def save(self, checkpoint_path: str) -> None:
        """Write the searcher's state as JSON: its Optuna trials and which Tune trial each is."""
        state = {"format": FORMAT, "trials": trials_to_json(self.study),
                 "tune_trials": {tid: t.number for tid, t in self.trials.items()},
                 "ended": {str(number): tid for number, tid in self.ended.items()}}
        Path(checkpoint_path).write_text(json.dumps(state))

    def restore(self, checkpoint_path: str) -> None:
        """Continue from a state :meth:`save` wrote: the same trials, numbers and values, on a
        new Optuna study with this searcher's sampler."""
        path = Path(checkpoint_path)
        state = read_state(path)
        try:
            with quiet_optuna():
                study, live = study_from_json(state["trials"], self.directions, self.study.sampler)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _not_ours(path, exc) from None
        self.study = study
        self.trials = {tid: live[number] for tid, number in state["tune_trials"].items()}
        self.ended = {int(number): tid for number, tid in state["ended"].items()}
        self.reported = EpochLedger()

    def _write_log(self) -> None:
        if not self.log_path:
            return
        rows = [{"number": t.number, "tune_trial_id": self.ended.get(t.number, ""),
                 "state": t.state.name, "value": t.values[0] if t.values else None,
                 **({"cost": t.values[1] if t.values else None} if self.cost else {}), **t.params}
                for t in self.study.get_trials(deepcopy=False)]
        fields = list(dict.fromkeys(k for row in rows for k in row))
        with open(self.log_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def read_state(path: Path | str) -> dict[str, Any]:
    """A searcher state as :meth:`StudySearcher.save` writes it, checked field by field; ``path``
    is a file or a URI in the study's storage (:func:`studies.storage.read_bytes`).

    Raises:
        UserError: one line naming the file, when it is anything else (a pickle of an earlier
            version, a damaged or foreign file): it is never executed.
    """
    try:
        state = json.loads(storage.read_bytes(str(path)))
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT!r}")
        trials, tune_trials, ended = state["trials"], state["tune_trials"], state["ended"]
        numbers = {t["number"] for t in trials}
        if not (isinstance(tune_trials, dict) and isinstance(ended, dict)
                and set(tune_trials.values()) <= numbers
                and {int(n) for n in ended} <= numbers):
            raise ValueError("its Tune trials name Optuna trials it does not hold")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _not_ours(path, exc) from None
    return state


def _not_ours(path: Path | str, problem: Exception) -> UserError:
    return UserError(
        f"the searcher state {path} is not one this version of the platform wrote ({problem}); "
        "it is read as JSON only, never executed: start the study over with --fresh")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
