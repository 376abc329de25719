"""What of MLflow the platform cannot reach through its public client.

Epoch records, runs, params, tags and artifacts all go through ``MlflowClient``
(:mod:`studies.tracking`). Two things are left here:

- :func:`relocate_artifacts`: MLflow has no API that changes an experiment's artifact
  location, so a moved or copied workspace's sqlite store is updated with the standard
  library's ``sqlite3``: the artifact columns of ``experiments`` and ``runs``, which every
  MLflow schema has had (checked before anything is written);
- :func:`tag_value_limit`: the longest tag value MLflow stores whole, from its validation
  module.

:func:`loopback_server` starts ``mlflow server`` (its flags, its ``/health`` page and the
variable that leaves out its job runner) for the benchmark and the tests.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from studies.frameworks import FrameworkChanged
from studies.launcher import free_port

BUSY_TIMEOUT_S = 20.0  # as MLflow's own sqlite sessions (PRAGMA busy_timeout = 20000)
# What relocate_artifacts writes: (table, column), in MLflow's schema since its first revision.
_RELOCATED = (("experiments", "artifact_location"), ("experiments", "experiment_id"),
              ("runs", "artifact_uri"), ("runs", "experiment_id"))


def tag_value_limit() -> int:
    """The longest tag value MLflow stores whole (8,000 characters in 3.x); longer ones it
    truncates with a warning."""
    return MAX_TAG_VAL_LENGTH


class StoreMismatch(FrameworkChanged):
    """A store's schema lacks a column this adapter writes."""


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI; None for any other store."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    return Path(urllib.parse.unquote(tracking_uri.removeprefix("sqlite:///").split("?")[0]))


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
        _check_columns(con, db)
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


def _check_columns(con: sqlite3.Connection, db: Path) -> None:
    """The store has every column :func:`relocate_artifacts` writes, else one line."""
    for table, column in _RELOCATED:
        if column not in {row[1] for row in con.execute(f"PRAGMA table_info({table})")}:
            raise StoreMismatch(
                f"the MLflow store {db} has no column {table}.{column}, which "
                "studies/frameworks/mlflow.py writes to point a moved workspace's artifact "
                "locations at it; open the store with the MLflow that wrote it")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


@contextlib.contextmanager
def loopback_server(backend_store_uri: str, folder: Path, workers: int = 1,
                    timeout: float = 300.0) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 at a free port, over ``backend_store_uri``, its artifacts
    and its log in ``folder``: yields its URL once it answers. When the block ends (also on an
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
               "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
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
