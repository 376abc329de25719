"""The in-memory form every loader returns, whatever the file format on disk."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class CaptionedImages:
    """One split of an image-caption dataset, in evaluation order.

    Captions are grouped by image but no code may assume they sit at ``5 * i .. 5 * i + 4``:
    ``caption_image`` is the ground-truth map.

    Attributes:
        split: ``train``, ``val`` or ``test`` (Karpathy ``restval`` is folded into ``train``).
        image_ids: unique image file names (Karpathy ``filename``), one per image.
        captions: raw caption strings, ``C`` of them.
        caption_ids: Karpathy ``sentid`` of each caption (used by CxC files).
        caption_image: ``(C,)`` int64, index into ``image_ids`` of each caption's image.
        image_root: folder holding the image files, or ``None`` when only features exist.
        tokens: per caption, the tokenised caption when the file provides it (Karpathy ``tokens``).
        image_subdirs: per image, the sub-folder of ``image_root`` holding it (Karpathy
            ``filepath``, e.g. ``train2014`` / ``val2014`` for COCO, whose train split mixes both),
            or ``None``.
        numeric_ids: per image, its number in the dataset (Karpathy ``cocoid`` for COCO, else
            ``imgid``): what SCAN's ``{split}_ids.txt`` lists, or ``None``.
    """

    split: str
    image_ids: tuple[str, ...]
    captions: tuple[str, ...]
    caption_ids: tuple[int, ...]
    caption_image: np.ndarray
    image_root: Path | None = None
    tokens: tuple[tuple[str, ...], ...] | None = field(default=None, repr=False)
    image_subdirs: tuple[str, ...] | None = field(default=None, repr=False)
    numeric_ids: tuple[str, ...] | None = field(default=None, repr=False)

    @property
    def num_images(self) -> int:
        return len(self.image_ids)

    @property
    def num_captions(self) -> int:
        return len(self.captions)

    def image_path(self, index: int) -> Path:
        if self.image_root is None:
            raise ValueError(f"split {self.split!r} has no image folder")
        if self.image_subdirs is not None:
            return self.image_root / self.image_subdirs[index] / self.image_ids[index]
        return self.image_root / self.image_ids[index]
