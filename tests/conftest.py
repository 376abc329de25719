"""Shared, session-scoped fixtures: one workspace with the tiny embedded benchmark."""

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
