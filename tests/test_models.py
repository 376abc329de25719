"""Image encoders (parametrised over the registry), the caption GRU, heads and the dual encoder."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torchvision
from torch import nn

from icr.config import ImageConfig
from icr.errors import ConfigError
from icr.models.dual_encoder import DualEncoder
from icr.models.heads import ProjectionHead
from icr.models.image import IMAGE_ENCODERS
from icr.models.text import GRUCaptionEncoder

EXPECTED_DIMS = {"resnet50": 2048, "resnet18": 512, "small_cnn": 16, "efficientnet_lite0": 1280}


@pytest.fixture(autouse=True)
def _empty_hub_cache(tmp_path, monkeypatch):
    """Point the torch hub cache at an empty directory so no real cached weights are found."""
    hub = tmp_path / "hub"
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(hub))
    return hub


REGION_DIM = 12  # a region vector of the tests' precomputed features
# small sizes for every encoder
SMALL = ImageConfig(hidden_dim=16, output_dim=16, gcn_layers=1, transformer_dim=16,
                    transformer_layers=1)


def _reads_regions(name: str) -> bool:
    return IMAGE_ENCODERS.meta(name)["input"] == "regions"


def _build(name: str, **options):
    """Any registered image encoder, built as the pipeline builds it (config section + context)."""
    section = replace(SMALL, **options)
    return IMAGE_ENCODERS.build(name, section, **({"in_dim": REGION_DIM} if _reads_regions(name) else {}))


def _example(name: str) -> torch.Tensor:
    """An input batch of the kind the encoder reads: pixels, or (B, R, D) region features."""
    return torch.randn(2, 5, REGION_DIM) if _reads_regions(name) else _images()


CNNS = [n for n in IMAGE_ENCODERS.names() if not _reads_regions(n)]
# Encoders whose pretrained weights ship with an installed package (no local file needed).
PACKAGED_WEIGHTS = {"efficientnet_lite0"}
LOCAL_WEIGHTS = [n for n in IMAGE_ENCODERS.names()
                 if "pretrained" in IMAGE_ENCODERS.options(n) and n not in PACKAGED_WEIGHTS]


def _images(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


def _batchnorms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --------------------------------------------------------------------------- image encoders


def test_registry_lists_expected_encoders():
    assert set(EXPECTED_DIMS) <= set(IMAGE_ENCODERS.names())
    assert all(IMAGE_ENCODERS.meta(n)["input"] in ("pixels", "regions") for n in IMAGE_ENCODERS)


@pytest.mark.parametrize("name", IMAGE_ENCODERS.names())
def test_image_encoder_forward_backward(name):
    torch.manual_seed(0)
    enc = _build(name, pretrained=False)
    out = enc(_example(name))
    assert out.shape == (2, enc.output_dim)
    if name in EXPECTED_DIMS:
        assert enc.output_dim == EXPECTED_DIMS[name]
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    grads = [p.grad for p in enc.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("name", LOCAL_WEIGHTS)
def test_pretrained_without_local_file_names_the_fix(name, _empty_hub_cache):
    with pytest.raises(ConfigError) as info:
        _build(name, pretrained=True)
    msg = str(info.value)
    assert "\n" not in msg
    assert "image.weights_path=" in msg and "image.pretrained=false" in msg
    if name.startswith("resnet"):
        assert str(_empty_hub_cache / "checkpoints") in msg  # names where it looked


@pytest.mark.parametrize("name", [n for n in IMAGE_ENCODERS.names()
                                  if "weights_path" in IMAGE_ENCODERS.options(n)])
def test_missing_weights_path_raises(name, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        _build(name, pretrained=True, weights_path=str(tmp_path / "nope.pth"))


@pytest.mark.parametrize("name", CNNS)
def test_frozen_backbone_keeps_batchnorm_in_eval(name):
    enc = _build(name, pretrained=False)
    enc.set_backbone_trainable(False)
    enc.train()
    bns = _batchnorms(enc.backbone)
    assert bns and not any(bn.training for bn in bns)
    before = [bn.running_mean.clone() for bn in bns]
    enc(_images())
    assert all(torch.equal(b, bn.running_mean) for b, bn in zip(before, bns, strict=True))
    assert not any(p.requires_grad for p in enc.backbone.parameters())
    enc.set_backbone_trainable(True)
    assert all(bn.training for bn in bns)
    assert all(p.requires_grad for p in enc.backbone.parameters())


def test_resnet_loads_local_torchvision_state_dict(tmp_path):
    torch.manual_seed(1)
    reference = torchvision.models.resnet18(weights=None).eval()
    path = tmp_path / "r18.pth"
    torch.save(reference.state_dict(), path)  # includes fc.*, which the encoder drops
    enc = IMAGE_ENCODERS.get("resnet18")(pretrained=True, weights_path=str(path)).eval()
    assert torch.equal(enc.backbone.conv1.weight, reference.conv1.weight)
    reference.fc = nn.Identity()
    x = _images()
    torch.testing.assert_close(enc(x), reference(x))


def test_resnet_loads_from_local_hub_cache(_empty_hub_cache):
    torch.manual_seed(2)
    reference = torchvision.models.resnet18(weights=None)
    file_name = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1]
    ckpt = _empty_hub_cache / "checkpoints" / file_name
    ckpt.parent.mkdir(parents=True)
    torch.save(reference.state_dict(), ckpt)
    enc = IMAGE_ENCODERS.get("resnet18")(pretrained=True)
    assert torch.equal(enc.backbone.layer4[1].conv2.weight, reference.layer4[1].conv2.weight)


def test_weights_of_wrong_architecture_raise(tmp_path):
    path = tmp_path / "r18.pth"
    torch.save(torchvision.models.resnet18(weights=None).state_dict(), path)
    with pytest.raises(ConfigError, match="do not fit small_cnn"):
        IMAGE_ENCODERS.get("small_cnn")(pretrained=True, weights_path=str(path))


def test_small_cnn_round_trips_its_own_weights(tmp_path):
    torch.manual_seed(3)
    enc = IMAGE_ENCODERS.bind("small_cnn", output_dim=64)().eval()
    path = tmp_path / "cnn.pth"
    torch.save(enc.state_dict(), path)  # keys carry the "backbone." prefix
    loaded = IMAGE_ENCODERS.bind(
        "small_cnn", output_dim=64, pretrained=True, weights_path=str(path)
    )().eval()
    x = _images(size=64)
    assert loaded(x).shape == (2, 64)
    torch.testing.assert_close(loaded(x), enc(x))
    assert sum(p.numel() for p in IMAGE_ENCODERS.bind("small_cnn")().parameters()) < 1_000_000


def test_an_image_encoder_rejects_unknown_options():
    with pytest.raises(ConfigError, match="output_dim"):
        IMAGE_ENCODERS.bind("resnet18", output_dim=10)()
    with pytest.raises(ConfigError, match="small_cnn"):
        IMAGE_ENCODERS.bind("vgg_nope")()


# --------------------------------------------------------------------------- caption encoder

H = 8


def _caption_encoder(**kwargs) -> GRUCaptionEncoder:
    torch.manual_seed(0)
    return GRUCaptionEncoder(vocab_size=20, embed_dim=6, hidden_dim=H, **kwargs).eval()


def _pad(captions: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(captions), length, dtype=torch.long)
    for i, cap in enumerate(captions):
        tokens[i, : len(cap)] = torch.tensor(cap)
    return tokens, torch.tensor([len(c) for c in captions])


def test_caption_summary_is_the_true_bidirectional_final_state():
    """Oracle: run each direction as a plain unidirectional GRU over the valid tokens only."""
    enc = _caption_encoder()
    captions = [[3, 4, 5], [7, 8, 9, 10, 11], [2]]
    tokens, lengths = _pad(captions, 6)
    out = enc(tokens, lengths)
    assert out.shape == (3, 2 * H) and enc.output_dim == 2 * H
    gru = enc.gru
    for direction, suffix in enumerate(["", "_reverse"]):
        uni = nn.GRU(6, H, batch_first=True)
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(uni, f"{name}_l0").data.copy_(getattr(gru, f"{name}_l0{suffix}"))
        for i, cap in enumerate(captions):
            seq = torch.tensor(cap if direction == 0 else cap[::-1])
            _, h = uni(enc.embed(seq)[None])  # (1, 1, H)
            torch.testing.assert_close(out[i, direction * H : (direction + 1) * H], h[0, 0])


def test_backward_direction_depends_on_first_token():
    enc = _caption_encoder()
    tokens, lengths = _pad([[3, 4, 5, 6], [9, 4, 5, 6]], 4)
    out = enc(tokens, lengths)
    backward = out[:, H:]
    assert not torch.allclose(backward[0], backward[1], atol=1e-4)


@pytest.mark.parametrize("merge", ["concat", "mean"])
def test_caption_summary_is_invariant_to_padding(merge):
    enc = _caption_encoder(merge=merge, num_layers=2)
    captions = [[3, 4, 5], [7, 8, 9, 10], [2, 6]]
    short = enc(*_pad(captions, 5))
    long = enc(*_pad(captions, 9))
    torch.testing.assert_close(short, long)
    assert short.shape[1] == enc.output_dim == (2 * H if merge == "concat" else H)


def test_caption_encoder_pretrained_embeddings_and_freezing():
    vectors = torch.randn(20, 6)
    enc = GRUCaptionEncoder(20, embed_dim=6, hidden_dim=H, pretrained_embeddings=vectors)
    assert torch.equal(enc.embed.weight, vectors)
    enc.set_embeddings_trainable(False)
    enc(*_pad([[1, 2, 3]], 3)).sum().backward()
    assert enc.embed.weight.grad is None
    assert enc.gru.weight_hh_l0.grad is not None
    with pytest.raises(ConfigError, match="embed_dim"):
        GRUCaptionEncoder(20, embed_dim=7, pretrained_embeddings=vectors)


# --------------------------------------------------------------------------- heads, dual encoder


@pytest.mark.parametrize("hidden_dim", [None, 12])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_projection_head(hidden_dim, batchnorm):
    head = ProjectionHead(10, 7, hidden_dim=hidden_dim, batchnorm=batchnorm)
    out = head(torch.randn(4, 10))
    assert out.shape == (4, 7) and head.output_dim == 7
    linears = [m for m in head.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == (1 if hidden_dim is None else 2)
    assert all(m.bias is None for m in linears) == (hidden_dim is not None)
    assert any(isinstance(m, nn.BatchNorm1d) for m in head.modules()) == batchnorm


def _dual_encoder() -> DualEncoder:
    torch.manual_seed(0)
    image = IMAGE_ENCODERS.bind("small_cnn", output_dim=32, width=8)()
    text = GRUCaptionEncoder(20, embed_dim=6, hidden_dim=H)
    return DualEncoder(
        image,
        text,
        ProjectionHead(32, 16, hidden_dim=32, batchnorm=True),
        ProjectionHead(2 * H, 16),
    )


def _dual_batch():
    tokens, lengths = _pad([[1, 2, 3], [4, 5], [6, 7, 8, 9], [3]], 4)
    return _images(batch=4), tokens, lengths


def test_dual_encoder_outputs_unit_norm():
    model = _dual_encoder()
    img, cap = model(*_dual_batch())
    assert img.shape == cap.shape == (4, 16)
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(4))
    torch.testing.assert_close(cap.norm(dim=-1), torch.ones(4))


@pytest.mark.parametrize("trainable", [False, True])
def test_backbone_freezing_stops_backbone_and_embedding_gradients(trainable):
    model = _dual_encoder().train()
    model.set_backbone_trainable(trainable)
    img, cap = model(*_dual_batch())
    (img @ cap.T).diagonal().sum().backward()
    frozen = [*model.image_encoder.backbone.parameters(), model.caption_encoder.embed.weight]
    for p in frozen:
        assert (p.grad is not None) == trainable
    for module in (model.image_head, model.caption_head, model.caption_encoder.gru):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_dual_encoder_rejects_mismatched_heads():
    with pytest.raises(ValueError, match="16"):
        DualEncoder(nn.Identity(), nn.Identity(), ProjectionHead(4, 16), ProjectionHead(4, 8))
