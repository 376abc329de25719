"""Projection heads from encoder features to the joint embedding space."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["ProjectionHead"]


class ProjectionHead(nn.Module):
    """A linear or two-layer projection, optionally followed by BatchNorm1d.

    With ``hidden_dim``: ``Linear(in, hidden, no bias) -> ReLU -> Linear(hidden, out, no bias)``, the
    PCME / LTD image head (2048 -> 2048 -> 1024). Without: one ``Linear(in, out)`` with a bias.
    ``batchnorm=True`` appends ``BatchNorm1d(out)``, which the PCME / LTD baseline uses only with the
    triplet loss (docs/reference-code.md section 1). Linear weights are xavier-uniform, biases zero.
    L2 normalisation is left to :class:`~icr.models.dual_encoder.DualEncoder`.

    Shapes:
        (B, in_dim) -> (B, out_dim).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int | None = None,
        batchnorm: bool = False,
    ) -> None:
        super().__init__()
        if hidden_dim is None:
            layers: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
        else:
            layers = [
                nn.Linear(in_dim, hidden_dim, bias=False),
                nn.ReLU(inplace=True),
                nn.Linear(hidden_dim, out_dim, bias=False),
            ]
        if batchnorm:
            layers.append(nn.BatchNorm1d(out_dim))
        self.net = nn.Sequential(*layers)
        self.in_dim = in_dim
        self.output_dim = out_dim
        for module in self.net:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, out_dim)
