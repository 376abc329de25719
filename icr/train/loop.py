"""``fit``: the one training loop, for every task, and ``load_trained`` for analyses.

The loop owns what every task shares (docs/architecture.md, "The seam"): epochs, validation, the best epoch by
the task's selection metric, a checkpoint after every epoch, one :class:`EpochReport` per epoch,
and at the end the test split and the analyses (``eval.analyses``), both on the best checkpoint.
The task (:mod:`icr.train.tasks`) knows how to train an epoch and evaluate a split.

A checkpoint holds the task's state, the loop's (epoch, best score, history, trajectory) and every
RNG state, so a run resumed from it gives the metrics of an uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from icr.analysis import Analysis, build_analysis
from icr.config import ExperimentConfig, from_flat, split_list, to_flat
from icr.context import TaskContext
from icr.errors import ConfigError
from icr.seeding import rng_state, seed_everything, set_rng_state
from icr.train.analyses import check_analyses
from icr.train.checkpoint import ARTIFACTS, load_checkpoint, save_checkpoint
from icr.train.device import configure_backends
from icr.train.seam import EpochReport, FitResult, Reporter
from icr.train.tasks import Task, build_task
from icr.workspace import Workspace

log = logging.getLogger(__name__)


@dataclass
class LoopState:
    """Where the loop stands: what a checkpoint needs beyond the task's own state."""

    epoch: int = 0  # epochs completed
    best_score: float = -math.inf
    best_epoch: int = 0  # 1-based
    history: list[dict[str, float]] = field(default_factory=list)
    trajectory: list[dict[str, float]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but CUDA is not available; use train.device=cpu")
    return torch.device(name)


def _workspace(workspace: Workspace | Path | str | None) -> Workspace:
    return workspace if isinstance(workspace, Workspace) else Workspace.resolve(workspace)


def fit(
    config: ExperimentConfig,
    reporter: Reporter | None = None,
    resume_from: Path | str | None = None,
    *,
    workspace: Workspace | Path | str | None = None,
    run_dir: Path | str | None = None,
    progress: bool = False,
) -> FitResult:
    """Train ``config``; call ``reporter(EpochReport)`` once per epoch.

    Args:
        config: the experiment.
        reporter: receives each epoch's :class:`EpochReport`.
        resume_from: a checkpoint folder written by an earlier call with the same config.
        workspace: where data and caches live (default: ``ICR_WORKSPACE`` or ``./workspace``).
        run_dir: where checkpoints are written (default: a temporary folder).
        progress: show tqdm progress bars.
    """
    device = resolve_device(config.train.device)
    configure_backends(device, config.train.deterministic)
    seed_everything(config.train.seed)
    task = build_task(config, _workspace(workspace), device)
    analyses = build_analyses(config, task)  # a bad analysis fails before any training
    state, best = LoopState(), None
    if resume_from is not None:
        state, best = _resume(config, task, Path(resume_from))
        log.info("resumed from %s after epoch %d", resume_from, state.epoch)
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="icr-fit-"))
    checkpoint = root / "checkpoint"
    for epoch in range(state.epoch, task.epochs):
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics: dict[str, float] = {"epoch": epoch + 1, **task.train_epoch(epoch, progress)}
        rows = task.take_trajectory()
        steps = task.step_modes() if hasattr(task, "step_modes") else None  # optional (Task)
        val = task.evaluate("val")
        metrics.update({f"val_{k}": v for k, v in val.items()})
        metrics.update(task.metrics())
        if val[task.selection_metric] > state.best_score:
            state.best_score, state.best_epoch = val[task.selection_metric], epoch + 1
            best = task.model_state()
        metrics[f"best_val_{task.selection_metric}"] = state.best_score
        metrics["best_epoch"] = state.best_epoch
        state.epoch = epoch + 1
        final = state.epoch == task.epochs
        artifacts: tuple[str, ...] = ()
        if final:
            with _best_weights(task, best):
                if config.eval.test:
                    metrics.update({f"test_{k}": v for k, v in task.evaluate("test").items()})
                metrics_out, artifacts = _run_analyses(analyses, root / ARTIFACTS)
                metrics.update(metrics_out)
        metrics["epoch_time_s"] = time.perf_counter() - start
        # The process's CPU seconds over the same span (every thread): a cost that other jobs
        # sharing the machine barely move, unlike the wall time (benchmarks/epoch_cost_under_load.py).
        metrics["epoch_cpu_s"] = time.process_time() - cpu_start
        state.history.append(metrics)
        state.trajectory.extend(rows)
        save_checkpoint(checkpoint, _checkpoint_state(config, task, state), best,
                        root / ARTIFACTS if artifacts else None)
        if reporter is not None:
            reporter(EpochReport(epoch + 1, dict(metrics), tuple(rows), checkpoint, artifacts, final,
                                 steps))
    return _result(state, task, checkpoint)


def _checkpoint_state(config: ExperimentConfig, task: Task, state: LoopState) -> dict[str, Any]:
    return {"config": to_flat(config), "task": task.state_dict(), "loop": asdict(state),
            "rng": rng_state()}


def _resume(
    config: ExperimentConfig, task: Task, directory: Path
) -> tuple[LoopState, dict[str, torch.Tensor] | None]:
    """Restore the task and the RNGs; the loop's state and the best weights so far."""
    try:
        found, saved, best = load_checkpoint(directory)
    except FileNotFoundError:
        raise ConfigError(f"{directory}: no checkpoint to resume from") from None
    if saved["config"] != to_flat(config):
        diff = sorted(k for k, v in to_flat(config).items() if saved["config"].get(k) != v)
        raise ConfigError(f"{found} was written with another config (differs in {', '.join(diff)})")
    try:
        task.load_state_dict(saved["task"])
    except RuntimeError as exc:  # the same config, other modules: written by another code version
        keys = re.findall(r'"([^"]+)"', str(exc))
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        raise ConfigError(f"{found} does not fit this version of the model (keys {shown}); it was "
                          "written by another version of the code: start the study afresh") from None
    set_rng_state(saved["rng"])
    return LoopState(**saved["loop"]), best


@contextmanager
def _best_weights(task: Task, best: dict[str, torch.Tensor] | None):
    """Within the block the task holds the best-validation weights; the live ones after it."""
    if best is None:
        yield
        return
    live = task.model_state()
    task.load_model_state(best)
    try:
        yield
    finally:
        task.load_model_state(live)


def _result(state: LoopState, task: Task, checkpoint: Path) -> FitResult:
    best_val = next((h for h in state.history if h["epoch"] == state.best_epoch), {})
    last = state.history[-1] if state.history else {}
    test = {k[5:]: v for k, v in last.items() if k.startswith("test_")} or None
    return FitResult(
        best_epoch=state.best_epoch,
        best_val={k[4:]: v for k, v in best_val.items() if k.startswith("val_")},
        test=test, history=state.history, trajectory=state.trajectory, checkpoint_dir=checkpoint,
    )


# -- analyses ---------------------------------------------------------------------------------


def build_analyses(config: ExperimentConfig, task: Task) -> dict[str, Analysis]:
    """The analyses of ``eval.analyses``, each checked against the task and its data now."""
    names = split_list(config.eval.analyses)
    if not names:
        return {}
    check_analyses(config)  # what the platform checked when it planned the study
    context = TaskContext.of(config.task.name, config, task.capabilities())
    return {name: build_analysis(name, context) for name in names}


def _run_analyses(analyses: dict[str, Analysis], out: Path) -> tuple[dict[str, float], tuple[str, ...]]:
    """Run every analysis on the task's current (best) weights; its files go to ``out``."""
    metrics: dict[str, float] = {}
    for name, run in analyses.items():
        start = time.perf_counter()
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        metrics.update(run(folder))
        log.info("analysis %s: %.1f s", name, time.perf_counter() - start)
    files = tuple(sorted(str(p.relative_to(out.parent)) for p in out.rglob("*") if p.is_file()))
    return metrics, files


def load_run(checkpoint_dir: Path | str, *, workspace: Workspace | Path | str | None = None) -> Task:
    """:func:`load_trained` with the configuration the checkpoint was written with."""
    try:
        _, state, _ = load_checkpoint(checkpoint_dir)
    except FileNotFoundError:
        raise ConfigError(f"{checkpoint_dir}: no checkpoint") from None
    return load_trained(from_flat(state["config"]), checkpoint_dir, workspace=workspace)


def load_trained(
    config: ExperimentConfig, checkpoint_dir: Path | str, *,
    workspace: Workspace | Path | str | None = None, best: bool = True,
) -> Task:
    """The task of a finished (or interrupted) run, holding its best-validation weights by default,
    in evaluation mode: for analyses of a trained model (embeddings, probes, COCOS, ensembles)."""
    device = resolve_device(config.train.device)
    seed_everything(config.train.seed)
    task = build_task(config, _workspace(workspace), device)
    _, weights = _resume(config, task, Path(checkpoint_dir))
    if best and weights is not None:
        task.load_model_state(weights)
    task.eval()
    return task
