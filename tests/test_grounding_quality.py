"""Negative quality: hand-built scenes and captions, aggregation, and the generated benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from icr.data.synthetic.grammar import BACKGROUND_KEY
from icr.data.synthetic.lexicon import lexicon
from icr.data.synthetic.semantics import holds
from icr.data.synthetic.world import COLOURS, Background, Scene, SceneObject, position_words
from icr.grounding.negatives import NegativeCaptions
from icr.grounding.quality import (
    CaptionNegatives,
    CaptionTruth,
    judge_substitution,
    load_shapes_truth,
    negative_quality,
)


def _words(text: str) -> list[str]:
    return text.split()


def _object(shape: str, colour: str, cx: float, cy: float) -> SceneObject:
    hpos, vpos = position_words(cx, cy, 96)
    return SceneObject(shape, colour, "medium", "solid", cx, cy, 14.0, 0.0, COLOURS[colour],
                       hpos, vpos)


RED_SQUARE = _object("square", "red", 15, 15)  # left, top
BLUE_CIRCLE = _object("circle", "blue", 81, 81)  # right, bottom
RED_CIRCLE = _object("circle", "red", 48, 48)  # centre, middle


def _scene(*objects: SceneObject) -> Scene:
    return Scene(96, Background("dark", "blue", (10, 20, 60), 0.0, 0.0, 0.0), tuple(objects))


SCENE_A = _scene(RED_SQUARE, BLUE_CIRCLE)
SCENE_B = _scene(RED_SQUARE, BLUE_CIRCLE, RED_CIRCLE)


def _truth(text: str, meaning: list[dict], phrases: list[tuple[int, int, int]], scene: Scene
           ) -> CaptionTruth:
    truth = CaptionTruth(tuple(text.split()), tuple(meaning), tuple(phrases), scene)
    assert holds(truth.meaning, scene)  # a true caption to start from
    return truth


def _red_square_left(scene: Scene = SCENE_A) -> CaptionTruth:
    return _truth("A red square on the left .",
                  [{"kind": "exists", "desc": {"shape": "square", "colour": "red", "hpos": "left"}}],
                  [(0, 3, 1)], scene)


def _square_and_circle(scene: Scene) -> CaptionTruth:
    return _truth("A red square and a blue circle .",
                  [{"kind": "exists", "desc": {"shape": "square", "colour": "red"}},
                   {"kind": "exists", "desc": {"shape": "circle", "colour": "blue"}}],
                  [(0, 3, 1), (4, 7, 2)], scene)


@pytest.mark.parametrize("substitute, verdict", [
    ("box", "false_negative"),  # a synonym
    ("Square", "false_negative"),  # the same word
    ("circle", "true_negative"),  # no red circle on the left
    ("triangle", "true_negative"),  # absent from the scene
    ("shape", "false_negative"),  # a generic noun
    ("polygon", "false_negative"),  # a hypernym of square
    ("quadrilateral", "false_negative"),  # another
    ("symbol", "true_negative"),  # a hypernym of other shapes: no red symbol on the left
    ("dog", "unknown"),  # outside the world
    ("red", "unknown"),  # a colour for a noun
    ("plus sign", "true_negative"),  # a two-word shape noun
])
def test_shape_noun_substitutions(substitute, verdict):
    assert judge_substitution(_red_square_left(), 2, substitute) == verdict


def test_a_shape_present_elsewhere_keeps_the_caption_true():
    # "a red circle and a blue circle": true where a red circle exists, false where none does
    assert judge_substitution(_square_and_circle(SCENE_B), 2, "circle") == "false_negative"
    assert judge_substitution(_square_and_circle(SCENE_A), 2, "circle") == "true_negative"
    assert judge_substitution(_square_and_circle(SCENE_A), 6, "square") == "true_negative"


def test_attribute_and_position_words():
    truth = _red_square_left()
    assert judge_substitution(truth, 1, "blue") == "true_negative"
    assert judge_substitution(truth, 5, "right") == "true_negative"  # the phrase before it
    assert judge_substitution(truth, 5, "top") == "unknown"  # another axis
    assert judge_substitution(truth, 4, "a") == "unknown"  # not a word of the lexicon
    relation = _truth(
        "A red square to the left of a blue circle .",
        [{"kind": "relation", "rel": "left_of", "a": {"shape": "square", "colour": "red"},
          "b": {"shape": "circle", "colour": "blue"}}], [(0, 3, 1), (7, 10, 2)], SCENE_A)
    assert judge_substitution(relation, 5, "right") == "true_negative"
    assert judge_substitution(relation, 9, "shape") == "false_negative"
    assert judge_substitution(relation, 9, "square") == "true_negative"
    background = _truth(
        "A red square on a dark blue background .",
        [{"kind": "exists", "desc": {"shape": "square", "colour": "red"}},
         {"kind": "background", "tone": "dark", "hue": "blue"}], [(0, 3, 1), (4, 8, BACKGROUND_KEY)],
        SCENE_A)
    assert judge_substitution(background, 5, "light") == "true_negative"
    assert judge_substitution(background, 6, "green") == "true_negative"  # the hue
    assert judge_substitution(background, 6, "blue") == "false_negative"
    assert judge_substitution(background, 7, "backdrop") == "false_negative"  # a synonym
    assert judge_substitution(background, 7, "circle") == "unknown"  # not an attribute noun
    polygon = _truth("A red polygon .", [{"kind": "exists", "desc": {"shape": "polygon",
                                                                     "colour": "red"}}],
                     [(0, 3, 1)], SCENE_A)
    assert judge_substitution(polygon, 2, "square") == "false_negative"  # narrowed, still true
    assert judge_substitution(polygon, 2, "hexagon") == "true_negative"


def test_generic_nouns_total_and_count():
    total = _truth("There are two shapes .", [{"kind": "total", "n": 2}], [(2, 4, 3)], SCENE_A)
    assert judge_substitution(total, 3, "objects") == "false_negative"
    assert judge_substitution(total, 3, "squares") == "true_negative"  # not two squares
    two_squares = _scene(RED_SQUARE, _object("square", "blue", 54, 54))
    total_b = _truth("There are two shapes .", [{"kind": "total", "n": 2}], [(2, 4, 3)],
                     two_squares)
    assert judge_substitution(total_b, 3, "boxes") == "false_negative"
    count = _truth("Two red objects .", [{"kind": "count", "desc": {"colour": "red"}, "n": 2}],
                   [(0, 3, 5)], SCENE_B)
    assert judge_substitution(count, 2, "figures") == "false_negative"
    assert judge_substitution(count, 2, "circles") == "true_negative"  # one red circle only
    one = _truth("A red object .", [{"kind": "exists", "desc": {"colour": "red"}}], [(0, 3, 1)],
                 _scene(RED_SQUARE))
    assert judge_substitution(one, 2, "square") == "false_negative"
    assert judge_substitution(one, 2, "circle") == "true_negative"


def test_a_word_that_disagrees_with_the_meaning_is_unknown():
    wrong = CaptionTruth(tuple(_words("A red circle .")),
                         ({"kind": "exists", "desc": {"shape": "square", "colour": "red"}},),
                         ((0, 3, 1),), SCENE_A)
    assert judge_substitution(wrong, 2, "triangle") == "unknown"
    with pytest.raises(ValueError, match="outside"):
        judge_substitution(wrong, 9, "triangle")


def test_negative_quality_fractions():
    truths = [_red_square_left(), _square_and_circle(SCENE_B)]
    negatives = {
        "lm": [CaptionNegatives(2, "square", ["box", "circle", "dog"]), (-1, "", [])],
        "random": [None, (2, "square", ("triangle",))],
        "empty": [None, None],
    }
    out = negative_quality(truths, negatives)
    assert out["lm_true_negative"] == out["lm_false_negative"] == out["lm_unknown"] == 1 / 3
    assert out["lm_substitutes"] == 3
    assert out["random_true_negative"] == 1.0 and out["random_substitutes"] == 1
    assert out["empty_unknown"] == 0.0 and out["empty_substitutes"] == 0
    parallel = NegativeCaptions(word_index=np.array([2, -1]), true_words=("square", ""),
                                substitutes=(("Box.", "circle", "dog"), ()), generator="lm")
    assert negative_quality(truths, {"lm": parallel}) == {
        k: v for k, v in out.items() if k.startswith("lm_")}
    with pytest.raises(ValueError, match="is not 'circle'"):
        negative_quality(truths, {"bad": [(2, "circle", ["box"]), None]})
    with pytest.raises(ValueError, match="1 entries for 2"):
        negative_quality(truths, {"short": [None]})


# ------------------------------------------------------------------------ the embedded benchmark


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from icr.data.synthetic import generate

    return generate(tmp_path_factory.mktemp("quality") / "shapes", "tiny", seed=2, workers=1)


def test_benchmark_truths_align_and_synonyms_are_false_negatives(shapes):
    from icr.grounding.data import load_shapes_grounding

    truths = load_shapes_truth(shapes, "train")
    split = load_shapes_grounding(shapes, "train", select_words=False)
    assert [" ".join(t.tokens) for t in truths] == list(split.captions)
    assert all(holds(t.meaning, t.scene) for t in truths)
    lex = lexicon()
    synonyms: dict[tuple[str, str], list[str]] = {}
    for word, entry in lex.items():
        synonyms.setdefault(entry, []).append(word)
    judged = 0
    for truth in truths:
        for i, token in enumerate(truth.tokens):
            entry = lex.get(token.lower())
            if entry is None or entry[0] not in ("shape", "generic", "colour", "size", "texture",
                                                 "tone", "background"):
                continue
            for other in synonyms[entry]:
                if other != token.lower():
                    judged += 1
                    assert judge_substitution(truth, i, other) == "false_negative", (truth, i, other)
    assert judged > 100
