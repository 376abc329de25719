"""Tune's state copies: Ray's harmless copy race is quiet, real copy failures are not, and an
experiment whose saved state was cut short is not taken for a saved one."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path

import pytest
from ray.train._internal.syncer import _BackgroundProcess, _BackgroundSyncer

from studies.frameworks.tune import quiet_retried_syncs, saved_by_tune


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
    from studies.failures import error_line
    from studies.frameworks.tune import trial_error

    storage = StorageContext(storage_path=str(tmp_path / "storage"), experiment_dir_name="exp",
                             trial_dir_name="trial_0")
    trial = Trial("trainable", stub=True, storage=storage)
    trial.init_local_path()
    trial.handle_error(TrainingError("non-finite loss at epoch 2"))
    assert trial.get_error() is None  # not copied to the storage yet
    assert error_line(trial_error(trial)).endswith("non-finite loss at epoch 2")


def saved_experiment(folder: Path, searcher: bool) -> list[Path]:
    """An experiment folder as Tune saves it (state files pickled as Tune pickles them); returns
    the search algorithm's state files."""
    folder.mkdir()
    (folder / "tuner.pkl").write_bytes(pickle.dumps({"tuner": 1}))
    (folder / "experiment_state-2026-11-25_22-57-40.json").write_text('{"trial_data": []}')
    names = (["search_gen_state-2026-11-25_22-57-40.json", "searcher-state-2026-11-25_22-57-40.pkl"]
             if searcher else ["basic-variant-state-2026-11-25_22-57-40.json"])
    for name in names:  # Tune's own pickled; the searcher's (studies.searcher) JSON
        (folder / name).write_bytes(
            json.dumps({"format": "x", "trials": []}).encode() if name.startswith("searcher-")
            else pickle.dumps({"counter": 4, "live_trials": {"631e9b45"}}))
    return [folder / name for name in names]


TRIALS = "experiment_state-2026-11-25_22-57-40.json"  # the trials' state in saved_experiment


@pytest.mark.parametrize("searcher", [True, False], ids=["searcher", "grid"])
def test_an_experiment_counts_as_saved_only_with_every_state_file_whole(tmp_path, searcher) -> None:
    """The trials' state (JSON, rewritten in place at every turn of Tune's loop) as much as
    the search algorithm's: a restore that fails on any of them restarts the experiment with
    one trial (:func:`studies.frameworks.tune.saved_by_tune`)."""
    states = [tmp_path / "whole" / TRIALS, *saved_experiment(tmp_path / "whole", searcher)]
    assert saved_by_tune(tmp_path / "whole")
    for i, state in enumerate(states):
        for cut in (0, len(state.read_bytes()) // 2):  # emptied, or cut in the middle
            folder = tmp_path / f"cut-{i}-{cut}"
            saved_experiment(folder, searcher)
            (folder / state.name).write_bytes(state.read_bytes()[:cut])
            assert not saved_by_tune(folder), (state.name, cut)
        folder = tmp_path / f"missing-{i}"  # not copied to the storage yet
        saved_experiment(folder, searcher)
        (folder / state.name).unlink()
        assert not saved_by_tune(folder), state.name


def test_only_the_newest_state_files_count_as_tune_restores_from_them(tmp_path) -> None:
    """A restore reads the newest file of each kind (by name: its driver's start time); an
    older one cut short by the first driver's kill does not matter, a newest one does."""
    folder = tmp_path / "experiment"
    states = [folder / TRIALS, *saved_experiment(folder, searcher=True)]
    for state in states:  # the first driver's, cut short
        (folder / state.name.replace("2026-11-25_22-57-40", "2026-11-25_22-50-00")).write_bytes(
            state.read_bytes()[:3])
    assert saved_by_tune(folder)
    for state in states:
        whole = state.read_bytes()
        state.write_bytes(whole[:3])
        assert not saved_by_tune(folder), state.name
        state.write_bytes(whole)


def _report_once(config: dict) -> None:
    from ray import tune

    tune.report({"score": config["x"]})


@pytest.mark.slow
def test_a_restore_that_cannot_read_the_trials_state_ends_with_one_new_trial(cluster, tmp_path) -> None:
    """Why the trials' state must be whole (the bug the resumed search met under load: "Tune
    returned with 1 of 2 trial(s) ... not ended"): Tune 2.60 restoring an experiment whose
    ``experiment_state-*`` a kill cut short logs "Failed to restore the run state" and runs
    a new experiment of ``num_samples=1`` instead, whatever the Tuner planned; the driver
    starts such an experiment over instead (:func:`saved_by_tune`)."""
    from ray import tune

    space = {"x": tune.uniform(0.0, 1.0)}
    tuner = tune.Tuner(_report_once, param_space=space,
                       tune_config=tune.TuneConfig(num_samples=2, max_concurrent_trials=2),
                       run_config=tune.RunConfig(name="exp", storage_path=str(tmp_path), verbose=0))
    assert len(tuner.fit()) == 2
    experiment = tmp_path / "exp"
    assert saved_by_tune(experiment)
    (state,) = experiment.glob("experiment_state-*.json")
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    assert not saved_by_tune(experiment)
    grid = tune.Tuner.restore(str(experiment), _report_once, param_space=space,
                              resume_unfinished=True, resume_errored=True).fit()
    assert (len(grid), grid.num_terminated) == (1, 1)  # one new trial where two were planned


def test_an_experiment_with_only_tuner_pkl_is_not_saved(tmp_path) -> None:
    (tmp_path / "tuner.pkl").write_bytes(pickle.dumps({"tuner": 1}))
    assert not saved_by_tune(tmp_path)


def test_a_checkpoint_copy_cut_short_is_not_taken_for_a_marked_one(tmp_path) -> None:
    """A trial marks its checkpoint (the result and the size of each file) before Tune copies
    it to storage; a driver killed during the copy leaves the mark without all the files."""
    from ray import tune

    from studies.trainable import mark, marked_checkpoints

    trial = tmp_path / "trial"
    for epoch, name in enumerate(("checkpoint_000000", "checkpoint_000001"), start=1):
        folder = trial / name
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "weights.pt").write_bytes(b"w" * 100 * epoch)
        (folder / "state.json").write_text(json.dumps({"epoch": epoch}))
        mark(tune.Checkpoint.from_directory(str(folder)), {"epoch": epoch, "training_iteration": 9})
    found = {Path(c.path).name: record for c, record in marked_checkpoints(str(trial))}
    assert found == {"checkpoint_000000": {"epoch": 1}, "checkpoint_000001": {"epoch": 2}}
    (trial / "checkpoint_000001" / "model" / "weights.pt").write_bytes(b"w" * 150)  # cut short
    assert [Path(c.path).name for c, _ in marked_checkpoints(str(trial))] == ["checkpoint_000000"]
    (trial / "checkpoint_000000" / "state.json").unlink()  # a file not copied yet
    assert marked_checkpoints(str(trial)) == []


@pytest.mark.parametrize("stored", [
    None,  # Tune's saved state copied, the result file not yet
    '{"epoch": 1, "val_rsum": 5.0}\n{"epoch": 2, "val_r',  # its row cut short
    '{"epoch": 1, "val_rsum": 5.0}\n{"epoch": 2, "val_rsum": 6.0}\n',  # whole: MLflow may lack it
], ids=["no-file", "row-cut-short", "file-whole"])
def test_a_resumed_checkpoint_that_tune_gave_is_reported_again_without_a_checkpoint(
        tmp_path, monkeypatch, stored) -> None:
    """A restored trial that Tune gives its newest marked checkpoint (epoch 2) reports that
    epoch's result again, without a checkpoint, whatever the stores hold: the trial's
    result.json in the storage may end before it (a driver killed while Tune copied its state
    and the result files), or MLflow may lack it (killed before the queued record was written)
    while the file holds it. Each store writes it where it lacks it (EpochLedger). The old
    trial reported it only where the stored file lacked it, so an MLflow run behind a whole
    file never got the epoch."""
    from ray import tune

    from studies import trainable
    from studies.trainable import TrialJob, mark, resume_point

    trial = tmp_path / "experiment" / "trial_0"
    for epoch in (1, 2):
        folder = trial / f"checkpoint_00000{epoch - 1}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"epoch": epoch}))
        mark(tune.Checkpoint.from_directory(str(folder)), {"epoch": epoch, "val_rsum": 4.0 + epoch})
    if stored is not None:
        (trial / "result.json").write_text(stored)
    reports = []
    monkeypatch.setattr(trainable, "trial_folder", lambda experiment: str(trial))
    monkeypatch.setattr(tune, "get_checkpoint",
                        lambda: tune.Checkpoint.from_directory(str(trial / "checkpoint_000001")))
    monkeypatch.setattr(tune, "report", lambda metrics, checkpoint=None: reports.append(
        (metrics, checkpoint)))
    job = TrialJob("s", "search", str(tmp_path), str(trial.parent))
    local, ended = resume_point(job, tmp_path / "resume")
    assert local == tmp_path / "resume" and not ended
    assert json.loads((local / "state.json").read_text()) == {"epoch": 2}
    assert reports == [({"epoch": 2, "val_rsum": 6.0}, None)]


class Planted:
    """What a stranger with write access to the storage could put in a state file: unpickled,
    it makes a folder (any code would run the same way)."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.flag),)


@pytest.mark.parametrize("name", ["searcher-state-2026-11-25_22-57-40.pkl",
                                  "search_gen_state-2026-11-25_22-57-40.json",
                                  "basic-variant-state-2026-11-25_22-57-40.json"])
def test_checking_an_experiment_s_state_files_executes_none_of_them(tmp_path, name) -> None:
    """The check that Tune saved an experiment whole loaded each state file with pickle.load,
    running whatever a file from the storage (which may be a shared bucket) asked."""
    folder = tmp_path / "experiment"
    saved_experiment(folder, searcher=not name.startswith("basic-"))
    flag = tmp_path / "executed"
    (folder / name).write_bytes(pickle.dumps(Planted(flag)))
    saved_by_tune(folder)
    assert not flag.exists()


def test_the_adapter_s_bookkeeping_keys_and_metadata_file_are_the_installed_tune_s() -> None:
    """The adapter spells out the keys Tune documents and asks Checkpoint for its metadata file;
    here they are compared with the installed Tune's own constants, so that a Tune that adds a
    key (which would be recorded as a metric) is a failing test."""
    from ray.train._checkpoint import _METADATA_FILE_NAME
    from ray.tune.result import AUTO_RESULT_KEYS

    from studies.frameworks.tune import BOOKKEEPING, METADATA_FILE

    installed = {*AUTO_RESULT_KEYS, "done", "trial_id", "should_checkpoint", "experiment_tag"}
    assert installed == BOOKKEEPING
    assert METADATA_FILE == _METADATA_FILE_NAME
