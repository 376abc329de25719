"""Shared, session-scoped fixtures: one workspace with the tiny embedded benchmark."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    """A workspace whose tiny benchmark (seed 0) and caches are shared by the whole session."""
    from icr.workspace import Workspace

    return Workspace(tmp_path_factory.mktemp("workspace"))
