"""What of MLflow the platform cannot reach through its public client.

Epoch records, runs, params, tags and artifacts all go through ``MlflowClient``
(:mod:`studies.tracking`). Two things are left here:

- :func:`relocate_artifacts`: MLflow has no API that changes an experiment's artifact
  location, so a moved or copied workspace's sqlite store is updated with the standard
  library's ``sqlite3``: the artifact columns of ``experiments`` and ``runs``, which every
  MLflow schema has had (checked before anything is written);
- :func:`tag_value_limit`: the longest tag value MLflow stores whole, from its validation
  module.
"""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from studies.frameworks import FrameworkChanged

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


@contextlib.contextmanager
def _transaction(db: Path) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back on an error.

    ``BEGIN IMMEDIATE`` takes the write lock first (waiting for another writer up to the busy
    timeout), so the transaction cannot fail half-way for a lock; foreign keys are enforced as
    in MLflow's sessions."""
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
