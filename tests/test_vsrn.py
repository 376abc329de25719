"""VSRN image encoder: shapes, gradients, padding invariance, determinism, the reasoning layer
against a loop."""

from __future__ import annotations

import pytest
import torch

from icr.models.image import IMAGE_ENCODERS
from icr.models.vsrn import GraphReasoning, VSRNEncoder

IN_DIM, DIM = 12, 8


def _encoder(seed: int = 0, **kwargs) -> VSRNEncoder:
    torch.manual_seed(seed)
    return IMAGE_ENCODERS.bind("vsrn", in_dim=IN_DIM, output_dim=DIM, **kwargs)()


def _open_reasoning(encoder: VSRNEncoder) -> None:
    """Give the reasoning layers' BatchNorm a non-zero scale (they start as the identity)."""
    with torch.no_grad():
        for layer in encoder.reasoning:
            layer.norm.weight.uniform_(0.5, 1.5)
            layer.norm.bias.uniform_(-0.1, 0.1)


def _padded(real: list[torch.Tensor], width: int, seed: int, scatter: bool = False):
    """Pad each image's regions to ``width`` with large garbage; optionally interleave the padding
    with the real regions (keeping their order)."""
    g = torch.Generator().manual_seed(seed)
    batch = 1e3 * torch.randn(len(real), width, IN_DIM, generator=g)
    mask = torch.zeros(len(real), width, dtype=torch.bool)
    for b, regions in enumerate(real):
        if scatter:
            slots = torch.randperm(width, generator=g)[: len(regions)].sort().values
        else:
            slots = torch.arange(len(regions))
        batch[b, slots] = regions
        mask[b, slots] = True
    return batch, mask


def _real_regions(counts=(2, 5, 3), seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, IN_DIM, generator=g) for n in counts]


# ---------------------------------------------------------------- basics


def test_registered_shapes_and_no_backbone():
    assert "vsrn" in IMAGE_ENCODERS and IMAGE_ENCODERS.meta("vsrn")["input"] == "regions"
    encoder = _encoder(gcn_layers=2, gcn_inter_dim=5)
    assert len(encoder.reasoning) == 2 and encoder.output_dim == DIM
    assert encoder.reasoning[0].theta.out_features == 5
    assert _encoder().reasoning[0].theta.out_features == DIM  # 0 = the embedding size
    out = encoder(torch.randn(3, 7, IN_DIM))
    assert out.shape == (3, DIM) and torch.isfinite(out).all()
    encoder.set_backbone_trainable(False)  # nothing to freeze: a no-op
    assert all(p.requires_grad for p in encoder.parameters())


def test_backward_reaches_every_parameter():
    encoder = _encoder()
    _open_reasoning(encoder)
    regions, mask = _padded(_real_regions(), 6, seed=2)
    encoder(regions, mask).pow(2).sum().backward()
    for name, param in encoder.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_reasoning_layers_start_as_the_identity():
    layer = GraphReasoning(DIM)
    x = torch.randn(2, 4, DIM)
    torch.testing.assert_close(layer(x, torch.ones(2, 4, dtype=torch.bool)), x)


def test_reasoning_layer_matches_loop():
    # eval mode with fresh running statistics: BN(y) = y / sqrt(1 + eps) * weight + bias
    torch.manual_seed(3)
    layer = GraphReasoning(DIM, inter_dim=5).double().eval()
    with torch.no_grad():
        layer.norm.weight.fill_(2.0)
        layer.norm.bias.fill_(0.1)
    x = torch.randn(2, 4, DIM, dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True], [True, False, True, False]])
    got = layer(x, mask)
    scale = 2.0 / (1 + layer.norm.eps) ** 0.5
    for b in range(2):
        real = [i for i in range(4) if mask[b, i]]
        for i in real:
            y = sum(
                (layer.theta(x[b, i]) @ layer.phi(x[b, j])) / len(real) * layer.g(x[b, j])
                for j in real
            )
            want = x[b, i] + layer.W(y) * scale + 0.1
            torch.testing.assert_close(got[b, i], want)


# ---------------------------------------------------------------- padding, determinism


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_padding_never_influences_the_output(mode):
    encoder = _encoder()
    _open_reasoning(encoder)
    encoder.train(mode == "train")
    real = _real_regions()
    regions, mask = _padded(real, 6, seed=4)
    reference = encoder(regions, mask)
    for width, seed, scatter in ((6, 5, False), (9, 6, False), (9, 7, True)):
        other, other_mask = _padded(real, width, seed, scatter)
        torch.testing.assert_close(encoder(other, other_mask), reference)
    if mode == "eval":  # without batch statistics, an image alone gives its row of the batch
        for b, r in enumerate(real):
            torch.testing.assert_close(encoder(r[None]), reference[b : b + 1])
    # the order of the real regions does matter (the GRU reads them in sequence)
    swapped = regions.clone()
    swapped[1, [0, 1]] = regions[1, [1, 0]]
    assert not torch.allclose(encoder(swapped, mask)[1], reference[1])


def test_deterministic():
    regions, mask = _padded(_real_regions(), 6, seed=8)
    a, b = _encoder(seed=9), _encoder(seed=9)
    for encoder in (a, b):
        torch.manual_seed(0)
        _open_reasoning(encoder)
    torch.testing.assert_close(a(regions, mask), b(regions, mask), rtol=0, atol=0)
    torch.testing.assert_close(a(regions, mask), a(regions, mask), rtol=0, atol=0)
    assert not torch.allclose(_encoder(seed=10)(regions, mask), _encoder(seed=9)(regions, mask))


def test_an_image_without_regions_raises():
    encoder = _encoder()
    mask = torch.tensor([[True, False], [False, False]])
    with pytest.raises(ValueError, match="real region per image"):
        encoder(torch.randn(2, 2, IN_DIM), mask)


def test_regions_normalisation_option_matters():
    # (with identity reasoning layers it would not: the regions are normalised again after them)
    regions = 5 * torch.randn(2, 4, IN_DIM)
    plain, normed = _encoder(seed=0, normalize_regions=False), _encoder(seed=0)
    for encoder in (plain, normed):
        torch.manual_seed(1)
        _open_reasoning(encoder)
    assert not torch.allclose(plain(regions), normed(regions))
    assert plain.fc.bias.abs().sum() == 0  # zero bias at init, as the reference
