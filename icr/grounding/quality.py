"""How often a negative-caption generator's substitutes are really false of the image.

``L_lang`` (Gupta et al., ECCV 2020, Sec. 2.4, Eq. 9) contrasts a caption's true noun with
substitute nouns in the same context and assumes every substituted caption is *false* of the
image. A synonym ("box" for "square"), a hypernym ("shape" for "circle") or an object the scene
also has makes a *false negative*: a true caption pushed down. The paper's re-ranking
``p(s'|c) / q(s'|s, c)`` exists to remove those; on the embedded benchmark their rate can be
measured, because every caption's meaning and every scene are known.

Negatives format (shared with the generators in :mod:`icr.grounding.negatives`): for a split's
captions, one entry per caption index, ``(word_index, word, substitutes)``: the index of the
substituted noun among the caption's whitespace tokens (-1 when the caption has no noun; the
entry is then ignored, as is ``None``), the true word, and the list of substitute words. The
generators' :class:`~icr.grounding.negatives.NegativeCaptions` (the same as parallel arrays) is
accepted as well. Words are compared without case and without the
punctuation at their ends (``"Circle." == "circle"``).

Judging one substituted caption (:func:`judge_substitution`):

1. The substitute equal to the true word (ignoring case) is the same caption: false negative.
2. Both words must be in the grammar's lexicon (:func:`icr.data.synthetic.lexicon.lexicon`),
   otherwise ``unknown`` (a word the shapes world cannot interpret, e.g. "dog" or "ball").
3. The true word is located in the caption's meaning: the phrase holding it (an Entities phrase,
   whose chain key is the set of objects it refers to) is matched to the clause description that
   refers to exactly those objects in the scene; a position word (``on the left``) belongs to the
   phrase before it; a ``left``/``right`` of ``left of`` names the relation of the clause. The
   word must agree with that description (``circle`` with ``shape: circle``), else ``unknown``.
4. The description is changed: a shape noun for a shape noun replaces the shape concept (synonyms
   name the same shape, so "box" for "square" changes nothing; a hypernym such as "polygon" names a
   set of shapes and is usually still true); a generic noun (``shape``, ``object``, ``figure``,
   ``item``) for a shape noun drops the shape (usually still true); a shape noun for a generic noun
   adds it, and in a ``total`` clause ("three shapes") turns it into ``count`` ("three circles":
   exactly three circles); a generic noun for a generic noun changes nothing; a colour, size,
   texture or position word for one of the same attribute replaces the value; in the background
   phrase a tone word replaces the tone, a colour word the hue, and ``backdrop`` for
   ``background`` changes nothing; ``left``/``right`` in a relation swap ``left_of``/``right_of``.
   Any other pair (a colour for a noun, a word of a two-word noun like ``plus sign``,
   ``centre``/``middle``, whose axis depends on the phrase) is ``unknown``. Grammatical number is
   ignored ("two square").
5. The changed meaning is evaluated on the scene (:func:`icr.data.synthetic.semantics.holds`):
   true -> false negative, false -> true negative.

:func:`negative_quality` returns, per generator, the fractions of its substituted captions in each
verdict: a dict the platform logs.
"""

from __future__ import annotations

import copy
import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from icr.data.entities import load_entities
from icr.data.synthetic.grammar import BACKGROUND_KEY
from icr.data.synthetic.lexicon import lexicon
from icr.data.synthetic.semantics import holds, matches
from icr.data.synthetic.world import Scene
from icr.data.synthetic.writer import CHAINS_PER_IMAGE, load_scenes
from icr.errors import DataError
from icr.grounding.negatives import NegativeCaptions

logger = logging.getLogger(__name__)

__all__ = [
    "VERDICTS",
    "CaptionNegatives",
    "CaptionTruth",
    "judge_substitution",
    "load_shapes_truth",
    "negative_quality",
]

TRUE_NEGATIVE, FALSE_NEGATIVE, UNKNOWN = "true_negative", "false_negative", "unknown"
VERDICTS = (TRUE_NEGATIVE, FALSE_NEGATIVE, UNKNOWN)
_ATTRIBUTE_KINDS = ("colour", "size", "texture", "hpos", "vpos")
_BACKGROUND_FIELD = {"tone": "tone", "colour": "hue"}  # the background's word kinds and fields
Lexicon = Mapping[str, tuple[str, str]]
_AFFIXES = re.compile(r"^[\W_]+|[\W_]+$")


class CaptionNegatives(NamedTuple):
    """The negatives of one caption (module docstring); a plain 3-tuple works as well."""

    word_index: int
    word: str
    substitutes: Sequence[str]


@dataclass(frozen=True)
class CaptionTruth:
    """What the embedded benchmark knows about one caption.

    Attributes:
        tokens: its whitespace tokens (the Entities sentence text).
        meaning: its clauses (:mod:`icr.data.synthetic.semantics`).
        phrases: ``(first token, end token, chain key)`` of each phrase; the key is the bit mask
            of the objects it refers to, or ``BACKGROUND_KEY``.
        scene: its image's scene.
    """

    tokens: tuple[str, ...]
    meaning: tuple[dict, ...]
    phrases: tuple[tuple[int, int, int], ...]
    scene: Scene


@dataclass(frozen=True)
class _Slot:
    """Where a word sits in a meaning: clause index and the description's field (None: none)."""

    clause: int
    role: str | None


# ------------------------------------------------------------------------------------ loading


def _core(token: str) -> str:
    """The word of a token: lower-cased, without punctuation at its ends."""
    return _AFFIXES.sub("", token).lower()


def _detokenise(text: str) -> str:
    return text.replace(" ,", ",").replace(" .", ".").replace(" :", ":")


def load_shapes_truth(root: str | Path, split: str) -> list[CaptionTruth]:
    """The truth of every caption of a split, in the caption order of the grounding loader.

    That order (:func:`icr.grounding.data.load_shapes_grounding`) is the Entities split file's
    images, each with its ``Sentences`` lines in order; ``scenes.json`` lists the same captions.

    Raises:
        DataError: missing files, or ``scenes.json`` disagrees with the Entities sentences.
    """
    root = Path(root)
    scenes = {Path(name).stem: record for name, record in load_scenes(root).items()}
    out = []
    for image in load_entities(root / "entities", split):
        record = scenes.get(Path(image.image_id).stem)
        if record is None or len(record["captions"]) != len(image.sentences):
            raise DataError(f"{root / 'scenes.json'}: no matching record for image "
                            f"{image.image_id!r}; regenerate the benchmark")
        scene = Scene.from_json(record["scene"])
        base = record["imgid"] * CHAINS_PER_IMAGE
        for sentence, caption in zip(image.sentences, record["captions"], strict=True):
            if _detokenise(sentence.text) != caption["raw"]:
                raise DataError(f"{root}: caption {caption['raw']!r} of scenes.json differs from "
                                f"the sentence {sentence.text!r}; regenerate the benchmark")
            phrases = tuple((p["first_word_index"], p["end"], p["chain_id"] - base)
                            for p in caption["phrases"])
            out.append(CaptionTruth(tuple(sentence.text.split()), tuple(caption["meaning"]),
                                    phrases, scene))
    return out


# ------------------------------------------------------------------------------------ locating


def _object_mask(scene: Scene, desc: Mapping[str, str]) -> int:
    return sum(1 << k for k, o in enumerate(scene.objects) if matches(o, desc))


def _slots(truth: CaptionTruth) -> list[tuple[int, _Slot]]:
    """Every description of the meaning with the bit mask of the objects it refers to."""
    out = []
    for i, clause in enumerate(truth.meaning):
        kind = clause["kind"]
        if kind in ("exists", "count"):
            out.append((_object_mask(truth.scene, clause["desc"]), _Slot(i, "desc")))
        elif kind == "relation":
            out += [(_object_mask(truth.scene, clause[r]), _Slot(i, r)) for r in ("a", "b")]
        elif kind == "total":
            out.append(((1 << len(truth.scene.objects)) - 1, _Slot(i, None)))
        elif kind == "background":
            out.append((BACKGROUND_KEY, _Slot(i, None)))
    return out


def _agrees(clause: Mapping, slot: _Slot, kind: str, value: str, relation_word: bool) -> bool:
    """Whether the word ``(kind, value)`` says what the slot's description says."""
    if relation_word:
        return clause["kind"] == "relation" and slot.role == "a" and clause["rel"] == f"{value}_of"
    if slot.role is None:
        if clause["kind"] == "background":
            return kind == "background" or clause.get(_BACKGROUND_FIELD.get(kind, "")) == value
        return clause["kind"] == "total" and kind == "generic"
    desc = clause[slot.role]
    if kind == "generic":
        return "shape" not in desc
    if kind == "shape" or kind in _ATTRIBUTE_KINDS:
        return desc.get(kind) == value
    return False


def _locate(truth: CaptionTruth, index: int, kind: str, value: str) -> tuple[_Slot | None, bool]:
    """The slot the word at ``index`` describes, and whether it is a relation word."""
    inside = [p for p in truth.phrases if p[0] <= index < p[1]]
    before = [p for p in truth.phrases if p[1] <= index]
    relation_word = (not inside and kind == "hpos" and index + 1 < len(truth.tokens)
                     and _core(truth.tokens[index + 1]) == "of")
    if inside:
        phrase = inside[0]
    elif before and (kind in ("hpos", "vpos")):  # a position phrase follows its noun phrase
        phrase = max(before, key=lambda p: p[1])
    else:
        return None, False
    candidates = [slot for mask, slot in _slots(truth) if mask == phrase[2]
                  and _agrees(truth.meaning[slot.clause], slot, kind, value, relation_word)]
    return (candidates[0] if len(candidates) == 1 else None), relation_word


# ------------------------------------------------------------------------------------ judging


def _changed(meaning: Sequence[Mapping], slot: _Slot, old: tuple[str, str],
             new: tuple[str, str], relation_word: bool) -> list[dict] | None:
    """The meaning with the word ``old`` at ``slot`` replaced by ``new``; None if undefined."""
    (old_kind, _), (new_kind, new_value) = old, new
    clauses = copy.deepcopy([dict(c) for c in meaning])
    clause = clauses[slot.clause]
    if relation_word:
        if new_kind != "hpos":
            return None
        clause["rel"] = f"{new_value}_of"
    elif clause["kind"] == "total":
        if new_kind == "shape":  # "three shapes" -> "three circles": exactly three circles
            clauses[slot.clause] = {"kind": "count", "desc": {"shape": new_value},
                                    "n": clause["n"]}
        elif new_kind != "generic":
            return None
    elif clause["kind"] == "background":
        if old_kind == new_kind == "background":
            return clauses  # "backdrop" for "background"
        if old_kind != new_kind or old_kind not in _BACKGROUND_FIELD:
            return None
        clause[_BACKGROUND_FIELD[old_kind]] = new_value
    else:
        desc = clause[slot.role]
        if old_kind in ("shape", "generic") and new_kind == "shape":
            desc["shape"] = new_value
        elif old_kind in ("shape", "generic") and new_kind == "generic":
            desc.pop("shape", None)  # a hypernym
        elif old_kind == new_kind and old_kind in _ATTRIBUTE_KINDS:
            desc[old_kind] = new_value
        else:
            return None
    return clauses


def _judge(truth: CaptionTruth, index: int, substitutes: Sequence[str], lex: Lexicon
           ) -> list[str]:
    word = _core(truth.tokens[index])
    old = lex.get(word)
    slot, relation_word = _locate(truth, index, *old) if old is not None else (None, False)
    verdicts = []
    for substitute in substitutes:
        sub = " ".join(_core(w) for w in substitute.split())
        new = lex.get(sub)
        if sub == word:
            verdicts.append(FALSE_NEGATIVE)
            continue
        meaning = (_changed(truth.meaning, slot, old, new, relation_word)
                   if slot is not None and new is not None else None)
        if meaning is None:
            verdicts.append(UNKNOWN)
        else:
            verdicts.append(FALSE_NEGATIVE if holds(meaning, truth.scene) else TRUE_NEGATIVE)
    return verdicts


def judge_substitution(truth: CaptionTruth, word_index: int, substitute: str) -> str:
    """``true_negative``, ``false_negative`` or ``unknown`` for one substituted caption.

    The rules are in the module docstring.
    """
    if not 0 <= word_index < len(truth.tokens):
        raise ValueError(f"word index {word_index} is outside the caption {truth.tokens}")
    return _judge(truth, word_index, [substitute], lexicon())[0]


def _entries(negatives: Any) -> Sequence[CaptionNegatives | tuple | None]:
    if isinstance(negatives, NegativeCaptions):
        return list(zip(np.asarray(negatives.word_index).tolist(), negatives.true_words,
                        negatives.substitutes, strict=True))
    return negatives


def negative_quality(
    truths: Sequence[CaptionTruth],
    negatives: Mapping[str, Any],
) -> dict[str, float]:
    """The verdicts of every generator's substituted captions, as fractions.

    Args:
        truths: the split's captions (:func:`load_shapes_truth`).
        negatives: generator name -> one entry per caption of ``truths``, or a
            :class:`~icr.grounding.negatives.NegativeCaptions` (module docstring).

    Returns:
        per generator ``g``: ``{g}_true_negative``, ``{g}_false_negative``, ``{g}_unknown``
        (fractions of its substituted captions, summing to 1; 0 when it has none) and
        ``{g}_substitutes`` (their number).

    Raises:
        ValueError: a generator's entries do not match the captions (count, index, or word).
    """
    lex = lexicon()
    out: dict[str, float] = {}
    for name, given in negatives.items():
        entries = _entries(given)
        if len(entries) != len(truths):
            raise ValueError(f"generator {name!r} has {len(entries)} entries for {len(truths)} "
                             "captions")
        counts: Counter[str] = Counter()
        for c, (truth, entry) in enumerate(zip(truths, entries, strict=True)):
            if entry is None or entry[0] < 0:
                continue
            index, word, substitutes = entry
            if index >= len(truth.tokens) or _core(truth.tokens[index]) != _core(word):
                raise ValueError(f"generator {name!r}, caption {c}: token {index} of "
                                 f"{' '.join(truth.tokens)!r} is not {word!r}")
            counts.update(_judge(truth, index, substitutes, lex))
        total = sum(counts.values())
        for verdict in VERDICTS:
            out[f"{name}_{verdict}"] = counts[verdict] / total if total else 0.0
        out[f"{name}_substitutes"] = float(total)
    return out
