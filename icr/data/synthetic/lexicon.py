"""The words of the shapes world: what each attribute value is called, synonyms and hypernyms.

One table per attribute family; the grammar writes from them, the grounding code reads them back
(:func:`lexicon`), so a word has one meaning everywhere. Real captions name one thing with many
words ("a dog", "a puppy", "an animal"), and a masked language model proposes them all; the shapes
world has the same structure so that negative-caption generators meet the false negatives they meet
on real data (Gupta et al., ECCV 2020, Sec. 2.4: the re-ranking exists to drop synonyms and
hypernyms):

- **synonyms**: several nouns or adjectives for one value ("square"/"box", "big"/"large",
  "grey"/"gray"); a caption with either is true of the same objects;
- **hypernyms**: nouns for a set of shapes, :data:`SHAPE_CONCEPTS` ("polygon": square, rectangle,
  triangle, diamond, pentagon, hexagon; "quadrilateral"; "symbol") and the generic nouns ("shape",
  "object", "figure", "item", "thing", "form", "element") that name any shape. A caption's meaning records the concept its
  noun names (``{"shape": "polygon"}``), so "a red polygon" is true of a red hexagon.

Multi-word nouns ("plus sign") are entries as a whole; :func:`lexicon` also lists their words.
"""

from __future__ import annotations

from collections.abc import Mapping

# shape -> [(singular, plural), ...]: the first pair is the canonical name
SHAPE_NOUNS: dict[str, list[tuple[str, str]]] = {
    "circle": [("circle", "circles"), ("disc", "discs"), ("disk", "disks")],
    "oval": [("oval", "ovals"), ("ellipse", "ellipses")],
    "square": [("square", "squares"), ("box", "boxes"), ("block", "blocks"), ("tile", "tiles")],
    "rectangle": [("rectangle", "rectangles"), ("oblong", "oblongs"), ("bar", "bars"),
                  ("strip", "strips")],
    "triangle": [("triangle", "triangles"), ("wedge", "wedges")],
    "diamond": [("diamond", "diamonds"), ("rhombus", "rhombuses"), ("lozenge", "lozenges")],
    "pentagon": [("pentagon", "pentagons")],
    "hexagon": [("hexagon", "hexagons")],
    "star": [("star", "stars")],
    "cross": [("cross", "crosses"), ("plus sign", "plus signs")],
    "heart": [("heart", "hearts")],
    "crescent": [("crescent", "crescents"), ("moon", "moons")],
    "arrow": [("arrow", "arrows"), ("pointer", "pointers")],
}
SHAPES = tuple(SHAPE_NOUNS)
# hypernym -> the shapes it names (a caption with it is true of any of them)
HYPERNYMS: dict[str, tuple[str, ...]] = {
    "polygon": ("square", "rectangle", "triangle", "diamond", "pentagon", "hexagon"),
    "quadrilateral": ("square", "rectangle", "diamond"),
    "symbol": ("star", "cross", "heart", "crescent", "arrow"),
}
HYPERNYM_NOUNS = {"polygon": ("polygon", "polygons"), "quadrilateral": ("quadrilateral",
                  "quadrilaterals"), "symbol": ("symbol", "symbols")}
# nouns for any shape (no "shape" key in the meaning)
GENERIC_NOUNS = [("shape", "shapes"), ("object", "objects"), ("figure", "figures"),
                 ("item", "items"), ("thing", "things"), ("form", "forms"), ("element", "elements")]
# concept -> the shapes it names: every shape names itself, every hypernym its members
SHAPE_CONCEPTS: dict[str, frozenset[str]] = {
    **{s: frozenset({s}) for s in SHAPES}, **{h: frozenset(m) for h, m in HYPERNYMS.items()},
}

COLOUR_WORDS: dict[str, list[str]] = {
    "red": ["red"], "orange": ["orange"], "yellow": ["yellow"], "green": ["green"],
    "cyan": ["cyan", "turquoise"], "blue": ["blue"], "purple": ["purple", "violet"],
    "pink": ["pink"], "brown": ["brown"], "grey": ["grey", "gray"],
}
SIZE_WORDS: dict[str, list[str]] = {
    "small": ["small", "little"], "medium": ["medium-sized", "medium", "mid-sized"],
    "large": ["large", "big"],
}
TEXTURE_ADJECTIVES: dict[str, list[str]] = {
    "solid": ["solid", "filled", "plain"], "striped": ["striped"],
    "dotted": ["dotted", "spotted"], "outlined": ["outlined", "hollow"],
    "checkered": ["checkered", "chequered"],
}
TEXTURE_PHRASES: dict[str, list[str]] = {
    "striped": ["with stripes"], "dotted": ["with dots", "with polka dots", "with spots"],
    "checkered": ["with checks"],
}
TONE_WORDS: dict[str, list[str]] = {"dark": ["dark"], "light": ["light", "pale", "bright"]}
# hues of the background, named with the object colour words
BACKGROUND_HUES = ("grey", "blue", "green", "red", "purple", "yellow")
BACKGROUND_NOUNS = ["background", "backdrop", "surface", "canvas"]
# nouns of the templates that name no attribute
OTHER_NOUNS = ("picture", "image", "corner", "side", "part", "scene")

Entry = tuple[str, str]  # (kind, value)


def lexicon() -> dict[str, Entry]:
    """What each word of the grammar names: ``word -> (kind, value)``.

    Kinds: ``shape`` (value: a concept of :data:`SHAPE_CONCEPTS`, a shape or a hypernym; synonyms
    and plurals included, e.g. ``box -> square``, ``polygons -> polygon``), ``generic`` (``shape``,
    ``object``, ``figure``, ...: any shape), ``colour``, ``size``, ``texture`` (adjectives
    and the nouns of ``with stripes``/``with dots``/``with checks``), ``tone`` (of the
    background), ``hpos``/``vpos`` (``left``, ``right``, ``top``, ``bottom``, ``upper``,
    ``lower``), ``position`` (``centre``, ``middle``: horizontal or vertical by context),
    ``background`` (``background``, ``backdrop``, ``surface``, ``canvas``), ``compound`` (a word of a two-word noun:
    ``plus``, ``sign``, ``polka``; value: the compound) and ``noun`` (a noun that names no
    attribute: ``picture``, ``image``, ``corner``, ...).
    """
    lex: dict[str, Entry] = {w: ("noun", w) for w in OTHER_NOUNS}
    lex.update({w: ("background", "background") for w in BACKGROUND_NOUNS})
    for shape, forms in SHAPE_NOUNS.items():
        for form in (f for pair in forms for f in pair):
            lex[form] = ("shape", shape)
            if " " in form:
                for part in form.split():
                    lex.setdefault(part, ("compound", form))
    for concept, pair in HYPERNYM_NOUNS.items():
        lex.update({form: ("shape", concept) for form in pair})
    for singular, plural in GENERIC_NOUNS:
        lex[singular] = lex[plural] = ("generic", singular)
    lex.update(_words("colour", COLOUR_WORDS))
    lex.update(_words("size", SIZE_WORDS))
    lex.update(_words("texture", TEXTURE_ADJECTIVES))
    for texture, phrases in TEXTURE_PHRASES.items():
        for phrase in phrases:
            *modifiers, noun = phrase.split()[1:]  # drop "with"
            lex[noun] = ("texture", texture)
            lex.update({m: ("compound", f"{m} {noun}") for m in modifiers})
    lex.update(_words("tone", TONE_WORDS))
    lex.update({"left": ("hpos", "left"), "right": ("hpos", "right"), "top": ("vpos", "top"),
                "bottom": ("vpos", "bottom"), "upper": ("vpos", "top"),
                "lower": ("vpos", "bottom"), "centre": ("position", "centre"),
                "middle": ("position", "middle")})
    return lex


def _words(kind: str, table: Mapping[str, list[str]]) -> dict[str, Entry]:
    return {w: (kind, value) for value, words in table.items() for w in words}

