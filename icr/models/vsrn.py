"""VSRN image encoder: region features -> graph reasoning -> GRU -> one image vector.

Visual Semantic Reasoning (Li et al., ICCV 2019), as used in the metric-learning study (Bleeker &
de Rijke, ECIR 2022, section 3; docs/reference-code.md section 2):

1. each precomputed region feature (36 x 2048 BUTD regions) goes through a Linear layer to the
   embedding size (xavier-uniform weights, zero bias) and, for COCO in the reference code, is
   L2-normalised (``normalize_regions``; the reference skips it for Flickr30K);
2. ``gcn_layers`` (4) graph reasoning layers (:class:`GraphReasoning`, VSRN's ``Rs_GCN``) relate
   the regions to each other; each region is then L2-normalised;
3. a GRU runs over the regions and its final hidden state is the image vector.

BatchNorm and L2 normalisation of that vector are left to the projection head / dual encoder
(``model.head_batchnorm``). The caption-generation branch of the original is removed, as in the
paper, and so is the two-model ensemble of VSRN's evaluation.

Padding: an optional ``mask`` (B, R) marks the real regions of images with fewer than R. Padded
regions never influence the output: they are zeroed on entry, excluded from every affinity, from
the BatchNorm statistics of the reasoning layers and from the GRU, and the affinities are divided
by each image's own number of regions. Real regions need not come first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from icr.models.image import IMAGE_ENCODERS, maybe_load_weights

__all__ = ["GraphReasoning", "VSRNEncoder", "vsrn"]


def _masked_batchnorm(norm: nn.BatchNorm1d, x: Tensor, mask: Tensor | None) -> Tensor:
    """BatchNorm over the real regions of the batch only; padded positions come back as 0.

    ``mask`` ``None``: every region is real, and no selection is made (selecting the real rows
    waits for the GPU to count them).

    Shapes:
        x: ``(B, R, D)``; mask: ``(B, R)`` bool or None; returns ``(B, R, D)``.
    """
    if mask is None:
        return norm(x.reshape(-1, x.shape[-1])).view_as(x)
    out = torch.zeros_like(x)
    out[mask] = norm(x[mask])  # (M, D): the statistics of real regions only
    return out


class GraphReasoning(nn.Module):
    """One graph reasoning layer over the regions of an image (VSRN's ``Rs_GCN``).

    ``R = theta(x) phi(x)^T / n`` is the affinity of every pair of regions, ``n`` the number of
    regions of the image; the layer returns ``x + BN(W(R g(x)))``. The BatchNorm's scale and shift
    start at 0, so the layer starts as the identity (as in the reference). theta, phi, g and W are
    per-region linear maps (1x1 convolutions in the reference).

    Args:
        dim: region vector size.
        inter_dim: size of the theta / phi / g projections (``dim`` in VSRN).

    Shapes:
        x: ``(B, R, dim)``; mask: ``(B, R)`` bool, or None when every region is real;
        returns ``(B, R, dim)``.

    References:
        Li et al., "Visual Semantic Reasoning for Image-Text Matching", ICCV 2019 (region
        relationship reasoning); their code, ``GCN_lib/Rs_GCN.py``; Wang et al., "Non-local
        Neural Networks", CVPR 2018.
    """

    def __init__(self, dim: int, inter_dim: int | None = None) -> None:
        super().__init__()
        inter_dim = inter_dim or dim
        self.g = nn.Linear(dim, inter_dim)
        self.theta = nn.Linear(dim, inter_dim)
        self.phi = nn.Linear(dim, inter_dim)
        self.W = nn.Linear(inter_dim, dim)
        self.norm = nn.BatchNorm1d(dim)
        nn.init.zeros_(self.norm.weight)
        nn.init.zeros_(self.norm.bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        affinity = self.theta(x) @ self.phi(x).transpose(1, 2)  # (B, R, R)
        if mask is None:  # every region real
            affinity = affinity / x.shape[1]
        else:
            count = mask.sum(1, keepdim=True).to(x.dtype)  # (B, 1) regions per image
            affinity = affinity.masked_fill(~mask[:, None, :], 0.0) / count[:, :, None]
        update = self.W(affinity @ self.g(x))  # (B, R, dim)
        return x + _masked_batchnorm(self.norm, update, mask)


class VSRNEncoder(nn.Module):
    """Region features to one image vector through graph reasoning and a GRU (module docstring).

    Args:
        in_dim: region feature size (2048 for BUTD).
        output_dim: embedding size: the regions' projection, the reasoning layers and the GRU
            (2048 in the paper's VSRN runs).
        gcn_layers: graph reasoning layers (4).
        inter_dim: size of the reasoning layers' theta / phi / g (``output_dim`` by default).
        normalize_regions: L2-normalise the projected regions before reasoning (VSRN on COCO).

    Shapes:
        regions ``(B, R, in_dim)``, mask ``(B, R)`` bool or None -> ``(B, output_dim)``.
    """

    def __init__(
        self,
        in_dim: int,
        output_dim: int = 2048,
        gcn_layers: int = 4,
        inter_dim: int | None = None,
        normalize_regions: bool = True,
    ) -> None:
        super().__init__()
        self.fc = nn.Linear(in_dim, output_dim)
        bound = math.sqrt(6.0 / (in_dim + output_dim))
        nn.init.uniform_(self.fc.weight, -bound, bound)  # xavier, as the reference
        nn.init.zeros_(self.fc.bias)
        self.reasoning = nn.ModuleList(
            GraphReasoning(output_dim, inter_dim) for _ in range(gcn_layers)
        )
        self.gru = nn.GRU(output_dim, output_dim, batch_first=True)
        self.normalize_regions = normalize_regions
        self.output_dim = output_dim

    def forward(self, regions: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:  # every region real (the precomputed files): nothing to select, and
            # the GRU reads all R regions (no lengths to count on the device)
            x = self.fc(regions)  # (B, R, D)
        elif mask.shape != regions.shape[:2] or not bool(mask.any(1).all()):
            raise ValueError(
                f"mask must be (B, R) = {tuple(regions.shape[:2])} with a real region per image"
            )
        else:
            x = self.fc(regions.masked_fill(~mask[..., None], 0.0))  # (B, R, D)
        if self.normalize_regions:
            x = F.normalize(x, dim=-1)
        for layer in self.reasoning:
            x = layer(x, mask)  # (B, R, D)
        x = F.normalize(x, dim=-1)
        if mask is None:
            _, hidden = self.gru(x)  # (1, B, D)
            return hidden[-1]  # (B, D)
        # real regions first, in their order, so the GRU can stop at each image's last one
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices  # (B, R)
        x = x.gather(1, order[..., None].expand_as(x))  # (B, R, D)
        lengths = mask.sum(1).cpu()  # (B,): the packed GRU reads them on the host
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, hidden = self.gru(packed)  # (1, B, D)
        return hidden[-1]  # (B, D)

    def set_backbone_trainable(self, flag: bool) -> None:
        """No backbone: the region features were extracted offline."""


@IMAGE_ENCODERS.register("vsrn", input="regions")
def vsrn(
    *,
    in_dim: int,
    output_dim: int = 2048,
    gcn_layers: int = 4,
    gcn_inter_dim: int = 0,
    normalize_regions: bool = True,
    pretrained: bool = False,
    weights_path: str | None = None,
) -> VSRNEncoder:
    """:class:`VSRNEncoder` over precomputed regions (``data.features=regions``).

    ``gcn_inter_dim`` 0 means ``output_dim`` (VSRN). There are no published weights for this
    encoder alone; ``pretrained=True`` needs ``weights_path`` (a state dict of this encoder, e.g.
    from an earlier run).
    """
    inter_dim = gcn_inter_dim or None
    encoder = VSRNEncoder(in_dim, output_dim, gcn_layers, inter_dim, normalize_regions)
    maybe_load_weights(encoder, "vsrn", pretrained, weights_path)
    return encoder
