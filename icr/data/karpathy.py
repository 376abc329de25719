"""Karpathy split JSON (``dataset_coco.json``, ``dataset_flickr30k.json``): writer and loader.

Layout (docs/reference-code.md, section 6)::

    {"images": [{"split": "train" | "restval" | "val" | "test",
                 "filename": "COCO_val2014_000000391895.jpg",
                 "filepath": "val2014",                     # COCO only
                 "imgid": 0, "sentids": [0, 1, ...], "cocoid": 391895,   # cocoid: COCO only
                 "sentences": [{"raw": "A man ...", "tokens": ["a", "man", ...],
                                "imgid": 0, "sentid": 0}, ...]},
                ...],
     "dataset": "coco"}

``restval`` is folded into ``train``; each image contributes its first ``captions_per_image``
captions (some COCO images have 6 or 7).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from icr.data.types import CaptionedImages
from icr.errors import DataError

logger = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
FILE_SPLITS = ("train", "restval", "val", "test")
_TOKEN = re.compile(r"[a-z0-9]+(?:['-][a-z0-9]+)*")


def tokenize(raw: str) -> list[str]:
    """Lower-cased word tokens without punctuation, close to the ``tokens`` of the real files."""
    return _TOKEN.findall(raw.lower())


def write_karpathy_json(
    path: str | Path, dataset_name: str, images: Sequence[Mapping[str, Any]]
) -> None:
    """Write images in the real Karpathy layout.

    Args:
        path: the JSON file to write (parent folders are created).
        dataset_name: the top-level ``dataset`` value (``coco``, ``flickr30k``, ...).
        images: one mapping per image with ``split`` (train/restval/val/test), ``filename`` and
            ``sentences`` (raw strings, or dicts with ``raw`` and optionally ``tokens``/``sentid``).
            Optional: ``filepath``, ``imgid`` (default: position), ``cocoid``. Missing sentence ids
            continue a running counter; missing tokens come from :func:`tokenize`.

    Raises:
        ValueError: an image has an unknown split, no filename, or a duplicate sentence id.
    """
    out: list[dict[str, Any]] = []
    next_sentid = 0
    seen_sentids: set[int] = set()
    for position, image in enumerate(images):
        if image.get("split") not in FILE_SPLITS:
            raise ValueError(f"image {position}: split {image.get('split')!r} not in {FILE_SPLITS}")
        if not image.get("filename"):
            raise ValueError(f"image {position}: no filename")
        imgid = int(image.get("imgid", position))
        sentences = []
        for sentence in image["sentences"]:
            entry = {"raw": sentence} if isinstance(sentence, str) else dict(sentence)
            sentid = int(entry.get("sentid", next_sentid))
            if sentid in seen_sentids:
                raise ValueError(f"image {position}: duplicate sentid {sentid}")
            seen_sentids.add(sentid)
            next_sentid = max(next_sentid, sentid + 1)
            sentences.append({
                "tokens": list(entry.get("tokens") or tokenize(entry["raw"])),
                "raw": entry["raw"], "imgid": imgid, "sentid": sentid,
            })
        record: dict[str, Any] = {"split": image["split"], "filename": image["filename"]}
        for key in ("filepath", "cocoid"):
            if key in image:
                record[key] = image[key]
        record.update(imgid=imgid, sentids=[s["sentid"] for s in sentences], sentences=sentences)
        out.append(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        json.dump({"images": out, "dataset": dataset_name}, f)


def _read_images(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DataError(f"{path}: Karpathy split JSON not found; set data.karpathy_json to the "
                        "file")
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); "
                        "is the file truncated?") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise DataError(f"{path}: no top-level 'images' list; is this a Karpathy split JSON?")
    return data["images"]


def _image_captions(path: Path, position: int, image: Any, k: int) -> tuple[str, str, list[dict]]:
    """Return (split, filename, first k sentences) of one image record, validated."""
    try:
        split, filename, sentences = image["split"], image["filename"], image["sentences"]
    except (KeyError, TypeError) as e:
        raise DataError(f"{path}: image {position} has no {e} field") from None
    if split not in FILE_SPLITS:
        raise DataError(f"{path}: image {filename!r} has split {split!r}, not one of {FILE_SPLITS}")
    return split, filename, sentences[:k]


def load_karpathy(
    json_path: str | Path,
    split: str,
    image_root: str | Path | None = None,
    captions_per_image: int = 5,
) -> CaptionedImages:
    """Load one split of a Karpathy JSON, captions grouped by image in file order.

    Args:
        json_path: the split JSON.
        split: ``train`` (includes ``restval``), ``val`` or ``test``.
        image_root: folder of the images; each image lives at ``image_root/filepath/filename``
            (``filepath`` only when the file has it, as COCO's does).
        captions_per_image: captions kept per image (the first ones); an image with fewer is an
            error.

    Returns:
        The split; ``caption_ids`` are the Karpathy ``sentid`` values (what CxC files refer to).

    Raises:
        DataError: missing or malformed file, unknown split, duplicate file name, too few captions.
    """
    path = Path(json_path)
    if split not in SPLITS:
        raise DataError(f"{path}: unknown split {split!r}; expected one of {SPLITS}")
    wanted = {"train", "restval"} if split == "train" else {split}
    image_ids: list[str] = []
    subdirs: list[str | None] = []
    numbers: list[int | None] = []  # cocoid (COCO) or imgid: what SCAN's ids files list
    captions: list[str] = []
    caption_ids: list[int] = []
    tokens: list[tuple[str, ...]] | None = []
    seen: set[str] = set()
    for position, image in enumerate(_read_images(path)):
        image_split, filename, sentences = _image_captions(path, position, image,
                                                           captions_per_image)
        if image_split not in wanted:
            continue
        if len(sentences) < captions_per_image:
            raise DataError(f"{path}: image {filename!r} (imgid {image.get('imgid')}) has "
                            f"{len(sentences)} captions, fewer than captions_per_image="
                            f"{captions_per_image}")
        if filename in seen:
            raise DataError(f"{path}: image file name {filename!r} occurs twice in split {split!r}")
        seen.add(filename)
        image_ids.append(filename)
        subdirs.append(image.get("filepath"))
        numbers.append(image.get("cocoid", image.get("imgid")))
        for sentence in sentences:
            try:
                captions.append(sentence["raw"])
                caption_ids.append(int(sentence["sentid"]))
            except (KeyError, TypeError, ValueError):
                raise DataError(f"{path}: image {filename!r} has a sentence without 'raw' and an "
                                "integer 'sentid'") from None
            if tokens is not None and isinstance(sentence.get("tokens"), list):
                tokens.append(tuple(sentence["tokens"]))
            else:
                tokens = None
    if not image_ids:
        raise DataError(f"{path}: no images with split {split!r}")
    has_subdirs = all(s is not None for s in subdirs)
    logger.info("%s: %s split, %d images, %d captions", path, split, len(image_ids), len(captions))
    return CaptionedImages(
        split=split,
        image_ids=tuple(image_ids),
        captions=tuple(captions),
        caption_ids=tuple(caption_ids),
        caption_image=np.repeat(np.arange(len(image_ids), dtype=np.int64), captions_per_image),
        image_root=Path(image_root) if image_root is not None else None,
        tokens=tuple(tokens) if tokens is not None else None,
        image_subdirs=tuple(subdirs) if has_subdirs else None,  # type: ignore[arg-type]
        numeric_ids=(tuple(str(n) for n in numbers) if all(n is not None for n in numbers)
                     else None),
    )
