"""Optuna behaviour of one version that the platform works around (tested with Optuna 5.0.0).

:class:`GridOnceSampler`: Optuna's ``GridSampler`` stops its study when the grid is exhausted
(``study.stop()`` in its ``after_trial``), which Optuna allows only inside ``Study.optimize``;
the platform drives Optuna with ``ask``/``tell`` from Ray Tune (:mod:`studies.searcher`), and
Tune ends the search itself after ``num_samples`` trials (the grid's size). The override relies
on ``after_trial`` doing nothing else that a search needs, which is true of the tested version.
"""

from __future__ import annotations

from typing import Any

from optuna.samplers import GridSampler
from optuna.study import Study
from optuna.trial import FrozenTrial

TESTED_VERSION = "5.0.0"


class GridOnceSampler(GridSampler):
    """Optuna's GridSampler for a search that Tune ends: every point once, in a seeded order."""

    def after_trial(self, study: Study, trial: FrozenTrial, state: Any, values: Any) -> None:
        return None
