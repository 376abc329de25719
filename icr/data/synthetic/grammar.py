"""Captions: a small grammar that says true, specific things about a scene, each about a part of it.

A caption is built in three steps.

1. A *plan* picks what to say, as COCO captions do: two or three objects, a spatial relation
   (with or without a third object), a count of similar objects, one object and the background, the
   number of objects with one or two of them, or one object alone; and, for each mentioned object, a
   random subset of its attributes, grown until the description singles the object out in its scene.
   A shape is sometimes named by a hypernym ("polygon", "symbol") or a generic noun ("shape").
2. The plan is made *specific*: a real caption is true of few other images (COCO: 0.08 to 1.5 per
   1,000 other images, measured by ``benchmarks/benchmark_realism.py`` from the CxC and ECCV Caption
   annotations). The plan's meaning is decided against a fixed sample of reference scenes from the
   same distribution (:class:`Specificity`); while it is true of more than
   :data:`MAX_TRUE_SHARE` of them, one more attribute is stated about a mentioned object (or the
   background is named). A plan that cannot be made specific is dropped. This is a calibration to a
   statistic of real data, never to a method's result.
3. The *realisation* picks the words: synonyms and hypernyms from :mod:`.lexicon`, adjective order,
   a texture as an adjective or a prepositional phrase ("striped"/"with stripes"), a colour before
   the noun or in a relative clause, a relation or its converse ("A left of B"/"B right of A"), the
   background first or last.

The five captions of an image get pairwise different plans (who is mentioned with which attributes),
so every caption leaves out something another one says: the setting in which a contrastive encoder
can keep a few shortcut features and suppress the rest (LTD paper, Sec. 1).

Every noun phrase that names objects is a Flickr30K Entities phrase; its chain key is the bit mask of
the objects it refers to (the background phrase has key :data:`BACKGROUND_KEY`), which the writer
turns into dataset-wide chain ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from icr.data.synthetic.lexicon import (
    BACKGROUND_NOUNS,
    COLOUR_WORDS,
    GENERIC_NOUNS,
    HYPERNYM_NOUNS,
    HYPERNYMS,
    SHAPE_NOUNS,
    SIZE_WORDS,
    TEXTURE_ADJECTIVES,
    TEXTURE_PHRASES,
    TONE_WORDS,
)
from icr.data.synthetic.semantics import TruthTable, matches
from icr.data.synthetic.world import RELATIONS, Scene, relation_holds

BACKGROUND_KEY = 256  # chain key of the background; object groups use bit masks 1..255
MAX_TRUE_SHARE = 0.002  # a caption may be true of at most this share of the reference scenes
HYPERNYM_PROB = 0.15  # a named shape is called by one of its hypernyms
GENERIC_PROB = 0.08  # ... or by a generic noun ("shape", "object"), if the rest singles it out
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven",
                8: "eight"}
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
    ("centre", "middle"): ["in the centre", "in the middle"],
    ("centre", "top"): ["at the top centre", "at the centre top"],
    ("centre", "bottom"): ["at the bottom centre", "at the centre bottom"],
    ("left", "middle"): ["on the middle left", "at the middle left"],
    ("right", "middle"): ["on the middle right", "at the middle right"],
}
PLAN_WEIGHTS = {"two": 3.0, "three": 0.6, "relation": 3.0, "relation_plus": 0.5, "count": 1.0,
                "one_background": 1.2, "one": 1.0, "total_among": 0.6}
# attribute-subset sampling: how many attributes, and how likely each is picked
NUM_ATTRIBUTE_PROBS = (0.45, 0.35, 0.15, 0.05)
ATTRIBUTE_WEIGHTS = {"shape": 6.0, "colour": 2.2, "size": 1.2, "texture": 1.4, "position": 1.0}
# growth (step 2) prefers the words that say most per word: a position or background phrase
# takes 3 to 5 words for what an adjective says in one
GROWTH_WEIGHTS = {"hpos": 0.5, "vpos": 0.5, "background": 0.4}
BACKGROUND_CHOICES = ({"tone"}, {"hue"}, {"tone", "hue"})
BACKGROUND_PROBS = (0.25, 0.3, 0.45)


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


# ------------------------------------------------------------------------------------ plans


@dataclass
class _Mention:
    """One noun phrase about one object: its index in the scene and what it says of it."""

    index: int
    desc: dict[str, str]
    position: bool  # whether its position may be stated (not in relations)


@dataclass
class _Plan:
    """What a caption says, before words: the clauses and the objects they are about."""

    kind: str
    mentions: list[_Mention] = field(default_factory=list)  # objects said to exist, in order
    relation: tuple[str, _Mention, _Mention] | None = None
    count: tuple[dict[str, str], list[int]] | None = None
    total: int | None = None
    background: dict[str, str] | None = None

    def described(self) -> list[_Mention]:
        """Every mention whose description can grow (relation arguments first)."""
        pair = list(self.relation[1:]) if self.relation else []
        return pair + self.mentions

    def meaning(self) -> list[dict]:
        out: list[dict] = []
        if self.total is not None:
            out.append({"kind": "total", "n": self.total})
        if self.count is not None:
            out.append({"kind": "count", "desc": dict(self.count[0]), "n": len(self.count[1])})
        if self.relation is not None:
            rel, a, b = self.relation
            out.append({"kind": "relation", "rel": rel, "a": dict(a.desc), "b": dict(b.desc)})
        out += [{"kind": "exists", "desc": dict(m.desc)} for m in self.mentions]
        if self.background is not None:
            out.append({"kind": "background", **self.background})
        return out


class Specificity:
    """Decides whether a meaning is specific enough: true of at most ``max_share`` of a fixed
    sample of reference scenes (step 2 of the module docstring)."""

    def __init__(self, reference: Sequence[Scene], max_share: float = MAX_TRUE_SHARE) -> None:
        self.table = TruthTable(reference)
        self.limit = int(np.floor(max_share * len(reference)))

    def specific(self, meaning: Sequence[dict]) -> bool:
        return int(self.table.holds(meaning).sum()) <= self.limit


def _object_attributes(desc_position: bool) -> list[str]:
    return ["shape", "colour", "size", "texture"] + (["hpos", "vpos"] if desc_position else [])


def _position_choices(scene: Scene, index: int) -> list[tuple[str, ...]]:
    obj = scene.objects[index]
    out: list[tuple[str, ...]] = [("hpos", "vpos")]
    if obj.hpos != "centre":
        out.append(("hpos",))
    if obj.vpos != "middle":
        out.append(("vpos",))
    return out


def _add_attribute(rng: np.random.Generator, scene: Scene, mention: _Mention, name: str) -> None:
    obj = scene.objects[mention.index]
    if name in ("hpos", "vpos") and (name, obj.attribute(name)) in (("hpos", "centre"),
                                                                  ("vpos", "middle")):
        name = "position"  # "centre" alone has no phrase: say both
    if name == "position":
        mention.desc.update({a: obj.attribute(a) for a in ("hpos", "vpos")})
    else:
        mention.desc[name] = obj.attribute(name)


def _sample_attributes(rng: np.random.Generator, scene: Scene, mention: _Mention) -> None:
    names = [a for a in ATTRIBUTE_WEIGHTS if mention.position or a != "position"]
    weights = np.array([ATTRIBUTE_WEIGHTS[a] for a in names])
    m = min(int(rng.choice(len(NUM_ATTRIBUTE_PROBS), p=NUM_ATTRIBUTE_PROBS)) + 1, len(names))
    for name in rng.choice(names, size=m, replace=False, p=weights / weights.sum()).tolist():
        if name == "position":
            for a in _pick(rng, _position_choices(scene, mention.index)):
                _add_attribute(rng, scene, mention, a)
        else:
            _add_attribute(rng, scene, mention, name)


def _name_shape(rng: np.random.Generator, mention: _Mention, shape: str) -> None:
    """Call the shape by a hypernym now and then (the meaning records what the noun names)."""
    hypernyms = [h for h, members in HYPERNYMS.items() if shape in members]
    if hypernyms and rng.random() < HYPERNYM_PROB:
        mention.desc["shape"] = _pick(rng, hypernyms)
    elif rng.random() < GENERIC_PROB and len(mention.desc) > 1:
        del mention.desc["shape"]


def _singles_out(scene: Scene, mention: _Mention) -> bool:
    return not any(matches(o, mention.desc) for i, o in enumerate(scene.objects)
                   if i != mention.index)


def _make_unique(rng: np.random.Generator, scene: Scene, mention: _Mention) -> bool:
    """Grow the description until it singles out its object in the scene; False if it cannot."""
    while not _singles_out(scene, mention):
        obj = scene.objects[mention.index]
        others = [o for i, o in enumerate(scene.objects) if i != mention.index
                  and matches(o, mention.desc)]
        useful = [a for a in _object_attributes(mention.position)
                  if (a not in mention.desc or (a == "shape" and mention.desc["shape"] != obj.shape))
                  and any(o.attribute(a) != obj.attribute(a) for o in others)]
        if not useful:
            return False
        _add_attribute(rng, scene, mention, _pick(rng, useful))
    return True


class _Planner:
    """Builds one plan for one scene; returns ``None`` when the plan does not fit the scene."""

    def __init__(self, scene: Scene, rng: np.random.Generator) -> None:
        self.scene, self.rng = scene, rng
        self.n = len(scene.objects)

    def mention(self, index: int, position: bool = True) -> _Mention | None:
        m = _Mention(index, {}, position)
        _sample_attributes(self.rng, self.scene, m)
        if "shape" in m.desc:
            _name_shape(self.rng, m, self.scene.objects[index].shape)
        return m if _make_unique(self.rng, self.scene, m) else None

    def mentions(self, k: int, exclude: Sequence[int] = ()) -> list[_Mention] | None:
        pool = [i for i in range(self.n) if i not in exclude]
        if len(pool) < k:
            return None
        out = [self.mention(int(i)) for i in sorted(self.rng.permutation(pool)[:k].tolist())]
        return None if any(m is None for m in out) else out  # type: ignore[return-value]

    def relation(self) -> tuple[str, _Mention, _Mention] | None:
        i, j = (int(v) for v in self.rng.permutation(self.n)[:2])
        x, y = self.scene.objects[i], self.scene.objects[j]
        rels = [r for r in RELATIONS if relation_holds(r, x, y, self.scene.size)]
        if not rels:
            return None
        a, b = self.mention(i, position=False), self.mention(j, position=False)
        if a is None or b is None:
            return None
        rel = _pick(self.rng, rels)
        if self.rng.random() < 0.3:  # say it the other way round
            a, b, rel = b, a, CONVERSE[rel]
        return rel, a, b

    def count(self) -> tuple[dict[str, str], list[int]] | None:
        groups = []
        for r in range(1, 5):
            for names in itertools.combinations(("shape", "colour", "size", "texture"), r):
                by_value: dict[tuple, list[int]] = {}
                for k, o in enumerate(self.scene.objects):
                    by_value.setdefault(tuple(o.attribute(a) for a in names), []).append(k)
                groups += [(names, ks) for ks in by_value.values() if len(ks) >= 2]
        if not groups:
            return None
        names, members = _pick(self.rng, groups)
        return {a: self.scene.objects[members[0]].attribute(a) for a in names}, members

    def background(self) -> dict[str, str]:
        fields = BACKGROUND_CHOICES[int(self.rng.choice(len(BACKGROUND_CHOICES),
                                                        p=BACKGROUND_PROBS))]
        bg = self.scene.background
        return {f: getattr(bg, f) for f in sorted(fields)}

    def plan(self, kind: str) -> _Plan | None:
        plan = _Plan(kind)
        if kind in ("two", "three", "one", "one_background"):
            plan.mentions = self.mentions({"two": 2, "three": 3}.get(kind, 1)) or []
            if not plan.mentions:
                return None
            if kind == "one_background":
                plan.background = self.background()
        elif kind in ("relation", "relation_plus"):
            plan.relation = self.relation()
            if plan.relation is None:
                return None
            if kind == "relation_plus":
                taken = [plan.relation[1].index, plan.relation[2].index]
                plan.mentions = self.mentions(1, exclude=taken) or []
                if not plan.mentions:
                    return None
        elif kind == "count":
            plan.count = self.count()
            if plan.count is None:
                return None
            plan.mentions = self.mentions(1, exclude=plan.count[1]) or []
            if not plan.mentions:
                return None
        elif kind == "total_among":
            plan.total = self.n
            plan.mentions = self.mentions(int(self.rng.integers(1, 3))) or []
            if not plan.mentions:
                return None
        if plan.background is None and self.rng.random() < 0.12:
            plan.background = self.background()
        return plan

    def make_specific(self, plan: _Plan, specificity: Specificity | None) -> bool:
        """Step 2 of the module docstring: grow the plan until it is specific; False if it cannot."""
        while specificity is not None and not specificity.specific(plan.meaning()):
            options: list[tuple[_Mention | None, str]] = []
            for m in plan.described():
                obj = self.scene.objects[m.index]
                options += [(m, a) for a in _object_attributes(m.position)
                            if a not in m.desc or (a == "shape" and m.desc["shape"] != obj.shape)]
            if plan.background is None or len(plan.background) < 2:
                options.append((None, "background"))
            if not options:
                return False
            weights = np.array([GROWTH_WEIGHTS.get(a, ATTRIBUTE_WEIGHTS.get(a)) for _, a in options])
            mention, name = options[int(self.rng.choice(len(options), p=weights / weights.sum()))]
            if mention is None:
                plan.background = {f: getattr(self.scene.background, f) for f in ("hue", "tone")}
            else:
                _add_attribute(self.rng, self.scene, mention, name)
        return True


# ------------------------------------------------------------------------------- realisation


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def _noun(rng: np.random.Generator, desc: dict[str, str], n: int) -> str:
    concept = desc.get("shape")
    if concept is None:
        forms = GENERIC_NOUNS
    elif concept in HYPERNYM_NOUNS:
        forms = [HYPERNYM_NOUNS[concept]]
    else:
        forms = SHAPE_NOUNS[concept]
    singular, plural = _pick(rng, forms)
    return singular if n == 1 else plural


def _noun_phrase(rng: np.random.Generator, desc: dict[str, str], n: int) -> list[str]:
    """Words of a noun phrase for ``n`` objects matching ``desc`` (position excluded)."""
    noun = _noun(rng, desc, n)
    size = _pick(rng, SIZE_WORDS[desc["size"]]) if "size" in desc else None
    colour = _pick(rng, COLOUR_WORDS[desc["colour"]]) if "colour" in desc else None
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
    words = " ".join([w for w in pre if w] + [noun] + tail).split()
    det = _article(words[0]) if n == 1 else NUMBER_WORDS[n]
    return [det, *words]


def _position_phrase(rng: np.random.Generator, desc: dict[str, str]) -> str | None:
    h, v = desc.get("hpos"), desc.get("vpos")
    if h and v:
        if (h, v) in HV_PHRASES:
            return _pick(rng, HV_PHRASES[(h, v)])
        return _pick(rng, [f"in the {v} {h} corner", f"at the {v} {h}", f"in the {v} {h}"])  # 3-5
    if h:
        return _pick(rng, H_PHRASES[h])
    if v:
        return _pick(rng, V_PHRASES[v])
    return None


def _say_object(cap: Caption, rng: np.random.Generator, mention: _Mention) -> None:
    cap.add_phrase(_noun_phrase(rng, mention.desc, 1), 1 << mention.index)
    where = _position_phrase(rng, mention.desc) if mention.position else None
    if where:
        cap.add(where)


def _say_list(cap: Caption, rng: np.random.Generator, mentions: list[_Mention]) -> None:
    for i, mention in enumerate(mentions):
        if i > 0:
            cap.add("and" if i == len(mentions) - 1 else ",")
        _say_object(cap, rng, mention)


def _background_phrase(rng: np.random.Generator, background: dict[str, str]) -> list[str]:
    words = []
    if "tone" in background:
        words.append(_pick(rng, TONE_WORDS[background["tone"]]))
    if "hue" in background:
        words.append(_pick(rng, COLOUR_WORDS[background["hue"]]))
    return [_article(words[0]), *words, _pick(rng, BACKGROUND_NOUNS)]


def _realise(plan: _Plan, scene: Scene, rng: np.random.Generator) -> Caption:
    cap = Caption(meaning=plan.meaning())
    for m in plan.described():
        cap.mentions.setdefault(m.index, set()).update(m.desc)
    if plan.count is not None:
        for k in plan.count[1]:
            cap.mentions.setdefault(k, set()).update(plan.count[0])
    if plan.total is not None:
        for k in range(len(scene.objects)):
            cap.mentions.setdefault(k, set())

    opener = plan.background is not None and rng.random() < 0.35  # "On a dark backdrop, ..."
    if opener:
        cap.add(_pick(rng, ["on", "against"]))
        cap.add_phrase(_background_phrase(rng, plan.background), BACKGROUND_KEY, "scene")
        cap.add(",")
    elif plan.kind in ("two", "three", "one", "one_background"):
        lead = _pick(rng, ["", "", "", "", "there is", "a picture of", "an image showing", "we see"])
        if lead:
            cap.add(lead)
    if plan.total is not None:
        noun = _pick(rng, GENERIC_NOUNS)[1]
        cap.add_phrase([NUMBER_WORDS[plan.total], noun], (1 << plan.total) - 1)
        cap.add(_pick(rng, [", including", ", among them", ", among which"]))
    if plan.count is not None:
        desc, members = plan.count
        cap.add_phrase(_noun_phrase(rng, desc, len(members)), sum(1 << k for k in members))
        cap.add(_pick(rng, ["and", ", plus", "as well as"]))
    if plan.relation is not None:
        rel, a, b = plan.relation
        cap.add_phrase(_noun_phrase(rng, a.desc, 1), 1 << a.index)
        verb = _pick(rng, ["", "is", "sits", "placed"])
        cap.add(f"{verb} {_pick(rng, RELATION_WORDS[rel])}")
        cap.add_phrase(_noun_phrase(rng, b.desc, 1), 1 << b.index)
        if plan.mentions:
            cap.add(_pick(rng, [", and", ", as well as", ", plus"]))
    _say_list(cap, rng, plan.mentions)
    if plan.background is not None and not opener:
        cap.add(_pick(rng, ["on", "against", "in front of"]))
        cap.add_phrase(_background_phrase(rng, plan.background), BACKGROUND_KEY, "scene")
    cap.add(".")
    cap.tokens[0] = cap.tokens[0][0].upper() + cap.tokens[0][1:]
    return cap


def _one_caption(scene: Scene, rng: np.random.Generator, specificity: Specificity | None
                 ) -> Caption | None:
    planner = _Planner(scene, rng)
    kinds = list(PLAN_WEIGHTS)
    weights = np.array([PLAN_WEIGHTS[p] for p in kinds])
    plan = planner.plan(kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))])
    if plan is None or not planner.make_specific(plan, specificity):
        return None
    return _realise(plan, scene, rng)


def sample_captions(scene: Scene, rng: np.random.Generator, k: int = 5, tries: int = 60,
                    specificity: Specificity | None = None) -> list[Caption]:
    """``k`` true, specific captions of ``scene`` with pairwise different signatures where possible.

    Args:
        specificity: the reference check of step 2 (module docstring); ``None`` skips it.
    """
    out: list[Caption] = []
    seen_signatures: set[tuple] = set()
    seen_text: set[str] = set()
    for _ in range(k):
        best = None
        for _ in range(tries):
            cap = _one_caption(scene, rng, specificity)
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
