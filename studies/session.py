"""The driver-side state of one study run, shared by search, confirm and report.

A run lives in ``<workspace>/ray/<key>/<run name>/`` (``<key>`` is the study name, with
``-smoke`` for ``--smoke``): ``state.json`` (parent MLflow run, winners, phase, the options it was
started with) and the searchers' logs; Tune's experiments go to ``<storage>/<key>/<run name>/``
(the same folder unless ``--storage`` names S3, GCS or NFS).

One driver per study: :class:`DriverLock` holds an exclusive lock on ``<workspace>/locks/<key>.lock``
for the driver's lifetime (the kernel drops it when the process dies, however it
dies), so a second ``studies.run`` of the same study refuses at once, naming the running one.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icr.errors import UserError
from icr.workspace import Workspace
from studies import storage
from studies.connection import Cluster
from studies.plan import StudyPlan
from studies.progress import ProgressOptions
from studies.signals import Interrupted, StopSignals
from studies.tracking import Tracker

STATE_FILE = "state.json"


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
    progress: ProgressOptions = field(default_factory=ProgressOptions)
    stops: StopSignals = field(default_factory=StopSignals)  # the driver's stop signals
    data: dict[str, str] = field(default_factory=dict)  # condition -> its prepared data folder

    def check_stop(self) -> None:
        """Raise Interrupted if a stop signal came (before a phase, a Tuner, a saved state)."""
        if self.stops.received:
            raise Interrupted()

    @property
    def concurrency(self) -> int:
        return self.cluster.concurrency(self.resources)

    @property
    def storage_path(self) -> str:
        """Where Tune keeps this run's experiments: a folder, or a URI (its query kept last)."""
        return storage.join(self.plan.storage_root, self.plan.key, self.run_dir.name)

    def experiment_path(self, name: str) -> str:
        return storage.join(self.storage_path, name)

    def save_state(self, **changes: Any) -> None:
        self.check_stop()  # a phase interrupted is not a phase done
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


def new_run_name() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


class DriverLock:
    """An exclusive, process-lifetime lock on a study: one driver per study at a time."""

    def __init__(self, workspace_root: Path, study: str) -> None:
        self.path = Workspace(workspace_root).locks / f"{study}.lock"
        self.study = study
        self._fd: int | None = None

    def __enter__(self) -> DriverLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(
                f"study {self.study} is already running (driver pid {holder}); wait for it, or "
                f"stop it with `kill {holder}` and run the same command again to continue"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None
