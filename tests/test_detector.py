"""The shapes world's detector: RoIAlign, training, determinism, the cache, what its features carry."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from icr.data.synthetic import detector as det
from icr.data.synthetic.detector import (
    BACKGROUND,
    HEADS,
    DetectorSpec,
    RegionDetector,
    detector_scenes,
    load_detector,
    region_features,
    roi_align,
    train_detector,
)

# Trains in seconds (about 5 CPU s): it learns colour, size and the background's tone, begins on
# texture and shape (its held-out heads: colour of objects and backgrounds 0.86, size 0.68, tone
# 1.0, texture 0.38, shape of an object's box 0.06); the floors below are measured on it with
# margin. The benchmark's detector trains for minutes (writer.py).
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


def test_training_is_deterministic_and_features_do_not_depend_on_the_chunks():
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    first, _ = train_detector(THIN)
    assert torch.get_num_threads() == threads  # the caller's threads and RNG are left alone
    assert torch.equal(torch.get_rng_state(), rng)
    second, _ = train_detector(THIN)
    assert det._weights_digest(first) == det._weights_digest(second)
    model = RegionDetector(THIN)
    model.load_state_dict(first)
    data = detector_scenes(det._CHUNK + 5, seed=11)
    whole = region_features(model, data.pixels, data.boxes)  # (N, R, D)
    assert whole.shape == (det._CHUNK + 5, 36, THIN.feature_dim) and (whole >= 0).all()
    parts = [region_features(model, data.pixels[i:i + 7], data.boxes[i:i + 7])
             for i in range(0, len(data.pixels), 7)]
    assert np.array_equal(np.concatenate(parts), whole)  # byte-identical, however split


def test_the_cache_is_keyed_on_the_definition_and_hit_on_a_second_call(tmp_path, monkeypatch):
    trained = load_detector(THIN, tmp_path, "shapes-4")
    assert [p.name for p in tmp_path.iterdir()] == [f"detector-{THIN.key('shapes-4')}.pt"]

    def never(*args, **kwargs):
        raise AssertionError("trained a detector the cache holds")

    monkeypatch.setattr(det, "train_detector", never)
    again = load_detector(THIN, tmp_path, "shapes-4")
    assert again.digest == trained.digest and again.accuracy == trained.accuracy
    for name in again.state:
        assert torch.equal(again.state[name], trained.state[name])
    path = tmp_path / f"detector-{THIN.key('shapes-4')}.pt"
    saved = torch.load(path, weights_only=True)
    torch.save({**saved, "digest": "0" * 64}, path)  # a damaged entry is trained again
    monkeypatch.undo()
    assert load_detector(THIN, tmp_path, "shapes-4").digest == trained.digest
    assert THIN.key("shapes-5") != THIN.key("shapes-4")  # another generator: another entry
    assert DetectorSpec(epochs=3).key("shapes-4") != DetectorSpec(epochs=4).key("shapes-4")
    monkeypatch.setattr(det, "train_detector", never)
    with pytest.raises(AssertionError, match="cache holds"):
        load_detector(dataclasses.replace(THIN, scenes=9), tmp_path, "shapes-4")


def _probe(train_x, train_y, test_x, test_y) -> float:
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    return float(probe.fit(train_x, train_y).score(test_x, test_y))


@pytest.fixture(scope="module")
def small_detector() -> tuple[RegionDetector, dict[str, float]]:
    state, accuracy = train_detector(SMALL)
    model = RegionDetector(SMALL)
    model.load_state_dict(state)
    return model, accuracy


def test_a_trained_detector_reads_what_it_was_trained_on(small_detector):
    """A linear probe of the features, on scenes neither the detector nor its held-out heads saw,
    reads what the detector learnt, far better than from the same network untrained: what BUTD's
    features owe to their training. (Measured: trained colour 0.92, size 0.77, texture 0.41,
    shape 0.26; untrained 0.54, 0.47, 0.28, 0.18; chance 0.10, 0.33, 0.20, 0.08.)"""
    model, heads = small_detector
    assert heads["colour"] > 0.8 and heads["size"] > 0.6 and heads["tone"] > 0.9
    data = detector_scenes(90, seed=77)
    owned = data.labels[..., 0] != BACKGROUND  # (N, R)
    split = np.zeros_like(owned)
    split[:60] = True  # probe: train on 60 scenes' boxes, test on 30 others'
    torch.manual_seed(0)
    untrained = RegionDetector(SMALL)
    scores = {}
    for name, network in (("trained", model), ("untrained", untrained)):
        features = region_features(network, data.pixels, data.boxes)  # (N, R, D)
        labels = {a: data.labels[..., det.COLUMN[a]] for a in det.OBJECT_HEADS}  # (N, R) each
        scores[name] = {a: _probe(features[owned & split], y[owned & split],
                                  features[owned & ~split], y[owned & ~split])
                        for a, y in labels.items()}
    trained, untrained_scores = scores["trained"], scores["untrained"]
    assert trained["colour"] > 0.85 and trained["size"] > 0.65
    assert trained["texture"] > 0.3 and trained["shape"] > 0.2
    assert trained["colour"] > untrained_scores["colour"] + 0.2
    assert trained["size"] > untrained_scores["size"] + 0.15
