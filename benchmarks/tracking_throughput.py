"""How many epoch records a second one driver records in MLflow, run creation included.

    python benchmarks/tracking_throughput.py [--trials 4] [--epochs 10] [--rows 60]
        [--stores local server] [--server-workers 4]

Each of ``--trials`` fake trials goes through what the Tune callback records for a trial: its
child run created with its tags and its 40 params, ``--epochs`` epoch records of 40 metrics and
``--rows`` trajectory rows of 4 terms (60 rows: an LTD epoch on COCO at
``train.trajectory_every=10``, one row per 10 steps of a 600-step epoch), the trials taking
turns epoch by epoch as concurrent trials do, then its run finished. The clock runs from the
first run's creation to the last run's end. Three recorders side by side:

- ``sync log_batch``: MLflow's public client, one ``log_batch`` per epoch record;
- ``async log_batch``: the same with ``synchronous=False`` (MLflow's asynchronous logging
  queue), each run finished once its queued writes are done;
- ``platform``: :class:`studies.tracking.MlflowTrialCallback` over its
  :class:`~studies.tracking.Tracker`, as a study records (the way it took is printed);

each on a fresh local sqlite store and on an ``mlflow server`` (``--server-workers`` workers,
MLflow's default 4) that the benchmark starts on 127.0.0.1 at a free port, over a sqlite store in
a temporary folder, and stops (also on an error, Ctrl-C or SIGTERM). Prints epoch records per
second and the ratios to ``sync log_batch``. The target: the platform records at least 50 a
second on both stores (one driver records for the whole cluster).
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
from studies.frameworks.mlflow import loopback_server
from studies.signals import StopSignals
from studies.tracking import MlflowTrialCallback, Tracker, epoch_metrics
from studies.trials import KEY, TrialSpec

WAYS = ("sync log_batch", "async log_batch", "platform")
STORES = {"local": "local sqlite", "server": "mlflow server"}
TARGET = 50.0  # epoch records a second


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


def measure(way: str, uri: str, artifacts: Path, trials: int, epochs: int, rows: int) -> tuple[float, Tracker]:
    """Epoch records a second recorded by ``way`` into the store ``uri`` (the experiment and the
    study's parent run are made before the clock starts)."""
    callback_cls = {"sync log_batch": SyncCallback, "async log_batch": AsyncCallback,
                    "platform": MlflowTrialCallback}[way]
    public_only = False if way != "platform" else None  # the platform chooses its own way
    tracker = Tracker(uri, f"bench-{way.split()[0]}", artifacts, sql_metrics=public_only)
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
    return trials * epochs / (time.perf_counter() - start), tracker


def measure_store(store: str, folder: Path, args: argparse.Namespace) -> dict[str, tuple[float, str]]:
    """Every way on one store: way -> (epoch records a second, how the platform recorded)."""
    rates = {}
    if store == "server":
        with loopback_server(f"sqlite:///{folder / 'server.db'}", folder,
                             workers=args.server_workers) as url:
            for way in WAYS:
                rate, tracker = measure(way, url, folder / "client", args.trials, args.epochs,
                                        args.rows)
                rates[way] = rate, describe(tracker)
        return rates
    for way in WAYS:
        root = folder / way.split()[0]
        root.mkdir(parents=True)
        rate, tracker = measure(way, f"sqlite:///{root / 'mlflow.db'}", root / "mlartifacts",
                                args.trials, args.epochs, args.rows)
        rates[way] = rate, describe(tracker)
    return rates


def describe(tracker: Tracker) -> str:
    return ("the adapter's SQL transactions of the records queued" if tracker.sql_metrics
            else "MLflow's asynchronous log_batch")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--rows", type=rows_count, default=60,
                        help="trajectory rows of an epoch record (0: its 40 metrics only)")
    parser.add_argument("--stores", nargs="+", choices=list(STORES), default=list(STORES))
    parser.add_argument("--server-workers", type=int, default=4, help="MLflow's default: 4")
    args = parser.parse_args(argv)
    # A server store prints two lines (the run's and the experiment's URL) per finished run.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    print(f"{args.trials} trials x {args.epochs} epochs; an epoch record: 40 metrics + "
          f"{args.rows} trajectory rows x 4 terms; run creation, tags and 40 params included")
    results = {}
    with StopSignals(), tempfile.TemporaryDirectory() as tmp:
        for store in args.stores:
            results[store] = measure_store(store, Path(tmp) / store, args)
    for store, rates in results.items():
        workers = f"{args.server_workers} worker{'s' if args.server_workers > 1 else ''}"
        name = STORES[store] + (f" ({workers})" if store == "server" else "")
        for way, (rate, how) in rates.items():
            note = f"  ({how})" if way == "platform" else ""
            print(f"{name:>26} | {way:>15}: {rate:6.1f} epoch records/s{note}")
        sync = rates["sync log_batch"][0]
        print(f"{name:>26} | async / sync = {rates['async log_batch'][0] / sync:.2f}, "
              f"platform / sync = {rates['platform'][0] / sync:.2f}")
    verdicts = ", ".join(f"{STORES[s]} {r['platform'][0]:.1f} "
                         f"({'met' if r['platform'][0] >= TARGET else 'not met'})"
                         for s, r in results.items())
    print(f"target: the platform records >= {TARGET:.0f} epoch records/s: {verdicts}")


if __name__ == "__main__":
    main()
