"""MLflow: one parent run per study, one child run per trial, recorded from the driver.

Why from the driver (a Tune callback) and not from inside each trial: the driver is the one
process that sees every trial's life, including the ends a trial cannot report itself (a killed
worker, a lost node); the sqlite store then has a single writer; and resuming a study can find
the run a trial already has (by the ``tune_trial_id`` tag) instead of opening a second one.

Child runs carry every flat config key as a param, the per-epoch metrics with step = epoch, the
training trajectory (``trajectory/<column>``, step = global step, read from the checkpoint's
``trajectory.csv``) and the tags study, phase, condition, seed, git commit, data fingerprint and
Tune trial id. Failed trials end FAILED; ASHA-stopped ones FINISHED with ``stopped_early=true``.
"""

from __future__ import annotations

import csv
import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from ray.tune import Callback
from ray.tune.result import AUTO_RESULT_KEYS

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PARENT_TAG = "mlflow.parentRunId"
MAX_PARAM_CHARS = 500  # MLflow's limit on a param value
_NOT_METRICS = set(AUTO_RESULT_KEYS) | {"done", "trial_id", "should_checkpoint", "experiment_tag"}
TRAJECTORY_FILE = "trajectory.csv"


def git_commit(root: Path = PROJECT_ROOT) -> str:
    """The commit of the project checkout, read from .git (no git process); '' if unknown."""
    git = root / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return ""


class Tracker:
    """A thin layer over MlflowClient for one study's experiment."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_root = artifact_root
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is not None:
                self._experiment_id = found.experiment_id
            else:
                location = None
                if self.artifact_root is not None:
                    location = (self.artifact_root / self.experiment).as_uri()
                self._experiment_id = self.client.create_experiment(
                    self.experiment, artifact_location=location
                )
        return self._experiment_id

    def create_run(self, name: str, tags: Mapping[str, str], params: Mapping[str, Any] = ()) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=dict(tags))
        self.log_params(run.info.run_id, dict(params))
        return run.info.run_id

    def find_runs(self, filter_string: str) -> list[Any]:
        runs, token = [], None
        while True:
            page = self.client.search_runs(
                [self.experiment_id], filter_string=filter_string, max_results=1000,
                page_token=token,
            )
            runs.extend(page)
            token = page.token
            if not token:
                return runs

    def child_run(
        self, parent_id: str, trial_id: str, name: str, tags: Mapping[str, str],
        params: Mapping[str, Any],
    ) -> tuple[str, bool]:
        """The child run of Tune trial ``trial_id``: found (after a resume) or created."""
        found = self.find_runs(
            f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.tune_trial_id = '{trial_id}'"
        )
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id, False
        tags = {**tags, PARENT_TAG: parent_id, "tune_trial_id": trial_id}
        return self.create_run(name, tags, params), True

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def last_step(self, run_id: str, key: str) -> int:
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=0)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def numeric_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a trial reported (Tune's bookkeeping keys and non-numbers left out)."""
    return {
        k: float(v) for k, v in result.items()
        if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def read_trajectory(directory: Path, after_step: int) -> Iterable[dict[str, float]]:
    path = Path(directory) / TRAJECTORY_FILE
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        rows = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]
    return [r for r in rows if r.get("step", 0) > after_step]


class MlflowTrialCallback(Callback):
    """Records every trial of a Tuner as a child run of the study's parent run."""

    def __init__(
        self, tracker: Tracker, parent_id: str, job: Any, tags: Mapping[str, str],
        fingerprints: Mapping[str, str], max_epochs: int,
    ) -> None:
        self.tracker = tracker
        self.parent_id = parent_id
        self.job = job  # studies.trainable.TrialJob: turns a trial config into flat params
        self.tags = dict(tags)
        self.fingerprints = dict(fingerprints)
        self.max_epochs = max_epochs
        self._runs: dict[str, str] = {}
        self._last_epoch: dict[str, int] = {}
        self._last_step: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_runs": {}, "_last_epoch": {}, "_last_step": {}}

    def run_id(self, trial: Any) -> str:
        if trial.trial_id not in self._runs:
            condition = trial.config["condition"]
            params = self.job.params(trial.config)
            seed = params.get("train.seed", "")
            tags = {
                **self.tags, "condition": condition, "seed": str(seed),
                "data_fingerprint": self.fingerprints.get(condition, ""), "icr.role": "trial",
            }
            name = f"{condition}-{trial.trial_id}" if self.job.phase == "search" else (
                f"{condition}-seed{seed}"
            )
            run_id, created = self.tracker.child_run(self.parent_id, trial.trial_id, name, tags, params)
            self._runs[trial.trial_id] = run_id
            self._last_epoch[run_id] = 0 if created else self.tracker.last_step(run_id, "epoch")
            self._last_step[run_id] = 0 if created else self.tracker.last_step(run_id, "trajectory/loss")
        return self._runs[trial.trial_id]

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.run_id(trial)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        run_id = self.run_id(trial)
        epoch = int(result.get("epoch", result.get("training_iteration", 0)))
        if epoch <= self._last_epoch[run_id]:
            return  # an epoch replayed after a restore: already recorded
        self.tracker.log_metrics(run_id, numeric_metrics(result), step=epoch)
        self._last_epoch[run_id] = epoch

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        with checkpoint.as_directory() as directory:
            rows = read_trajectory(Path(directory), self._last_step[run_id])
        for row in rows:
            step = int(row["step"])
            values = {f"trajectory/{k}": v for k, v in row.items() if k != "step"}
            self.tracker.log_metrics(run_id, values, step=step)
            self._last_step[run_id] = step

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        epochs = int((trial.last_result or {}).get("epoch", 0))
        full = epochs >= self.max_epochs
        self.tracker.set_tags(run_id, {"epochs": epochs, "budget_complete": str(full).lower(),
                                       "stopped_early": str(not full).lower()})
        self.tracker.finish(run_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        error = trial.get_error()
        message = str(error).strip().splitlines()[-1] if error else "trial failed"
        self.tracker.set_tags(run_id, {"error": message[:MAX_PARAM_CHARS], "budget_complete": "false"})
        self.tracker.finish(run_id, "FAILED")
