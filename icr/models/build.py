"""Builders: turn config sections into the keyword arguments of the model components.

The components themselves (:mod:`icr.models.image`, :mod:`icr.models.text`,
:mod:`icr.models.heads`, :mod:`icr.models.decoders`) take plain arguments; only this module reads
the config.
"""

from __future__ import annotations

import torch
from torch import nn

from icr.config import ExperimentConfig
from icr.errors import ConfigError
from icr.models.decoders import InputTargetDecoder, LatentTargetDecoder
from icr.models.dual_encoder import DualEncoder
from icr.models.heads import ProjectionHead
from icr.models.image import build_image_encoder
from icr.models.text import GRUCaptionEncoder


def image_options(config: ExperimentConfig, region_dim: int | None) -> dict[str, object]:
    """Keyword arguments of the image encoder named by ``image.encoder``."""
    image, pixels = config.image, config.data.features == "pixels"
    if (image.encoder == "regions") == pixels:
        raise ConfigError(
            f"image.encoder={image.encoder} does not read data.features={config.data.features}; "
            "use image.encoder=regions with data.features=regions, a CNN with pixels"
        )
    options: dict[str, object] = {"pretrained": image.pretrained}
    if image.weights_path:
        options["weights_path"] = image.weights_path
    if image.encoder == "regions":
        options.update(in_dim=region_dim, hidden_dim=image.hidden_dim, output_dim=image.output_dim)
    elif image.encoder == "small_cnn":
        options["output_dim"] = image.output_dim
    return options


def build_dual_encoder(
    config: ExperimentConfig,
    vocab_size: int,
    word_vectors: torch.Tensor | None,
    region_dim: int | None = None,
) -> DualEncoder:
    """The image-caption dual encoder of the LTD paper (Section 4.2), sized by ``config``.

    ``region_dim`` is the size of a region vector when the images are precomputed regions.

    BatchNorm follows the projection heads only with a triplet loss, as in the reference code.
    """
    image_encoder = build_image_encoder(config.image.encoder, **image_options(config, region_dim))
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
