"""Phrase grounding metrics: Recall@k and pointing accuracy from word-region attention.

Protocol (Gupta et al., ECCV 2020, Sec. 2.5 "Attention to phrase grounding" and Sec. 3.1;
REFERENCE_NOTES.md section 4):

- The score of a region for a phrase is the max over the phrase's word pieces of their attention
  to the region (:func:`phrase_region_scores`); regions are ranked by it.
- Recall@k: a phrase is found when one of its top-k regions has IoU >= 0.5 with *any* of the
  phrase's ground-truth boxes (no union box).
- Pointing accuracy: the centre of the top-1 region lies inside any ground-truth box of the phrase.
- Phrases without a ground-truth box are skipped; all values are percentages of the counted
  phrases, and ``phrases`` is their number.

Box convention: continuous pixel coordinates ``(x0, y0, x1, y1)``, ``(x1, y1)`` one past the last
covered pixel, area ``(x1 - x0) * (y1 - y0)``, no ``+1``. The loaders
(:mod:`icr.grounding.data`) convert inclusive integer boxes to it by adding 1 to ``x1, y1``,
which gives the same IoU as the reference's "+1 pixel" areas on inclusive boxes. A point is
inside a box when ``x0 <= x <= x1`` and ``y0 <= y <= y1`` (the border counts).

Where this deliberately differs from the info-ground reference code:

- IoU >= 0.5 is decided exactly (``2 * intersection >= union``); the reference divides by
  ``union + 1e-6``, so an IoU of exactly 0.5 is a miss there.
- Padded regions are never ranked (the reference takes the top 10 and then drops padded ids, so
  a phrase can be left with fewer than k boxes).
- Ties: at equal scores, regions that are not a hit rank first (the pessimistic order of
  :mod:`icr.metrics.retrieval`), so uniform attention from a collapsed model scores 0, not the
  luck of region order.
- A phrase none of whose words has a scored piece (e.g. the tagger kept none of them) has no
  ranking and counts as a miss, not as skipped; ``unscored`` is their share.
- Pointing uses the closed box in continuous coordinates; the reference tests ``x1 < x < x2`` on
  inclusive coordinates.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "box_intersection_union",
    "box_iou",
    "grounding_hits",
    "grounding_metrics",
    "phrase_region_scores",
    "point_in_boxes",
]

KS = (1, 5, 10)
IOU_THRESHOLD = 0.5
NO_HIT = torch.iinfo(torch.int64).max  # the rank of a phrase without a hit: above every k


def _tensor(x: Tensor | np.ndarray, dtype: torch.dtype | None = None,
            device: torch.device | None = None) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))
    return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype)


def box_intersection_union(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Intersection and union areas of boxes ``a`` and ``b``, broadcast over leading dims.

    Shapes:
        a ``(..., 4)``, b ``(..., 4)`` (broadcastable) -> two ``(...)`` tensors.
    """
    width = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    height = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(
        min=0)
    inter = width * height
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    return inter, area_a + area_b - inter


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """IoU of boxes in continuous coordinates (0 when the union is empty).

    Shapes:
        a ``(..., 4)``, b ``(..., 4)`` (broadcastable) -> ``(...)``.
    """
    inter, union = box_intersection_union(a, b)
    return torch.where(union > 0, inter / union.clamp(min=torch.finfo(inter.dtype).tiny), 0.0)


def point_in_boxes(points: Tensor, boxes: Tensor) -> Tensor:
    """Whether each point lies in the closed box ``[x0, x1] x [y0, y1]``.

    Shapes:
        points ``(..., 2)``, boxes ``(..., 4)`` (broadcastable) -> ``(...)`` bool.
    """
    x, y = points[..., 0], points[..., 1]
    return (boxes[..., 0] <= x) & (x <= boxes[..., 2]) & (boxes[..., 1] <= y) & (y <= boxes[..., 3])


def phrase_region_scores(
    attention: Tensor | np.ndarray, piece_phrase: Tensor | np.ndarray, num_phrases: int
) -> Tensor:
    """Score of every region for every phrase: max over the phrase's pieces of their attention.

    Args:
        attention: each caption position's attention over its own image's regions.
        piece_phrase: the global phrase index of each position, -1 for none (padding, or a word
            outside every phrase); :meth:`icr.grounding.data.GroundingSplit.piece_phrase`.
        num_phrases: ``F``, the number of phrases.

    Shapes:
        attention ``(C, P, R)``, piece_phrase ``(C, P)`` -> ``(F, R)`` float, ``-inf`` in the
        rows of phrases that have no position.

    References:
        Sec. 2.5 of Gupta et al., ECCV 2020 ("the maximum attention score assigned to the region
        by any of the tokens in the phrase").
    """
    attention = _tensor(attention).float()
    piece_phrase = _tensor(piece_phrase, torch.int64, attention.device)
    r = attention.shape[-1]
    valid = piece_phrase >= 0  # (C, P)
    rows = attention[valid]  # (V, R)
    index = piece_phrase[valid][:, None].expand(-1, r)  # (V, R)
    out = attention.new_full((num_phrases, r), float("-inf"))  # (F, R)
    return out.scatter_reduce(0, index, rows, reduce="amax", include_self=True)


def _first_hit_rank(scores: Tensor, candidate: Tensor, hit: Tensor) -> Tensor:
    """0-based rank of the best-ranked hit under the pessimistic tie order; :data:`NO_HIT` if none.

    A hit region at score ``s`` ranks after every candidate scoring above ``s`` and every
    non-hit candidate scoring exactly ``s``.

    Shapes:
        scores, candidate, hit ``(F, R)`` -> ``(F,)`` int64.
    """
    hit = hit & candidate
    best = torch.where(hit, scores, torch.full_like(scores, float("-inf"))).amax(dim=1)  # (F,)
    above = (candidate & (scores > best[:, None])).sum(dim=1)  # (F,)
    tied = (candidate & ~hit & (scores == best[:, None])).sum(dim=1)  # (F,)
    return torch.where(hit.any(dim=1), above + tied, torch.full_like(above, NO_HIT))


def grounding_hits(
    scores: Tensor | np.ndarray,
    phrase_image: Tensor | np.ndarray,
    region_boxes: Tensor | np.ndarray,
    region_mask: Tensor | np.ndarray,
    gt_boxes: Tensor | np.ndarray,
    gt_mask: Tensor | np.ndarray,
    iou_threshold: float = IOU_THRESHOLD,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per phrase: the rank of its first IoU hit, whether it points right, which are counted.

    Args:
        scores: region scores of each phrase (:func:`phrase_region_scores`); ``-inf`` or NaN
            marks a region without a score.
        phrase_image: the image of each phrase.
        region_boxes: every image's region boxes, continuous coordinates (module docstring).
        region_mask: which regions are real.
        gt_boxes: ground-truth boxes of each phrase, padded.
        gt_mask: which ground-truth boxes are real.
        iou_threshold: the IoU a region needs to be a hit.

    Shapes:
        scores ``(F, R)``, phrase_image ``(F,)``, region_boxes ``(N, R, 4)``, region_mask
        ``(N, R)``, gt_boxes ``(F, G, 4)``, gt_mask ``(F, G)``.

    Returns:
        ``rank`` ``(F,)`` int64 (0-based rank of the best-ranked region with IoU >= threshold,
        :data:`NO_HIT` when none), ``pointed`` ``(F,)`` bool, ``counted`` ``(F,)`` bool (the phrase has a
        ground-truth box), ``scored`` ``(F,)`` bool (some real region has a score).
    """
    scores = _tensor(scores).double()
    device = scores.device
    image = _tensor(phrase_image, torch.int64, device)
    boxes = _tensor(region_boxes, torch.float64, device)[image]  # (F, R, 4)
    candidate = _tensor(region_mask, torch.bool, device)[image] & torch.isfinite(scores)  # (F, R)
    gt = _tensor(gt_boxes, torch.float64, device)  # (F, G, 4)
    gt_valid = _tensor(gt_mask, torch.bool, device)  # (F, G)
    inter, union = box_intersection_union(boxes[:, :, None], gt[:, None])  # (F, R, G) x2
    overlaps = (inter >= iou_threshold * union) & (union > 0) & gt_valid[:, None]  # (F, R, G)
    rank = _first_hit_rank(scores, candidate, overlaps.any(dim=2))  # (F,)
    centres = (boxes[..., :2] + boxes[..., 2:]) / 2  # (F, R, 2)
    inside = (point_in_boxes(centres[:, :, None], gt[:, None]) & gt_valid[:, None]).any(dim=2)
    pointed = _first_hit_rank(scores, candidate, inside) == 0  # (F,)
    return rank, pointed, gt_valid.any(dim=1), candidate.any(dim=1)


def grounding_metrics(
    scores: Tensor | np.ndarray,
    phrase_image: Tensor | np.ndarray,
    region_boxes: Tensor | np.ndarray,
    region_mask: Tensor | np.ndarray,
    gt_boxes: Tensor | np.ndarray,
    gt_mask: Tensor | np.ndarray,
    ks: tuple[int, ...] = KS,
    iou_threshold: float = IOU_THRESHOLD,
    chunk_size: int = 4096,
) -> dict[str, float]:
    """Recall@k and pointing accuracy of a split's phrases (module docstring for the protocol).

    Arguments and shapes as :func:`grounding_hits`; ``chunk_size`` phrases are processed at a time
    (it bounds the ``(chunk, R, G)`` IoU temporaries and does not change the result).

    Returns:
        ``R_at_{k}`` for k in ``ks``, ``pointing`` and ``unscored`` in percent of the counted
        phrases, and ``phrases``, their number. With no counted phrase every percentage is 0.
    """
    num = len(scores)
    found = {k: 0 for k in ks}
    pointed_total = unscored = counted_total = 0
    for start in range(0, num, chunk_size):
        part = slice(start, start + chunk_size)
        rank, pointed, counted, scored = grounding_hits(
            scores[part], phrase_image[part], region_boxes, region_mask, gt_boxes[part],
            gt_mask[part], iou_threshold)
        for k in ks:
            found[k] += int((counted & scored & (rank < k)).sum())
        pointed_total += int((counted & scored & pointed).sum())
        unscored += int((counted & ~scored).sum())
        counted_total += int(counted.sum())
    share = 100.0 / counted_total if counted_total else 0.0
    out = {f"R_at_{k}": found[k] * share for k in ks}
    out.update(pointing=pointed_total * share, unscored=unscored * share,
               phrases=float(counted_total))
    return out
