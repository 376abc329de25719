"""SmoothAP: one minus a smooth approximation of average precision, both retrieval directions.

A batch in the project's pair convention (:mod:`icr.losses.contrastive`) holds ``B`` image-caption
pairs; with image-level batches (:mod:`icr.data.sampler`) every image appears once per caption, so
its row of ``sims`` is repeated. SmoothAP is defined over distinct queries and candidates, so the
pairs are first folded by image (the rows of an image averaged; :func:`image_caption_matrix`
folds them into distinct rows, the loss keeps one folded row per pair and weights each image's
rows so that it counts once, which keeps every shape at ``B`` and the GPU from waiting):

- image queries: one per distinct image id; its positives are all the batch's captions of that
  image, its candidates all ``B`` captions;
- caption queries: every caption; its candidates are the distinct images, its one positive its image.

For a query with positive set P, candidate scores s and a positive i,
``D_ij = s_j - s_i`` (candidate j scores above positive i when ``D_ij > 0``),
``R(i) = 1 + sum_{j != i} G(D_ij)``, ``R_pos(i) = 1 + sum_{j in P, j != i} G(D_ij)``,
``AP = mean_{i in P} R_pos(i) / R(i)`` with ``G(x) = sigmoid(x / tau)``, its exponent clamped to
[-50, 50] as in the reference code. The loss is ``0.5 * (mean_q (1 - AP_q) over image queries +
the same over caption queries)``.

The metric-learning paper writes ``D_ij = s_i - s_j`` next to the indicator ``1{D_ij > 0}``
(section 2, after Eq. 6), which would count the candidates ranked *below* i; its Eq. 6, the
Smooth-AP paper (Brown et al. 2020, Eq. 8) and the ECIR reference code all count those ranked
above, which is what is implemented here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from icr.losses.contrastive import LOSSES

EXPONENT_CLAMP = 50.0  # |x / tau| beyond this gives a sigmoid of exactly 0 or 1 (reference code)


def smooth_step(x: Tensor, tau: float) -> Tensor:
    """``G(x; tau) = 1 / (1 + exp(-x / tau))`` with ``x / tau`` clamped to [-50, 50] (Eq. 7)."""
    return torch.sigmoid((x / tau).clamp(-EXPONENT_CLAMP, EXPONENT_CLAMP))


def image_caption_matrix(sims: Tensor, image_ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """Fold a pair batch into distinct images by captions.

    Rows of pairs that share an image id are averaged: they are the same image (identical rows when
    the image is encoded once per pair), and averaging, unlike keeping the first copy, passes a
    gradient to every copy, which matters when the copies differ (e.g. augmented views).

    Args:
        sims: pair similarities, ``sims[i, j]`` = image of pair i vs caption of pair j.
        image_ids: dataset image id of each pair; ``None`` means all images differ.

    Returns:
        ``(matrix, caption_image)``: ``matrix[k, j]`` scores distinct image k against caption j
        (images in increasing id order); ``caption_image[j]`` is the row of caption j's image.

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; matrix: ``(I, B)``; caption_image: ``(B,)`` int64.
    """
    if sims.dim() != 2 or sims.shape[0] != sims.shape[1]:
        raise ValueError(f"sims must be a square (B, B) matrix, got {tuple(sims.shape)}")
    batch = sims.shape[0]
    if image_ids is None:
        return sims, torch.arange(batch, device=sims.device)
    if image_ids.shape != (batch,):
        raise ValueError(f"image_ids must have shape ({batch},), got {tuple(image_ids.shape)}")
    _, caption_image = torch.unique(image_ids.to(sims.device), return_inverse=True)  # (B,)
    num_images = int(caption_image.max()) + 1
    counts = torch.bincount(caption_image, minlength=num_images).to(sims.dtype)  # (I,)
    matrix = sims.new_zeros(num_images, batch).index_add(0, caption_image, sims)  # (I, B)
    return matrix / counts[:, None], caption_image


def positive_slots(caption_image: Tensor, num_images: int) -> tuple[Tensor, Tensor]:
    """Caption columns of each image, padded to the largest group.

    Returns:
        ``(columns, valid)``: ``columns[k, p]`` is the p-th caption of image k (0 where padded),
        ``valid[k, p]`` whether that slot holds a caption.

    Shapes:
        caption_image: ``(C,)`` int64; columns, valid: ``(I, P)``.
    """
    counts = torch.bincount(caption_image, minlength=num_images)  # (I,)
    order = torch.sort(caption_image, stable=True).indices  # (C,) captions grouped by image
    starts = torch.cumsum(counts, 0) - counts  # (I,)
    slot = torch.arange(len(order), device=order.device) - starts[caption_image[order]]  # (C,)
    width = int(counts.max())
    columns = torch.zeros(num_images, width, dtype=torch.long, device=order.device)
    valid = torch.zeros(num_images, width, dtype=torch.bool, device=order.device)
    columns[caption_image[order], slot] = order
    valid[caption_image[order], slot] = True
    return columns, valid


@LOSSES.register("smoothap")
def smoothap_loss(sims: Tensor, image_ids: Tensor | None = None, *, tau: float = 0.01) -> Tensor:
    """SmoothAP loss ``0.5 * (mean (1 - AP) over image queries + over caption queries)``.

    Image queries are deduplicated by ``image_ids`` (see the module docstring), so a batch of B
    images with all their captions (``icr.data.sampler``) gives each image query its k positive
    captions, as the paper's image-level batches do. With one caption per image (pair batches) it
    is the same loss with one positive per query.

    Args:
        sims: pair similarities, positives on the diagonal.
        image_ids: dataset image id of each pair, or ``None`` when all images differ.
        tau: sigmoid temperature (0.01 in the metric-learning study and in Smooth-AP).

    Shapes:
        sims: ``(B, B)``; image_ids: ``(B,)``; returns a scalar.

    References:
        Brown et al., "Smooth-AP", ECCV 2020, Eq. 8; Eqs. 5-8 of Bleeker & de Rijke, "Do Lessons
        from Metric Learning Generalize to Image-Caption Retrieval?" (ECIR 2022).
    """
    batch = sims.shape[0]
    if sims.dim() != 2 or sims.shape[1] != batch:
        raise ValueError(f"sims must be a square (B, B) matrix, got {tuple(sims.shape)}")
    if image_ids is None:
        image_ids = torch.arange(batch, device=sims.device)
    elif image_ids.shape != (batch,):
        raise ValueError(f"image_ids must have shape ({batch},), got {tuple(image_ids.shape)}")
    same = image_ids.to(sims.device)[:, None] == image_ids.to(sims.device)[None, :]  # (B, B)
    count = same.sum(1).to(sims.dtype)  # (B,) pairs of each pair's image
    matrix = (same.to(sims.dtype) @ sims) / count[:, None]  # (B, B): row i = i's image, folded
    weight = 1.0 / count  # (B,): each distinct image counts once over its rows
    i2t = 1 - pair_smoothap_i2t(matrix, same, tau)  # (B,) one per row, equal within an image
    t2i = 1 - pair_smoothap_t2i(matrix, same, weight, tau)  # (B,)
    return 0.5 * ((i2t * weight).sum() / weight.sum() + t2i.mean())


def pair_smoothap_i2t(matrix: Tensor, same: Tensor, tau: float) -> Tensor:
    """Smooth AP of each pair's image as a query over all captions (Eq. 8 of Brown et al.),
    in fixed shapes: the rows of one image are equal, and so are their APs.

    The fold into distinct images (:func:`image_caption_matrix`) has shapes that depend on the
    batch's content, which a GPU can only learn by waiting for it; here every shape is ``B``.

    Shapes:
        matrix: ``(B, C)`` folded rows; same: ``(B, C)`` bool, caption j is of row i's image;
        returns ``(B,)``.
    """
    step = smooth_step(matrix[:, None, :] - matrix[:, :, None], tau)  # (B, P=C, C): G(D_pj)
    own = torch.arange(matrix.shape[1], device=matrix.device)  # (C,)
    others = own[None, :] != own[:, None]  # (P, C): j != p
    rank_all = 1 + (step * others).sum(2)  # (B, P) R(p)
    rank_pos = 1 + (step * (others[None] & same[:, None, :])).sum(2)  # (B, P) R_pos(p)
    ratio = torch.where(same, rank_pos / rank_all, 0.0)  # (B, P): the positives p only
    return ratio.sum(1) / same.sum(1)  # (B,)


def pair_smoothap_t2i(matrix: Tensor, same: Tensor, weight: Tensor, tau: float) -> Tensor:
    """Smooth AP of every caption query over the distinct images (one positive: ``1 / R``),
    each image's rows weighted so that it counts once.

    Shapes:
        matrix: ``(B, C)``; same: ``(B, C)`` bool; weight: ``(B,)``; returns ``(C,)``.
    """
    positive = matrix.diagonal()[None, :]  # (1, C): caption j's own image is row j's
    step = smooth_step(matrix - positive, tau)  # (B, C)
    return 1.0 / (1 + (step * ~same * weight[:, None]).sum(0))  # (C,)
