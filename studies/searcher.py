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
  fast, REFERENCE_NOTES section 7);
- FAIL when it failed.

Only public APIs are used: Tune's ``Searcher`` (``suggest``, ``on_trial_result``,
``on_trial_complete``, ``save``/``restore`` for ``Tuner.restore``) and Optuna's ``ask``/``tell``.
Every Optuna trial's state is written to ``log_path`` (CSV) as it ends.
"""

from __future__ import annotations

import csv
import logging
import math
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import optuna
from optuna.trial import TrialState
from ray.tune.search import Searcher

from studies.space import ConditionalSpace
from studies.trials import KEY, TrialSpec

log = logging.getLogger(__name__)


class StudySearcher(Searcher):
    """Optuna's study over a condition's space, as a Tune searcher.

    Args:
        space: the condition's define-by-run space (draws only the keys a trial uses).
        resolve: turns a trial's drawn values into its :class:`TrialSpec`.
        metric, mode: what is optimised (``val_rsum``, ``max``).
        sampler: Optuna's sampler (:mod:`studies.samplers`).
        max_t: a trial's full budget in ``time_attr`` units (epochs).
        log_path: where every Optuna trial's state is written (CSV), or ``None``.
    """

    def __init__(self, space: ConditionalSpace, resolve: Callable[[Mapping[str, Any]], TrialSpec],
                 *, metric: str, mode: str, sampler: optuna.samplers.BaseSampler, max_t: int,
                 time_attr: str = "epoch", log_path: str | None = None) -> None:
        super().__init__(metric=metric, mode=mode)
        self.space = space
        self.resolve = resolve
        self.max_t = max_t
        self.time_attr = time_attr
        self.log_path = log_path
        direction = "maximize" if mode == "max" else "minimize"
        self.study = optuna.create_study(direction=direction, sampler=sampler)
        self.trials: dict[str, optuna.trial.Trial] = {}  # Tune trial id -> its Optuna trial
        self.ended: dict[int, str] = {}  # Optuna trial number -> Tune trial id, once told

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
        elif reached < self.max_t:
            state, told = TrialState.PRUNED, None  # stopped by ASHA: its reports stay, for TPE
        else:
            state, told = TrialState.COMPLETE, float(value)
        self.study.tell(trial, told, state=state)
        self.ended[trial.number] = trial_id
        self._write_log()

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))

    def _write_log(self) -> None:
        if not self.log_path:
            return
        rows = [{"number": t.number, "tune_trial_id": self.ended.get(t.number, ""),
                 "state": t.state.name, "value": t.value, **t.params}
                for t in self.study.get_trials(deepcopy=False)]
        fields = list(dict.fromkeys(k for row in rows for k in row))
        with open(self.log_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
