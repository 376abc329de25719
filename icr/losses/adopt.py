"""AdOpt: InfoNCE over the K hardest in-batch negatives, K set by the batch's alignment and
uniformity (the adaptive objective of VSE+2AD)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from icr.losses.contrastive import LOSSES, LossOutput, negative_mask

ADOPT_POWER = 1.25  # exponent of (align + uniform) in the reference code (its ``scale``)


def adopt_k_tensor(align: Tensor, uniform: Tensor, batch: int) -> Tensor:
    """The number of negatives AdOpt uses, ``clip(int(cos((align + uniform)^1.25) * B) + 1, 1, B - 1)``,
    on the device: ``align`` and ``uniform`` are never read on the host (which would wait for the
    GPU at every step). Returns a 0-d int64 tensor; ``tests/test_adopt.py`` holds it equal to the
    formula computed in Python floats over the whole range.

    Early in training (align small, uniform near 1) K is about half the batch; as positives align
    the cosine falls and K goes down to 1.

    Deliberate choices where the reference formula is undefined or folds back:

    - a negative ``align + uniform`` (possible when positives anti-align) is clamped to 0 before
      the power (the reference's ``numpy`` power gives NaN there and ``int(NaN)`` raises), giving
      the largest K, ``B - 1``; a non-finite sum (NaN similarities) gives ``B - 1`` too;
    - the cosine's argument is clamped to ``[0, pi/2]``, so K never grows again as the argument
      passes ``3 pi / 2`` (reachable only by degenerate batches). Between ``pi/2`` and ``3 pi/2``
      this changes nothing: the reference's negative cosine gives K = 1, and so does cos(pi/2).

    A batch of one holds no negative: K = 0.

    Args:
        align: mean cosine of the positive pairs, 0-d.
        uniform: the code's uniformity, 0-d, see :func:`adopt_loss`.
        batch: B, the number of pairs in the batch.

    References:
        VSE+2AD paper, Section 3.3, Eq. 6, with the exponent 1.25 and ``int(.) + 1`` of the
        reference code (vse_2ad ``losses.py``) in place of the paper's ``pi / 4`` scaling and
        rounding.
    """
    total = align.double() + uniform.double()  # () as Python adds the two floats
    total = torch.where(torch.isfinite(total), total.clamp(min=0.0), torch.zeros_like(total))
    angle = (total**ADOPT_POWER).clamp(max=math.pi / 2)
    k = torch.trunc(torch.cos(angle) * batch).long() + 1  # int() truncates toward 0
    return k.clamp(1, max(batch - 1, 1)) if batch > 1 else torch.zeros_like(k)


def _hardest_k_cross_entropy(
    scores: Tensor, negatives: Tensor, k: Tensor, margin: float, tau: float
) -> Tensor:
    """Mean over query rows of CE over ``[positive, K hardest negatives + margin] / tau``.

    The negatives are sorted and all but the first ``k`` masked with -inf, so ``k`` can stay on
    the device (a ``topk`` needs it on the host); -inf entries weigh nothing in the softmax.

    Shapes:
        scores: ``(B, B)`` query rows, positives on the diagonal; negatives: ``(B, B)`` bool;
        k: 0-d int64.
    """
    positive = scores.diagonal()[:, None]  # (B, 1)
    # -inf, not 0 as in the reference, so a positive or a same-image pair is never chosen as a
    # "negative"; a query with fewer than K negatives picks -inf entries, which weigh nothing.
    candidates = scores.masked_fill(~negatives, float("-inf"))  # (B, B)
    ranked = candidates.sort(dim=1, descending=True).values  # (B, B)
    rank = torch.arange(ranked.shape[1], device=scores.device)[None, :]  # (1, B)
    hardest = ranked.masked_fill(rank >= k, float("-inf"))  # (B, B): the K hardest kept
    logits = torch.cat([positive, hardest + margin], dim=1) / tau  # (B, 1 + B)
    targets = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)  # (B,)
    return F.cross_entropy(logits, targets)


@LOSSES.register("adopt")
def adopt_loss(
    sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2, tau: float = 0.05
) -> LossOutput:
    """AdOpt: per query, cross-entropy over its positive and its K hardest negatives.

    1. ``align`` = mean of the positive similarities; ``uniform`` = mean of ``exp(-s)`` over the
       ``B x B`` similarity matrix with its diagonal set to 0 (so each diagonal entry adds
       ``exp(0) = 1``). This is the reference code's uniformity; the paper writes
       ``log E[exp(sim)]`` over all pairs instead: the code's is implemented here, because the
       published numbers and the K trajectory (about B/2 early, falling to 1) come from it.
       Both are computed without gradient, over the whole matrix, so K is the same in both
       directions.
    2. ``K = adopt_k_tensor(align, uniform, B)`` (Eq. 6 as in the code, see
       :func:`adopt_k_tensor`), computed on the device.
    3. For each image query (rows) and each caption query (columns), the K negatives of highest
       similarity; ``margin`` is added to their similarities; the loss is the cross-entropy of
       the positive among ``[positive, negatives] / tau``, averaged over queries, and the two
       directions are averaged.

    Same-image pairs (``image_ids``) are neither positives nor negatives. Deliberate difference
    from the reference code (vse_2ad ``losses.py``, ``ADCTO``): it fills the diagonal with 0
    before choosing the hardest negatives, so a positive of similarity above the K-th negative's
    is taken as a negative of itself; here positives and same-image pairs are masked with -inf.

    Args:
        sims: image-caption similarities (cosines), positives on the diagonal.
        image_ids: dataset image id of each pair, or ``None`` when all images differ.
        margin: added to the negatives' similarities (0.2).
        tau: temperature (0.05).

    Returns:
        The loss and, in ``logs``, ``K`` (the number of negatives used), ``align`` and
        ``uniform``, detached.

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; the loss is a scalar.

    References:
        Zhang et al., "Improving Visual-Semantic Embedding with Adaptive Pooling and Optimization
        Objective" (VSE+2AD), Section 3.3 (alignment, uniformity, Eq. 6 and the InfoNCE over K
        negatives); Wang & Isola, ICML 2020, for alignment and uniformity.
    """
    negatives = negative_mask(sims, image_ids)  # (B, B)
    batch = sims.shape[0]
    with torch.no_grad():
        align = sims.diagonal().mean()
        eye = torch.eye(batch, dtype=torch.bool, device=sims.device)  # (B, B)
        uniform = torch.exp(-sims.masked_fill(eye, 0.0)).mean()
    k = adopt_k_tensor(align, uniform, batch)  # ()
    i2t = _hardest_k_cross_entropy(sims, negatives, k, margin, tau)  # image queries: rows
    t2i = _hardest_k_cross_entropy(sims.t(), negatives.t(), k, margin, tau)  # caption queries
    logs = {"K": k.float(), "align": align, "uniform": uniform}
    return LossOutput(0.5 * (i2t + t2i), logs)
