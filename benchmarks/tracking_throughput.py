"""How many epoch results a second one driver records in MLflow, as the Tune callback does.

    python benchmarks/tracking_throughput.py [--epochs 40] [--rows 60] [--trials 4]

Drives :class:`studies.tracking.MlflowTrialCallback` without Ray: fake trials, each reporting
``--epochs`` epoch records of about 40 metrics and ``--rows`` trajectory rows of 4 terms (what an
LTD epoch on COCO reports at ``train.trajectory_every=10``... 60 rows: one per 10 steps of a
600-step epoch), into a fresh sqlite store. Two ways side by side in one run:

- ``per-row``: the former recording, one MLflow ``log_batch`` call for the epoch's metrics and one
  per trajectory row;
- ``log_batch``: the epoch's metrics and all its rows in one MLflow ``log_batch`` call;
- ``one-txn``: what the callback does now, the same rows in one transaction of two bulk
  statements (:func:`studies.tracking.insert_metrics`).

Prints the epoch results per second of each and the ratios. One driver records for the whole
cluster, so results/s bounds how many GPUs' worth of one-minute epochs it keeps up with.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from mlflow.entities import Metric

from studies.tracking import MlflowTrialCallback, Tracker, epoch_metrics


class _Job:
    phase = "search"

    def params(self, config: dict) -> dict:
        return {"objective.eta": config["objective.eta"], "loss.tau": 0.05}

    def shown(self, config: dict) -> dict:
        return {"objective.eta": config["objective.eta"]}

    def seed(self, config: dict) -> int:
        return 0


def epoch_result(epoch: int, rows: int, steps_per_epoch: int) -> dict:
    metrics = {f"val_metric_{i}": 100.0 / (i + epoch) for i in range(36)}
    metrics.update(epoch=epoch, train_loss=1.0 / epoch, lr=2e-4, epoch_time_s=60.0)
    every = steps_per_epoch // rows
    trajectory = [{"step": (epoch - 1) * steps_per_epoch + every * (r + 1), "epoch": epoch,
                   "loss": 1.0, "L_con": 0.9, "L_rec": 0.2, "lambda": 3.0} for r in range(rows)]
    return {**metrics, "trajectory": trajectory, "artifacts": [], "final": False}


class PerRowCallback(MlflowTrialCallback):
    """The former recording: one MLflow call for the epoch, one per trajectory row."""

    def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: ANN001
        run_id, client = self.run_id(trial), self.tracker.client
        now = int(time.time() * 1000)
        plain = {k: v for k, v in result.items() if k != "trajectory"}
        client.log_batch(run_id, metrics=epoch_metrics(plain, now))
        for row in result["trajectory"]:
            client.log_batch(run_id, metrics=[Metric(f"trajectory/{k}", v, now, row["step"])
                                              for k, v in row.items() if k not in ("step", "epoch")])


class LogBatchCallback(MlflowTrialCallback):
    """One MLflow ``log_batch`` call per epoch record."""

    def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: ANN001
        metrics = epoch_metrics(result, int(time.time() * 1000))
        self.tracker.client.log_batch(self.run_id(trial), metrics=metrics)


def measure(callback_cls: type, root: Path, trials: int, epochs: int, rows: int) -> float:
    """Epoch results per second recorded by ``callback_cls`` (store creation not timed)."""
    tracker = Tracker(f"sqlite:///{root / 'mlflow.db'}", "bench", root / "artifacts")
    parent = tracker.create_run("parent", {"icr.role": "study"})
    callback = callback_cls(tracker, parent, _Job(), {"study": "bench"}, {}, {"lag": epochs})
    fake = [SimpleNamespace(trial_id=f"t{i}", config={"condition": "lag", "objective.eta": 0.1 * i})
            for i in range(trials)]
    for trial in fake:
        callback.on_trial_start(0, fake, trial)
    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        for trial in fake:
            callback.on_trial_result(0, fake, trial, epoch_result(epoch, rows, 600))
    return trials * epochs / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--trials", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rates = {}
        ways = (("per-row", PerRowCallback), ("log_batch", LogBatchCallback),
                ("one-txn", MlflowTrialCallback))
        for name, cls in ways:
            folder = Path(tmp) / name
            folder.mkdir()
            rates[name] = measure(cls, folder, args.trials, args.epochs, args.rows)
    for name, rate in rates.items():
        print(f"{name:>9}: {rate:6.1f} epoch results/s "
              f"({args.rows} trajectory rows x 4 terms + 40 metrics per result)")
    print(f"one-txn / per-row = {rates['one-txn'] / rates['per-row']:.1f}, "
          f"one-txn / log_batch = {rates['one-txn'] / rates['log_batch']:.1f}; "
          "target: one-txn >= 50 results/s")


if __name__ == "__main__":
    main()
