"""Captions: a small grammar that says true things about a scene, each time about a different part.

A caption is built in two steps. A *plan* picks what to say (one object, two or three objects, a
spatial relation, a count of similar objects, the number of objects, the background) and, for each
mentioned object, a random subset of its attributes; its meaning (see :mod:`.semantics`) is fixed
there. The *realisation* then picks the words: synonyms ("square"/"box", "large"/"big"), adjective
order, a texture as an adjective or a prepositional phrase ("striped"/"with stripes"), a colour
before the noun or in a relative clause, a relation or its converse ("A left of B"/"B right of A"),
the background first or last. The five captions of an image get pairwise different plans (who is
mentioned with which attributes), so every caption leaves out something another one says: the
setting in which a contrastive encoder can keep a few shortcut features and suppress the rest.

Every noun phrase that names objects is a Flickr30K Entities phrase; its chain key is the bit mask of
the objects it refers to (the background phrase has key :data:`BACKGROUND_KEY`), which the writer
turns into dataset-wide chain ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from icr.data.synthetic.semantics import matches
from icr.data.synthetic.world import RELATIONS, Scene, SceneObject, relation_holds

BACKGROUND_KEY = 16  # chain key of the background; object groups use bit masks 1..15

SHAPE_NOUNS = {
    "circle": [("circle", "circles")],
    "square": [("square", "squares"), ("box", "boxes")],
    "triangle": [("triangle", "triangles")],
    "diamond": [("diamond", "diamonds"), ("rhombus", "rhombuses")],
    "star": [("star", "stars")],
    "cross": [("cross", "crosses"), ("plus sign", "plus signs")],
}
GENERIC_NOUNS = [("shape", "shapes"), ("object", "objects"), ("figure", "figures")]
SIZE_WORDS = {"small": ["small", "little"], "medium": ["medium-sized", "medium", "mid-sized"],
              "large": ["large", "big"]}
TEXTURE_ADJECTIVES = {"solid": ["solid", "filled"], "striped": ["striped"],
                      "dotted": ["dotted", "spotted"], "outlined": ["outlined", "hollow"]}
TEXTURE_PHRASES = {"striped": ["with stripes"], "dotted": ["with dots", "with polka dots"]}
TONE_WORDS = {"dark": ["dark"], "light": ["light", "pale", "bright"]}
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATION_WORDS = {
    "left_of": ["to the left of", "left of"],
    "right_of": ["to the right of", "right of"],
    "above": ["above"],
    "below": ["below", "beneath"],
    "next_to": ["next to", "beside", "near"],
}
CONVERSE = {"left_of": "right_of", "right_of": "left_of", "above": "below", "below": "above",
            "next_to": "next_to"}
H_PHRASES = {"left": ["on the left", "on the left side", "at the left"],
             "right": ["on the right", "on the right side", "at the right"]}
V_PHRASES = {"top": ["at the top", "near the top", "in the upper part"],
             "bottom": ["at the bottom", "near the bottom", "in the lower part"]}
HV_PHRASES = {
    ("centre", "middle"): ["in the centre", "in the middle of the image", "in the middle"],
    ("centre", "top"): ["at the top centre", "at the top in the middle"],
    ("centre", "bottom"): ["at the bottom centre", "at the bottom in the middle"],
    ("left", "middle"): ["in the middle of the left side", "on the left halfway down"],
    ("right", "middle"): ["in the middle of the right side", "on the right halfway down"],
}
PLAN_WEIGHTS = {"one": 3.0, "two": 2.0, "three": 1.0, "relation": 2.5, "relation_plus": 0.8,
                "count": 1.2, "total_only": 0.5, "total_list": 0.7, "total_among": 0.5}
# attribute-subset sampling: how many attributes, and how likely each is picked
NUM_ATTRIBUTE_PROBS = (0.35, 0.35, 0.2, 0.1)
ATTRIBUTE_WEIGHTS = {"shape": 3.0, "colour": 2.2, "size": 1.2, "texture": 1.4, "position": 1.0}


@dataclass
class Caption:
    """A caption with its words, phrases and meaning.

    Attributes:
        tokens: words and punctuation, e.g. ``["A", "red", "circle", "."]``.
        phrases: ``(first token, end token, chain key, type)`` of each entity phrase.
        meaning: the clauses (see :mod:`.semantics`).
        mentions: per mentioned object index, the attributes the caption states about it.
    """

    tokens: list[str] = field(default_factory=list)
    phrases: list[tuple[int, int, int, str]] = field(default_factory=list)
    meaning: list[dict] = field(default_factory=list)
    mentions: dict[int, set[str]] = field(default_factory=dict)

    @property
    def raw(self) -> str:
        """The caption as a person would type it (no space before punctuation)."""
        text = " ".join(self.tokens)
        return text.replace(" ,", ",").replace(" .", ".").replace(" :", ":")

    def signature(self) -> tuple:
        """What is said about what: two captions with equal signatures make the same claims."""
        kinds = tuple(sorted(c["kind"] + (":" + c["rel"] if "rel" in c else "") for c in self.meaning))
        return kinds, tuple(sorted((k, tuple(sorted(v))) for k, v in self.mentions.items()))

    def add(self, text: str) -> None:
        self.tokens.extend(text.split())

    def add_phrase(self, words: list[str], key: int, kind: str = "shapes") -> None:
        start = len(self.tokens)
        self.tokens.extend(words)
        self.phrases.append((start, len(self.tokens), key, kind))


def _pick(rng: np.random.Generator, options: Sequence):
    return options[int(rng.integers(len(options)))]


# ------------------------------------------------------------------------------- descriptions


def _position_choices(obj: SceneObject) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [("hpos", "vpos")]
    if obj.hpos != "centre":
        out.append(("hpos",))
    if obj.vpos != "middle":
        out.append(("vpos",))
    return out


def _sample_attributes(rng: np.random.Generator, obj: SceneObject, position: bool) -> set[str]:
    names = [a for a in ATTRIBUTE_WEIGHTS if position or a != "position"]
    weights = np.array([ATTRIBUTE_WEIGHTS[a] for a in names])
    m = min(int(rng.choice(len(NUM_ATTRIBUTE_PROBS), p=NUM_ATTRIBUTE_PROBS)) + 1, len(names))
    chosen = set(rng.choice(names, size=m, replace=False, p=weights / weights.sum()).tolist())
    if "position" in chosen:
        chosen.remove("position")
        chosen.update(_pick(rng, _position_choices(obj)))
    return chosen


def _unique_desc(
    rng: np.random.Generator, scene: Scene, index: int, attrs: set[str], position: bool
) -> dict[str, str] | None:
    """Grow ``attrs`` until they single out object ``index``; ``None`` if they cannot."""
    obj = scene.objects[index]
    attrs = set(attrs)
    while True:
        desc = {a: obj.attribute(a) for a in sorted(attrs)}
        others = [o for i, o in enumerate(scene.objects) if i != index and matches(o, desc)]
        if not others:
            return desc
        pool = ["shape", "colour", "size", "texture"] + (["hpos", "vpos"] if position else [])
        useful = [a for a in pool if a not in attrs and any(o.attribute(a) != obj.attribute(a)
                                                            for o in others)]
        if not useful:
            return None
        extra = _pick(rng, useful)
        if (extra, obj.attribute(extra)) in (("hpos", "centre"), ("vpos", "middle")):
            attrs.update(("hpos", "vpos"))  # "centre" alone has no phrase: say both
        else:
            attrs.add(extra)


# ------------------------------------------------------------------------------- realisation


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def _noun_phrase(rng: np.random.Generator, desc: dict[str, str], n: int) -> list[str]:
    """Words of a noun phrase for ``n`` objects matching ``desc`` (position excluded)."""
    singular, plural = _pick(rng, SHAPE_NOUNS[desc["shape"]] if "shape" in desc else GENERIC_NOUNS)
    noun = singular if n == 1 else plural
    size = _pick(rng, SIZE_WORDS[desc["size"]]) if "size" in desc else None
    colour = desc.get("colour")
    texture = desc.get("texture")
    tex_adj = _pick(rng, TEXTURE_ADJECTIVES[texture]) if texture else None
    tail: list[str] = []
    form = int(rng.integers(4))
    if form == 1 and texture in TEXTURE_PHRASES:
        tail, tex_adj = [_pick(rng, TEXTURE_PHRASES[texture])], None
    if form == 2 and colour is not None and ("shape" in desc or texture or size):
        verb = "is" if n == 1 else "are"
        tail.append(_pick(rng, [f"that {verb} {colour}", f"which {verb} {colour}", f"coloured {colour}"]))
        colour = None
    pre = [size, tex_adj, colour] if form == 3 else [size, colour, tex_adj]
    words = [w for w in pre if w] + [noun] + tail
    words = " ".join(words).split()
    det = _article(words[0]) if n == 1 else NUMBER_WORDS[n]
    return [det, *words]


def _position_phrase(rng: np.random.Generator, desc: dict[str, str]) -> str | None:
    h, v = desc.get("hpos"), desc.get("vpos")
    if h and v:
        if (h, v) in HV_PHRASES:
            return _pick(rng, HV_PHRASES[(h, v)])
        word = {"top": "top", "bottom": "bottom"}[v]
        return _pick(rng, [f"in the {word} {h} corner", f"at the {word} {h}", f"in the {word} {h}"])
    if h:
        return _pick(rng, H_PHRASES[h])
    if v:
        return _pick(rng, V_PHRASES[v])
    return None


def _say_object(cap: Caption, rng: np.random.Generator, desc: dict[str, str], key: int, n: int = 1,
                with_position: bool = True) -> None:
    cap.add_phrase(_noun_phrase(rng, desc, n), key)
    where = _position_phrase(rng, desc) if with_position else None
    if where:
        cap.add(where)


def _say_list(cap: Caption, rng: np.random.Generator, items: list[tuple[dict, int]]) -> None:
    for i, (desc, key) in enumerate(items):
        if i > 0:
            cap.add("and" if i == len(items) - 1 else ",")
        _say_object(cap, rng, desc, key)


def _background_phrase(rng: np.random.Generator, tone: str) -> list[str]:
    word = _pick(rng, TONE_WORDS[tone])
    return [_article(word), word, "background"]


# ------------------------------------------------------------------------------- plans


class _Planner:
    """Builds one caption for one scene; returns ``None`` when the plan does not fit the scene."""

    def __init__(self, scene: Scene, rng: np.random.Generator) -> None:
        self.scene, self.rng = scene, rng
        self.n = len(scene.objects)

    def _mention(self, cap: Caption, index: int, desc: dict[str, str]) -> None:
        cap.mentions.setdefault(index, set()).update(desc)

    def _exists(self, cap: Caption, indices: Sequence[int]) -> list[tuple[dict, int]] | None:
        items = []
        for i in indices:
            attrs = _sample_attributes(self.rng, self.scene.objects[i], position=True)
            desc = _unique_desc(self.rng, self.scene, i, attrs, position=True)
            if desc is None:
                return None
            cap.meaning.append({"kind": "exists", "desc": desc})
            self._mention(cap, i, desc)
            items.append((desc, 1 << i))
        return items

    def _objects(self, k: int) -> list[int]:
        return sorted(self.rng.permutation(self.n)[:k].tolist())

    def plan_one(self, cap: Caption, opener: bool) -> bool:
        items = self._exists(cap, self._objects(1))
        if items is None:
            return False
        lead = _pick(self.rng, ["", "there is", "a picture of", "an image showing", "we see"])
        if lead and not opener:
            cap.add(lead)
        _say_list(cap, self.rng, items)
        return True

    def plan_many(self, cap: Caption, k: int, opener: bool) -> bool:
        if self.n < k:
            return False
        items = self._exists(cap, self.rng.permutation(self.n)[:k].tolist())
        if items is None:
            return False
        if not opener:
            lead = _pick(self.rng, ["", "there is", "a picture of"])
            if lead:
                cap.add(lead)
        _say_list(cap, self.rng, items)
        return True

    def _relation(self, cap: Caption) -> tuple[int, int] | None:
        if self.n < 2:
            return None
        i, j = (int(v) for v in self.rng.permutation(self.n)[:2])
        x, y = self.scene.objects[i], self.scene.objects[j]
        rels = [r for r in RELATIONS if relation_holds(r, x, y, self.scene.size)]
        if not rels:
            return None
        rel = _pick(self.rng, rels)
        a = _unique_desc(self.rng, self.scene, i, _sample_attributes(self.rng, x, False), False)
        b = _unique_desc(self.rng, self.scene, j, _sample_attributes(self.rng, y, False), False)
        if a is None or b is None:
            return None
        if self.rng.random() < 0.3:  # say it the other way round
            i, j, a, b, rel = j, i, b, a, CONVERSE[rel]
        cap.meaning.append({"kind": "relation", "rel": rel, "a": a, "b": b})
        self._mention(cap, i, a)
        self._mention(cap, j, b)
        cap.add_phrase(_noun_phrase(self.rng, a, 1), 1 << i)
        cap.add(_pick(self.rng, ["", "is", "sits", "placed"]) + " " + _pick(self.rng, RELATION_WORDS[rel]))
        cap.add_phrase(_noun_phrase(self.rng, b, 1), 1 << j)
        return i, j

    def plan_relation(self, cap: Caption, opener: bool, extra: bool = False) -> bool:
        if extra and self.n < 3:
            return False
        pair = self._relation(cap)
        if pair is None:
            return False
        if extra:
            rest = [k for k in range(self.n) if k not in pair]
            items = self._exists(cap, [int(self.rng.choice(rest))])
            if items is None:
                return False
            cap.add(_pick(self.rng, [", and", ", as well as", ", plus"]))
            _say_list(cap, self.rng, items)
        return True

    def plan_count(self, cap: Caption, opener: bool) -> bool:
        groups = []
        for r in range(1, 5):
            for names in itertools.combinations(("shape", "colour", "size", "texture"), r):
                by_value: dict[tuple, list[int]] = {}
                for k, o in enumerate(self.scene.objects):
                    by_value.setdefault(tuple(o.attribute(a) for a in names), []).append(k)
                groups += [(names, ks) for ks in by_value.values() if len(ks) >= 2]
        if not groups:
            return False
        names, members = _pick(self.rng, groups)
        desc = {a: self.scene.objects[members[0]].attribute(a) for a in names}
        cap.meaning.append({"kind": "count", "desc": desc, "n": len(members)})
        for k in members:
            self._mention(cap, k, desc)
        if not opener and self.rng.random() < 0.4:
            cap.add("there are")
        cap.add_phrase(_noun_phrase(self.rng, desc, len(members)), sum(1 << k for k in members))
        return True

    def _total(self, cap: Caption) -> None:
        cap.meaning.append({"kind": "total", "n": self.n})
        noun = _pick(self.rng, GENERIC_NOUNS)
        words = ["a", "single", noun[0]] if self.n == 1 else [NUMBER_WORDS[self.n], noun[1]]
        cap.add_phrase(words, (1 << self.n) - 1)
        for k in range(self.n):
            cap.mentions.setdefault(k, set())

    def plan_total_only(self, cap: Caption, opener: bool) -> bool:
        if not opener and self.rng.random() < 0.5:
            cap.add("there " + ("is" if self.n == 1 else "are"))
        self._total(cap)
        return True

    def plan_total_list(self, cap: Caption, opener: bool) -> bool:
        if not 2 <= self.n <= 3:
            return False
        self._total(cap)
        items = self._exists(cap, list(range(self.n)))
        if items is None:
            return False
        cap.add(":")
        _say_list(cap, self.rng, items)
        return True

    def plan_total_among(self, cap: Caption, opener: bool) -> bool:
        if self.n < 2:
            return False
        self._total(cap)
        items = self._exists(cap, self._objects(1))
        if items is None:
            return False
        cap.add(_pick(self.rng, [", including", ", among them", ", one of them"]))
        _say_list(cap, self.rng, items)
        return True


def _one_caption(scene: Scene, rng: np.random.Generator) -> Caption | None:
    planner = _Planner(scene, rng)
    plans = list(PLAN_WEIGHTS)
    weights = np.array([PLAN_WEIGHTS[p] for p in plans])
    plan = plans[int(rng.choice(len(plans), p=weights / weights.sum()))]
    cap = Caption()
    background = rng.random() < 0.3
    opener = background and rng.random() < 0.35  # "On a dark background, ..."
    if opener:
        cap.add(_pick(rng, ["on", "against"]))
        cap.add_phrase(_background_phrase(rng, scene.background.tone), BACKGROUND_KEY, "scene")
        cap.add(",")
    ok = {
        "one": lambda: planner.plan_one(cap, opener),
        "two": lambda: planner.plan_many(cap, 2, opener),
        "three": lambda: planner.plan_many(cap, 3, opener),
        "relation": lambda: planner.plan_relation(cap, opener),
        "relation_plus": lambda: planner.plan_relation(cap, opener, extra=True),
        "count": lambda: planner.plan_count(cap, opener),
        "total_only": lambda: planner.plan_total_only(cap, opener),
        "total_list": lambda: planner.plan_total_list(cap, opener),
        "total_among": lambda: planner.plan_total_among(cap, opener),
    }[plan]()
    if not ok:
        return None
    if background:
        if not opener:
            cap.add(_pick(rng, ["on", "against", "in front of"]))
            cap.add_phrase(_background_phrase(rng, scene.background.tone), BACKGROUND_KEY, "scene")
        cap.meaning.append({"kind": "background", "tone": scene.background.tone})
    cap.add(".")
    cap.tokens[0] = cap.tokens[0][0].upper() + cap.tokens[0][1:]
    return cap


def sample_captions(scene: Scene, rng: np.random.Generator, k: int = 5, tries: int = 60) -> list[Caption]:
    """``k`` true captions of ``scene`` with pairwise different signatures where possible.

    A scene with one plain object has few different things to say; after ``tries`` attempts a
    caption may repeat a signature (never observed with the default vocabulary), but its words
    still differ whenever the grammar allows.
    """
    out: list[Caption] = []
    seen_signatures: set[tuple] = set()
    seen_text: set[str] = set()
    for _ in range(k):
        best = None
        for _ in range(tries):
            cap = _one_caption(scene, rng)
            if cap is None or cap.raw in seen_text:
                continue
            best = cap
            if cap.signature() not in seen_signatures:
                break
        if best is None:
            raise RuntimeError("the grammar could not produce a new caption for a scene")  # a bug
        out.append(best)
        seen_signatures.add(best.signature())
        seen_text.add(best.raw)
    return out
