"""Ensembles of retrieval models: average their similarity matrices, then rank.

Each member is one trained model's embeddings of the same evaluation split (same images and
captions, same order); members may embed in spaces of different sizes, since only their
similarities are combined. This is how VSE-infinity and VSE+2AD report ensembles (e.g. "RG",
region + grid models): the mean of the members' image-caption similarity matrices, scored as
one model's (:func:`icr.train.evaluation.split_metrics`: on COCO, the 5K and the 5-fold 1K).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["average_similarity"]


def average_similarity(members: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """Mean over members of ``image_embeddings @ caption_embeddings.T``.

    Args:
        members: per model, ``(image_embeddings, caption_embeddings)`` of the same split (usually
            L2-normalised, so the similarities are cosines on a common scale).

    Shapes:
        member m: ``(N_img, D_m)`` and ``(N_cap, D_m)``, D_m may differ across members;
        returns ``(N_img, N_cap)`` on the first member's device.

    References:
        VSE+2AD paper, Section 4 (ensembles of region, grid and patch models, "RG" / "RGP" rows);
        Chen et al. 2021 (VSE-infinity), the same averaging of similarities.

    Raises:
        ValueError: no member, or members of different splits or mismatched sizes.
    """
    if not members:
        raise ValueError("an ensemble needs at least one member")
    first_img, first_cap = members[0]
    shape = (first_img.shape[0], first_cap.shape[0])
    total = None
    for index, (img, cap) in enumerate(members):
        if img.shape[1] != cap.shape[1]:
            raise ValueError(
                f"member {index}: image embeddings are {img.shape[1]}-d, captions {cap.shape[1]}-d"
            )
        if (img.shape[0], cap.shape[0]) != shape:
            raise ValueError(
                f"member {index} embeds {img.shape[0]} images and {cap.shape[0]} captions, "
                f"member 0 {shape[0]} and {shape[1]}: members must share the split"
            )
        sims = img.to(first_img.device) @ cap.to(first_img.device).T  # (N_img, N_cap)
        total = sims if total is None else total.add_(sims)  # in place: one matrix in memory
    return total / len(members)

