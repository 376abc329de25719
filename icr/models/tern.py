"""TERN: transformer encoders over the regions and the caption, with shared top layers.

The Transformer Encoder Reasoning Network (Messina et al., "Transformer Reasoning Network for
Image-Text Matching and Retrieval", ICPR 2020; code: github.com/mesnico/TERN, ``models/tern.py``),
as the LTD paper uses it in Section 4.4 and Table 3 (Bleeker, Yates & de Rijke, TMLR 2023):

- image: each precomputed region (its box appended by the data pipeline when the dataset has
  boxes), standardised and through a two-layer MLP to ``region_dim``
  (:class:`~icr.models.tokens.RegionTokenEncoder`); a learned CLS vector prepended; a stack of
  ``region_layers`` (4) transformer encoder layers over the CLS and the regions; a linear map to
  ``shared_dim``;
- caption: a BERT-architecture encoder from a local folder (the bundled MiniLM by default; TERN
  uses the first 6 layers of BERT-base), its wordpieces projected to ``shared_dim``
  (:class:`~icr.models.tokens.BertTokenEncoder`);
- both streams then go through the same stack of ``shared_layers`` (2) transformer encoder layers:
  one set of weights, applied to each modality separately (no cross-attention), so an image's
  embedding never depends on a caption and vice versa;
- the output at the CLS position (the learned image CLS, the caption's ``[CLS]``) is the global
  representation of each (TERN's ``aggregation: first``, "I-CLS" / "T-CLS").

Every transformer layer is PyTorch's post-norm ``TransformerEncoderLayer`` with ReLU, as in the
reference (``nhead=4``, ``dim_feedforward=2048``, dropout 0.1). Padding is masked out of every
attention (``key_padding_mask``), so padded regions and padded wordpieces never change an
output.

Deliberate differences from the reference:

- the image CLS is a learned vector added after the input MLP; the reference reserves a zero
  feature with a zero box as slot 0 and passes it through the positional MLP (``data.py``,
  ``Collate``), i.e. a constant learned through the MLP's biases: the same role;
- the reference's box encoding ("concat-and-process") appends the box and its area to the
  feature and runs a two-layer MLP; here the same MLP reads the region vector as the data
  pipeline gives it (feature + box in [0, 1] when the dataset has boxes), without the area term
  (a product the MLP can form), after a BatchNorm that standardises each input dimension over
  the batch's real regions. The reference feeds raw BUTD features; on the embedded benchmark,
  whose region features are small (std 0.19) beside the boxes, unstandardised inputs leave every
  image's CLS output nearly the same at the start (mean pairwise cosine 0.97) and training
  barely moves;
- padded regions are masked (the reference builds a mask from lengths that are always 36);
- the dual encoder puts its projection head (``model.embed_dim``) after the CLS output, where
  the reference L2-normalises the shared layers' output directly (a head of one linear layer
  when ``model.head_hidden=0``).

When both ``image.encoder`` and ``text.encoder`` are ``tern`` the dual encoder ties the two
shared stacks into one (:func:`tie_shared_layers`); either side alone keeps its own stack.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from icr.errors import ConfigError
from icr.models.image import IMAGE_ENCODERS
from icr.models.text import TEXT_ENCODERS
from icr.models.tokens import BertTokenEncoder, RegionTokenEncoder

logger = logging.getLogger(__name__)

__all__ = [
    "TernCaptionEncoder",
    "TernImageEncoder",
    "TransformerStack",
    "tie_shared_layers",
]

# The model.* keys both TERN encoders read (the shared layers and every layer's sizes).
_MODEL_KEYS = ("model.shared_layers", "model.shared_dim", "model.transformer_heads",
               "model.transformer_ff_dim", "model.transformer_dropout")


class TransformerStack(nn.Module):
    """``num_layers`` post-norm transformer encoder layers with a padding mask.

    Args:
        dim: token size.
        num_layers: layers (0: the identity).
        heads: attention heads (must divide ``dim``).
        ff_dim: feed-forward size.
        dropout: dropout of the attention weights and of each sub-layer's output.

    Shapes:
        tokens ``(B, T, dim)``, mask ``(B, T)`` bool (True = real) -> ``(B, T, dim)``.
    """

    def __init__(self, dim: int, num_layers: int, heads: int = 4, ff_dim: int = 2048,
                 dropout: float = 0.1) -> None:
        super().__init__()
        if dim % heads:
            raise ConfigError(f"TERN: model.transformer_heads={heads} does not divide the layer "
                              f"width {dim}; choose heads that divide it")
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=ff_dim, dropout=dropout,
                                           activation="relu", batch_first=True)
        # no nested tensors: the padded positions are computed (and ignored) on every path, so
        # training and evaluation run the same kernels
        self.layers = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.dim, self.num_layers = dim, num_layers

    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        if self.num_layers == 0:
            return tokens
        return self.layers(tokens, src_key_padding_mask=~mask)  # (B, T, dim)


class TernImageEncoder(nn.Module):
    """Regions -> BatchNorm + MLP -> [CLS] + regions -> region layers -> linear -> shared -> CLS.

    Args:
        in_dim: size of a region vector (feature, + 4 with boxes).
        region_dim: width of the region layers (TERN: 2048, the BUTD feature size).
        region_layers: transformer layers over the regions (TERN: 4).
        shared_dim: width of the shared layers (TERN: 1024).
        shared_layers: layers of the shared stack (TERN: 2).
        heads, ff_dim, dropout: of every transformer layer (TERN: 4, 2048, 0.1).

    Shapes:
        regions ``(B, R, in_dim)``, mask ``(B, R)`` bool or None (all real) -> ``(B, shared_dim)``.
    """

    def __init__(
        self, in_dim: int, region_dim: int = 2048, region_layers: int = 4, shared_dim: int = 1024,
        shared_layers: int = 2, heads: int = 4, ff_dim: int = 2048, dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.embed = RegionTokenEncoder(in_dim, hidden_dim=region_dim, output_dim=region_dim)
        self.cls = nn.Parameter(torch.randn(region_dim) * 0.02)
        self.regions = TransformerStack(region_dim, region_layers, heads, ff_dim, dropout)
        self.proj = nn.Linear(region_dim, shared_dim)
        self.shared = TransformerStack(shared_dim, shared_layers, heads, ff_dim, dropout)
        self.output_dim = shared_dim

    def forward(self, regions: Tensor, mask: Tensor | None = None) -> Tensor:
        batch = regions.shape[0]
        if mask is not None and mask.shape != regions.shape[:2]:
            raise ValueError(f"mask must be (B, R) = {tuple(regions.shape[:2])}")
        # padded slots come back as 0 and never enter the BatchNorm (0 x NaN would be NaN even
        # where the attention weight is 0)
        x, mask = self.embed(regions, mask)  # (B, R, region_dim), (B, R)
        x = torch.cat([self.cls.expand(batch, 1, -1), x], dim=1)  # (B, 1 + R, region_dim)
        mask = torch.cat([mask.new_ones(batch, 1), mask], dim=1)  # (B, 1 + R), CLS always real
        x = self.proj(self.regions(x, mask))  # (B, 1 + R, shared_dim)
        return self.shared(x, mask)[:, 0]  # (B, shared_dim): the CLS position

    def set_backbone_trainable(self, flag: bool) -> None:
        """No backbone: the region features were extracted offline."""

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """No pretrained backbone: nothing."""
        return iter(())


class TernCaptionEncoder(nn.Module):
    """BERT wordpieces -> linear to ``shared_dim`` -> shared layers -> the ``[CLS]`` output.

    ``set_embeddings_trainable(False)`` freezes the BERT (kept in eval mode meanwhile, see
    :class:`~icr.models.tokens.BertTokenEncoder`); its parameters are
    ``backbone_parameters()``, trained at ``backbone_lr_factor`` x the learning rate (TERN: 1).

    Args:
        path: a transformers (or sentence-transformers) folder; ``None`` = the bundled MiniLM.
        bert_layers: use the first N layers of the BERT (0: all; TERN: 6 of BERT-base's 12).
        shared_dim, shared_layers, heads, ff_dim, dropout: as :class:`TernImageEncoder`.
        backbone_lr_factor: the BERT's learning rate = the common one x this.

    Shapes:
        tokens ``(B, T)`` wordpiece ids starting with ``[CLS]``, lengths ``(B,)`` with
        ``1 <= length <= T`` -> ``(B, shared_dim)``.
    """

    def __init__(
        self, path: str | Path | None = None, bert_layers: int = 0, shared_dim: int = 1024,
        shared_layers: int = 2, heads: int = 4, ff_dim: int = 2048, dropout: float = 0.1,
        backbone_lr_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.tokens = BertTokenEncoder(path, output_dim=shared_dim, num_layers=bert_layers)
        self.shared = TransformerStack(shared_dim, shared_layers, heads, ff_dim, dropout)
        self.output_dim = shared_dim
        self.backbone_lr_factor = backbone_lr_factor

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        x, mask = self.tokens(tokens, lengths)  # (B, T, shared_dim), (B, T)
        return self.shared(x, mask)[:, 0]  # (B, shared_dim): the [CLS] position

    def set_embeddings_trainable(self, flag: bool) -> None:
        self.tokens.set_embeddings_trainable(flag)

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        return self.tokens.backbone_parameters()


def tie_shared_layers(image_encoder: nn.Module, caption_encoder: nn.Module) -> None:
    """Make both TERN encoders use the image side's shared stack (one parameter set).

    The caption side's own stack is dropped. Both stacks are built from the same ``model.*`` keys,
    so they have the same shapes.
    """
    if not (isinstance(image_encoder, TernImageEncoder)
            and isinstance(caption_encoder, TernCaptionEncoder)):  # pragma: no cover - registry bug
        raise TypeError("tie_shared_layers ties a TernImageEncoder and a TernCaptionEncoder")
    caption_encoder.shared = image_encoder.shared


@IMAGE_ENCODERS.register("tern", input="regions", reads=_MODEL_KEYS, tie=tie_shared_layers)
def tern_image(
    *, in_dim: int, transformer_dim: int = 2048, transformer_layers: int = 4,
    shared_dim: int = 1024, shared_layers: int = 2, transformer_heads: int = 4,
    transformer_ff_dim: int = 2048, transformer_dropout: float = 0.1,
) -> TernImageEncoder:
    """TERN's image side over precomputed regions: ``image.transformer_layers`` layers at
    ``image.transformer_dim``, then the ``model.shared_layers`` shared with a TERN caption side."""
    return TernImageEncoder(in_dim, transformer_dim, transformer_layers, shared_dim, shared_layers,
                            transformer_heads, transformer_ff_dim, transformer_dropout)


@TEXT_ENCODERS.register("tern", input="wordpiece", reads=_MODEL_KEYS, tie=tie_shared_layers)
def tern_text(
    *, bert_path: str = "", bert_layers: int = 0, bert_lr_factor: float = 1.0,
    shared_dim: int = 1024, shared_layers: int = 2, transformer_heads: int = 4,
    transformer_ff_dim: int = 2048, transformer_dropout: float = 0.1, **context: object,
) -> TernCaptionEncoder:
    """TERN's caption side: the BERT at ``text.bert_path`` (first ``text.bert_layers`` layers),
    projected to ``model.shared_dim``, then the shared layers; the ``[CLS]`` output."""
    return TernCaptionEncoder(bert_path or None, bert_layers, shared_dim, shared_layers,
                              transformer_heads, transformer_ff_dim, transformer_dropout,
                              bert_lr_factor)
