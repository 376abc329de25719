"""Epoch time of one configuration under Ray Tune against the same configuration in-process.

    python benchmarks/trial_overhead.py [--preset small] [--epochs 3] [--set key=value ...]

Both runs train the ltd_bound Lagrangian condition (eta = 0.15) with the same number of CPU
threads: in-process (what ``--debug`` does) and as one Ray Tune trial reserving all the CPUs
(what a study does: ``tune.report`` with a checkpoint every epoch, Tune's checkpoint copy, the
driver's MLflow-free bookkeeping). The epoch time is the wall time between two consecutive
reports, so it includes everything Tune adds per epoch; the first epoch (model building, data
loading) is left out of the mean. Prints both and their ratio, measured in this one run.
Target: ratio <= 1.10.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def in_process_epochs(config, workspace) -> list[float]:
    from icr.train import fit

    marks = [time.perf_counter()]
    fit(config, lambda report: marks.append(time.perf_counter()), None,
        workspace=workspace, run_dir=Path(tempfile.mkdtemp(prefix="overhead-")))
    return [b - a for a, b in zip(marks, marks[1:], strict=False)]


def ray_epochs(flat: dict, workspace, cpus: int) -> tuple[list[float], float]:
    from ray import tune

    from studies import connection
    from studies.frameworks.tune import EpochCsvLogger, EpochJsonLogger
    from studies.trainable import StopWhenUnreadable, TrialJob, run_trial
    from studies.trials import KEY, TrialSpec

    class EpochTimes(tune.Callback):
        """Tune's time of each reported epoch, as the driver receives it."""

        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
            self.seconds.append(float(result["time_this_iter_s"]))

    cluster = connection.connect(num_cpus=cpus, dashboard=False)
    try:
        storage = tempfile.mkdtemp(prefix="overhead-ray-")
        job = TrialJob("ltd_bound", "search", str(workspace.root),
                       experiment=f"{storage}/overhead")
        trainable = tune.with_resources(tune.with_parameters(run_trial, job=job), {"cpu": cpus})
        times = EpochTimes()
        # The callbacks a study's Tuner has beside MLflow's (studies.tuning.tuner_callbacks):
        # the storage marker a trial checks before it trains, and the loggers (Tune's are off).
        run_config = tune.RunConfig(name="overhead", storage_path=storage, verbose=0,
                                    callbacks=[StopWhenUnreadable(job.experiment), times,
                                               EpochJsonLogger(), EpochCsvLogger()])
        tuner = tune.Tuner(trainable, param_space={KEY: TrialSpec.resolve("bench", flat, {})},
                           run_config=run_config)
        start = time.perf_counter()
        tuner.fit()
        return times.seconds, time.perf_counter() - start
    finally:
        connection.disconnect(cluster)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Print the comparison; return both runs' epoch times (s), ``local`` and ``tuned``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workspace")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[])
    args = parser.parse_args(argv)

    import torch

    from icr.config import from_flat, parse_overrides, to_flat
    from icr.train.retrieval_data import prepare_data
    from icr.workspace import Workspace
    from studies.catalog import get_study
    from studies.environment import set_quiet_environment
    from studies.plan import Options, StudyPlan

    set_quiet_environment()  # a study's environment (Tune's own loggers off, as in a study)

    plan = StudyPlan.build(get_study("ltd_bound"), Options())
    flat = {**plan.condition("lagrangian").flat, "objective.eta": 0.15, "data.preset": args.preset,
            "train.warmup_epochs": 1, "train.finetune_epochs": args.epochs - 1,
            **parse_overrides(args.overrides)}
    config = from_flat(flat)
    flat = to_flat(config)
    workspace = Workspace.resolve(args.workspace)
    prepare_data(config, workspace)  # generated and cached once, outside both measurements
    cpus = os.cpu_count() or 1
    torch.set_num_threads(cpus)

    local = in_process_epochs(config, workspace)
    tuned, wall = ray_epochs(flat, workspace, cpus)
    local_mean = statistics.mean(local[1:] or local)
    tuned_mean = statistics.mean(tuned[1:] or tuned)
    print(f"config: preset={args.preset}, {config.epochs} epochs, {cpus} CPU threads in both runs")
    print(f"in-process epoch times (s): {', '.join(f'{t:.2f}' for t in local)}")
    print(f"Ray Tune   epoch times (s): {', '.join(f'{t:.2f}' for t in tuned)}")
    print(f"Tune trial wall time incl. actor start: {wall:.1f} s (sum of epochs {sum(tuned):.1f} s)")
    print(f"mean epoch time after the first: in-process {local_mean:.2f} s, Ray Tune {tuned_mean:.2f} s")
    print(f"ratio Ray Tune / in-process: {tuned_mean / local_mean:.3f} (target <= 1.10)")
    return {"local": local, "tuned": tuned}


if __name__ == "__main__":
    main()
