"""Symmetric InfoNCE over in-batch image-caption pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from icr.losses.contrastive import LOSSES, negative_mask


@LOSSES.register("infonce")
def infonce_loss(sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.05) -> Tensor:
    """Symmetric InfoNCE: ``0.5 * (CE_i2t + CE_t2i)`` on ``sims / tau``, each averaged over the batch.

    For an image query the candidates are its caption and the negative captions of its row; for a
    caption query, its image and the negative images of its column. Entries between pairs sharing
    an image are excluded from the denominators (they are neither positive nor negative).

    Args:
        sims: image-caption similarities (cosines of L2-normalised embeddings), positives on
            the diagonal.
        image_ids: dataset image id of each pair, or ``None`` when all images differ.
        tau: temperature (0.05 in the LTD paper, 0.1 for NT-Xent in the metric-learning study).

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns a scalar.

    References:
        Eq. 1 of the LTD paper (Bleeker et al., "Reducing Predictive Feature Suppression in
        Resource-Constrained Contrastive Image-Caption Retrieval"), applied in both directions;
        van den Oord et al., 2018.
    """
    keep = negative_mask(sims, image_ids) | torch.eye(
        sims.shape[0], dtype=torch.bool, device=sims.device
    )  # (B, B) positive or negative
    logits = (sims / tau).masked_fill(~keep, float("-inf"))  # (B, B)
    targets = torch.arange(sims.shape[0], device=sims.device)  # (B,)
    i2t = F.cross_entropy(logits, targets)  # rows: image queries
    t2i = F.cross_entropy(logits.t(), targets)  # columns: caption queries
    return 0.5 * (i2t + t2i)
