"""MLflow: one parent run per study, one child run per trial, recorded from the driver.

Why from the driver (a Tune callback) and not from inside each trial: the driver is the one
process that sees every trial's life, including the ends a trial cannot report itself (a killed
worker, a lost node); the sqlite store then has a single writer; and resuming a study finds the run
a trial already has (by the ``tune_trial_id`` tag) instead of opening a second one.

What a child run holds (made for comparing trials in the MLflow UI):

- name: the condition and the sampled values (``lagrangian eta=0.112``, ``dual seed=1001``);
- params: the config keys its configuration uses (:func:`icr.config.used_keys`: no
  ``objective.eta`` for a contrastive run, no ``loss.tau`` for a triplet one);
- metrics, step = epoch: everything ``fit`` reports (``val_*``, ``train_*``, ``lr``, ``test_*``,
  the analyses'), plus ``best_val_<metric>`` and ``best_epoch``, so a compare view can rank runs on
  their best epoch and leave out ASHA-stopped ones (tag ``budget_complete``);
- metrics, step = training step: ``trajectory/<term>`` (``loss``, ``L_con``, ``L_rec``,
  ``lambda``: the Lagrange multiplier, the one lambda series; AdOpt's ``K``; ...), only the terms
  the run has;
- tags: study, phase, condition, seed, git commit, data fingerprint, Tune trial id, epochs,
  budget_complete, stopped_early and, for a failed run, ``error``: the one-line cause;
- artifacts: the files of its analyses; tag ``checkpoint``: where Tune keeps its last checkpoint.

The experiment carries MLflow's experiment-kind tag (``mlflow.experimentKind`` =
``custom_model_development``, what the UI's "Machine learning" choice writes), so MLflow 3's UI
opens it on its runs, not on the GenAI traces page. Its artifacts live in the workspace
(``<workspace>/mlartifacts/<experiment>``); MLflow records them by absolute path, so a store
opened from a moved or copied workspace has its locations pointed at that workspace
(:func:`relocate_artifacts`).

An epoch is recorded in one transaction (metrics and trajectory together, :func:`insert_metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sqlite3
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy
from mlflow.entities import Metric, Param, RunTag
from mlflow.store.tracking.dbmodels.models import SqlExperiment, SqlLatestMetric, SqlMetric, SqlRun
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from mlflow.tracking import MlflowClient
from mlflow.utils.file_utils import local_file_uri_to_path as local_path
from ray.tune import Callback

from icr.errors import UserError
from studies.frameworks.tune import BOOKKEEPING, CHECKPOINT_DIR, trial_error
from studies.trials import spec_of

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PARENT_TAG = "mlflow.parentRunId"
MAX_PARAM_CHARS = 500  # MLflow's limit on a param value
MAX_BATCH = 1000  # MLflow's limit on the metrics of one log_batch call
RECORD_KEYS = {"trajectory", "artifacts", "final"}  # the EpochReport fields beside its metrics
# The tag MLflow 3's UI reads to choose an experiment's page (its JS bundle: "Machine learning"
# opens the runs, "GenAI apps & agents" the traces); an experiment without it is guessed from
# its content or asks the user, and a new empty one opens on the traces.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


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
        """The study's experiment: created with its kind and its artifacts in the workspace;
        found again (after a move of the workspace, its artifact locations pointed here)."""
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                location = None
                if self.artifact_root is not None:
                    location = (self.artifact_root / self.experiment).as_uri()
                self._experiment_id = self.client.create_experiment(
                    self.experiment, artifact_location=location,
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
                return self._experiment_id
            self._experiment_id = found.experiment_id
            if EXPERIMENT_KIND_TAG not in found.tags:  # made before the tag was set
                self.client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG,
                                               EXPERIMENT_KIND)
            store = self.client._tracking_client.store
            if self._own_store() and isinstance(store, SqlAlchemyStore):
                relocate_artifacts(store, self.artifact_root)
        return self._experiment_id

    def _own_store(self) -> bool:
        """The store is the sqlite file of the workspace that holds the artifact root (a store
        shared by several workspaces keeps the locations each recorded)."""
        if self.artifact_root is None or not self.tracking_uri.startswith("sqlite:///"):
            return False
        db = Path(self.tracking_uri.removeprefix("sqlite:///"))
        return db.resolve().parent == self.artifact_root.resolve().parent

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
    ) -> str:
        """The child run of Tune trial ``trial_id``: found (after a resume) or created."""
        found = self.find_runs(
            f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.tune_trial_id = '{trial_id}'"
        )
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        tags = {**tags, PARENT_TAG: parent_id, "tune_trial_id": trial_id}
        return self.create_run(name, tags, params)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.log_batch(run_id, [Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_batch(self, run_id: str, metrics: list[Metric]) -> None:
        """Metrics of any steps in one transaction (a SQL store) or as few calls as MLflow allows."""
        store = self.client._tracking_client.store
        if isinstance(store, SqlAlchemyStore) and metrics:
            try:
                insert_metrics(store, run_id, metrics)
                return
            except sqlalchemy.exc.IntegrityError:  # a metric already recorded: MLflow dedups
                log.debug("run %s: a metric was already recorded; logging through MLflow", run_id)
        for i in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(run_id, metrics=metrics[i : i + MAX_BATCH])

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def last_step(self, run_id: str, key: str) -> int:
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=0)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def insert_metrics(store: SqlAlchemyStore, run_id: str, metrics: list[Metric]) -> None:
    """Record ``metrics`` in a SQL tracking store in one transaction, as ``log_batch`` would.

    MLflow's ``log_batch`` builds an ORM object per metric and costs about 0.3 ms a metric, so an
    epoch record of 300 metrics (its trajectory rows) takes 100 ms and one driver records fewer
    than 10 epochs a second. This writes the same rows with two bulk statements: the metric
    history (MLflow's ``metrics`` table) and the latest value per key (``latest_metrics``, what
    the runs table shows), updated only where the new value is more recent by (step, timestamp,
    value), MLflow's rule; NaN and infinities are stored as MLflow stores them.
    ``tests/test_tracking.py`` holds its result equal to ``log_batch``'s.

    Raises:
        sqlalchemy.exc.IntegrityError: a metric of the batch is already recorded (nothing written).
    """
    rows, newest = [], {}
    for m in metrics:
        is_nan, value = store.sanitize_metric_value(float(m.value))
        row = {"run_uuid": run_id, "key": m.key, "value": value, "timestamp": m.timestamp,
               "step": m.step, "is_nan": is_nan}
        rows.append(row)
        old = newest.get(m.key)
        if old is None or (m.step, m.timestamp, value) > (old["step"], old["timestamp"], old["value"]):
            newest[m.key] = row
    metric_table, latest_table = SqlMetric.__table__, SqlLatestMetric.__table__
    with store.engine.begin() as conn:
        conn.execute(sqlalchemy.insert(metric_table), rows)
        stored = {
            r.key: r for r in conn.execute(
                sqlalchemy.select(latest_table).where(
                    latest_table.c.run_uuid == run_id, latest_table.c.key.in_(list(newest))))
        }
        inserts = [row for key, row in newest.items() if key not in stored]
        updates = [row for key, row in newest.items() if key in stored and (
            row["step"], row["timestamp"], row["value"])
            > (stored[key].step, stored[key].timestamp, stored[key].value)]
        if inserts:
            conn.execute(sqlalchemy.insert(latest_table), inserts)
        if updates:
            conn.execute(
                sqlalchemy.update(latest_table)
                .where(latest_table.c.run_uuid == sqlalchemy.bindparam("b_run"),
                       latest_table.c.key == sqlalchemy.bindparam("b_key"))
                .values(value=sqlalchemy.bindparam("value"), step=sqlalchemy.bindparam("step"),
                        timestamp=sqlalchemy.bindparam("timestamp"),
                        is_nan=sqlalchemy.bindparam("is_nan")),
                [{**row, "b_run": row["run_uuid"], "b_key": row["key"]} for row in updates],
            )


def relocate_artifacts(store: SqlAlchemyStore, root: Path) -> int:
    """Point the artifact locations a moved or copied workspace's store recorded at ``root``.

    MLflow turns an experiment's artifact location into an absolute path when it creates the
    experiment, and a run's artifact URI is that path plus the run's folder, so a copied workspace
    would read (or miss) the original's files. Every experiment located in a folder
    ``<old workspace>/mlartifacts/<name>`` other than ``root/<name>`` is moved to
    ``root/<name>``, its runs with it; locations elsewhere (a shared store, S3) are left alone.
    Returns how many experiments were moved.
    """
    root = root.resolve()
    moved = 0
    with store.engine.begin() as conn:
        experiments = SqlExperiment.__table__
        runs = SqlRun.__table__
        for row in conn.execute(sqlalchemy.select(experiments.c.experiment_id,
                                                  experiments.c.artifact_location)):
            old = row.artifact_location or ""
            if not old.startswith("file://"):
                continue
            path = Path(local_path(old))
            if path.parent.name != root.name or path.parent == root:
                continue
            new = (root / path.name).as_uri()
            conn.execute(sqlalchemy.update(experiments)
                         .where(experiments.c.experiment_id == row.experiment_id)
                         .values(artifact_location=new))
            conn.execute(sqlalchemy.update(runs)
                         .where(runs.c.experiment_id == row.experiment_id,
                                runs.c.artifact_uri.startswith(old + "/"))
                         .values(artifact_uri=sqlalchemy.func.replace(runs.c.artifact_uri, old, new)))
            log.info("artifacts of experiment %s: %s (was %s)", row.experiment_id, new, old)
            moved += 1
    return moved


def check_store(tracking_uri: str, busy_timeout: float = 30.0) -> None:
    """A sqlite tracking store that exists must be an intact database.

    Checked on the driver before Ray starts (``PRAGMA quick_check`` reads every page, 0.25 s
    for 250 MB): MLflow would otherwise fail on the store's first damaged page, after the study
    started. A store that another driver keeps locked for ``busy_timeout`` seconds is in use,
    not damaged: it is left unchecked.

    Raises:
        UserError: one line naming the file, what is wrong and the fix.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    if not db.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True,
                                                timeout=busy_timeout)) as con:
            rows = con.execute("PRAGMA quick_check").fetchall()
        problem = "" if rows == [("ok",)] else str(rows[0][0]).splitlines()[0]
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):  # another study writes to it: not damage
            log.info("the MLflow store %s is busy; not checked", db)
            return
        problem = str(exc).splitlines()[0]
    except sqlite3.Error as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if problem:
        raise UserError(
            f"the MLflow store {db} is damaged ({problem}); move it aside (mv {db} {db}.damaged: "
            "the next run starts a new store) or put back a copy from a backup, then run the "
            "same command again")


def numeric_metrics(result: Mapping[str, Any]) -> dict[str, float]:
    """The metrics a trial reported (Tune's bookkeeping keys and non-numbers left out)."""
    return {
        k: float(v) for k, v in result.items()
        if k not in BOOKKEEPING and k not in RECORD_KEYS
        and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def epoch_metrics(result: Mapping[str, Any], now_ms: int) -> list[Metric]:
    """One epoch's record as MLflow metrics: the epoch's own at step = epoch, then its
    trajectory rows (``trajectory/<term>``) at step = their training step."""
    epoch = int(result["epoch"])
    items = [Metric(k, v, now_ms, epoch) for k, v in numeric_metrics(result).items()]
    for row in result.get("trajectory") or ():
        step = int(row["step"])
        items += [Metric(f"trajectory/{k}", float(v), now_ms, step)
                  for k, v in row.items() if k not in ("step", "epoch")]
    return items


def error_line(error: BaseException | str | None) -> str:
    """The one-line cause of a failed trial: the innermost exception's last line (Tune gives
    the error as an exception, or as the text of its error file)."""
    if not error:
        return "the trial failed without an error (its worker was lost?)"
    if isinstance(error, str):
        lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
        return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1])[:MAX_PARAM_CHARS]
    cause: BaseException = error
    for _ in range(10):  # RayTaskError keeps the worker's exception as .cause
        inner = getattr(cause, "cause", None) or cause.__cause__
        if not isinstance(inner, BaseException) or inner is cause:
            break
        cause = inner
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else type(cause).__name__
    if ": " not in text[:60]:
        text = f"{type(cause).__name__}: {text}"
    return text[:MAX_PARAM_CHARS]


def checkpoint_location(checkpoint: Any) -> str:
    """Where a Tune checkpoint is, as ``tune.Checkpoint(location)`` reads it on any node (the
    ``checkpoint`` tag of a run, for ensembles and analyses): its folder on a local or shared
    file system, else its URI (``s3://bucket/...``, ``gcs://bucket/...``)."""
    kind = checkpoint.filesystem.type_name
    return checkpoint.path if kind == "local" else f"{kind}://{checkpoint.path}"


class MlflowTrialCallback(Callback):
    """Records every trial of a Tuner as a child run of the study's parent run."""

    def __init__(
        self, tracker: Tracker, parent_id: str, tags: Mapping[str, str],
        fingerprints: Mapping[str, str], max_epochs: Mapping[str, int],
    ) -> None:
        self.tracker = tracker
        self.parent_id = parent_id
        self.tags = dict(tags)
        self.fingerprints = dict(fingerprints)
        self.max_epochs = dict(max_epochs)  # per condition: a trial's full budget in epochs
        self._runs: dict[str, str] = {}
        self._last_epoch: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_runs": {}, "_last_epoch": {}}

    def run_id(self, trial: Any) -> str:
        if trial.trial_id not in self._runs:
            spec = spec_of(trial.config)  # resolved on the driver, once (studies.trials)
            tags = {
                **self.tags, "condition": spec.condition, "seed": str(spec.seed),
                "data_fingerprint": self.fingerprints.get(spec.condition, ""), "icr.role": "trial",
                **{f"sampled.{k}": str(v) for k, v in spec.values.items()},
            }
            run_id = self.tracker.child_run(self.parent_id, trial.trial_id, spec.name, tags,
                                            spec.params)
            self._runs[trial.trial_id] = run_id
            self._last_epoch[run_id] = self.tracker.last_step(run_id, "epoch")
        return self._runs[trial.trial_id]

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.run_id(trial)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if result.get(CHECKPOINT_DIR):
            return  # recorded in on_checkpoint, once its checkpoint is marked (see _record)
        self._record(trial, result)

    def _record(self, trial: Any, result: Mapping[str, Any]) -> None:
        """Record one epoch's result, unless its run has it already (an epoch replayed after a
        restore). An epoch that came with a checkpoint is recorded only after the marking
        callback (:class:`studies.trainable.MarkReported`, which runs first) wrote the result
        into the checkpoint: a restored trial resumes from the newest marked checkpoint, so
        every epoch recorded here is one a restored trial continues after."""
        run_id = self.run_id(trial)
        epoch = int(result.get("epoch", 0))
        if epoch <= self._last_epoch[run_id]:
            return
        self.tracker.log_batch(run_id, epoch_metrics(result, int(time.time() * 1000)))
        self._last_epoch[run_id] = epoch

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        self._record(trial, trial.last_result or {})
        self.tracker.set_tags(run_id, {"checkpoint": checkpoint_location(checkpoint)})
        files = (trial.last_result or {}).get("artifacts") or ()
        if not files:
            return
        with checkpoint.as_directory() as directory:
            for name in files:
                path = Path(directory) / name
                if path.is_file():
                    folder = str(Path(name).parent)
                    self.tracker.client.log_artifact(run_id, str(path), artifact_path=folder)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        epochs = int((trial.last_result or {}).get("epoch", 0))
        full = epochs >= self.max_epochs[spec_of(trial.config).condition]
        self.tracker.set_tags(run_id, {"epochs": epochs, "budget_complete": str(full).lower(),
                                       "stopped_early": str(not full).lower()})
        self.tracker.finish(run_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        epochs = int((trial.last_result or {}).get("epoch", 0))
        self.tracker.set_tags(run_id, {"error": error_line(trial_error(trial)), "epochs": epochs,
                                       "budget_complete": "false", "stopped_early": "false"})
        self.tracker.finish(run_id, "FAILED")
