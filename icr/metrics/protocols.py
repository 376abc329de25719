"""Evaluation protocols: which images and captions are ranked against each other.

- ``full``: every test image against every test caption (COCO 5k, Flickr30K 1k, the embedded
  benchmark). Keys are those of :func:`icr.metrics.retrieval.retrieval_metrics`, unprefixed.
- ``coco_5fold_1k``: the COCO Karpathy test split's 5,000 images, in order, cut into 5 folds of
  1,000, each fold with the captions of its images (5,000 captions); every metric is computed
  within each fold and averaged over the folds (ranks too, as VSE++ and VSE-infinity do). Keys
  are prefixed ``1k_`` (``1k_rsum``, ``1k_i2t_R_at_1``, ...).

Which protocols a test split is reported with, and its fold size, its dataset decides from what
its files hold (:func:`icr.data.datasets.reporting_protocols`: COCO's ``testall``, or any test
split of 5,000 images; a scaled-down COCO-layout folder gets 5 folds of a fifth of its test split,
and says so); :func:`icr.train.evaluation.split_metrics` evaluates them.

Graded relevance (nDCG) and CxC extended positives are sliced per fold: a fold's relevance
matrix is its captions' rows and its images' columns, and its extended positives are those that
fall inside the fold (re-indexed). This is how TERN computes nDCG on COCO 1k; CxC publishes 5k
numbers only, so a ``1k_cxc_*`` value is this project's extension of it.

References:
    Faghri et al. 2018 (VSE++), Section 4 (COCO 1k as the average over 5 folds and 5k);
    VSE+2AD paper, Section 4.1 ("MS-COCO 1K averages the results over 5-folds of 1K test
    images"); Messina et al. 2021 (TERN) for nDCG on the folds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from torch import Tensor

from icr.metrics.retrieval import retrieval_metrics

__all__ = [
    "FOLD_PREFIX",
    "FOLD_SIZE",
    "PROTOCOLS",
    "evaluate_protocol",
    "evaluate_protocols",
    "fold_metrics",
]

PROTOCOLS = ("full", "coco_5fold_1k")
FOLD_SIZE = 1000  # images per fold on COCO (a scaled-down fixture: a fifth of its test split)
FOLD_PREFIX = "1k_"

Similarities = Tensor | tuple[Tensor, Tensor]


def evaluate_protocol(
    sims: Similarities,
    caption_image: Tensor,
    protocol: str,
    *,
    fold_size: int = FOLD_SIZE,
    **retrieval_kwargs: Any,
) -> dict[str, float]:
    """Retrieval metrics of one protocol (see the module docstring).

    Args:
        sims: the image-caption similarity matrix, or ``(image_embeddings, caption_embeddings)``
            (then only each fold's block of similarities is ever computed).
        caption_image: index of each caption's image.
        protocol: ``"full"`` or ``"coco_5fold_1k"``.
        fold_size: images per fold (1,000; smaller in tests); must divide the number of images.
        retrieval_kwargs: passed to :func:`~icr.metrics.retrieval.retrieval_metrics` (``ks``,
            ``relevance``, ``extended_i2t``, ``extended_t2i``, ``chunk_size``), sliced per fold.

    Shapes:
        sims: ``(N_img, N_cap)`` or ``((N_img, D), (N_cap, D))``; caption_image: ``(N_cap,)``.

    Raises:
        ValueError: an unknown protocol, or folds that do not divide the images.
    """
    if protocol == "full":
        return retrieval_metrics(_block(sims, None, None), caption_image, **retrieval_kwargs)
    if protocol == "coco_5fold_1k":
        folds = fold_metrics(sims, caption_image, fold_size=fold_size, **retrieval_kwargs)
        return {f"{FOLD_PREFIX}{key}": float(np.mean([f[key] for f in folds])) for key in folds[0]}
    raise ValueError(f"unknown evaluation protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")


def evaluate_protocols(
    sims: Similarities, caption_image: Tensor, protocols: Iterable[str], **kwargs: Any
) -> dict[str, float]:
    """The metrics of several protocols in one dict (their keys never clash)."""
    out: dict[str, float] = {}
    for protocol in protocols:
        out |= evaluate_protocol(sims, caption_image, protocol, **kwargs)
    return out


def fold_metrics(
    sims: Similarities,
    caption_image: Tensor,
    *,
    fold_size: int = FOLD_SIZE,
    relevance: Tensor | np.ndarray | None = None,
    extended_i2t: Sequence[Sequence[int]] | None = None,
    extended_t2i: Sequence[Sequence[int]] | None = None,
    **retrieval_kwargs: Any,
) -> list[dict[str, float]]:
    """The metrics of each fold: images ``[f * fold_size, (f + 1) * fold_size)`` and their captions.

    Returns one :func:`~icr.metrics.retrieval.retrieval_metrics` dict per fold, in fold order.
    """
    num_images = _num_images(sims)
    if fold_size < 1 or num_images % fold_size:
        raise ValueError(f"{num_images} images do not split into folds of {fold_size}")
    caption_image = caption_image.long()
    out = []
    for start in range(0, num_images, fold_size):
        stop = start + fold_size
        in_fold = (caption_image >= start) & (caption_image < stop)  # (N_cap,)
        captions = in_fold.nonzero().squeeze(1)  # (C,) in caption order
        kwargs = dict(retrieval_kwargs)
        if relevance is not None:
            rows = captions.cpu().numpy()
            kwargs["relevance"] = (
                relevance[rows][:, start:stop]
                if isinstance(relevance, np.ndarray)
                else relevance[captions.to(relevance.device)][:, start:stop]
            )  # (C, fold_size)
        if extended_i2t is not None:
            fold_index = {int(c): i for i, c in enumerate(captions.tolist())}
            kwargs["extended_i2t"] = [
                [fold_index[c] for c in extended_i2t[img] if c in fold_index]
                for img in range(start, stop)
            ]
        if extended_t2i is not None:
            kwargs["extended_t2i"] = [
                [img - start for img in extended_t2i[c] if start <= img < stop]
                for c in captions.tolist()
            ]
        block = _block(sims, slice(start, stop), captions)  # (fold_size, C)
        out.append(retrieval_metrics(block, caption_image[captions] - start, **kwargs))
    return out


def _num_images(sims: Similarities) -> int:
    return int(sims[0].shape[0] if isinstance(sims, tuple) else sims.shape[0])


def _block(sims: Similarities, images: slice | None, captions: Tensor | None) -> Tensor:
    """The similarities of ``images`` (rows) to ``captions`` (columns); None = all."""
    images = images or slice(None)
    if isinstance(sims, tuple):
        img, cap = sims
        cap = cap if captions is None else cap[captions.to(cap.device)]
        return img[images] @ cap.T  # (N_img', N_cap')
    block = sims[images]
    return block if captions is None else block[:, captions.to(sims.device)]
