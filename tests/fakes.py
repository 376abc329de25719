"""A fast fake of ``icr.train.fit`` that keeps its contract, for the platform's tests.

It does no learning: the validation rsum is a smooth function of the config (best at
eta = 0.17, better with the epoch, a little seed noise), lambda and L_rec follow the shape of the
LTD paper's Figure 3, each epoch is one :class:`~icr.train.EpochReport` with its trajectory rows
and a checkpoint folder (a JSON state), ``resume_from`` continues after the checkpoint's epoch,
and chosen configs raise ``TrainingError`` (the non-finite-loss error of the real fit) at a chosen
epoch. ``tests/test_seam.py`` holds this fake and the real ``fit`` to the same assertions. Ray
workers import it as the tests do: ``tests/conftest.py`` puts this folder on the ``PYTHONPATH`` of
every process the tests start.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icr.config import ExperimentConfig, to_flat
from icr.errors import TrainingError
from icr.train.seam import EAGER, EpochReport, FitResult, StepModes
from icr.train.tasks import Prepared

STEPS_PER_EPOCH = 20
TRAJECTORY_EVERY = 5


@dataclass(frozen=True)
class FakeFit:
    """Callable like ``icr.train.fit``.

    Args:
        epoch_seconds: wall time of an epoch (a sleep), to make trials overlap.
        fail_on: ``(key, value)`` pairs; a config matching any of them raises at ``fail_epoch``.
        record_dir: each call writes a JSON record there (pid, CUDA_VISIBLE_DEVICES, run_dir,
            resumed epoch, epochs run), for tests of GPU pinning and of resuming.
        barrier: with ``record_dir``, wait (up to 60 s) until this many calls have started,
            which proves that they run concurrently.
        gate, hold_after: before training epoch ``hold_after + 1`` wait until the file
            ``<gate>/go`` exists (a test holds trials at a known point, e.g. to lose a node).
        hold_on: ``(key, value)`` pairs; with them, only a config matching one is held.
        count_builds: with ``record_dir``, record how many configs the process built
            (:class:`ConfigBuilds`) between unpickling this fake (in a Ray worker: before the
            trial's function runs) and the call.
        crash_dir, crashes: a config matching ``fail_on`` ends its process abruptly at
            ``fail_epoch`` instead of raising (a lost worker), as long as ``crash_dir`` holds
            fewer than ``crashes`` files; each crash adds one.
        seconds_per_eta: added to the ``epoch_time_s`` an epoch reports, times its eta (not
            slept): a cost that grows with eta, for a study with a second objective.
    """

    epoch_seconds: float = 0.0
    fail_on: tuple[tuple[str, Any], ...] = ()
    fail_epoch: int = 2
    record_dir: str | None = None
    barrier: int = 0
    gate: str | None = None
    hold_after: int = 0
    hold_on: tuple[tuple[str, Any], ...] = ()
    count_builds: bool = False
    crash_dir: str | None = None
    crashes: int = 0
    seconds_per_eta: float = 0.0

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.count_builds:
            ConfigBuilds.install()

    def __call__(
        self, config: ExperimentConfig, reporter: Any = None, resume_from: Path | str | None = None,
        *, workspace: Any = None, run_dir: Path | str | None = None, progress: bool = False,
    ) -> FitResult:
        flat = to_flat(config)
        root = Path(run_dir) if run_dir else Path(f"/tmp/fake-fit-{os.getpid()}")
        checkpoint = root / "checkpoint"
        checkpoint.mkdir(parents=True, exist_ok=True)
        start, history, trajectory = 0, [], []
        if resume_from is not None:
            state = json.loads((Path(resume_from) / "state.json").read_text())
            start, history, trajectory = state["epoch"], state["history"], state["trajectory"]
        record = self._record_start(root, start, flat)
        failing = any(flat.get(k) == v for k, v in self.fail_on)
        held = bool(self.gate) and (not self.hold_on or any(flat.get(k) == v for k, v in self.hold_on))
        logs = _logged_terms(config)
        for epoch in range(start, config.epochs):
            if failing and epoch + 1 == self.fail_epoch:
                if self.crash_dir is None:
                    raise TrainingError(f"non-finite loss at epoch {epoch + 1} (fake)")
                crashed = Path(self.crash_dir)
                crashed.mkdir(parents=True, exist_ok=True)
                if len(list(crashed.iterdir())) < self.crashes:
                    (crashed / f"{os.getpid()}-{time.time_ns()}").touch()
                    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer, or a node lost
            while held and epoch >= self.hold_after and not (Path(self.gate) / "go").exists():
                time.sleep(0.05)  # held by the test, not timed
            time.sleep(self.epoch_seconds)
            metrics, rows = self._epoch(flat, epoch, *logs)
            best = max([h["val_rsum"] for h in history] + [metrics["val_rsum"]])
            metrics["best_val_rsum"] = best
            metrics["best_epoch"] = next(
                (h["epoch"] for h in history if h["val_rsum"] == best), metrics["epoch"])
            final = epoch + 1 == config.epochs
            if final and config.eval.test:
                metrics.update({f"test_{k[4:]}": v - 3.0 for k, v in metrics.items()
                                if k.startswith("val_")})
            history.append(metrics)
            trajectory.extend(rows)
            (checkpoint / "state.json").write_text(json.dumps(
                {"epoch": epoch + 1, "history": history, "trajectory": trajectory}))
            if reporter is not None:
                steps = StepModes(EAGER, eager=len(rows), reason="no CUDA")  # as fit on a CPU
                reporter(EpochReport(epoch + 1, dict(metrics), tuple(rows), checkpoint, (), final,
                                     steps))
            self._record(record, epochs_run=epoch + 1 - start)  # after the epoch was reported
        best = max(history, key=lambda h: h["val_rsum"]) if history else {"epoch": 0}
        test = {k[5:]: v for k, v in history[-1].items() if k.startswith("test_")} if history else {}
        return FitResult(int(best["epoch"]),
                         {k[4:]: v for k, v in best.items() if k.startswith("val_")},
                         test or None, history, trajectory, checkpoint)

    def _epoch(self, flat: dict[str, Any], epoch: int, lagrangian: bool, reconstruction: bool
               ) -> tuple[dict[str, float], list[dict]]:
        eta = float(flat["objective.eta"])
        quality = 300.0 - (4000.0 * (eta - 0.17) ** 2 if lagrangian else 20.0)
        noise = random.Random(flat["train.seed"] * 1000 + epoch).uniform(-1.0, 1.0)
        rsum = quality * (1.0 - math.exp(-(epoch + 1) / 2.0)) + noise
        lam, rows = 1.0, []
        for s in range(STEPS_PER_EPOCH):
            step = epoch * STEPS_PER_EPOCH + s + 1
            l_rec = max(eta, 0.5 * math.exp(-step / 30.0)) if lagrangian else 0.5 * math.exp(-step / 30)
            lam = min(100.0, max(0.0, 1.0 + 5.0 * (0.12 - eta) * step))
            if step % TRAJECTORY_EVERY == 0:
                row = {"step": step, "epoch": epoch + 1, "loss": 2.0 / step ** 0.3,
                       "L_con": 1.5 / step ** 0.3}
                row.update({"L_rec": l_rec} if reconstruction else {})
                row.update({"lambda": lam} if lagrangian else {})
                rows.append(row)
        metrics = {"epoch": epoch + 1, "val_rsum": rsum, "train_loss": 2.0 / (epoch + 1),
                   "train_L_con": 1.5 / (epoch + 1), "lr": 2e-4,
                   "epoch_time_s": self.epoch_seconds + self.seconds_per_eta * eta}
        metrics["epoch_cpu_s"] = metrics["epoch_time_s"]  # a fake epoch computes all its time
        for k in (1, 5, 10):
            metrics[f"val_i2t_R_at_{k}"] = rsum / 6 * (0.6 + 0.04 * k)
            metrics[f"val_t2i_R_at_{k}"] = rsum / 6 * (0.5 + 0.04 * k)
        metrics.update({"val_i2t_rprec": rsum / 10, "val_t2i_nDCG_at_25": rsum / 5})
        if reconstruction:
            metrics["train_L_rec"] = rows[-1]["L_rec"]
        if lagrangian:
            metrics["lambda"] = lam
        return metrics, rows

    def _record_start(self, root: Path, start: int, flat: dict[str, Any]) -> Path | None:
        if not self.record_dir:
            return None
        directory = Path(self.record_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{os.getpid()}-{time.time_ns()}.json"
        builds = {"config_builds": ConfigBuilds.count} if self.count_builds else {}
        self._record(path, resumed_after=start, run_dir=str(root),
                     objective=flat["objective.name"], seed=flat["train.seed"],
                     cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), epochs_run=0,
                     **builds)
        deadline = time.monotonic() + 60
        while self.barrier and len(list(directory.glob("*.json"))) < self.barrier:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return path

    @staticmethod
    def _record(path: Path | None, **values: Any) -> None:
        if path is None:
            return
        data = json.loads(path.read_text()) if path.is_file() else {}
        data.update(values)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)


@dataclass(frozen=True)
class CountingFit:
    """The real ``icr.train.fit``, each call recorded as :class:`FakeFit` records it: the epoch
    it continued after, the epochs it reported and their training steps (``record_dir``)."""

    record_dir: str

    def __call__(self, config: ExperimentConfig, reporter: Any = None,
                 resume_from: Path | str | None = None, **kwargs: Any) -> FitResult:
        from icr.train import fit

        directory = Path(self.record_dir)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{os.getpid()}-{time.time_ns()}.json"
        FakeFit._record(path, run_dir=str(kwargs.get("run_dir", "")), epochs_run=0, steps=[])

        def counted(report: EpochReport) -> None:
            if reporter is not None:
                reporter(report)
            done = json.loads(path.read_text())
            FakeFit._record(path, resumed_after=done.get("resumed_after", report.epoch - 1),
                            epochs_run=done["epochs_run"] + 1,
                            steps=done["steps"] + [row["step"] for row in report.trajectory])

        return fit(config, counted, resume_from, **kwargs)


class ConfigBuilds:
    """Counts the configs this process builds: the calls of ``icr.config.from_flat``, wherever a
    module imported it from."""

    count = 0
    _original: Any = None
    _patched: list[Any] = []  # the modules whose from_flat was replaced

    @classmethod
    def install(cls) -> None:
        import icr.config

        if cls._original is not None:
            return
        original = cls._original = icr.config.from_flat

        def counted(*args: Any, **kwargs: Any) -> Any:
            cls.count += 1
            return original(*args, **kwargs)

        cls._patched = [m for m in list(sys.modules.values()) if _binds(m, original)]
        for module in cls._patched:
            module.from_flat = counted

    @classmethod
    def uninstall(cls) -> None:
        for module in cls._patched:
            module.from_flat = cls._original
        cls._original, cls._patched, cls.count = None, [], 0


def _binds(module: Any, function: Any) -> bool:
    try:  # some modules answer any attribute (torch's class namespaces), some raise
        return getattr(module, "from_flat", None) is function
    except Exception:
        return False


@contextlib.contextmanager
def counting_config_builds() -> Iterator[type[ConfigBuilds]]:
    """Count the configs built in this process while the block runs."""
    ConfigBuilds.install()
    try:
        yield ConfigBuilds
    finally:
        ConfigBuilds.uninstall()


# Training images of the embedded benchmark's presets (5 captions each), as the real data has.
TRAIN_IMAGES = {"tiny": 40, "small": 600, "default": 4000}


def fake_prepare(config: ExperimentConfig, workspace: Any) -> Prepared:
    """What preparing the embedded benchmark reports, without generating it."""
    images = TRAIN_IMAGES[config.data.preset]
    return Prepared(f"fake-{config.data.preset}-{config.data.seed}", 5 * images, images)


def _logged_terms(config: ExperimentConfig) -> tuple[bool, bool]:
    """What the real ``fit`` of ``config`` logs besides L_con: lambda (its objective has a
    multiplier, the Lagrangian bound on L_rec) and L_rec (it has a decoder), read from the
    components the config builds rather than from their names."""
    from icr.models.build import build_decoder
    from icr.objectives import build_objective

    multiplier = "lambda" in build_objective(config.objective).metrics()
    decoder = build_decoder(config, vocab_size=8, target_dim=4) is not None
    return multiplier, decoder


FAKE_SPACE = """
space:
  loss.tau: 0.05
conditions:
  lagrangian:
    objective.eta: {uniform: [0.05, 0.3]}
"""


def fake_study(folder: Path, budget: int = 6,
               conditions: tuple[str, ...] = ("contrastive", "lagrangian")) -> Any:
    """A small ltd_bound-like :class:`~studies.catalog.Study` named ``fake`` for the fake fit:
    its space file written into ``folder``, eta searched in ``lagrangian``, 3 seeds, ASHA at
    reduction 2; the first condition is the table's baseline."""
    from dataclasses import replace

    from studies.catalog import Condition, Study
    from studies.papers.ltd_bound import TABLE_1, figure_3

    (folder / "space.yaml").write_text(FAKE_SPACE)
    known = {
        "contrastive": Condition("contrastive", "BL", {"objective.name": "contrastive"}),
        "lagrangian": Condition("lagrangian", "BL + LTD, L_lag",
                                {"objective.name": "lagrangian", "decoder.name": "ltd"}),
    }
    return Study(
        name="fake", description="fake study", space_file=str(folder / "space.yaml"),
        base={"train.warmup_epochs": 2, "train.finetune_epochs": 2, "eval.test": False},
        conditions=tuple(known[c] for c in conditions), budget=budget, seeds=3,
        grace_period=1, reduction_factor=2, max_failures=1, startup_trials=3,
        tables=(replace(TABLE_1, baseline=conditions[0]),), figures=figure_3(),
    )


def most_at_once(calls: list[dict]) -> int:
    """The most of ``calls`` (each with a ``start`` and an ``end`` time) that ran at the same
    moment; a start sorts before an end at one instant, so calls that merely touch overlap."""
    events = sorted([(c["start"], 0) for c in calls] + [(c["end"], 1) for c in calls])
    running = most = 0
    for _, kind in events:
        running += 1 if kind == 0 else -1
        most = max(most, running)
    return most


@contextlib.contextmanager
def private_ray(num_cpus: int, num_gpus: int) -> Iterator[Any]:
    """A private Ray instance on 127.0.0.1 with ``num_gpus`` fake GPUs, quiet, stopped after."""
    from studies import connection
    from studies.environment import set_quiet_environment

    set_quiet_environment()
    info = connection.connect(num_cpus=num_cpus, num_gpus=num_gpus, dashboard=False)
    try:
        yield info
    finally:
        connection.disconnect(info)

