"""Retrieval evaluation: functions of an encoder and the prepared data.

``embed_split`` encodes a split's images and captions in evaluation order, batch by batch, from
the inputs the task placed on its device (:class:`~icr.data.images.ImageStore` and the clean
caption ids of :meth:`~icr.data.captions.CaptionTable.clean`); ``split_metrics`` scores them
with every retrieval metric the split's assets allow (R@k, rsum, ranks, R-precision, mAP@5, nDCG
from the relevance matrix, CxC from the extended positives). The test split is scored under
every protocol its dataset is reported with (:attr:`~icr.data.datasets.DatasetSource.protocols`):
on COCO the full 5K and the mean over five 1K folds (``1k_*`` keys,
:mod:`icr.metrics.protocols`).
"""

from __future__ import annotations

import torch

from icr.data.images import ImageStore, PixelNorm, encoder_input
from icr.data.pipeline import PreparedData
from icr.metrics.protocols import FOLD_PREFIX, Similarities, evaluate_protocols
from icr.models.dual_encoder import DualEncoder


@torch.no_grad()
def embed_split(
    encoder: DualEncoder, images: ImageStore, tokens: torch.Tensor, lengths: torch.Tensor, *,
    normalize: PixelNorm, batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image (N_img, D) and caption (N_cap, D) embeddings of a split, in evaluation order.

    Shapes: tokens ``(N_cap, T)`` on the encoder's device, lengths ``(N_cap,)`` on the CPU.
    """
    was_training = encoder.training
    encoder.eval()
    img = torch.cat([
        encoder.encode_images(encoder_input(images.rows(i, i + batch_size), normalize))
        for i in range(0, len(images), batch_size)
    ])  # (N_img, D)
    caps = []
    for i in range(0, len(tokens), batch_size):
        n = lengths[i : i + batch_size]  # (b,)
        caps.append(encoder.encode_captions(tokens[i : i + batch_size, : int(n.max())], n))
    encoder.train(was_training)
    return img.float(), torch.cat(caps).float()  # (N_img, D), (N_cap, D)


def split_metrics(sims: Similarities, data: PreparedData, split: str) -> dict[str, float]:
    """Every retrieval metric of ``split`` from its similarities, or its ``(images, captions)``
    embeddings: validation on the full split, test under each of the dataset's protocols (COCO:
    the 5K keys and the ``1k_`` keys of the 5-fold mean, plus ``1k_fold_images``, the images a
    fold held: 1,000 on COCO, fewer on a scaled-down fixture).

    Shapes: sims ``(N_img, N_cap)`` or ``((N_img, D), (N_cap, D))``.
    """
    assets = data.eval_assets[split]
    device = sims[0].device if isinstance(sims, tuple) else sims.device
    caption_image = torch.as_tensor(data.splits[split].caption_image, device=device)
    source = data.source
    protocols = source.protocols if split == "test" else ("full",)
    metrics = evaluate_protocols(
        sims, caption_image, protocols, fold_size=source.fold_size, relevance=assets.relevance,
        extended_i2t=assets.extended_i2t, extended_t2i=assets.extended_t2i,
    )
    if "coco_5fold_1k" in protocols:
        metrics[f"{FOLD_PREFIX}fold_images"] = float(source.fold_size)
    return metrics
