"""How much the two costs a trial reports move when other jobs share the CPUs.

    python benchmarks/epoch_cost_under_load.py [--preset tiny] [--epochs 3] [--busy N]

Trains the same configuration (ltd_bound's Lagrangian condition, eta = 0.15, one torch thread)
twice in this process: alone, then with ``--busy`` processes spinning beside it (default: one
per CPU). Prints, for each run, the mean over its epochs of ``epoch_time_s`` (wall seconds) and
``epoch_cpu_s`` (the process's CPU seconds), and each one's ratio loaded / alone, measured side
by side in this one run. A study's second objective (``Study(cost=...)``) ranks runs by one of
them: the ratio says how far another job on the machine moves it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def spin(stop) -> None:
    """A busy job: the CPU it runs on is taken until ``stop`` is set."""
    while not stop.is_set():
        sum(range(10_000))


def costs(config, workspace) -> tuple[float, float]:
    """The means over the run's epochs of ``epoch_time_s`` and ``epoch_cpu_s``."""
    from icr.train import fit

    result = fit(config, workspace=workspace, run_dir=Path(tempfile.mkdtemp(prefix="cost-")))
    return (statistics.mean(m["epoch_time_s"] for m in result.history),
            statistics.mean(m["epoch_cpu_s"] for m in result.history))


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                        help="processes spinning beside the loaded run (default: one per CPU)")
    parser.add_argument("--workspace")
    args = parser.parse_args(argv)

    import torch

    from icr.config import from_flat
    from icr.train.retrieval_data import prepare_data
    from icr.workspace import Workspace
    from studies.catalog import get_study
    from studies.plan import Options, StudyPlan

    plan = StudyPlan.build(get_study("ltd_bound"), Options())
    config = from_flat({**plan.condition("lagrangian").flat, "objective.eta": 0.15,
                        "data.preset": args.preset, "train.warmup_epochs": 1,
                        "train.finetune_epochs": args.epochs - 1, "eval.test": False})
    workspace = Workspace.resolve(args.workspace)
    prepare_data(config, workspace)  # generated and cached once, outside both measurements
    torch.set_num_threads(1)  # a trial's one CPU, as a CPU-only study gives it

    alone = costs(config, workspace)
    stop = multiprocessing.Event()
    jobs = [multiprocessing.Process(target=spin, args=(stop,), daemon=True)
            for _ in range(args.busy)]
    for job in jobs:
        job.start()
    try:
        loaded = costs(config, workspace)
    finally:
        stop.set()
        for job in jobs:
            job.join()
    print(f"config: preset={args.preset}, {config.epochs} epochs, 1 torch thread; "
          f"{args.busy} busy process(es) beside the loaded run, {os.cpu_count()} CPU(s)")
    for name, a, b in (("epoch_time_s", alone[0], loaded[0]), ("epoch_cpu_s", alone[1], loaded[1])):
        print(f"{name:>12}: alone {a:.2f} s, loaded {b:.2f} s, ratio loaded / alone {b / a:.2f}")
    return {"alone": alone, "loaded": loaded}


if __name__ == "__main__":
    main()
