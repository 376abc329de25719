"""The searcher's sampler: quasi-random trials that spread over the space, then TPE.

Optuna's TPE draws its first ``n_startup_trials`` (10 by default) uniformly at random, so a study
with a budget of a few trials per condition is random search, and random points can cluster (four
draws of eta all in [0.186, 0.229] in one run of ltd_bound). Here trial ``n`` of the first
``startup`` trials takes the ``n``-th point of a Sobol sequence (scipy's, unscrambled: the first
points are the low end, the middle, the quarters, ...), one dimension per searched key in a fixed
order, mapped onto each distribution; after them :class:`optuna.samplers.TPESampler` takes over with
every trial so far (pruned ones included) as its history. The points depend only on the trial's
number, so concurrent trials and a resumed search get the same ones.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, TPESampler
from optuna.study import Study
from optuna.trial import FrozenTrial
from scipy.stats import qmc


def spread_point(u: float, distribution: BaseDistribution) -> Any:
    """The value at quantile ``u`` in [0, 1) of a distribution (log-uniform on a log scale)."""
    if isinstance(distribution, CategoricalDistribution):
        choices = distribution.choices
        return choices[min(int(u * len(choices)), len(choices) - 1)]
    low, high = distribution.low, distribution.high
    if isinstance(distribution, IntDistribution):
        if distribution.log:
            value = math.exp(math.log(low) + u * (math.log(high + 1) - math.log(low)))
        else:
            value = low + u * (high + 1 - low)
        return int(min(max(math.floor(value), low), high))
    if isinstance(distribution, FloatDistribution):
        if distribution.log:
            return float(math.exp(math.log(low) + u * (math.log(high) - math.log(low))))
        value = low + u * (high - low)
        if distribution.step is not None:
            value = low + round((value - low) / distribution.step) * distribution.step
        return float(min(value, high))
    raise TypeError(f"no quasi-random point for {distribution!r}")


class SpreadThenTPESampler(BaseSampler):
    """Sobol points for the first ``startup`` trials, then TPE.

    Args:
        startup: trials sampled quasi-randomly (trial numbers 0 .. startup - 1).
        seed: seed of TPE.
        dimensions: the searched keys in a fixed order (one Sobol dimension each); keys sampled
            that are not listed get the next free dimensions in the order they are first seen.
    """

    def __init__(self, startup: int, seed: int = 0, dimensions: tuple[str, ...] = ()) -> None:
        self.startup = startup
        self._dimensions = list(dimensions)
        self._tpe = TPESampler(seed=seed, n_startup_trials=0)
        self._points: np.ndarray | None = None

    def _point(self, number: int, dimension: int) -> float:
        needed = max(dimension + 1, 1)
        if self._points is None or self._points.shape[1] < needed:
            rows = 1 << max(self.startup - 1, 0).bit_length()  # Sobol wants a power of 2
            self._points = qmc.Sobol(d=max(needed, 4), scramble=False).random(rows)
        return float(self._points[number, dimension])

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if trial.number < self.startup:
            return {}
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial.number < self.startup:
            return {}
        return self._tpe.sample_relative(study, trial, search_space)

    def sample_independent(self, study: Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if trial.number >= self.startup:
            return self._tpe.sample_independent(study, trial, param_name, param_distribution)
        if param_name not in self._dimensions:
            self._dimensions.append(param_name)
        return spread_point(self._point(trial.number, self._dimensions.index(param_name)),
                            param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._tpe.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: Any, values: Any) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()
