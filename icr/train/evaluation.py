"""Retrieval evaluation: functions of an encoder and the prepared data.

``embed_split`` encodes a split's images and captions in evaluation order; ``evaluate_split``
scores them with every retrieval metric the split's assets allow (R@k, rsum, ranks, R-precision,
mAP@5, nDCG from the relevance matrix, CxC from the extended positives).
"""

from __future__ import annotations

import torch

from icr.data.pipeline import PreparedData, encode_split_captions, image_input, pad_sequences
from icr.metrics import retrieval_metrics
from icr.models.dual_encoder import DualEncoder


@torch.no_grad()
def embed_split(
    encoder: DualEncoder, data: PreparedData, split: str, *, batch_size: int, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Image (N_img, D) and caption (N_cap, D) embeddings of ``split``, in evaluation order."""
    was_training = encoder.training
    encoder.eval()
    images = data.images[split]
    img = torch.cat([
        encoder.encode_images(image_input(images, i, i + batch_size, data.pixels).to(device))
        for i in range(0, len(images), batch_size)
    ])  # (N_img, D)
    ids = encode_split_captions(data.splits[split], data.captions)
    caps = []
    for i in range(0, len(ids), batch_size):
        tokens, lengths = pad_sequences(ids[i : i + batch_size])
        caps.append(encoder.encode_captions(tokens.to(device), lengths))
    encoder.train(was_training)
    return img.float(), torch.cat(caps).float()  # (N_img, D), (N_cap, D)


def evaluate_split(
    img: torch.Tensor, cap: torch.Tensor, data: PreparedData, split: str
) -> dict[str, float]:
    """Every retrieval metric of ``split`` from its embeddings (see :func:`retrieval_metrics`)."""
    assets = data.eval_assets[split]
    caption_image = torch.as_tensor(data.splits[split].caption_image, device=img.device)
    return retrieval_metrics(
        img @ cap.t(), caption_image, relevance=assets.relevance,
        extended_i2t=assets.extended_i2t, extended_t2i=assets.extended_t2i,
    )
