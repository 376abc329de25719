"""Phrase grounding metrics: Recall@k and pointing accuracy from word-region attention.

Protocol (Gupta et al., ECCV 2020, Sec. 2.5 "Attention to phrase grounding" and Sec. 3.1;
docs/reference-code.md, sections 4 and 8):

- The score of a region for a phrase is the max over the phrase's word pieces of their attention
  to the region (:func:`phrase_region_scores`); regions are ranked by it.
- Recall@k: a phrase is found when one of its top-k regions has IoU >= 0.5 with *any* of the
  phrase's ground-truth boxes (no union box).
- Pointing accuracy: the centre of the top-1 region lies inside any ground-truth box of the phrase.
- Phrases without a ground-truth box are skipped; all values are percentages of the counted
  phrases, and ``phrases`` is their number.

Box conventions (``box_convention``; every box ``(x1, y1, x2, y2)`` in pixels):

- ``infoground`` (the default): exactly what the info-ground evaluation computes
  (``utils/bbox_utils.py`` and ``exp/ground/eval_flickr_phrase_loc.py`` of BigRedT/info-ground),
  which reads every box as an *inclusive* pixel box. A box's area is ``(x2 - x1 + 1) * (y2 - y1 +
  1)``, and 0 unless ``x2 > x1`` and ``y2 > y1`` (the reference's intersection of two boxes that
  share only a row or a column of pixels is therefore 0, and it fails on such a predicted box;
  here its area is 0). IoU is ``intersection / (union + 1e-6)``, so an IoU of exactly 0.5 is a
  miss. Pointing counts the centre ``(0.5 (x1 + x2), 0.5 (y1 + y2))`` only when it is strictly
  inside: ``x1 < x < x2`` and ``y1 < y < y2`` (a centre on an edge is outside).
- ``continuous``: boxes in continuous pixel coordinates, ``(x2, y2)`` one past the last covered
  pixel, area ``(x2 - x1) * (y2 - y1)``, no ``+1``; IoU >= 0.5 is decided exactly
  (``2 * intersection >= union``); a centre is inside a closed box (``x1 <= x <= x2``, the border
  counts). On integer boxes it gives the IoU of the reference's "+1 pixel" areas once inclusive
  boxes get ``+1`` on ``x2, y2``, but its ground-truth boxes reach one pixel further and its
  border counts, so its pointing is never below the reference's on the same files and often
  above: by 2.6 to 5.3 points on four random draws of detections 1 to 40 pixels wide, by 0.1
  with detections 5 to 200 pixels wide.

The metric takes the boxes as given; which input is converted how (annotation boxes, detector
boxes) is :meth:`icr.grounding.data.GroundingSplit.boxes`. With ``infoground`` nothing is
converted: the reference compares its torchvision detections (continuous floats) with the
Flickr30K Entities boxes (1-based inclusive in the XML, 1 subtracted on reading) as they are, and
so does this convention.

Where the default still differs from the info-ground code, deliberately:

- Padded regions are never ranked (the reference takes the top 10 and then drops padded ids, so
  a phrase can be left with fewer than k boxes).
- Ties: at equal scores, regions that are not a hit rank first (the pessimistic order of
  :mod:`icr.metrics.retrieval`), so uniform attention from a collapsed model scores 0, not the
  luck of ``torch.topk``'s order.
- A phrase none of whose words has a scored piece (e.g. the tagger kept none of them) has no
  ranking and counts as a miss, not as skipped; ``unscored`` is their share.
- Arithmetic is float64 (the reference mixes Python ints with float32 detections).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from icr.errors import ConfigError

__all__ = [
    "BOX_CONVENTIONS",
    "DEFAULT_BOX_CONVENTION",
    "box_area",
    "box_centres",
    "box_intersection_union",
    "box_iou",
    "check_box_convention",
    "grounding_hits",
    "grounding_metrics",
    "phrase_region_scores",
    "point_in_boxes",
]

KS = (1, 5, 10)
IOU_THRESHOLD = 0.5
NO_HIT = torch.iinfo(torch.int64).max  # the rank of a phrase without a hit: above every k
BOX_CONVENTIONS = ("infoground", "continuous")
DEFAULT_BOX_CONVENTION = "infoground"
INFOGROUND_IOU_EPS = 1e-6  # the reference's ``union + 1e-6``


def check_box_convention(convention: str) -> str:
    """``convention`` if it is one of :data:`BOX_CONVENTIONS`; a one-line ConfigError otherwise."""
    if convention not in BOX_CONVENTIONS:
        raise ConfigError(f"box convention {convention!r} is unknown; valid: "
                         f"{', '.join(BOX_CONVENTIONS)}")
    return convention


def _tensor(x: Tensor | np.ndarray, dtype: torch.dtype | None = None,
            device: torch.device | None = None) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.from_numpy(np.asarray(x))
    return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype)


def _extent(low: Tensor, high: Tensor, convention: str) -> Tensor:
    """Side length of ``[low, high]``: ``high - low + 1`` when ``high > low`` else 0
    (``infoground``), ``max(high - low, 0)`` (``continuous``)."""
    if convention == "infoground":
        return torch.where(high > low, high - low + 1, torch.zeros_like(high))
    return (high - low).clamp(min=0)


def box_area(boxes: Tensor, convention: str = DEFAULT_BOX_CONVENTION) -> Tensor:
    """Area of each box (module docstring for the conventions).

    Shapes:
        boxes ``(..., 4)`` -> ``(...)``.
    """
    check_box_convention(convention)
    return (_extent(boxes[..., 0], boxes[..., 2], convention)
            * _extent(boxes[..., 1], boxes[..., 3], convention))


def box_intersection_union(a: Tensor, b: Tensor, convention: str = DEFAULT_BOX_CONVENTION
                           ) -> tuple[Tensor, Tensor]:
    """Intersection and union areas of boxes ``a`` and ``b``, broadcast over leading dims.

    Shapes:
        a ``(..., 4)``, b ``(..., 4)`` (broadcastable) -> two ``(...)`` tensors.
    """
    check_box_convention(convention)
    width = _extent(torch.maximum(a[..., 0], b[..., 0]), torch.minimum(a[..., 2], b[..., 2]),
                    convention)
    height = _extent(torch.maximum(a[..., 1], b[..., 1]), torch.minimum(a[..., 3], b[..., 3]),
                     convention)
    inter = width * height
    return inter, box_area(a, convention) + box_area(b, convention) - inter


def box_iou(a: Tensor, b: Tensor, convention: str = DEFAULT_BOX_CONVENTION) -> Tensor:
    """IoU of boxes: ``inter / (union + 1e-6)`` (``infoground``, as the reference) or
    ``inter / union``, 0 for an empty union (``continuous``).

    Shapes:
        a ``(..., 4)``, b ``(..., 4)`` (broadcastable) -> ``(...)``.
    """
    inter, union = box_intersection_union(a, b, convention)
    if convention == "infoground":
        return inter / (union + INFOGROUND_IOU_EPS)
    return torch.where(union > 0, inter / union.clamp(min=torch.finfo(inter.dtype).tiny), 0.0)


def _iou_at_least(a: Tensor, b: Tensor, threshold: float, convention: str) -> Tensor:
    """``IoU >= threshold``: the reference's float test (``infoground``) or decided exactly
    without a division (``continuous``: ``inter >= threshold * union`` and a non-empty union)."""
    if convention == "infoground":
        return box_iou(a, b, convention) >= threshold
    inter, union = box_intersection_union(a, b, convention)
    return (inter >= threshold * union) & (union > 0)


def box_centres(boxes: Tensor) -> Tensor:
    """``(0.5 (x1 + x2), 0.5 (y1 + y2))`` of each box, in the box's own coordinates.

    Shapes:
        boxes ``(..., 4)`` -> ``(..., 2)``.
    """
    return (boxes[..., :2] + boxes[..., 2:]) / 2


def point_in_boxes(points: Tensor, boxes: Tensor, convention: str = DEFAULT_BOX_CONVENTION
                   ) -> Tensor:
    """Whether each point lies strictly inside ``(x1, x2) x (y1, y2)`` (``infoground``, the
    reference's ``point_in_box``) or in the closed box ``[x1, x2] x [y1, y2]`` (``continuous``).

    Shapes:
        points ``(..., 2)``, boxes ``(..., 4)`` (broadcastable) -> ``(...)`` bool.
    """
    check_box_convention(convention)
    x, y = points[..., 0], points[..., 1]
    if convention == "infoground":
        return (boxes[..., 0] < x) & (x < boxes[..., 2]) & (boxes[..., 1] < y) & (y < boxes[..., 3])
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
    box_convention: str = DEFAULT_BOX_CONVENTION,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per phrase: the rank of its first IoU hit, whether it points right, which are counted.

    Args:
        scores: region scores of each phrase (:func:`phrase_region_scores`); ``-inf`` or NaN
            marks a region without a score.
        phrase_image: the image of each phrase.
        region_boxes: every image's region boxes, in ``box_convention``.
        region_mask: which regions are real.
        gt_boxes: ground-truth boxes of each phrase, padded, in ``box_convention``.
        gt_mask: which ground-truth boxes are real.
        iou_threshold: the IoU a region needs to be a hit.
        box_convention: ``infoground`` or ``continuous`` (module docstring).

    Shapes:
        scores ``(F, R)``, phrase_image ``(F,)``, region_boxes ``(N, R, 4)``, region_mask
        ``(N, R)``, gt_boxes ``(F, G, 4)``, gt_mask ``(F, G)``.

    Returns:
        ``rank`` ``(F,)`` int64 (0-based rank of the best-ranked region with IoU >= threshold,
        :data:`NO_HIT` when none), ``pointed`` ``(F,)`` bool, ``counted`` ``(F,)`` bool (the phrase has a
        ground-truth box), ``scored`` ``(F,)`` bool (some real region has a score).
    """
    check_box_convention(box_convention)
    scores = _tensor(scores).double()
    device = scores.device
    image = _tensor(phrase_image, torch.int64, device)
    boxes = _tensor(region_boxes, torch.float64, device)[image]  # (F, R, 4)
    candidate = _tensor(region_mask, torch.bool, device)[image] & torch.isfinite(scores)  # (F, R)
    gt = _tensor(gt_boxes, torch.float64, device)  # (F, G, 4)
    gt_valid = _tensor(gt_mask, torch.bool, device)  # (F, G)
    overlaps = _iou_at_least(boxes[:, :, None], gt[:, None], iou_threshold,
                             box_convention) & gt_valid[:, None]  # (F, R, G)
    rank = _first_hit_rank(scores, candidate, overlaps.any(dim=2))  # (F,)
    centres = box_centres(boxes)  # (F, R, 2)
    inside = point_in_boxes(centres[:, :, None], gt[:, None], box_convention)  # (F, R, G)
    pointed = _first_hit_rank(scores, candidate, (inside & gt_valid[:, None]).any(dim=2)) == 0
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
    box_convention: str = DEFAULT_BOX_CONVENTION,
) -> dict[str, float]:
    """Recall@k and pointing accuracy of a split's phrases (module docstring for the protocol).

    Arguments and shapes as :func:`grounding_hits`; ``chunk_size`` phrases are processed at a time
    (it bounds the ``(chunk, R, G)`` IoU temporaries and does not change the result).

    Returns:
        ``R_at_{k}`` for k in ``ks``, ``pointing`` and ``unscored`` in percent of the counted
        phrases, and ``phrases``, their number. With no counted phrase every percentage is 0.
    """
    check_box_convention(box_convention)
    num = len(scores)
    found = {k: 0 for k in ks}
    pointed_total = unscored = counted_total = 0
    for start in range(0, num, chunk_size):
        part = slice(start, start + chunk_size)
        rank, pointed, counted, scored = grounding_hits(
            scores[part], phrase_image[part], region_boxes, region_mask, gt_boxes[part],
            gt_mask[part], iou_threshold, box_convention)
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
