"""Region boxes made the way a detector's proposals look.

Each image gets ``R`` boxes (36, as the bottom-up-attention features that SCAN, VSRN, VSE-infinity
and the grounding paper use; Anderson et al., CVPR 2018), made the way a detector's proposals look
after non-maximum suppression: for every object a tight box and several looser, shifted ones that
overlap it (IoU about 0.4 to 0.9), parts of objects, boxes around two neighbouring objects, and
background patches of all scales, one of them large; ordered by a detection score, as the released
BUTD files are. Each box's feature is computed from the pixels by the benchmark's detector
(:mod:`.detector`).
"""

from __future__ import annotations

import numpy as np

Box = tuple[float, float, float, float]
OWNER_IOU = 0.5  # a box "is" an object's detection when its IoU with the object is at least this
# A box that detects no object shows the background (a "stuff" region, as Visual Genome's "sky"
# or "grass", which BUTD's detector classifies with their attributes) when the objects cover less
# than this share of it; parts of objects and pairs of objects are neither.
STUFF_COVERAGE = 0.25


def object_coverage(boxes: np.ndarray, objects: np.ndarray) -> np.ndarray:
    """``(M, 4)`` boxes x ``(K, 4)`` object boxes, xyxy -> ``(M,)``: the share of each box's area
    inside the objects' boxes (their intersections summed, at most 1: objects overlap little)."""
    objects = np.asarray(objects, dtype=np.float64).reshape(-1, 4)
    lo = np.maximum(boxes[:, None, :2], objects[None, :, :2])
    hi = np.minimum(boxes[:, None, 2:], objects[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2).sum(axis=1)  # (M,)
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    return np.minimum(inter / area, 1.0)


def _iou(boxes: np.ndarray, objects: np.ndarray) -> np.ndarray:
    """``(M, 4)`` x ``(K, 4)`` xyxy -> ``(M, K)`` IoU (continuous coordinates)."""
    lo = np.maximum(boxes[:, None, :2], objects[None, :, :2])
    hi = np.minimum(boxes[:, None, 2:], objects[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])  # noqa: E731
    return inter / (area(boxes)[:, None] + area(objects)[None, :] - inter)


def _proposal_counts(n: int, total: int) -> tuple[int, int, int, int]:
    """How many tight, loose, part and pair boxes ``n`` objects get among ``total`` (the rest are
    background patches, at least ``total // 8``)."""
    tight = min(n, total)
    loose = min(2 * n, max(total * 5 // 8 - tight, 0))
    parts = min(n, max(total * 13 // 16 - tight - loose, 0))
    pairs = min(max(n - 1, 0), 3, max(total - total // 8 - tight - loose - parts, 0))
    return tight, loose, parts, pairs


def region_boxes(
    object_boxes: list[Box],
    size: int,
    num_regions: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """BUTD-like proposals: boxes on and around the objects, parts, pairs and background.

    Returns:
        boxes: ``(R, 4)`` float32 xyxy pixel boxes inside the image, by descending score.
        owner: ``(R,)`` int64, the object a box detects (IoU >= :data:`OWNER_IOU`, the largest),
            -1 for parts, pairs and background.
    """
    objects = np.asarray(object_boxes, dtype=np.float64).reshape(-1, 4)
    n = len(objects)
    tight, loose, parts, pairs = _proposal_counts(n, num_regions)
    wh = objects[:, 2:] - objects[:, :2]  # (n, 2)
    out = []
    for k in range(tight):  # the object's own box, slightly jittered
        out.append(objects[k] + rng.uniform(-0.06, 0.06, size=4) * np.tile(wh[k], 2))
    for _ in range(loose):  # looser or tighter, shifted: overlapping detections of one object
        k = int(rng.integers(n))
        centre = (objects[k, :2] + objects[k, 2:]) / 2 + rng.uniform(-0.2, 0.2, size=2) * wh[k]
        half = wh[k] * rng.uniform(0.75, 1.35, size=2) / 2
        out.append(np.concatenate([centre - half, centre + half]))
    for _ in range(parts):  # a part of an object
        k = int(rng.integers(n))
        (x0, y0), (w, h) = objects[k, :2], wh[k] * rng.uniform(0.35, 0.7, size=2)
        bx = rng.uniform(x0 - 0.2 * w, objects[k, 2] - 0.8 * w)
        by = rng.uniform(y0 - 0.2 * h, objects[k, 3] - 0.8 * h)
        out.append(np.array([bx, by, bx + w, by + h]))
    centres = (objects[:, :2] + objects[:, 2:]) / 2
    distance = np.linalg.norm(centres[:, None] - centres[None], axis=2) + np.eye(n) * 1e9
    for _ in range(pairs):  # two neighbouring objects in one box
        k = int(rng.integers(n))
        j = int(np.argmin(distance[k]))
        union = np.concatenate([np.minimum(objects[k, :2], objects[j, :2]),
                                np.maximum(objects[k, 2:], objects[j, 2:])])
        out.append(union + rng.uniform(-0.04, 0.04, size=4) * size)
    while len(out) < num_regions:  # background, often with pieces of objects; one large patch
        scale = rng.uniform(0.6, 1.0) if len(out) == num_regions - 1 else rng.uniform(0.1, 0.5)
        w = scale * size
        h = min(w * rng.uniform(0.6, 1.6), size)
        bx, by = rng.uniform(0, size - w), rng.uniform(0, size - h)
        out.append(np.array([bx, by, bx + w, by + h]))
    boxes = np.clip(np.stack(out), 0, size)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)  # at least one pixel wide
    boxes[:, :2] = np.minimum(boxes[:, :2], size - 1)
    boxes[:, 2:] = np.minimum(boxes[:, 2:], size)
    iou = _iou(boxes, objects) if n else np.zeros((len(boxes), 1))
    best = iou.max(axis=1)
    owner = np.where(best >= OWNER_IOU, iou.argmax(axis=1), -1)
    score = best + rng.uniform(-0.1, 0.1, size=len(boxes))  # a detector's confidence, roughly
    order = np.argsort(-score, kind="stable")
    return boxes[order].astype(np.float32), owner[order].astype(np.int64)
