"""What a study checks on a cluster: each trial's node reads its data and the study's storage
(else the study stops with one line naming the node and the path, no retry), and a study whose
every run failed does not exit 0.

The unit tests need no Ray instance; the end-to-end ones (slow) run the fake study on a private
Ray instance, where a data folder that the driver prepared and no node can read stands for a
worker node without the shared mount.
"""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from icr.config import from_flat, local_paths
from studies.failures import NodeCannotRead, node_cannot_read
from studies.frameworks.tune import raised_in_callback
from studies.trainable import (
    STORAGE_MARKER,
    TrialJob,
    check_readable,
    path_problem,
    storage_problem,
)

from fakes import FakeFit, fake_prepare, fake_study


def job(tmp_path: Path, data: dict[str, str] | None = None) -> TrialJob:
    experiment = tmp_path / "storage" / "search-x"
    experiment.mkdir(parents=True, exist_ok=True)
    (experiment / STORAGE_MARKER).touch()  # as the driver writes it when the Tuner starts
    return TrialJob("fake", "search", str(tmp_path / "ws"), str(experiment), data or {})


def test_a_path_is_readable_when_its_folder_lists_or_its_file_opens(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert path_problem(str(tmp_path)) == ""
    assert path_problem(str(tmp_path / "file")) == ""
    assert path_problem(str(tmp_path / "gone")) == "no such file or folder on this node"
    assert path_problem(str(tmp_path / "file" / "below")) != ""  # a file is no folder


def test_the_storage_is_shared_when_the_node_sees_the_marker_tune_wrote(tmp_path: Path) -> None:
    experiment = tmp_path / "search-x"
    experiment.mkdir()
    assert "not found from this node" in storage_problem(str(experiment))
    (experiment / STORAGE_MARKER).touch()
    assert storage_problem(str(experiment)) == ""
    assert storage_problem(f"file://{experiment}") == ""  # a URI goes through its file system


def test_a_trial_names_its_node_and_the_path_it_cannot_read(tmp_path: Path) -> None:
    config = from_flat({"data.preset": "tiny"})
    check_readable(job(tmp_path, {"c": str(tmp_path)}), config, "c")  # all readable: no error
    with pytest.raises(NodeCannotRead) as caught:
        check_readable(job(tmp_path, {"c": str(tmp_path / "absent")}), config, "c")
    line = str(caught.value)
    assert line.startswith("node ") and f"({socket.gethostname()})" in line
    assert f"cannot read the prepared data folder {tmp_path / 'absent'} (no such file" in line
    assert "\n" not in line

    # a file the configuration names, here a relevance matrix missing on this node
    config = from_flat({"data.preset": "tiny", "data.relevance": str(tmp_path / "rel.npy")})
    assert local_paths(config) == {"data.relevance": tmp_path / "rel.npy"}
    with pytest.raises(NodeCannotRead, match=r"cannot read data.relevance .*rel\.npy"):
        check_readable(job(tmp_path), config, "c")


def test_a_local_storage_is_given_to_the_trials_as_an_absolute_path(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """A trial runs in its own folder: a relative --storage would name another folder there."""
    from studies.plan import check_storage_uri

    monkeypatch.chdir(tmp_path)
    assert check_storage_uri("tune-storage") == str(tmp_path / "tune-storage")
    assert check_storage_uri("s3://bucket/prefix") == "s3://bucket/prefix"


def test_a_trial_that_does_not_see_the_storage_says_so_before_its_data(tmp_path: Path) -> None:
    unshared = TrialJob("fake", "search", str(tmp_path), str(tmp_path / "elsewhere"),
                        {"c": str(tmp_path / "absent")})
    with pytest.raises(NodeCannotRead, match="cannot read the study's Tune storage .*elsewhere"):
        check_readable(unshared, from_flat({}), "c")


def test_the_driver_finds_the_trial_s_own_line_inside_ray_s_and_tune_s_wrappings() -> None:
    from ray.exceptions import RayTaskError
    from ray.tune.error import TuneError

    own = NodeCannotRead("node 10.0.0.5 (w1) cannot read /data (no such file or folder)")
    try:
        raise own
    except NodeCannotRead as exc:
        wrapped = RayTaskError("train", "traceback text", exc).as_instanceof_cause()
    assert isinstance(wrapped, NodeCannotRead)  # Ray's error is one too, with another message
    assert node_cannot_read(wrapped) is own
    assert node_cannot_read(ValueError("x")) is None and node_cannot_read(None) is None
    tune_error = TuneError("Traceback ...")  # Tune 2.60 raises it in place of a callback's
    tune_error.__context__ = NodeCannotRead(str(own))  # exception, raised while it handled it
    assert str(node_cannot_read(raised_in_callback(tune_error))) == str(own)
    assert raised_in_callback(ValueError("x")) is None


# --- end to end, on a private Ray instance ------------------------------------------------------


def trial_runs(workspace: Path) -> list:
    client = MlflowClient(f"sqlite:///{workspace / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fake")
    return [r for r in client.search_runs([experiment.experiment_id])
            if r.data.tags.get("icr.role") == "trial"]


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_a_node_that_cannot_read_the_data_stops_the_study_until_it_can(
        cluster, tmp_path: Path, capsys) -> None:
    """The data folder the driver prepared is missing where the trials run: the study stops at
    the first trial with one line (exit 2), no run is recorded as failed, nothing retried it;
    once the folder is there, the same command continues the study to its report."""
    from studies.pipeline import Backend
    from studies.run import main

    workspace, data = tmp_path / "ws", tmp_path / "mounted-data"
    study = fake_study(tmp_path, budget=2, conditions=("contrastive",))
    (tmp_path / "space.yaml").write_text("space:\n  loss.tau: 0.05\n")  # nothing searched
    args = ["fake", "--workspace", str(workspace), "--seeds", "2",
            "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"]
    fit = FakeFit(record_dir=str(tmp_path / "calls"))

    def prepare(config, ws):
        return replace(fake_prepare(config, ws), root=data)

    backend = Backend(fit, prepare)
    assert main(args, backend=backend, extra_studies={"fake": study}) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: node ") and f"({socket.gethostname()})" in err[-1]
    assert f"cannot read the prepared data folder {data} (no such file or folder" in err[-1]
    assert not (tmp_path / "calls").exists()  # fit never ran
    assert all(r.info.status != "FAILED" for r in trial_runs(workspace))

    data.mkdir()  # the mount is there now
    assert main(args, backend=backend, extra_studies={"fake": study}) == 0
    runs = trial_runs(workspace)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_a_study_whose_every_run_failed_exits_non_zero(cluster, tmp_path: Path, capsys) -> None:
    """Every run diverges: the report is written (it lists the errors), and the command says in
    one line that every run failed, exit code 1, where it used to exit 0."""
    from studies.pipeline import Backend
    from studies.run import main

    workspace = tmp_path / "ws"
    study = fake_study(tmp_path, budget=2, conditions=("contrastive",))
    (tmp_path / "space.yaml").write_text("space:\n  loss.tau: 0.05\n")
    args = ["fake", "--workspace", str(workspace), "--seeds", "2",
            "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"]
    fit = FakeFit(fail_on=(("loss.tau", 0.05),), fail_epoch=1)
    assert main(args, backend=Backend(fit, fake_prepare), extra_studies={"fake": study}) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: every run of study fake failed in training (2 of 2 runs "
                              "failed in training: "), err[-1]
    assert "TrainingError: non-finite loss at epoch 1" in err[-1]
    assert (workspace / "reports" / "fake").is_dir()
    assert all(r.info.status == "FAILED" for r in trial_runs(workspace))


def test_the_driver_writes_the_marker_when_its_tuner_starts(tmp_path: Path) -> None:
    """Tune calls a callback's ``setup`` once, on the driver, before any trial starts."""
    from studies.trainable import StopWhenUnreadable

    experiment = tmp_path / "storage" / "search-x"
    assert "not found from this node" in storage_problem(str(experiment))
    StopWhenUnreadable(str(experiment)).setup(num_samples=2)
    assert storage_problem(str(experiment)) == ""
    assert storage_problem(f"file://{experiment}") == ""
