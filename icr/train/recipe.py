"""The pieces of the LTD training recipe that are pure functions of the step.

LTD paper Section 4.3, REFERENCE_NOTES section 1: a warm-up phase with the backbone and word
embeddings frozen, then a fine-tune phase with everything trained at ``lr x finetune_lr_factor``;
a cosine schedule inside each phase (the reference stepped its fine-tune scheduler with the
absolute epoch, so the lr climbed back from 0 to the warm-up lr: not copied); per-epoch SWA over
snapshots of the epoch's last part.
"""

from __future__ import annotations

import math

import numpy as np


def lr_factor(
    step: int, steps_per_epoch: int, warmup_epochs: int, finetune_epochs: int, finetune_factor: float
) -> float:
    """Multiplier of the base lr at optimiser step ``step``: a cosine per phase.

    Warm-up steps go from 1 down to 0 along half a cosine; the fine-tune phase restarts at
    ``finetune_factor`` and decays the same way.
    """
    warm = warmup_epochs * steps_per_epoch
    if step < warm:
        return 0.5 * (1.0 + math.cos(math.pi * step / warm))
    tune = max(finetune_epochs * steps_per_epoch, 1)
    progress = min((step - warm) / tune, 1.0)
    return finetune_factor * 0.5 * (1.0 + math.cos(math.pi * progress))


def swa_snapshot_steps(steps: int, snapshots: int, fraction: float) -> set[int]:
    """The 0-based steps of an epoch at which SWA takes a snapshot: evenly over its last part."""
    window = max(int(round(steps * fraction)), min(snapshots, steps), 1)
    return {int(s) for s in np.linspace(steps - window, steps - 1, snapshots).round()}
