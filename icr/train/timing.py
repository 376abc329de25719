"""Timing a task's training steps, for ``--plan --calibrate`` and the benchmarks.

A step on a GPU is queued, not run (:mod:`icr.train.step_log`), so the time between two calls is
the CPU's, not the step's. :class:`StepTimer` waits for the device after each step it times, so
each interval is the step's whole cost (a little pessimistic: the CPU cannot prepare the next
step meanwhile). :func:`time_epoch` runs one epoch of a task with a timer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["EpochTiming", "StepTimer", "time_epoch"]


@dataclass
class StepTimer:
    """Records the wall time of each training step of an epoch (the device synchronised)."""

    device: torch.device
    seconds: list[float] = field(default_factory=list)
    _last: float | None = None

    def start(self) -> None:
        self._sync()
        self._last = time.perf_counter()

    def step(self) -> None:
        """After a step: the time since the previous mark."""
        self._sync()
        now = time.perf_counter()
        if self._last is not None:
            self.seconds.append(now - self._last)
        self._last = now

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass(frozen=True)
class EpochTiming:
    """One epoch's steps and what the epoch cost beyond them (its plan, SWA, BatchNorm)."""

    step_seconds: tuple[float, ...]
    epoch_seconds: float

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.epoch_seconds - sum(self.step_seconds))


def time_epoch(task: Any, epoch: int, device: torch.device) -> EpochTiming:
    """Train ``epoch`` of ``task`` (a :class:`~icr.train.tasks.Task`) and time it."""
    timer = StepTimer(device)
    start = time.perf_counter()
    timer.start()
    task.train_epoch(epoch, timer=timer)
    timer._sync()
    return EpochTiming(tuple(timer.seconds), time.perf_counter() - start)
