"""CPU seconds a fresh process takes to start, as the code is (torchvision imported only where a
ResNet or random erasing is built) and with torchvision imported up front, as the command line and
every trial did before: side by side in one run.

    .venv/bin/python benchmarks/process_start.py [--repeats 5] [--study ltd_bound]

Two kinds of process a study starts many of:

- ``plan``: the command line ``python -m studies.run <study> --plan`` from start to exit (every
  run of the command, and every test that runs it, starts the same way);
- ``trial``: what a trial's Ray worker imports before it trains: Ray Tune, the trainable
  (``studies.trainable``), the training loop (``icr.train``), the model and data builders.

Each is run ``--repeats`` times both ways, the two ways alternating, in fresh interpreters; the
CPU time is the child's user + system time (``getrusage(RUSAGE_CHILDREN)``). Prints the medians
and their ratio. Why it matters: importing torchvision imports all of it, torch._dynamo included,
and on a cluster every trial's process pays it at its start; here all of a simulated cluster's
trials start on 2 cores (``benchmarks/scheduling_scale.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRIAL_IMPORTS = ("import ray.tune, studies.trainable, icr.train, icr.models.build, "
                 "icr.data.pipeline")


def programs(study: str) -> dict[str, str]:
    """What each kind of process runs (Python source for ``python -c``)."""
    plan = ("import runpy, sys\n"
            f"sys.argv = ['studies.run', {study!r}, '--plan']\n"
            "try:\n    runpy.run_module('studies.run', run_name='__main__')\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n")
    return {"plan": plan, "trial": TRIAL_IMPORTS}


def cpu_seconds(source: str, env: dict[str, str]) -> float:
    """The user + system CPU seconds of one fresh interpreter running ``source``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--study", default="ltd_bound", help="the study --plan plans")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workspace:
        env = {**os.environ, "ICR_WORKSPACE": workspace}
        print(f"CPU seconds to start, median of {args.repeats} (2 CPU cores, load average "
              f"{os.getloadavg()[0]:.2f} at the start)")
        print("| process | as it is | torchvision up front | ratio |")
        print("| --- | ---: | ---: | ---: |")
        for kind, source in programs(args.study).items():
            ways: dict[str, list[float]] = {"as it is": [], "torchvision up front": []}
            for _ in range(args.repeats):
                ways["as it is"].append(cpu_seconds(source, env))
                ways["torchvision up front"].append(cpu_seconds("import torchvision\n" + source, env))
            now, before = (statistics.median(v) for v in ways.values())
            print(f"| {kind} | {now:.2f} | {before:.2f} | {before / now:.2f} |")


if __name__ == "__main__":
    main()
