"""``python -m studies.run NAME``: run a study end to end (or one trial with ``--debug``).

    python -m studies.run --list                      the studies
    python -m studies.run --keys                      the config keys (for --set and space files)
    python -m studies.run ltd_bound                   search -> select -> confirm -> report
    python -m studies.run ltd_bound --smoke           the same on the tiny preset, in ~2 minutes
    python -m studies.run ltd_bound --debug --set objective.eta=0.1
    python -m studies.run ltd_bound --address auto    on a running Ray cluster
    python -m studies.run ltd_bound --recipe paper --plan --set data.dataset=karpathy ...
                                                      the paper's recipe: what it runs, its cost

A mistake in the command line (unknown study, key or value, bad search-space file) prints one
line, ``error: ...``, and exits with code 2 before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping, Sequence

if __name__ == "__main__":
    # Outside main's handlers (while Python imports the platform, or shuts down after main),
    # Ctrl-C ends the process as SIGTERM and SIGHUP do: nothing is written then, or everything
    # is, and Python's KeyboardInterrupt would print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

try:
    from icr.config import key_specs, parse_overrides
    from icr.errors import UserError
    from studies.catalog import RECIPES, Study, all_studies, get_study
    from studies.debug import run_debug
    from studies.environment import set_quiet_environment
    from studies.failures import EveryRunFailed
    from studies.plan import Options, StudyPlan
    from studies.signals import Interrupted, StopSignals, StudyIncomplete
except ModuleNotFoundError as missing:  # the project's dependencies are not in this interpreter
    if (missing.name or "").split(".")[0] in ("icr", "studies"):
        raise  # one of our own modules: a bug, not the user's setup
    print(f"error: {missing.name} is not installed for {sys.executable}; run `make install` and use "
          ".venv/bin/python -m studies.run (see README)", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one ``error: ...`` line (exit 2), not a usage screen."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see python -m studies.run --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m studies.run", description="Run a hyperparameter study (or one trial).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", nargs="?", help="study name (see --list)")
    p.add_argument("--list", action="store_true", help="list the studies and exit")
    p.add_argument("--keys", action="store_true", help="list the config keys and exit")
    p.add_argument("--debug", action="store_true", help="one trial in-process, no Ray")
    p.add_argument("--condition", help="the condition --debug trains (default: the study's)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny preset, few short trials (the whole pipeline in ~2 minutes)")
    p.add_argument("--recipe", choices=RECIPES, metavar="{embedded,paper,smoke}",
                   help="embedded (default): scaled to the embedded benchmark and 2 CPU cores; "
                        "paper: the paper's own recipe for its real datasets; smoke: as --smoke")
    p.add_argument("--plan", action="store_true",
                   help="print what the study would run and the data it needs, run nothing")
    p.add_argument("--calibrate", type=int, metavar="N",
                   help="with --plan: time N training steps of each condition here and "
                        "estimate the study's wall time and device-hours")
    p.add_argument("--gpus", type=int, metavar="N",
                   help="the most GPUs the cluster can reach: with --plan, estimate for N GPUs "
                        "(default: this machine); with --address, size the study for N "
                        "(default: read from the cluster's autoscaler)")
    p.add_argument("--resume", action="store_true",
                   help="continue the study's unfinished run (also done without it)")
    p.add_argument("--fresh", action="store_true", help="start a new run even if one is unfinished")
    p.add_argument("--warm-start", metavar="STUDY",
                   help="start each search from an earlier study's trials (a study of this "
                        "workspace, or another workspace's folder), none trained again")
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   metavar="KEY=VALUE", help="config overrides, e.g. --set loss.tau=0.07")
    p.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    p.add_argument("--address", help="join a Ray cluster: auto or HOST:PORT (default: start one)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default sqlite <workspace>/mlflow.db)")
    p.add_argument("--storage", help="Tune storage: s3://..., gs://... or a shared path "
                                     "(default <workspace>/ray; required shared on multi-node)")
    p.add_argument("--seeds", type=int, help="confirmation seeds per condition (default 3)")
    p.add_argument("--budget", type=int, help="trials per condition (default: the study's)")
    p.add_argument("--cpus-per-trial", type=int, help="CPUs reserved per trial")
    p.add_argument("--trials-per-gpu", type=int, metavar="N",
                   help="N trials share each GPU, each reserving 1/N of it and 1/N of its "
                        "node's cores per GPU (default: ICR_TRIALS_PER_GPU, else 1)")
    p.add_argument("--no-dashboard", action="store_true", help="start Ray without its dashboard")
    p.add_argument("--verbose", action="store_true", help="show Ray Tune's status tables")
    return p


def list_studies() -> str:
    lines = []
    for study in all_studies().values():
        conditions = ", ".join(c.name for c in study.conditions)
        lines.append(f"{study.name:<14} {study.description}")
        lines.append(f"{'':<14} conditions: {conditions}; space: search_spaces/{study.space_file}")
    return "\n".join(lines)


def list_keys() -> str:
    return "\n".join(
        f"{s.key:<28} {str(s.default):<18} {s.describe():<40} {s.help}" for s in key_specs().values()
    )


def main(
    argv: Sequence[str] | None = None, *, backend: object | None = None,
    extra_studies: Mapping[str, Study] | None = None,
) -> int:
    """The command line; ``backend`` and ``extra_studies`` let tests inject fakes.

    A stop signal (Ctrl-C, SIGTERM, SIGHUP) at any moment ends it with one line, ``interrupted:
    run the same command again to continue``, and exit code 130, whatever it interrupted. A study
    that could not run every run it planned for a reason other than a run's own training (a lost
    worker, say) ends with one ``error: ...`` line and exit code 1; it too can be continued. So
    does a study whose every run failed in its own training, after its report (which lists
    the errors). A node that cannot read the study's data or storage is a mistake in the
    cluster's setup: one line naming the node and the path, exit code 2.
    """
    set_quiet_environment()

    with StopSignals() as stops:
        try:
            return _run(build_parser().parse_args(argv), backend, extra_studies)
        except (Interrupted, KeyboardInterrupt):
            return _interrupted()
        except (StudyIncomplete, EveryRunFailed) as exc:
            if stops.received:
                return _interrupted()
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except UserError as exc:
            if stops.received:  # e.g. a library that reports an interrupted call as its error
                return _interrupted()
            print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                  file=sys.stderr)
            return 2
        except Exception:
            if stops.received:
                return _interrupted()
            raise


def _print_plan(plan: StudyPlan, calibrate: int | None, gpus: int | None) -> int:
    from studies import estimate  # lazy: keeps the benchmark's generator off --help and --list

    costs = estimate.plan_costs(plan)
    if calibrate:
        if plan.missing():
            raise UserError(f"--calibrate needs the data: {plan.missing()[0]}")
        costs = estimate.calibrate(plan, costs, calibrate)
    for line in estimate.describe(plan, costs, gpus):
        print(line)
    return 0


def _warm_started(plan: StudyPlan, source: str, announce: bool) -> StudyPlan:
    """The plan with the earlier study's trials (``--warm-start``), read before anything is
    written; what each condition takes is said now (``--plan`` lists it with the plan)."""
    from studies.warm_start import load_warm_start  # lazy: keeps MLflow off --help and --list

    plan = dataclasses.replace(plan, warm=load_warm_start(source, plan))
    for line in plan.warm.describe() if announce else ():
        print(line)
    return plan


def _interrupted() -> int:
    print(f"interrupted: {INTERRUPTED}", file=sys.stderr)
    return 130


def leave(code: int) -> None:
    """End the process with ``main``'s exit code.

    An interrupted driver (130) has stopped what it started in ``main``'s own cleanup, so it
    leaves at once, as a killed one does (which the next run recovers from), without Python's
    shutdown: that runs the libraries' exit hooks, and Ray's core worker, torn down there while
    its connection is half made (a stop signal while Ray starts), can end the process with
    SIGSEGV after the ``interrupted`` line.
    """
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


INTERRUPTED = "run the same command again to continue"


def _run(args: argparse.Namespace, backend: object | None, extra: Mapping[str, Study] | None) -> int:
    if args.list:
        print(list_studies())
        return 0
    if args.keys:
        print(list_keys())
        return 0
    if not args.name:
        raise UserError("give a study name (python -m studies.run --list shows them)")
    study = get_study(args.name, extra)
    options = Options(
        overrides=parse_overrides(args.overrides), smoke=args.smoke, recipe=args.recipe,
        seeds=args.seeds,
        budget=args.budget, workspace=args.workspace, tracking_uri=args.tracking_uri,
        address=args.address, storage=args.storage, cpus_per_trial=args.cpus_per_trial,
        dashboard=not args.no_dashboard, trials_per_gpu=args.trials_per_gpu,
        gpus=args.gpus if args.address else None,
    )
    if args.calibrate is not None and (not args.plan or args.calibrate < 1):
        raise UserError("--calibrate N goes with --plan, N >= 1 (e.g. --plan --calibrate 20)")
    if args.gpus is not None and (not (args.plan or args.address) or args.gpus < 1):
        raise UserError("--gpus N goes with --plan or --address, N >= 1")
    # every user mistake surfaces here, nothing written yet (--plan lists what a recipe lacks)
    plan = StudyPlan.build(study, options, strict=not args.plan)
    if args.warm_start:
        plan = _warm_started(plan, args.warm_start, announce=not args.plan)
    if args.plan:
        return _print_plan(plan, args.calibrate, args.gpus)
    if args.condition:
        plan.condition(args.condition)
    if args.debug:
        run_debug(plan, args.condition, getattr(backend, "fit", None))
        return 0
    # lazy: keeps Ray, MLflow and Optuna off --help, --list, --plan and --debug
    from studies.pipeline import Backend, run_study

    run_study(plan, backend or Backend(), resume=args.resume, fresh=args.fresh,
              verbose=1 if args.verbose else 0)
    return 0


if __name__ == "__main__":
    leave(main())
