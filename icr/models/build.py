"""Builders: turn config sections into the keyword arguments of the model components.

The components themselves (:mod:`icr.models.image`, :mod:`icr.models.text`,
:mod:`icr.models.heads`, :mod:`icr.models.decoders`) take plain arguments; only this module reads
the config.
"""

from __future__ import annotations

import torch
from torch import nn

from icr.config import ExperimentConfig
from icr.models.decoders import InputTargetDecoder, LatentTargetDecoder
from icr.models.dual_encoder import DualEncoder
from icr.models.heads import ProjectionHead
from icr.models.image import build_image_encoder
from icr.models.text import GRUCaptionEncoder


def build_dual_encoder(
    config: ExperimentConfig, vocab_size: int, word_vectors: torch.Tensor | None
) -> DualEncoder:
    """The image-caption dual encoder of the LTD paper (Section 4.2), sized by ``config``.

    BatchNorm follows the projection heads only with a triplet loss, as in the reference code.
    """
    image_options: dict[str, object] = {"pretrained": config.image.pretrained}
    if config.image.weights_path:
        image_options["weights_path"] = config.image.weights_path
    image_encoder = build_image_encoder(config.image.encoder, **image_options)
    caption_encoder = GRUCaptionEncoder(
        vocab_size,
        embed_dim=config.text.word_dim,
        hidden_dim=config.text.hidden_dim,
        pretrained_embeddings=word_vectors,
    )
    batchnorm = config.loss.name.startswith("triplet")
    hidden = config.model.head_hidden or None

    def head(in_dim: int) -> ProjectionHead:
        return ProjectionHead(in_dim, config.model.embed_dim, hidden_dim=hidden, batchnorm=batchnorm)

    return DualEncoder(
        image_encoder, caption_encoder, head(image_encoder.output_dim),
        head(caption_encoder.output_dim),
    )


def build_decoder(
    config: ExperimentConfig, vocab_size: int, target_dim: int | None
) -> nn.Module | None:
    """The reconstruction decoder: LTD (Eq. 5), ITD (Eq. 4) or none."""
    name, embed_dim = config.decoder.name, config.model.embed_dim
    if name == "ltd":
        if target_dim is None:
            raise ValueError("the LTD decoder needs the latent targets' dimension")
        return LatentTargetDecoder(embed_dim, config.decoder.hidden_dim, target_dim)
    if name == "itd":
        return InputTargetDecoder(
            vocab_size, embed_dim=config.decoder.word_dim, hidden_dim=config.decoder.hidden_dim,
            in_dim=embed_dim,
        )
    return None
