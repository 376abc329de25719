"""Region boxes and BUTD-style region features computed from pixels.

Each image gets ``R`` boxes (36, as the bottom-up-attention features that SCAN, VSRN, VSE-infinity
and the grounding paper use; Anderson et al., CVPR 2018), made the way a detector's proposals look
after non-maximum suppression: for every object a tight box and several looser, shifted ones that
overlap it (IoU about 0.4 to 0.9), parts of objects, boxes around two neighbouring objects, and
background patches of all scales, one of them large; ordered by a detection score, as the released
BUTD files are. Each box's feature comes from the *pixels* of its crop, resized to 16 x 16, through
a fixed feature extractor: a two-layer random convolutional network (fixed seed) pooled to 64 values,
a soft joint colour histogram, a gradient-orientation histogram and colour statistics, each group
L2-normalised and mixed by a fixed random projection to ``D`` dimensions. The extractor never sees an
attribute label, so what the features say about colour, shape, texture or size they say through the
pixels, as a detector's features would; they are similar, not equal, for two renderings of equal
objects (background, jitter, noise and neighbours differ).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

EXTRACTOR_SEED = 20_240_611  # part of the benchmark's definition, independent of the data seed
CROP = 16
_CHUNK = 256  # crops per forward pass; fixed so every crop goes through identical arithmetic
_HIST_CENTRES = np.array([0.0, 0.5, 1.0], dtype=np.float32)


Box = tuple[float, float, float, float]
OWNER_IOU = 0.5  # a box "is" an object's detection when its IoU with the object is at least this


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


def crop_regions(pixels: np.ndarray, boxes: np.ndarray, crop: int = CROP) -> np.ndarray:
    """``(R, crop, crop, 3)`` float32 in [0, 1]: each box of ``pixels`` (H, W, 3 uint8) resized."""
    image = Image.fromarray(pixels)
    out = [
        np.asarray(image.resize((crop, crop), Image.BILINEAR, box=tuple(float(v) for v in b)))
        for b in boxes
    ]
    return np.stack(out).astype(np.float32) / 255.0


class RegionFeatureExtractor:
    """A fixed, seeded pixels-to-features map (see the module docstring).

    Args:
        dim: output feature size ``D``.
        seed: the extractor's weights; keep the default so that all datasets share one extractor.
    """

    def __init__(self, dim: int = 128, seed: int = EXTRACTOR_SEED) -> None:
        rng = np.random.default_rng(seed)
        self.w1 = (rng.standard_normal((27, 24)) / np.sqrt(27)).astype(np.float32)  # 3x3x3 -> 24
        self.b1 = (rng.standard_normal(24) * 0.1).astype(np.float32)
        self.w2 = (rng.standard_normal((216, 32)) / np.sqrt(216)).astype(np.float32)  # 3x3x24 -> 32
        self.b2 = (rng.standard_normal(32) * 0.1).astype(np.float32)
        self.proj = (rng.standard_normal((64 + 27 + 9 + 6, dim)) / np.sqrt(106)).astype(np.float32)
        self.dim = dim

    @staticmethod
    def _conv3x3(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: int = 1) -> np.ndarray:
        """3 x 3 convolution (edge padding) and ReLU, ``(M, H, W, C) -> (M, H/s, W/s, C_out)``."""
        m, h, wd, c = x.shape
        padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
        ho, wo = h // stride, wd // stride
        cols = np.empty((m, ho, wo, 9, c), dtype=np.float32)
        for dy in range(3):
            for dx in range(3):
                cols[:, :, :, 3 * dy + dx] = padded[:, dy:dy + h:stride, dx:dx + wd:stride]
        out = cols.reshape(m * ho * wo, 9 * c) @ w + b  # (M*Ho*Wo, C_out)
        return np.maximum(out, 0).reshape(m, ho, wo, -1)

    def _conv_features(self, x: np.ndarray) -> np.ndarray:
        m = x.shape[0]
        h = self._conv3x3(x - 0.5, self.w1, self.b1, stride=2)  # (M, 8, 8, 24)
        h = h.reshape(m, 4, 2, 4, 2, 24).mean(axis=(2, 4))  # (M, 4, 4, 24)
        h = self._conv3x3(h, self.w2, self.b2)  # (M, 4, 4, 32)
        return np.concatenate([h.mean(axis=(1, 2)), h.max(axis=(1, 2))], axis=1)  # (M, 64)

    @staticmethod
    def _colour_histogram(x: np.ndarray) -> np.ndarray:
        """Soft joint RGB histogram, 3 bins a channel: ``(M, H, W, 3) -> (M, 27)``."""
        m = x.shape[0]
        soft = np.maximum(0, 1 - np.abs(x[..., None] - _HIST_CENTRES) / 0.5)  # (M, H, W, 3, 3)
        soft = soft.reshape(m, -1, 3, 3)  # (M, P, channel, bin)
        rg = (soft[:, :, 0, :, None] * soft[:, :, 1, None, :]).reshape(m, -1, 9)  # (M, P, 9)
        joint = np.matmul(rg.transpose(0, 2, 1), soft[:, :, 2])  # (M, 9, 3)
        return joint.reshape(m, 27) / soft.shape[1]

    @staticmethod
    def _gradients(x: np.ndarray) -> np.ndarray:
        grey = x.mean(axis=3)  # (M, H, W)
        gx = grey[:, 1:-1, 2:] - grey[:, 1:-1, :-2]
        gy = grey[:, 2:, 1:-1] - grey[:, :-2, 1:-1]
        magnitude = np.hypot(gx, gy)
        angle = np.mod(np.arctan2(gy, gx), np.pi)  # orientation, sign-free
        bins = np.minimum((angle / np.pi * 8).astype(np.int64), 7)
        hist = np.stack([(magnitude * (bins == k)).sum(axis=(1, 2)) for k in range(8)], axis=1)
        total = magnitude.mean(axis=(1, 2))[:, None]
        return np.concatenate([hist / (hist.sum(axis=1, keepdims=True) + 1e-6), total], axis=1)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        groups = [
            self._conv_features(x),
            self._colour_histogram(x),
            self._gradients(x),
            np.concatenate([x.mean(axis=(1, 2)), x.std(axis=(1, 2))], axis=1),
        ]
        z = np.concatenate(
            [g / (np.linalg.norm(g, axis=1, keepdims=True) + 1e-6) for g in groups], axis=1
        ).astype(np.float32)  # (M, 106)
        return z @ self.proj  # (M, D)

    def __call__(self, crops: np.ndarray) -> np.ndarray:
        """``(M, 16, 16, 3)`` float crops in [0, 1] -> ``(M, D)`` float32 features."""
        out = np.empty((len(crops), self.dim), dtype=np.float32)
        for start in range(0, len(crops), _CHUNK):
            chunk = crops[start:start + _CHUNK]
            padded = np.zeros((_CHUNK, *crops.shape[1:]), dtype=np.float32)
            padded[: len(chunk)] = chunk
            out[start:start + len(chunk)] = self._forward(padded)[: len(chunk)]
        return out

    def image_features(self, pixels: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """``(R, D)`` features of the boxes ``(R, 4)`` of one image ``(H, W, 3)`` uint8."""
        return self(crop_regions(pixels, boxes))
