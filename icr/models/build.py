"""The retrieval model from a config: every component chosen by name through its registry.

The components themselves (image and caption encoders, poolings, heads, decoders) take plain
keyword arguments; their registries' builders take the config fields they use plus the context the
data gives (``in_dim`` of a region, ``vocab_size``, the word vectors, the latent targets' size).
This module only connects them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from icr.config import ExperimentConfig
from icr.errors import ConfigError
from icr.models.decoders import DECODERS
from icr.models.dual_encoder import DualEncoder
from icr.models.heads import ProjectionHead
from icr.models.image import IMAGE_ENCODERS
from icr.models.text import TEXT_ENCODERS


def build_dual_encoder(
    config: ExperimentConfig,
    vocab_size: int,
    word_vectors: torch.Tensor | None,
    region_dim: int | None = None,
) -> DualEncoder:
    """The image-caption dual encoder (LTD paper Section 4.2 and the other papers' variants).

    ``region_dim`` is the size of a region vector when the images are precomputed regions.
    ``model.head_batchnorm`` puts BatchNorm after the projection heads (the PCME / LTD reference
    does so with the triplet loss; VSRN always). An image and a caption encoder registered with
    the same ``tie`` function (TERN's ``tie_shared_layers``) are tied by it after both are built.
    """
    check_inputs(config)
    reads_regions = region_dim is not None
    if reads_regions != (config.data.features == "regions"):  # pragma: no cover - a pipeline bug
        raise ValueError("region_dim must be given exactly when data.features=regions")
    image_name, text_name = config.image.encoder, config.text.encoder
    image_encoder = IMAGE_ENCODERS.build(
        image_name, config.image, **({"in_dim": region_dim} if reads_regions else {}),
        **declared_keys(IMAGE_ENCODERS, image_name, config),
    )
    caption_encoder = TEXT_ENCODERS.build(
        text_name, config.text, vocab_size=vocab_size, word_vectors=word_vectors,
        **declared_keys(TEXT_ENCODERS, text_name, config),
    )
    tie = IMAGE_ENCODERS.meta(image_name).get("tie")
    if tie is not None and tie is TEXT_ENCODERS.meta(text_name).get("tie"):
        tie(image_encoder, caption_encoder)  # e.g. TERN: one set of shared layers for both
    hidden = config.model.head_hidden or None

    def head(in_dim: int) -> ProjectionHead:
        return ProjectionHead(in_dim, config.model.embed_dim, hidden_dim=hidden,
                              batchnorm=config.model.head_batchnorm)

    return DualEncoder(
        image_encoder, caption_encoder, head(image_encoder.output_dim),
        head(caption_encoder.output_dim),
    )


def declared_keys(registry: Any, name: str, config: ExperimentConfig) -> dict[str, Any]:
    """The keys of *other* config sections that component ``name`` is registered to read
    (``reads=("model.shared_dim", ...)``) and its builder takes, as keyword arguments named after
    their field: TERN's encoders read the ``model.*`` sizes of the layers both towers share."""
    params = inspect.signature(registry.get(name)).parameters
    out = {}
    for key in registry.reads(name):
        section, _, field = key.partition(".")
        if section != registry.section and field in params:
            out[field] = getattr(getattr(config, section), field)
    return out


def check_inputs(config: ExperimentConfig) -> None:
    """The image encoder must read what ``data.features`` provides (pixels or regions)."""
    reads = IMAGE_ENCODERS.meta(config.image.encoder).get("input", "pixels")
    if reads != config.data.features:
        fitting = [n for n in IMAGE_ENCODERS.names()
                   if IMAGE_ENCODERS.meta(n).get("input", "pixels") == config.data.features]
        raise ConfigError(
            f"image.encoder={config.image.encoder} reads {reads}, not data.features="
            f"{config.data.features}; use data.features={reads}, or one of {', '.join(fitting)}"
        )


def caption_input_kind(config: ExperimentConfig) -> str:
    """``vocab`` or ``wordpiece``: what the caption encoder ``text.encoder`` reads."""
    return TEXT_ENCODERS.meta(config.text.encoder).get("input", "vocab")


def build_decoder(
    config: ExperimentConfig, vocab_size: int, target_dim: int | None
) -> nn.Module | None:
    """The reconstruction decoder named by ``decoder.name`` (``none`` gives ``None``)."""
    return DECODERS.build(config.decoder.name, config.decoder, embed_dim=config.model.embed_dim,
                          vocab_size=vocab_size, target_dim=target_dim)
