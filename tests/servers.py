"""The servers a lab runs beside the platform, started on 127.0.0.1 for the tests: an
S3-compatible object store (moto's server mode, from PyPI: ``moto[server]`` in the dev extra)
and PostgreSQL (Debian's ``postgresql`` package, which ``.ci/run`` installs where it is
missing), and ``mlflow server`` (:func:`loopback_server`, also loaded by the tracking benchmark
through ``benchmarks/testfakes.py``; its flags, ``/health`` page and the variable that leaves out
its job runner are those of MLflow 3.16 and 3.17).

Each server runs in a process group of its own, started and stopped here by its PID (SIGTERM,
then SIGKILL for whatever of the group is left), also when the test fails; its data lives in a
temporary folder removed after it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from studies.launcher import free_port

START_TIMEOUT_S = 120.0
# Any key works for moto; pyarrow, boto3 and MLflow read them from the environment.
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                  "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def serving(command: list[str], log: Path, ready: Callable[[], bool], **popen) -> Iterator[int]:
    """Run ``command`` in a process group of its own, its output in ``log``, until the block
    ends; yields its PID once ``ready()``. Raises RuntimeError naming the log's last line when
    it exits or is not ready within :data:`START_TIMEOUT_S`."""
    with open(log, "wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, **popen)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if server.poll() is not None or time.monotonic() > deadline:
                lines = log.read_text(errors="replace").strip().splitlines()
                raise RuntimeError(f"{command[0]} did not start ({server.poll()}): "
                                   f"{lines[-1] if lines else 'no output'}")
            time.sleep(0.2)  # polls the server, not a timing
        yield server.pid
    finally:
        stop_group(server)


def stop_group(server: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the process group ``server`` leads (a server passes it on to its workers),
    SIGKILL to what is left of the group after ``grace`` seconds; returns once no process of
    the group is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=grace)
    while time.monotonic() < deadline and _group_alive(server.pid):
        time.sleep(0.1)  # polls the group's workers, not a timing
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    gone = time.monotonic() + grace
    while _group_alive(server.pid) and time.monotonic() < gone:  # SIGKILLed, not yet gone
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class S3:
    """An S3-compatible server on loopback, with one bucket."""

    endpoint: str  # http://127.0.0.1:PORT
    bucket: str

    def uri(self, prefix: str) -> str:
        """``s3://bucket/prefix`` with the server in its query, as Ray documents for
        S3-compatible servers."""
        host = self.endpoint.removeprefix("http://")
        return f"s3://{self.bucket}/{prefix}?endpoint_override={host}&scheme=http"

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_boto_credentials())

    def keys(self, prefix: str = "") -> list[str]:
        """Every object's key under ``prefix``."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket,
                                                                         Prefix=prefix)
        return [item["Key"] for page in pages for item in page.get("Contents", ())]


def _boto_credentials() -> dict[str, str]:
    return {"aws_access_key_id": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"]}


@contextlib.contextmanager
def s3_server(folder: Path, bucket: str = "icr") -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 (``python -m moto.server``), with ``bucket`` created.
    Its clients need the credentials of :data:`S3_CREDENTIALS` in their environment."""
    pytest.importorskip("moto.server", reason="moto's S3 server: pip install 'moto[server]' "
                                              "(the dev extra)")
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with serving(command, folder / "s3.log", lambda: _answers(endpoint)):
        s3 = S3(endpoint, bucket)
        s3.client().create_bucket(Bucket=bucket)
        yield s3


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs: on the PATH, or where Debian's package
    puts them (``/usr/lib/postgresql/<version>/bin``, off the PATH)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                     key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(folders[-1]).parent if folders else None


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A PostgreSQL server on 127.0.0.1 at a free port, in a new database cluster
    (``initdb`` into a temporary folder, trust authentication on loopback); yields the
    SQLAlchemy URL of its ``postgres`` database for psycopg 3 (``postgresql+psycopg://``).

    PostgreSQL refuses to run as root: run as root (as CI is), the server runs as the
    ``postgres`` user that Debian's package creates, in a folder it owns.
    """
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3: pip install 'icr-studies[postgres]'")
    binaries = postgres_bin()
    if binaries is None:
        pytest.skip("PostgreSQL's server is not installed (apt-get install postgresql; "
                    ".ci/run installs it)")
    user: dict = {}
    folder = Path(tempfile.mkdtemp(prefix="icr-postgres-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
            user = {"user": "postgres", "group": "postgres", "extra_groups": []}
        data = folder / "data"
        subprocess.run([str(binaries / "initdb"), "-D", str(data), "-U", "postgres",
                        "--auth=trust", "--no-sync"], check=True, cwd=folder,
                       capture_output=True, **user)
        port = free_port()
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"

        def ready() -> bool:
            try:
                psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres",
                                connect_timeout=2).close()
            except psycopg.OperationalError:
                return False
            return True

        command = [str(binaries / "postgres"), "-D", str(data), "-h", "127.0.0.1",
                   "-p", str(port), "-k", str(folder), "-c", "fsync=off"]
        log = Path(tempfile.mkstemp(prefix="icr-postgres-", suffix=".log")[1])
        try:
            with serving(command, log, ready, cwd=folder, **user):
                yield url
        finally:
            log.unlink(missing_ok=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)



def _healthy(url: str) -> bool:
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
    once it answers. When the block ends (also on an error or Ctrl-C) the server is stopped by
    the process group it was started in, so its workers with it. Its job runner (seven processes
    MLflow 3.17 starts for GenAI jobs) is left out: recording runs does not use it.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds (the
            message ends with the last line of its log).
    """
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", artifacts or str(folder / "artifacts"),
               "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "wb") as out:
        server = subprocess.Popen(command, cwd=folder, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.monotonic()
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() - start > timeout:
                lines = (folder / "server.log").read_text(errors="replace").strip().splitlines()
                state = (f"exited with {server.returncode}" if server.returncode is not None
                         else f"did not answer within {timeout:.0f} s")
                raise RuntimeError(f"mlflow server at {url} {state}: "
                                   f"{lines[-1] if lines else 'no output'}")
            time.sleep(0.2)  # polls the server, not a timing
        yield url
    finally:
        stop_group(server)


def served_artifacts(client, run_id: str, destination: Path) -> set[str]:
    """The artifact paths of a run of a local store whose artifacts ``mlflow server
    --artifacts-destination destination`` serves (``mlflow-artifacts:/...``, which MLflow's
    client reads only through a server): the files under the run URI's path in the destination,
    where ``test_a_moved_workspace_s_artifacts_are_served_from_it`` fetches them through one."""
    uri = client.get_run(run_id).info.artifact_uri
    assert uri.startswith("mlflow-artifacts:/"), uri
    root = destination / uri.removeprefix("mlflow-artifacts:/")
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}

