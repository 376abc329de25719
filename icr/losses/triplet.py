"""Hinge triplet losses over in-batch negatives: hardest negative (VSE++) and all negatives."""

from __future__ import annotations

from torch import Tensor

from icr.losses.contrastive import LOSSES, negative_mask


def _hinge_costs(sims: Tensor, image_ids: Tensor | None, margin: float) -> tuple[Tensor, Tensor]:
    """Hinge ``[margin + s_neg - s_pos]_+`` per (query, negative), zero where not a negative.

    Returns ``(cost_i2t, cost_t2i)``: ``cost_i2t[i, j]`` for image query ``i`` and negative caption
    ``j``; ``cost_t2i[i, j]`` for caption query ``j`` and negative image ``i``.
    """
    positives = sims.diagonal()  # (B,)
    negatives = negative_mask(sims, image_ids)  # (B, B)
    cost_i2t = (margin + sims - positives[:, None]).clamp(min=0)  # (B, B) row query
    cost_t2i = (margin + sims - positives[None, :]).clamp(min=0)  # (B, B) column query
    return cost_i2t.masked_fill(~negatives, 0.0), cost_t2i.masked_fill(~negatives, 0.0)


# VSE-infinity's training (and VSE+2AD's, which builds on it) starts with the sum over all
# negatives for ``vse_mean_warmup_epochs`` (1) before the hardest negative: from a random start
# the hardest-negative loss alone can collapse every embedding to one point, where each hinge
# is the margin and the loss is 2 B alpha (measured on the embedded benchmark, docs/results.md).
@LOSSES.register("triplet", reads=("loss.warmup_epochs",), warmup="triplet_all")
def triplet_loss(sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2) -> Tensor:
    """VSE++ max-violation triplet loss: the hardest in-batch negative per query.

    ``sum_i max_j [m + s(i, c_j) - s(i, c_i)]_+ + sum_j max_i [m + s(i_i, c_j) - s(i_j, c_j)]_+``
    over negatives only: summed over the batch (not averaged) and over both directions. A query
    whose batch holds no negative contributes 0.

    Args:
        sims: image-caption similarities, positives on the diagonal.
        image_ids: dataset image id of each pair, or ``None`` when all images differ.
        margin: hinge margin (0.2).

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns a scalar.

    References:
        Faghri et al., "VSE++", 2018, Eq. 5 (max of hinges); used as L_con in Table 2 of the LTD
        paper (experiments 3.*).
    """
    cost_i2t, cost_t2i = _hinge_costs(sims, image_ids, margin)
    return cost_i2t.max(dim=1).values.sum() + cost_t2i.max(dim=0).values.sum()


@LOSSES.register("triplet_all")
def triplet_all_loss(
    sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2
) -> Tensor:
    """Triplet loss summed over all in-batch negatives, both directions, summed over the batch.

    Args:
        sims: image-caption similarities, positives on the diagonal.
        image_ids: dataset image id of each pair, or ``None`` when all images differ.
        margin: hinge margin (0.2).

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns a scalar.

    References:
        Faghri et al., "VSE++", 2018, Eq. 4 (sum of hinges); "Triplet (all)" of the
        metric-learning-losses study.
    """
    cost_i2t, cost_t2i = _hinge_costs(sims, image_ids, margin)
    return cost_i2t.sum() + cost_t2i.sum()
