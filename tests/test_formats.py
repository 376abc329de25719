"""Round trips through every format's writer and loader, the real CxC samples, and loader errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from icr.data.cxc import extended_positives, load_cxc_pairs, write_cxc_sits
from icr.data.entities import (
    EntityAnnotation,
    EntitySentence,
    Phrase,
    format_sentence,
    load_annotation,
    load_entities,
    load_sentences,
    load_split_ids,
    parse_sentence_line,
    write_annotation,
    write_sentences,
    write_split_ids,
)
from icr.data.karpathy import load_karpathy, write_karpathy_json
from icr.data.precomp import load_precomp, write_precomp
from icr.data.relevance import load_relevance, save_relevance
from icr.data.types import CaptionedImages
from icr.errors import DataError

CXC = Path(__file__).resolve().parent / "fixtures" / "cxc"  # real CxC samples: see its README


def raises_naming(path: Path, match: str = ""):
    """Context manager: a one-line DataError naming ``path`` (and containing ``match``)."""

    class _Check:
        def __enter__(self):
            self.ctx = pytest.raises(DataError)
            self.info = self.ctx.__enter__()
            return self.info

        def __exit__(self, *exc):
            suppressed = self.ctx.__exit__(*exc)
            message = str(self.info.value)
            assert "\n" not in message, message
            assert str(path) in message, message
            assert match in message, message
            return suppressed

    return _Check()


# ----------------------------------------------------------------------------------------- karpathy


def _karpathy_images() -> list[dict]:
    def sentences(name: str, n: int = 5) -> list[str]:
        return [f"A {name} photo, number {k}." for k in range(n)]

    return [
        {"split": "train", "filename": "a.jpg", "filepath": "train2014",
         "sentences": sentences("a")},
        {"split": "test", "filename": "b.jpg", "filepath": "val2014",
         "sentences": sentences("b", 6)},
        {"split": "restval", "filename": "c.jpg", "filepath": "val2014",
         "sentences": sentences("c")},
        {"split": "val", "filename": "d.jpg", "filepath": "val2014", "sentences": sentences("d")},
        {"split": "test", "filename": "e.jpg", "filepath": "val2014", "sentences": sentences("e")},
    ]


def test_karpathy_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "dataset_coco.json"
    write_karpathy_json(path, "coco", _karpathy_images())
    raw = json.loads(path.read_text())
    assert raw["dataset"] == "coco" and raw["images"][1]["sentids"] == list(range(5, 11))
    assert raw["images"][0]["sentences"][0]["tokens"] == ["a", "a", "photo", "number", "0"]

    test = load_karpathy(path, "test", image_root=tmp_path)
    assert test.image_ids == ("b.jpg", "e.jpg")
    assert test.num_captions == 10  # b's sixth caption is dropped
    assert test.caption_ids == (5, 6, 7, 8, 9, 21, 22, 23, 24, 25)
    np.testing.assert_array_equal(test.caption_image, [0] * 5 + [1] * 5)
    assert test.captions[5] == "A e photo, number 0."
    assert test.tokens is not None and test.tokens[0][:2] == ("a", "b")
    assert test.image_path(1) == tmp_path / "val2014" / "e.jpg"

    train = load_karpathy(path, "train")
    assert train.split == "train" and train.image_ids == ("a.jpg", "c.jpg")  # restval folded in
    assert train.image_root is None


def test_karpathy_errors(tmp_path: Path) -> None:
    path = tmp_path / "k.json"
    images = _karpathy_images()
    images[4]["sentences"] = images[4]["sentences"][:3]
    write_karpathy_json(path, "coco", images)
    with raises_naming(path, "'e.jpg'"):
        load_karpathy(path, "test")
    load_karpathy(path, "test", captions_per_image=3)
    with raises_naming(path, "split"):
        load_karpathy(path, "restval")

    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:200])
    with raises_naming(truncated, "not valid JSON"):
        load_karpathy(truncated, "test")
    with raises_naming(tmp_path / "missing.json", "not found"):
        load_karpathy(tmp_path / "missing.json", "test")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([1, 2]))
    with raises_naming(wrong, "images"):
        load_karpathy(wrong, "val")


# ------------------------------------------------------------------------------------------ precomp


@pytest.fixture()
def precomp_data() -> dict:
    rng = np.random.default_rng(0)
    n, r, d = 3, 4, 6
    return {
        "features": rng.normal(size=(n, r, d)).astype(np.float32),
        "boxes": rng.uniform(0, 100, size=(n, r, 4)).astype(np.float32),
        "captions": [f"caption {i} über café" for i in range(5 * n)],
        "ids": ["101", "102", "103"],
    }


def test_precomp_round_trip(tmp_path: Path, precomp_data: dict) -> None:
    write_precomp(tmp_path, "test", **precomp_data)
    loaded = load_precomp(tmp_path, "test")
    assert isinstance(loaded.features, np.memmap)
    np.testing.assert_array_equal(loaded.features, precomp_data["features"])
    np.testing.assert_array_equal(loaded.boxes, precomp_data["boxes"])
    assert loaded.images.captions == tuple(precomp_data["captions"])
    assert loaded.images.image_ids == ("101", "102", "103")
    np.testing.assert_array_equal(loaded.images.caption_image, np.repeat(np.arange(3), 5))

    write_precomp(tmp_path, "dev", **{**precomp_data, "boxes": None})
    dev = load_precomp(tmp_path, "dev", mmap=False)
    assert dev.boxes is None and not isinstance(dev.features, np.memmap)


@pytest.mark.parametrize("repeat_ids", [True, False])
def test_precomp_repeated_release(tmp_path: Path, precomp_data: dict, repeat_ids: bool) -> None:
    ids = [i for i in precomp_data["ids"] for _ in range(5)] if repeat_ids else precomp_data["ids"]
    np.save(tmp_path / "train_ims.npy", np.repeat(precomp_data["features"], 5, axis=0))
    np.save(tmp_path / "train_boxes.npy", np.repeat(precomp_data["boxes"], 5, axis=0))
    (tmp_path / "train_caps.txt").write_text("\n".join(precomp_data["captions"]) + "\n", "utf-8")
    (tmp_path / "train_ids.txt").write_text("\n".join(ids) + "\n")
    loaded = load_precomp(tmp_path, "train")
    np.testing.assert_array_equal(loaded.features, precomp_data["features"])
    np.testing.assert_array_equal(loaded.boxes, precomp_data["boxes"])
    assert loaded.images.image_ids == tuple(precomp_data["ids"])
    assert loaded.images.num_captions == 15


def test_precomp_errors(tmp_path: Path, precomp_data: dict) -> None:
    write_precomp(tmp_path, "test", **precomp_data)
    caps = tmp_path / "test_caps.txt"
    caps.write_text("\n".join(precomp_data["captions"][:-1]) + "\n", encoding="utf-8")
    with raises_naming(tmp_path, "test_caps.txt has 14 captions"):
        load_precomp(tmp_path, "test")
    caps.write_text("\n".join(precomp_data["captions"]) + "\n", encoding="utf-8")

    np.save(tmp_path / "test_boxes.npy", np.zeros((3, 5, 4), np.float32))
    with raises_naming(tmp_path / "test_boxes.npy", "(3, 5, 4)"):
        load_precomp(tmp_path, "test")
    np.save(tmp_path / "test_ims.npy", np.zeros((3, 6), np.float32))
    with raises_naming(tmp_path / "test_ims.npy", "3-d"):
        load_precomp(tmp_path, "test")
    (tmp_path / "test_ims.npy").write_bytes(b"\x93NUMPY garbage")
    with raises_naming(tmp_path / "test_ims.npy"):
        load_precomp(tmp_path, "test")
    with raises_naming(tmp_path / "val_ims.npy", "not found"):
        load_precomp(tmp_path, "val")


# ----------------------------------------------------------------------------------------- entities

README_LINE = ("[/EN#18/people A child] in [/EN#19/clothing a pink dress] is climbing up "
               "[/EN#20/other a set of stairs] in [/EN#21/scene an entry way] .")


def test_parse_sentence_line() -> None:
    sentence = parse_sentence_line(README_LINE + "\n")
    assert sentence.text == ("A child in a pink dress is climbing up a set of stairs in an "
                             "entry way .")
    assert sentence.phrases[1] == Phrase(3, "a pink dress", 19, ("clothing",))
    assert sentence.phrases[3].first_word_index == 14
    assert format_sentence(sentence) == README_LINE

    multi = parse_sentence_line("[/EN#6729/vehicles/scene the subway] and [/EN#0/notvisual it] ]x")
    assert multi.phrases[0].types == ("vehicles", "scene")
    assert multi.phrases[1] == Phrase(3, "it", 0, ("notvisual",))
    assert multi.text == "the subway and it ]x"


@pytest.mark.parametrize("line", [
    "[/EN#18/people A child in a park .",          # never closed
    "A child] in a park .",                        # stray closing bracket
    "[/EN#x/people A child] .",                    # chain id not an integer
    "[/EN#18 A child] .",                          # no type
    "[/EN#18/people [/EN#19/people A child]] .",   # nested
    "[/EN#18/people ] .",                          # empty phrase
])
def test_malformed_entity_bracket(tmp_path: Path, line: str) -> None:
    path = tmp_path / "Sentences" / "42.txt"
    path.parent.mkdir()
    path.write_text(README_LINE + "\n" + line + "\n")
    with raises_naming(path, ":2:"):
        load_sentences(path)


def _annotation() -> EntityAnnotation:
    return EntityAnnotation(
        width=500, height=375, depth=3,
        boxes={18: [(10, 20, 110, 220), (0, 0, 49, 49)], 19: [(10, 20, 110, 220)],
               20: [(5, 5, 9, 9)]},
        nobox_chains=frozenset({22, 23}), scene_chains=frozenset({21, 23}),
    )


def test_entities_round_trip(tmp_path: Path) -> None:
    sentences = [parse_sentence_line(README_LINE), EntitySentence("Nothing here .", ())]
    ids = ["1000092795", "36979"]
    for image_id in ids:
        write_sentences(tmp_path / "Sentences" / f"{image_id}.txt", sentences)
        write_annotation(tmp_path / "Annotations" / f"{image_id}.xml", _annotation())
    write_split_ids(tmp_path / "test.txt", ids)

    xml = (tmp_path / "Annotations" / "36979.xml").read_text()
    assert xml.count("<object>") == 3 + 3  # the box shared by chains 18 and 19 is one object
    assert "<xmin>11</xmin>" in xml  # written 1-based
    assert load_split_ids(tmp_path / "test.txt") == ids
    images = load_entities(tmp_path, "test")
    assert [im.image_id for im in images] == ids
    assert images[1].sentences == sentences
    assert images[1].annotation == _annotation()


def test_entities_real_style_xml(tmp_path: Path) -> None:
    path = tmp_path / "1.xml"
    path.write_text(
        "<annotation><filename>1.jpg</filename><size><width>333</width><height>500</height>"
        "<depth>3</depth></size><object><name>5</name><name>7</name><bndbox><xmin>1</xmin>"
        "<ymin>2</ymin><xmax>30</xmax><ymax>40</ymax></bndbox></object><object><name>9</name>"
        "<nobndbox>0</nobndbox><scene>1</scene></object></annotation>")
    annotation = load_annotation(path)
    assert annotation.boxes == {5: [(0, 1, 29, 39)], 7: [(0, 1, 29, 39)]}
    assert annotation.scene_chains == {9} and not annotation.nobox_chains
    bad = tmp_path / "2.xml"
    bad.write_text("<annotation><size><width>3</width>")
    with raises_naming(bad, "malformed XML"):
        load_annotation(bad)
    with raises_naming(tmp_path / "val.txt"):
        load_entities(tmp_path, "val")


# ---------------------------------------------------------------------------------------------- CxC


def test_real_cxc_samples_load() -> None:
    sits = load_cxc_pairs(CXC / "sits_test.head.csv")
    assert sits.attrs["kind"] == "sits" and len(sits) == 300
    assert sits.loc[0, "caption"] == 732091
    assert sits.loc[0, "image"] == "COCO_val2014_000000365325.jpg"
    assert sits.loc[1, "agg_score"] == pytest.approx(4.97)
    assert sits["sampling_method"].eq("c2i_intrasim").all()
    strong = load_cxc_pairs(CXC / "sits_test.head.csv", min_score=3.0)
    assert 0 < len(strong) < 300 and strong["agg_score"].min() >= 3.0

    sis = load_cxc_pairs(CXC / "sis_test.head.csv")
    assert sis.attrs["kind"] == "sis" and len(sis) == 100
    assert sis["image1"].str.endswith(".jpg").all()
    sts = load_cxc_pairs(CXC / "sts_test.head.csv")
    assert sts.attrs["kind"] == "sts" and len(sts) == 100
    assert (sts.loc[0, "caption1"], sts.loc[0, "caption2"]) == (411553, 5142)


def _split_from(sentids_per_image: list[list[int]], images: list[str]) -> CaptionedImages:
    caption_ids = [s for group in sentids_per_image for s in group]
    return CaptionedImages(
        split="test", image_ids=tuple(images), captions=tuple(f"c{s}" for s in caption_ids),
        caption_ids=tuple(caption_ids),
        caption_image=np.repeat(np.arange(len(images)), [len(g) for g in sentids_per_image]),
    )


def test_real_cxc_maps_onto_split(caplog: pytest.LogCaptureFixture) -> None:
    rows = load_cxc_pairs(CXC / "sits_test.head.csv", min_score=3.0)
    chosen = rows.iloc[:3]
    images = list(dict.fromkeys(chosen["image"])) + ["COCO_val2014_000000000001.jpg"]
    # The chosen captions belong to the last (unrelated) image, so every chosen pair is an extra.
    sentids = [[900000 + 5 * j + k for k in range(5)] for j in range(len(images) - 1)]
    sentids.append(list(chosen["caption"]) + [1, 2])
    split = _split_from(sentids, images)
    with caplog.at_level(logging.WARNING, logger="icr.data.cxc"):
        i2t, t2i = extended_positives(split, CXC / "sits_test.head.csv", min_score=3.0)
    last = len(images) - 1
    for t, (sentid, image) in enumerate(zip(chosen["caption"], chosen["image"], strict=True)):
        caption = 5 * last + t
        assert split.caption_ids[caption] == sentid
        assert images.index(image) in t2i[caption]
        assert caption in i2t[images.index(image)]
    assert sum(map(len, i2t)) == sum(map(len, t2i)) >= 3
    assert i2t[last] == [] and t2i[0] == []
    assert f"{len(rows) - 3} of {len(rows)} pairs" in caplog.text or len(rows) == 3


def test_cxc_write_round_trip(tmp_path: Path) -> None:
    split = _split_from([[10, 11], [12, 13], [14, 15]], ["x.jpg", "y.jpg", "z.jpg"])
    path = tmp_path / "sits_test.csv"
    write_cxc_sits(path, [(10, "y.jpg", 4.5, "c2i_intrasim"), (10, "z.jpg", 2.9),
                          (15, "x.jpg", 3.0), (12, "y.jpg", 5.0), (99, "x.jpg", 5.0),
                          (14, "w.jpg", 4.0)])
    assert path.read_text().splitlines()[1] == "COCO_val2014:sentid:10,y.jpg,4.5,c2i_intrasim"
    assert len(load_cxc_pairs(path)) == 6
    i2t, t2i = extended_positives(split, path)
    assert i2t == [[5], [0], []]  # (12, y.jpg) is y's own caption; 2.9 < 3; 99 and w.jpg skipped
    assert t2i == [[1], [], [], [], [], [0]]
    i2t, _ = extended_positives(split, path, min_score=2.5)
    assert i2t == [[5], [0], [0]]


def test_cxc_errors(tmp_path: Path) -> None:
    header = tmp_path / "wrong_header.csv"
    header.write_text("caption,img,agg_score,sampling_method\nCOCO_val2014:sentid:1,a.jpg,3,x\n")
    with raises_naming(header, "header"):
        load_cxc_pairs(header)
    truncated = tmp_path / "truncated.csv"
    truncated.write_text("caption,image,agg_score,sampling_method\nCOCO_val2014:sentid:1,a.jp")
    with raises_naming(truncated, "line 2"):
        load_cxc_pairs(truncated)
    bad_caption = tmp_path / "bad_caption.csv"
    bad_caption.write_text("caption,image,agg_score,sampling_method\n1,a.jpg,3.0,x\n")
    with raises_naming(bad_caption, "sentid"):
        load_cxc_pairs(bad_caption)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with raises_naming(empty):
        load_cxc_pairs(empty)
    with raises_naming(CXC / "sis_test.head.csv", "sits"):
        extended_positives(_split_from([[1]], ["a.jpg"]), CXC / "sis_test.head.csv")


# ---------------------------------------------------------------------------------------- relevance


def test_relevance_round_trip_and_errors(tmp_path: Path) -> None:
    matrix = np.random.default_rng(0).uniform(size=(10, 2)).astype(np.float32)
    path = tmp_path / "spice.npy"
    save_relevance(path, matrix)
    np.testing.assert_array_equal(load_relevance(path, 10, 2), matrix)
    np.testing.assert_array_equal(load_relevance(path, 10, 2, mmap=True), matrix)
    with raises_naming(path, "expected (captions, images) = (10, 3)"):
        load_relevance(path, 10, 3)
    with raises_naming(path, "transposed"):
        load_relevance(path, 2, 10)
    matrix[3, 1] = np.nan
    np.save(path, matrix)
    with raises_naming(path, "1 non-finite"):
        load_relevance(path, 10, 2)
    with raises_naming(tmp_path / "none.npy", "not found"):
        load_relevance(tmp_path / "none.npy", 10, 2)
