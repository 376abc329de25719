"""Crisscrossed Captions (CxC) similarity CSVs: loader, mapping onto a split, writer.

CxC (Parekh et al., 2021; data by Google LLC, google-research-datasets/Crisscrossed-Captions) rates
MS-COCO pairs on a 0-5 scale. Three kinds of file, told apart by their header:

- ``sits_*``: ``caption,image,agg_score,sampling_method`` (caption-image pairs);
- ``sis_*``: ``image1,image2,agg_score,sampling_method`` (image-image);
- ``sts_*``: ``caption1,caption2,agg_score,sampling_method`` (caption-caption).

Captions are written ``<prefix>:sentid:<Karpathy sentid>`` (prefix ``COCO_val2014``), images as COCO
file names. For retrieval, a sits pair whose ``agg_score`` is at or above a threshold (3.0 by
default) adds a positive beyond the image's own captions (docs/reference-code.md, section 1).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from icr.data.types import CaptionedImages
from icr.errors import DataError

logger = logging.getLogger(__name__)

HEADERS: dict[str, tuple[str, ...]] = {
    "sits": ("caption", "image", "agg_score", "sampling_method"),
    "sis": ("image1", "image2", "agg_score", "sampling_method"),
    "sts": ("caption1", "caption2", "agg_score", "sampling_method"),
}
CAPTION_COLUMNS = ("caption", "caption1", "caption2")
_SENTID = r"^[^:,]+:sentid:(\d+)$"


def _read_csv(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise DataError(f"{path}: CxC file not found")
    try:
        return pd.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8")
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: empty file; expected a CxC CSV with a header row") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a readable CSV ({e})".replace("\n", " ")) from None


def _kind(path: Path, columns: Sequence[str]) -> str:
    for kind, header in HEADERS.items():
        if tuple(columns) == header:
            return kind
    expected = " or ".join(",".join(h) for h in HEADERS.values())
    raise DataError(f"{path}: header {','.join(map(str, columns))!r} is not a CxC header; "
                    f"expected {expected}")


def _bad_row(path: Path, frame: pd.DataFrame, mask: pd.Series, problem: str) -> DataError:
    row = int(np.flatnonzero(mask.to_numpy())[0])
    values = ",".join(frame.iloc[row].astype(str))
    count = int(mask.sum())
    return DataError(f"{path}: line {row + 2} ({values!r}) {problem} ({count} such rows in all)")


def load_cxc_pairs(path: str | Path, min_score: float | None = None) -> pd.DataFrame:
    """Read a CxC ``sits_*``, ``sis_*`` or ``sts_*`` CSV.

    Args:
        path: the CSV file; its kind is told by its header.
        min_score: keep only rows with ``agg_score >= min_score`` (``None`` keeps all).

    Returns:
        A frame with the file's columns in file order: caption columns hold the integer Karpathy
        sentid (``int64``), image columns the file names, ``agg_score`` is ``float64``. The kind
        (``sits``, ``sis`` or ``sts``) is in ``frame.attrs["kind"]``.

    Raises:
        DataError: missing file, unknown header, empty field, malformed caption reference or score.
    """
    path = Path(path)
    frame = _read_csv(path)
    kind = _kind(path, list(frame.columns))
    empty = (frame == "").any(axis=1) | frame.isna().any(axis=1)
    if empty.any():
        raise _bad_row(path, frame, empty, "has an empty field (truncated file?)")
    for column in CAPTION_COLUMNS:
        if column in frame:
            sentid = frame[column].str.extract(_SENTID, expand=False)
            if sentid.isna().any():
                raise _bad_row(path, frame, sentid.isna(),
                               f"has a {column} not of the form <prefix>:sentid:<integer>")
            frame[column] = sentid.astype(np.int64)
    score = pd.to_numeric(frame["agg_score"], errors="coerce")
    if score.isna().any():
        raise _bad_row(path, frame, score.isna(), "has a non-numeric agg_score")
    frame["agg_score"] = score.astype(np.float64)
    if min_score is not None:
        frame = frame[frame["agg_score"] >= min_score].reset_index(drop=True)
    frame.attrs["kind"] = kind
    return frame


def extended_positives(
    split: CaptionedImages, sits_path: str | Path, min_score: float = 3.0
) -> tuple[list[list[int]], list[list[int]]]:
    """Map the positive CxC caption-image pairs onto a split's caption and image indices.

    Rows with ``agg_score >= min_score`` are positives. Rows whose caption (by sentid, against
    ``split.caption_ids``) or image (by file name, against ``split.image_ids``) is not in the split
    are skipped and counted in a log message; pairs already in the ground truth are not repeated.

    Args:
        split: the evaluation split; its ``caption_ids`` must be Karpathy sentids.
        sits_path: a ``sits_*`` CSV.
        min_score: the threshold on ``agg_score``.

    Returns:
        ``(extended_i2t, extended_t2i)``: per image index, the sorted extra positive caption
        indices; per caption index, the sorted extra positive image indices.

    Raises:
        DataError: the file is not a sits file or is malformed, or the split repeats a caption id.
    """
    path = Path(sits_path)
    pairs = load_cxc_pairs(path, min_score=min_score)
    if pairs.attrs["kind"] != "sits":
        raise DataError(f"{path}: is a {pairs.attrs['kind']} file; extended positives need a sits "
                        "(caption,image) file")
    caption_index = {sentid: i for i, sentid in enumerate(split.caption_ids)}
    if len(caption_index) != split.num_captions:
        raise DataError(f"{path}: split {split.split!r} repeats caption ids, so sentids cannot be "
                        "mapped; load it from a Karpathy JSON")
    image_index = {name: j for j, name in enumerate(split.image_ids)}
    i2t: list[set[int]] = [set() for _ in range(split.num_images)]
    t2i: list[set[int]] = [set() for _ in range(split.num_captions)]
    skipped = 0
    for sentid, image in zip(pairs["caption"].tolist(), pairs["image"].tolist(), strict=True):
        t, j = caption_index.get(sentid), image_index.get(image)
        if t is None or j is None:
            skipped += 1
        elif split.caption_image[t] != j:
            i2t[j].add(t)
            t2i[t].add(j)
    if pairs.shape[0] and skipped == pairs.shape[0]:
        raise DataError(f"{path}: none of its {skipped} pairs with agg_score >= {min_score:g} names "
                        f"a caption (Karpathy sentid) and an image (COCO file name) of the "
                        f"{split.split} split; CxC maps onto the COCO splits of a Karpathy JSON "
                        "(data.dataset=karpathy), not onto a precomputed folder's line numbers")
    if skipped:
        logger.warning("%s: %d of %d pairs with agg_score >= %g name a caption or image outside "
                       "the %s split; skipped", path, skipped, len(pairs), min_score, split.split)
    added = sum(len(s) for s in i2t)
    logger.info("%s: %d extra positive caption-image pairs for the %s split", path, added,
                split.split)
    return [sorted(s) for s in i2t], [sorted(s) for s in t2i]


def write_cxc_sits(
    path: str | Path,
    rows: Iterable[Sequence[object]],
    prefix: str = "COCO_val2014",
) -> None:
    """Write a sits CSV in the CxC layout.

    Args:
        path: the CSV file (parent folders are created).
        rows: ``(sentid, image_file_name, agg_score)`` or ``(sentid, image_file_name, agg_score,
            sampling_method)``; the default sampling method is ``synthetic``.
        prefix: caption prefix, written as ``<prefix>:sentid:<sentid>``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(HEADERS["sits"])
        for row in rows:
            sentid, image, score, *rest = row
            method = rest[0] if rest else "synthetic"
            writer.writerow((f"{prefix}:sentid:{int(sentid)}", image, float(score), method))
