"""Grounding metrics: the default against info-ground's own formulas, the continuous convention
against an exact per-phrase loop, and hand-built border cases."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from icr.errors import ConfigError
from icr.metrics.grounding import (
    box_area,
    box_intersection_union,
    box_iou,
    grounding_metrics,
    phrase_region_scores,
    point_in_boxes,
)

# ------------------------------------------------------ the reference: info-ground's formulas
# Written from the definitions in BigRedT/info-ground, utils/bbox_utils.py (compute_area,
# compute_iou, point_in_box, compute_center) and exp/ground/eval_flickr_phrase_loc.py
# (compute_recall, compute_pt_acc): plain Python, one phrase at a time.


def ref_area(box, invalid=None):
    x1, y1, x2, y2 = box
    if x2 <= x1 or y2 <= y1:
        return invalid
    return (x2 - x1 + 1) * (y2 - y1 + 1)


def ref_iou(a, b):
    inter = ref_area([max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])],
                     invalid=0.0)
    union = ref_area(a) + ref_area(b) - inter
    return inter / (union + 1e-6)


def ref_point_in_box(point, box):
    x, y = point
    return box[0] < x < box[2] and box[1] < y < box[3]


def ref_centre(box):
    return 0.5 * (box[0] + box[2]), 0.5 * (box[1] + box[3])


def reference(scores, image, regions, gt, gt_mask, ks=(1, 5, 10)):
    """Recall@k and pointing as info-ground's evaluation loop computes them (tie-free scores,
    every region real): its top-k boxes, a hit against any ground-truth box, percentages."""
    found = dict.fromkeys(ks, 0)
    pointed = counted = 0
    for f in range(len(scores)):
        truth = [[float(v) for v in gt[f][g]] for g in range(len(gt[f])) if gt_mask[f][g]]
        if not truth:
            continue
        counted += 1
        order = sorted(range(len(scores[f])), key=lambda r: -scores[f][r])[:max(ks)]
        boxes = [[float(v) for v in regions[image[f]][r]] for r in order]
        hits = [any(ref_iou(box, t) >= 0.5 for t in truth) for box in boxes]
        for k in ks:
            found[k] += any(hits[:k])
        pointed += any(ref_point_in_box(ref_centre(boxes[0]), t) for t in truth)
    out = {f"R_at_{k}": 100.0 * found[k] / counted for k in ks}
    out["pointing"] = 100.0 * pointed / counted
    out["phrases"] = float(counted)
    return out


def _reference_case(seed: int, images=6, regions=10, phrases=60, gts=3, integer_regions=False):
    """Detections as torchvision gives them (continuous floats; or integers, which put centres on
    box edges), 0-based inclusive integer ground truth near some of them, tie-free scores."""
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 60, size=(images, regions, 2))
    wh = rng.uniform(1, 40, size=(images, regions, 2))
    boxes = np.concatenate([xy, xy + wh], axis=-1)
    boxes = np.round(boxes) if integer_regions else boxes
    boxes = boxes.astype(np.float32)  # (N, R, 4)
    image = rng.integers(0, images, size=phrases)
    source = rng.integers(0, regions, size=phrases)
    near = np.round(boxes[image, source] + rng.normal(0, 3, size=(phrases, 4)))  # (F, 4)
    near[:, 2:] = np.maximum(near[:, 2:], near[:, :2] + 1)
    gxy = rng.integers(0, 60, size=(phrases, gts, 2))
    gt = np.concatenate([gxy, gxy + rng.integers(1, 40, size=(phrases, gts, 2))], axis=-1)
    gt = gt.astype(np.float32)  # (F, G, 4) inclusive integer boxes
    gt[:, 0] = near
    gt_mask = rng.random((phrases, gts)) < 0.5
    gt_mask[:, 0] = True
    gt_mask[:2] = False  # phrases without a box are skipped
    scores = rng.random((phrases, regions))
    scores[np.arange(phrases), source] += rng.random(phrases) < 0.5  # often the source on top
    return scores, image, boxes, gt, gt_mask


@pytest.mark.parametrize("seed, integer_regions", [(0, False), (1, False), (2, True), (3, True)])
def test_default_equals_the_info_ground_formulas(seed, integer_regions):
    scores, image, regions, gt, gt_mask = _reference_case(seed, integer_regions=integer_regions)
    want = reference(scores, image, regions, gt, gt_mask)
    mask = np.ones(regions.shape[:2], dtype=bool)
    got = grounding_metrics(torch.tensor(scores), image, regions, mask, gt, gt_mask, chunk_size=7)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-9), key
    assert 0 < got["pointing"] < 100 and 0 < got["R_at_1"] < got["R_at_10"] < 100
    # the continuous reading of the same files (annotations + 1, a closed box) never points less
    plus = np.float32([0, 0, 1, 1])
    continuous = grounding_metrics(torch.tensor(scores), image, regions, mask, gt + plus,
                                   gt_mask, box_convention="continuous")
    assert continuous["pointing"] >= got["pointing"]


def test_integer_regions_put_centres_on_edges():
    """The random case above does test the strict centre rule: some top-1 centres lie on an edge
    of a ground-truth box, where the reference says outside and a closed box says inside."""
    _, _, regions, gt, gt_mask = _reference_case(2, integer_regions=True)
    centres = (regions[..., :2] + regions[..., 2:]) / 2  # (N, R, 2)
    on_x = (centres[:, :, None, None, 0] == gt[None, None, :, :, 0]) | (
        centres[:, :, None, None, 0] == gt[None, None, :, :, 2])
    assert on_x.any()


# ------------------------------------------- the continuous convention: one phrase at a time


def _inclusive_iou(a, b) -> Fraction:
    """IoU of inclusive integer boxes with the reference's +1-pixel areas, exactly."""
    iw = max(0, min(a[2], b[2]) - max(a[0], b[0]) + 1)
    ih = max(0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
    inter = iw * ih
    area = lambda x: (x[2] - x[0] + 1) * (x[3] - x[1] + 1)  # noqa: E731
    return Fraction(inter, area(a) + area(b) - inter)


def _inside(point, box) -> bool:
    """Closed box in continuous coordinates: inclusive box [x0, x1] covers [x0, x1 + 1]."""
    return box[0] <= point[0] <= box[2] + 1 and box[1] <= point[1] <= box[3] + 1


def oracle(scores, image, regions, mask, gt, gt_mask, ks=(1, 5, 10)):
    """Recall@k and pointing with loops over phrases, on inclusive integer boxes read as
    continuous ones (``+1`` on the far edges), with the pessimistic tie order."""
    found = dict.fromkeys(ks, 0)
    pointed = counted = 0
    for f in range(len(scores)):
        truth = [tuple(gt[f][g]) for g in range(len(gt[f])) if gt_mask[f][g]]
        if not truth:
            continue
        counted += 1
        cands = [r for r in range(len(scores[f])) if mask[image[f]][r] and np.isfinite(scores[f][r])]
        boxes = {r: tuple(regions[image[f]][r]) for r in cands}
        iou_hit = {r: any(_inclusive_iou(boxes[r], t) >= Fraction(1, 2) for t in truth)
                   for r in cands}
        centre = {r: ((boxes[r][0] + boxes[r][2] + 1) / 2, (boxes[r][1] + boxes[r][3] + 1) / 2)
                  for r in cands}
        point_hit = {r: any(_inside(centre[r], t) for t in truth) for r in cands}
        # pessimistic order: score descending, at equal scores the non-hits first
        order = sorted(cands, key=lambda r: (-scores[f][r], iou_hit[r], r))
        for k in ks:
            found[k] += any(iou_hit[r] for r in order[:k])
        order = sorted(cands, key=lambda r: (-scores[f][r], point_hit[r], r))
        pointed += bool(order) and point_hit[order[0]]
    out = {f"R_at_{k}": 100.0 * found[k] / counted for k in ks}
    out["pointing"] = 100.0 * pointed / counted
    out["phrases"] = float(counted)
    return out


def _random_case(seed: int, images=7, regions=12, phrases=40, gts=3):
    rng = np.random.default_rng(seed)

    def boxes(*shape):
        xy = rng.integers(0, 30, size=(*shape, 2))
        wh = rng.integers(0, 25, size=(*shape, 2))
        return np.concatenate([xy, xy + wh], axis=-1)  # inclusive integer boxes

    regions_incl = boxes(images, regions)
    mask = rng.random((images, regions)) < 0.8
    image = rng.integers(0, images, size=phrases)
    gt_incl = boxes(phrases, gts)
    # half the phrases get a ground truth near a region, which often scores best
    source = rng.integers(0, regions, size=phrases)
    near = regions_incl[image, source] + rng.integers(-1, 2, (phrases, 4))
    near[:, 2:] = np.maximum(near[:, 2:], near[:, :2])
    chosen = rng.random(phrases) < 0.5
    gt_incl[chosen, 0] = near[chosen]
    gt_mask = rng.random((phrases, gts)) < 0.6
    gt_mask[chosen, 0] = True
    gt_mask[:3] = False  # some phrases have no box
    scores = rng.integers(0, 6, size=(phrases, regions)).astype(float)  # many ties
    boost = chosen & (rng.random(phrases) < 0.6)
    scores[boost, source[boost]] = 6.0
    scores[rng.random((phrases, regions)) < 0.1] = -np.inf
    scores[5] = -np.inf  # an unscored phrase
    return scores, image, regions_incl, mask, gt_incl, gt_mask


@pytest.mark.parametrize("seed", range(5))
def test_continuous_against_the_loop_oracle(seed):
    scores, image, regions, mask, gt, gt_mask = _random_case(seed)
    expected = oracle(scores, image, regions, mask, gt, gt_mask)
    plus = np.array([0, 0, 1, 1])  # inclusive -> continuous
    got = grounding_metrics(torch.tensor(scores), image, regions + plus, mask, gt + plus, gt_mask,
                            chunk_size=7, box_convention="continuous")
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert got["unscored"] > 0 and 0 < got["R_at_1"] <= got["R_at_5"] <= got["R_at_10"]


def test_chunking_and_numpy_inputs_do_not_change_the_result():
    case = _random_case(11)
    plus = np.array([0, 0, 1, 1])
    args = (case[0], case[1], case[2] + plus, case[3], case[4] + plus, case[5])
    for convention in ("infoground", "continuous"):
        whole = grounding_metrics(*args, chunk_size=1000, box_convention=convention)
        assert grounding_metrics(*args, chunk_size=3, box_convention=convention) == whole
        assert grounding_metrics(*(torch.as_tensor(a) for a in args),
                                 box_convention=convention) == whole


# ------------------------------------------------------------------------------ hand-built boxes


def _one(scores, regions, gt, mask=None, ks=(1, 5, 10), convention="infoground"):
    scores = torch.tensor([scores], dtype=torch.float32)
    regions = torch.tensor([regions], dtype=torch.float32)
    mask = torch.ones(regions.shape[:2], dtype=torch.bool) if mask is None else torch.tensor([mask])
    gt = torch.tensor([gt], dtype=torch.float32)
    return grounding_metrics(scores, torch.tensor([0]), regions, mask, gt,
                             torch.ones(gt.shape[:2], dtype=torch.bool), ks=ks,
                             box_convention=convention)


def test_iou_of_exactly_one_half_under_each_convention():
    # infoground: +1-pixel areas 10 x 10 = 100 and 10 x 20 = 200, so IoU 100 / 200; the
    # reference divides by union + 1e-6: a miss
    a, b = torch.tensor([0.0, 0, 9, 9]).double(), torch.tensor([0.0, 0, 9, 19]).double()
    assert box_intersection_union(a, b) == (100.0, 200.0)
    assert box_iou(a, b).item() == pytest.approx(0.5) and box_iou(a, b).item() < 0.5
    assert _one([1.0], [[0, 0, 9, 19]], [[0, 0, 9, 9]])["R_at_1"] == 0.0
    assert _one([1.0], [[0, 0, 9, 18]], [[0, 0, 9, 9]])["R_at_1"] == 100.0  # 100 / 190
    # continuous: 100 / 200 exactly is a hit
    a, b = torch.tensor([0.0, 0, 10, 10]).double(), torch.tensor([0.0, 0, 10, 20]).double()
    assert box_iou(a, b, "continuous").item() == 0.5
    assert _one([1.0], [[0, 0, 10, 20]], [[0, 0, 10, 10]], convention="continuous")["R_at_1"] == 100
    assert _one([1.0], [[0, 0, 10, 21]], [[0, 0, 10, 10]], convention="continuous")["R_at_1"] == 0
    # the same pair read as inclusive boxes: 11 x 11 / 11 x 21
    assert box_iou(a, b).item() == pytest.approx(121 / (231 + 1e-6), rel=1e-12)
    assert box_iou(torch.zeros(4), torch.zeros(4), "continuous").item() == 0.0  # empty union
    assert box_iou(torch.zeros(4), torch.zeros(4)).item() == 0.0


def test_touching_boxes():
    left, right = torch.tensor([0.0, 0, 10, 10]), torch.tensor([10.0, 0, 20, 10])
    # inclusive boxes sharing the column x = 10: the reference's intersection is 0 (x2 <= x1)
    assert box_intersection_union(left, right) == (0.0, 242.0)
    assert box_intersection_union(left, right, "continuous") == (0.0, 200.0)
    # one pixel of overlap: 2 x 11 pixels inclusive, 1 x 10 continuous
    overlap = torch.tensor([9.0, 0, 19, 10])
    assert box_intersection_union(left, overlap) == (22.0, 220.0)
    assert box_intersection_union(left, overlap, "continuous") == (10.0, 190.0)
    # a degenerate (zero-width) box has area 0 in both (the reference fails on it)
    line = torch.tensor([5.0, 0, 5, 10])
    assert box_area(line).item() == 0.0 and box_area(line, "continuous").item() == 0.0


def test_pointing_on_an_edge():
    region = [[10, 0, 20, 10]]  # centre (15, 5)
    # infoground: strictly inside; a centre on an edge or a corner is outside
    assert _one([1.0], region, [[0, 0, 15, 10]])["pointing"] == 0.0
    assert _one([1.0], region, [[0, 0, 15.1, 10]])["pointing"] == 100.0
    assert _one([1.0], region, [[15, 0, 30, 10]])["pointing"] == 0.0
    assert _one([1.0], region, [[0, 5, 30, 30]])["pointing"] == 0.0
    # continuous: the border counts
    assert _one([1.0], region, [[0, 0, 15, 10]], convention="continuous")["pointing"] == 100.0
    assert _one([1.0], region, [[0, 0, 14.9, 10]], convention="continuous")["pointing"] == 0.0
    assert _one([1.0], region, [[15, 5, 30, 30]], convention="continuous")["pointing"] == 100.0
    point, box = torch.tensor([15.0, 5.0]), torch.tensor([15.0, 5.0, 15.0, 5.0])
    assert point_in_boxes(point, box, "continuous") and not point_in_boxes(point, box)


def test_unknown_convention_is_one_line():
    with pytest.raises(ConfigError, match="box convention 'inclusive' is unknown; valid: "
                                          "infoground, continuous"):
        _one([1.0], [[0, 0, 1, 1]], [[0, 0, 1, 1]], convention="inclusive")


def test_padded_regions_are_never_selected():
    gt = [[0, 0, 10, 10]]
    regions = [[0, 0, 10, 10], [50, 50, 60, 60], [0, 0, 10, 10]]
    # the padded hit (region 0) has the best score; the real hit (region 2) ranks second
    out = _one([0.9, 0.5, 0.4], regions, gt, mask=[False, True, True])
    assert out["R_at_1"] == 0 and out["R_at_5"] == 100 and out["pointing"] == 0
    out = _one([0.9, 0.5, 0.4], regions, gt, mask=[False, True, False])
    assert out["R_at_10"] == 0  # the only hits are padding


def test_ties_are_pessimistic_and_phrases_without_scores_are_misses():
    gt = [[0, 0, 10, 10]]
    regions = [[0, 0, 10, 10], [50, 50, 60, 60], [70, 70, 80, 80]]
    out = _one([0.5, 0.5, 0.5], regions, gt, ks=(1, 2, 3))
    assert out["R_at_1"] == 0 and out["R_at_2"] == 0 and out["R_at_3"] == 100
    out = _one([float("-inf")] * 3, regions, gt)
    assert out["R_at_10"] == 0 and out["unscored"] == 100 and out["phrases"] == 1


def test_phrases_without_boxes_are_skipped():
    scores = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    regions = torch.tensor([[[0.0, 0, 10, 10], [20, 20, 30, 30]]])
    gt = torch.tensor([[[0.0, 0, 10, 10]], [[0.0, 0, 10, 10]]])
    out = grounding_metrics(scores, torch.tensor([0, 0]), regions, torch.ones(1, 2, dtype=bool),
                            gt, torch.tensor([[True], [False]]))
    assert out["phrases"] == 1 and out["R_at_1"] == 100
    none = grounding_metrics(scores, torch.tensor([0, 0]), regions, torch.ones(1, 2, dtype=bool),
                             gt, torch.zeros(2, 1, dtype=bool))
    assert none == {"R_at_1": 0.0, "R_at_5": 0.0, "R_at_10": 0.0, "pointing": 0.0,
                    "unscored": 0.0, "phrases": 0.0}


# --------------------------------------------------------------------------- phrase scores


def test_phrase_scores_are_the_max_over_pieces_against_a_loop():
    rng = np.random.default_rng(3)
    attention = rng.random((5, 7, 4))  # (C, P, R)
    piece_phrase = rng.integers(-1, 6, size=(5, 7))
    piece_phrase[:, 0] = -1
    got = phrase_region_scores(torch.tensor(attention), piece_phrase, num_phrases=8)
    assert got.shape == (8, 4)
    for f in range(8):
        rows = [attention[c, p] for c in range(5) for p in range(7) if piece_phrase[c, p] == f]
        if rows:
            np.testing.assert_allclose(got[f].numpy(), np.max(rows, axis=0), rtol=1e-6)
        else:
            assert torch.isneginf(got[f]).all()
    assert torch.isneginf(got[6:]).all()  # phrases no position names
