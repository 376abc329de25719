"""``--plan``: what a study will run and what it will cost, without running it.

Per condition: the search trials (a grid's points, else the budget), the confirmation runs, the
epochs of a trial, the optimiser steps of an epoch (from the size of the dataset's training
split, which icr reads from its files when they are present,
:func:`icr.data.datasets.training_size`; else from the sizes of the datasets the paper trained
on, :data:`REFERENCE_DATASETS`), and the local files the configuration needs (present or not).
With ``--calibrate N`` each condition trains ``N`` steps of its first epoch and of its first
fine-tune epoch on the device at hand and evaluates once on validation; from those times the
study's wall time and its device-hours follow:

    epoch time   = median step time x steps per epoch + validation and per-epoch costs
    trial epochs = search trials x E[epochs of a searched trial] + seeds x epochs
    wall time    = sum over conditions of trial epochs x epoch time / trials at once

A searched trial's expected epochs under ASHA (``grace_period`` g, ``reduction_factor`` r, max
``T`` epochs, rungs at g, g r, g r^2, ... below T) count the epochs up to the first rung for every
trial and the epochs between rung k and the next for the 1/r^(k+1) of trials promoted past it (the
asymptotic promotion rate; the first trials of a search are promoted more often, so the estimate
is a lower bound for small budgets). Without early stopping (a paper's grid) every trial trains
``T`` epochs. ``benchmarks/plan_estimate.py`` compares the estimate with a real study's
time on the embedded benchmark.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from icr.config import ExperimentConfig, from_flat, is_uri, key_specs, to_flat, used_keys
from icr.data.datasets import training_size
from icr.data.sampler import steps_per_epoch
from icr.train.loop import configure_backends, resolve_device
from icr.train.tasks import build_task
from icr.train.timing import time_epoch
from studies.catalog import Study
from studies.plan import StudyPlan
from studies.space import grid_size

# The papers' training splits (captions, images), for --plan when the files are absent: COCO
# and Flickr30K in Karpathy's splits (COCO's train with restval), Flickr30K Entities' train list
# (29,783 images, 5 captions each). Sizes as the papers and the splits' files give them.
REFERENCE_DATASETS: dict[str, tuple[str, int, int]] = {
    "coco": ("COCO (Karpathy train + restval)", 566_435, 113_287),
    "f30k": ("Flickr30K (Karpathy train)", 145_000, 29_000),
    "f30k_entities": ("Flickr30K Entities (train)", 148_915, 29_783),
}


def asha_expected_epochs(max_t: int, grace_period: int, reduction_factor: float) -> float:
    """Expected epochs of one searched trial under ASHA (see the module docstring)."""
    if max_t <= grace_period or reduction_factor <= 1:
        return float(max_t)
    rungs = []
    rung = grace_period
    while rung < max_t:
        rungs.append(rung)
        rung = int(rung * reduction_factor)
    bounds = [*rungs, max_t]
    expected = float(rungs[0])
    for k in range(len(rungs)):
        expected += (bounds[k + 1] - bounds[k]) / reduction_factor ** (k + 1)
    return expected


@dataclass(frozen=True)
class Need:
    """A local file or folder the configuration names (or a folder's URI, copied to this
    node by the data check: :mod:`icr.data.remote`)."""

    key: str
    path: str
    present: bool


@dataclass(frozen=True)
class ConditionCost:
    name: str
    search_trials: int
    epochs_per_search_trial: float  # expected, under ASHA (or the full budget)
    confirm_runs: int
    epochs: int
    warmup_epochs: int
    steps_per_epoch: int | None  # None: the dataset is not present (or not read)
    train_captions: int | None
    needs: tuple[Need, ...]
    step_s: dict[str, float] | None = None  # "warmup" / "finetune": seconds per step measured
    eval_s: float | None = None  # an epoch's validation and its costs beyond its steps, measured
    # the papers' datasets when the files are absent: (name, training captions, steps per epoch)
    reference_steps: tuple[tuple[str, int, int], ...] = ()
    # its data checked file by file: what preparation will choose; None: not checked (absent)
    data: tuple[str, ...] | None = None

    @property
    def trial_epochs(self) -> float:
        return self.search_trials * self.epochs_per_search_trial + self.confirm_runs * self.epochs

    @property
    def epoch_s(self) -> float | None:
        """Mean seconds of one epoch (training and validation), from the calibration."""
        if self.step_s is None or self.steps_per_epoch is None or self.eval_s is None:
            return None
        finetune = self.epochs - self.warmup_epochs
        per_step = (self.warmup_epochs * self.step_s["warmup"]
                    + finetune * self.step_s.get("finetune", self.step_s["warmup"])) / self.epochs
        return per_step * self.steps_per_epoch + self.eval_s

    @property
    def device_s(self) -> float | None:
        """Device seconds of every trial of the condition together."""
        epoch = self.epoch_s
        return None if epoch is None else epoch * self.trial_epochs


def needs(config: ExperimentConfig) -> tuple[Need, ...]:
    """The local paths the configuration uses (bundled assets named by their name are not)."""
    specs, flat = key_specs(), to_flat(config)
    out = []
    for key in used_keys(config):
        spec, value = specs[key], flat[key]
        if spec.path is None or value == "" or value in spec.path:
            continue
        out.append(Need(key, str(value), is_uri(value) or Path(str(value)).expanduser().exists()))
    return tuple(out)


def plan_costs(plan: StudyPlan) -> list[ConditionCost]:
    study = plan.study
    data = plan.check_data()  # every file the runs read, checked by icr (DataError: exit 2)
    out = []
    for condition in plan.conditions:
        config = condition.config
        searched = bool(condition.domains)
        trials = condition.trials(plan.budget) if searched else 0
        epochs = config.epochs
        per_trial = (asha_expected_epochs(epochs, study.grace_period, study.reduction_factor)
                     if plan.early_stopping else float(epochs))
        sizes = training_size(config, plan.workspace)
        steps = None if sizes is None else _steps(config, *sizes)
        references = () if sizes is not None else tuple(
            (REFERENCE_DATASETS[name][0], REFERENCE_DATASETS[name][1],
             _steps(config, *REFERENCE_DATASETS[name][1:]))
            for name in (plan.recipe.reference_data if plan.recipe else ()))
        out.append(ConditionCost(
            condition.name, trials, per_trial, len(plan.seeds), epochs,
            config.train.warmup_epochs, steps, None if sizes is None else sizes[0], needs(config),
            reference_steps=references, data=data.get(condition.name)))
    return out


def _steps(config: ExperimentConfig, captions: int, images: int) -> int:
    t = config.train
    steps = steps_per_epoch(captions, images, t.batch_size, t.sampler, t.epoch_unit)
    return min(steps, t.max_steps_per_epoch) if t.max_steps_per_epoch else steps


def calibrate(plan: StudyPlan, costs: list[ConditionCost], steps: int,
              say: Callable[[str], None] = print) -> list[ConditionCost]:
    """Time ``steps`` training steps of each condition (its searched keys at their midpoints) in
    its first epoch and its first fine-tune epoch, and one validation pass, on the device at hand.

    Each timed phase is an epoch cut to ``steps`` steps (``train.max_steps_per_epoch``), run once
    untimed first (lazy initialisation, caches). A step's time is the median of its steps, each
    timed to the device's end of it (:func:`icr.train.timing.time_epoch`; robust to a busy
    machine); what the epoch costs beyond its steps (its plan, SWA's swap and BatchNorm
    refresh) is counted once per epoch.
    """
    out = []
    for cost in costs:
        config = from_flat({"train.max_steps_per_epoch": steps, "eval.test": False},
                           plan.debug_config(cost.name))
        device = resolve_device(config.train.device)
        configure_backends(device, config.train.deterministic)
        say(f"calibrating {cost.name}: {steps} steps a phase on {device} ...")
        task = build_task(config, plan.workspace, device)
        phases = {"warmup": 0}
        if config.train.finetune_epochs and config.train.warmup_epochs:
            phases["finetune"] = config.train.warmup_epochs
        step_s, fixed_s = {}, []
        for phase, epoch in phases.items():
            task.train_epoch(epoch)  # untimed: lazy initialisation, caches
            timing = time_epoch(task, epoch, device)
            step_s[phase] = statistics.median(timing.step_seconds)
            fixed_s.append(timing.other_seconds)
        start = time.perf_counter()
        task.evaluate("val")
        eval_s = time.perf_counter() - start
        out.append(replace(cost, step_s=step_s, eval_s=eval_s + statistics.median(fixed_s)))
    return out


def trials_at_once(plan: StudyPlan, gpus: int | None = None) -> tuple[int, str]:
    """Trials at once, as the estimate counts them, here (or on a cluster of ``gpus`` GPUs):
    one per GPU, else one per CPU slot (:meth:`studies.connection.Cluster.concurrency`). With
    ``--trials-per-gpu N`` the study runs N per GPU, but the calibrated step is one trial's
    alone, so the estimate still counts one (N sharing a GPU train at a speed not measured)."""
    if gpus is None:
        gpus = torch.cuda.device_count()
        where = "this machine"
    else:
        where = f"a cluster of {gpus} GPU(s)"
    if gpus:
        shared = (f" (the study runs {plan.trials_per_gpu} per GPU; their shared speed is not "
                  "calibrated)" if plan.trials_per_gpu > 1 else "")
        return gpus, f"{where}: one trial per GPU{shared}"
    cpus = os.cpu_count() or 1
    slot = plan.cpus_per_trial or 1
    return max(1, cpus // slot), f"{where}: {cpus} CPUs, {slot} per trial, no GPU"


def objectives(study: Study) -> str:
    """What the search optimises, in words: the metric, and the cost when the study has one."""
    first = f"{'maximise' if study.mode == 'max' else 'minimise'} {study.metric}"
    if not study.cost:
        return first
    return (f"{first} and minimise {study.cost} (its mean over a trial's epochs): Optuna's "
            f"multi-objective TPE; ASHA stops trials on {study.metric} alone")


def describe(plan: StudyPlan, costs: list[ConditionCost], gpus: int | None = None) -> Iterator[str]:
    """The lines ``--plan`` prints."""
    recipe = plan.recipe or plan.study.recipe("embedded")
    study = plan.study
    yield f"study {study.name}, recipe {recipe.name} ({recipe.source})"
    for note in recipe.notes:
        yield f"  note: {note}"
    stopping = (f"ASHA (grace {study.grace_period}, reduction {study.reduction_factor})"
                if plan.early_stopping else "none (every trial trains its full length)")
    sampled = any(c.domains and grid_size(c.domains) is None for c in plan.conditions)
    budget = f"{plan.budget} trial(s) per searched condition; " if sampled else ""
    yield (f"search: {budget}early stopping {stopping}; confirmation: {len(plan.seeds)} seed(s) "
           f"per condition")
    yield "objectives: " + objectives(study)
    if plan.warm is not None:
        yield from plan.warm.describe()
    for missing in plan.missing():
        yield f"  missing: {missing}"
    default = to_flat(ExperimentConfig())
    shown: tuple[str, ...] | None = None  # the data lines, printed once while they repeat
    for condition, cost in zip(plan.conditions, costs, strict=True):
        flat = to_flat(condition.config)
        changed = {k: flat[k] for k in used_keys(condition.config) if flat[k] != default[k]}
        if cost.steps_per_epoch is not None:
            steps = f"{cost.steps_per_epoch:,} steps/epoch ({cost.train_captions:,} training captions)"
        elif cost.reference_steps:
            steps = "; ".join(f"{n:,} steps/epoch on {name} ({c:,} training captions)"
                              for name, c, n in cost.reference_steps) + " (files absent)"
        else:
            steps = "? steps/epoch (dataset not present)"
        search = (f"{cost.search_trials} search trial(s) x {cost.epochs_per_search_trial:.1f} "
                  f"expected epochs + " if cost.search_trials else "nothing searched; ")
        yield (f"{condition.name}: {search}{cost.confirm_runs} confirmation run(s) x {cost.epochs} "
               f"epochs = {cost.trial_epochs:.1f} trial-epochs; {steps}")
        for domain in condition.domains.values():
            yield f"  searched {domain.key}: {domain.describe()}"
        yield "  " + " ".join(f"{k}={v}" for k, v in sorted(changed.items()))
        for need in cost.needs:
            checked = (" and checked" if need.present and cost.data is not None
                       and need.key.startswith("data.") else "")
            present = "present"
            if is_uri(need.path):  # its copy's line (data:) says where it is
                present = "copied to this node" if checked else "a URI, not copied yet"
            yield (f"  needs {need.key}={need.path}: "
                   f"{present + checked if need.present else 'MISSING'}")
        if cost.data is not None and cost.data != shown:
            yield from (f"  {line}" for line in cost.data)
            shown = cost.data
        if cost.epoch_s is not None:
            phases = ", ".join(f"{p} {s * 1000:.0f} ms" for p, s in cost.step_s.items())
            yield (f"  calibrated: {phases} a step, {cost.eval_s:.1f} s an epoch beyond its steps "
                   f"(validation, SWA) -> "
                   f"{cost.epoch_s / 60:.1f} min an epoch, {cost.device_s / 3600:.2f} device-hours")
    at_once, where = trials_at_once(plan, gpus)
    device_s = [c.device_s for c in costs]
    if all(s is not None for s in device_s):
        total = sum(device_s)
        yield (f"estimate: {total / 3600:.2f} device-hours; {total / at_once / 60:.0f} min of wall "
               f"time at {at_once} trial(s) at once ({where}); data preparation not included")
    else:
        yield (f"{at_once} trial(s) at once ({where}); --calibrate N times N steps of each "
               f"condition here to estimate the wall time and device-hours")
