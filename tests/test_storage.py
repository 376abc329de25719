"""Tune storage: whether every node a study can reach reaches it, and reading and writing it
through the file system of its URI (a local folder, or ``s3://`` on an S3-compatible server).

The fast tests check the storage check against clusters described by hand, and the driver's
readings of Tune's saved state through :mod:`pyarrow.fs`. The slow ones run studies on
``--storage s3://...`` with moto's S3 server on 127.0.0.1 (:mod:`servers`).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from icr.errors import UserError
from studies import connection, storage
from studies.connection import Cluster, Growth, growth_from_config

ROOT = Path(__file__).resolve().parent.parent
MOUNTS = "/dev/sda1 / ext4 rw 0 0\nnfs:/export /mnt/shared nfs4 rw 0 0\n"


# --- the nodes a study can reach ---------------------------------------------------------------


def head_alone(address: str = "10.0.0.5:6379", growth: Growth | None = None) -> Cluster:
    """A cluster as cluster.yaml starts it: its head alone, no GPU, its workers to be added."""
    growth = growth or growth_from_config(yaml.safe_load((ROOT / "cluster.yaml").read_text()),
                                          "cluster.yaml")
    return Cluster(address, None, cpus=0, gpus=0, nodes=1, started_here=False, hosts=1,
                   shapes=((0.0, 0.0),), growth=growth)


def check(cluster: Cluster, path: str = "/home/me/workspace/ray") -> None:
    storage.check_storage(path, cluster.reachable_nodes, MOUNTS, hosts=cluster.reachable_hosts,
                          now=cluster.nodes)


def test_a_cluster_that_starts_with_its_head_alone_refuses_local_storage() -> None:
    """cluster.yaml: at most 8 workers; the head alone at the start is not a one-node cluster."""
    cluster = head_alone()
    assert (cluster.reachable_nodes, cluster.reachable_hosts) == (9, None)
    with pytest.raises(UserError) as refused:
        check(cluster)
    assert str(refused.value) == (
        "the cluster can reach 9 nodes (1 now) but the Tune storage /home/me/workspace/ray is on "
        "a local disk (ext4); pass --storage s3://BUCKET/PATH, gs://BUCKET/PATH or a path on NFS "
        "mounted on every node")
    check(cluster, "/mnt/shared/icr/ray")  # a network file system
    check(cluster, "s3://bucket/ray")
    # Once its workers are up, they count as they are, not on top of those it can add.
    grown = replace(cluster, nodes=3, hosts=3)
    assert grown.reachable_nodes == 9


def test_gpus_stated_beyond_those_of_the_nodes_alive_mean_more_nodes() -> None:
    stated = head_alone(growth=Growth("--gpus", stated_gpus=8))
    assert stated.reachable_nodes == 2  # at least one more: the head has no GPU
    with pytest.raises(UserError, match=r"can reach 2 nodes \(1 now\)"):
        check(stated)
    eight = replace(stated, gpus=8, shapes=((64.0, 8.0),))  # one machine with its 8 GPUs
    assert eight.reachable_nodes == 1
    check(eight)


def test_nodes_that_can_only_be_on_this_machine_share_its_disk() -> None:
    """A head at a loopback address (Ray's fake autoscaler, nodes started on one machine for
    tests): no other machine can join it, so the workspace's disk is every node's."""
    loopback = head_alone("127.0.0.1:6379")
    assert loopback.reachable_hosts == 1
    check(loopback)
    cannot_grow = Cluster("10.0.0.5:6379", None, cpus=2, gpus=0, nodes=2, started_here=False,
                          hosts=1)
    assert cannot_grow.reachable_hosts == 1
    check(cannot_grow)
    with pytest.raises(UserError, match="can reach 2 nodes but"):
        check(replace(cannot_grow, hosts=2))


def test_a_study_joining_a_cluster_that_can_grow_is_refused_before_any_run(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """Through the command line: one line, exit 2, nothing recorded in MLflow."""
    from studies.pipeline import Backend
    from studies.run import main

    from fakes import FakeFit, fake_prepare, fake_study

    joined = head_alone()
    monkeypatch.setattr(storage, "filesystem_type", lambda path, mounts=None: "ext4")
    monkeypatch.setattr(connection, "reachable_gcs", lambda address: address)
    monkeypatch.setattr(connection, "connect", lambda *args, **kwargs: joined)
    monkeypatch.setattr(connection, "disconnect", lambda *args, **kwargs: None)
    workspace = tmp_path / "ws"
    rc = main(["fake", "--workspace", str(workspace), "--address", joined.address],
              backend=Backend(FakeFit(), fake_prepare), extra_studies={"fake": fake_study(tmp_path)})
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.splitlines() == [
        f"error: the cluster can reach 9 nodes (1 now) but the Tune storage {workspace / 'ray'} is "
        "on a local disk (ext4); pass --storage s3://BUCKET/PATH, "
        "gs://BUCKET/PATH or a path on NFS mounted on every node"]
    assert not (workspace / "ray" / "fake").exists()  # no study run begun


# --- reading and writing it through its URI's file system --------------------------------------


def test_sub_paths_are_joined_before_a_uri_s_query() -> None:
    query = "endpoint_override=127.0.0.1:9000&scheme=http"
    assert storage.join(f"s3://b/p?{query}", "ltd_bound", "run") == f"s3://b/p/ltd_bound/run?{query}"
    assert storage.join(f"s3://b?{query}", "x") == f"s3://b/x?{query}"
    assert storage.join("s3://b/p/", "x") == "s3://b/p/x"
    assert storage.join("/ws/ray/", "x", "y") == "/ws/ray/x/y"
    assert storage.with_query_of("s3://b/p/x/checkpoint_000001", f"s3://b/p?{query}") == \
        f"s3://b/p/x/checkpoint_000001?{query}"
    assert storage.with_query_of("s3://b/p/x", "/ws/ray") == "s3://b/p/x"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_tune_s_saved_state_is_read_and_removed_through_the_storage_s_file_system(
        where, tmp_path: Path, request) -> None:
    """What the driver reads of a Tune experiment before it restores it (saved whole? the
    searcher's state) and how it discards one never saved whole, on a folder and on S3 with
    the server in the URI's query."""
    import pyarrow.fs
    from test_frameworks_tune import saved_experiment

    from studies.frameworks.tune import newest_searcher_state, saved_by_tune
    from studies.searcher import FORMAT, read_state

    local = tmp_path / "experiment"
    states = saved_experiment(local, searcher=True)
    searcher = json.dumps({"format": FORMAT, "trials": [], "tune_trials": {}, "ended": {}})
    states[1].write_text(searcher)
    (local / "searcher-state-2026-11-25_22-50-00.pkl").write_text(searcher.replace("{}", "[]", 1))
    if where == "local":
        experiment = str(local)
    else:
        s3 = request.getfixturevalue("s3")
        experiment = storage.join(s3.uri(f"storage-{tmp_path.name}"), "experiment")
        fs, path = storage.filesystem(experiment)
        pyarrow.fs.copy_files(str(local), path, destination_filesystem=fs)
    assert saved_by_tune(experiment)
    newest = newest_searcher_state(experiment)
    assert newest == storage.join(experiment, states[1].name)
    assert read_state(newest)["format"] == FORMAT
    assert storage.read_bytes(storage.join(experiment, states[0].name)) == states[0].read_bytes()

    fs, path = storage.filesystem(experiment)
    with fs.open_output_stream(f"{path}/{states[0].name}") as cut:  # a copy cut short
        cut.write(states[0].read_bytes()[:5])
    assert not saved_by_tune(experiment)
    storage.remove_folder(experiment)
    assert storage.names(experiment) == [] and not saved_by_tune(experiment)
    storage.remove_folder(experiment)  # gone already: nothing to do


KILLED_WRITER = """
import os, signal, sys
from studies import storage
path, filesystem = storage.tune_storage(sys.argv[1])
out = filesystem.open_output_stream(path + "/experiment_state-1.json")
out.write(b'{"trial_data": [')  # the first part of a copy, as Ray writes it
out.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_folder_is_given_to_tune_through_a_file_system_that_writes_each_file_whole(
        tmp_path: Path) -> None:
    """A driver killed while Ray copied Tune's state into the storage left the file cut short,
    and the experiment was started over: through :func:`storage.tune_storage` a write is seen
    whole or not at all, also by a process killed in the middle of it (SIGKILL)."""
    import pickle
    import subprocess
    import sys

    import pyarrow.fs

    from studies.frameworks.tune import saved_by_tune

    path, fs = storage.tune_storage(tmp_path / "exp")
    assert path == str((tmp_path / "exp").absolute()) and storage.is_local(fs)
    assert storage.tune_storage("s3://b/p?scheme=http") == ("s3://b/p?scheme=http", None)
    state = tmp_path / "exp" / "experiment_state-1.json"
    with fs.open_output_stream(str(state)) as out:  # its folder made, as for Ray's copies
        out.write(b'{"trial_data": []}')
        assert not state.exists()  # not there until it is whole
    assert state.read_text() == '{"trial_data": []}'

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path / "exp")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert state.read_text() == '{"trial_data": []}'  # the old file, whole
    assert storage.names(tmp_path / "exp", "experiment_state-*.json") == [state.name]
    (tmp_path / "exp" / "basic-variant-state-1.json").write_bytes(pickle.dumps({}))
    assert saved_by_tune(tmp_path / "exp")  # the temporary file left beside it is no state

    pyarrow.fs.copy_files(str(tmp_path / "exp"), str(tmp_path / "copy"), destination_filesystem=fs)
    assert (tmp_path / "copy" / state.name).read_bytes() == state.read_bytes()


def test_a_write_that_fails_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "result.json"
    target.write_text("old")
    whole = storage._WholeFile(str(target))
    os.close(whole.fileno())  # what a write meets when the disk is gone
    with pytest.raises(OSError):
        whole.write(b"new")
    with pytest.raises(OSError):
        whole.close()
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


def test_tune_s_file_system_travels_to_workers_and_its_checkpoints_stay_folders(tmp_path) -> None:
    """Ray pickles the storage's file system to every worker and into a checkpoint; a run's
    ``checkpoint`` tag is the folder, which ``tune.Checkpoint`` reads on any node."""
    import pickle

    from ray import tune

    from studies.tracking import checkpoint_location

    fs = pickle.loads(pickle.dumps(storage.tune_storage(tmp_path)[1]))
    assert storage.is_local(fs)
    checkpoint = pickle.loads(pickle.dumps(tune.Checkpoint(str(tmp_path / "checkpoint_000001"),
                                                           filesystem=fs)))
    assert checkpoint_location(checkpoint) == str(tmp_path / "checkpoint_000001")


def test_an_s3_endpoint_is_read_from_aws_endpoint_url(s3, monkeypatch, tmp_path: Path) -> None:
    """``--storage s3://bucket/prefix`` with the server in ``AWS_ENDPOINT_URL`` (pyarrow reads
    it, as boto3 does), no query string."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    experiment = f"s3://{s3.bucket}/env-{tmp_path.name}/experiment"
    fs, path = storage.filesystem(experiment)
    with fs.open_output_stream(f"{path}/searcher-state-1.pkl") as out:
        out.write(b'{"format": "x"}')
    assert storage.names(experiment, "searcher-state-*") == ["searcher-state-1.pkl"]
    assert s3.keys(f"env-{tmp_path.name}/") == [f"env-{tmp_path.name}/experiment/searcher-state-1.pkl"]


# --- a study on S3, its driver killed at an instant of the chaos campaign ------------------------

# (phase, signal, seconds after, trial) as test_studies_chaos.Instant holds them; on S3 a row is
# the phase's trials done by the driver's progress line (Tune's result files are in the bucket,
# not on this disk, where the campaign counts their rows): as the search's first trial ends, as
# the confirmation's second does, into the selection and into the report.
S3_INSTANTS = [("search", "SIGKILL", 0.0, 1), ("confirm", "SIGTERM", 0.0, 2),
               ("select", "SIGHUP", 0.0, None), ("report", "SIGINT", 0.0, None)]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("phase", "kind", "after", "row"), S3_INSTANTS,
                         ids=[f"{s}-{p}" for p, s, _, _ in S3_INSTANTS])
def test_a_study_on_s3_interrupted_is_completed_by_the_rerun(
        phase, kind, after, row, s3, tmp_path: Path) -> None:
    """The chaos test's study (:mod:`test_studies_chaos`) with ``--storage s3://...?
    endpoint_override=...`` on moto's server, its driver signalled at an instant of the chaos
    campaign; the same command then completes it (at most 4 runs): every run FINISHED once, no
    epoch trained or recorded twice, each as Tune's result files in the bucket hold it."""
    import re
    import signal
    import time

    import pyarrow.fs
    from test_studies_chaos import (
        DRIVER,
        FAKE,
        Campaign,
        Instant,
        check_instant,
        fit_calls,
        recorded_epochs,
        wait_for_no_leftovers,
    )

    uri = s3.uri(f"studies-{tmp_path.name}")
    progress = re.compile(r"^(search \S+|confirm): (\d+) done")

    class OnS3(Campaign):
        def command(self) -> list[str]:
            return [*super().command(), "--storage", uri]

        def _due(self, run, instant, before, reached) -> bool:
            if instant.row is None:
                return super()._due(run, instant, before, reached)
            done = [m for _, line in run.lines if (m := progress.match(line))]
            return any(m[1].startswith(instant.phase) and int(m[2]) >= instant.row for m in done)

    instant = Instant(phase, signal.Signals[kind], after, row)
    (tmp_path / "driver.py").write_text(DRIVER)
    campaign = OnS3(FAKE, tmp_path, seed=0)
    started = time.monotonic()
    runs, calls, held = [], [], []
    try:
        while not runs or campaign.state_of(set())[1].get("phase") != "done":
            assert len(runs) < 4, f"{instant}: no complete run in 4 tries"
            if runs:
                state = campaign.state_of(set())[1]
                held.append(recorded_epochs(campaign.workspace / "mlflow.db",
                                            state.get("parent_run_id")))
            records = tmp_path / f"records-{len(runs)}"
            runs.append(campaign.run(records, None if runs else instant))
            calls.append(fit_calls(records) if records.is_dir() else [])
        assert runs[0].signalled, f"{instant}: the study ended first"
        assert kind != "SIGKILL" or runs[0].rc == -signal.SIGKILL, runs[0].text[-3000:]
        took = time.monotonic() - started

        # Tune's experiments are in the bucket, not on the driver's disk: fetched beside the
        # study run's state for the chaos test's checks of its result files.
        run_dir, _ = campaign.state_of(set())
        experiments = storage.join(uri, FAKE.key, run_dir.name)
        assert not list(run_dir.glob("*/*/result.json"))
        fs, path = storage.filesystem(experiments)
        pyarrow.fs.copy_files(path, str(run_dir), source_filesystem=fs)
        check_instant(campaign, set(), runs, calls, held, None)
        assert not wait_for_no_leftovers(campaign)
    finally:
        campaign.clean()
    keys = s3.keys(f"studies-{tmp_path.name}/")
    print(f"S3 resume: {instant}: signalled {runs[0].signalled[1]:.0f} s into the driver "
          f"({runs[0].phase_at_signal}), exit codes {[r.rc for r in runs]}; {took:.0f} s in "
          f"all; {len(keys)} objects in the bucket")
