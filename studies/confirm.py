"""Confirm: each condition's winner re-trained with N fresh seeds and tested once.

One Tuner over the grid (condition x seed), so the confirmation runs of all conditions share the
cluster; each run is a trial (a child run in MLflow with ``phase=confirm``) that trains the full
budget with ``eval.test=true``: ``fit`` evaluates its best-validation checkpoint on test once, at
the end. The seeds (1000, 1001, ...) are never those of the search trials.
"""

from __future__ import annotations

from ray import tune

from studies.search import TrialRecord, run_tuner
from studies.select import Winner
from studies.session import Session
from studies.trainable import TrialJob


def confirm(session: Session, winners: dict[str, Winner]) -> list[TrialRecord]:
    plan = session.plan
    if not winners or not plan.seeds:
        return []
    conditions = {
        name: {**plan.condition(name).flat, **w.sampled, "eval.test": True}
        for name, w in winners.items()
    }
    job = TrialJob(plan.study.name, "confirm", str(plan.workspace.root), conditions)
    param_space = {
        "condition": tune.grid_search(list(conditions)),
        "train.seed": tune.grid_search(list(plan.seeds)),
    }
    tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=session.concurrency)
    return run_tuner(session, "confirm", job, param_space, tune_config,
                     expected=len(conditions) * len(plan.seeds))
