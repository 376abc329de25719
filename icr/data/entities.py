"""Flickr30K Entities: sentence and box annotations, writers and loaders.

Layout of a root folder (the official ``annotations.zip``; docs/reference-code.md, section 4):

- ``Sentences/<image id>.txt``: one caption a line (5), phrases written
  ``[/EN#<chain id>/<type 1>/.../<type n> word ... word]``, e.g.
  ``[/EN#18/people A child] in [/EN#19/clothing a pink dress] is climbing up ...``.
  Phrases of type ``notvisual`` have chain id 0 and no boxes.
- ``Annotations/<image id>.xml``: PASCAL VOC-like; ``size`` (width, height, depth) and ``object``
  elements, each with one or more ``name`` tags (the chain ids sharing that object) and either a
  ``bndbox`` (1-based pixel coordinates) or ``nobndbox`` / ``scene`` flags.
- ``train.txt``, ``val.txt``, ``test.txt``: image ids, one a line.

Parsing follows the official ``flickr30k_entities_utils.py``: the sentence text is its words
joined by single spaces (brackets removed), ``first_word_index`` indexes those words, and box
coordinates are made 0-based by subtracting 1. Boxes are integer ``(xmin, ymin, xmax, ymax)``
tuples, inclusive as in the source; the writer rounds non-integer coordinates. Unlike the official
parser, every ``name`` of an object gets its box (one version of it kept only the first), and a
stray ``]``, a nested or unclosed phrase, or a malformed tag is an error instead of a silent word.
"""

from __future__ import annotations

import logging
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from icr.errors import DataError

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]
_OPENER = re.compile(r"^\[/EN#(\d+)((?:/[^/\s\]]+)+)$")


@dataclass(frozen=True)
class Phrase:
    """One annotated phrase of a sentence.

    Attributes:
        first_word_index: index of its first word among the sentence's words.
        text: its words joined by spaces.
        chain_id: the coreference chain (the ``name`` of the boxes); 0 for ``notvisual``.
        types: its entity types, e.g. ``("people",)`` or ``("vehicles", "scene")``.
    """

    first_word_index: int
    text: str
    chain_id: int
    types: tuple[str, ...]


@dataclass(frozen=True)
class EntitySentence:
    """A caption without its brackets and the phrases annotated in it."""

    text: str
    phrases: tuple[Phrase, ...] = ()


@dataclass(frozen=True)
class EntityAnnotation:
    """The boxes of one image.

    Attributes:
        width, height, depth: the ``size`` element.
        boxes: chain id -> 0-based ``(xmin, ymin, xmax, ymax)`` boxes (a chain can have several).
        nobox_chains: chains annotated as having no box.
        scene_chains: chains annotated as the scene.
    """

    width: int
    height: int
    depth: int
    boxes: dict[int, list[Box]] = field(default_factory=dict)
    nobox_chains: frozenset[int] = frozenset()
    scene_chains: frozenset[int] = frozenset()


@dataclass(frozen=True)
class EntitiesImage:
    """One image of a split: its id, its sentences and its boxes."""

    image_id: str
    sentences: list[EntitySentence]
    annotation: EntityAnnotation


# --------------------------------------------------------------------------------------- sentences


def _parse_opener(token: str, line: str) -> tuple[int, tuple[str, ...]]:
    match = _OPENER.match(token)
    if match is None:
        raise DataError(f"malformed phrase opener {token!r} (expected [/EN#<id>/<type>...) "
                        f"in {line!r}")
    return int(match.group(1)), tuple(match.group(2)[1:].split("/"))


def parse_sentence_line(line: str) -> EntitySentence:
    """Parse one line of a ``Sentences/<id>.txt`` file.

    Raises:
        DataError: an unclosed, nested or empty phrase, a stray ``]``, or a malformed ``[/EN#`` tag
            (the message quotes the line; :func:`load_sentences` adds the file and line number).
    """
    line = line.strip()
    words: list[str] = []
    phrases: list[Phrase] = []
    current: tuple[int, int, tuple[str, ...]] | None = None  # (first word, chain id, types)
    for token in line.split():
        if token.startswith("["):
            if current is not None:
                raise DataError(f"nested phrase at {token!r} in {line!r}")
            chain_id, types = _parse_opener(token, line)
            current = (len(words), chain_id, types)
            continue
        closes = token.endswith("]")
        word = token[:-1] if closes else token
        if word:
            words.append(word)
        if closes:
            if current is None:
                raise DataError(f"']' without an opening [/EN# tag at {token!r} in {line!r}")
            first, chain_id, types = current
            if len(words) == first:
                raise DataError(f"empty phrase [/EN#{chain_id}/...] in {line!r}")
            phrases.append(Phrase(first, " ".join(words[first:]), chain_id, types))
            current = None
    if current is not None:
        raise DataError(f"phrase [/EN#{current[1]}/...] is never closed with ']' in {line!r}")
    return EntitySentence(" ".join(words), tuple(phrases))


def format_sentence(sentence: EntitySentence) -> str:
    """Write a sentence back in the bracket syntax; inverse of :func:`parse_sentence_line`.

    Raises:
        ValueError: a phrase does not match the words at its ``first_word_index``, overlaps
            another, or has no valid type.
    """
    words = sentence.text.split()
    out: list[str] = []
    position = 0
    for phrase in sorted(sentence.phrases, key=lambda p: p.first_word_index):
        phrase_words = phrase.text.split()
        start, end = phrase.first_word_index, phrase.first_word_index + len(phrase_words)
        if start < position or not phrase_words or words[start:end] != phrase_words:
            raise ValueError(f"phrase {phrase.text!r} at word {start} does not fit "
                             f"{sentence.text!r}")
        if not phrase.types or any("/" in t or not t or t.split() != [t] for t in phrase.types):
            raise ValueError(f"phrase {phrase.text!r} has invalid types {phrase.types}")
        out.extend(words[position:start])
        tag = "/".join((f"[/EN#{phrase.chain_id}", *phrase.types))
        out.append(f"{tag} {' '.join(phrase_words)}]")
        position = end
    out.extend(words[position:])
    return " ".join(out)


def load_sentences(path: str | Path) -> list[EntitySentence]:
    """Read a ``Sentences/<id>.txt`` file, one :class:`EntitySentence` per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: sentence file not found")
    sentences = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                sentences.append(parse_sentence_line(line))
            except DataError as e:
                raise DataError(f"{path}:{number}: {e}") from None
    return sentences


def write_sentences(path: str | Path, sentences: Iterable[EntitySentence]) -> None:
    """Write sentences one a line in the bracket syntax (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(format_sentence(s) + "\n" for s in sentences), encoding="utf-8")


# ------------------------------------------------------------------------------------- annotations


def _int(element: ET.Element | None, path: Path, what: str) -> int:
    if element is None or element.text is None:
        raise DataError(f"{path}: missing <{what}>")
    try:
        return round(float(element.text))
    except ValueError:
        raise DataError(f"{path}: <{what}> is {element.text!r}, not a number") from None


def _flag(obj: ET.Element, tag: str, path: Path) -> bool:
    element = obj.find(tag)
    return element is not None and _int(element, path, tag) > 0


def load_annotation(path: str | Path) -> EntityAnnotation:
    """Read an ``Annotations/<id>.xml`` file; boxes become 0-based (1 is subtracted)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: annotation file not found")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise DataError(f"{path}: malformed XML ({e})") from None
    size = root.find("size")
    if size is None:
        raise DataError(f"{path}: no <size> element")
    width, height, depth = (_int(size.find(t), path, f"size/{t}")
                            for t in ("width", "height", "depth"))
    boxes: dict[int, list[Box]] = {}
    nobox: set[int] = set()
    scene: set[int] = set()
    for obj in root.iter("object"):
        names = [_int(name, path, "object/name") for name in obj.findall("name")]
        if not names:
            raise DataError(f"{path}: an <object> has no <name> (chain id)")
        bndbox = obj.find("bndbox")
        if bndbox is not None:
            box = tuple(_int(bndbox.find(t), path, f"bndbox/{t}") - 1
                        for t in ("xmin", "ymin", "xmax", "ymax"))
            for chain in names:
                boxes.setdefault(chain, []).append(box)  # type: ignore[arg-type]
            continue
        if _flag(obj, "nobndbox", path):
            nobox.update(names)
        if _flag(obj, "scene", path):
            scene.update(names)
    return EntityAnnotation(width, height, depth, boxes, frozenset(nobox), frozenset(scene))


def write_annotation(path: str | Path, annotation: EntityAnnotation) -> None:
    """Write an annotation as the dataset's XML (boxes written 1-based).

    A box shared by several chains becomes one ``object`` with several ``name`` tags, as in the
    dataset.
    """
    path = Path(path)
    root = ET.Element("annotation")
    ET.SubElement(root, "filename").text = f"{path.stem}.jpg"
    size = ET.SubElement(root, "size")
    for tag, value in (("width", annotation.width), ("height", annotation.height),
                       ("depth", annotation.depth)):
        ET.SubElement(size, tag).text = str(value)
    chains_of_box: dict[Box, list[int]] = {}
    for chain, chain_boxes in annotation.boxes.items():
        for box in chain_boxes:
            key = tuple(round(v) for v in box)
            chains_of_box.setdefault(key, []).append(chain)  # type: ignore[arg-type]
    for box, chains in chains_of_box.items():
        obj = ET.SubElement(root, "object")
        for chain in chains:
            ET.SubElement(obj, "name").text = str(chain)
        bndbox = ET.SubElement(obj, "bndbox")
        for tag, value in zip(("xmin", "ymin", "xmax", "ymax"), box, strict=True):
            ET.SubElement(bndbox, tag).text = str(value + 1)
    for chain in sorted(annotation.nobox_chains | annotation.scene_chains):
        obj = ET.SubElement(root, "object")
        ET.SubElement(obj, "name").text = str(chain)
        ET.SubElement(obj, "nobndbox").text = str(int(chain in annotation.nobox_chains))
        ET.SubElement(obj, "scene").text = str(int(chain in annotation.scene_chains))
    ET.indent(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8")


# ---------------------------------------------------------------------------------------- splits


def load_split_ids(path: str | Path) -> list[str]:
    """Read a split file (``train.txt``, ...): one image id a line, blank lines ignored."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: split file not found")
    ids = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    ids = [i for i in ids if i]
    if len(set(ids)) != len(ids):
        raise DataError(f"{path}: {len(ids) - len(set(ids))} image ids occur more than once")
    return ids


def write_split_ids(path: str | Path, ids: Sequence[str | int]) -> None:
    """Write image ids one a line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")


def load_entities(root: str | Path, split: str) -> list[EntitiesImage]:
    """Load the images listed in ``root/<split>.txt`` with their sentences and annotations.

    Raises:
        DataError: a missing split, sentence or annotation file, or a malformed one.
    """
    root = Path(root)
    images = [
        EntitiesImage(
            image_id=image_id,
            sentences=load_sentences(root / "Sentences" / f"{image_id}.txt"),
            annotation=load_annotation(root / "Annotations" / f"{image_id}.xml"),
        )
        for image_id in load_split_ids(root / f"{split}.txt")
    ]
    logger.info("%s: %s split, %d images", root, split, len(images))
    return images
