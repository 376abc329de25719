"""The process environment every entry point sets before Ray, Tune or MLflow is imported."""

from __future__ import annotations

import os


def set_quiet_environment() -> None:
    """Telemetry off and Ray's own chatter down, for every entry point."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # An MLflow server store: no two lines (and one more request) per finished run.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0")  # save Tune's state at every event
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # tuning.py adds JSON and CSV
    # Tune's classic reporter: silent at verbose=0 (the new one prints a table per experiment).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
