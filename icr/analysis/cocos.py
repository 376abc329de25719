"""COCOS: counting the samples that contribute to the gradient with respect to a query.

Section 4 of Bleeker & de Rijke, "Do Lessons from Metric Learning Generalize to Image-Caption
Retrieval?" (ECIR 2022). For one batch similarity matrix in the project's pair convention
(``sims[i, j]`` = image of pair i vs caption of pair j, ``image_ids`` the dataset image of each
pair, see :mod:`icr.losses.contrastive`), a counter returns per-query numbers for both directions
(i2t: image queries; t2i: caption queries), with positives and negatives exactly as the matching
loss defines them (pairs sharing an image are neither):

- triplet (SH, ``triplet``) and triplet (all, ``triplet_all``), margin alpha: C^q, the number of
  negatives whose hinge ``alpha - s+ + s-`` is positive (Eq. 9d); for SH only the hardest
  negative counts, so C^q is 0 or 1 (Eq. 10).
- NT-Xent (``infonce``), temperature tau: C^{qv-}, the number of negatives whose softmax weight
  ``exp(s-/tau) / Z(q)`` exceeds eps; W^{qv-}, the sum of those weights; W^{qv+} = 1 - p_pos
  (Eq. 11 and the three terms after it).
- SmoothAP (``smoothap``), temperature tau: Eq. 13, C^q = mean over the query's positives i of the
  number of other candidates j with ``G'(D_ij) / R(i)^2 > eps``, where ``G'(x) = sigma(x/tau)
  (1 - sigma(x/tau)) / tau`` is the derivative of Eq. 7 (with its 1/tau, as in the paper's
  appendix) and R(i) the smoothed rank of positive i among all candidates. Image queries are
  deduplicated as the loss does (:func:`icr.losses.smoothap.image_caption_matrix`).

Every counter summarises a direction ``d`` of one batch as (``COCOS_KEYS``):

- ``{d}_contributing``: mean of C^q over the queries with C^q > 0, and 0 when no query of the
  batch contributes, the column C^q of Tables 2 and 4 (a Triplet SH query counts 1 exactly when
  it has a gradient, which is why the paper reports 1 +- 0). The 0 is what the paper's
  notebooks average (``evaluation/Gradient counting-*``: the ECIR SmoothAP counter returns 0 for
  such a batch and ``GradStats`` takes the mean and std over all batches);
- ``{d}_contributing_nonempty``: the same mean, NaN when no query contributes, so that the mean
  over batches skips those batches (the mean per batch that has gradient at all; this module's
  earlier default);
- ``{d}_contributing_all``: mean of C^q over all queries, the column C^{qv-} of Table 3;
- ``{d}_batch_total``: C^B, the sum of C^q over the batch's queries (Table 2);
- ``{d}_zero_queries``: C^0, the number of queries with C^q = 0 (Tables 2 and 4);
- NT-Xent only: ``{d}_negative_weight`` (mean W^{qv-}) and ``{d}_positive_weight`` (mean W^{qv+}).

Where this differs from the ECIR code (``shared/losses.py``; docs/reference-code.md section 2), the paper's
definitions win: the code's SmoothAP t2i counter slices the columns of the wrong queries (captions
count as zeros), its SmoothAP counter drops the 1/tau of G' (with tau = 0.01, a threshold 100x
lower here), its triplet t2i counter sums over the wrong axis without max violation, its counters
treat every off-diagonal entry as a negative (pairs sharing an image are excluded here, as in the
losses), and its NT-Xent counter defaults to eps = 0.05 where the paper uses 0.01. The code averages
triplet and SmoothAP counts over queries with a non-zero count and NT-Xent over all queries: both
means are reported for every loss.

:func:`cocos_over_split` runs a counter over training-like batches of a whole split and reports
the mean and standard deviation over batches, as section 5 of the paper does
(:func:`summarize_batches`). The two means over batches differ where a direction often has no
contributing query in a batch: SmoothAP's caption queries, each with a single positive.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from icr.analysis import ANALYSES
from icr.config import ExperimentConfig
from icr.context import Embeddings, TaskContext
from icr.data.sampler import build_batch_sampler
from icr.errors import ConfigError
from icr.losses.contrastive import config_options, negative_mask
from icr.losses.smoothap import image_caption_matrix, positive_slots, smooth_step
from icr.registry import Registry
from icr.train.retrieval_data import RetrievalInputs

logger = logging.getLogger(__name__)

COCOS_EPS = 0.01  # the paper's threshold for NT-Xent and SmoothAP
COCOS_KEYS = ("contributing", "contributing_nonempty", "contributing_all", "batch_total",
              "zero_queries")
NTXENT_KEYS = ("negative_weight", "positive_weight")

# A counter registers the batches its loss trains on (``sampler=``: ``pairs`` or ``images``).
COCOS_COUNTERS: Registry[Callable[..., dict[str, float]]] = Registry(
    "COCOS counter", package="icr.analysis", requires=("sampler",))


def summarize_counts(per_query: Tensor, prefix: str) -> dict[str, float]:
    """The four COCOS numbers of one direction from its per-query counts C^q.

    Shapes:
        per_query: ``(Q,)`` counts (integers, or means over positives for SmoothAP).
    """
    per_query = per_query.double()
    contributing = per_query > 0  # (Q,)
    active_mean = float(per_query[contributing].mean()) if contributing.any() else math.nan
    return {
        f"{prefix}contributing": 0.0 if math.isnan(active_mean) else active_mean,
        f"{prefix}contributing_nonempty": active_mean,
        f"{prefix}contributing_all": float(per_query.mean()),
        f"{prefix}batch_total": float(per_query.sum()),
        f"{prefix}zero_queries": float((~contributing).sum()),
    }


# ---------------------------------------------------------------- triplet


def triplet_active_counts(
    sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2, hardest: bool = True
) -> tuple[Tensor, Tensor]:
    """Per query, the negatives whose hinge is active (Eq. 9d); with ``hardest`` the hardest only.

    Returns:
        ``(i2t, t2i)``: counts for the image query of each row and the caption query of each
        column. With ``hardest`` a count is 1 when the hardest negative violates the margin
        (Eq. 10), which happens exactly when any negative does.

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns two ``(B,)`` int64 tensors.
    """
    negatives = negative_mask(sims, image_ids)  # (B, B)
    positives = sims.diagonal()  # (B,)
    active_i2t = negatives & (margin + sims - positives[:, None] > 0)  # (B, B) row queries
    active_t2i = negatives & (margin + sims - positives[None, :] > 0)  # (B, B) column queries
    if hardest:
        return active_i2t.any(1).long(), active_t2i.any(0).long()
    return active_i2t.sum(1), active_t2i.sum(0)


@COCOS_COUNTERS.register("triplet", sampler="pairs")
def triplet_sh_cocos(
    sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2
) -> dict[str, float]:
    """COCOS of the Triplet loss SH (max violation) on one batch: Eq. 10 and Table 2."""
    i2t, t2i = triplet_active_counts(sims, image_ids, margin=margin, hardest=True)
    return summarize_counts(i2t, "i2t_") | summarize_counts(t2i, "t2i_")


@COCOS_COUNTERS.register("triplet_all", sampler="pairs")
def triplet_all_cocos(
    sims: Tensor, image_ids: Tensor | None = None, *, margin: float = 0.2
) -> dict[str, float]:
    """COCOS of the Triplet loss over all negatives on one batch: C^q, C^B, C^0 (Table 2)."""
    i2t, t2i = triplet_active_counts(sims, image_ids, margin=margin, hardest=False)
    return summarize_counts(i2t, "i2t_") | summarize_counts(t2i, "t2i_")


# ---------------------------------------------------------------- NT-Xent


def ntxent_weights(
    sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax weights of Eq. 11 for the image queries (rows); transpose ``sims`` for captions.

    Returns:
        ``(weights, negatives, positive_weight)``: ``exp(s_j / tau) / Z(q)`` over the row's
        positive and negatives (entries of pairs sharing the image are excluded from Z, as in
        the loss), the negative mask, and ``p_pos`` of each row.

    Shapes:
        sims: ``(B, B)``; returns ``(B, B)``, ``(B, B)`` bool, ``(B,)``.
    """
    negatives = negative_mask(sims, image_ids)  # (B, B)
    keep = negatives | torch.eye(sims.shape[0], dtype=torch.bool, device=sims.device)
    weights = torch.softmax((sims / tau).masked_fill(~keep, -math.inf), dim=1)  # (B, B)
    return weights, negatives, weights.diagonal()


@COCOS_COUNTERS.register("infonce", sampler="pairs")
def ntxent_cocos(
    sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.1, eps: float = COCOS_EPS
) -> dict[str, float]:
    """COCOS of NT-Xent on one batch: C^{qv-}, W^{qv-}, W^{qv+} per direction (Table 3)."""
    out: dict[str, float] = {}
    # the negative mask is symmetric: the transposed matrix has the caption queries as rows
    for prefix, matrix in (("i2t_", sims), ("t2i_", sims.t())):
        weights, negatives, p_pos = ntxent_weights(matrix, image_ids, tau=tau)
        above = negatives & (weights > eps)  # (B, B)
        out |= summarize_counts(above.sum(1), prefix)
        out[f"{prefix}negative_weight"] = float((weights * above).sum(1).double().mean())
        out[f"{prefix}positive_weight"] = float((1 - p_pos).double().mean())
    return out


# ---------------------------------------------------------------- SmoothAP


def smoothap_weight(step: Tensor, rank: Tensor, tau: float) -> Tensor:
    """``G'(D_ij) / R(i)^2`` from ``G(D_ij)`` and the smoothed rank R(i) (Eqs. 12-13).

    Shapes:
        step: ``(..., N)``; rank: ``(...)``; returns ``(..., N)``.
    """
    return step * (1 - step) / tau / rank[..., None] ** 2


def smoothap_contributing_counts(
    sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.01, eps: float = COCOS_EPS
) -> tuple[Tensor, Tensor]:
    """C^q of Eq. 13 for the deduplicated image queries and for every caption query.

    Returns:
        ``(i2t, t2i)``: per distinct image (in increasing id order), the mean over its positives
        i of the number of other candidates j with ``G'(D_ij) / R(i)^2 > eps``; per caption, the
        number of other images with that property (its one positive).

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns ``(I,)`` and ``(B,)`` float64.
    """
    matrix, caption_image = image_caption_matrix(sims, image_ids)  # (I, C), (C,)
    num_images, num_captions = matrix.shape
    columns, valid = positive_slots(caption_image, num_images)  # (I, P)
    step = smooth_step(matrix[:, None, :] - matrix.gather(1, columns)[:, :, None], tau)  # (I, P, C)
    others = torch.arange(num_captions, device=sims.device)[None, None, :] != columns[:, :, None]
    rank = 1 + (step * others).sum(2)  # (I, P) R(i)
    above = (smoothap_weight(step, rank, tau) > eps) & others & valid[:, :, None]  # (I, P, C)
    i2t = above.sum((1, 2)).double() / valid.sum(1)  # (I,)

    scores = matrix.t()  # (C, I)
    step_t = smooth_step(scores - scores.gather(1, caption_image[:, None]), tau)  # (C, I)
    others_t = torch.arange(num_images, device=sims.device)[None, :] != caption_image[:, None]
    rank_t = 1 + (step_t * others_t).sum(1)  # (C,)
    t2i = ((smoothap_weight(step_t, rank_t, tau) > eps) & others_t).sum(1).double()  # (C,)
    return i2t, t2i


@COCOS_COUNTERS.register("smoothap", sampler="images")
def smoothap_cocos(
    sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.01, eps: float = COCOS_EPS
) -> dict[str, float]:
    """COCOS of SmoothAP on one batch: C^q and C^0 per direction (Eq. 13, Table 4)."""
    i2t, t2i = smoothap_contributing_counts(sims, image_ids, tau=tau, eps=eps)
    return summarize_counts(i2t, "i2t_") | summarize_counts(t2i, "t2i_")


# ---------------------------------------------------------------- over a split


def build_counter(name: str, **options: Any) -> Callable[..., dict[str, float]]:
    """The COCOS counter of loss ``name`` with its options bound.

    Raises:
        ConfigError: unknown loss name or an option its counter does not take.
    """
    return COCOS_COUNTERS.bind(name, **options)


def cocos_over_split(
    img_emb: Tensor,
    cap_emb: Tensor,
    caption_image: Tensor,
    loss_name: str,
    batch_size: int = 128,
    seed: int = 0,
    *,
    sampler: str | None = None,
    **loss_options: Any,
) -> dict[str, float]:
    """COCOS of a trained model over one split, batch by batch as in training (section 5).

    The split's captions are drawn into batches like training batches (each caption with its
    image) for one epoch, the counter of ``loss_name`` runs on each batch's similarity matrix, and
    every number is summarised over batches by :func:`summarize_batches`.

    Args:
        img_emb: the embeddings the model scores with (L2-normalised), one per image.
        cap_emb: likewise, one per caption.
        caption_image: index of each caption's image.
        loss_name: a key of :data:`COCOS_COUNTERS` (``triplet``, ``triplet_all``, ``infonce``,
            ``smoothap``).
        batch_size: pairs per batch (``pairs``) or images per batch (``images``); 128 in the paper.
        seed: seed of the batch order.
        sampler: ``pairs`` or ``images``; ``None`` takes the batches the counter registered as
            its loss's training batches (``images`` for ``smoothap``, the paper's 128 images x 5
            captions; ``pairs`` for the others).
        **loss_options: the loss's options (``margin``, ``tau``) and ``eps``; see
            :func:`build_counter`.

    Returns:
        :func:`summarize_batches` of the batches: ``cocos_{d}_{key}_mean`` and
        ``cocos_{d}_{key}_std`` for d in (i2t, t2i) and each key of :data:`COCOS_KEYS` (plus
        :data:`NTXENT_KEYS` for ``infonce``), and ``cocos_batches``.

    Shapes:
        img_emb: ``(N_img, D)``; cap_emb: ``(N_cap, D)``; caption_image: ``(N_cap,)`` int.
    """
    counter = build_counter(loss_name, **loss_options)
    sampler = sampler or COCOS_COUNTERS.meta(loss_name)["sampler"]
    batches = build_batch_sampler(sampler, caption_image, batch_size, seed=seed)
    caption_image = caption_image.to(device=img_emb.device, dtype=torch.long)
    rows: list[dict[str, float]] = []
    with torch.no_grad():
        for batch in batches:
            caps = torch.as_tensor(batch, device=img_emb.device)  # (B,)
            images = caption_image[caps]  # (B,)
            sims = img_emb[images] @ cap_emb[caps].t()  # (B, B), positives on the diagonal
            rows.append(counter(sims, images))
    logger.info("COCOS (%s) over %d batches of %d %s", loss_name, len(rows), batch_size, sampler)
    return summarize_batches(rows)


def summarize_batches(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean and (population) standard deviation over batches of each counter number.

    A NaN is left out of its key's mean and std (only ``{d}_contributing_nonempty`` has NaNs:
    batches without a contributing query), so ``cocos_{d}_contributing_mean`` averages those
    batches as 0, as the paper's notebooks do (``np.mean`` / ``np.std`` over every batch), and
    ``cocos_{d}_contributing_nonempty_mean`` over the other batches only (NaN if none is left).

    Args:
        rows: one counter result per batch (:data:`COCOS_COUNTERS`), all with the same keys.

    Returns:
        ``cocos_{key}_mean`` and ``cocos_{key}_std`` for each key of the rows, and
        ``cocos_batches``.
    """
    out: dict[str, float] = {"cocos_batches": float(len(rows))}
    for key in rows[0] if rows else ():
        values = np.array([row[key] for row in rows], dtype=np.float64)
        finite = values[~np.isnan(values)]
        out[f"cocos_{key}_mean"] = float(finite.mean()) if len(finite) else math.nan
        out[f"cocos_{key}_std"] = float(finite.std()) if len(finite) else math.nan
    return out


# --------------------------------------------------------------------------- the analysis


def _has_counter(config: ExperimentConfig) -> None:
    """The run's loss has a COCOS counter (checked when the study is planned)."""
    name = config.loss.name
    if name not in COCOS_COUNTERS:
        raise ConfigError(f"eval.analyses=cocos needs a COCOS counter of the run's loss, and "
                          f"loss.name={name} has none; use one of "
                          f"{', '.join(COCOS_COUNTERS.names())}, or drop cocos")


@ANALYSES.register("cocos", task="retrieval", needs=(Embeddings, RetrievalInputs),
                   check=_has_counter)
def cocos_analysis(*, context: TaskContext) -> Callable[[Path], dict[str, float]]:
    """COCOS of the best checkpoint over the training split (``eval.analyses=cocos``), with the
    counter of the run's own loss and its options: ``cocos/{i2t,t2i}_{key}_{mean,std}``."""
    config = context.config
    _has_counter(config)
    name, options = config.loss.name, config_options(config.loss)
    embeddings = context.get(Embeddings)
    caption_image = torch.as_tensor(context.get(RetrievalInputs).data.splits["train"].caption_image)

    def run(out: Path) -> dict[str, float]:
        img, cap = embeddings.embed("train")  # (N_img, D), (N_cap, D), L2-normalised
        # Batches as the run trained on (the paper: its training batches of 128).
        t = config.train
        result = cocos_over_split(img, cap, caption_image, name, batch_size=t.batch_size,
                                  seed=t.seed, sampler=t.sampler, **options)
        return {f"cocos/{k.removeprefix('cocos_')}": v for k, v in result.items()}

    return run
