"""The dual encoder: an image tower and a caption tower into one L2-normalised space."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DualEncoder"]


class DualEncoder(nn.Module):
    """Image encoder + head and caption encoder + head, each output L2-normalised.

    The image encoder must provide ``set_backbone_trainable(flag)`` and the caption encoder
    ``set_embeddings_trainable(flag)`` (see :mod:`icr.models.image` and :mod:`icr.models.text`).

    Args:
        image_encoder: images (B, 3, H, W) -> (B, D_img).
        caption_encoder: tokens (B, T), lengths (B,) -> (B, D_txt).
        image_head: (B, D_img) -> (B, D).
        caption_head: (B, D_txt) -> (B, D).

    Shapes:
        encode_images: (B, 3, H, W) -> (B, D), unit norm.
        encode_captions: (B, T), (B,) -> (B, D), unit norm.
    """

    def __init__(
        self,
        image_encoder: nn.Module,
        caption_encoder: nn.Module,
        image_head: nn.Module,
        caption_head: nn.Module,
    ) -> None:
        super().__init__()
        img_dim = getattr(image_head, "output_dim", None)
        cap_dim = getattr(caption_head, "output_dim", None)
        if img_dim is not None and cap_dim is not None and img_dim != cap_dim:
            raise ValueError(f"image head gives {img_dim}-d embeddings, caption head {cap_dim}-d")
        self.image_encoder = image_encoder
        self.caption_encoder = caption_encoder
        self.image_head = image_head
        self.caption_head = caption_head
        self.embed_dim = img_dim if img_dim is not None else cap_dim

    def encode_images(self, images: Tensor) -> Tensor:
        feats = self.image_encoder(images)  # (B, D_img)
        return F.normalize(self.image_head(feats), dim=-1)  # (B, D)

    def encode_captions(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        feats = self.caption_encoder(tokens, lengths)  # (B, D_txt)
        return F.normalize(self.caption_head(feats), dim=-1)  # (B, D)

    def forward(self, images: Tensor, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        """Return ``(image_embeddings, caption_embeddings)``, both (B, D) and unit norm."""
        return self.encode_images(images), self.encode_captions(tokens, lengths)

    def set_backbone_trainable(self, flag: bool) -> None:
        """Freeze or unfreeze the image backbone and the word embeddings together.

        ``False`` is the warm-up phase of the LTD recipe (docs/reference-code.md section 1: 30 epochs with
        the ResNet and word embeddings frozen, then fine-tuning). The GRU and both heads stay
        trainable. Frozen BatchNorm layers of the backbone stay in eval mode (see
        :class:`~icr.models.image.ImageEncoder`).
        """
        self.image_encoder.set_backbone_trainable(flag)
        self.caption_encoder.set_embeddings_trainable(flag)
