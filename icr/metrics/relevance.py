"""ROUGE-L relevance matrices for nDCG, by the TERN protocol (docs/reference-code.md, section 5).

Entry ``(i, j)`` of the ``(N_cap, N_img)`` matrix is the ROUGE-L score of query caption ``i`` against
the reference captions of image ``j``, computed as pycocoevalcap's ``Rouge.calc_score`` does:

    P_r = LCS(q, r) / |q|,   R_r = LCS(q, r) / |r|      for each reference r of image j
    P = max_r P_r,  R = max_r R_r                        (maxima may come from different references)
    F = (1 + b^2) P R / (R + b^2 P),  b = 1.2,           F = 0 when P = 0 or R = 0

and the query's own image scores 1.0. Tokens are the lower-cased caption split on whitespace
(pycocoevalcap splits on a single space; ``str.split()`` also collapses runs of spaces, which only
matters for malformed captions). Whether the query itself is among its own image's references does not
matter: that entry is overwritten with 1.0, and no other column contains the query.

The longest common subsequence is computed for all (query, reference) pairs at once with the
bit-parallel algorithm of Allison & Dix (1986) in Hyyro's form (2004): for a query of ``m <= 64``
tokens, ``M[t]`` is the bit mask of the query positions holding token ``t``; starting from
``V = ~0``, each reference token ``t`` does ``U = V & M[t]; V = (V + U) | (V - U)``, and the LCS is the
number of zero bits among the low ``m`` bits of ``V``. One step is a handful of numpy operations over a
``(queries, references)`` block of uint64 words. Queries longer than 64 tokens fall back to a plain
dynamic programme.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from icr.errors import DataError
from icr.io import save_npy_atomic

logger = logging.getLogger(__name__)

BETA = 1.2
_MAX_BITS = 64
_BLOCK_ELEMENTS = 1 << 21  # (queries x references) uint64 words per block: ~16 MB per array
_QUERY_CHUNK = 4096  # queries scored at once


def rouge_l_relevance(
    query_captions: Sequence[str],
    image_captions: Sequence[Sequence[str]],
    query_image: Sequence[int] | np.ndarray | None = None,
    beta: float = BETA,
) -> np.ndarray:
    """ROUGE-L relevance of every query caption to every image (TERN protocol).

    Args:
        query_captions: the ``N_cap`` evaluation captions, in evaluation order (the rows).
        image_captions: per image, in evaluation order (the columns), its reference captions.
        query_image: per query caption, the index of its own image, whose entry is set to 1.0;
            ``None`` when the queries do not belong to the images.
        beta: the F-score weight of recall (1.2 in pycocoevalcap).

    Returns:
        ``(N_cap, N_img)`` float32 scores in [0, 1].
    """
    vocab: dict[str, int] = {}
    queries = [_token_ids(c, vocab) for c in query_captions]
    refs, ref_image = [], []
    for j, captions in enumerate(image_captions):
        if len(captions) == 0:
            raise DataError(f"image {j} has no reference captions; every image needs at least one")
        for caption in captions:
            refs.append(_token_ids(caption, vocab))
            ref_image.append(j)

    scores = np.zeros((len(queries), len(image_captions)), dtype=np.float32)  # (N_cap, N_img)
    if refs:
        # References are stored image by image: each image is one contiguous, non-empty segment.
        starts = np.flatnonzero(np.diff(np.asarray(ref_image), prepend=-1))
        r_len = np.array([len(r) for r in refs], dtype=np.float32)
        # Query chunks bound the memory: a COCO 5k matrix would need GBs of LCS values at once.
        for lo in range(0, len(queries), _QUERY_CHUNK):
            chunk = queries[lo : lo + _QUERY_CHUNK]
            lcs = lcs_matrix(chunk, refs, vocab_size=len(vocab))  # (n, N_ref)
            q_len = np.array([len(q) for q in chunk], dtype=np.float32)
            scores[lo : lo + len(chunk)] = _f_score(lcs, q_len, r_len, starts, beta)
    if query_image is not None:
        own = np.asarray(query_image, dtype=np.int64)
        if own.shape != (len(queries),):
            raise DataError(
                f"query_image has shape {own.shape}, expected ({len(queries)},): one image per query"
            )
        scores[np.arange(len(queries)), own] = 1.0
    return scores


def _f_score(
    lcs: np.ndarray, q_len: np.ndarray, r_len: np.ndarray, starts: np.ndarray, beta: float
) -> np.ndarray:
    """ROUGE-L F per (query, image) from ``(n, N_ref)`` LCS lengths; ``starts``: first ref per image."""
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(q_len[:, None] > 0, lcs / q_len[:, None], 0.0)  # (n, N_ref)
        recall = np.where(r_len[None, :] > 0, lcs / r_len[None, :], 0.0)  # (n, N_ref)
    p = np.maximum.reduceat(precision, starts, axis=1)  # (n, N_img)
    r = np.maximum.reduceat(recall, starts, axis=1)  # (n, N_img)
    b2 = beta * beta
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((p > 0) & (r > 0), (1 + b2) * p * r / (r + b2 * p), 0.0)


def lcs_matrix(
    queries: Sequence[Sequence[int]], refs: Sequence[Sequence[int]], vocab_size: int
) -> np.ndarray:
    """Length of the longest common subsequence of every (query, reference) pair.

    Args:
        queries: token-id sequences, ids in ``[0, vocab_size)``.
        refs: token-id sequences, ids in ``[0, vocab_size)``.
        vocab_size: one more than the largest id.

    Returns:
        ``(len(queries), len(refs))`` float32 LCS lengths.
    """
    out = np.zeros((len(queries), len(refs)), dtype=np.float32)
    if not queries or not refs:
        return out
    pad = vocab_size  # a token no query holds: its mask is 0, so the step leaves V unchanged
    r_len = np.array([len(r) for r in refs])
    width = max(1, int(r_len.max()))
    ref_tokens = np.full((len(refs), width), pad, dtype=np.int64)  # (N_ref, L)
    for k, r in enumerate(refs):
        ref_tokens[k, : len(r)] = r
    # Sorted by length, the references still running at step t are one contiguous tail.
    order = np.argsort(r_len, kind="stable")
    ref_tokens, r_len = ref_tokens[order], r_len[order]

    short = [i for i, q in enumerate(queries) if len(q) <= _MAX_BITS]
    rows = max(1, _BLOCK_ELEMENTS // len(refs))
    for start in range(0, len(short), rows):
        block = short[start : start + rows]
        masks = _match_masks([queries[i] for i in block], vocab_size + 1)  # (V + 1, B)
        lcs = _bit_parallel_lcs(masks, [len(queries[i]) for i in block], ref_tokens, r_len)
        out[block] = lcs.T  # columns still in length order
    out[:, order] = out.copy()  # back to the callers' reference order
    for i, q in enumerate(queries):
        if len(q) > _MAX_BITS:
            out[i] = [_lcs_dp(q, r) for r in refs]
    return out


def _match_masks(queries: Sequence[Sequence[int]], vocab_size: int) -> np.ndarray:
    """``(vocab_size, B)`` uint64: bit k of ``masks[t, b]`` is set when ``queries[b][k] == t``."""
    masks = np.zeros((vocab_size, len(queries)), dtype=np.uint64)
    cols = np.repeat(np.arange(len(queries)), [len(q) for q in queries])
    tokens = np.fromiter((t for q in queries for t in q), dtype=np.int64, count=len(cols))
    bits = np.fromiter((1 << k for q in queries for k in range(len(q))), dtype=np.uint64)
    np.bitwise_or.at(masks, (tokens, cols), bits)
    return masks


def _bit_parallel_lcs(
    masks: np.ndarray, q_len: Sequence[int], ref_tokens: np.ndarray, r_len: np.ndarray
) -> np.ndarray:
    """``(N_ref, B)`` LCS of B queries (given by their match masks) and references sorted by length.

    The state is laid out reference-major so that the references still running at step t (the
    longest ones, at the end) form one contiguous slice.
    """
    n_ref, n_query = ref_tokens.shape[0], masks.shape[1]
    v = np.full((n_ref, n_query), np.iinfo(np.uint64).max, dtype=np.uint64)  # (N_ref, B)
    u = np.empty_like(v)
    w = np.empty_like(v)
    for t in range(ref_tokens.shape[1]):
        first = int(np.searchsorted(r_len, t, side="right"))  # references with a token at t
        if first == n_ref:
            break
        vt, ut, wt = v[first:], u[first:], w[first:]
        np.take(masks, ref_tokens[first:, t], axis=0, out=ut, mode="clip")  # M[token] per pair
        np.bitwise_and(vt, ut, out=ut)  # U = V & M
        np.subtract(vt, ut, out=wt)  # V - U
        np.add(vt, ut, out=vt)  # V + U (wraps modulo 2^64, as the algorithm wants)
        np.bitwise_or(vt, wt, out=vt)
    low = np.array([(1 << m) - 1 for m in q_len], dtype=np.uint64)  # (B,)
    return np.bitwise_count(~v & low).astype(np.float32)  # zero bits among the low m bits


def _lcs_dp(a: Sequence[int], b: Sequence[int]) -> int:
    """Plain O(|a| |b|) LCS length, for queries too long for one machine word."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for k, y in enumerate(b):
            cur.append(prev[k] + 1 if x == y else max(prev[k + 1], cur[k]))
        prev = cur
    return prev[-1]


def _token_ids(caption: str, vocab: dict[str, int]) -> list[int]:
    return [vocab.setdefault(tok, len(vocab)) for tok in caption.lower().split()]


def relevance_fingerprint(
    query_captions: Sequence[str],
    image_captions: Sequence[Sequence[str]],
    query_image: Sequence[int] | np.ndarray | None,
    beta: float = BETA,
) -> str:
    """A hex digest that changes whenever any input of :func:`rouge_l_relevance` changes."""
    payload = {
        "metric": "rouge_l/v1",
        "beta": beta,
        "queries": list(query_captions),
        "images": [list(c) for c in image_captions],
        "query_image": None if query_image is None else [int(j) for j in query_image],
    }
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()


def cached_relevance(
    query_captions: Sequence[str],
    image_captions: Sequence[Sequence[str]],
    query_image: Sequence[int] | np.ndarray | None,
    cache_dir: Path,
    beta: float = BETA,
) -> np.ndarray:
    """:func:`rouge_l_relevance`, stored as ``rouge_l_<fingerprint>.npy`` in ``cache_dir``.

    The file is written to a temporary name and renamed, so a reader never sees half a matrix.
    """
    key = relevance_fingerprint(query_captions, image_captions, query_image, beta)
    path = Path(cache_dir) / f"rouge_l_{key[:20]}.npy"
    if path.exists():
        logger.info("ROUGE-L relevance: cache hit %s", path)
        return np.load(path)
    scores = rouge_l_relevance(query_captions, image_captions, query_image, beta)
    save_npy_atomic(path, scores)
    logger.info("ROUGE-L relevance %s written to %s", scores.shape, path)
    return scores
