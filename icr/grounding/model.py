"""The word-region compatibility function of contrastive phrase grounding.

A caption word attends over the regions of an image; its compatibility with the image is the dot
product of its value with the attention-weighted region values (Gupta et al., "Contrastive Learning
for Weakly Supervised Phrase Grounding", ECCV 2020, Sec. 2.3, Eqs. 6-7). The attention of a word
over the regions of its own image is the grounding.

Builders are registered by name in :data:`GROUNDING_MODELS` and take plain keyword arguments:

- ``word_region``: :class:`WordRegionAttention`, the paper's query-key-value attention with 2-layer
  MLPs (Linear, BatchNorm1d, ReLU, Linear) for the word queries and values and the region keys and
  values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from icr.registry import Registry

__all__ = [
    "GROUNDING_MODELS",
    "Compatibility",
    "WordRegionAttention",
    "build_grounding_model",
    "masked_mlp",
]


@dataclass(frozen=True)
class Compatibility:
    """Word-image compatibility logits and, when asked for, the word-region attention.

    Attributes:
        logits: ``phi(R, w)`` of each word against each image (zero at padded words).
        attention: ``a(r, w)`` of each word over the image's regions (zero at padded regions and
            padded words), or ``None``.

    Shapes:
        all pairs (:meth:`WordRegionAttention.forward`): logits ``(B_c, B_i, W)``, attention
        ``(B_c, B_i, W, R)``; own image only (:meth:`WordRegionAttention.paired`): logits
        ``(B, W)``, attention ``(B, W, R)``.
    """

    logits: Tensor
    attention: Tensor | None = None


def _mlp(input_dim: int, hidden_dim: int, output_dim: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(input_dim, hidden_dim),
        nn.BatchNorm1d(hidden_dim),
        nn.ReLU(inplace=True),
        nn.Linear(hidden_dim, output_dim),
    )


def masked_mlp(mlp: nn.Module, features: Tensor, mask: Tensor, output_dim: int) -> Tensor:
    """``mlp`` applied to the valid entries only; padded entries get zeros.

    Only valid entries pass through the network, so padding neither enters the BatchNorm batch
    statistics nor receives gradients.

    Shapes:
        features ``(B, N, D)``, mask ``(B, N)`` bool -> ``(B, N, output_dim)``.
    """
    out = features.new_zeros(*mask.shape, output_dim)  # (B, N, d)
    out[mask] = mlp(features[mask]).to(out.dtype)  # (N_valid, d) written into the valid slots
    return out


class WordRegionAttention(nn.Module):
    """Query-key-value attention of caption words over image regions (Sec. 2.3 of the paper).

    ``s(r, w) = q_w(w) . k_r(r) / sqrt(d)`` (Eq. 6), ``a = softmax_r s`` over the image's valid
    regions, ``v_att(R, w) = sum_r a(r, w) v_r(r)`` (Eq. 7) and the compatibility
    ``phi(R, w) = v_w(w) . v_att(R, w)``. Each of ``q_w, v_w, k_r, v_r`` is an MLP with one hidden
    layer (Linear, BatchNorm1d, ReLU, Linear; Sec. 2.5, "Query-Key-Value Networks").

    Differences from the info-ground reference code (docs/reference-code.md section 4): padded regions
    are masked out of the softmax (the reference lets zero-padded region slots up to 30 take
    attention in training and evaluation), and padded words and regions are kept out of the MLPs'
    BatchNorm statistics, so padding never changes a valid word's logit.

    Args:
        word_dim: size of the contextual word features (768 for BERT-base, 384 for MiniLM).
        region_dim: size of the region features (2048 for BUTD).
        dim: size of the queries, keys and values (384 in the paper).
        word_hidden: hidden units of the word MLPs; ``None`` means ``word_dim`` (the paper).
        region_hidden: hidden units of the region MLPs; ``None`` means ``region_dim`` (the paper).

    Shapes:
        words ``(B_c, W, word_dim)``, word_mask ``(B_c, W)`` bool, regions ``(B_i, R, region_dim)``,
        region_mask ``(B_i, R)`` bool; see :class:`Compatibility` for the outputs.

    References:
        Eqs. 6-7 and Sec. 2.5 of Gupta et al., ECCV 2020.
    """

    def __init__(
        self,
        word_dim: int,
        region_dim: int,
        dim: int = 384,
        word_hidden: int | None = None,
        region_hidden: int | None = None,
    ) -> None:
        super().__init__()
        word_hidden = word_hidden or word_dim
        region_hidden = region_hidden or region_dim
        self.word_query = _mlp(word_dim, word_hidden, dim)
        self.word_value = _mlp(word_dim, word_hidden, dim)
        self.region_key = _mlp(region_dim, region_hidden, dim)
        self.region_value = _mlp(region_dim, region_hidden, dim)
        self.dim = dim
        self.word_dim = word_dim
        self.region_dim = region_dim

    def encode_words(self, words: Tensor, word_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and values of the words, zero at padding: two ``(B_c, W, dim)`` tensors."""
        query = masked_mlp(self.word_query, words, word_mask, self.dim)  # (B_c, W, d)
        value = masked_mlp(self.word_value, words, word_mask, self.dim)  # (B_c, W, d)
        return query, value

    def encode_regions(self, regions: Tensor, region_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the regions, zero at padding: two ``(B_i, R, dim)`` tensors."""
        key = masked_mlp(self.region_key, regions, region_mask, self.dim)  # (B_i, R, d)
        value = masked_mlp(self.region_value, regions, region_mask, self.dim)  # (B_i, R, d)
        return key, value

    def forward(
        self,
        words: Tensor,
        word_mask: Tensor,
        regions: Tensor,
        region_mask: Tensor,
        return_attention: bool = False,
    ) -> Compatibility:
        """Logits of every caption's words against every image: ``(B_c, B_i, W)``.

        ``phi`` is linear in ``v_att``, so the logit is computed as ``sum_r a(r, w) (v_w . v_r)``
        without materialising the attended values ``(B_c, B_i, W, d)``.
        """
        query, word_value = self.encode_words(words, word_mask)  # (B_c, W, d) x2
        key, region_value = self.encode_regions(regions, region_mask)  # (B_i, R, d) x2
        scores = torch.einsum("cwd,ird->ciwr", query, key) / math.sqrt(self.dim)  # (B_c,B_i,W,R)
        attention = _masked_softmax(scores, region_mask[None, :, None, :])  # (B_c, B_i, W, R)
        attention = attention * word_mask[:, None, :, None]
        dots = torch.einsum("cwd,ird->ciwr", word_value, region_value)  # (B_c, B_i, W, R)
        logits = (attention * dots).sum(dim=-1)  # (B_c, B_i, W)
        return Compatibility(logits, attention if return_attention else None)

    def paired(
        self, words: Tensor, word_mask: Tensor, regions: Tensor, region_mask: Tensor
    ) -> Compatibility:
        """Logits and attention of caption ``b``'s words against image ``b`` only.

        For evaluation (the attention is the grounding) and for ``L_lang`` (candidate words
        against the caption's own image).

        Shapes:
            words ``(B, W, word_dim)``, word_mask ``(B, W)``, regions ``(B, R, region_dim)``,
            region_mask ``(B, R)`` -> logits ``(B, W)``, attention ``(B, W, R)``.
        """
        if words.shape[0] != regions.shape[0]:
            raise ValueError(
                f"paired() needs one image per caption, got {words.shape[0]} captions and "
                f"{regions.shape[0]} images"
            )
        query, word_value = self.encode_words(words, word_mask)  # (B, W, d) x2
        key, region_value = self.encode_regions(regions, region_mask)  # (B, R, d) x2
        scores = torch.einsum("bwd,brd->bwr", query, key) / math.sqrt(self.dim)  # (B, W, R)
        attention = _masked_softmax(scores, region_mask[:, None, :]) * word_mask[..., None]
        attended = torch.einsum("bwr,brd->bwd", attention, region_value)  # (B, W, d), Eq. 7
        logits = (word_value * attended).sum(dim=-1)  # (B, W)
        return Compatibility(logits, attention)


def _masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dimension restricted to ``mask``; all-zero where nothing is valid."""
    filled = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(filled, dim=-1) * mask  # an image without regions attends to nothing


GROUNDING_MODELS: Registry[Callable[..., nn.Module]] = Registry(
    "grounding model", package="icr.grounding"
)


@GROUNDING_MODELS.register("word_region")
def word_region(
    *,
    word_dim: int,
    region_dim: int,
    dim: int = 384,
    word_hidden: int | None = None,
    region_hidden: int | None = None,
) -> WordRegionAttention:
    """:class:`WordRegionAttention` (the paper's compatibility function)."""
    return WordRegionAttention(word_dim, region_dim, dim, word_hidden, region_hidden)


def build_grounding_model(name: str, **kwargs: object) -> nn.Module:
    """Build the grounding model registered as ``name``; an option it does not take raises."""
    return GROUNDING_MODELS.bind(name, **kwargs)()
