"""Grounding inputs: region features and boxes per image, phrases and their boxes per caption.

A :class:`GroundingSplit` joins two folders by image id (file stem):

- a BUTD-style feature folder: ``{split}_ims.npy`` ``(N, R, D_r)`` region features,
  ``{split}_boxes.npy`` ``(N, R, 4)`` xyxy pixel boxes, ``{split}_ids.txt`` one image id a line
  (:mod:`icr.data.precomp`; a caption file is not needed);
- a Flickr30K Entities folder: ``Sentences/``, ``Annotations/`` and ``{split}.txt``
  (:mod:`icr.data.entities`). The split's images, their order and their captions come from here.

:func:`load_shapes_grounding` reads the embedded benchmark (``precomp/`` and ``entities/``);
:func:`load_grounding` reads real data, e.g. BUTD detections of Flickr30K with the official
annotations.

Phrases. Each caption's phrases come from its ``Sentences`` line. A phrase is kept when it can be
evaluated: ``notvisual`` phrases (chain 0) are skipped, and so are phrases whose chain has no box in
``Annotations``. A ``scene`` chain has no box in the format (``<scene>1</scene>``, no
``bndbox``) and is skipped like the reference's evaluation does; ``scene_as_image=True`` gives it
the whole image as its box instead. A chain can have several boxes: a phrase counts as found when
any of them is (the reference; no union box).

Boxes. The split keeps every box as its file gives it: annotation boxes are 0-based inclusive
integer pixel boxes (the XML's 1-based values minus 1, :mod:`icr.data.entities`), region boxes are
``{split}_boxes.npy`` as stored. :meth:`GroundingSplit.boxes` hands both to the metric in one of
the conventions of :mod:`icr.metrics.grounding`:

- ``infoground`` (the default): both as they are. The info-ground evaluation does exactly this
  with its torchvision detections (continuous floats) and the annotations (XML minus 1), reading
  every box as inclusive (``+1`` in areas, centre strictly inside), so the default metric equals
  the reference's on the same files. ``region_boxes_inclusive`` plays no part.
- ``continuous``: annotation boxes become ``(x1, y1, x2 + 1, y2 + 1)``; region boxes stay as stored
  when they are continuous (``region_boxes_inclusive=False``, the default of :func:`load_grounding`:
  torchvision detections and the shapes world, whose right/bottom edges are exclusive) and get
  ``+1`` on ``x2, y2`` when the detector wrote inclusive boxes (``region_boxes_inclusive=True``).

A region whose raw box is all zeros is padding (``region_mask`` False).

Words. With ``max_words`` set (or ``None`` for no cap), the loader tags every caption and selects
its content words (:func:`icr.grounding.words.select_split_words`), and ``word_phrase`` says which
kept phrase each selected word falls in (its token index lies in the phrase's word span).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import Tensor

from icr.data.entities import EntitiesImage, load_entities
from icr.errors import DataError
from icr.grounding.words import MAX_WORDS, SelectedWords, select_split_words
from icr.metrics.grounding import (
    DEFAULT_BOX_CONVENTION,
    check_box_convention,
    grounding_metrics,
    phrase_region_scores,
)

logger = logging.getLogger(__name__)

__all__ = [
    "GroundingPhrase",
    "GroundingSplit",
    "load_grounding",
    "load_shapes_grounding",
]


@dataclass(frozen=True)
class GroundingPhrase:
    """One evaluable phrase of a caption.

    Attributes:
        chain_id: its Flickr30K Entities chain.
        first_word_index: index of its first word among the caption's whitespace tokens.
        words: its words.
        boxes: ``(G, 4)`` float32 ground-truth boxes, 0-based inclusive pixel boxes as annotated
            (module docstring).
    """

    chain_id: int
    first_word_index: int
    words: tuple[str, ...]
    boxes: np.ndarray = field(repr=False)

    @property
    def end(self) -> int:
        """One past the index of its last word."""
        return self.first_word_index + len(self.words)


@dataclass(frozen=True)
class GroundingSplit:
    """Regions per image, captions with phrases and boxes, and the selected words of a split.

    Global phrase index: the kept phrases of caption 0 in caption order, then caption 1's, ...;
    ``phrase_*`` arrays and ``word_phrase`` use it.

    Attributes:
        split: the split name (of the Entities folder).
        image_ids: image ids (file stems), the Entities split file's order.
        region_features: region features of each image (a memory map when the file order already
            matches the split's).
        region_boxes: float32 boxes as the feature folder stores them (module docstring).
        region_mask: which regions are real (padding is False).
        image_sizes: ``(width, height)`` of each image, from the annotations.
        captions: caption texts, whitespace-tokenised (the Entities sentence text).
        caption_image: index of each caption's image.
        phrases: per caption, its evaluable phrases (module docstring).
        phrase_caption, phrase_first, phrase_end: caption and word span ``[first, end)`` of each
            phrase.
        phrase_boxes: ground-truth boxes of each phrase, 0-based inclusive, zero-padded to the most
            boxes of a phrase.
        phrase_box_mask: which of them are real.
        words: the selected content words of each caption, or ``None`` (not selected).
        word_phrase: global index of the phrase holding each selected word, -1 when none does or
            at padding; ``None`` without ``words``.
        skipped: phrases left out, by reason (``notvisual``, ``no_box``).
        region_boxes_inclusive: the stored region boxes are inclusive (for ``continuous``).

    Shapes:
        region_features ``(N, R, D_r)``, region_boxes ``(N, R, 4)``, region_mask ``(N, R)``,
        image_sizes ``(N, 2)``, caption_image ``(C,)``, phrase_caption / phrase_first /
        phrase_end ``(F,)``, phrase_boxes ``(F, G, 4)``, phrase_box_mask ``(F, G)``, word_phrase
        ``(C, W)``.
    """

    split: str
    image_ids: tuple[str, ...]
    region_features: np.ndarray = field(repr=False)
    region_boxes: np.ndarray = field(repr=False)
    region_mask: np.ndarray = field(repr=False)
    image_sizes: np.ndarray = field(repr=False)
    captions: tuple[str, ...] = field(repr=False)
    caption_image: np.ndarray = field(repr=False)
    phrases: tuple[tuple[GroundingPhrase, ...], ...] = field(repr=False)
    phrase_caption: np.ndarray = field(repr=False)
    phrase_first: np.ndarray = field(repr=False)
    phrase_end: np.ndarray = field(repr=False)
    phrase_boxes: np.ndarray = field(repr=False)
    phrase_box_mask: np.ndarray = field(repr=False)
    words: SelectedWords | None = field(default=None, repr=False)
    word_phrase: np.ndarray | None = field(default=None, repr=False)
    skipped: dict[str, int] = field(default_factory=dict)
    region_boxes_inclusive: bool = False

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    @property
    def num_phrases(self) -> int:
        return len(self.phrase_caption)

    @property
    def phrase_image(self) -> np.ndarray:
        """``(F,)`` int64, the image of each phrase."""
        return self.caption_image[self.phrase_caption]

    def piece_phrase(self, piece_word: np.ndarray) -> np.ndarray:
        """The global phrase of each word-feature position, -1 when none.

        Args:
            piece_word: ``(C, P)`` selected-word slot of each position
                (:attr:`icr.grounding.words.WordFeatures.piece_word`), -1 at padding.

        Returns:
            ``(C, P)`` int64, for :func:`icr.metrics.grounding.phrase_region_scores`.
        """
        if self.word_phrase is None:
            raise ValueError("this split has no selected words; load it with max_words set")
        if len(piece_word) != self.num_captions:
            raise ValueError(f"piece_word has {len(piece_word)} rows for {self.num_captions} "
                             "captions")
        rows = np.arange(len(piece_word))[:, None]  # (C, 1)
        phrase = self.word_phrase[rows, np.maximum(piece_word, 0)]  # (C, P)
        return np.where(piece_word >= 0, phrase, -1)

    def boxes(self, convention: str = DEFAULT_BOX_CONVENTION) -> tuple[np.ndarray, np.ndarray]:
        """Region and phrase boxes in a metric convention (module docstring).

        Args:
            convention: ``infoground`` (as stored) or ``continuous``.

        Returns:
            ``region_boxes`` ``(N, R, 4)`` and ``phrase_boxes`` ``(F, G, 4)``, float32.
        """
        if check_box_convention(convention) == "infoground":
            return self.region_boxes, self.phrase_boxes
        far = np.float32([0, 0, 1, 1])  # inclusive -> one past the last pixel
        regions = self.region_boxes + far if self.region_boxes_inclusive else self.region_boxes
        return regions, self.phrase_boxes + far

    def evaluate(self, attention: Tensor | np.ndarray, piece_word: np.ndarray,
                 ks: tuple[int, ...] = (1, 5, 10),
                 box_convention: str = DEFAULT_BOX_CONVENTION) -> dict[str, float]:
        """Recall@k and pointing accuracy of every caption's attention over its image's regions.

        Args:
            attention: each word-feature position's attention over the regions of its caption's
                own image (e.g. the model's ``paired`` attention, caption by caption).
            piece_word: ``(C, P)`` selected-word slot of each position, -1 at padding.
            ks: the k of Recall@k.
            box_convention: ``infoground`` (the reference's evaluation) or ``continuous``.

        Shapes:
            attention ``(C, P, R)``.

        Returns:
            :func:`icr.metrics.grounding.grounding_metrics` (percentages and ``phrases``).
        """
        scores = phrase_region_scores(attention, self.piece_phrase(piece_word),
                                      self.num_phrases)  # (F, R)
        regions, truth = self.boxes(box_convention)
        return grounding_metrics(scores, self.phrase_image, regions, self.region_mask, truth,
                                 self.phrase_box_mask, ks, box_convention=box_convention)


# --------------------------------------------------------------------------------- phrases


def _phrases_of(image: EntitiesImage, scene_as_image: bool, skipped: dict[str, int]
                ) -> list[tuple[GroundingPhrase, ...]]:
    ann = image.annotation
    out = []
    for sentence in image.sentences:
        kept = []
        for phrase in sentence.phrases:
            if phrase.chain_id == 0 or "notvisual" in phrase.types:
                skipped["notvisual"] += 1
                continue
            boxes = list(ann.boxes.get(phrase.chain_id, []))
            if not boxes and scene_as_image and phrase.chain_id in ann.scene_chains:
                boxes = [(0, 0, ann.width - 1, ann.height - 1)]
            if not boxes:
                skipped["no_box"] += 1
                continue
            kept.append(GroundingPhrase(phrase.chain_id, phrase.first_word_index,
                                        tuple(phrase.text.split()),
                                        np.asarray(boxes, dtype=np.float32)))  # (G, 4)
        out.append(tuple(kept))
    return out


def _phrase_arrays(phrases: Sequence[tuple[GroundingPhrase, ...]]) -> dict[str, np.ndarray]:
    flat = [(c, p) for c, caption in enumerate(phrases) for p in caption]
    most = max((len(p.boxes) for _, p in flat), default=1)
    boxes = np.zeros((len(flat), most, 4), dtype=np.float32)  # (F, G, 4)
    mask = np.zeros((len(flat), most), dtype=bool)  # (F, G)
    for f, (_, p) in enumerate(flat):
        boxes[f, :len(p.boxes)] = p.boxes
        mask[f, :len(p.boxes)] = True
    return {
        "phrase_caption": np.array([c for c, _ in flat], dtype=np.int64),
        "phrase_first": np.array([p.first_word_index for _, p in flat], dtype=np.int64),
        "phrase_end": np.array([p.end for _, p in flat], dtype=np.int64),
        "phrase_boxes": boxes,
        "phrase_box_mask": mask,
    }


def _word_phrase(words: SelectedWords, arrays: dict[str, np.ndarray], num_captions: int
                 ) -> np.ndarray:
    out = np.full(words.word_index.shape, -1, dtype=np.int64)  # (C, W)
    starts = np.searchsorted(arrays["phrase_caption"], np.arange(num_captions + 1))  # (C + 1,)
    for c in range(num_captions):
        for f in range(starts[c], starts[c + 1]):
            inside = ((words.word_index[c] >= arrays["phrase_first"][f])
                      & (words.word_index[c] < arrays["phrase_end"][f]))  # (W,)
            out[c, inside] = f
    return out


# --------------------------------------------------------------------------------- regions


def _read_ids(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path}: image id file not found")
    ids = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [i for i in ids if i]


def _load_npy(path: Path, what: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: {what} file not found (grounding needs {path.name})")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})".replace("\n", " ")) from None
    if array.ndim != 3:
        raise DataError(f"{path}: expected a 3-d array, got shape {array.shape}")
    return array


def _regions(folder: Path, split: str, stems: Sequence[str], max_regions: int | None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features, boxes (as stored) and mask of the images ``stems``, in that order."""
    ims_path, boxes_path = folder / f"{split}_ims.npy", folder / f"{split}_boxes.npy"
    ids_path = folder / f"{split}_ids.txt"
    features = _load_npy(ims_path, "region feature")
    boxes = _load_npy(boxes_path, "region box")
    ids = [Path(i).stem for i in _read_ids(ids_path)]
    if not len(ids) == features.shape[0] == boxes.shape[0] or boxes.shape[1:] != (
            features.shape[1], 4):
        raise DataError(f"{folder}: {ids_path.name} has {len(ids)} ids, {ims_path.name} shape "
                        f"{features.shape}, {boxes_path.name} shape {boxes.shape}; expected N "
                        "ids, (N, R, D) features and (N, R, 4) boxes")
    row_of = {stem: r for r, stem in enumerate(ids)}
    missing = [s for s in stems if s not in row_of]
    if missing:
        raise DataError(f"{ids_path}: {len(missing)} images of the entities split are missing "
                        f"(e.g. {missing[0]!r}); use the feature split of the same images")
    rows = np.array([row_of[s] for s in stems], dtype=np.int64)
    r = features.shape[1] if max_regions is None else min(max_regions, features.shape[1])
    if np.array_equal(rows, np.arange(features.shape[0])):
        features = features[:, :r]  # a view of the memory map: nothing is read yet
    else:
        logger.info("%s: %d of %d rows in entities order; reading them", ims_path, len(rows),
                    features.shape[0])
        features = np.ascontiguousarray(features[rows, :r])
    raw = np.asarray(boxes[rows, :r], dtype=np.float32)  # (N, R, 4)
    mask = np.any(raw != 0, axis=-1)  # (N, R) an all-zero box is padding
    return features, raw, mask


# --------------------------------------------------------------------------------- loaders


def load_grounding(
    features_dir: str | Path,
    entities_dir: str | Path,
    split: str,
    features_split: str | None = None,
    max_regions: int | None = None,
    region_boxes_inclusive: bool = False,
    max_words: int | None = MAX_WORDS,
    select_words: bool = True,
    scene_as_image: bool = False,
) -> GroundingSplit:
    """Load a grounding split from a BUTD-style feature folder and a Flickr30K Entities folder.

    Args:
        features_dir: folder with ``{features_split}_ims.npy``, ``_boxes.npy``, ``_ids.txt``.
        entities_dir: folder with ``Sentences/``, ``Annotations/`` and ``{split}.txt``.
        split: the Entities split (``train``, ``val``, ``test``): its images, order, captions.
        features_split: the split name in the feature files (e.g. ``dev``); default ``split``.
        max_regions: keep the first R regions of each image (the reference: 30); ``None``: all.
        region_boxes_inclusive: the stored region boxes are inclusive pixel boxes; they get ``+1``
            on ``x2, y2`` in the ``continuous`` convention only (module docstring). Torchvision
            detections (the reference's) are continuous.
        max_words: cap on selected words per caption (:func:`~icr.grounding.words.select_words`);
            ``None`` keeps all content words (useful for evaluation splits).
        select_words: tag the captions and select their words (``False``: ``words`` is None).
        scene_as_image: give ``scene`` chains without a box the whole image as box.

    Raises:
        DataError: a missing or malformed file, or images of the split missing from the features.
    """
    features_dir, entities_dir = Path(features_dir), Path(entities_dir)
    images = load_entities(entities_dir, split)
    if not images:
        raise DataError(f"{entities_dir / (split + '.txt')}: the split lists no images")
    stems = [Path(im.image_id).stem for im in images]
    if len(set(stems)) != len(stems):
        raise DataError(f"{entities_dir / (split + '.txt')}: image ids repeat after removing "
                        "file extensions")
    features, boxes, mask = _regions(features_dir, features_split or split, stems, max_regions)
    skipped = {"notvisual": 0, "no_box": 0}
    phrases = [p for im in images for p in _phrases_of(im, scene_as_image, skipped)]
    captions = tuple(s.text for im in images for s in im.sentences)
    caption_image = np.repeat(np.arange(len(images), dtype=np.int64),
                              [len(im.sentences) for im in images])
    arrays = _phrase_arrays(phrases)
    words = select_split_words(captions, max_words) if select_words else None
    word_phrase = _word_phrase(words, arrays, len(captions)) if words is not None else None
    sizes = np.array([(im.annotation.width, im.annotation.height) for im in images],
                     dtype=np.int64)
    out = GroundingSplit(split, tuple(stems), features, boxes, mask, sizes, captions,
                         caption_image, tuple(phrases), **arrays, words=words,
                         word_phrase=word_phrase, skipped=skipped,
                         region_boxes_inclusive=region_boxes_inclusive)
    logger.info("%s grounding: %d images x %d regions, %d captions, %d phrases (skipped %s)",
                split, out.num_images, boxes.shape[1], out.num_captions, out.num_phrases,
                skipped)
    return out


def load_shapes_grounding(
    root: str | Path,
    split: str,
    max_regions: int | None = None,
    max_words: int | None = MAX_WORDS,
    select_words: bool = True,
    scene_as_image: bool = False,
) -> GroundingSplit:
    """Load a split of the embedded benchmark (``root/precomp`` and ``root/entities``).

    Its region boxes are continuous (the generator writes exclusive right/bottom edges), and its
    image ids are the stems of the precomputed folder's file names. Arguments as
    :func:`load_grounding`.
    """
    root = Path(root)
    if not (root / "precomp").is_dir() or not (root / "entities").is_dir():
        raise DataError(f"{root}: no precomp/ and entities/ folders; is it a shapes benchmark "
                        "(python -m icr.data.synthetic --out DIR)?")
    return load_grounding(root / "precomp", root / "entities", split, max_regions=max_regions,
                          region_boxes_inclusive=False, max_words=max_words,
                          select_words=select_words, scene_as_image=scene_as_image)
