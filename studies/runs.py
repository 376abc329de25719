"""A study run's trials as the report reads them: one frame from MLflow, histories on demand.

Every number of a report comes from here, so it is traceable to an MLflow run: the frame has one
row per child run (identity, tags, the params it recorded, its latest metrics) and
:meth:`RunSet.history` reads a metric's series (per epoch, or per step for ``trajectory/*``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from studies.tracking import PARENT_TAG, Tracker

TAG_COLUMNS = ("phase", "condition", "tune_trial_id", "seed", "epochs", "budget_complete", "error",
               "checkpoint", "members")

History = tuple[list[int], list[float]]


@dataclass
class RunSet:
    """The child runs of one study run.

    Attributes:
        frame: one row per run: ``run_id``, ``run_name``, ``status``, the tags of
            :data:`TAG_COLUMNS`, every recorded param (dotted config keys) and the latest value
            of every metric (``trajectory/*`` series left out).
        read_history: ``(run_id, key) -> (steps, values)``.
    """

    frame: pd.DataFrame
    read_history: Callable[[str, str], History]
    _cache: dict[tuple[str, str], History] = field(default_factory=dict, repr=False)

    def history(self, run_id: str, key: str) -> History:
        """A metric's series of one run, sorted by step (cached)."""
        if (run_id, key) not in self._cache:
            self._cache[(run_id, key)] = self.read_history(run_id, key)
        return self._cache[(run_id, key)]

    def where(self, **equal: Any) -> pd.DataFrame:
        """The rows whose columns equal the given values (a missing column matches nothing)."""
        rows = self.frame
        for column, value in equal.items():
            if column not in rows:
                return rows.iloc[:0]
            rows = rows[rows[column] == value]
        return rows

    def finished(self, phase: str) -> pd.DataFrame:
        """The runs of ``phase`` that ended normally (the rows of a table)."""
        return self.where(phase=phase, status="FINISHED")


def load_runs(tracker: Tracker, parent_id: str) -> RunSet:
    """The child runs of the study run ``parent_id`` (see :class:`RunSet`)."""
    rows = []
    for run in tracker.find_runs(f"tags.`{PARENT_TAG}` = '{parent_id}'"):
        tags = run.data.tags
        row: dict[str, Any] = {"run_id": run.info.run_id, "run_name": run.info.run_name,
                               "status": run.info.status}
        row.update({k: tags.get(k, "") for k in TAG_COLUMNS})
        row.update({k: _number(v) for k, v in sorted(run.data.params.items())})
        row.update({k: v for k, v in sorted(run.data.metrics.items())
                    if not k.startswith("trajectory/")})
        rows.append(row)
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame = frame.sort_values(["phase", "condition", "run_name"], ignore_index=True)

    def read_history(run_id: str, key: str) -> History:
        points = sorted((m.step, m.value) for m in tracker.client.get_metric_history(run_id, key))
        return [p[0] for p in points], [p[1] for p in points]

    return RunSet(frame, read_history)


def _number(value: str) -> Any:
    """A param as recorded (a string) back to a number where it is one."""
    try:
        return float(value) if any(c in value for c in ".eE") else int(value)
    except ValueError:
        return {"True": True, "False": False}.get(value, value)
