"""Chaos: a study's driver killed at seeded random instants of every phase, then run again.

Each instant is a phase (data preparation, search, select, confirm, report), a moment in it
and a signal (SIGKILL, SIGTERM, SIGINT, SIGHUP) sent to the driver of a fresh study run; the
same command then runs until it completes, and the instant passes when:

- every planned run is in MLflow once, FINISHED (no run failed: the fit here never fails);
- every epoch of every run is recorded once, and equals the row of Tune's ``result.json``,
  which holds each epoch once;
- no epoch that MLflow held when the driver died was trained again (each ``fit`` call records
  the epoch it continued after), and each run's training steps are recorded once, those of an
  uninterrupted run of the same configuration;
- the report is complete: every file, each table over the planned runs per row;
- no run printed a traceback, a handled signal ended the driver with one line and exit code
  130, and no process of the study is left once the last run has ended.

The driver is ``studies.run`` (``main``) in its own process on its own private Ray instance,
as a user runs it, with :class:`fakes.FakeFit` as the fit: it keeps ``fit``'s contract
(``tests/test_seam.py``: checkpoints, resuming, one report per epoch with its trajectory) and
records each call, in a second instead of ``--smoke``'s minute and a half, so that CI runs
eight instants and a campaign of forty stays within the hour. The kill points are in the
platform (the driver, Tune's state, MLflow, the records), which is the same for either fit;
``ICR_CHAOS_STUDY=smoke`` runs the campaign on ``ltd_bound --smoke`` with the real fit
(:class:`fakes.CountingFit`). ``ICR_CHAOS_INSTANTS`` sets N (default 8), ``ICR_CHAOS_SEED``
the seed (default: a new one, printed with every failure so that it reproduces),
``ICR_CHAOS_PHASES`` the phases (default all; e.g. ``confirm``), ``ICR_CHAOS_SIGNALS`` the
signals (default all four; e.g. ``SIGKILL``).

An instant is a uniform fraction of its phase's duration in an uninterrupted run of the same
study, measured first in the same workspace (a phase starts when the driver prints its first
line; the data preparation when the driver starts), or, for half the search and confirm
instants, up to 0.3 s after one of the phase's epoch results reached Tune's files: where a
checkpoint, Tune's saved state and MLflow are written one after another.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from studies import processes, records

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("prepare", "search", "select", "confirm", "report")
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RUN_TIMEOUT_S = 600
INTERRUPTED = "interrupted: run the same command again to continue"

DRIVER = """
import signal
signal.signal(signal.SIGINT, signal.SIG_DFL)  # as `python -m studies.run` (studies/run.py) does
import os, sys
from dataclasses import replace
from pathlib import Path
from fakes import CountingFit, FakeFit, fake_prepare, fake_study
from studies.pipeline import Backend
from studies.run import leave, main
if __name__ == "__main__":  # the benchmark's generator spawns workers, which import this file
    records = os.environ["ICR_CHAOS_RECORDS"]
    if sys.argv[1] == "ltd_bound":  # the user's --smoke, with the real fit
        leave(main(sys.argv[1:], backend=Backend(CountingFit(records))))
    study = replace(fake_study(Path(os.environ["ICR_CHAOS_STUDY_DIR"]), budget=2), name="chaos")
    fit = FakeFit(epoch_seconds=0.3, record_dir=records)
    leave(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={"chaos": study}))
"""


@dataclass(frozen=True)
class ChaosStudy:
    """A study as the campaign runs it: its command and what it plans."""

    args: tuple[str, ...]  # after the driver script, before --workspace
    key: str  # its runs' folder and MLflow experiment
    searched: dict[str, int]  # condition -> search trials
    confirmed: tuple[str, ...]  # the conditions confirmed
    seeds: int
    epochs: int
    files: tuple[str, ...]  # of the report
    deterministic: bool  # a run's metrics are a function of its config (the fake fit)


FAKE = ChaosStudy(
    ("chaos", "--seeds", "2", "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"),
    "chaos", {"lagrangian": 2}, ("contrastive", "lagrangian"), 2, 2,
    ("table1.md", "table1.tex", "table1_vs_baseline.md", "table1_vs_baseline.tex", "trials.csv",
     "lambda_per_eta.png", "lrec_per_eta.png", "val_rsum_per_epoch.png",
     "best_val_rsum_vs_eta.png"), True)
SMOKE = ChaosStudy(
    ("ltd_bound", "--smoke"), "ltd_bound-smoke", {"lagrangian": 2},
    ("contrastive", "dual", "lagrangian"), 2, 2, FAKE.files, False)


@dataclass
class DriverRun:
    """One run of the driver: its lines with the time each arrived, how it ended."""

    lines: list[tuple[float, str]] = field(default_factory=list)  # stdout
    err: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    rc: int | None = None
    signalled: tuple[str, float] | None = None  # (signal, seconds after start)
    phase_at_signal: str = ""

    def first(self, predicate: Callable[[str], bool]) -> float | None:
        return next((t for t, line in self.lines if predicate(line)), None)

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines) + "\n" + "\n".join(self.err)


@dataclass(frozen=True)
class Instant:
    """When the driver gets its signal: ``after`` seconds into ``phase`` or, with ``row``,
    ``after`` seconds after the phase's ``row``-th epoch result reached Tune's files (a trial's
    epoch ends there: when a checkpoint, Tune's saved state and MLflow are written one after
    another)."""

    phase: str
    signal: signal.Signals
    after: float
    row: int | None = None

    def __str__(self) -> str:
        at = f"{self.after:.2f} s after result {self.row} of" if self.row else f"{self.after:.2f} s into"
        return f"{self.signal.name} {at} {self.phase}"


# A phase starts when the driver prints its first line (prepare: when the driver starts).
STARTS: dict[str, Callable[[str], bool]] = {
    "search": lambda line: line.startswith("search "),
    "select": lambda line: line.startswith(("  winner ", "  no trial of ")),
    "confirm": lambda line: line.startswith("confirm: ") and " winner(s) x " in line,
    "report": lambda line: re.match(r"confirm: \d+ done, 0 running, 0 left", line) is not None,
}


def phase_starts(run: DriverRun) -> dict[str, float]:
    """Seconds from the driver's start to each phase's first line (those it printed)."""
    starts = {"prepare": 0.0}
    for phase, predicate in STARTS.items():
        at = run.first(predicate)
        if at is not None:
            starts[phase] = at - run.started
    return starts


def durations(run: DriverRun) -> dict[str, float]:
    """Each phase's duration in an uninterrupted run."""
    starts = phase_starts(run)
    bounds = [starts[p] for p in PHASES] + [run.ended - run.started]
    return {p: max(bounds[i + 1] - bounds[i], 0.0) for i, p in enumerate(PHASES)}


class Campaign:
    """N instants on one workspace (each a fresh run of the study), and what they left."""

    def __init__(self, study: ChaosStudy, root: Path, seed: int) -> None:
        self.study = study
        self.root = root
        self.workspace = root / "ws"
        self.seed = seed
        self.temp_dirs: set[Path] = set()  # the private Ray instances' folders, from the record
        self.record = self.workspace / "locks" / f"{study.key}.ray.json"
        self.count = 0

    def command(self) -> list[str]:
        return [sys.executable, str(self.root / "driver.py"), *self.study.args,
                "--workspace", str(self.workspace)]

    def run(self, records: Path, instant: Instant | None = None,
            before: frozenset[Path] = frozenset()) -> DriverRun:
        """Run the driver to its end; signal it at ``instant`` of the study run it starts (or
        continues) beside those ``before``."""
        self.count += 1
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               "ICR_CHAOS_RECORDS": str(records), "ICR_CHAOS_STUDY_DIR": str(self.root)}
        run = DriverRun(started=time.monotonic())
        driver = subprocess.Popen(self.command(), cwd=ROOT, env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        readers = [threading.Thread(target=_read, args=(driver.stdout, run.lines, True)),
                   threading.Thread(target=_read, args=(driver.stderr, run.err, False))]
        for reader in readers:
            reader.start()
        deadline = run.started + RUN_TIMEOUT_S
        reached: list[float] = []  # when the instant's result row reached Tune's files
        try:
            while driver.poll() is None and time.monotonic() < deadline:
                self._note_temp_dir()
                if instant is not None and run.signalled is None \
                        and self._due(run, instant, before, reached):
                    run.phase_at_signal = self._phase_now(run)
                    driver.send_signal(instant.signal)
                    run.signalled = (instant.signal.name, time.monotonic() - run.started)
                time.sleep(0.01)  # polls the driver's output, not a timing
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait()
            for reader in readers:
                reader.join()
        run.ended, run.rc = time.monotonic(), driver.returncode
        assert time.monotonic() < deadline, f"the driver ran past {RUN_TIMEOUT_S} s:\n{run.text[-3000:]}"
        return run

    def _due(self, run: DriverRun, instant: Instant, before: frozenset[Path],
             reached: list[float]) -> bool:
        begun = run.started if instant.phase == "prepare" else run.first(STARTS[instant.phase])
        if begun is None:
            return False
        if instant.row is None:
            return time.monotonic() >= begun + instant.after
        if not reached and self.rows(instant.phase, before) >= instant.row:
            reached.append(time.monotonic())
        return bool(reached) and time.monotonic() >= reached[0] + instant.after

    def rows(self, phase: str, before: frozenset[Path]) -> int:
        """The epoch results in Tune's files of the phase's experiments, in the study runs
        started since ``before``."""
        experiments = "search-*" if phase == "search" else "confirm"
        return sum(len(path.read_text().splitlines())
                   for run_dir in self.study_runs() - before
                   for path in run_dir.glob(f"{experiments}/*/result.json"))

    def _note_temp_dir(self) -> None:
        try:
            folder = json.loads(self.record.read_text()).get("temp_dir")
        except (OSError, ValueError, AttributeError):
            return
        if isinstance(folder, str):
            self.temp_dirs.add(Path(folder))

    def _phase_now(self, run: DriverRun) -> str:
        """The phase the driver is in, by what it printed."""
        now = time.monotonic() - run.started
        started = [p for p, at in phase_starts(run).items() if at <= now]
        return started[-1]

    def study_runs(self) -> set[Path]:
        """The study runs' folders (each a fresh run of the study, or one continued)."""
        folder = self.workspace / "ray" / self.study.key
        return {p for p in folder.iterdir() if (p / "state.json").is_file()} if folder.is_dir() else set()

    def state_of(self, before: set[Path]) -> tuple[Path | None, dict]:
        """The folder and state of the study run started since ``before`` (None, {}: none yet)."""
        new = sorted(self.study_runs() - before)
        assert len(new) <= 1, f"more than one study run: {new}"
        return (new[0], json.loads((new[0] / "state.json").read_text())) if new else (None, {})

    def leftovers(self) -> list[str]:
        """The processes of this study still running: a marker of its owner id, a file open in
        (or a command line naming) one of its instances' folders."""
        owner = records.owner_of(self.record)
        folders = tuple(str(p) for p in self.temp_dirs)
        inside = tuple(f + os.sep for f in folders)
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.uids().real != os.getuid() or proc.pid == os.getpid():
                    continue
                marked = (proc.environ().get(processes.MARKER) or "").startswith(f"{owner}-")
                cmdline = " ".join(proc.cmdline())
                named = any(f in cmdline for f in folders)
                holding = bool(inside) and any(f.path.startswith(inside) for f in proc.open_files())
            except (psutil.Error, OSError):
                continue
            if marked or named or holding:
                found.append(f"{proc.pid} {cmdline[:100]}")
        return found

    def clean(self) -> None:
        """Remove the instances' folders that interrupted drivers kept (Ray's logs)."""
        for folder in self.temp_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def _read(stream, into: list, stamped: bool) -> None:
    for line in stream:
        line = line.rstrip("\n")
        into.append((time.monotonic(), line) if stamped else line)


# --- what an instant must leave ------------------------------------------------------------------


def recorded(db: Path, parent: str) -> dict[str, dict]:
    """MLflow's child runs of ``parent``, by Tune trial id: name, status, phase, condition,
    ``epochs`` (tag), and each metric's steps and values, read with SQL (no driver runs now; a
    writable connection rolls back what a killed one left half written, as the next driver's)."""
    with contextlib.closing(sqlite3.connect(db, timeout=60)) as con:
        runs = con.execute(
            "SELECT r.run_uuid, r.name, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE t.key = 'mlflow.parentRunId' AND t.value = ? AND r.lifecycle_stage = 'active'",
            (parent,)).fetchall()
        found = {}
        for run_id, name, status in runs:
            tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)))
            metrics: dict[str, list[tuple[int, float]]] = {}
            for key, step, value in con.execute(
                    "SELECT key, step, value FROM metrics WHERE run_uuid = ? ORDER BY step",
                    (run_id,)):
                metrics.setdefault(key, []).append((step, value))
            found[tags.get("tune_trial_id", run_id)] = {
                "name": name, "status": status, "phase": tags.get("phase"),
                "condition": tags.get("condition"), "epochs": tags.get("epochs"),
                "metrics": metrics}
    return found


def recorded_epochs(db: Path, parent: str | None) -> dict[str, int]:
    """Tune trial id -> the last epoch MLflow holds of it (0 where none)."""
    if parent is None or not db.exists():
        return {}
    return {trial: max((s for s, _ in run["metrics"].get("epoch", [])), default=0)
            for trial, run in recorded(db, parent).items()}


def result_rows(run_dir: Path, trial: str) -> list[dict]:
    """The rows of a trial's result.json in its Tune experiment."""
    (folder,) = [p for p in run_dir.glob(f"*/*{trial}*") if (p / "result.json").is_file()]
    return [json.loads(line) for line in (folder / "result.json").read_text().splitlines()
            if line.strip()]


def fit_calls(folder: Path) -> list[dict]:
    calls = []
    for path in folder.glob("*.json"):
        call = json.loads(path.read_text())
        call["trial"] = re.search(r"icr-trial-(\w+?)-", call["run_dir"]).group(1)
        calls.append(call)
    return calls


def check_instant(campaign: Campaign, before: set[Path], runs: list[DriverRun],
                  calls: list[list[dict]], held: list[dict[str, int]],
                  reference: dict[str, dict] | None) -> dict[str, dict]:
    """Assert what the instant must leave (module docstring); returns its MLflow runs by name."""
    study = campaign.study
    run_dir, state = campaign.state_of(before)
    assert state.get("phase") == "done", state
    report_line = f"report: {campaign.workspace / 'reports' / study.key}"
    for run in runs:
        assert "Traceback" not in run.text, run.text[-3000:]
        if run.signalled and run.signalled[0] != "SIGKILL" and run.rc != 0:
            # Handled: one line and 130; before the driver's handlers (while Python imports the
            # platform) or after them (the study done, Python shutting down): the signal's own end.
            own_end = run.rc == -signal.Signals[run.signalled[0]] and (
                not run.lines or run.lines[-1][1] == report_line)
            assert own_end or (run.rc == 130 and run.err[-1] == INTERRUPTED), \
                (run.rc, run.lines[-1:], run.err[-5:])
    last = runs[-1]
    assert last.rc == 0 or last.signalled, last.text[-3000:]  # or signalled once it was done
    assert report_line in [line for _, line in last.lines], last.text[-3000:]

    # Every planned run in MLflow once, FINISHED; each epoch once, as Tune's result.json has it.
    found = recorded(campaign.workspace / "mlflow.db", state["parent_run_id"])
    planned = {("search", c): n for c, n in study.searched.items()}
    planned.update({("confirm", c): study.seeds for c in study.confirmed})
    counted: dict[tuple, int] = {}
    for trial, run in found.items():
        counted[(run["phase"], run["condition"])] = counted.get((run["phase"], run["condition"]), 0) + 1
        assert run["status"] == "FINISHED", (trial, run["name"], run["status"])
        epochs = [s for s, _ in run["metrics"]["epoch"]]
        assert epochs == list(range(1, int(run["epochs"]) + 1)), (run["name"], epochs)
        assert run["phase"] == "search" or epochs[-1] == study.epochs, (run["name"], epochs)
        rows = result_rows(run_dir, trial)
        assert [r["epoch"] for r in rows] == epochs, (run["name"], [r["epoch"] for r in rows])
        for (step, value), row in zip(run["metrics"]["val_rsum"], rows, strict=True):
            assert math.isclose(value, row["val_rsum"], rel_tol=1e-9), (run["name"], step)
        steps = [s for s, _ in run["metrics"]["trajectory/loss"]]
        assert len(steps) == len(set(steps)), (run["name"], "a training step recorded twice")
    assert counted == planned, (counted, planned)

    # No epoch MLflow held when a driver died was trained again.
    for before, later in zip(held, calls[1:], strict=True):
        for call in later:
            if call["epochs_run"]:
                assert call["resumed_after"] >= before.get(call["trial"], 0), (call, before)

    # The same runs as an uninterrupted study: steps (and, for the fake fit, every value).
    by_name = {run["name"]: run for run in found.values()}
    if reference is not None:
        for name, run in by_name.items():
            if run["phase"] != "confirm":
                continue
            if name not in reference:  # another winner (the real fit's search differs)
                continue
            same = reference[name]["metrics"]
            for key in ("epoch", "trajectory/loss") + (("val_rsum", "test_rsum") if study.deterministic else ()):
                assert run["metrics"][key] == same[key], (name, key)

    # The report: every file, each table over the planned runs.
    report = campaign.workspace / "reports" / study.key
    for name in study.files:
        assert (report / name).is_file() and (report / name).stat().st_size > 0, name
    table = (report / "table1.md").read_text()
    assert f"over {study.seeds} runs per row" in table and "did not finish" not in table, table
    return by_name


def wait_for_no_leftovers(campaign: Campaign, timeout: float = 120.0) -> list[str]:
    """The study's processes still running ``timeout`` s after its last driver ended (a killed
    driver's launcher stops its instance in the background)."""
    deadline = time.monotonic() + timeout
    while (left := campaign.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.5)  # waits for processes to end, not for time
    return left


# --- the campaign --------------------------------------------------------------------------------


def plan_instants(n: int, rng: random.Random, took: dict[str, float], rows: dict[str, int],
                  phases: tuple[str, ...] = PHASES,
                  kinds: tuple[signal.Signals, ...] = SIGNALS) -> list[Instant]:
    """N instants: every phase and every signal as evenly as N allows, in a seeded order; each
    at a uniform fraction of its phase or, in half of the search and confirm instants, up to
    0.3 s after one of the phase's epoch results."""
    chosen = [phases[i % len(phases)] for i in range(n)]
    signals = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(chosen)
    rng.shuffle(signals)
    instants = []
    for phase, sig in zip(chosen, signals, strict=True):
        if rows.get(phase) and rng.random() < 0.5:
            instants.append(Instant(phase, sig, rng.uniform(0.0, 0.3), rng.randint(1, rows[phase])))
        else:
            instants.append(Instant(phase, sig, rng.random() * took[phase]))
    return instants


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_a_study_killed_at_random_instants_loses_and_repeats_nothing(tmp_path: Path) -> None:
    study = {"fake": FAKE, "smoke": SMOKE}[os.environ.get("ICR_CHAOS_STUDY", "fake")]
    n = int(os.environ.get("ICR_CHAOS_INSTANTS", "8"))
    phases = tuple(os.environ.get("ICR_CHAOS_PHASES", ",".join(PHASES)).split(","))
    assert set(phases) <= set(PHASES), f"ICR_CHAOS_PHASES: choose among {PHASES}"
    kinds = tuple(signal.Signals[name] for name in
                  os.environ.get("ICR_CHAOS_SIGNALS", ",".join(s.name for s in SIGNALS)).split(","))
    seed = int(os.environ.get("ICR_CHAOS_SEED") or random.SystemRandom().randrange(2**32))
    print(f"chaos: seed {seed}, {n} instants, study {study.key} "
          f"(ICR_CHAOS_SEED={seed} ICR_CHAOS_INSTANTS={n} reproduces it)", flush=True)
    (tmp_path / "driver.py").write_text(DRIVER)
    campaign = Campaign(study, tmp_path, seed)
    started = time.monotonic()
    try:
        # An uninterrupted run: the phases' durations, and the runs every instant must match.
        clean = campaign.run(tmp_path / "records-0")
        assert clean.rc == 0, clean.text[-3000:]
        reference = check_instant(campaign, set(), [clean], [fit_calls(tmp_path / "records-0")],
                                  [], None)
        took = durations(clean)
        rows = {p: campaign.rows(p, frozenset()) for p in ("search", "confirm")}
        print(f"chaos: uninterrupted run {clean.ended - clean.started:.0f} s; phases "
              + ", ".join(f"{p} {t:.1f} s" for p, t in took.items())
              + f"; epoch results: {rows}", flush=True)
        for i, instant in enumerate(plan_instants(n, random.Random(seed), took, rows, phases, kinds), 1):
            runs, calls, held = [], [], []
            before = frozenset(campaign.study_runs())
            done = False
            while not done:  # the same command until the study run is done
                assert len(runs) < 4, f"seed {seed}, instant {i}: no complete run in 4 tries"
                folder = tmp_path / f"records-{i}-{len(runs)}"
                runs.append(campaign.run(folder, None if runs else instant, before))
                calls.append(fit_calls(folder) if folder.is_dir() else [])
                _, state = campaign.state_of(before)
                done = state.get("phase") == "done"
                if not done:
                    held.append(recorded_epochs(campaign.workspace / "mlflow.db",
                                                state.get("parent_run_id")))
            first = runs[0]
            signalled = (f"{first.signalled[1]:.1f} s after the start, in "
                         f"{first.phase_at_signal}" if first.signalled else "not signalled: it ended first")
            what = (f"seed {seed}, instant {i}: {instant} ({signalled}; exit codes "
                    f"{[r.rc for r in runs]})")
            print(f"chaos: {what}", flush=True)
            try:
                check_instant(campaign, before, runs, calls, held, reference)
                left = wait_for_no_leftovers(campaign)
                assert not left, left
            except AssertionError as failure:
                raise AssertionError(f"{what}: {failure}") from None
    finally:
        campaign.clean()
    print(f"chaos: {n} instants clean in {time.monotonic() - started:.0f} s "
          f"({campaign.count} driver runs)", flush=True)
