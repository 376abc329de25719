"""Shared fixtures: one workspace with the tiny embedded benchmark (the session's), and a private
Ray instance of 2 CPUs (each test module's that asks for ``cluster``)."""

import os
from pathlib import Path

import pytest

# The platform's test fakes (tests/fakes.py) are imported by the Ray workers that the tests'
# private Ray instances start, which inherit this environment.
TESTS = str(Path(__file__).resolve().parent)
if TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A workspace whose tiny benchmark (seed 0) and caches are shared by the whole session."""
    from icr.workspace import Workspace

    return Workspace(tmp_path_factory.mktemp("workspace"))


@pytest.fixture(scope="module")
def cluster():
    """A private Ray instance on loopback with 2 CPUs, for the module's whole studies; stopped
    by the processes it started when the module is done."""
    from studies import connection
    from studies.environment import set_quiet_environment

    set_quiet_environment()
    info = connection.connect(num_cpus=2, dashboard=False)
    yield info
    connection.disconnect(info)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 for the module's tests (skipped where moto is not
    installed), its credentials in this process's environment."""
    from servers import S3_CREDENTIALS, s3_server

    with pytest.MonkeyPatch.context() as env:
        for name, value in S3_CREDENTIALS.items():
            env.setenv(name, value)
        with s3_server(tmp_path_factory.mktemp("s3")) as server:
            yield server
