"""Contrastive losses (by name in :data:`LOSSES`) and the decoders' reconstruction losses.

Importing this package registers every contrastive loss.
"""

from icr.losses.contrastive import (
    LOSSES,
    ContrastiveLoss,
    build_loss,
    config_options,
    loss_from_config,
    negative_mask,
    warmup_from_config,
)
from icr.losses.infonce import infonce_loss
from icr.losses.reconstruction import cosine_reconstruction_loss, token_nll_loss
from icr.losses.triplet import triplet_all_loss, triplet_loss

__all__ = [
    "LOSSES",
    "ContrastiveLoss",
    "build_loss",
    "config_options",
    "cosine_reconstruction_loss",
    "infonce_loss",
    "loss_from_config",
    "negative_mask",
    "token_nll_loss",
    "triplet_all_loss",
    "triplet_loss",
    "warmup_from_config",
]
