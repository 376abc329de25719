"""GroundingSplit loaders: a hand-built Flickr30K Entities folder, errors, the embedded benchmark."""

from __future__ import annotations

import json

import numpy as np
import pytest

from icr.data.entities import (
    EntityAnnotation,
    parse_sentence_line,
    write_annotation,
    write_sentences,
    write_split_ids,
)
from icr.data.synthetic.writer import CHAINS_PER_IMAGE
from icr.errors import DataError
from icr.grounding.data import load_grounding, load_shapes_grounding

SENTENCES = {
    "img1": [
        "[/EN#1/people A man] in [/EN#2/clothing a red hat] looks at [/EN#3/other the sky] .",
        "[/EN#0/notvisual Someone] stands under [/EN#4/scene a blue sky] near [/EN#1/people the "
        "man] .",
    ],
    "img2": ["[/EN#5/animals A dog] runs ."],
}
ANNOTATIONS = {
    "img1": EntityAnnotation(100, 80, 3, {1: [(10, 10, 19, 29), (50, 5, 59, 14)],
                                          2: [(12, 8, 17, 12)]},
                             nobox_chains=frozenset({3}), scene_chains=frozenset({4})),
    "img2": EntityAnnotation(64, 64, 3, {5: [(0, 0, 63, 63)]}),
}
FEATURE_IDS = ["img1.jpg", "img2.jpg", "img3.jpg"]  # features in another order, one extra image


def _write(tmp_path, ids=FEATURE_IDS, boxes=True):
    ents, feats = tmp_path / "entities", tmp_path / "features"
    for image, lines in SENTENCES.items():
        write_sentences(ents / "Sentences" / f"{image}.txt", [parse_sentence_line(x) for x in lines])
        write_annotation(ents / "Annotations" / f"{image}.xml", ANNOTATIONS[image])
    write_split_ids(ents / "val.txt", ["img2", "img1"])
    feats.mkdir()
    rng = np.random.default_rng(0)
    ims = rng.standard_normal((3, 4, 5)).astype(np.float32)
    raw = rng.integers(0, 60, size=(3, 4, 4)).astype(np.float32)
    raw[..., 2:] += raw[..., :2]
    raw[0, 3] = 0  # img1's last region is padding
    np.save(feats / "dev_ims.npy", ims)
    if boxes:
        np.save(feats / "dev_boxes.npy", raw)
    (feats / "dev_ids.txt").write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")
    return feats, ents, ims, raw


def test_hand_built_split(tmp_path):
    feats, ents, ims, raw = _write(tmp_path)
    split = load_grounding(feats, ents, "val", features_split="dev")
    assert split.image_ids == ("img2", "img1")
    np.testing.assert_array_equal(split.region_features, ims[[1, 0]])
    np.testing.assert_array_equal(split.region_boxes, raw[[1, 0]])  # as stored
    assert split.region_mask.tolist() == [[True] * 4, [True, True, True, False]]
    assert split.image_sizes.tolist() == [[64, 64], [100, 80]]
    assert split.captions[0] == "A dog runs ." and split.caption_image.tolist() == [0, 1, 1]
    # kept: dog | man, hat (sky has no box) | the man (notvisual and scene skipped)
    assert [[p.words for p in c] for c in split.phrases] == [
        [("A", "dog")], [("A", "man"), ("a", "red", "hat")], [("the", "man")]]
    assert split.skipped == {"notvisual": 1, "no_box": 2}
    assert split.phrase_caption.tolist() == [0, 1, 1, 2]
    assert split.phrase_first.tolist() == [0, 0, 3, 7] and split.phrase_end.tolist() == [2, 2, 6, 9]
    assert split.phrase_image.tolist() == [0, 1, 1, 1]
    # annotation boxes 0-based inclusive, as the XML's 1-based values minus 1
    np.testing.assert_array_equal(split.phrase_boxes[1], [[10, 10, 19, 29], [50, 5, 59, 14]])
    np.testing.assert_array_equal(split.phrase_boxes[0], [[0, 0, 63, 63], [0, 0, 0, 0]])
    assert split.phrase_box_mask.tolist() == [[True, False], [True, True], [True, False],
                                              [True, True]]


def test_boxes_in_each_convention(tmp_path):
    feats, ents, _, raw = _write(tmp_path)
    split = load_grounding(feats, ents, "val", features_split="dev")
    regions, truth = split.boxes()  # infoground: every box as its file gives it
    assert regions is split.region_boxes and truth is split.phrase_boxes
    regions, truth = split.boxes("continuous")  # one past the last pixel
    np.testing.assert_array_equal(regions, raw[[1, 0]])  # continuous detections stay
    np.testing.assert_array_equal(truth[1], [[10, 10, 20, 30], [50, 5, 60, 15]])
    inclusive = load_grounding(feats, ents, "val", features_split="dev",
                               region_boxes_inclusive=True)
    np.testing.assert_array_equal(inclusive.region_boxes, raw[[1, 0]])
    np.testing.assert_array_equal(inclusive.boxes("infoground")[0], raw[[1, 0]])
    np.testing.assert_array_equal(inclusive.boxes("continuous")[0], raw[[1, 0]] + [0, 0, 1, 1])
    with pytest.raises(ValueError, match="box convention 'pixel' is unknown; valid: infoground"):
        split.boxes("pixel")


def test_selected_words_belong_to_phrases(tmp_path):
    feats, ents, _, _ = _write(tmp_path)
    split = load_grounding(feats, ents, "val", features_split="dev")
    words = split.words
    # "A man in a red hat looks at the sky ." -> man, red, hat, sky
    assert words.word_index[1][words.mask[1]].tolist() == [1, 4, 5, 9]
    assert split.word_phrase[1][words.mask[1]].tolist() == [1, 2, 2, -1]  # sky: no box
    assert split.word_phrase[0][words.mask[0]].tolist() == [0]  # dog
    # "Someone stands under a blue sky near the man ." -> Someone, blue, sky (scene), man
    assert split.word_phrase[2][split.words.mask[2]].tolist() == [-1, -1, -1, 3]
    piece_word = np.array([[0, -1, -1], [0, 1, 2], [3, 1, -1]])
    assert split.piece_phrase(piece_word).tolist() == [[0, -1, -1], [1, 2, 2], [3, -1, -1]]
    bare = load_grounding(feats, ents, "val", features_split="dev", select_words=False)
    assert bare.words is None and bare.word_phrase is None
    with pytest.raises(ValueError, match="selected words"):
        bare.piece_phrase(piece_word)


def test_options(tmp_path):
    feats, ents, ims, raw = _write(tmp_path)
    scene = load_grounding(feats, ents, "val", features_split="dev", scene_as_image=True)
    assert [p.words for p in scene.phrases[2]] == [("a", "blue", "sky"), ("the", "man")]
    np.testing.assert_array_equal(scene.phrases[2][0].boxes, [[0, 0, 99, 79]])
    assert scene.skipped == {"notvisual": 1, "no_box": 1}
    few = load_grounding(feats, ents, "val", features_split="dev", max_regions=2)
    assert few.region_features.shape == (2, 2, 5)
    np.testing.assert_array_equal(few.region_boxes, raw[[1, 0], :2])


def test_same_order_keeps_the_memory_map(tmp_path):
    feats, ents, _, _ = _write(tmp_path, ids=["img2.jpg", "img1.jpg"])
    for name in ("ims", "boxes"):
        array = np.load(feats / f"dev_{name}.npy")
        np.save(feats / f"dev_{name}.npy", array[:2])
    split = load_grounding(feats, ents, "val", features_split="dev")
    assert isinstance(split.region_features, np.memmap)


@pytest.mark.parametrize("case, match", [
    ("no_boxes", "dev_boxes.npy: region box file not found"),
    ("missing_image", "1 images of the entities split are missing"),
    ("count", "has 2 ids"),
    ("split", "val.txt: split file not found"),
])
def test_errors_are_one_line(tmp_path, case, match):
    ids = {"missing_image": ["img1.jpg", "img3.jpg", "img4.jpg"],
           "count": ["img1.jpg", "img2.jpg"]}.get(case, FEATURE_IDS)
    feats, ents, _, _ = _write(tmp_path, ids=ids, boxes=case != "no_boxes")
    if case == "split":
        (ents / "val.txt").unlink()
    with pytest.raises(DataError, match=match) as info:
        load_grounding(feats, ents, "val", features_split="dev")
    assert "\n" not in str(info.value)


def test_not_a_benchmark_folder(tmp_path):
    with pytest.raises(DataError, match="shapes benchmark"):
        load_shapes_grounding(tmp_path, "train")


# ------------------------------------------------------------------------ the embedded benchmark


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from icr.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("grounding") / "shapes", "tiny", seed=0, workers=1)


def test_shapes_split_matches_the_generated_files(shapes):
    manifest = json.loads((shapes / "MANIFEST.json").read_text())
    split = load_shapes_grounding(shapes, "val")
    assert split.num_images == manifest["counts"]["val"]["images"]
    assert split.num_captions == manifest["counts"]["val"]["captions"]
    np.testing.assert_array_equal(split.region_boxes, np.load(shapes / "precomp/val_boxes.npy"))
    assert split.region_mask.all()
    scenes = json.loads((shapes / "scenes.json").read_text())["images"]
    by_stem = {r["filename"].rsplit(".", 1)[0]: r for r in scenes}
    for c, phrases in enumerate(split.phrases):
        record = by_stem[split.image_ids[split.caption_image[c]]]
        for phrase in phrases:
            key = phrase.chain_id - record["imgid"] * CHAINS_PER_IMAGE
            objects = [o for k, o in enumerate(record["scene"]["objects"]) if key >> k & 1]
            assert len(phrase.boxes) == len(objects) > 0
            for box, obj in zip(phrase.boxes, objects, strict=True):  # pixels the bbox covers
                x0, y0, x1, y1 = obj["bbox"]  # inclusive: last pixel box[2], box[3]
                assert box[0] <= x0 < box[0] + 1 and box[1] <= y0 < box[1] + 1
                assert box[2] < x1 <= box[2] + 1 and box[3] < y1 <= box[3] + 1
    assert split.skipped["no_box"] > 0  # the background phrases


def test_attention_on_the_owner_region_finds_every_scored_phrase(shapes):
    """The loader's boxes, the word-phrase map and the metric agree on the ground truth."""
    split = load_shapes_grounding(shapes, "val", max_words=None)
    scenes = json.loads((shapes / "scenes.json").read_text())["images"]
    owner = {r["filename"].rsplit(".", 1)[0]: (r["imgid"], np.array(r["region_owner"]))
             for r in scenes}
    piece_word = np.where(split.words.mask, np.arange(split.words.word_index.shape[1]), -1)
    piece_phrase = split.piece_phrase(piece_word)
    regions = split.region_boxes.shape[1]
    attention = np.full((*piece_word.shape, regions), 1.0 / regions)  # (C, P, R)
    for c, p in zip(*np.nonzero(piece_phrase >= 0), strict=True):
        imgid, owners = owner[split.image_ids[split.caption_image[c]]]
        phrase = piece_phrase[c, p]
        key = split.phrases[c][phrase - np.searchsorted(split.phrase_caption, c)].chain_id
        wanted = [r for r in range(regions)
                  if owners[r] >= 0 and (key - imgid * CHAINS_PER_IMAGE) >> owners[r] & 1]
        attention[c, p] = np.eye(regions)[wanted[0]]
    for convention in ("infoground", "continuous"):
        metrics = split.evaluate(attention, piece_word, box_convention=convention)
        assert metrics["phrases"] == split.num_phrases > 0
        assert metrics["unscored"] < 20
        for name in ("R_at_1", "R_at_5", "R_at_10", "pointing"):
            assert metrics[name] == pytest.approx(100 - metrics["unscored"]), (convention, name)
    uniform = split.evaluate(np.full_like(attention, 0.5), piece_word)  # ties rank misses first
    assert uniform["R_at_1"] == 0 and uniform["R_at_10"] < metrics["R_at_10"]
