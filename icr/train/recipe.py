"""The pieces of the papers' training recipes that are pure functions of the step, and the optimisers.

LTD paper Section 4.3: a warm-up phase with the backbone and word embeddings frozen, then a
fine-tune phase with everything trained at ``lr x finetune_lr_factor``; a cosine schedule inside
each phase (the reference stepped its fine-tune scheduler with the absolute epoch, so the lr climbed
back from 0 to the warm-up lr: not copied); per-epoch SWA over snapshots of the epoch's last part;
AdamP (Heo et al., ICLR 2021), the optimiser of the LTD reference code (via PCME; here
:mod:`icr.train.adamp`).

The metric-learning paper (VSE++ and VSRN, Sec. 4) and VSE+2AD (Sec. 4.1: "a decaying factor of 10%
for every 15 epochs") step the lr instead: ``x gamma`` every ``step_epochs`` epochs of the run
(:func:`step_factor`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from icr.errors import ConfigError
from icr.train.adamp import AdamP

OPTIMIZERS = ("adam", "adamw", "adamp")
SCHEDULES = ("cosine", "step")


def build_optimizer(name: str, params: Iterable[Any], lr: float, weight_decay: float,
                    device: torch.device | None = None, capturable: bool = False
                    ) -> torch.optim.Optimizer:
    """``adam`` / ``adamw`` (torch; fused kernels on CUDA) or ``adamp`` (:mod:`icr.train.adamp`,
    the update of its authors' package without a host sync per parameter).

    ``capturable``: the step can be captured as a CUDA graph (:mod:`icr.train.graphs`): step
    counts on the device, and every group's learning rate a tensor on ``device`` that the
    schedule fills in place, so a replay reads the current rate.
    """
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={name!r} is unknown; valid: {', '.join(OPTIMIZERS)}")
    groups = list(params)
    if capturable:
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        groups = [{**g, "lr": torch.tensor(float(g.get("lr", lr)), device=device)} for g in groups]
    if name == "adamp":
        return AdamP(groups, lr=lr, weight_decay=weight_decay, capturable=capturable)
    cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    fused = device is not None and device.type == "cuda"
    return cls(groups, lr=lr, weight_decay=weight_decay, fused=fused or None,
               capturable=capturable)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` as this run built the optimiser: each group keeps its
    own ``capturable`` and ``fused`` (``load_state_dict`` takes the checkpoint's, which a run on
    another device wrote), a capturable or fused group's step counts become float32 tensors on
    their parameters' devices, and a ``capturable`` group's learning-rate tensor stays where it is
    with the saved value: a captured step reads those tensors' memory, and a count left a Python
    number would be frozen into the graph."""
    own = [{k: group[k] for k in ("capturable", "fused") if k in group}
           for group in optimizer.param_groups]
    kept = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags, lr in zip(optimizer.param_groups, own, kept, strict=True):
        group.update(flags)
        if isinstance(lr, torch.Tensor):
            lr.copy_(torch.as_tensor(group["lr"]))
            group["lr"] = lr
        if flags.get("capturable") or flags.get("fused"):
            for p in group["params"]:
                counts = optimizer.state.get(p, {})
                if "step" in counts:
                    counts["step"] = torch.as_tensor(counts["step"], dtype=torch.float32
                                                     ).to(p.device)


def schedule_factor(
    step: int, steps_per_epoch: int, warmup_epochs: int, finetune_epochs: int,
    finetune_factor: float, schedule: str = "cosine", step_epochs: int = 15, gamma: float = 0.1,
) -> float:
    """Multiplier of the base lr at optimiser step ``step`` for ``schedule`` (module docstring):
    :func:`lr_factor` (``cosine``) or :func:`step_factor` (``step``)."""
    if schedule == "cosine":
        return lr_factor(step, steps_per_epoch, warmup_epochs, finetune_epochs, finetune_factor)
    if schedule == "step":
        return step_factor(step, steps_per_epoch, warmup_epochs, finetune_factor, step_epochs,
                           gamma)
    raise ConfigError(f"optim.schedule={schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")


def step_factor(step: int, steps_per_epoch: int, warmup_epochs: int, finetune_factor: float,
                step_epochs: int, gamma: float) -> float:
    """``gamma ** (epoch // step_epochs)``, epochs counted over the whole run; times
    ``finetune_factor`` in the fine-tune phase (after ``warmup_epochs``)."""
    epoch = step // max(steps_per_epoch, 1)
    phase = finetune_factor if epoch >= warmup_epochs else 1.0
    return phase * gamma ** (epoch // step_epochs)


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
