"""What of MLflow the platform cannot reach through its public client.

Epoch records, runs, params, tags and artifacts all go through ``MlflowClient``
(:mod:`studies.tracking`), with one exception:

- **the artifacts of a workspace's own store.** MLflow records a ``file://`` artifact location
  as an absolute path, and has no API that changes it, so a moved or copied workspace would
  read, and write, the original's folder. An experiment of the workspace's sqlite store is
  therefore located ``mlflow-artifacts:/<experiment>`` (:func:`served_location`), the location
  a tracking server gives its proxied artifacts: a path relative to the artifact store that
  serves it. MLflow's client writes such a location only through a server, so the platform
  writes the files itself where ``mlflow server --artifacts-destination <workspace>/mlartifacts``
  (``mlflow ui`` takes the same flags) reads them (:func:`write_served_artifacts`): the URI's
  path under the destination, as the server's handlers map it (``mlflow/server/handlers.py:
  _get_proxied_run_artifact_destination_path`` in 3.17).
"""

from __future__ import annotations

import re
import shutil
import urllib.parse
from pathlib import Path

SERVED_SCHEME = "mlflow-artifacts"  # MLflow's scheme of artifacts a tracking server proxies


def served_location(experiment: str) -> str:
    """The served artifact location of an experiment: the destination's folder named after
    it. Characters other than letters, digits, ``.``, ``_`` and ``-`` become ``_``, so the
    name is one plain folder (the server reads the URI's path as written); two experiments
    that share a folder still keep their runs apart, each in its run id's folder."""
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", experiment).strip(".") or "_"
    return f"{SERVED_SCHEME}:/{folder}"


def is_served(artifact_uri: str) -> bool:
    """Whether an artifact location or URI is one an artifact store serves
    (``mlflow-artifacts:``)."""
    return urllib.parse.urlparse(artifact_uri).scheme == SERVED_SCHEME


def served_path(artifact_uri: str, destination: Path) -> Path:
    """Where ``mlflow server --artifacts-destination destination`` reads the artifacts of a
    served URI (``mlflow-artifacts:/<experiment>/<run id>/artifacts``): the URI's path under
    the destination."""
    return destination / urllib.parse.urlparse(artifact_uri).path.lstrip("/")


def write_served_artifacts(artifact_uri: str, destination: Path, local: Path,
                           artifact_path: str = "") -> None:
    """Store ``local`` in the artifacts of a run whose artifact URI is served, as the client
    would through a server: a file as ``log_artifact`` does (into ``artifact_path``), a
    folder's files as ``log_artifacts`` does (under ``artifact_path``); a file already there
    is replaced."""
    folder = served_path(artifact_uri, destination) / artifact_path
    folder.mkdir(parents=True, exist_ok=True)
    if local.is_dir():
        shutil.copytree(local, folder, dirs_exist_ok=True)
    else:
        shutil.copyfile(local, folder / local.name)
