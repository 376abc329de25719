"""SCAN / BUTD precomputed region features: writer and loader.

One folder holds, per split (docs/reference-code.md, section 6):

- ``{split}_ims.npy``: ``(N, R, D)`` float32 region features (BUTD: R = 36, D = 2048);
- ``{split}_caps.txt``: one caption a line, ``k`` (5) per image, in image order, UTF-8;
- ``{split}_ids.txt``: one image id a line;
- ``{split}_boxes.npy`` (ours, optional on read): ``(N, R, 4)`` float32 xyxy boxes in pixels.

Some releases store every image ``k`` times (``k * N`` feature rows, one per caption, and the ids
either repeated the same way or listed once). :func:`load_precomp` detects this and keeps every
``k``-th row; with ``mmap=True`` that is a strided view of the memory map, so nothing is copied.
Only the first image's ``k`` rows are checked to be identical (checking all would read the file).

The published folders (SCAN's ``data.zip``, read as published by VSE-infinity and the LTD code)
name their splits ``train``, ``dev`` (validation) and ``test``, and for COCO ``testall``: COCO's
5,000 Karpathy test images (its ``test`` holds the first 1,000 of them); the embedded benchmark
names them ``train``, ``val`` and ``test``. :func:`choose_splits` picks, per role, the file split a
folder holds (``data.splits`` names them explicitly).

Precomputed releases carry no Karpathy ``sentid``: ``caption_ids`` are the caption line numbers
(0-based), so CxC files, which name captions by ``sentid``, cannot be mapped onto such a split.
The caption file is read in text mode (the VSRN reference read bytes under Python 3 and lost
accuracy).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from icr.data.types import CaptionedImages
from icr.errors import DataError

logger = logging.getLogger(__name__)

ROLES = ("train", "val", "test")  # what a run reads, in evaluation order
# The file splits a role is read from, the first one a folder holds: SCAN's names, then ours.
CANDIDATES = {"train": ("train",), "val": ("dev", "val"), "test": ("testall", "test")}


@dataclass(frozen=True)
class PrecompSplit:
    """Region features of one split and its captions.

    Attributes:
        features: ``(N, R, D)`` region features, a read-only memory map when loaded with ``mmap``.
        boxes: ``(N, R, 4)`` xyxy pixel boxes, or ``None`` when the folder has none.
        images: the captions and image ids, row ``i`` of ``features`` is ``images.image_ids[i]``.
    """

    features: np.ndarray
    boxes: np.ndarray | None
    images: CaptionedImages


def _paths(folder: Path, split: str) -> dict[str, Path]:
    return {
        "ims": folder / f"{split}_ims.npy",
        "caps": folder / f"{split}_caps.txt",
        "ids": folder / f"{split}_ids.txt",
        "boxes": folder / f"{split}_boxes.npy",
    }


def write_precomp(
    folder: str | Path,
    split: str,
    features: np.ndarray,
    boxes: np.ndarray | None,
    captions: Sequence[str],
    ids: Sequence[str | int],
) -> None:
    """Write one split in the SCAN layout (plus ``{split}_boxes.npy`` when ``boxes`` is given).

    Args:
        folder: output folder (created).
        split: split name used in the file names (``train``, ``dev``, ``test``, ``testall``, ...).
        features: ``(N, R, D)`` region features, stored as float32.
        boxes: ``(N, R, 4)`` xyxy pixel boxes, or ``None``.
        captions: ``k * N`` captions, image 0's first; none may contain a line break.
        ids: ``N`` image ids.

    Raises:
        ValueError: inconsistent shapes or a caption with a line break.
    """
    features = np.asarray(features)
    n = len(ids)
    if features.ndim != 3 or features.shape[0] != n:
        raise ValueError(f"features must be (N={n}, R, D), got {features.shape}")
    if boxes is not None and np.shape(boxes) != (*features.shape[:2], 4):
        raise ValueError(f"boxes must be {(*features.shape[:2], 4)}, got {np.shape(boxes)}")
    if n == 0 or len(captions) % n:
        raise ValueError(f"{len(captions)} captions is not a multiple of {n} images")
    if any("\n" in c or "\r" in c for c in captions):
        raise ValueError("captions must not contain line breaks")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = _paths(folder, split)
    np.save(paths["ims"], features.astype(np.float32, copy=False))
    if boxes is not None:
        np.save(paths["boxes"], np.asarray(boxes, dtype=np.float32))
    paths["caps"].write_text("".join(f"{c}\n" for c in captions), encoding="utf-8")
    paths["ids"].write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")


def folder_splits(folder: str | Path) -> tuple[str, ...]:
    """The split names a folder holds files of (``{name}_ims.npy`` or ``{name}_caps.txt``)."""
    names = {p.name.rsplit("_", 1)[0] for pattern in ("*_ims.npy", "*_caps.txt")
             for p in Path(folder).glob(pattern)}
    return tuple(sorted(names))


def parse_splits(value: str) -> dict[str, str]:
    """``data.splits`` as ``{role: file split}``: ``auto`` is ``{}``; ``val=dev,test=test`` names
    two (the key's form is validated with the config)."""
    if value in ("", "auto"):
        return {}
    return dict(pair.split("=", 1) for pair in value.split(","))


def choose_splits(folder: str | Path, given: str = "auto") -> dict[str, str]:
    """The file split each role (``train``, ``val``, ``test``) is read from.

    A role named in ``given`` (``data.splits``) takes that name; any other the first of
    :data:`CANDIDATES` the folder holds: validation from ``dev`` (SCAN) else ``val``, test from
    ``testall`` (COCO's 5,000 images) else ``test``.

    Raises:
        DataError: a role the folder holds no files of, one line naming what was looked for.
    """
    folder = Path(folder)
    named, held = parse_splits(given), folder_splits(folder)
    found = ", ".join(held) or "none"
    out = {}
    for role in ROLES:
        if role in named:
            if named[role] not in held:
                raise DataError(f"{folder / (named[role] + '_ims.npy')}: not found (data.splits "
                                f"names {role}={named[role]}; the folder holds splits: {found})")
            out[role] = named[role]
            continue
        choice = next((name for name in CANDIDATES[role] if name in held), None)
        if choice is None:
            wanted = " or ".join(f"{name}_ims.npy" for name in CANDIDATES[role])
            raise DataError(f"{folder}: no {role} split ({wanted}; the folder holds splits: "
                            f"{found}); name its files' split with data.splits={role}=NAME")
        out[role] = choice
    return out


def _read_lines(path: Path, what: str) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path}: {what} file not found")
    try:
        with path.open(encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    while lines and not lines[-1].strip():  # blank lines at the end of a file are not entries
        lines.pop()
    return lines


def _load_array(path: Path, mmap: bool) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: feature file not found")
    try:
        array = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})".replace("\n", " ")) from None
    if array.ndim != 3:
        raise DataError(f"{path}: expected a 3-d array (images, regions, dims), got shape "
                        f"{array.shape}")
    if array.dtype != np.float32:  # what SCAN/BUTD publish and the encoders read
        raise DataError(f"{path}: dtype {array.dtype}, expected float32; save it with "
                        "np.save(path, array.astype(np.float32))")
    return array


def _deduplicate(
    paths: dict[str, Path], features: np.ndarray, ids: list[str], num_captions: int, k: int
) -> tuple[np.ndarray, list[str], bool]:
    """Undo a release that stores each image ``k`` times; return (features, ids, repeated)."""
    rows = features.shape[0]
    counts = (f"{paths['ims'].name} has {rows} rows, {paths['ids'].name} has {len(ids)} ids, "
              f"{paths['caps'].name} has {num_captions} captions")
    if rows == len(ids) and num_captions == k * rows:
        return features, ids, False
    repeated_rows = k > 1 and rows == num_captions and rows % k == 0
    if repeated_rows and len(ids) == rows:
        blocks = [ids[i:i + k] for i in range(0, rows, k)]
        bad = next((b for b in blocks if len(set(b)) != 1), None)
        if bad is not None:
            raise DataError(f"{paths['ids'].parent}: {counts}, but ids are not repeated {k} times "
                            f"in a row (e.g. {bad}); expected {k} captions per image")
        ids = ids[::k]
    elif not (repeated_rows and len(ids) * k == rows):
        raise DataError(f"{paths['ids'].parent}: {counts}; expected N rows, N ids and {k}N "
                        f"captions (or {k}N rows for releases that repeat each image)")
    if not np.array_equal(features[0], features[k - 1]):
        raise DataError(f"{paths['ims']}: {counts}, but rows 0 and {k - 1} differ, so the rows are "
                        f"not images repeated {k} times")
    return features[::k], ids, True


def load_precomp(
    folder: str | Path, split: str, mmap: bool = True, captions_per_image: int = 5
) -> PrecompSplit:
    """Load one split of a SCAN/BUTD precomputed folder.

    Args:
        folder: the folder holding ``{split}_ims.npy``, ``{split}_caps.txt``, ``{split}_ids.txt``
            and optionally ``{split}_boxes.npy``.
        split: the split name in the file names.
        mmap: memory-map the arrays (read-only) instead of reading them into memory.
        captions_per_image: ``k``, captions per image in the caption file.

    Returns:
        The split, with repeated-image releases de-duplicated (see the module docstring).

    Raises:
        DataError: a missing file, or counts that disagree between the files.
    """
    folder = Path(folder)
    paths = _paths(folder, split)
    features = _load_array(paths["ims"], mmap)
    captions = _read_lines(paths["caps"], "caption")
    ids = [line.strip() for line in _read_lines(paths["ids"], "image id")]
    k = captions_per_image
    rows = features.shape[0]
    features, ids, repeated = _deduplicate(paths, features, ids, len(captions), k)
    if repeated:
        logger.info("%s: each image is stored %d times; keeping every %d-th row", paths["ims"],
                    k, k)
    if len(set(ids)) != len(ids):
        raise DataError(f"{paths['ids']}: image ids are not unique ({len(ids) - len(set(ids))} "
                        "duplicates)")
    boxes = None
    if paths["boxes"].is_file():
        boxes = _load_array(paths["boxes"], mmap)
        if boxes.shape != (rows, features.shape[1], 4):
            raise DataError(f"{paths['boxes']}: shape {boxes.shape} does not match "
                            f"{paths['ims'].name} {(rows, features.shape[1])} + 4 coordinates")
        boxes = boxes[::k] if repeated else boxes
    images = CaptionedImages(
        split=split,
        image_ids=tuple(ids),
        captions=tuple(captions),
        caption_ids=tuple(range(len(captions))),
        caption_image=np.repeat(np.arange(len(ids), dtype=np.int64), k),
    )
    logger.info("%s: %s split, %d images x %s regions, %d captions", folder, split, len(ids),
                features.shape[1:], len(captions))
    return PrecompSplit(features=features, boxes=boxes, images=images)
