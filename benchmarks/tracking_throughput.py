"""How many epoch records a second one driver records in MLflow, beside how many a study makes.

    python benchmarks/tracking_throughput.py [--trials 4] [--epochs 10] [--rows 60]
        [--stores local server] [--server-workers 4]
        [--gpus 8] [--trials-per-gpu 4] [--gpu-pairs 58723] [--epoch-pairs 80000]

What a study needs, from the figures in docs/: each of ``--gpus`` GPUs (8: the cluster of
docs/clusters.md's estimate) runs ``--trials-per-gpu`` trials (4: docs/gpu.md's example), which
take turns on it without MPS (docs/gpu.md, "Several trials per GPU"), so each trains ``--gpu-pairs`` /
trials-per-GPU pairs a second (58,723: the fastest step measured, vsepp with CUDA graphs on one
H200, docs/gpu.md) and reports an epoch every ``--epoch-pairs`` pairs (80,000: the embedded
benchmark's ``large`` preset, 16,000 training images x 5 captions, the one meant for GPU runs,
docs/embedded-benchmark.md). The driver records GPUs x trials per GPU x epochs a second of each
trial; validation and checkpoints, left out, only lower it. The CPU preset, ``default`` (20,000
pairs), on the same GPUs: ``--epoch-pairs 20000 --rows 15``. A COCO-sized study is 566,400
pairs an epoch (4,425 steps of 128, docs/clusters.md) at 8,000 pairs a second (16 ms a step,
ibid.): ``--epoch-pairs 566400 --gpu-pairs 8000``.

What MLflow's client gives: each of ``--trials`` fake trials goes through what the Tune callback
records for a trial: its child run created with its tags and its 40 params, ``--epochs`` epoch
records of 40 metrics and ``--rows`` trajectory rows of 4 terms (60: about an LTD epoch of the
``large`` preset, 625 steps at ``train.trajectory_every=10``; COCO's holds 442, the default
preset's 15), the trials taking turns
epoch by epoch as concurrent trials do, then its run finished. The clock runs from the first
run's creation to the last run's end. Three ways, all MLflow's public client:

- ``sync log_batch``: one ``log_batch`` per epoch record, in Tune's loop;
- ``async log_batch``: the same with ``synchronous=False`` (MLflow's asynchronous logging
  queue), each run finished once its queued writes are done;
- ``platform``: :class:`studies.tracking.MlflowTrialCallback` over its
  :class:`~studies.tracking.Tracker`, as a study records (one thread calling ``log_batch``, a
  run's queued records merged into one call);

each on a fresh local sqlite store and on an ``mlflow server`` (``--server-workers`` workers,
MLflow's default 4) that the benchmark starts on 127.0.0.1 at a free port, over a sqlite store in
a temporary folder, and stops (also on an error, Ctrl-C or SIGTERM). Prints epoch records per
second, the ratios to ``sync log_batch`` and whether the platform keeps up with the need.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlflow import RunOperations

from icr.config import ExperimentConfig
from icr.workspace import Workspace
from studies.signals import StopSignals
from studies.tracking import MlflowTrialCallback, Tracker, epoch_metrics
from studies.trials import KEY, TrialSpec

import testfakes  # benchmarks/testfakes.py: the tests' helpers

WAYS = ("sync log_batch", "async log_batch", "platform")
STORES = {"local": "local sqlite", "server": "mlflow server"}


def need(gpus: int, trials_per_gpu: int, gpu_pairs: float, epoch_pairs: int) -> float:
    """Epoch records a second a study makes: GPUs x trials per GPU x epochs a second of each
    trial, the trials of a GPU sharing its pairs a second."""
    return gpus * trials_per_gpu * (gpu_pairs / trials_per_gpu) / epoch_pairs


def fake_trial_config(i: int) -> dict:
    """A fake trial's Tune config: its spec, with the 40 params a study's trial records."""
    eta = 0.1 * i
    params = {"objective.eta": eta, **{f"group{k // 10}.key{k}": 0.001 * k for k in range(39)}}
    return {KEY: TrialSpec("lag", {"objective.eta": eta}, ExperimentConfig(), params)}


def epoch_result(epoch: int, rows: int, steps_per_epoch: int) -> dict:
    metrics = {f"val_metric_{i}": 100.0 / (i + epoch) for i in range(36)}
    metrics.update(epoch=epoch, train_loss=1.0 / epoch, lr=2e-4, epoch_time_s=60.0)
    every = steps_per_epoch // max(rows, 1)  # --rows 0: metrics only
    trajectory = [{"step": (epoch - 1) * steps_per_epoch + every * (r + 1), "epoch": epoch,
                   "loss": 1.0, "L_con": 0.9, "L_rec": 0.2, "lambda": 3.0} for r in range(rows)]
    return {**metrics, "trajectory": trajectory, "artifacts": [], "final": False}


def rows_count(text: str) -> int:
    """``--rows``: a whole number of trajectory rows, 0 to 600 (a 600-step epoch)."""
    if not text.isdigit() or int(text) > 600:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 0 to 600")
    return int(text)


class SyncCallback(MlflowTrialCallback):
    """(a) One synchronous MLflow ``log_batch`` per epoch record."""

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        metrics = epoch_metrics(result, int(time.time() * 1000))
        self.tracker.client.log_batch(self.run_id(trial), metrics=metrics, synchronous=True)


class AsyncCallback(MlflowTrialCallback):
    """(b) MLflow's asynchronous ``log_batch``; a run is finished once its writes are done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queued: dict[str, list[RunOperations]] = {}

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        run_id = self.run_id(trial)
        metrics = epoch_metrics(result, int(time.time() * 1000))
        operations = self.tracker.client.log_batch(run_id, metrics=metrics, synchronous=False)
        self.queued.setdefault(run_id, []).append(operations)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        for operations in self.queued.pop(self.run_id(trial), []):
            operations.wait()  # raises if a write failed
        super().on_trial_complete(iteration, trials, trial, **info)


def measure(way: str, uri: str, artifacts: Path, trials: int, epochs: int, rows: int) -> float:
    """Epoch records a second recorded by ``way`` into the store ``uri`` (the experiment and the
    study's parent run are made before the clock starts)."""
    callback_cls = {"sync log_batch": SyncCallback, "async log_batch": AsyncCallback,
                    "platform": MlflowTrialCallback}[way]
    tracker = Tracker(uri, f"bench-{way.split()[0]}", artifacts)
    parent = tracker.create_run("parent", {"icr.role": "study"})
    callback = callback_cls(tracker, parent, {"study": "bench"}, {}, {"lag": epochs})
    fake = [SimpleNamespace(trial_id=f"t{i}", last_result={"epoch": epochs},
                            config=fake_trial_config(i)) for i in range(trials)]
    start = time.perf_counter()
    for trial in fake:
        callback.on_trial_start(0, fake, trial)
    for epoch in range(1, epochs + 1):
        for trial in fake:
            callback.on_trial_result(0, fake, trial, epoch_result(epoch, rows, 600))
    for trial in fake:
        callback.on_trial_complete(0, fake, trial)
    callback.on_experiment_end(fake)
    return trials * epochs / (time.perf_counter() - start)


def measure_store(store: str, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Every way on one store: way -> epoch records a second."""
    rates = {}
    if store == "server":
        with testfakes.load("servers").loopback_server(f"sqlite:///{folder / 'server.db'}", folder,
                             workers=args.server_workers) as url:
            for way in WAYS:
                rates[way] = measure(way, url, folder / "client", args.trials, args.epochs,
                                     args.rows)
        return rates
    for way in WAYS:
        workspace = Workspace(folder / way.split()[0])
        workspace.root.mkdir(parents=True)
        rates[way] = measure(way, workspace.mlflow_uri, workspace.mlartifacts, args.trials,
                             args.epochs, args.rows)
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rows", type=rows_count, default=60,
                        help="trajectory rows of an epoch record (0: its 40 metrics only)")
    parser.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    parser.add_argument("--server-workers", type=int, default=4, help="MLflow's default: 4")
    parser.add_argument("--gpus", type=int, default=8, help="the study's GPUs (docs/clusters.md: 8)")
    parser.add_argument("--trials-per-gpu", type=int, default=4, help="docs/gpu.md's example: 4")
    parser.add_argument("--gpu-pairs", type=float, default=58_723.0,
                        help="pairs a second one GPU trains (docs/gpu.md: vsepp, H200, 58,723)")
    parser.add_argument("--epoch-pairs", type=int, default=80_000,
                        help="pairs an epoch (the embedded large preset: 80,000)")
    args = parser.parse_args(argv)
    # A server store prints two lines (the run's and the experiment's URL) per finished run.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    print(f"{args.trials} trials x {args.epochs} epochs; an epoch record: 40 metrics + "
          f"{args.rows} trajectory rows x 4 terms; run creation, tags and 40 params included")
    results = {}
    with StopSignals(), tempfile.TemporaryDirectory() as tmp:
        for store in args.stores:
            results[store] = measure_store(store, Path(tmp) / store, args)
    needed = need(args.gpus, args.trials_per_gpu, args.gpu_pairs, args.epoch_pairs)
    for store, rates in results.items():
        workers = f"{args.server_workers} worker{'s' if args.server_workers > 1 else ''}"
        name = STORES[store] + (f" ({workers})" if store == "server" else "")
        for way, rate in rates.items():
            print(f"{name:>26} | {way:>15}: {rate:6.1f} epoch records/s")
        sync = rates["sync log_batch"]
        print(f"{name:>26} | async / sync = {rates['async log_batch'] / sync:.2f}, "
              f"platform / sync = {rates['platform'] / sync:.2f}")
    per_trial = args.gpu_pairs / args.trials_per_gpu / args.epoch_pairs
    print(f"need: {args.gpus} GPUs x {args.trials_per_gpu} trials x {per_trial:.3f} epochs/s "
          f"({args.gpu_pairs:,.0f} pairs/s a GPU, {args.epoch_pairs:,} pairs an epoch) = "
          f"{needed:.2f} epoch records/s")
    verdicts = ", ".join(f"{STORES[s]} {r['platform']:.1f} "
                         f"({'met' if r['platform'] >= needed else 'not met'})"
                         for s, r in results.items())
    print(f"the platform records >= {needed:.2f} epoch records/s: {verdicts}")


if __name__ == "__main__":
    main()
