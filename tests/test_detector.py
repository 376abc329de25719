"""The shapes world's detector: RoIAlign, training, the exact integer extractor, the shipped
weights, what its features carry."""

from __future__ import annotations

import dataclasses
import hashlib
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from icr.data.synthetic import detector as det
from icr.data.synthetic import extractor as ex
from icr.data.synthetic.detector import (
    BACKGROUND,
    DETECTORS,
    HEADS,
    DetectorSpec,
    RegionDetector,
    detector_scenes,
    float_features,
    head_accuracy,
    roi_align,
    train_detector,
)
from icr.errors import DataError

# Trains in seconds (about 5 CPU s): it learns colour, size and the background's tone, begins on
# texture and shape (its held-out heads: colour of objects and backgrounds 0.86, size 0.68, tone
# 1.0, texture 0.38, shape of an object's box 0.06); the floors below are measured on it with
# margin. The benchmark's detectors train for minutes and ship with the package.
SMALL = DetectorSpec(channels=(16, 24, 24), roi=4, scenes=240, eval_scenes=40, epochs=6,
                     batch_size=16, lr=5e-3)
THIN = DetectorSpec(channels=(4, 8, 8), roi=2, scenes=8, eval_scenes=4, epochs=1, batch_size=4)


def _bilinear(feature_map: np.ndarray, x: float, y: float) -> np.ndarray:
    """A ``(C, h, w)`` map at continuous map coordinates (pixel centres at +0.5), zero outside."""
    c, h, w = feature_map.shape
    x, y = x - 0.5, y - 0.5
    x0, y0 = int(np.floor(x)), int(np.floor(y))
    out = np.zeros(c)
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < h and 0 <= xx < w:
                out += wy * wx * feature_map[:, yy, xx]
    return out


def test_roi_align_samples_each_cell_centre_bilinearly():
    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)  # a stride-4 map of 24 px
    boxes = np.array([[[0.0, 0.0, 24.0, 24.0], [3.0, 5.0, 17.0, 11.0]],
                      [[10.0, 2.0, 13.0, 23.0], [-2.0, 20.0, 6.0, 26.0]]], dtype=np.float32)
    cells, stride = 3, 4.0
    got = roi_align(torch.from_numpy(features), torch.from_numpy(boxes), 24, cells).numpy()
    assert got.shape == (2, 2, 3, cells, cells)
    for n in range(2):
        for r in range(2):
            x0, y0, x1, y1 = boxes[n, r] / stride
            for i in range(cells):
                for j in range(cells):
                    y = y0 + (y1 - y0) * (i + 0.5) / cells
                    x = x0 + (x1 - x0) * (j + 0.5) / cells
                    np.testing.assert_allclose(got[n, r, :, i, j], _bilinear(features[n], x, y),
                                               rtol=1e-5, atol=1e-5)


def _boxes(rng: np.random.Generator, n: int, r: int, size: int) -> np.ndarray:
    """``(n, r, 4)`` float32 boxes inside a ``size`` image, including its edges."""
    corners = np.sort(rng.uniform(0, size, (n, r, 2, 2)), axis=2)  # (n, r, lo/hi, x/y)
    boxes = corners.transpose(0, 1, 3, 2).reshape(n, r, 4)[..., [0, 2, 1, 3]]  # xyxy
    boxes[0, 0] = (0, 0, size, size)  # the whole image: samples beside its borders
    return boxes.astype(np.float32)


def test_integer_roi_align_is_exact_bilinear_interpolation_at_its_sample_points():
    """Oracle: the same sample points (:func:`sample_points`), interpolated in exact rational
    arithmetic and rounded half up, give exactly the integer RoIAlign's values."""
    rng = np.random.default_rng(1)
    fmap = rng.integers(0, ex.ACTIVATION_MAX + 1, (2, 3, 6, 6))  # a stride-4 map of 24 px
    boxes, cells, one = _boxes(rng, 2, 3, 24), 2, 1 << ex.COORDINATE_BITS
    got = ex.integer_roi_align(torch.from_numpy(fmap), boxes, 24, cells).numpy()  # (N, R, C*s*s)
    assert got.shape == (2, 3, 3 * cells * cells)
    for n in range(2):
        for r in range(3):
            xs = ex.sample_points(boxes[n:n + 1, r:r + 1, 0], boxes[n:n + 1, r:r + 1, 2], cells, 6, 24)
            ys = ex.sample_points(boxes[n:n + 1, r:r + 1, 1], boxes[n:n + 1, r:r + 1, 3], cells, 6, 24)
            want = np.empty((3, cells, cells), dtype=np.int64)
            for i, v in enumerate(ys.ravel()):
                for j, u in enumerate(xs.ravel()):
                    y, x = Fraction(int(v), one), Fraction(int(u), one)
                    value = [Fraction(0)] * 3
                    for yy in (int(np.floor(y)), int(np.floor(y)) + 1):
                        for xx in (int(np.floor(x)), int(np.floor(x)) + 1):
                            if 0 <= yy < 6 and 0 <= xx < 6:
                                w = (1 - abs(y - yy)) * (1 - abs(x - xx))
                                value = [a + w * int(fmap[n, ch, yy, xx]) for ch, a in enumerate(value)]
                    want[:, i, j] = [int(np.floor(a + Fraction(1, 2))) for a in value]
            np.testing.assert_array_equal(got[n, r], want.ravel())


def test_sample_points_are_the_float_roi_align_points_rounded_to_a_256th_of_a_cell():
    rng = np.random.default_rng(2)
    boxes, cells = _boxes(rng, 3, 5, 96), 6
    fixed = ex.sample_points(boxes[..., 0], boxes[..., 2], cells, 24, 96)  # (N, R, cells)
    x0, x1 = boxes[..., 0:1].astype(np.float64), boxes[..., 2:3].astype(np.float64)
    exact = (x0 + (x1 - x0) * (np.arange(cells) + 0.5) / cells) / 4 - 0.5  # map coordinates
    assert np.abs(fixed / 256 - exact).max() <= 0.5 / 256 + 1e-12
    # and the integer RoIAlign follows the float one within that rounding
    fmap = rng.integers(0, 1000, (3, 2, 24, 24))
    got = ex.integer_roi_align(torch.from_numpy(fmap), boxes, 96, cells).numpy()
    want = roi_align(torch.from_numpy(fmap).double(), torch.from_numpy(boxes), 96, cells)
    step = np.abs(np.diff(fmap, axis=-1)).max() + np.abs(np.diff(fmap, axis=-2)).max()
    assert np.abs(got - want.flatten(2).numpy()).max() <= 0.5 + step / 256


def _quantized(spec: DetectorSpec, seed: int = 0) -> tuple[RegionDetector, ex.ExactExtractor]:
    torch.manual_seed(seed)
    model = RegionDetector(spec).eval()
    with torch.no_grad():  # BatchNorm statistics away from their initial 0 / 1
        for module in model.backbone:
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.1, 0.1)
    data = detector_scenes(8, seed=5)
    return model, ex.quantize(model, data.pixels, data.boxes, "tiny")


def test_the_extractor_computes_exact_integers():
    """Oracle: the same layers in int64 (convolution as im2col and an integer matrix product,
    which rounds nothing) give the float64 path's integers exactly."""
    _, extractor = _quantized(DetectorSpec(channels=(8, 12, 12), roi=3))
    data = detector_scenes(3, seed=6)
    x = torch.from_numpy(data.pixels).permute(0, 3, 1, 2).to(torch.int64) * 2 - 255
    for layer in extractor.convs:
        o, i, k, _ = layer.weight.shape
        columns = F.unfold(x.double(), k, padding=k // 2, stride=layer.stride).to(torch.int64)
        h = (x.shape[2] + 2 * (k // 2) - k) // layer.stride + 1
        acc = torch.from_numpy(layer.weight.reshape(o, -1).astype(np.int64)) @ columns  # (N, O, L)
        acc = acc.view(len(x), o, h, -1) + torch.from_numpy(layer.bias).view(1, -1, 1, 1)
        assert torch.equal(ex._accumulate(x, layer), acc)
        m = torch.from_numpy(layer.multiplier).view(1, -1, 1, 1)
        x = torch.clamp((acc.clamp_min(0) * m + 2 ** (layer.shift - 1)) // 2 ** layer.shift,
                        max=ex.ACTIVATION_MAX)
    assert torch.equal(x, extractor.feature_map(data.pixels))
    pooled = ex.integer_roi_align(x, data.boxes, 96, extractor.cells)  # (N, R, K)
    acc = pooled @ torch.from_numpy(extractor.fc.weight.astype(np.int64)).T + \
        torch.from_numpy(extractor.fc.bias)
    assert torch.equal(ex._accumulate(pooled, extractor.fc), acc)
    assert torch.equal(extractor.integer_features(data.pixels, data.boxes),
                       extractor.fc.rescale(acc, channel_dim=-1))


def test_features_do_not_depend_on_chunks_or_threads(monkeypatch):
    _, extractor = _quantized(THIN)
    data = detector_scenes(9, seed=11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = extractor.features(data.pixels, data.boxes)  # (N, R, D)
        torch.set_num_threads(2)
        monkeypatch.setattr(ex, "_CHUNK", 4)
        two = extractor.features(data.pixels, data.boxes)
    finally:
        torch.set_num_threads(before)
    parts = np.concatenate([extractor.features(data.pixels[i:i + 2], data.boxes[i:i + 2])
                            for i in range(0, 9, 2)])
    assert one.shape == (9, 36, THIN.feature_dim) and one.dtype == np.float32 and (one >= 0).all()
    assert np.array_equal(one, two) and np.array_equal(one, parts)
    # a feature is an integer times 2^-k
    scaled = one * 2.0**extractor.feature_exponent
    assert np.array_equal(scaled, np.rint(scaled)) and scaled.max() <= ex.ACTIVATION_MAX


def test_the_integer_features_follow_the_float_network():
    """Quantisation error (int8 weights, 15-bit activations): within 2 % of the largest feature,
    0.5 % on average (measured on the tiny detector: 1.0 % and 0.5 %)."""
    model, extractor = _quantized(DetectorSpec(channels=(8, 12, 12), roi=3))
    data = detector_scenes(6, seed=7)
    exact = extractor.features(data.pixels, data.boxes)  # (N, R, D)
    floating = float_features(model, data.pixels, data.boxes).numpy()
    error = np.abs(exact - floating)
    assert error.max() <= 0.02 * floating.max()
    assert error.mean() <= 0.005 * np.abs(floating).mean() + 1e-6


def test_weights_whose_sums_could_round_are_refused():
    layer = ex.IntegerLayer(np.full((2, 3, 3, 3), 127, dtype=np.int8), np.zeros(2, dtype=np.int64),
                            np.full(2, 1 << 23, dtype=np.int64), 24)
    layer.check_exact(ex.ACTIVATION_MAX, "conv0")  # 27 * 127 * 32767: far below 2^53
    huge = dataclasses.replace(layer, bias=np.array([2**53, 0], dtype=np.int64))
    with pytest.raises(DataError, match="conv0.*not exact"):
        huge.check_exact(ex.ACTIVATION_MAX, "conv0")
    overflow = dataclasses.replace(layer, multiplier=np.array([2**40, 1], dtype=np.int64))
    with pytest.raises(DataError, match="not exact"):
        overflow.check_exact(ex.ACTIVATION_MAX, "conv0")


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_each_shipped_detector_matches_its_sha256_and_its_definition(name):
    extractor = ex.shipped(name)
    path = ex.DETECTOR_DIR / f"{name}.npz"
    data = path.read_bytes()
    assert extractor.digest == ex.SHA256[name] == hashlib.sha256(data).hexdigest()
    spec = DETECTORS[name]
    assert extractor.feature_dim == spec.feature_dim and extractor.cells == spec.roi
    assert [layer.weight.shape[0] for layer in extractor.convs] == list(spec.channels)
    assert [layer.stride for layer in extractor.convs] == list(spec.strides)
    assert ex.to_bytes(extractor) == data  # the file holds exactly what the extractor computes with
    assert extractor.describe()["weights_sha256"] == ex.SHA256[name]
    assert set(extractor.accuracy) == {*HEADS, "shape_object"}


def test_a_damaged_or_missing_shipped_file_is_refused(tmp_path, monkeypatch):
    data = bytearray((ex.DETECTOR_DIR / "tiny.npz").read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / "tiny.npz").write_bytes(bytes(data))
    monkeypatch.setattr(ex, "DETECTOR_DIR", tmp_path)
    ex.shipped.cache_clear()
    try:
        with pytest.raises(DataError, match=r"tiny\.npz: SHA-256 .* reinstall icr-studies"):
            ex.shipped("tiny")
        with pytest.raises(DataError, match=r"default\.npz: not found; reinstall"):
            ex.shipped("default")
        with pytest.raises(DataError, match="valid: tiny"):
            ex.shipped("huge")
    finally:
        ex.shipped.cache_clear()


def test_training_is_deterministic_and_leaves_the_caller_alone():
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    first, accuracy = train_detector(THIN)
    assert torch.get_num_threads() == threads  # the caller's threads and RNG are left alone
    assert torch.equal(torch.get_rng_state(), rng)
    second, _ = train_detector(THIN)
    for name, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[name]), name
    assert set(accuracy) == {*HEADS, "shape_object"}


def test_head_accuracy_counts_the_boxes_each_head_is_trained_on():
    """Hand-made case: two boxes, one an object's (every object head labelled), one background
    (shape and tone only); heads that read feature 0 as their class."""
    heads = torch.nn.ModuleDict({name: torch.nn.Linear(2, len(classes), bias=False)
                                 for name, classes in HEADS.items()})
    with torch.no_grad():
        for head in heads.values():
            head.weight.zero_()
            head.weight[1, 0] = 1.0  # class 1 when feature 0 is positive, else class 0
    features = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]])  # (1, 2, 2): predicts 1, then 0
    labels = np.full((1, 2, len(HEADS)), det.IGNORE, dtype=np.int64)
    labels[0, 0, [det.COLUMN[h] for h in det.OBJECT_HEADS]] = [1, 1, 0, 1]  # size wrong
    labels[0, 1, det.COLUMN["shape"]] = BACKGROUND  # predicted 0: wrong
    labels[0, 1, det.COLUMN["tone"]] = 0  # right
    got = head_accuracy(heads, features, labels)
    assert got == {"shape": 0.5, "shape_object": 1.0, "colour": 1.0, "size": 0.0,
                   "texture": 1.0, "tone": 1.0}


def test_scenes_label_every_box_as_the_benchmark_owns_it():
    data = detector_scenes(6, seed=3)
    assert data.pixels.shape == (6, 96, 96, 3) and data.boxes.shape == (6, 36, 4)
    column = det.COLUMN
    objects = data.labels[..., 0] != BACKGROUND  # (N, R)
    assert (data.labels[objects][:, [column[h] for h in det.OBJECT_HEADS]] >= 0).all()
    assert (data.labels[objects][:, column["tone"]] == det.IGNORE).all()
    other = data.labels[~objects]  # stuff (the background's hue and tone) and parts, pairs
    assert (other[:, [column["size"], column["texture"]]] == det.IGNORE).all()
    stuff = data.labels[..., column["tone"]] != det.IGNORE  # (N, R)
    assert np.array_equal(stuff, ~objects & (data.labels[..., column["colour"]] != det.IGNORE))
    assert 0.1 < stuff.mean() < 0.5 and 0.3 < objects.mean() < 0.7
    for image, boxes in zip(data.labels, stuff, strict=True):  # one background an image
        assert len({tuple(label) for label in image[boxes][:, [column["colour"], column["tone"]]]}) <= 1
    for k, classes in enumerate(HEADS.values()):
        assert data.labels[..., k].max() < len(classes)
    again = detector_scenes(6, seed=3)
    assert np.array_equal(again.pixels, data.pixels) and np.array_equal(again.labels, data.labels)
    assert not np.array_equal(detector_scenes(6, seed=4).pixels, data.pixels)


def _probe(train_x, train_y, test_x, test_y) -> float:
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    return float(probe.fit(train_x, train_y).score(test_x, test_y))


@pytest.fixture(scope="module")
def small_detector() -> tuple[RegionDetector, ex.ExactExtractor, dict[str, float]]:
    model, accuracy = train_detector(SMALL)
    calibration = detector_scenes(64, SMALL.seed, 0)
    return model, ex.quantize(model, calibration.pixels, calibration.boxes, "default"), accuracy


def test_a_trained_detector_reads_what_it_was_trained_on(small_detector):
    """A linear probe of the (integer) features, on scenes neither the detector nor its held-out
    heads saw, reads what the detector learnt, far better than from the same network untrained:
    what BUTD's features owe to their training. (Measured: trained colour 0.92, size 0.77,
    texture 0.41, shape 0.26; untrained 0.54, 0.47, 0.28, 0.18; chance 0.10, 0.33, 0.20, 0.08.)"""
    model, extractor, heads = small_detector
    assert heads["colour"] > 0.8 and heads["size"] > 0.6 and heads["tone"] > 0.9
    data = detector_scenes(90, seed=77)
    owned = data.labels[..., 0] != BACKGROUND  # (N, R)
    split = np.zeros_like(owned)
    split[:60] = True  # probe: train on 60 scenes' boxes, test on 30 others'
    torch.manual_seed(0)
    untrained = RegionDetector(SMALL).eval()
    calibration = detector_scenes(64, SMALL.seed, 0)
    scores = {}
    for name, network in (("trained", extractor),
                          ("untrained", ex.quantize(untrained, calibration.pixels,
                                                    calibration.boxes, "default"))):
        features = network.features(data.pixels, data.boxes)  # (N, R, D)
        labels = {a: data.labels[..., det.COLUMN[a]] for a in det.OBJECT_HEADS}  # (N, R) each
        scores[name] = {a: _probe(features[owned & split], y[owned & split],
                                  features[owned & ~split], y[owned & ~split])
                        for a, y in labels.items()}
    trained, untrained_scores = scores["trained"], scores["untrained"]
    assert trained["colour"] > 0.85 and trained["size"] > 0.65
    assert trained["texture"] > 0.3 and trained["shape"] > 0.2
    assert trained["colour"] > untrained_scores["colour"] + 0.2
    assert trained["size"] > untrained_scores["size"] + 0.15
