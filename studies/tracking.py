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
- how its training steps ran (:class:`icr.train.StepModes`): tags ``steps.mode`` (captured as
  CUDA graphs, eager, partly eager), ``steps.shapes`` (the shapes captured), ``steps.reason``
  (why steps run eagerly: ``no CUDA``, a failed capture's error, ...) and ``steps.fell_back``,
  and metrics ``steps_captured`` / ``steps_eager`` per epoch;
- artifacts: the files of its analyses; tag ``checkpoint``: where Tune keeps its last checkpoint.

The experiment carries MLflow's experiment-kind tag (``mlflow.experimentKind`` =
``custom_model_development``, what the UI's "Machine learning" choice writes), so MLflow 3's UI
opens it on its runs, not on the GenAI traces page. Against a tracking server (``http``,
``https``) its artifacts go to the server's artifact store (the experiment is created without a
location of its own), so a lab's UI on another machine shows the reports, figures and analyses.
With the workspace's own sqlite store they live in the workspace
(``<workspace>/mlartifacts/<experiment>/<run id>/artifacts``), recorded as
``mlflow-artifacts:/<experiment>``: a location relative to the artifact store that serves it,
not the workspace's absolute path, so a moved or copied workspace keeps showing its artifacts
(``mlflow ui --backend-store-uri sqlite:///<workspace>/mlflow.db --artifacts-destination
<workspace>/mlartifacts``) and a study resumed there writes into it, never into the original's
folder (:mod:`studies.frameworks.mlflow` writes them, as MLflow's client does so only through a
server). Any other store (a sqlite file outside the workspace, a database) records the absolute
path of ``<workspace>/mlartifacts/<experiment>``. A database URI's driver is checked before
anything starts (:func:`check_database_driver`).

An epoch's record (its metrics and trajectory rows together) is written through MLflow's
public ``log_batch`` by one thread (:class:`RecordQueue`), off Tune's loop.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient, MlflowException
from mlflow.entities import Metric, Param, RunTag
from ray.tune import Callback, Checkpoint

from icr.errors import UserError
from icr.workspace import sqlite_file
from studies import storage
from studies.failures import error_line
from studies.frameworks import mlflow as mlflow_adapter
from studies.frameworks.tune import BOOKKEEPING, CHECKPOINT_DIR, trial_error
from studies.trials import EpochLedger, epochs_of, full_budget, spec_of

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PARENT_TAG = "mlflow.parentRunId"
ERROR_TAG = "error"  # a failed trial's one-line cause, on its run
MAX_PARAM_CHARS = 500  # MLflow's limit on a param value
# The longest tag value every MLflow store keeps whole, in UTF-8 bytes, as MLflow's REST API
# reference states it for SetTag ("all storage backends are guaranteed to support values up to
# 5000 bytes"); a store may keep more (8,000 characters in a 3.17 sqlite store), a lab's server
# of another version or backend may not.
MAX_TAG_BYTES = 5000
RECORD_KEYS = {"trajectory", "artifacts", "final", "steps"}  # EpochReport's fields beside metrics
# The tag MLflow 3's UI reads to choose an experiment's page (its JS bundle: "Machine learning"
# opens the runs, "GenAI apps & agents" the traces); an experiment without it is guessed from
# its content or asks the user, and a new empty one opens on the traces.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Tracking URIs of a server, which keeps the artifacts of its runs in its own artifact store.
SERVED_SCHEMES = ("http", "https", "databricks")
# (SQLAlchemy dialect, driver) -> the extra of pyproject.toml that installs the driver.
DRIVER_EXTRAS = {("postgresql", "psycopg"): "postgres", ("mysql", "pymysql"): "mysql"}
DRIVER_SCHEMES = {"postgresql": ("postgresql", "postgres"), "mysql": ("mysql+pymysql", "mysql")}


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


class RecordQueue:
    """Epoch records written through ``MlflowClient.log_batch`` by one thread, the records of
    a run queued while another call was written merged into one call.

    One writer, because a sqlite store takes one at a time: MLflow's own asynchronous queue
    (``log_batch(synchronous=False)``) writes up to ten batches at once, which wait on the
    store's lock, and recorded no more a second than this thread
    (``benchmarks/tracking_throughput.py``; docs/benchmarks.md has its runs). MLflow splits a
    long call into its requests of 1,000 metrics. The thread runs while records are queued
    and is not a daemon: a driver that exits writes what it queued first.
    """

    def __init__(self, write: Callable[[str, list[Metric]], None]) -> None:
        self._write = write
        self._lock = threading.Condition()
        self._queued: list[tuple[str, list[Metric]]] = []
        self._running = False  # a thread writes the queue
        self._failed: list[tuple[str, int, BaseException]] = []

    def put(self, run_id: str, metrics: list[Metric]) -> None:
        with self._lock:
            self._queued.append((run_id, metrics))
            if not self._running:
                threading.Thread(target=self._drain, name="mlflow-records").start()
                self._running = True

    def wait(self) -> list[tuple[str, int, BaseException]]:
        """Wait until every queued record is written; returns (run id, records, error) of each
        call that failed since the last wait."""
        with self._lock:
            self._lock.wait_for(lambda: not self._running)
            failed, self._failed = self._failed, []
        return failed

    def _drain(self) -> None:
        while True:
            with self._lock:
                records, self._queued = self._queued, []
                if not records:
                    self._running = False
                    self._lock.notify_all()
                    return
            by_run: dict[str, list[list[Metric]]] = {}
            for run_id, metrics in records:
                by_run.setdefault(run_id, []).append(metrics)
            for run_id, batches in by_run.items():
                try:
                    self._write(run_id, [m for batch in batches for m in batch])
                except Exception as exc:  # no caller to raise to: wait() reports it
                    with self._lock:
                        self._failed.append((run_id, len(batches), exc))


class Tracker:
    """One study's experiment in MLflow, recorded through MLflow's public client.

    Epoch records (:meth:`log_batch`) are queued and written by a :class:`RecordQueue`'s
    thread; what is queued is written before a run is finished, before the store is read
    through this tracker (:meth:`last_step`, :meth:`find_runs`) and by :meth:`flush`, and a
    record that could not be written is reported in one error line. Everything else (runs,
    params, tags, the few metrics of :meth:`log_metrics`) is written at once.
    """

    def __init__(self, tracking_uri: str, experiment: str, artifact_root: Path | None = None):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.artifact_root = artifact_root
        self.store_file = sqlite_file(tracking_uri)  # None: not a sqlite store
        self._client: MlflowClient | None = None
        self._experiment_id: str | None = None
        self._records: RecordQueue | None = None
        self._artifact_uris: dict[str, str] = {}  # run id -> its artifact URI

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None, "_records": None}

    @property
    def client(self) -> MlflowClient:
        if self._client is None:
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def experiment_id(self) -> str:
        """The study's experiment: found by its name (its artifact location checked:
        :meth:`_check_location`), else created with its kind and its artifact location
        (:meth:`_new_location`)."""
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                self._experiment_id = self.client.create_experiment(
                    self.experiment, artifact_location=self._new_location(),
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            else:
                self._check_location(found.artifact_location)
                self._experiment_id = found.experiment_id
        return self._experiment_id

    def _new_location(self) -> str | None:
        """A server's experiment has none of its own (its artifact store, served to every
        machine); the workspace's own store's is served from the workspace's artifact root
        whatever the workspace's path (:func:`studies.frameworks.mlflow.served_location`);
        another store's is the artifact root's folder of the experiment."""
        if self.artifact_root is None or serves_artifacts(self.tracking_uri):
            return None
        if self._own_store():
            return mlflow_adapter.served_location(self.experiment)
        return (self.artifact_root / self.experiment).as_uri()

    def _check_location(self, location: str) -> None:
        """An experiment found in a local store keeps its artifacts where this tracker writes
        them, else one line: a served location read from a store that is not this workspace's
        own, or (an experiment created before locations were served) an absolute path outside
        this workspace's artifact root, which MLflow would write to (the original's folder of
        a moved or copied workspace)."""
        if serves_artifacts(self.tracking_uri) or self.artifact_root is None:
            return
        if mlflow_adapter.is_served(location):
            if not self._own_store():
                raise UserError(
                    f"the experiment {self.experiment!r} of {self.tracking_uri} keeps its artifacts "
                    f"in the workspace that holds that store, not in {self.artifact_root.parent}; "
                    "run the command with --workspace set to the store's folder")
            return
        if not self._own_store() or not location.startswith("file:"):
            return
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path))
        if not path.resolve().is_relative_to(self.artifact_root.resolve()):
            raise UserError(
                f"the experiment {self.experiment!r} of {self.store_file} keeps its artifacts at "
                f"{path}, outside this workspace (it was created there before this workspace was "
                "moved or copied, by a version of the platform that recorded absolute paths); "
                f"run the study in the workspace at {path.parent.parent}, or start it afresh in "
                "a new workspace")

    def _own_store(self) -> bool:
        """The store is the sqlite file of the workspace that holds the artifact root (a store
        shared by several workspaces keeps the locations each recorded)."""
        if self.artifact_root is None or self.store_file is None:
            return False
        return self.store_file.resolve().parent == self.artifact_root.resolve().parent

    def log_artifacts(self, run_id: str, local: Path, artifact_path: str = "") -> None:
        """Store a file (into ``artifact_path``) or a folder's files (under it) in the run's
        artifacts: through the client, or, for a run of a served location on a local store
        (which MLflow's client writes only through a server), into this workspace's artifact
        root where ``mlflow ui --artifacts-destination`` serves them."""
        uri = self._artifact_uris.get(run_id) or self.client.get_run(run_id).info.artifact_uri
        self._artifact_uris[run_id] = uri
        if mlflow_adapter.is_served(uri) and not serves_artifacts(self.tracking_uri):
            mlflow_adapter.write_served_artifacts(uri, self.artifact_root, local, artifact_path)
        elif local.is_dir():
            self.client.log_artifacts(run_id, str(local), artifact_path=artifact_path or None)
        else:
            self.client.log_artifact(run_id, str(local), artifact_path=artifact_path or None)

    def create_run(self, name: str, tags: Mapping[str, str], params: Mapping[str, Any] = ()) -> str:
        run = self.client.create_run(self.experiment_id, run_name=name, tags=dict(tags))
        self.log_params(run.info.run_id, dict(params))
        return run.info.run_id

    def find_runs(self, filter_string: str) -> list[Any]:
        self.flush()  # what this tracker queued is in what it finds
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
        """The child run of Tune trial ``trial_id``: found (after a resume) or created. A run
        found again is running again: the ``error`` tag of an earlier failure is removed (a
        trial continued after it failed and then finished has no error; one that fails again
        gets its new one)."""
        found = self.find_runs(
            f"tags.`{PARENT_TAG}` = '{parent_id}' and tags.tune_trial_id = '{trial_id}'"
        )
        if found:
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
            if ERROR_TAG in found[0].data.tags:
                self.client.delete_tag(run_id, ERROR_TAG)
            return run_id
        tags = {**tags, PARENT_TAG: parent_id, "tune_trial_id": trial_id}
        return self.create_run(name, tags, params)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Written at once, as tags are (also where ``MLFLOW_ENABLE_ASYNC_LOGGING`` is set)."""
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        if items:
            self.client.log_batch(run_id, params=items, synchronous=True)

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int) -> None:
        """A few metrics (a summary, an analysis), written at once."""
        now = int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, step)
                                               for k, v in metrics.items()], synchronous=True)

    def log_batch(self, run_id: str, metrics: list[Metric]) -> None:
        """Queue one record (metrics of any steps) for the store (see the class docstring)."""
        if not metrics:
            return
        if self._records is None:
            self._records = RecordQueue(self._write)
        self._records.put(run_id, metrics)

    def _write(self, run_id: str, metrics: list[Metric]) -> None:
        self.client.log_batch(run_id, metrics=metrics, synchronous=True)

    def flush(self) -> int:
        """Wait until the queued records are written.

        A record that could not be written is not retried: each run's are reported in one error
        line (what they held is not in MLflow). Returns how many records were lost.
        """
        lost: dict[str, list[tuple[int, BaseException]]] = {}
        for run, records, error in self._records.wait() if self._records is not None else ():
            lost.setdefault(run, []).append((records, error))
        for run, failures in lost.items():
            log.error("MLflow did not record %d epoch record(s) of run %s: %s",
                      sum(n for n, _ in failures), run, _first_line(failures[0][1]))
        return sum(n for failures in lost.values() for n, _ in failures)

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        """Written at once: a resumed study finds a trial's run by its tags."""
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()],
                              synchronous=True)

    def last_step(self, run_id: str, key: str) -> int:
        self.flush()
        history = self.client.get_metric_history(run_id, key)
        return max((m.step for m in history), default=0)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.flush()  # a run is finished with every record it was given
        self.client.set_terminated(run_id, status=status)


def _first_line(error: BaseException, limit: int = 300) -> str:
    lines = str(error).strip().splitlines()
    return (lines[0] if lines else type(error).__name__)[:limit]


def serves_artifacts(tracking_uri: str) -> bool:
    """Whether the tracking URI is a tracking server's (``http``, ``https``, ``databricks``),
    which stores the artifacts of the runs it records in its own artifact store."""
    return tracking_uri.split("://", 1)[0].split(":", 1)[0] in SERVED_SCHEMES


def check_database_driver(tracking_uri: str) -> None:
    """A database tracking URI (``postgresql://``, ``mysql+pymysql://``, ...) whose driver is
    installed: SQLAlchemy, which MLflow reads it with, imports the driver only when it first
    connects, after the study's data and Ray started. SQLAlchemy 2.1 reads a bare
    ``postgresql://`` with psycopg 3 (the ``postgres`` extra) and a bare ``mysql://`` with
    MySQLdb (which has no wheel for Linux; the ``mysql`` extra installs PyMySQL, for
    ``mysql+pymysql://``).

    Raises:
        UserError: one line naming the URI, the missing driver and the extra to install.
    """
    scheme = tracking_uri.split("://", 1)[0] if "://" in tracking_uri else ""
    if not scheme or scheme.split("+", 1)[0] in (*SERVED_SCHEMES, "sqlite", "file"):
        return
    from sqlalchemy.engine import make_url  # lazy: MLflow's dependency, needed only here
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError  # lazy: as make_url's

    shown = _without_password(tracking_uri)
    try:
        dialect = make_url(tracking_uri).get_dialect()
        dialect.import_dbapi()
    except (ArgumentError, NoSuchModuleError) as exc:
        raise UserError(f"--tracking-uri {shown}: not a database URL SQLAlchemy reads "
                        f"({str(exc).splitlines()[0]})") from None
    except ImportError as exc:
        missing = exc.name or dialect.driver
        extra = DRIVER_EXTRAS.get((dialect.name, dialect.driver))
        if extra is not None:
            fix = f"pip install 'icr-studies[{extra}]'"
        elif dialect.name in DRIVER_SCHEMES:
            scheme, extra = DRIVER_SCHEMES[dialect.name]
            fix = f"install {missing}, or write {scheme}://... and pip install 'icr-studies[{extra}]'"
        else:
            fix = f"install {missing}"
        raise UserError(f"--tracking-uri {shown}: its driver {missing} is not installed; "
                        f"{fix}") from None


def _without_password(uri: str) -> str:
    """The URI with the password of its user replaced by ``***`` (it is printed)."""
    parts = urllib.parse.urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def check_store(tracking_uri: str, busy_timeout: float = 30.0) -> None:
    """A sqlite tracking store that exists must be an intact database that the installed MLflow
    opens (MLflow refuses a store at another schema revision than its own).

    Checked on the driver before Ray starts (``PRAGMA quick_check`` reads every page, 0.25 s
    for 250 MB): MLflow would otherwise fail on the store's first damaged page, after the study
    started. A store that another driver keeps locked for ``busy_timeout`` seconds is in use,
    not damaged: it is left unchecked.

    Raises:
        UserError: one line naming the file, what is wrong and the fix.
    """
    db = sqlite_file(tracking_uri)
    if db is None or not db.is_file():
        return
    try:
        try:
            rows = _quick_check(db, busy_timeout, "ro")
        except sqlite3.OperationalError as exc:
            if "readonly" not in str(exc):
                raise
            # A hot journal: a writer killed mid-transaction (SIGKILL). Only a writable
            # connection lets SQLite roll it back, as any next writer would.
            rows = _quick_check(db, busy_timeout, "rw")
        problem = "" if rows == [("ok",)] else str(rows[0][0]).splitlines()[0]
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):  # another study writes to it
            log.info("the MLflow store %s is busy; not checked", db)
            return
        problem = str(exc).splitlines()[0]
    except sqlite3.Error as exc:
        problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if problem:
        raise UserError(
            f"the MLflow store {db} is damaged ({problem}); move it aside (mv {db} "
            f"{db}.damaged: the next run starts a new store) or put back a copy from a "
            "backup, then run the same command again")
    try:
        MlflowClient(tracking_uri).search_experiments(max_results=1)
    except MlflowException as exc:
        raise UserError(f"the MLflow store {db} cannot be opened by the installed mlflow "
                        f"{mlflow.__version__}: {_first_line(exc)}") from None


def _quick_check(db: Path, busy_timeout: float, mode: str) -> list[tuple]:
    with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode={mode}", uri=True,
                                            timeout=busy_timeout)) as con:
        return con.execute("PRAGMA quick_check").fetchall()


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


def step_tags(result: Mapping[str, Any]) -> dict[str, str]:
    """How a trial's steps ran (its result's ``steps``, :func:`studies.trainable.tune_record`)
    as the run's ``steps.*`` tags; empty when the result does not say."""
    steps = result.get("steps")
    if not isinstance(steps, Mapping):
        return {}
    return {"steps.mode": str(steps.get("mode", "")),
            "steps.shapes": "; ".join(steps.get("shapes", ())),
            "steps.reason": str(steps.get("reason", "")),
            "steps.fell_back": str(bool(steps.get("fell_back"))).lower()}


def checkpoint_location(checkpoint: Any, storage_root: str = "") -> str:
    """Where a Tune checkpoint is, as ``tune.Checkpoint(location)`` reads it on any node (the
    ``checkpoint`` tag of a run, for ensembles and analyses): its folder on a local or shared
    file system, else its URI (``s3://bucket/...``, ``gcs://bucket/...``) with the query string
    of the study's storage URI ``storage_root`` (its file system's options: an S3-compatible
    server's ``endpoint_override``, say)."""
    if storage.is_local(checkpoint.filesystem):
        return checkpoint.path
    kind = checkpoint.filesystem.type_name
    return storage.with_query_of(f"{kind}://{checkpoint.path}", storage_root)


class MlflowTrialCallback(Callback):
    """Records every trial of a Tuner as a child run of the study's parent run.

    An epoch reported without a checkpoint is recorded when its result arrives; one reported
    with a checkpoint once Tune has saved the checkpoint (:meth:`on_checkpoint`).

    Each epoch once (:class:`studies.trials.EpochLedger`): a restored trial reports the epoch
    it continues after again (:func:`studies.trainable.resume_point`), which this run may hold
    already; it is written only above the run's last recorded epoch, read from MLflow when the
    run is first opened. MLflow and Tune's result files are written at different moments, and
    a killed driver leaves either ahead (``tests/test_tracking.py``: a replayed epoch reaches
    each store that lacks it).
    """

    def __init__(
        self, tracker: Tracker, parent_id: str, tags: Mapping[str, str],
        fingerprints: Mapping[str, str], max_epochs: Mapping[str, int], storage_root: str = "",
    ) -> None:
        self.tracker = tracker
        self.storage_root = storage_root  # the study's Tune storage (its URI's options)
        self.parent_id = parent_id
        self.tags = dict(tags)
        self.fingerprints = dict(fingerprints)
        self.max_epochs = dict(max_epochs)  # per condition: a trial's full budget in epochs
        self._runs: dict[str, str] = {}
        self._ledger = EpochLedger()  # run id -> its last epoch recorded
        self._step_tags: dict[str, dict[str, str]] = {}  # run id -> its steps.* tags written

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_runs": {}, "_ledger": EpochLedger(), "_step_tags": {}}

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
            self._ledger.open(run_id, self.tracker.last_step(run_id, "epoch"))
        return self._runs[trial.trial_id]

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.run_id(trial)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if result.get(CHECKPOINT_DIR):
            return  # recorded with its checkpoint, in on_checkpoint
        self._record(trial, result)

    def _record(self, trial: Any, result: Mapping[str, Any]) -> None:
        """Record one epoch's result, unless its run has it already (an epoch replayed after a
        restore)."""
        run_id = self.run_id(trial)
        if not self._ledger.admit(run_id, epochs_of(result)):
            return
        self.tracker.log_batch(run_id, epoch_metrics(result, int(time.time() * 1000)))
        tags = step_tags(result)
        if tags and tags != self._step_tags.get(run_id):  # written when they change
            self.tracker.set_tags(run_id, tags)
            self._step_tags[run_id] = tags

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
        """An epoch reported with a checkpoint, recorded once Tune has saved the checkpoint.

        The trial marked the checkpoint with its result before Tune copied it
        (:func:`studies.trainable.run_trial`), and a restored trial resumes from its newest
        marked checkpoint (:func:`studies.trainable.resume_point`), so every epoch recorded here
        is one a restored trial continues after. Then the run's ``checkpoint`` tag and the
        epoch's artifacts.
        """
        result = trial.last_result or {}
        run_id = self.run_id(trial)
        self._record(trial, result)
        self.tracker.set_tags(run_id, {"checkpoint": checkpoint_location(checkpoint, self.storage_root)})
        files = result.get("artifacts") or ()
        if not files:
            return
        if storage.is_local(checkpoint.filesystem):  # read in place: as_directory would copy it
            checkpoint = Checkpoint(checkpoint.path)
        with checkpoint.as_directory() as directory:
            for name in files:
                path = Path(directory) / name
                if path.is_file():
                    self.tracker.log_artifacts(run_id, path, str(Path(name).parent))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        self.tracker.flush()  # the records still queued, before the report reads them

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        epochs = epochs_of(trial.last_result)
        full = full_budget(epochs, self.max_epochs[spec_of(trial.config).condition])
        self.tracker.set_tags(run_id, {"epochs": epochs, "budget_complete": str(full).lower(),
                                       "stopped_early": str(not full).lower()})
        self.tracker.finish(run_id, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        run_id = self.run_id(trial)
        epochs = epochs_of(trial.last_result)
        self.tracker.set_tags(run_id, {ERROR_TAG: error_line(trial_error(trial)), "epochs": epochs,
                                       "budget_complete": "false", "stopped_early": "false"})
        self.tracker.finish(run_id, "FAILED")
