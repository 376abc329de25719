"""What a contrastive loss is in this project: its call signature, the registry and the negative mask.

Every contrastive loss is a function ``loss(sims, image_ids=None, **options) -> scalar`` where
``sims[i, j]`` is the similarity of image ``i`` and caption ``j`` of a batch of ``B`` image-caption
pairs, so the matching pairs sit on the diagonal. ``image_ids[i]`` is the dataset id of the image of
pair ``i``: when two pairs share an image (two of its captions drawn into one batch), the
off-diagonal entries between them are not negatives and are masked out of every loss.

The losses themselves live one per module (:mod:`icr.losses.infonce`, :mod:`icr.losses.triplet`)
and register here by name; :func:`build_loss` binds a name and its options into a callable and
:func:`loss_from_config` does the same from a config section (``name`` plus option fields).
:func:`config_options` is the one reader of a loss's options from the config: the loss, its
warm-up form and its COCOS counters (:mod:`icr.analysis.cocos`) all take what it gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from icr.config import LossConfig
from icr.errors import ConfigError
from icr.registry import Registry


class ContrastiveLoss(Protocol):
    def __call__(self, sims: Tensor, image_ids: Tensor | None = None) -> Tensor | LossOutput: ...


@dataclass(frozen=True)
class LossOutput:
    """A loss with scalars to log beside it, for losses that have more to say than their value.

    ``logs`` holds detached 0-d tensors (e.g. ``K``, the number of negatives AdOpt chose); the
    training loop records them in the per-step trajectory. A loss with nothing to log returns a
    plain tensor; :func:`split_output` turns either form into ``(loss, logs)``.
    """

    loss: Tensor
    logs: dict[str, Tensor] = field(default_factory=dict)


def split_output(out: Tensor | LossOutput) -> tuple[Tensor, dict[str, Tensor]]:
    """``(loss, logs)`` of a loss's return value (a tensor or a :class:`LossOutput`)."""
    if isinstance(out, LossOutput):
        return out.loss, out.logs
    return out, {}


LOSSES: Registry = Registry("contrastive loss", section=LossConfig, package="icr.losses")


def negative_mask(sims: Tensor, image_ids: Tensor | None = None) -> Tensor:
    """Which entries of a batch similarity matrix are negatives.

    Args:
        sims: image-caption similarities, positives on the diagonal.
        image_ids: dataset image id of each pair; pairs sharing an image are not negatives of
            each other. ``None`` means every pair has its own image.

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns a bool ``(B, B)``, symmetric.
    """
    if sims.dim() != 2 or sims.shape[0] != sims.shape[1]:
        raise ValueError(f"sims must be a square (B, B) matrix, got {tuple(sims.shape)}")
    batch = sims.shape[0]
    if image_ids is None:
        return ~torch.eye(batch, dtype=torch.bool, device=sims.device)  # (B, B)
    if image_ids.shape != (batch,):
        raise ValueError(f"image_ids must have shape ({batch},), got {tuple(image_ids.shape)}")
    image_ids = image_ids.to(sims.device)
    return image_ids[:, None] != image_ids[None, :]  # (B, B), diagonal False


def build_loss(name: str, **options: Any) -> ContrastiveLoss:
    """The registered loss ``name`` with its options (e.g. ``tau``, ``margin``) bound.

    Raises:
        ConfigError: unknown loss name or an option the loss does not take.
    """
    return LOSSES.bind(name, **options)


def warmup_from_config(section: LossConfig) -> ContrastiveLoss | None:
    """The loss trained in the first ``section.warmup_epochs`` epochs: the warm-up form that
    ``section.name`` was registered with (``warmup=``, e.g. the triplet loss's sum over all
    negatives), with the section's options; ``None`` without warm-up epochs.

    Raises:
        ConfigError: warm-up epochs for a loss registered without a warm-up form.
    """
    if not section.warmup_epochs:
        return None
    warmup = LOSSES.meta(section.name).get("warmup")
    if warmup is None:
        with_form = [n for n in LOSSES.names() if LOSSES.meta(n).get("warmup")]
        raise ConfigError(f"loss.warmup_epochs={section.warmup_epochs}: loss.name={section.name} "
                          f"has no warm-up form; only {', '.join(with_form)} has one (or set "
                          "loss.warmup_epochs=0)")
    return loss_from_config(replace(section, name=warmup))


def config_options(section: LossConfig) -> dict[str, Any]:
    """The options of loss ``section.name`` as the config sets them: the fields of ``section``
    that its builder takes (``tau`` for InfoNCE, ``margin`` for the triplet losses); fields the
    chosen loss does not use are left out."""
    return LOSSES.section_options(section.name, section)


def loss_from_config(section: LossConfig) -> ContrastiveLoss:
    """The loss named ``section.name`` with its options from ``section`` (:func:`config_options`)."""
    return build_loss(section.name, **config_options(section))
