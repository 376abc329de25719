"""Select: per condition, the best configuration on validation among full-budget trials.

A trial stopped by ASHA, or one that failed, never wins: comparing a trial trained for two epochs
with one trained for ten (what ``ResultGrid.get_best_result`` would do) says nothing about the
configurations. A trial's score is its validation metric at the end of the full budget, the value
Optuna was told.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from icr.config import Scalar
from studies.trials import full_budget
from studies.tuning import TrialRecord


@dataclass(frozen=True)
class Winner:
    condition: str
    trial_id: str
    score: float | None  # None: a condition with nothing to search
    sampled: dict[str, Scalar]  # the searched keys of the winning trial

    def to_json(self) -> dict[str, Any]:
        return {"condition": self.condition, "trial_id": self.trial_id, "score": self.score,
                "sampled": self.sampled}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Winner:
        return cls(data["condition"], data["trial_id"], data["score"], data["sampled"])


def select_winner(
    records: list[TrialRecord], metric: str, mode: str, max_epochs: int
) -> Winner | None:
    """The best full-budget trial by ``metric`` (ties: the earlier trial id); None if none ran."""
    eligible = [r for r in records if _ran_full(r, max_epochs) and _finite(r.metrics.get(metric))]
    if not eligible:
        return None
    sign = 1.0 if mode == "max" else -1.0
    best = max(sorted(eligible, key=lambda r: r.trial_id), key=lambda r: sign * r.metrics[metric])
    return Winner(best.condition, best.trial_id, float(best.metrics[metric]), dict(best.spec.values))


def _ran_full(record: TrialRecord, max_epochs: int) -> bool:
    return not record.error and full_budget(record.epochs, max_epochs)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def summary(records: list[TrialRecord], max_epochs: int) -> str:
    full = sum(1 for r in records if _ran_full(r, max_epochs))
    failed = sum(1 for r in records if r.error)
    return f"{len(records)} trials: {full} ran the full budget, " \
           f"{len(records) - full - failed} stopped early, {failed} failed"
