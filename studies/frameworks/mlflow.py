"""MLflow's tables and command line, where the platform needs them (tested with MLflow 3.17.2).

Everything else records through MLflow's public client. Two things cannot be done that way:

- :func:`insert_metrics`: epoch records written into a local sqlite store in one transaction,
  by :class:`RecordWriter`'s thread, each transaction holding every record queued by then.
  MLflow's ``log_batch`` builds an ORM object per value and commits each call: it records fewer
  than the 50 epochs a second that one driver recording every trial of a study needs (an epoch
  is about 40 metrics and 60 trajectory rows of 4 terms, 280 values).
  ``benchmarks/tracking_throughput.py`` measures both ways; docs/benchmarks.md has its runs.
- :func:`relocate_artifacts`: MLflow has no API that changes an experiment's artifact location.

Both write MLflow's tables (``metrics``, ``latest_metrics``, ``experiments``, ``runs``) as the
schema of MLflow 3.17.2 has them, with the standard library's ``sqlite3``: no MLflow module is
imported for it, and :func:`check_sqlite_store` refuses, in one line, a store at another schema
revision or another installed MLflow before anything is written.

:func:`loopback_server` starts ``mlflow server`` (its flags, its ``/health`` page and the
variable that leaves out its job runner are those of 3.17.2) for the benchmark and the tests.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from studies.frameworks import FrameworkChanged
from studies.launcher import free_port

if TYPE_CHECKING:
    from mlflow.entities import Metric

TESTED_VERSION = "3.17.2"
# The alembic revision of the tracking schema that MLflow 3.17.2 creates (its newest migration).
SCHEMA_REVISION = "dc11669786a5"
BUSY_TIMEOUT_S = 20.0  # as MLflow's own sqlite sessions (PRAGMA busy_timeout = 20000)
_MAX_FLOAT = 1.7976931348623157e308  # MLflow stores +-inf as +-this (SQL has no infinity)


def tag_value_limit() -> int:
    """The longest tag value MLflow stores whole (8,000 characters in 3.17.2); longer ones it
    truncates with a warning."""
    return MAX_TAG_VAL_LENGTH


_INSERT_METRIC = (
    "INSERT INTO metrics (key, value, is_nan, timestamp, step, run_uuid) VALUES (?, ?, ?, ?, ?, ?)"
)
# MLflow's rule for the latest value of a key: the one with the greatest (step, timestamp, value).
_UPSERT_LATEST = (
    "INSERT INTO latest_metrics (key, value, is_nan, timestamp, step, run_uuid) "
    "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key, run_uuid) DO UPDATE SET value = excluded.value, "
    "is_nan = excluded.is_nan, timestamp = excluded.timestamp, step = excluded.step "
    "WHERE (excluded.step, excluded.timestamp, excluded.value) "
    "> (latest_metrics.step, latest_metrics.timestamp, latest_metrics.value)"
)


class StoreMismatch(FrameworkChanged):
    """The installed MLflow, or a store's schema, is not the one this adapter writes."""


def installed_version() -> str:
    return importlib.metadata.version("mlflow")


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(urllib.parse.unquote(tracking_uri.removeprefix("sqlite:///").split("?")[0]))


def schema_revision(db: Path) -> str | None:
    """The alembic revision of a sqlite store; None for a file MLflow has not set up yet."""
    with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True,
                                            timeout=BUSY_TIMEOUT_S)) as con:
        try:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError:  # no such table: an empty file
            return None
    return row[0] if row else None


def check_sqlite_store(db: Path) -> None:
    """The installed MLflow and the store's schema are those the SQL writes of this module were
    written for (a store that does not exist yet is made by the installed MLflow).

    Raises:
        StoreMismatch: one line naming the installed and the tested version (or the store's
            revision and the expected one) and the fix.
    """
    installed, tested = installed_version(), TESTED_VERSION
    if installed != tested:
        raise StoreMismatch(
            f"mlflow {installed} is installed, but studies/frameworks/mlflow.py writes the "
            f"tables of mlflow {tested}; install mlflow=={tested} (as pyproject.toml pins it) "
            "or check that adapter against the installed version")
    revision = schema_revision(db) if db.is_file() else None
    if revision not in (None, SCHEMA_REVISION):
        raise StoreMismatch(
            f"the MLflow store {db} is at schema revision {revision}, but mlflow {installed} "
            f"and studies/frameworks/mlflow.py (tested with {tested}) write revision "
            f"{SCHEMA_REVISION}; use the mlflow version that wrote it, or back it up and run "
            f"`mlflow db upgrade sqlite:///{db}` if it is older")


@contextlib.contextmanager
def _transaction(db: Path) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back on an error.

    ``BEGIN IMMEDIATE`` takes the write lock first (waiting for another writer up to the busy
    timeout), so the transaction cannot fail half-way for a lock; foreign keys are enforced as
    in MLflow's sessions (a metric of an unknown run is refused)."""
    con = sqlite3.connect(db, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        con.execute("PRAGMA foreign_keys = ON")
        con.execute("BEGIN IMMEDIATE")
        try:
            yield con
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")
    finally:
        con.close()


class _LeftToMlflow(Exception):
    """A record that MLflow's own rules must judge: nothing of it was written."""


def _stored(value: float) -> tuple[float, int]:
    """A metric value as MLflow stores it: (value, is_nan), NaN as 0 and infinities as +-max."""
    if math.isnan(value):
        return 0.0, 1
    if math.isinf(value):
        return math.copysign(_MAX_FLOAT, value), 0
    return value, 0


def insert_metrics(db: Path, records: Sequence[tuple[str, Sequence[Metric]]]) -> bool:
    """Record ``records`` (run id, its metrics) in the sqlite store ``db`` as ``log_batch`` would,
    all in one transaction: the history rows (``metrics``) and the latest value per key
    (``latest_metrics``, what the runs table shows), replaced only by a value with a greater
    (step, timestamp, value). ``tests/test_tracking.py`` holds the result equal to
    ``log_batch``'s. Call :func:`check_sqlite_store` first.

    Returns:
        True when written; False when nothing was written because MLflow must judge a record
        (a metric of it is recorded already, its run is unknown or deleted): the caller logs
        the records through ``MlflowClient.log_batch``, which skips what is recorded or raises
        its error.
    """
    rows = [(m.key, *_stored(float(m.value)), m.timestamp, m.step, run_id)
            for run_id, metrics in records for m in metrics]
    try:
        with _transaction(db) as con:
            for run_id in {run_id for run_id, _ in records}:
                stage = con.execute("SELECT lifecycle_stage FROM runs WHERE run_uuid = ?",
                                    (run_id,)).fetchone()
                if stage != ("active",):
                    raise _LeftToMlflow
            con.executemany(_INSERT_METRIC, rows)
            con.executemany(_UPSERT_LATEST, rows)
    except (_LeftToMlflow, sqlite3.IntegrityError):
        return False
    return True


class RecordWriter:
    """Epoch records written into a sqlite store by a background thread, each transaction
    holding every record queued by then.

    A commit costs the disk syncs of a transaction (about 20 ms on a busy machine), the rows of a
    record about 1 ms, so records that arrive while one is written are committed with the next
    (``benchmarks/tracking_throughput.py``). The thread runs while records are queued and is not
    a daemon: a driver that exits writes what it queued first. A record that
    :func:`insert_metrics` leaves to MLflow (recorded already after a resume, a deleted run) goes
    to ``judge``: MLflow's ``log_batch``. Call :func:`check_sqlite_store` first.
    """

    def __init__(self, db: Path, judge: Callable[[str, list[Metric]], None]) -> None:
        self.db = db
        self._judge = judge
        self._lock = threading.Condition()
        self._queued: list[tuple[str, list[Metric]]] = []
        self._running = False  # a thread writes the queue
        self._failed: list[tuple[str, BaseException]] = []

    def put(self, run_id: str, metrics: list[Metric]) -> None:
        with self._lock:
            self._queued.append((run_id, metrics))
            if not self._running:
                threading.Thread(target=self._drain, name="mlflow-record-writer").start()
                self._running = True

    def wait(self) -> list[tuple[str, BaseException]]:
        """Wait until every queued record is written; returns (run id, error) of each record
        that could not be, since the last wait."""
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
            self._write(records)

    def _write(self, records: list[tuple[str, list[Metric]]]) -> None:
        """Never raises: the thread must go on to empty the queue (wait() waits for that)."""
        with contextlib.suppress(Exception):  # then each record on its own, with its error
            if insert_metrics(self.db, records):
                return
        for run_id, metrics in records:
            try:
                if not insert_metrics(self.db, [(run_id, metrics)]):
                    self._judge(run_id, metrics)
            except Exception as exc:  # no caller to raise to: wait() reports it
                with self._lock:
                    self._failed.append((run_id, exc))


def relocate_artifacts(db: Path, root: Path) -> list[tuple[str, str, str]]:
    """Point the artifact locations a moved or copied workspace's store recorded at ``root``.

    MLflow makes an experiment's artifact location an absolute path when it creates the
    experiment, and a run's artifact URI is that path plus the run's folder, so a copied
    workspace would read (or miss) the original's files. Every experiment located in a folder
    ``<old workspace>/<root's name>/<name>`` other than ``root/<name>`` is moved to
    ``root/<name>``, its runs with it; locations elsewhere (a shared store, S3) are left alone.

    Returns:
        (experiment id, new location, old location) of each experiment moved.
    """
    root = root.resolve()
    moved = []
    with _transaction(db) as con:
        for experiment_id, old in con.execute(
                "SELECT experiment_id, artifact_location FROM experiments").fetchall():
            if not (old or "").startswith("file://"):
                continue
            path = Path(urllib.request.url2pathname(urllib.parse.urlparse(old).path))
            if path.parent.name != root.name or path.parent == root:
                continue
            new = (root / path.name).as_uri()
            con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                        (new, experiment_id))
            con.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                        "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                        (new, len(old) + 1, experiment_id, len(old) + 1, old + "/"))
            moved.append((str(experiment_id), new, old))
    return moved


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


@contextlib.contextmanager
def loopback_server(backend_store_uri: str, folder: Path, workers: int = 1,
                    timeout: float = 300.0, artifacts: str | None = None) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 at a free port, over ``backend_store_uri``, its artifacts
    in ``artifacts`` (a folder or a URI such as ``s3://bucket/mlflow``; default: ``folder``'s
    ``artifacts``, served by the server either way) and its log in ``folder``: yields its URL
    once it answers. When the block ends (also on an
    error or Ctrl-C) the server is stopped by the process group it was started in, so its
    workers with it. Its job runner (seven processes MLflow 3.17 starts for GenAI jobs) is left
    out: recording runs does not use it.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds (the
            message ends with the last line of its log).
    """
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", artifacts or str(folder / "artifacts"), "--host", "127.0.0.1",
               "--port", str(port), "--workers", str(workers)]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "wb") as out:
        server = subprocess.Popen(command, cwd=folder, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.monotonic()
        while not _answers(url):
            if server.poll() is not None or time.monotonic() - start > timeout:
                lines = (folder / "server.log").read_text(errors="replace").strip().splitlines()
                state = (f"exited with {server.returncode}" if server.returncode is not None
                         else f"did not answer within {timeout:.0f} s")
                raise RuntimeError(f"mlflow server at {url} {state}: "
                                   f"{lines[-1] if lines else 'no output'}")
            time.sleep(0.2)
        yield url
    finally:
        _stop(server)


def _stop(server: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop the process group that ``server`` leads: SIGTERM (the server passes it on to its
    workers), then SIGKILL for whatever of the group is left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=grace)
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
