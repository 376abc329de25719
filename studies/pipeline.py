"""``studies.run NAME``: prepare -> search -> select -> confirm -> report (docs/architecture.md, "A study").

Every phase is resumable: ``state.json`` records the phase reached and the winners; Tune
experiments are continued with ``Tuner.restore``; MLflow runs are found again by their tags. One
driver runs a study at a time (:class:`~studies.session.DriverLock`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from filelock import FileLock

from icr.config import ExperimentConfig, key_specs, to_flat, used_keys
from icr.errors import ConfigError
from icr.train.tasks import Prepared, check_fits, prepare
from icr.workspace import Workspace, sqlite_file
from studies import connection
from studies.ensembles import ray_evaluator
from studies.failures import EveryRunFailed
from studies.plan import ConditionPlan, StudyPlan
from studies.progress import ProgressOptions, say_now
from studies.records import stop_recorded_instance
from studies.report import build_report
from studies.select import Winner, select_winner, summary
from studies.session import (
    DriverLock,
    Session,
    find_unfinished,
    new_run_name,
    read_state,
    write_state,
)
from studies.signals import StopSignals, StudyIncomplete, stop_signals_ignored
from studies.space_analysis import domain_tags
from studies.storage import check_storage
from studies.tracking import (
    PARENT_TAG,
    Tracker,
    check_database_driver,
    check_store,
    git_commit,
)
from studies.trials import run_name
from studies.tuning import confirm, search

log = logging.getLogger(__name__)
# Keys that decide which data a config trains on (a distinct data config is prepared once).
DATA_PREFIXES = ("task.", "data.", "text.", "decoder.target_model", "grounding.")


def default_prepare(config: ExperimentConfig, workspace: Workspace) -> Prepared:
    """icr's preparation; the embedded benchmark's data fingerprint is its manifest's (every file,
    region features included: the same on every CPU), printed at start and in every report."""
    from icr.data.synthetic import read_manifest  # lazy: the generator stays off the CLI's start

    prepared = prepare(config, workspace)
    manifest = read_manifest(prepared.root) if prepared.root is not None else None
    return replace(prepared, fingerprint=manifest["fingerprint"]) if manifest else prepared


@dataclass(frozen=True)
class Backend:
    """What trains a trial and prepares its data: ``icr`` by default, fakes in fast tests."""

    fit: Callable[..., Any] | None = None  # None = icr.train.fit (imported in the worker)
    prepare: Callable[[ExperimentConfig, Workspace], Prepared] = default_prepare


def choose_run_dir(plan: StudyPlan, fresh: bool, say: Callable[[str], None]) -> Path:
    """An unfinished run of the study is continued (with or without --resume) unless --fresh."""
    unfinished = None if fresh else find_unfinished(plan.state_root)
    if unfinished is not None:
        state = read_state(unfinished)
        if state.get("signature") != plan.signature():
            raise ConfigError(
                f"the unfinished run {unfinished} was started with other options "
                f"({state.get('signature')}); repeat them to resume it, or pass --fresh"
            )
        say(f"resuming the unfinished run {unfinished.name} (phase {state.get('phase')}); "
            "--fresh starts a new one")
        return unfinished
    return plan.state_root / new_run_name()


def data_key(config: ExperimentConfig) -> tuple[tuple[str, Any], ...]:
    """The data keys ``config`` uses, with their values: two configurations with the same key
    need the same assets. Only used keys count: every configuration holds a
    ``decoder.target_model``, but only one whose decoder reconstructs latent targets needs them
    encoded, and its trials would otherwise encode them, each on its own core, at the start of
    the study (about 140 s of each of ltd_bound's first two trials on 2 cores)."""
    flat = to_flat(config)
    return tuple(sorted((k, flat[k]) for k in used_keys(config) if k.startswith(DATA_PREFIXES)))


def prepare_data(plan: StudyPlan, backend: Backend, say: Callable[[str], None]) -> dict[str, Prepared]:
    """Prepare each distinct data config once on the driver; condition -> what it prepared
    (its data fingerprint, its folder).

    This is where a bad data file, word-vector file or latent-target model is found, and a value
    that cannot work for the data (:func:`check_against_data`): on the driver, before Ray starts
    and before any MLflow run exists.
    """
    done: dict[tuple, Prepared] = {}
    prepared = {}
    for condition in plan.conditions:
        key = data_key(condition.config)
        if key not in done:
            say(f"preparing data for {condition.name} ...")
            done[key] = backend.prepare(condition.config, plan.workspace)
            for note in done[key].notes:  # which files serve each split, the test's protocols
                say(f"  {note}")
            say(f"  data fingerprint {done[key].fingerprint}")
        check_against_data(plan, condition, done[key])
        prepared[condition.name] = done[key]
    return prepared


def check_against_data(plan: StudyPlan, condition: ConditionPlan, data: Prepared) -> None:
    """The checks a trial makes against the size of its data (:func:`icr.train.tasks.check_fits`),
    for the condition's configuration and for every configuration its search can draw.

    A searched domain is checked at its corners (every combination of the choices and of both
    ends of the ranges): the size checks are monotone in a range's value (a larger batch has
    fewer steps), so a domain passes exactly when every value it holds can work. A domain that
    holds a value that cannot is refused, not left to fail trials at run time.
    """
    check_fits(condition.config, data)
    for drawn, config in condition.corners():
        try:
            check_fits(config, data)
        except ConfigError as exc:
            searched = ", ".join(f"{k} ~ {condition.domains[k].describe()}" for k in drawn)
            raise ConfigError(f"{plan.study.space_path}: condition {condition.name} searches "
                              f"{searched}, which holds a value that cannot work: {exc} (narrow "
                              "the domain in the space file)") from None


def run_study(
    plan: StudyPlan, backend: Backend = Backend(), *, resume: bool = False, fresh: bool = False,
    say: Callable[[str], None] = say_now, verbose: int = 0,
    progress: ProgressOptions | None = None,
) -> Path:
    """Run (or continue) the whole study; returns the report folder.

    Before Ray starts and before any MLflow run exists: the study's lock (a second driver is
    refused at once), what a killed driver left (its Ray instance), the tracking store, the
    data and every value checked against it.
    """
    if not verbose:  # one line per trial (ProgressCallback), not Tune's tracebacks and tables
        logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    if resume and not fresh and find_unfinished(plan.state_root) is None:  # before writing a lock
        raise ConfigError(f"nothing to resume: study {plan.key} has no unfinished run in {plan.state_root}")
    if plan.address:
        connection.reachable_gcs(plan.address)  # fails in seconds, before anything is written
    with StopSignals() as stops, DriverLock(plan.workspace.root, plan.key):
        run_dir = choose_run_dir(plan, fresh, say)
        # A driver killed earlier may have left its private Ray instance: stop exactly that one.
        record = plan.workspace.locks / f"{plan.key}.ray.json"
        stop_recorded_instance(record)
        check_database_driver(plan.tracking_uri)
        check_store(plan.tracking_uri)
        prepared = prepare_data(plan, backend, say)
        fingerprints = {name: data.fingerprint for name, data in prepared.items()}
        cluster = connection.connect(plan.address, dashboard=plan.dashboard, record=record,
                                     reachable_gpus=plan.gpus)
        failed = True
        try:
            stops.check()  # a KeyboardInterrupt raised while Ray started can be lost
            with StopSignals() as inner:
                check_storage(plan.storage_root, cluster.reachable_nodes,
                              hosts=cluster.reachable_hosts, now=cluster.nodes)
                resources = cluster.trial_resources(plan.cpus_per_trial, plan.trials_per_gpu)
                say(cluster.describe(resources))
                say(connection.dashboard_hint(cluster))
                session = open_session(plan, run_dir, cluster, resources, fingerprints, backend,
                                       verbose, progress or ProgressOptions(say=say))
                session.stops = inner
                session.data = {name: str(data.root) for name, data in prepared.items() if data.root}
                say(mlflow_hint(plan, session.tracker.experiment_id))
                out = run_phases(session, say)
                failed = False
                return out
        finally:
            if cluster.started_here:
                # A stop signal while a finished study stops its Ray instance does not make it
                # interrupted (the next run would start a new study): the teardown goes on.
                with contextlib.nullcontext() if failed else stop_signals_ignored():
                    connection.disconnect(cluster, keep_logs=failed)


def mlflow_hint(plan: StudyPlan, experiment_id: str = "") -> str:
    """Where to watch the study. MLflow 3.17's UI follows its GenAI / Model training toggle
    (default GenAI, remembered by the browser) over the experiment's kind tag, so the link opens
    the experiment's runs with ``workflowType=machine_learning`` (checked in headless Chromium:
    ``benchmarks/mlflow_ui_check.py``). The artifacts of the workspace's store are served from
    the workspace (:mod:`studies.tracking`)."""
    uri = plan.tracking_uri
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning" if experiment_id else ""
    if uri.startswith("http"):
        return f"MLflow UI: {uri.rstrip('/')}/{page} (experiment {plan.key})"
    return (f"MLflow UI: `.venv/bin/mlflow ui --backend-store-uri {uri} --artifacts-destination "
            f"{plan.workspace.mlartifacts} --host 127.0.0.1 --port 5000`, then "
            f"http://127.0.0.1:5000/{page} (experiment {plan.key})")


def open_tracker(plan: StudyPlan) -> Tracker:
    """The study's tracker, its store created (and migrated) under a lock: two drivers starting
    at once on a fresh sqlite store would otherwise both run MLflow's schema migrations."""
    tracker = Tracker(plan.tracking_uri, plan.key, plan.workspace.mlartifacts)
    db = sqlite_file(plan.tracking_uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(db) + ".lock"):
            tracker.experiment_id  # noqa: B018 - creates the store and the experiment
    return tracker


def open_session(
    plan: StudyPlan, run_dir: Path, cluster: connection.Cluster, resources: dict[str, float],
    fingerprints: dict[str, str], backend: Backend, verbose: int,
    progress: ProgressOptions | None = None,
) -> Session:
    tracker = open_tracker(plan)
    state = read_state(run_dir) if (run_dir / "state.json").is_file() else {}
    commit = git_commit()
    tags = {"study": plan.study.name, "study_key": plan.key, "git_commit": commit,
            "study_run": run_dir.name, "mlflow.source.git.commit": commit,
            "mlflow.source.name": f"python -m studies.run {plan.study.name}",
            "mlflow.source.type": "LOCAL"}
    parent_id = state.get("parent_run_id")
    if parent_id is None:
        parent_tags = {**tags, "icr.role": "study", "mlflow.note.content": plan.study.description,
                       "description": plan.study.description,
                       "conditions": ",".join(c.name for c in plan.conditions),
                       **{f"label.{c.name}": c.label for c in plan.conditions},
                       **{f"searched.{c.name}": ",".join(c.domains) for c in plan.conditions},
                       **domain_tags({c.name: c.domains for c in plan.conditions}),
                       **(plan.warm.tags() if plan.warm is not None else {}),
                       **{f"data_fingerprint.{c}": f for c, f in fingerprints.items()}}
        params = {"budget": plan.budget, "seeds": ",".join(map(str, plan.seeds)),
                  "max_epochs": plan.max_epochs, "smoke": plan.smoke,
                  **{f"set.{k}": v for k, v in plan.overrides.items()}}
        parent_id = tracker.create_run(f"{plan.key}-{run_dir.name}", parent_tags, params)
        state = {"study": plan.study.name, "key": plan.key, "run": run_dir.name,
                 "parent_run_id": parent_id, "phase": "search", "signature": plan.signature(),
                 "winners": {}}
        write_state(run_dir, state)
    else:
        tracker.client.update_run(parent_id, status="RUNNING")
    return Session(plan, run_dir, cluster, resources, tracker, parent_id, tags, fingerprints,
                   backend.fit, verbose, state, progress or ProgressOptions())


def run_phases(session: Session, say: Callable[[str], None]) -> Path:
    plan = session.plan
    if session.state["phase"] == "search":
        winners = {}
        for condition in plan.conditions:
            if not condition.domains:
                # Nothing to search, nothing to select: the fixed config goes to confirmation.
                say(f"search {condition.name}: nothing to search, confirmed as configured")
                winners[condition.name] = Winner(condition.name, "", None, {}).to_json()
                continue
            say(f"search {condition.name}: {_describe_space(condition)}")
            records = search(session, condition.name)
            epochs = condition.config.epochs
            say(f"  {summary(records, epochs)}")
            winner = select_winner(records, plan.study.metric, plan.study.mode, epochs)
            if winner is None:
                say(f"  no trial of {condition.name} ran the full budget: not confirmed")
                continue
            say(f"  winner {winner.trial_id}: {plan.study.metric}={winner.score:.2f} "
                f"({run_name(condition.name, winner.sampled)})")
            winners[condition.name] = winner.to_json()
        session.save_state(phase="confirm", winners=winners)
    if session.state["phase"] == "confirm":
        winners = {k: Winner.from_json(v).sampled for k, v in session.state["winners"].items()}
        say(f"confirm: {len(winners)} winner(s) x {len(plan.seeds)} seed(s), evaluated on test")
        records = confirm(session, winners)
        for record in (r for r in records if r.error):
            say(f"  confirmation run {record.condition} seed {record.spec.seed} "
                f"failed: {record.error}")
        session.save_state(phase="report")
    failed, planned = check_planned_runs(session)
    out = build_report(plan.study, session.tracker, plan.report_dir, session.parent_id,
                       plan.workspace, ray_evaluator(plan.storage_root, session.cluster.reachable_gpus))
    session.tracker.finish(session.parent_id, "FINISHED")
    session.check_stop()  # a report interrupted is not a report: made again by the next run
    note = failed_in_words(failed, planned)
    say(f"report: {out}" + (f" ({note}; the report's notes say which)" if note else ""))
    session.save_state(phase="done")  # after the line: a study marked done has said so
    if failed and len(failed) == planned:  # a report of nothing: the command must not succeed
        raise EveryRunFailed(f"every run of study {plan.key} failed in training ({note}); "
                             f"the report {out} lists their errors")
    return out


def planned_runs(session: Session) -> dict[tuple[str, str], int]:
    """(phase, condition) -> the runs the study run planned: a searched condition's trials, and
    each winner's confirmation seeds."""
    plan = session.plan
    planned = {("search", c.name): c.trials(plan.budget) for c in plan.conditions if c.domains}
    planned.update({("confirm", name): len(plan.seeds) for name in session.state["winners"]})
    return planned


def check_planned_runs(session: Session) -> tuple[list[Any], int]:
    """Before the report: every planned run is in MLflow, once, and ended; a run can have failed
    only in its own training (a run lost around it is retried, :func:`studies.tuning.run_tuner`).
    Returns the runs that failed, and how many runs were planned.

    Raises:
        StudyIncomplete: a planned run is missing or never ended (the report would hold fewer
            runs than planned without saying why).
    """
    runs = session.tracker.find_runs(f"tags.`{PARENT_TAG}` = '{session.parent_id}'")
    found: dict[tuple[str, str], list[Any]] = {}
    for run in runs:
        found.setdefault((run.data.tags.get("phase", ""), run.data.tags.get("condition", "")),
                         []).append(run)
    planned = planned_runs(session)
    for (phase, condition), count in planned.items():
        ended = [r for r in found.get((phase, condition), []) if r.info.status in ("FINISHED", "FAILED")]
        if len(ended) != count:
            raise StudyIncomplete(
                f"MLflow holds {len(ended)} ended {phase} run(s) of {condition}, not the "
                f"{count} planned, in study run {session.run_dir.name}; run the same command "
                "again, or start over with --fresh")
    failed = [r for key in planned for r in found.get(key, []) if r.info.status == "FAILED"]
    return failed, sum(planned.values())


def failed_in_words(failed: list[Any], planned: int) -> str:
    """The runs that failed, in words: how many, and the first one's error ('' if none did)."""
    if not failed:
        return ""
    first = failed[0]
    return (f"{len(failed)} of {planned} runs failed in training: "
            f"{first.info.run_name}: {first.data.tags.get('error', 'no error recorded')}"
            + (" and others" if len(failed) > 1 else ""))


def _describe_space(condition: ConditionPlan) -> str:
    """The searched keys the condition uses (all of them when it searches a component choice)."""
    specs = key_specs()
    choosing = any(specs[k].registry for k in condition.domains)
    used = set(used_keys(condition.config))
    return ", ".join(f"{k} ~ {d.describe()}" for k, d in condition.domains.items()
                     if choosing or k in used)
