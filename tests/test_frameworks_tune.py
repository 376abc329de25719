"""Tune's state copies: Ray's harmless copy race is quiet, real copy failures are not."""

from __future__ import annotations

import logging

import pytest
from ray.train._internal.syncer import _BackgroundProcess, _BackgroundSyncer

from studies.frameworks.tune import quiet_retried_syncs


def failed_copy(error: Exception) -> list[logging.LogRecord]:
    """What Ray's syncer logs when it starts a copy after the previous one raised ``error``."""
    def previous() -> None:
        raise error

    syncer = _BackgroundSyncer()
    syncer._sync_process = _BackgroundProcess(previous)
    syncer._sync_process.start()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ray.train._internal.syncer")
    # Whatever earlier tests did to logging (levels, loggers disabled by a dictConfig), this
    # logger emits here, so a missing record can only be the filter's doing.
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.DEBUG)
    logger.disabled = False
    logger.addHandler(handler)
    try:
        syncer._launch_sync_process((lambda: None, {}))
        syncer.wait()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = disabled
    return [r for r in records if r.levelno >= logging.WARNING]


@pytest.fixture(autouse=True)
def _quiet() -> None:
    quiet_retried_syncs()
    quiet_retried_syncs()  # installed once however often it is called
    filters = logging.getLogger("ray.train._internal.syncer").filters
    assert sum(type(f).__name__ == "RetriedSyncFilter" for f in filters) == 1


def test_a_copy_that_met_a_state_file_being_rewritten_is_not_shown() -> None:
    gone = FileNotFoundError(
        "[Errno 2] Failed to open local file '/tmp/s/driver_artifacts/"
        ".d373-tmp-searcher-state-2026-11-22_20-22-34.pkl'. Detail: [errno 2] No such file")
    assert failed_copy(gone) == []


def test_any_other_failed_copy_is_shown_with_its_traceback() -> None:
    shown = failed_copy(PermissionError("[Errno 13] Permission denied: '/storage/exp'"))
    assert len(shown) == 1 and "PermissionError" in shown[0].getMessage()
    missing = failed_copy(FileNotFoundError("[Errno 2] No such file: '/storage/exp/tuner.pkl'"))
    assert len(missing) == 1 and "tuner.pkl" in missing[0].getMessage()


def test_a_failed_trial_s_error_is_read_before_tune_copies_it_to_the_storage(tmp_path, monkeypatch) -> None:
    """Tune writes the error into the driver's staging folder and copies it to the storage later;
    the callbacks run in between and must still name the cause."""
    from ray.train._internal import storage as ray_storage
    from ray.train._internal.storage import StorageContext

    # The staging folder lives in the Ray session's folder; no Ray instance is needed for it here.
    monkeypatch.setattr(ray_storage, "_get_ray_train_session_dir", lambda: str(tmp_path / "session"))
    from ray.tune.experiment import Trial

    from icr.errors import TrainingError
    from studies.frameworks.tune import trial_error
    from studies.tracking import error_line

    storage = StorageContext(storage_path=str(tmp_path / "storage"), experiment_dir_name="exp",
                             trial_dir_name="trial_0")
    trial = Trial("trainable", stub=True, storage=storage)
    trial.init_local_path()
    trial.handle_error(TrainingError("non-finite loss at epoch 2"))
    assert trial.get_error() is None  # not copied to the storage yet
    assert error_line(trial_error(trial)).endswith("non-finite loss at epoch 2")
