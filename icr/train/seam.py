"""The seam between the research library and the platform: what ``fit`` hands out.

``fit(config, reporter, resume_from)`` calls ``reporter(record)`` once per epoch with one
:class:`EpochReport`; nothing else of a run crosses to the platform (it never reads icr's files).
The debug mode passes a reporter that prints and stores; the Ray trainable one that forwards the
record to ``ray.tune.report`` with the checkpoint. The one loop keeps it for every task (retrieval,
grounding), and one conformance test holds the real ``fit`` and the platform's fake to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TrajectoryRow = dict[str, float]  # {"step": global step, "epoch": 1-based, "loss": ..., ...}

CAPTURED, EAGER, PARTLY_EAGER = "captured", "eager", "partly eager"


@dataclass(frozen=True)
class StepModes:
    """How a run's training steps ran: replays of CUDA graphs or eager calls
    (:class:`icr.train.graphs.GraphedStep`).

    Attributes:
        mode: ``captured`` (every step a replay, but the few eager warm-up steps of each new
            shape), ``eager`` (no step is captured) or ``partly eager`` (the shapes beyond the
            graphs kept run eagerly); the run's state after the epoch.
        captured: steps of the epoch replayed from a graph.
        eager: steps of the epoch run eagerly (warm-up steps of a new shape included).
        shapes: the input shapes of the graphs captured so far (``tokens 128x16``: the inputs
            whose shape tells the graphs apart).
        reason: why steps run eagerly: ``no CUDA``, ``train.cuda_graphs=false``, ``float16 with
            loss scaling``, ``warm-up: ...`` (no shape has had its eager warm-up steps yet: a
            run of a few steps), or a fallback's cause (a failed capture's error, too many
            shapes); empty when every step is captured.
        fell_back: the steps were to be captured and some are not (a failed capture, too many
            shapes): the run is slower than its configuration promised.
    """

    mode: str
    captured: int = 0
    eager: int = 0
    shapes: tuple[str, ...] = ()
    reason: str = ""
    fell_back: bool = False


@dataclass(frozen=True)
class EpochReport:
    """One epoch of a run, as the platform records it.

    Attributes:
        epoch: 1-based epoch just finished.
        metrics: ``epoch``, ``train_*`` (means over the epoch), ``val_*``, ``best_val_<m>`` and
            ``best_epoch`` (the best epoch so far by the task's selection metric ``m``), ``lr``,
            ``epoch_time_s`` (wall seconds of the epoch: training, validation and, last, the test
            and analyses) and ``epoch_cpu_s`` (the process's CPU seconds over the same span),
            the objective's state (``lambda``); on the last epoch ``test_*`` (when ``eval.test``) and
            the analyses' numbers (``probe/...``, ``cocos/...``).
        trajectory: the per-step rows recorded since the previous report (every
            ``train.trajectory_every`` steps): ``step``, ``epoch`` and the loss terms the
            objective and the loss log (``loss``, ``L_con``, ``L_rec``, ``lambda``, ``K``, ...);
            a row holds only the terms that exist (no NaN placeholders).
        checkpoint: the folder of the checkpoint written after this epoch (overwritten by the
            next epoch's), or ``None``.
        artifacts: files inside ``checkpoint`` (relative paths) that the run's analyses wrote and
            the platform should keep with the run (tables, figures).
        final: this is the run's last epoch.
        steps: how the epoch's training steps ran (``None``: a task that does not say).
    """

    epoch: int
    metrics: dict[str, float]
    trajectory: tuple[TrajectoryRow, ...] = ()
    checkpoint: Path | None = None
    artifacts: tuple[str, ...] = ()
    final: bool = False
    steps: StepModes | None = None


Reporter = Callable[[EpochReport], None]


@dataclass
class FitResult:
    """What ``fit`` returns once the run is over."""

    best_epoch: int  # 1-based epoch of the best validation score
    best_val: dict[str, float]
    test: dict[str, float] | None
    history: list[dict[str, float]] = field(repr=False)
    trajectory: list[TrajectoryRow] = field(repr=False)
    checkpoint_dir: Path
