"""The embedded shapes benchmark: layout, determinism, truthful captions, loaders, pixel features."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from icr.config import ExperimentConfig, from_flat
from icr.data import cxc, entities, karpathy, precomp
from icr.data.synthetic import grammar, regions, writer
from icr.data.synthetic.extractor import shipped
from icr.data.synthetic.lexicon import HYPERNYMS, SHAPE_CONCEPTS, SHAPES
from icr.data.synthetic.render import render_scene
from icr.data.synthetic.semantics import TruthTable, holds, matches
from icr.data.synthetic.world import ATTRIBUTES, Background, Scene, SceneObject, position_words
from icr.errors import DataError

SPLITS = ("train", "val", "test")
TINY = writer.PRESETS["tiny"]


def _hashes(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny preset, seed 0, written by the command line."""
    out = tmp_path_factory.mktemp("shapes") / "tiny-0"
    subprocess.run(
        [sys.executable, "-m", "icr.data.synthetic", "--out", str(out), "--preset", "tiny",
         "--seed", "0"],
        check=True, capture_output=True, text=True,
    )
    return out


@pytest.fixture(scope="session")
def tiny_hashes(tiny) -> dict[str, str]:
    return _hashes(tiny)


@pytest.fixture(scope="session")
def scenes(tiny) -> dict[str, dict]:
    return writer.load_scenes(tiny)


# ------------------------------------------------------------------------------ layout, determinism


def test_cli_writes_the_layout(tiny, tiny_hashes):
    n = {s: TINY.count(s) for s in SPLITS}
    files = set(tiny_hashes)
    assert {"MANIFEST.json", "dataset_shapes.json", "scenes.json", "cxc/sits_val.csv",
            "cxc/sits_test.csv", "relevance/semantic_val.npy", "relevance/semantic_test.npy"} <= files
    for s in SPLITS:
        for name in ("ims.npy", "boxes.npy", "caps.txt", "ids.txt"):
            assert f"precomp/{s}_{name}" in files
        assert f"entities/{s}.txt" in files
    total = sum(n.values())
    assert sum(f.startswith("images/shapes_") and f.endswith(".png") for f in files) == total
    assert sum(f.startswith("entities/Sentences/") for f in files) == total
    assert sum(f.startswith("entities/Annotations/") for f in files) == total
    assert not [p for p in tiny.parent.iterdir() if p.name.startswith(".")]  # no temp folder left
    manifest = writer.read_manifest(tiny)
    assert manifest["preset"] == "tiny" and manifest["seed"] == 0
    assert manifest["generator_version"] == writer.GENERATOR_VERSION
    assert {s: manifest["counts"][s]["images"] for s in SPLITS} == n
    assert manifest["fingerprint"] == writer.fingerprint(tiny)
    with Image.open(tiny / "images" / "shapes_000000.png") as im:
        assert im.size == (TINY.image_size,) * 2 and im.mode == "RGB"


def test_same_seed_gives_identical_files_and_another_seed_differs(tmp_path, tiny_hashes):
    again = _hashes(writer.generate(tmp_path / "again", "tiny", 0))
    assert again == tiny_hashes
    other = _hashes(writer.generate(tmp_path / "other", "tiny", 1))
    assert other.keys() == tiny_hashes.keys()
    changed = [f for f in other if other[f] != tiny_hashes[f]]
    assert "dataset_shapes.json" in changed and "precomp/train_ims.npy" in changed
    assert sum(f.startswith("images/") for f in changed) == sum(TINY.count(s) for s in SPLITS)


def test_worker_processes_do_not_change_the_files(tmp_path, tiny_hashes, monkeypatch):
    monkeypatch.setattr(writer, "_BLOCK", 16)  # 4 blocks over 2 spawned workers
    assert _hashes(writer.generate(tmp_path / "pool", "tiny", 0, workers=2)) == tiny_hashes


def test_interrupted_generation_leaves_no_dataset(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_write_cxc", boom)  # after images, precomp and entities
    with pytest.raises(KeyboardInterrupt):
        writer.generate(tmp_path / "broken", "tiny", 0)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KeyboardInterrupt):
        writer.ensure_benchmark(tmp_path / "broken", "tiny", 0)
    assert list(tmp_path.iterdir()) == []


def test_ensure_benchmark_generates_once_then_reuses(tmp_path, monkeypatch, tiny_hashes):
    root = tmp_path / "shapes-tiny-0"
    assert writer.ensure_benchmark(root, "tiny", 0) == root
    assert _hashes(root) == tiny_hashes

    def never(*args, **kwargs):
        raise AssertionError("regenerated an existing benchmark")

    monkeypatch.setattr(writer, "write_benchmark", never)
    assert writer.ensure_benchmark(root, "tiny", 0) == root
    with pytest.raises(DataError, match="seed"):
        writer.ensure_benchmark(root, "tiny", 1)
    with pytest.raises(DataError, match="not empty"):
        writer.generate(root, "tiny", 0)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "file").write_text("x")
    with pytest.raises(DataError, match="MANIFEST"):
        writer.ensure_benchmark(tmp_path / "junk", "tiny", 0)
    with pytest.raises(DataError, match="preset"):
        writer.generate(tmp_path / "x", "huge", 0)


def test_ensure_benchmark_regenerates_an_older_version(tmp_path, tiny, tiny_hashes):
    root = tmp_path / "shapes-tiny-0"
    shutil.copytree(tiny, root)
    shutil.rmtree(root / "relevance")  # what a shapes-1 folder lacks
    manifest = writer.read_manifest(root)
    (root / "MANIFEST.json").write_text(json.dumps({**manifest, "generator_version": "shapes-1"}))
    with pytest.raises(DataError, match="seed"):  # another seed: never deleted
        writer.ensure_benchmark(root, "tiny", 1)
    assert writer.ensure_benchmark(root, "tiny", 0) == root
    assert _hashes(root) == tiny_hashes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no stale copy left
    writer._remove_stale(root)  # a current folder (regenerated by another process) is put back
    assert _hashes(root) == tiny_hashes
    writer._remove_stale(tmp_path / "gone")  # a folder another process removed already
    (root / "MANIFEST.json").write_text(json.dumps({**manifest, "generator_version": "shapes-99"}))
    with pytest.raises(DataError, match="generator_version"):  # newer: not ours to delete
        writer.ensure_benchmark(root, "tiny", 0)


# ------------------------------------------------------------------------------ captions


def _scene(record: dict) -> Scene:
    return Scene.from_json(record["scene"])


def test_every_caption_is_true_of_its_image(scenes):
    for record in scenes.values():
        scene = _scene(record)
        for caption in record["captions"]:
            assert holds(caption["meaning"], scene), caption["raw"]
            for mention in caption["mentions"]:
                assert 0 <= mention["object"] < len(scene.objects)


def test_captions_of_an_image_differ_in_what_they_mention(scenes):
    all_distinct = 0
    for record in scenes.values():
        raws = [c["raw"] for c in record["captions"]]
        assert len(raws) == 5 and len(set(raws)) == 5
        signatures = {
            (tuple(sorted(json.dumps(c, sort_keys=True) for c in cap["meaning"])),)
            for cap in record["captions"]
        }
        mentions = {json.dumps(c["mentions"], sort_keys=True) for c in record["captions"]}
        assert len(signatures) >= 4 and len(mentions) >= 2, raws
        all_distinct += len(mentions) == 5
    assert all_distinct >= 0.6 * len(scenes)


def test_grammar_uses_its_variety(scenes):
    captions = [c for r in scenes.values() for c in r["captions"]]
    kinds = {clause["kind"] for c in captions for clause in c["meaning"]}
    assert kinds == {"exists", "count", "relation", "background", "total"}
    mentioned = [len(c["mentions"]) for c in captions]
    assert min(mentioned) == 1 and max(mentioned) >= 3
    sizes = [len(m["attributes"]) for c in captions for m in c["mentions"] if m["attributes"]]
    assert min(sizes) == 1 and max(sizes) >= 4


def test_captions_are_specific_against_the_reference_scenes(scenes):
    """Step 2 of the grammar: no caption is true of more than MAX_TRUE_SHARE of the reference
    scenes (the calibration that brings in-batch false negatives to COCO's range)."""
    check = writer.reference_specificity(0, TINY.image_size)
    assert check.limit == int(grammar.MAX_TRUE_SHARE * writer.REFERENCE_SCENES) >= 1
    for record in scenes.values():
        for caption in record["captions"]:
            assert int(check.table.holds(caption["meaning"]).sum()) <= check.limit, caption["raw"]


def test_captions_state_part_of_the_scene(scenes):
    """LTD's premise: a caption leaves facts of its image out; the 5 together still say more."""
    for record in scenes.values():
        objects = record["scene"]["objects"]
        facts = len(objects) * len(ATTRIBUTES)
        stated = [sum(len(m["attributes"]) for m in c["mentions"]) for c in record["captions"]]
        assert max(stated) < facts
        union = {(m["object"], a) for c in record["captions"] for m in c["mentions"]
                 for a in m["attributes"]}
        assert len(union) > max(stated)


def test_hypernyms_name_sets_of_shapes():
    square = SceneObject("square", "red", "small", "solid", 10.0, 10.0, 11.0, 0.0, (0, 0, 0),
                         "left", "top")
    assert matches(square, {"shape": "polygon", "colour": "red"})
    assert matches(square, {"shape": "quadrilateral"}) and not matches(square, {"shape": "symbol"})
    assert not matches(square, {"shape": "polygon", "colour": "blue"})
    scene = Scene(96, Background("dark", "grey", (30, 30, 30), 0.0, 0.0, 0.0), (square,))
    table = TruthTable([scene])
    for concept in ("polygon", "quadrilateral", "symbol", "square", "circle"):
        meaning = [{"kind": "exists", "desc": {"shape": concept}}]
        assert table.holds(meaning).tolist() == [holds(meaning, scene)]
    for concept, members in SHAPE_CONCEPTS.items():
        assert members <= set(SHAPES) and (concept in SHAPES) == (members == {concept})


def test_every_hypernym_and_synonym_is_written(scenes):
    """The lexicon's structure is in the data: hypernyms and synonyms appear in the captions."""
    words = {w.lower().strip(",.:") for r in scenes.values() for c in r["captions"]
             for w in c["raw"].split()}
    assert {"polygon", "symbol"} & words or {"polygons", "symbols"} & words
    concepts = {d.get("shape") for r in scenes.values() for c in r["captions"]
                for clause in c["meaning"] for d in _descs(clause)}
    assert concepts & set(HYPERNYMS)
    assert len(concepts & set(SHAPES)) >= 10


def _descs(clause: dict) -> list[dict]:
    if clause["kind"] in ("exists", "count"):
        return [clause["desc"]]
    return [clause["a"], clause["b"]] if clause["kind"] == "relation" else []


def test_region_sets_look_like_butd_proposals(tiny, scenes):
    """36 boxes an image: several overlapping boxes per object, and boxes of no object (parts,
    pairs, background) -- the region sets poolings and grounding face on real data."""
    boxes = np.load(tiny / "precomp" / "train_boxes.npy")
    assert boxes.shape[1] == TINY.regions == 36
    for record, image_boxes in zip([r for r in scenes.values() if r["split"] == "train"], boxes,
                                   strict=True):
        owner = np.asarray(record["region_owner"])
        objects = np.array([o["bbox"] for o in record["scene"]["objects"]])
        iou = regions._iou(image_boxes.astype(np.float64), objects)  # (36, K)
        np.testing.assert_array_equal(owner, np.where(iou.max(1) >= 0.5, iou.argmax(1), -1))
        per_object = np.bincount(owner[owner >= 0], minlength=len(objects))
        assert per_object.min() >= 1 and per_object.mean() >= 2  # overlapping detections
        assert (owner < 0).sum() >= 36 // 8  # parts, pairs and background
        assert ((image_boxes[:, 2] - image_boxes[:, 0]) > 0.55 * TINY.image_size).any()


def test_iou_of_hand_made_boxes():
    a = np.array([[0.0, 0.0, 10.0, 10.0], [5.0, 0.0, 15.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    np.testing.assert_allclose(regions._iou(a, a[:1])[:, 0], [1.0, 50 / 150, 0.0])


def test_truth_table_agrees_with_the_plain_checker(scenes):
    records = [r for r in scenes.values() if r["split"] == "val"]
    scene_list = [_scene(r) for r in records]
    table = TruthTable(scene_list)
    for r in records:
        for caption in r["captions"]:
            expected = [holds(caption["meaning"], s) for s in scene_list]
            assert table.holds(caption["meaning"]).tolist() == expected


def test_extended_positives_are_true_other_images_and_complete(tiny, scenes):
    """Every written pair is a caption true of another image, and every such pair is written (the
    tiny preset's captions are specific, so there may be none: see the next test)."""
    for split in ("val", "test"):
        pairs = cxc.load_cxc_pairs(tiny / "cxc" / f"sits_{split}.csv")
        assert (pairs["agg_score"] == 5.0).all() and (pairs["sampling_method"] == "c2i_scene").all()
        records = [r for r in scenes.values() if r["split"] == split]
        caption_of = {c["sentid"]: (c, r["filename"]) for r in records for c in r["captions"]}
        found = set()
        for sentid, image in zip(pairs["caption"], pairs["image"], strict=True):
            caption, own = caption_of[sentid]
            assert image != own
            assert holds(caption["meaning"], _scene(scenes[image]))
            found.add((sentid, image))
        expected = {
            (c["sentid"], r2["filename"])
            for r in records for c in r["captions"] for r2 in records
            if r2 is not r and holds(c["meaning"], _scene(r2))
        }
        assert found == expected


def test_extended_positive_pairs_find_an_image_with_the_same_scene():
    """Two images of one scene: each caption is an extended positive of the other image."""
    first = writer.generate_image(0, 0, "val", TINY)
    second = writer.generate_image(0, 1, "val", TINY)
    twin = writer.generate_image(0, 2, "val", TINY)
    twin.scene, twin.captions = first.scene, first.captions
    pairs = set(writer.extended_positive_pairs([first, second, twin]))
    for k in range(5):
        assert (first.sentid(k), twin.filename) in pairs
        assert (twin.sentid(k), first.filename) in pairs
    for sentid, name in pairs:
        assert name != {im.sentid(k): im.filename for im in (first, second, twin)
                        for k in range(5)}[sentid]


# ------------------------------------------------------------------------------ loaders


def test_loaders_read_everything_back(tiny, scenes):
    manifest = writer.read_manifest(tiny)
    for split in SPLITS:
        n = TINY.count(split)
        kp = karpathy.load_karpathy(tiny / "dataset_shapes.json", split, image_root=tiny / "images")
        assert kp.num_images == n and kp.num_captions == 5 * n
        assert len(set(kp.caption_ids)) == 5 * n
        assert all(kp.image_path(i).is_file() for i in range(n))
        pc = precomp.load_precomp(tiny / "precomp", split, mmap=False)
        assert pc.features.shape == (n, TINY.regions, TINY.feature_dim)
        assert pc.features.dtype == np.float32 and np.isfinite(pc.features).all()
        assert pc.boxes.shape == (n, TINY.regions, 4)
        assert (pc.boxes >= 0).all() and (pc.boxes <= TINY.image_size).all()
        assert (pc.boxes[..., 2:] > pc.boxes[..., :2]).all()
        assert pc.images.image_ids == kp.image_ids and pc.images.captions == kp.captions
        ent = entities.load_entities(tiny / "entities", split)
        assert [e.image_id + ".png" for e in ent] == list(kp.image_ids)
        for e, first in zip(ent, range(0, 5 * n, 5), strict=True):
            _check_entities_image(e, kp.captions[first:first + 5], scenes[e.image_id + ".png"])
        if split != "train":
            i2t, t2i = cxc.extended_positives(kp, tiny / "cxc" / f"sits_{split}.csv", 3.0)
            assert sum(map(len, t2i)) == sum(map(len, i2t)) == manifest["counts"][split]["cxc_pairs"]


def _check_entities_image(image, raw_captions, record):
    assert len(image.sentences) == 5
    annotation = image.annotation
    assert (annotation.width, annotation.height) == (TINY.image_size,) * 2
    objects = record["scene"]["objects"]
    for sentence, raw, caption in zip(image.sentences, raw_captions, record["captions"], strict=True):
        assert sentence.text.replace(" ,", ",").replace(" .", ".").replace(" :", ":") == raw
        assert len(sentence.phrases) == len(caption["phrases"]) >= 1
        for phrase in sentence.phrases:
            if phrase.types == ("scene",):
                assert phrase.chain_id in annotation.scene_chains
                continue
            assert phrase.types == ("shapes",) and phrase.chain_id in annotation.boxes
    for k, obj in enumerate(objects):  # each object's own chain: its tight box, 0-based inclusive
        x0, y0, x1, y1 = obj["bbox"]
        chain = record["imgid"] * writer.CHAINS_PER_IMAGE + (1 << k)
        assert annotation.boxes[chain] == [(int(np.floor(x0)), int(np.floor(y0)),
                                            int(np.ceil(x1)) - 1, int(np.ceil(y1)) - 1)]


# ------------------------------------------------------------------------------ region features


@pytest.fixture(scope="session")
def tiny_detector(tiny):
    """The tiny preset's shipped detector, the one the manifest names."""
    extractor = shipped(TINY.detector)
    assert extractor.describe() == writer.read_manifest(tiny)["detector"]
    return extractor


def _single_object_scene(cx: float, cy: float, colour_rgb, tone: str, bg_rgb) -> Scene:
    h, v = position_words(cx, cy, 96)
    obj = SceneObject("star", "red", "large", "striped", cx, cy, 22.0, 0.0, colour_rgb, h, v)
    return Scene(96, Background(tone, "grey", bg_rgb, 6.0, 15.0, 0.5), (obj,))


def _object_feature(detector, scene: Scene, seed: int) -> np.ndarray:
    rendering = render_scene(scene, np.random.default_rng(seed))
    box = np.asarray([[rendering.boxes[0]]], dtype=np.float32)  # (1, 1, 4)
    return detector.features(rendering.pixels[None], box)[0, 0]


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_region_features_of_equal_objects_are_similar_not_equal(tiny_detector):
    red = (214, 39, 40)
    a = _object_feature(tiny_detector, _single_object_scene(15.0, 16.0, red, "dark", (30, 35, 40)), 1)
    b = _object_feature(tiny_detector, _single_object_scene(44.0, 47.0, red, "dark", (55, 40, 45)), 2)
    blue = _object_feature(tiny_detector,
                           _single_object_scene(44.0, 47.0, (40, 80, 220), "dark", (55, 40, 45)), 2)
    assert not np.allclose(a, b, atol=1e-3)
    assert _cosine(a, b) > 0.9
    assert 1 - _cosine(a, b) < 0.5 * (1 - _cosine(blue, b))  # colour moves it more than place


def test_stored_features_are_computed_from_the_png_pixels(tiny, scenes, tiny_detector):
    pc = precomp.load_precomp(tiny / "precomp", "val", mmap=False)
    name = pc.images.image_ids[0]
    pixels = np.asarray(Image.open(tiny / "images" / name).convert("RGB"))
    boxes = pc.boxes[0]
    features = tiny_detector.features(pixels[None], boxes[None])[0]  # (R, D)
    np.testing.assert_array_equal(features, pc.features[0])
    owner = scenes[name]["region_owner"]
    r = owner.index(0)  # the region of object 0
    x0, y0, x1, y1 = (int(v) for v in scenes[name]["scene"]["objects"][0]["bbox"])
    recoloured = pixels.copy()
    recoloured[y0:y1, x0:x1] = recoloured[y0:y1, x0:x1, ::-1]  # swap red and blue there only
    after = tiny_detector.features(recoloured[None], boxes[None])[0]
    assert not np.allclose(after[r], pc.features[0][r], atol=1e-3)
    # The backbone's receptive field (15 px) and RoIAlign's bilinear reach (4 px): a region
    # farther than that from the recoloured pixels keeps its feature, to the bit (integers).
    far = [i for i, b in enumerate(boxes)
           if b[0] >= x1 + 16 or b[2] <= x0 - 16 or b[1] >= y1 + 16 or b[3] <= y0 - 16]
    assert far
    for i in far:
        np.testing.assert_array_equal(after[i], pc.features[0][i])


def test_every_preset_is_a_config_value_and_2048_shares_the_default_images():
    for name in writer.PRESETS:
        assert from_flat({"data.preset": name}, ExperimentConfig()).data.preset == name
    wide, default = writer.PRESETS["default-2048"], writer.PRESETS["default"]
    assert wide.feature_dim == 2048 and default.feature_dim == 128
    a, b = (writer.generate_image(0, 7, "train", p) for p in (default, wide))
    assert np.array_equal(a.pixels, b.pixels) and [c.raw for c in a.captions] == [c.raw for c in b.captions]
    assert np.array_equal(a.region_boxes, b.region_boxes)


@pytest.mark.parametrize("name, times", [("large", 4), ("xlarge", 12)])
def test_the_larger_presets_extend_the_default_training_split(name, times):
    default, larger = writer.PRESETS["default"], writer.PRESETS[name]
    assert larger.detector == default.detector and (larger.val, larger.test) == (default.val, default.test)
    plan = writer._image_plan(larger)
    assert plan[:default.train] == writer._image_plan(default)[:default.train]
    assert sum(split == "train" for _, split in plan) == times * default.train


def test_the_command_line_refuses_zero_workers(tmp_path):
    done = subprocess.run([sys.executable, "-m", "icr.data.synthetic", "--out", str(tmp_path / "x"),
                           "--preset", "tiny", "--workers", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--workers 0" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "x").exists()
