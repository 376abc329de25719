"""Linear attribute probes: oracles on constructed embeddings, and labels from hand-written records."""

import itertools

import numpy as np
import pytest

from icr.analysis.probe import (
    FAMILIES,
    LABELS,
    Label,
    caption_labels,
    family_means,
    fit_linear_probe,
    image_labels,
    label_matrix,
    probe,
    roc_auc,
    split_targets,
)
from icr.data.types import CaptionedImages
from icr.errors import DataError


def _obj(shape, colour, size, texture, hpos, vpos):
    return {"shape": shape, "colour": colour, "size": size, "texture": texture, "hpos": hpos,
            "vpos": vpos, "cx": 10.0, "cy": 10.0}


RECORD = {
    "filename": "shapes_000007.png",
    "scene": {
        "background": {"tone": "dark", "hue": "green"},
        "objects": [_obj("circle", "red", "small", "striped", "left", "top"),
                    _obj("star", "blue", "large", "solid", "right", "bottom"),
                    _obj("star", "blue", "small", "solid", "centre", "bottom")],
    },
    "captions": [
        {"sentid": 35, "raw": "A red circle at the top on a dark background.",
         "meaning": [{"kind": "exists", "desc": {"shape": "circle", "colour": "red", "vpos": "top"}},
                     {"kind": "background", "tone": "dark"}]},
        {"sentid": 36, "raw": "A small object left of a big star.",
         "meaning": [{"kind": "relation", "rel": "left_of", "a": {"size": "small"},
                      "b": {"size": "large", "shape": "star"}}]},
        {"sentid": 37, "raw": "Three shapes, among them a striped circle.",
         "meaning": [{"kind": "total", "n": 3},
                     {"kind": "exists", "desc": {"texture": "striped", "shape": "circle"}}]},
        {"sentid": 38, "raw": "Two solid shapes on a light green background.",  # a count clause
         "meaning": [{"kind": "count", "desc": {"texture": "solid"}, "n": 2},  # counts a subset
                     {"kind": "background", "tone": "light", "hue": "green"}]},
    ],
}


def test_image_labels_of_a_hand_written_scene():
    assert image_labels(RECORD) == {
        "shape=circle", "shape=star", "colour=red", "colour=blue", "size=small", "size=large",
        "texture=striped", "texture=solid", "hpos=left", "hpos=right", "hpos=centre", "vpos=top",
        "vpos=bottom", "count=3", "background=dark", "background_hue=green",
    }


@pytest.mark.parametrize("index, expected", [
    (0, {"shape=circle", "colour=red", "vpos=top", "background=dark"}),
    (1, {"size=small", "size=large", "shape=star"}),
    (2, {"count=3", "texture=striped", "shape=circle"}),
    (3, {"texture=solid", "background=light", "background_hue=green"}),
])
def test_caption_labels_state_only_what_the_caption_says(index, expected):
    assert caption_labels(RECORD["captions"][index]) == expected


def test_label_space_covers_every_family_once_per_value():
    names = [label.name for label in LABELS]
    assert len(names) == len(set(names))
    assert {label.family for label in LABELS} == set(FAMILIES)
    assert sum(label.family == "count" for label in LABELS) == 6  # scenes of 3 to 8 objects


def test_split_targets_follow_the_split_order_not_the_record_order():
    split = CaptionedImages(
        split="test", image_ids=("shapes_000007.png",), captions=("c", "a", "b", "d"),
        caption_ids=(37, 35, 36, 38), caption_image=np.zeros(4, dtype=np.int64),
    )
    images, captions = split_targets({"shapes_000007.png": RECORD}, split)
    col = {label.name: k for k, label in enumerate(LABELS)}
    assert images.shape == (1, len(LABELS)) and captions.shape == (4, len(LABELS))
    assert images[0, col["count=3"]] and not images[0, col["count=4"]]
    assert captions[0, col["count=3"]] and not captions[1, col["count=3"]]  # sentid 37 first
    assert captions[1, col["background=dark"]] and captions[2, col["size=large"]]
    with pytest.raises(DataError, match="no record"):
        split_targets({}, split)


def _auc_oracle(scores, labels):
    """Probability that a random positive outscores a random negative, ties counted half."""
    pos, neg = scores[labels], scores[~labels]
    wins = sum((p > n) + 0.5 * (p == n) for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_roc_auc_matches_pair_counting_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 6, size=(60, 3)).astype(float)  # many ties
    labels = rng.random((60, 3)) < 0.4
    expected = [_auc_oracle(scores[:, k], labels[:, k]) for k in range(3)]
    np.testing.assert_allclose(roc_auc(scores, labels), expected, atol=1e-12)
    assert np.isnan(roc_auc(scores[:, :1], np.zeros((60, 1), dtype=bool))[0])


def _random_labels(rng, n, rate=0.3):
    return rng.random((n, len(LABELS))) < rate  # (N, K)


def test_probe_reads_an_attribute_encoded_linearly():
    rng = np.random.default_rng(1)
    y_tr, y_te = _random_labels(rng, 1500), _random_labels(rng, 800)
    dim = 2 * len(LABELS)
    mix = rng.normal(size=(len(LABELS), dim))  # labels spread over all dimensions

    def embed(y):  # (N, dim): a linear image of the labels, plus noise
        return (y * 2.0 - 1.0) @ mix + 2.0 * rng.normal(size=(len(y), dim))

    result = probe(embed(y_tr), y_tr, embed(y_te), y_te)
    assert not result.skipped
    assert min(result.per_value.values()) > 0.98
    assert set(result.per_family) == set(FAMILIES)


def test_probe_of_random_embeddings_is_at_chance():
    rng = np.random.default_rng(2)
    y_tr, y_te = _random_labels(rng, 1500), _random_labels(rng, 1500)
    result = probe(rng.normal(size=(1500, 32)), y_tr, rng.normal(size=(1500, 32)), y_te)
    assert abs(np.mean(list(result.per_value.values())) - 0.5) < 0.02
    assert all(abs(v - 0.5) < 0.06 for v in result.per_family.values())


def test_probe_skips_values_with_too_few_positives_and_only_those():
    rng = np.random.default_rng(3)
    y_tr, y_te = _random_labels(rng, 400), _random_labels(rng, 400)
    rare = [k for k, label in enumerate(LABELS) if label.family == "background"]
    y_te[:, rare] = False
    y_te[:5, rare] = True  # 5 positives on test: below min_positives
    result = probe(rng.normal(size=(400, 8)), y_tr, rng.normal(size=(400, 8)), y_te,
                   min_positives=20)
    assert set(result.skipped) == {label.name for label in LABELS if label.family == "background"}
    assert "background" not in result.per_family
    assert len(result.per_value) == len(LABELS) - len(rare)


def test_fit_probe_separates_a_separable_column_and_is_scale_invariant():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(300, 5))
    y = (x[:, [2]] > 0.1)  # (N, 1)
    for scale in (1.0, 1000.0):  # features are standardised, so the scale does not matter
        fitted = fit_linear_probe(x * scale, y)
        assert roc_auc(fitted.scores(x * scale), y)[0] == pytest.approx(1.0)


def test_family_means_average_within_a_family():
    labels = (Label("colour", "colour=red"), Label("colour", "colour=blue"),
              Label("size", "size=small"))
    assert family_means({"colour=red": 0.9, "colour=blue": 0.7}, labels) == {"colour": 0.8}
    assert label_matrix([{"size=small", "unknown=x"}], labels).tolist() == [[False, False, True]]
