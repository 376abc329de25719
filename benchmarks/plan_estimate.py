"""How close `--plan --calibrate N` comes to a study's real wall time.

Runs the plan's calibration (N timed steps per phase of each condition, one validation pass) and
then the study itself with the same recipe in a fresh workspace (or takes the wall time of a run
already made, ``--measured``), and prints the estimate, the measured time and their ratio, side by
side in one run. The estimate leaves out data preparation, Ray's start and the report; the study's
time here leaves them out too where it can (the benchmark is generated before the clock starts).

    .venv/bin/python benchmarks/plan_estimate.py                       # ltd_bound --smoke
    .venv/bin/python benchmarks/plan_estimate.py --recipe embedded     # make study's run (~20 min)
    .venv/bin/python benchmarks/plan_estimate.py --recipe embedded --measured 1227 --workspace W
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def estimate(study: str, recipe: str, steps: int, workspace: str) -> tuple[float, list[str]]:
    """The plan's estimated wall time (seconds) and the lines ``--plan`` prints."""
    from studies.catalog import get_study
    from studies.estimate import calibrate, describe, plan_costs, trials_at_once
    from studies.plan import Options, StudyPlan

    plan = StudyPlan.build(get_study(study), Options(recipe=recipe, workspace=workspace))
    costs = calibrate(plan, plan_costs(plan), steps, say=lambda line: None)
    at_once, _ = trials_at_once(plan)
    total = sum(c.device_s for c in costs)
    return total / at_once, list(describe(plan, costs))


def run_study(study: str, recipe: str, workspace: str) -> float:
    """Seconds the study takes end to end, its data prepared before the clock starts."""
    env = {**os.environ, "ICR_WORKSPACE": workspace}
    subprocess.run([sys.executable, "-m", "studies.run", study, "--recipe", recipe, "--plan",
                    "--calibrate", "1"], cwd=ROOT, env=env, check=True, capture_output=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "studies.run", study, "--recipe", recipe,
                    "--no-dashboard"], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", default="ltd_bound")
    parser.add_argument("--recipe", default="smoke", choices=("smoke", "embedded"))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per phase (--calibrate)")
    parser.add_argument("--measured", type=float, help="seconds a run of the study took (skip running it)")
    parser.add_argument("--workspace", help="workspace (default: a fresh temporary folder)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workspace = args.workspace or tmp
        estimated, lines = estimate(args.study, args.recipe, args.steps, workspace)
        for line in lines:
            print(line)
        measured = args.measured if args.measured is not None else run_study(
            args.study, args.recipe, workspace)
    print(f"\n{args.study} --recipe {args.recipe}: estimated {estimated / 60:.1f} min, "
          f"measured {measured / 60:.1f} min, estimate / measured = {estimated / measured:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
