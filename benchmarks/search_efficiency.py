"""Does the platform's search find a grid's best eta for fewer epochs? (ltd_bound, Lagrangian)

    python benchmarks/search_efficiency.py [--workspace DIR] [--budget 8] [--smoke]

Two searches of LTD's bound eta on ltd_bound's Lagrangian condition, its recipe and seed, in one
run, through the platform's own Tune runs (trainable, MLflow tracking) in a scratch study run:

- ``grid``: every eta of the paper's grid {0.05, 0.1, ..., 0.3} trained for the full budget;
- ``search``: the platform's search as ``studies.run ltd_bound`` runs it (quasi-random start then
  TPE, ASHA stopping weak trials), ``--budget`` trials.

Each side's best is what the platform would select (the best validation rsum among full-budget
trials); the cost is the epochs trained, summed over trials. Prints both and the ratios
search / grid (target: best within 1 % of the grid's at <= 40 % of its epochs).
"""

from __future__ import annotations

import argparse
import time

from ray import tune

from studies import connection
from studies.catalog import get_study
from studies.environment import set_quiet_environment
from studies.pipeline import Backend, open_session, prepare_data
from studies.plan import Options, StudyPlan
from studies.select import select_winner
from studies.session import DriverLock, Session
from studies.trainable import TrialJob
from studies.trials import KEY, TrialSpec
from studies.tuning import TrialRecord, run_tuner, search

GRID = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)  # the paper's eta grid (docs/reference-code.md section 1)
CONDITION = "lagrangian"


def summarize(records: list[TrialRecord], max_epochs: int) -> tuple[float, float, int]:
    """(best validation rsum of a full-budget trial, its eta, epochs trained in all)."""
    winner = select_winner(records, "val_rsum", "max", max_epochs)
    epochs = sum(r.epochs for r in records)
    if winner is None:
        return float("nan"), float("nan"), epochs
    return float(winner.score), float(winner.sampled["objective.eta"]), epochs


def run_grid(session: Session, plan: StudyPlan) -> list[TrialRecord]:
    """Every eta of GRID for the full budget, as a confirmation runs its specs: one Tune trial
    per point, the search's seed, tracked in the same study run."""
    condition = plan.condition(CONDITION)
    specs = [TrialSpec.resolve(CONDITION, condition.flat, {"objective.eta": eta}) for eta in GRID]
    job = TrialJob(plan.study.name, "search", str(plan.workspace.root),
                   experiment=session.experiment_path("grid"))
    return run_tuner(session, "grid", job, (CONDITION,), {KEY: tune.grid_search(specs)},
                     tune.TuneConfig(num_samples=1, max_concurrent_trials=session.concurrency),
                     expected=len(specs), title=f"grid {CONDITION}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workspace", default=None, help="default: ICR_WORKSPACE or ./workspace")
    parser.add_argument("--budget", type=int, default=None, help="search trials (default: the study's)")
    parser.add_argument("--smoke", action="store_true", help="the tiny preset (a minute)")
    args = parser.parse_args(argv)
    set_quiet_environment()
    study = get_study("ltd_bound")
    options = Options(workspace=args.workspace, smoke=args.smoke, budget=args.budget, seeds=1,
                      dashboard=False)
    plan = StudyPlan.build(study, options)
    plan = StudyPlan(**{**plan.__dict__, "conditions": (plan.condition(CONDITION),)})
    run_dir = plan.state_root / f"search-efficiency-{time.strftime('%Y%m%d-%H%M%S')}"
    with DriverLock(plan.workspace.root, plan.key):
        prepared = prepare_data(plan, Backend(), print)
        fingerprints = {name: data.fingerprint for name, data in prepared.items()}
        cluster = connection.connect(dashboard=False)
        try:
            resources = cluster.trial_resources()
            session = open_session(plan, run_dir, cluster, resources, fingerprints, Backend(), 0)
            session.data = {name: str(data.root) for name, data in prepared.items() if data.root}
            start = time.perf_counter()
            searched = search(session, CONDITION)
            search_s = time.perf_counter() - start
            start = time.perf_counter()
            grid = run_grid(session, plan)
            grid_s = time.perf_counter() - start
            session.tracker.finish(session.parent_id)
        finally:
            connection.disconnect(cluster)
    report(summarize(searched, plan.max_epochs), summarize(grid, plan.max_epochs), plan,
           search_s, grid_s, len(searched))


def report(found: tuple[float, float, int], grid: tuple[float, float, int], plan: StudyPlan,
           search_s: float, grid_s: float, trials: int) -> None:
    print(f"search_efficiency: ltd_bound {CONDITION}, preset "
          f"{plan.condition(CONDITION).config.data.preset}, {plan.max_epochs} epochs per trial")
    print(f"  grid   ({len(GRID)} etas, full budget): best val rsum {grid[0]:.2f} at eta "
          f"{grid[1]:.3g}, {grid[2]} epochs, {grid_s / 60:.1f} min")
    print(f"  search ({trials} trials, ASHA):         best val rsum {found[0]:.2f} at eta "
          f"{found[1]:.3g}, {found[2]} epochs, {search_s / 60:.1f} min")
    print(f"  search / grid: best {found[0] / grid[0]:.4f}, epochs {found[2] / grid[2]:.2f} "
          "(target: best >= 0.99 at epochs <= 0.40)")


if __name__ == "__main__":
    main()
