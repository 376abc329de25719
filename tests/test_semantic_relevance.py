"""Semantic (SPICE-like) relevance of the shapes world: tuples, F1, and the files the writer stores."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from icr.data import karpathy
from icr.data.relevance import load_relevance
from icr.data.synthetic import ensure_benchmark, load_scenes, read_manifest
from icr.data.synthetic.lexicon import HYPERNYMS
from icr.data.synthetic.relevance import (
    Proposition,
    caption_relevance,
    meaning_tuples,
    tuple_f1,
)
from icr.data.synthetic.semantics import holds
from icr.data.synthetic.world import (
    RELATIONS,
    Background,
    Scene,
    SceneObject,
    position_words,
    relation_holds,
)

RED_CIRCLE = {"kind": "exists", "desc": {"shape": "circle", "colour": "red"}}
LARGE_RED_CIRCLE = {"kind": "exists", "desc": {"shape": "circle", "colour": "red", "size": "large"}}
RED_THING = {"kind": "exists", "desc": {"colour": "red"}}


@pytest.fixture(scope="module")
def tiny(workspace):
    return ensure_benchmark(workspace.data / "shapes-tiny-0", "tiny", 0)


# ------------------------------------------------------------------------------------- tuples


def test_hand_computed_tuples():
    assert meaning_tuples([LARGE_RED_CIRCLE]) == {
        ("object", "circle"),
        ("attribute", "circle", "colour", "red"), ("attribute", "object", "colour", "red"),
        ("attribute", "circle", "size", "large"), ("attribute", "object", "size", "large"),
    }
    assert meaning_tuples([RED_THING]) == {("attribute", "object", "colour", "red")}
    where = {"kind": "exists", "desc": {"hpos": "left", "vpos": "top"}}
    assert meaning_tuples([where]) == {("attribute", "object", "hpos", "left"),
                                       ("attribute", "object", "vpos", "top")}
    count = {"kind": "count", "desc": {"shape": "star", "colour": "blue"}, "n": 2}
    assert meaning_tuples([count]) == {
        ("object", "star"), ("attribute", "star", "colour", "blue"),
        ("attribute", "object", "colour", "blue"), ("count", "colour=blue,shape=star", "2"),
    }
    relation = {"kind": "relation", "rel": "right_of", "a": {"shape": "square"},
                "b": {"shape": "circle", "colour": "blue"}}
    assert meaning_tuples([relation]) == {  # "a square right of a blue circle": circle left_of square
        ("object", "square"), ("object", "circle"),
        ("attribute", "circle", "colour", "blue"), ("attribute", "object", "colour", "blue"),
        ("relation", "left_of", "circle", "square"), ("relation", "left_of", "object", "square"),
        ("relation", "left_of", "circle", "object"), ("relation", "left_of", "object", "object"),
    }
    rest = [{"kind": "background", "tone": "dark"}, {"kind": "total", "n": 3}]
    assert meaning_tuples(rest) == {("background", "tone", "dark"), ("total", "3")}
    both = {"kind": "background", "tone": "light", "hue": "blue"}
    assert meaning_tuples([both]) == {("background", "tone", "light"), ("background", "hue", "blue")}
    polygon = {"kind": "exists", "desc": {"shape": "polygon", "colour": "red"}}  # a hypernym head
    assert meaning_tuples([polygon]) == {("object", "polygon"),
                                         ("attribute", "polygon", "colour", "red"),
                                         ("attribute", "object", "colour", "red")}
    # a conjunction is the union; a repeated proposition counts once
    assert meaning_tuples([RED_CIRCLE, RED_THING, *rest]) == (
        meaning_tuples([RED_CIRCLE]) | meaning_tuples(rest))


def test_converse_relations_and_orders_of_attributes_are_synonyms():
    a, b = {"shape": "square", "size": "small"}, {"colour": "green"}

    def rel(name, x, y):
        return [{"kind": "relation", "rel": name, "a": x, "b": y}]

    assert meaning_tuples(rel("left_of", a, b)) == meaning_tuples(rel("right_of", b, a))
    assert meaning_tuples(rel("above", a, b)) == meaning_tuples(rel("below", b, a))
    assert meaning_tuples(rel("next_to", a, b)) == meaning_tuples(rel("next_to", b, a))
    assert meaning_tuples(rel("left_of", a, b)) != meaning_tuples(rel("left_of", b, a))
    assert meaning_tuples(rel("above", a, b)) != meaning_tuples(rel("left_of", a, b))
    swapped = {"kind": "exists", "desc": {"colour": "red", "shape": "circle"}}  # dict order
    assert meaning_tuples([swapped]) == meaning_tuples([RED_CIRCLE])
    count = [{"kind": "count", "desc": {"colour": "red", "shape": "circle"}, "n": 2}]
    assert meaning_tuples(count) == meaning_tuples(
        [{"kind": "count", "desc": {"shape": "circle", "colour": "red"}, "n": 2}])


def test_synonymous_words_of_the_generated_captions_give_the_same_tuples(tiny):
    """"box" and "square", "big" and "large" in the captions: one shape tuple, one size tuple."""
    captions = [c for r in load_scenes(tiny).values() for c in r["captions"]]
    for words, tup in ((("box", "square"), ("object", "square")),
                       (("big", "large"), ("attribute", "object", "size", "large"))):
        for word in words:
            with_word = [c for c in captions if word in c["raw"].lower().rstrip(".").split()]
            assert with_word, word
            assert all(tup in meaning_tuples(c["meaning"]) for c in with_word), word


# ------------------------------------------------------------------------------------- F1


def _f1_loop(query: set, reference: set) -> float:
    """SPICE's F-score as written: precision, recall, their harmonic mean."""
    if not query or not reference:
        return 0.0
    matched = sum(t in reference for t in query)
    precision, recall = matched / len(query), sum(t in query for t in reference) / len(reference)
    return 0.0 if matched == 0 else 2 * precision * recall / (precision + recall)


def test_tuple_f1_hand_computed_and_against_a_loop():
    queries = [{"a", "b"}, {"a", "b", "c", "d"}, {"x"}, set()]
    refs = [{"a", "b", "c"}, {"b"}, set()]
    f1 = tuple_f1(queries, refs)
    assert f1.shape == (4, 3) and f1.dtype == np.float32
    # {a, b} vs {a, b, c}: P = 1, R = 2/3, F1 = 2 * 2 / (2 + 3) = 0.8
    assert f1[0, 0] == pytest.approx(0.8)
    # {a, b, c, d} vs {b}: P = 1/4, R = 1, F1 = 2 * 1 / (4 + 1) = 0.4
    assert f1[1, 1] == pytest.approx(0.4)
    assert f1[2].tolist() == [0, 0, 0] and f1[3].tolist() == [0, 0, 0] and f1[:, 2].tolist() == [0] * 4
    rng = random.Random(0)
    queries = [set(rng.sample(range(30), rng.randint(0, 8))) for _ in range(40)]
    refs = [set(rng.sample(range(30), rng.randint(0, 15))) for _ in range(25)]
    expected = np.array([[_f1_loop(q, r) for r in refs] for q in queries])
    np.testing.assert_allclose(tuple_f1(queries, refs), expected, atol=1e-6)


def test_a_more_specific_description_shares_the_partial_tuples():
    # Q = "a red circle": 3 tuples; R = "a large red circle": 5 tuples, all 3 of Q among them.
    # P = 1, R = 3/5, F1 = 2 * 3 / (3 + 5) = 0.75
    f1 = caption_relevance([[RED_CIRCLE], [RED_THING]], [[[LARGE_RED_CIRCLE]]])
    assert f1[0, 0] == pytest.approx(0.75)
    # "a red shape" (1 tuple) is entailed by "a large red circle": F1 = 2 * 1 / (1 + 5)
    assert f1[1, 0] == pytest.approx(1 / 3)
    blue_square = {"kind": "exists", "desc": {"shape": "square", "colour": "blue"}}
    assert caption_relevance([[RED_CIRCLE]], [[[blue_square]]])[0, 0] == 0.0


def test_relevance_against_the_union_of_an_images_captions():
    background = {"kind": "background", "tone": "light"}
    images = [
        [[RED_CIRCLE], [background]],  # reference tuples: 3 + 1 = 4
        [[RED_CIRCLE]],  # 3
        [[LARGE_RED_CIRCLE], [RED_THING, background]],  # 5 + 1 = 6
    ]
    queries = [[RED_CIRCLE], [background], [RED_CIRCLE, background]]
    f1 = caption_relevance(queries, images)
    expected = np.array([
        [2 * 3 / (3 + 4), 1.0, 2 * 3 / (3 + 6)],
        [2 * 1 / (1 + 4), 0.0, 2 * 1 / (1 + 6)],
        [1.0, 2 * 3 / (4 + 3), 2 * 4 / (4 + 6)],
    ])
    np.testing.assert_allclose(f1, expected, atol=1e-6)
    # A caption against its own image (query 0 is image 0's first caption): precision 1, recall
    # 3/4; not set to 1.0, as TERN's SPICE relevance does not.
    assert f1[0, 0] == pytest.approx(6 / 7) and f1[0, 0] < f1[0, 1]


# ------------------------------------------------------------------------------------- scenes


def _scene() -> Scene:
    def obj(shape, colour, cx, cy):
        h, v = position_words(cx, cy, 96)
        return SceneObject(shape, colour, "small", "solid", cx, cy, 11.0, 0.0, (0, 0, 0), h, v)

    objects = (obj("circle", "red", 15.0, 15.0), obj("circle", "red", 75.0, 15.0),
               obj("star", "blue", 45.0, 75.0))
    return Scene(96, Background("dark", "blue", (20, 20, 20), 0.0, 0.0, 0.0), objects)


# --- the oracle: every tuple true of a scene ---------------------------------------------------

COUNTED = ("shape", "colour", "size", "texture")  # what the grammar's count clauses describe


def _concepts(shape: str) -> list[str]:
    """A shape and every hypernym that names it (``HYPERNYMS``)."""
    return [shape] + [h for h, members in HYPERNYMS.items() if shape in members]


def scene_meaning(scene: Scene) -> list[dict]:
    """A meaning that says everything the tuple vocabulary can say about ``scene``.

    Every object with all its attributes (once per shape concept: its shape and each hypernym of
    it), every count of two or more objects sharing some of shape, colour, size and texture (the
    counts the grammar states), every relation that holds between two objects (by shape concept),
    the background and the number of objects. It is true of ``scene`` (``holds``),
    and its tuples contain those of every true caption.
    """
    objects = scene.objects
    meaning: list[dict] = [
        {"kind": "exists", "desc": {**{a: o.attribute(a) for a in ("colour", "size", "texture",
                                                                    "hpos", "vpos")},
                                    "shape": concept}}
        for o in objects for concept in _concepts(o.shape)
    ]
    for r in range(1, len(COUNTED) + 1):
        for names in itertools.combinations(COUNTED, r):
            groups: dict[tuple[str, ...], int] = {}
            for o in objects:
                value = tuple(o.attribute(a) for a in names)
                groups[value] = groups.get(value, 0) + 1
            meaning += [{"kind": "count", "desc": dict(zip(names, value, strict=True)), "n": n}
                        for value, n in groups.items() if n >= 2]
    for x, y in itertools.permutations(objects, 2):
        rels = [rel for rel in RELATIONS if relation_holds(rel, x, y, scene.size)]
        meaning += [{"kind": "relation", "rel": rel, "a": {"shape": cx}, "b": {"shape": cy}}
                    for rel in rels for cx in _concepts(x.shape) for cy in _concepts(y.shape)]
    meaning.append({"kind": "background", "tone": scene.background.tone,
                    "hue": scene.background.hue})
    meaning.append({"kind": "total", "n": len(objects)})
    return meaning


def scene_tuples(scene: Scene) -> frozenset[Proposition]:
    """Every tuple true of ``scene`` (the tuples of ``scene_meaning``)."""
    return meaning_tuples(scene_meaning(scene))


def test_scene_tuples_hold_and_contain_every_true_caption(tiny):
    scene = _scene()
    assert holds(scene_meaning(scene), scene)
    tuples = scene_tuples(scene)
    assert ("count", "colour=red,shape=circle", "2") in tuples
    assert ("count", "shape=circle", "2") in tuples and ("count", "shape=star", "2") not in tuples
    assert ("relation", "left_of", "circle", "circle") in tuples
    assert ("relation", "above", "circle", "star") in tuples
    assert ("relation", "above", "star", "circle") not in tuples
    assert ("total", "3") in tuples and ("background", "tone", "dark") in tuples
    assert ("background", "hue", "blue") in tuples and ("relation", "above", "circle", "symbol") in tuples
    for record in load_scenes(tiny).values():
        scene = Scene.from_json(record["scene"])
        assert holds(scene_meaning(scene), scene)
        truth = scene_tuples(scene)
        for caption in record["captions"]:
            assert meaning_tuples(caption["meaning"]) <= truth, caption["raw"]


# ------------------------------------------------------------------------------------- files


def test_stored_matrices_follow_the_karpathy_order(tiny):
    manifest = read_manifest(tiny)
    assert manifest["relevance"]["semantic"] == {
        "val": "relevance/semantic_val.npy", "test": "relevance/semantic_test.npy"}
    scenes = load_scenes(tiny)
    for split in ("val", "test"):
        kp = karpathy.load_karpathy(tiny / "dataset_shapes.json", split)
        matrix = load_relevance(tiny / manifest["relevance"]["semantic"][split],
                                kp.num_captions, kp.num_images)
        assert matrix.dtype == np.float32 and matrix.shape == (5 * kp.num_images, kp.num_images)
        meaning = {c["sentid"]: c["meaning"] for r in scenes.values() for c in r["captions"]}
        refs = [set().union(*(meaning_tuples(c["meaning"]) for c in scenes[name]["captions"]))
                for name in kp.image_ids]
        for i, j in itertools.product(range(kp.num_captions), range(kp.num_images)):
            expected = _f1_loop(set(meaning_tuples(meaning[kp.caption_ids[i]])), refs[j])
            assert matrix[i, j] == pytest.approx(expected, abs=1e-6), (split, i, j)
        own = matrix[np.arange(kp.num_captions), kp.caption_image]
        assert (own > 0).all() and (own < 1).any()  # precision 1, recall < 1: not 1.0 by fiat
