"""Poolings: a set of token features and its mask -> one vector per set.

Every pooling is an ``nn.Module`` mapping ``features (B, T, D)`` and ``mask (B, T)`` (bool, True =
a real token) to ``(B, D)``, so the same poolings serve regions, grid cells, words and wordpieces
(the token-set encoders of :mod:`icr.models.tokens` return exactly that pair). They are registered
by name in :data:`POOLINGS` as builders ``(dim, **options) -> nn.Module``:

- ``max``: per-dimension maximum over the real tokens;
- ``mean``: mean over the real tokens;
- ``gpo``: VSE-infinity's generalized pooling operator (Chen et al., CVPR 2021);
- ``adpool``: adaptive pooling of VSE+2AD (Zhang et al., "Improving Visual-Semantic Embedding with
  Adaptive Pooling and Optimization Objective", Section 3.2, Eq. 3-5).

Padding never reaches a pooled vector: padded slots are overwritten (``masked_fill``, so even NaN or
inf garbage is harmless) before any sort, softmax or sum, and every softmax runs over the real
tokens only. Every set needs at least one real token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from icr.errors import ConfigError
from icr.models.recurrent import StaticShapes, run_gru
from icr.registry import Registry

__all__ = [
    "POOLINGS",
    "AdaptivePool",
    "GPO",
    "MaxPool",
    "MeanPool",
    "positional_encoding",
    "sort_tokens",
]

POOLINGS: Registry[Callable[..., nn.Module]] = Registry("pooling", package="icr.models")


def sort_tokens(features: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Sort each dimension's values over the real tokens, descending; padding goes last.

    Returns the sorted features, with 0 in the padded slots (which now sit at positions
    ``>= n``, n = the number of real tokens), and the mask of the sorted slots,
    ``position < n``. Works for any mask, not only prefix masks.

    Shapes:
        features: ``(B, T, D)``; mask: ``(B, T)`` bool; returns ``(B, T, D)`` and ``(B, T)`` bool.
    """
    filled = features.masked_fill(~mask[:, :, None], float("-inf"))  # (B, T, D)
    ordered = filled.sort(dim=1, descending=True).values  # (B, T, D)
    positions = torch.arange(mask.shape[1], device=mask.device)  # (T,)
    sorted_mask = positions[None, :] < mask.sum(dim=1, keepdim=True)  # (B, T)
    # 0, not -inf, in the padded slots: 0 * weight 0 is 0 where -inf * 0 would be NaN.
    return ordered.masked_fill(~sorted_mask[:, :, None], 0.0), sorted_mask


def _masked_softmax(scores: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """Softmax over the real tokens only (padded entries get weight exactly 0).

    Shapes:
        scores: ``(B, T, ...)``; mask: ``(B, T)`` bool, broadcast over the trailing dims.
    """
    shape = mask.shape + (1,) * (scores.dim() - mask.dim())
    return scores.masked_fill(~mask.view(shape), float("-inf")).softmax(dim=dim)


class MaxPool(nn.Module):
    """Per-dimension maximum over the real tokens (MaxPool of Section 3.2.1 of the VSE+2AD paper).

    Shapes:
        features (B, T, D), mask (B, T) bool -> (B, D).
    """

    def forward(self, features: Tensor, mask: Tensor) -> Tensor:
        filled = features.masked_fill(~mask[:, :, None], float("-inf"))  # (B, T, D)
        return filled.amax(dim=1)  # (B, D)


class MeanPool(nn.Module):
    """Mean over the real tokens (MeanPool of Section 3.2.1 of the VSE+2AD paper).

    Shapes:
        features (B, T, D), mask (B, T) bool -> (B, D).
    """

    def forward(self, features: Tensor, mask: Tensor) -> Tensor:
        total = features.masked_fill(~mask[:, :, None], 0.0).sum(dim=1)  # (B, D)
        count = mask.sum(dim=1, keepdim=True).clamp(min=1).to(features.dtype)  # (B, 1)
        return total / count


@POOLINGS.register("max")
def max_pool(dim: int) -> MaxPool:
    """:class:`MaxPool`; ``dim`` is unused (no parameters)."""
    return MaxPool()


@POOLINGS.register("mean")
def mean_pool(dim: int) -> MeanPool:
    """:class:`MeanPool`; ``dim`` is unused (no parameters)."""
    return MeanPool()


# --------------------------------------------------------------------------- GPO


def positional_encoding(length: int, dim: int, device: torch.device | None = None) -> Tensor:
    """Sinusoidal position encodings (Vaswani et al. 2017): sin on even, cos on odd channels.

    Shapes:
        returns ``(length, dim)``; ``dim`` must be even.
    """
    if dim % 2:
        raise ConfigError(f"positional encodings need an even size, got {dim}; use an even pe_dim")
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]  # (L, 1)
    freq = torch.exp(
        torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )  # (dim / 2,)
    pe = torch.empty(length, dim, device=device)  # (L, dim)
    pe[:, 0::2] = torch.sin(position * freq)
    pe[:, 1::2] = torch.cos(position * freq)
    return pe


class GPO(nn.Module, StaticShapes):
    """Generalized pooling operator: a learned weighting of the per-dimension sorted features.

    The real tokens' values are sorted per dimension, descending, so position k holds each
    dimension's k-th largest value. The weight of position k comes from a one-layer BiGRU run over
    the sinusoidal encodings of positions ``0 .. n-1`` only (so the GRU also knows n, the number
    of real tokens; packed or at a static shape, :mod:`icr.models.recurrent`), its two directions averaged, a linear score without bias and a
    softmax over the n real positions with temperature 0.1. Max pooling, mean pooling and K-max
    pooling are special cases of the weights.

    Args:
        dim: feature size (unused: the weights depend on positions and n only).
        pe_dim: size of the positional encodings (32 in VSE-infinity).
        gru_dim: BiGRU units per direction (32 in VSE-infinity).
        temperature: softmax temperature of the scores (0.1).

    Shapes:
        features (B, T, D), mask (B, T) bool -> (B, D).

    References:
        Chen et al., "Learning the Best Pooling Strategy for Visual Semantic Embedding"
        (VSE-infinity), CVPR 2021, Section 3 (the generalized pooling operator and its
        weight generator).
    """

    def __init__(
        self, dim: int, pe_dim: int = 32, gru_dim: int = 32, temperature: float = 0.1
    ) -> None:
        super().__init__()
        positional_encoding(1, pe_dim)  # validates pe_dim early
        self.pe_dim = pe_dim
        self.temperature = temperature
        self.gru = nn.GRU(pe_dim, gru_dim, num_layers=1, batch_first=True, bidirectional=True)
        self.score = nn.Linear(gru_dim, 1, bias=False)

    def position_weights(self, sorted_mask: Tensor) -> Tensor:
        """Softmax weights of the sorted positions, 0 beyond each set's size.

        The weights depend on a set's size ``n`` alone, so they are computed once per size, for
        every ``n`` in ``1 .. T`` (:meth:`weight_table`), and each set takes its row: the GRU
        then needs no set size on the host (a packed sequence reads its lengths there, which
        would wait for the GPU at every step).

        Shapes:
            sorted_mask: ``(B, T)`` bool prefix mask; returns ``(B, T)``.
        """
        sizes = sorted_mask.sum(dim=1)  # (B,) on the device
        table = self.weight_table(sorted_mask.shape[1], sorted_mask.device)  # (T, T)
        return table.index_select(0, (sizes - 1).clamp(min=0))  # (B, T)

    def weight_table(self, length: int, device: torch.device) -> Tensor:
        """Row ``n - 1``: the weights of a set of ``n`` real tokens, for ``n = 1 .. length``.

        Shapes: returns ``(length, length)``, row ``n - 1`` zero beyond position ``n - 1``.
        """
        # T, T - 1, ..., 1: on the host for a packed run, on the device for a static one
        sizes = torch.arange(length, 0, -1, device=device if self.static_shapes else None)  # (T,)
        pe = positional_encoding(length, self.pe_dim, device)  # (T, P)
        pe = pe.expand(length, length, self.pe_dim)  # (T, T, P)
        out, _ = run_gru(self.gru, pe, sizes, static=self.static_shapes)  # (T, T, 2H)
        forward_dir, backward_dir = out.chunk(2, dim=-1)  # (T, T, H) each
        scores = self.score((forward_dir + backward_dir) / 2).squeeze(-1)  # (T, T)
        mask = torch.arange(length, device=device)[None, :] < sizes.to(device)[:, None]
        return _masked_softmax(scores / self.temperature, mask).flip(0)  # row n - 1: size n

    def forward(self, features: Tensor, mask: Tensor) -> Tensor:
        ordered, sorted_mask = sort_tokens(features, mask)  # (B, T, D), (B, T)
        weights = self.position_weights(sorted_mask).to(ordered.dtype)  # (B, T)
        return (ordered * weights[:, :, None]).sum(dim=1)  # (B, D)


@POOLINGS.register("gpo")
def gpo(dim: int, pe_dim: int = 32, gru_dim: int = 32, temperature: float = 0.1) -> GPO:
    """:class:`GPO` (VSE-infinity's generalized pooling operator)."""
    return GPO(dim, pe_dim=pe_dim, gru_dim=gru_dim, temperature=temperature)


# --------------------------------------------------------------------------- AdPool


class AdaptivePool(nn.Module):
    """AdPool: token-level and embedding-level soft pooling, fused by learned weights.

    - Embedding level (Eq. 4): per dimension j, ``sum_i softmax_i(x_ij) * x_ij`` over the real
      tokens, a soft max pooling.
    - Token level (Eq. 3): the features sorted per dimension (descending, as in K-max pooling),
      ``u``; weights ``softmax_i(relu(Linear(D, D)(u_i)))_j`` over the real sorted positions,
      one per position *and dimension* (as in the reference code; Eq. 3 writes one weight per
      token); the pooled vector is ``sum_i w_ij * u_ij``.
    - Fusion (Eq. 5): ``w_1 t_tok + w_2 t_emb`` with ``(w_1, w_2) = softmax(W_bal t_tok,
      W_bal t_emb)``, ``W_bal`` a shared ``Linear(D, 1)``.

    Deliberate difference from the reference code (vse_2ad ``modules/adcap.py``): there the
    token-level softmax also runs over the padded slots (zero features, score relu(bias)), so
    those slots take weight from the real ones and adding padding changes the pooled vector.
    Here both softmaxes run over the real tokens only.

    Args:
        dim: feature size D.

    Shapes:
        features (B, T, D), mask (B, T) bool -> (B, D).

    References:
        Zhang et al., "Improving Visual-Semantic Embedding with Adaptive Pooling and Optimization
        Objective" (VSE+2AD), Section 3.2, Eq. 3, 4 and 5.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.token_scores = nn.Linear(dim, dim)
        self.balance = nn.Linear(dim, 1)
        nn.init.xavier_uniform_(self.token_scores.weight)  # as the reference initialises it
        nn.init.zeros_(self.token_scores.bias)

    def forward(self, features: Tensor, mask: Tensor) -> Tensor:
        ordered, sorted_mask = sort_tokens(features, mask)  # (B, T, D), padding 0 and last
        # Embedding level: a per-dimension softmax is permutation invariant, so the sorted
        # features give Eq. 4 of the unsorted ones.
        emb_weights = _masked_softmax(ordered, sorted_mask)  # (B, T, D)
        pooled_emb = (ordered * emb_weights).sum(dim=1)  # (B, D)
        tok_weights = _masked_softmax(F.relu(self.token_scores(ordered)), sorted_mask)  # (B, T, D)
        pooled_tok = (ordered * tok_weights).sum(dim=1)  # (B, D)
        both = torch.stack([pooled_tok, pooled_emb], dim=1)  # (B, 2, D)
        fusion = self.balance(both).softmax(dim=1)  # (B, 2, 1)
        return (both * fusion).sum(dim=1)  # (B, D)


@POOLINGS.register("adpool")
def adpool(dim: int) -> AdaptivePool:
    """:class:`AdaptivePool` (AdPool of VSE+2AD)."""
    return AdaptivePool(dim)
