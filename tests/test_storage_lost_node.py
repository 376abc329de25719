"""A study on S3 storage loses a worker node mid-trial: the trial continues on another node from
its checkpoint in the bucket.

The slow test runs the chaos test's fake study (:mod:`test_studies_chaos`, :class:`fakes.FakeFit`)
with ``--storage s3://...?endpoint_override=...`` on moto's S3 server on 127.0.0.1
(:mod:`servers`) and ``--address`` of a head on Ray's fake autoscaler (:mod:`test_autoscaling`:
two one-GPU worker nodes at most, real Ray processes on this machine). The confirmation's
contrastive trials are held after reporting their first epoch; the test SIGKILLs the node of the
first one held (its raylet and every process under it, the PIDs of the processes the test's head
started, as a lost machine loses them) and removes that trial's local working folder. It passes
when the study completes and

- the lost trial's first call reported epoch 1 and its second call, on another node, continued
  after epoch 1 and trained epoch 2 only (no epoch trained twice, none lost);
- that second call read its checkpoint from the bucket: moto served the checkpoint's
  ``state.json`` after the node was lost, and nothing of the checkpoints is on the local disk;
- MLflow holds every planned run once, FINISHED, each epoch once, as Tune's result files in the
  bucket hold it (the chaos test's checks, :func:`test_studies_chaos.check_instant`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from test_autoscaling import FAST_HEALTH_CHECKS, Watcher, _running, fake_cluster_config

from studies import launcher, processes, storage

STUDY_TIMEOUT_S = 1800  # a hang guard for the study on the fake cluster, not a timing
HELD = ("objective.name", "contrastive")  # the trials held: the confirmation's baseline

# The chaos test's study with the fake fit, its contrastive trials held after epoch 1 (until
# ``<study dir>/gate/go`` exists), each call's node recorded (NodeFit).
DRIVER = """
if __name__ == "__main__":  # the benchmark's generator spawns workers, which import this file
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as `python -m studies.run` does
    import os, sys
    from dataclasses import replace
    from pathlib import Path
    from fakes import FakeFit, fake_prepare, fake_study
    from studies.pipeline import Backend
    from studies.run import leave, main
    from test_storage_lost_node import HELD, NodeFit
    root = Path(os.environ["ICR_CHAOS_STUDY_DIR"])
    study = replace(fake_study(root, budget=2), name="chaos")
    fake = FakeFit(epoch_seconds=0.3, record_dir=os.environ["ICR_CHAOS_RECORDS"],
                   gate=str(root / "gate"), hold_after=1, hold_on=(HELD,))
    fit = NodeFit(fake, str(root / "nodes"))
    leave(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={"chaos": study}))
"""


@dataclass(frozen=True)
class NodeFit:
    """``fit`` (a :class:`fakes.FakeFit`), each call's Ray node and raylet recorded in ``nodes``
    (a JSON file per call: pid, start time, node id, raylet pid, working folder, resume_from)."""

    fit: Any
    nodes: str

    def __call__(self, config: Any, reporter: Any = None, resume_from: Any = None,
                 **kwargs: Any) -> Any:
        import ray

        folder = Path(self.nodes)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{os.getpid()}-{time.time_ns()}.json").write_text(json.dumps({
            "pid": os.getpid(), "start": time.monotonic(),
            "node": ray.get_runtime_context().get_node_id(),
            "raylet": os.getppid(), "run_dir": str(kwargs.get("run_dir", "")),
            "resume_from": None if resume_from is None else str(resume_from)}))
        return self.fit(config, reporter, resume_from, **kwargs)


class NodeTaker(Watcher):
    """:class:`test_autoscaling.Watcher`, which takes away the node of the first held trial: a
    call of a ``HELD`` trial that reported epoch 1 and was not resumed. Once the trial's process
    is gone it removes the call's working folder (its local checkpoint) and notes how much of
    the S3 server's log was written, then lets the held trials go."""

    def __init__(self, head: launcher.LocalInstance, gate: Path, records: Path, s3_log: Path
                 ) -> None:
        super().__init__(head, gate)
        gate.mkdir(parents=True, exist_ok=True)
        self.records, self.s3_log = records, s3_log
        self.log_at_loss = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.watch()
        except BaseException as error:  # the test fails on it; the held trials go on
            self.error = error
            (self.gate / "go").touch()
            raise

    def watch(self) -> None:
        while not self.done.is_set():
            self.note_workers()
            held = None if self.lost else self.held_call()
            if held is not None:
                self.take_node_of(held["pid"], held["run_dir"])
            time.sleep(0.1)  # polls the processes, not a timing

    def held_call(self) -> dict | None:
        for path in sorted(self.records.glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                call = json.loads(path.read_text())
                if (call.get("objective") == HELD[1] and call.get("epochs_run") == 1
                        and call.get("resumed_after") == 0):
                    return {**call, "pid": int(path.name.split("-")[0])}  # FakeFit's file name
        return None

    def take_node_of(self, pid: int, run_dir: str = "") -> None:  # type: ignore[override]
        raylet = psutil.Process(pid).parent()
        self.lost = {"pid": pid, "run_dir": run_dir, "at": time.monotonic(),
                     "raylet": raylet.pid if raylet.pid in self.workers else None}
        if self.lost["raylet"] is not None:  # else the test fails on it; the study goes on
            for proc in [raylet, *raylet.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _running(pid):
                time.sleep(0.05)  # waits for the process to end, not for time
            shutil.rmtree(run_dir, ignore_errors=True)
        self.log_at_loss = self.s3_log.stat().st_size
        (self.gate / "go").touch()


@pytest.mark.slow
@pytest.mark.timeout(STUDY_TIMEOUT_S + 600)
def test_a_study_on_s3_loses_a_node_and_the_trial_resumes_from_the_bucket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow.fs
    import test_studies_chaos as chaos

    from servers import S3_CREDENTIALS, s3_server

    monkeypatch.setattr(chaos, "RUN_TIMEOUT_S", STUDY_TIMEOUT_S)
    for name, value in S3_CREDENTIALS.items():  # the head's processes and its nodes inherit them
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    with s3_server(tmp_path / "s3") as s3:
        port = launcher.free_port()
        config = tmp_path / "autoscaling.yaml"
        config.write_text(yaml.safe_dump(fake_cluster_config(port)))
        head = launcher.start_head(
            num_cpus=0, dashboard=False, system_config=FAST_HEALTH_CHECKS,
            autoscaling=launcher.Autoscaling(config, port, {
                "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
                "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "10"}))
        taker = NodeTaker(head, tmp_path / "gate", tmp_path / "records", tmp_path / "s3" / "s3.log")
        prefix = f"studies-{tmp_path.name}"
        uri = s3.uri(prefix)
        try:
            taker.thread.start()
            (tmp_path / "driver.py").write_text(DRIVER)

            class OnS3OnTheCluster(chaos.Campaign):
                def command(self) -> list[str]:
                    return [*super().command(), "--address", head.address, "--storage", uri]

            campaign = OnS3OnTheCluster(chaos.FAKE, tmp_path, seed=0)
            run = campaign.run(tmp_path / "records")
            assert run.rc == 0, run.text[-3000:]
            taker.done.set()
            taker.thread.join()
            assert taker.error is None, repr(taker.error)
            assert taker.lost, "no trial was held"
            assert taker.lost["raylet"] is not None, "the held trial ran on no worker node"
            outcome = check_lost_trial(campaign, taker, s3, prefix, uri)

            # Tune's experiments are in the bucket, not on the driver's disk: fetched beside the
            # study run's state for the chaos test's checks of MLflow against its result files.
            run_dir, _ = campaign.state_of(set())
            assert not list(run_dir.glob("*/*/result.json"))
            assert not list(campaign.workspace.glob("**/checkpoint_*"))
            fs, path = storage.filesystem(storage.join(uri, chaos.FAKE.key, run_dir.name))
            pyarrow.fs.copy_files(path, str(run_dir), source_filesystem=fs)
            chaos.check_instant(campaign, set(), [run], [chaos.fit_calls(tmp_path / "records")],
                                [], None)
        finally:
            taker.done.set()
            launcher.stop_instance(head)
        assert not processes.family(head.marker, head.temp_dir)
    print(f"S3 lost node: {outcome}; the study took {run.ended - run.started:.0f} s, "
          f"the test {time.monotonic() - started:.0f} s")


def check_lost_trial(campaign: Any, taker: NodeTaker, s3: Any, prefix: str, uri: str) -> str:
    """Assert that the lost trial continued after its checkpoint, read from the bucket, on
    another node, and trained no epoch twice; returns what happened, in words."""
    import test_studies_chaos as chaos

    calls = chaos.fit_calls(campaign.root / "records")
    nodes = {c["run_dir"]: c for c in map(json.loads, map(Path.read_text,
                                                          (campaign.root / "nodes").glob("*.json")))}
    for call in calls:
        assert nodes[call["run_dir"]]["raylet"] in taker.workers, call  # on a worker node
    (lost,) = [c for c in calls if c["run_dir"] == taker.lost["run_dir"]]
    again = [c for c in calls if c["trial"] == lost["trial"] and c is not lost]
    assert len(again) == 1, again
    (again,) = again
    assert (lost["resumed_after"], lost["epochs_run"]) == (0, 1), lost
    assert (again["resumed_after"], again["epochs_run"]) == (1, 1), again  # epoch 2 only
    lost_node, again_node = nodes[lost["run_dir"]], nodes[again["run_dir"]]
    assert again_node["node"] != lost_node["node"] and again_node["raylet"] != taker.lost["raylet"]
    assert again_node["resume_from"] and again_node["resume_from"].startswith(again["run_dir"])

    # Its checkpoint came from the bucket: moto served it after the loss (the local copy was gone;
    # the line of a ranged GET, pyarrow's, starts with a colour code).
    served = taker.s3_log.read_bytes()[taker.log_at_loss:].decode(errors="replace")
    key = re.compile(rf'GET /{s3.bucket}/{re.escape(prefix)}/\S*{lost["trial"]}\S*/'
                     r'(checkpoint_\d+)/state\.json')
    read = key.findall(served)
    assert read, f"no GET of the trial's checkpoint after the loss:\n{served[-3000:]}"
    return (f"trial {lost['trial']} reported epoch 1 on node {lost_node['node'][-8:]} "
            f"(raylet {taker.lost['raylet']}) and lost it; resumed on node "
            f"{again_node['node'][-8:]} (raylet {again_node['raylet']}) "
            f"{again_node['start'] - taker.lost['at']:.1f} s later, after epoch "
            f"{again['resumed_after']}, from {read[0]} read from the bucket")
