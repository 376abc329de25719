"""The driver-side state of one study run, shared by search, confirm and report.

A run lives in ``<workspace>/ray/<key>/<run name>/`` (``<key>`` is the study name, with
``-smoke`` for ``--smoke``): ``state.json`` (options, parent MLflow run, winners, phase) and the
searchers' logs; Tune's experiments go to ``<storage>/<key>/<run name>/`` (the same folder unless
``--storage`` names S3, GCS or NFS).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from studies.plan import StudyPlan
from studies.ray_adapter import Cluster
from studies.tracking import Tracker

STATE_FILE = "state.json"


class Interrupted(Exception):
    """The driver was interrupted (Ctrl-C); the run can be continued."""
PHASES = ("search", "confirm", "report", "done")


@dataclass
class Session:
    plan: StudyPlan
    run_dir: Path  # local state folder of this run
    cluster: Cluster
    resources: dict[str, float]
    tracker: Tracker
    parent_id: str
    tags: dict[str, str]  # tags of every child run
    fingerprints: dict[str, str]  # condition -> data fingerprint
    fit: Callable[..., Any] | None  # None = icr.train.fit
    verbose: int = 1
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def concurrency(self) -> int:
        return self.cluster.concurrency(self.resources)

    @property
    def storage_path(self) -> str:
        return f"{self.plan.storage_root.rstrip('/')}/{self.plan.key}/{self.run_dir.name}"

    def experiment_path(self, name: str) -> str:
        return f"{self.storage_path}/{name}"

    def save_state(self, **changes: Any) -> None:
        self.state.update(changes)
        write_state(self.run_dir, self.state)


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Write ``state.json`` atomically (a killed driver never leaves half a file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(run_dir / STATE_FILE)


def read_state(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / STATE_FILE).read_text())


def find_unfinished(state_root: Path) -> Path | None:
    """The newest run of a study that has not reached the phase ``done``."""
    if not state_root.is_dir():
        return None
    runs = sorted(p for p in state_root.iterdir() if (p / STATE_FILE).is_file())
    for run_dir in reversed(runs):
        if read_state(run_dir).get("phase") != "done":
            return run_dir
    return None


def find_latest(state_root: Path) -> Path | None:
    if not state_root.is_dir():
        return None
    runs = sorted(p for p in state_root.iterdir() if (p / STATE_FILE).is_file())
    return runs[-1] if runs else None


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")
