"""Precomputed nDCG relevance matrices (SPICE or any other), stored as ``.npy`` files.

A matrix has shape ``(N_cap, N_img)``: row ``i`` is evaluation caption ``i`` as a query, column
``j`` is evaluation image ``j``, both in the split's evaluation order (docs/reference-code.md, section
5). ROUGE-L matrices are computed in :mod:`icr.metrics.relevance`; this module only reads and writes
files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from icr.errors import DataError

logger = logging.getLogger(__name__)

_ROWS_PER_CHECK = 4096  # finiteness is checked in row blocks, to bound the temporary mask


def load_relevance(
    path: str | Path, num_captions: int, num_images: int, mmap: bool = False
) -> np.ndarray:
    """Read a relevance matrix and check it fits the split.

    Args:
        path: an ``.npy`` file holding a 2-d float array.
        num_captions, num_images: the split's sizes; the matrix must be
            ``(num_captions, num_images)``.
        mmap: memory-map the file (read-only) instead of reading it.

    Returns:
        The ``(N_cap, N_img)`` matrix, as stored if floating point, else converted to float32.

    Raises:
        DataError: missing or unreadable file, wrong shape (transposed matrices are named as such),
            or non-finite entries.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: relevance matrix not found; set data.relevance to an .npy file, "
                        "'rouge' or 'none'")
    try:
        matrix = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable .npy array ({e})".replace("\n", " ")) from None
    expected = (num_captions, num_images)
    if matrix.shape != expected:
        transposed = matrix.shape == expected[::-1]
        hint = "; it looks transposed, save it as (captions, images)" if transposed else ""
        raise DataError(f"{path}: relevance matrix has shape {matrix.shape}, expected "
                        f"(captions, images) = {expected}{hint}")
    dtype = matrix.dtype
    if not np.issubdtype(dtype, np.number) or np.issubdtype(dtype, np.complexfloating):
        raise DataError(f"{path}: relevance matrix has dtype {matrix.dtype}, expected real numbers")
    if not np.issubdtype(matrix.dtype, np.floating):
        matrix = matrix.astype(np.float32)
    bad = sum(int((~np.isfinite(matrix[i:i + _ROWS_PER_CHECK])).sum())
              for i in range(0, num_captions, _ROWS_PER_CHECK))
    if bad:
        raise DataError(f"{path}: relevance matrix has {bad} non-finite entries (NaN or inf)")
    logger.info("%s: relevance matrix %s, %s", path, matrix.shape, matrix.dtype)
    return matrix


def save_relevance(path: str | Path, matrix: np.ndarray) -> None:
    """Write a ``(N_cap, N_img)`` relevance matrix to exactly ``path`` (no ``.npy`` is appended).

    Raises:
        ValueError: the matrix is not 2-d or has non-finite entries.
    """
    matrix = np.asarray(matrix)
    if matrix.ndim != 2:
        raise ValueError(f"relevance matrix must be 2-d (captions, images), got {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise ValueError("relevance matrix has non-finite entries")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.save(f, matrix)
