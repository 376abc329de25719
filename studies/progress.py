"""The driver's status line: where a Tune run stands, every 30 seconds and at each trial's end.

    search lagrangian: 3 done, 2 running, 3 left; best val_rsum 188.2 (lagrangian eta=0.237);
    5m12s elapsed, about 6m40s left

A trial whose steps were to be captured as CUDA graphs and fell back to eager ones (a failed
capture, too many shapes: several times slower) is named in the line, with the reason.

:class:`Progress` keeps the counts, the best score and the measured epoch times of one Tune run
(a condition's search, or the confirmation) and writes the line; it knows nothing of Ray (the
Tune callback that feeds it is :class:`studies.tuning.ProgressCallback`).

The estimate of the rest is the epochs still to train times the measured epoch time (Tune's
``time_this_iter_s``: training, validation and reporting), divided by the trials that run at
once; a running trial's epoch under way counts as done for the time since its last report (or
its start), up to one epoch, so that the estimate falls while a long epoch trains. It assumes
that a running trial trains to the full budget and that a trial not yet started trains as many
epochs as the trials finished so far in this run did on average (the full budget until one has
finished, and in a confirmation, where nothing stops early). ASHA decides at run
time how far a trial goes, so during a search the estimate moves; it is an upper bound while no
trial has finished.

A trial that has waited to start for longer than :data:`WAIT_NAMED_S` is named at the end of the
line with what it waits for (:func:`describe_wait`): the resources each trial asks, what the
cluster has and has free, and the nodes its autoscaler is adding, e.g.

    search lagrangian: 0 done, 0 running, 2 left; 4m30s elapsed, the rest estimated after the
    first epoch; waiting 4m30s: trial 1b2c3_00000 [lagrangian eta=0.112], trial 1b2c3_00001
    [lagrangian eta=0.25] for CPU 1, GPU 1 each; the cluster has CPU 2 (2 free), GPU 0; its
    autoscaler is adding worker_gpu x2

(a study that cannot place its trials otherwise waits in silence: Tune's own warning is muted).

A confirmation runs every condition's seeds in one Tune run, and conditions can differ in speed
many times over (a TERN epoch of ltd_architectures is about 5 VSRN ones): each condition's
trials are timed by that condition's own epochs (by the run's mean until one of them has
reported), and its trials not yet started are counted from its own planned number.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DONE, RUNNING, WAITING = "done", "running", "waiting"
INTERVAL_S = 30.0  # the longest time between two status lines
# A trial that waited to start this long is named in the status line: an autoscaler adds a cloud
# GPU node in a few minutes, so a longer wait is one a person wants explained.
WAIT_NAMED_S = 180.0
NAMED_AT_MOST = 3  # waiting trials named in one line; the rest are counted


def say_now(line: str) -> None:
    """Print a line at once, also when stdout is a pipe (``make study | tee log``)."""
    print(line, flush=True)


@dataclass(frozen=True)
class ProgressOptions:
    """How a driver shows its progress.

    Attributes:
        interval: seconds between two status lines at most (a line comes at each trial's end too).
        say: where lines go.
        clock: seconds (monotonic); tests pass a fake one.
        bar: a tqdm bar instead of status lines; ``None``: when stderr is a terminal.
        named_after: seconds a trial waits to start before the line names it (tests: less).
    """

    interval: float = INTERVAL_S
    say: Callable[[str], None] = say_now
    clock: Callable[[], float] = time.monotonic
    bar: bool | None = None
    named_after: float = WAIT_NAMED_S  # seconds a trial waits to start before it is named

    def use_bar(self) -> bool:
        return self.bar if self.bar is not None else sys.stderr.isatty()


@dataclass(frozen=True)
class TrialView:
    """What the line needs of one trial: its state and how many epochs it reported."""

    trial_id: str
    state: str  # DONE, RUNNING or WAITING (created, not started)
    epochs: int = 0
    group: str = ""  # its condition, where a run mixes conditions (Progress.groups)
    label: str = ""  # how a person knows it (studies.trials.trial_label), named while it waits


@dataclass
class Progress:
    """The status of one Tune run (see the module docstring).

    Args:
        title: what runs, e.g. ``search lagrangian`` or ``confirm``.
        expected: trials the run will have in all.
        max_epochs: the full budget of a trial.
        metric, mode: the score shown as the best so far (``max`` or ``min``).
        slots: trials that run at once.
        clock: seconds (monotonic); tests pass a fake one.
        groups: the planned trials of each condition, where one run mixes conditions (a
            confirmation); empty: one group of ``expected`` trials.
        named_after: seconds a trial waits to start before the line names it.
    """

    title: str
    expected: int
    max_epochs: int
    metric: str
    mode: str = "max"
    slots: int = 1
    clock: Callable[[], float] = time.monotonic
    groups: Mapping[str, int] = field(default_factory=dict)
    named_after: float = WAIT_NAMED_S
    started: float = field(init=False)
    waiting_since: dict[str, float] = field(default_factory=dict, init=False)  # first seen waiting
    last_seen: dict[str, float] = field(default_factory=dict, init=False)  # report or start
    latest: dict[str, tuple[float, str]] = field(default_factory=dict, init=False)
    epoch_seconds: dict[str, list[float]] = field(default_factory=dict, init=False)
    finished_epochs: list[int] = field(default_factory=list, init=False)
    fell_back: dict[str, tuple[str, str]] = field(default_factory=dict, init=False)  # name, reason

    def __post_init__(self) -> None:
        self.started = self.clock()

    def on_result(self, trial_id: str, result: Mapping[str, Any], values: str,
                  group: str = "") -> None:
        """A reported epoch: its time, and the trial's score now (``values``: the trial's name,
        :func:`studies.trials.run_name`, shown beside the best score; ``group``: its condition)."""
        self.last_seen[trial_id] = self.clock()
        seconds = result.get("time_this_iter_s", result.get("epoch_time_s"))
        if isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0:
            self.epoch_seconds.setdefault(group, []).append(float(seconds))
        steps = result.get("steps")  # how its steps ran (studies.trainable.tune_record)
        if isinstance(steps, Mapping) and steps.get("fell_back"):
            self.fell_back[trial_id] = (values or trial_id, str(steps.get("reason", "")))
        self.on_score(trial_id, result, values)

    def on_score(self, trial_id: str, result: Mapping[str, Any], values: str) -> None:
        """A trial's latest score (e.g. a restored trial's last result)."""
        score = result.get(self.metric)
        if isinstance(score, int | float) and math.isfinite(score):
            self.latest[trial_id] = (float(score), values)

    @property
    def best(self) -> tuple[float, str] | None:
        """The best of the trials' latest scores, with its values: the score a trial is judged
        on (select.py takes it at the end of the full budget), as the trial lines show it."""
        if not self.latest:
            return None
        sign = 1.0 if self.mode == "max" else -1.0
        return max(self.latest.values(), key=lambda pair: sign * pair[0])

    def on_start(self, trial_id: str) -> None:
        """A trial started (or resumed): its first epoch under way is timed from now."""
        self.last_seen[trial_id] = self.clock()

    def on_trial_end(self, epochs: int) -> None:
        """A trial of this run ended after ``epochs`` epochs (finished, stopped or failed)."""
        self.finished_epochs.append(epochs)

    def line(self, trials: Iterable[TrialView], waits_for: Callable[[], str] | None = None) -> str:
        """The status line; ``waits_for()`` says what a trial that waits to start waits for
        (asked only when one has waited :attr:`named_after` seconds)."""
        trials = list(trials)
        done = sum(t.state == DONE for t in trials)
        running = [t for t in trials if t.state == RUNNING]
        left = max(0, self.expected - done - len(running))
        parts = [f"{done} done, {len(running)} running, {left} left"]
        if self.best is not None:
            parts.append(f"best {self.metric} {self.best[0]:.1f}"
                         + (f" ({self.best[1]})" if self.best[1] else ""))
        if self.fell_back:
            named = [f"{name} ({reason[:80]})" for name, reason in self.fell_back.values()]
            more = f" and {len(named) - 2} more" if len(named) > 2 else ""
            parts.append("eager steps, not CUDA graphs: " + ", ".join(named[:2]) + more)
        now = self.clock()
        elapsed = f"{_duration(now - self.started)} elapsed"
        rest = self.seconds_left(trials)
        if rest is None:
            elapsed += ", the rest estimated after the first epoch"
        elif left or running:
            elapsed += f", about {_duration(rest)} left" if rest >= 1 else ", finishing"
        parts.append(elapsed)
        waiting = self.long_waiting(trials, now)
        if waiting:
            parts.append(self._waiting(waiting, now, waits_for))
        return f"{self.title}: " + "; ".join(parts)

    def _waiting(self, waiting: Sequence[TrialView], now: float,
                 waits_for: Callable[[], str] | None) -> str:
        """``waiting 4m30s: trial ..., trial ... for ...``: the longest wait, the trials."""
        longest = now - self.waiting_since[waiting[0].trial_id]
        named = ", ".join(t.label or f"trial {t.trial_id}" for t in waiting[:NAMED_AT_MOST])
        more = len(waiting) - NAMED_AT_MOST
        named += f" and {more} more" if more > 0 else ""
        why = waits_for() if waits_for is not None else ""
        return f"waiting {_duration(longest)}: {named}" + (f" for {why}" if why else "")

    def long_waiting(self, trials: Sequence[TrialView], now: float) -> list[TrialView]:
        """The trials that have waited to start for :attr:`named_after` seconds or more at
        ``now``, longest first; a trial is timed from the first line that saw it waiting."""
        for t in trials:
            if t.state == WAITING:
                self.waiting_since.setdefault(t.trial_id, now)
            else:
                self.waiting_since.pop(t.trial_id, None)
        waiting = [t for t in trials if t.state == WAITING
                   and now - self.waiting_since[t.trial_id] >= self.named_after]
        return sorted(waiting, key=lambda t: self.waiting_since[t.trial_id])

    def seconds_left(self, trials: Sequence[TrialView]) -> float | None:
        """The estimate of the rest (module docstring); None before an epoch was measured."""
        measured = [s for times in self.epoch_seconds.values() for s in times]
        length = (sum(self.finished_epochs) / len(self.finished_epochs)
                  if self.finished_epochs else self.max_epochs)
        to_come: list[float] = []  # the seconds of each trial not started
        running_left: list[float] = []  # the seconds each running trial has left
        now = self.clock()
        for group, planned in (self.groups or {"": self.expected}).items():
            own = [t for t in trials if not self.groups or t.group == group]
            running = [t for t in own if t.state == RUNNING]
            left = max(0, planned - sum(t.state == DONE for t in own) - len(running))
            if not running and not left:
                continue
            if not measured:
                return None
            times = self.epoch_seconds.get(group) if self.groups else measured
            epoch = sum(times or measured) / len(times or measured)
            running_left += [max(0.0, max(0, self.max_epochs - t.epochs) * epoch
                                 - min(epoch, now - self.last_seen.get(t.trial_id, now)))
                             for t in running]
            to_come += [length * epoch] * left
        work = sum(running_left) + sum(to_come)
        parallel = max(1, min(self.slots, len(running_left) + len(to_come)))
        return max(work / parallel, max(running_left, default=0.0))


def describe_wait(asked: Mapping[str, float], total: Mapping[str, float],
                  free: Mapping[str, float], adding: Sequence[str] | None) -> str:
    """What waiting trials wait for, in words: the resources each asks, what the cluster has of
    those (``total``) and has free, and the nodes its autoscaler is adding (node types, one
    entry a node; ``None``: no autoscaler reports, the cluster cannot grow), e.g. "CPU 1, GPU 1
    each; the cluster has CPU 2 (2 free), GPU 0; its autoscaler is adding worker_gpu x2"."""
    names = [name for name, amount in sorted(asked.items()) if amount]
    each = ", ".join(f"{name} {_amount(asked[name])}" for name in names)
    has = ", ".join(f"{name} {_amount(total.get(name, 0))}"
                    + (f" ({_amount(free.get(name, 0))} free)" if total.get(name, 0) else "")
                    for name in names)
    if adding is None:
        growth = "no autoscaler adds nodes to it"
    elif not adding:
        growth = "its autoscaler is adding no node"
    else:
        counts = {kind: adding.count(kind) for kind in dict.fromkeys(adding)}
        growth = "its autoscaler is adding " + ", ".join(f"{k} x{n}" for k, n in counts.items())
    return f"{each} each; the cluster has {has}; {growth}"


def _amount(value: float) -> str:
    return f"{value:g}"


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
