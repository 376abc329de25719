"""EfficientNet-Lite0: strict loading of the real ImageNet weights, shapes, TensorFlow padding,
the pretrained classifier on synthetic patterns, and a frozen backbone's BatchNorm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from icr.errors import ConfigError
from icr.models.efficientnet import (
    EfficientNetLite0,
    SameConv2d,
    lite0_weights_file,
    load_lite0_weights,
    normalize,
)
from icr.models.image import IMAGE_ENCODERS

SIZE = 224


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return torch.load(lite0_weights_file(), map_location="cpu", weights_only=True)


def efficientnet_lite0_classifier(*, pretrained: bool = True) -> EfficientNetLite0:
    """The ImageNet classifier (1000 classes) of the shipped weights, to check them
    (:meth:`EfficientNetLite0.logits`)."""
    model = EfficientNetLite0(num_classes=1000)
    if pretrained:
        load_lite0_weights(model, lite0_weights_file())
    return model


@pytest.fixture(scope="module")
def classifier() -> EfficientNetLite0:
    return efficientnet_lite0_classifier().eval()


def _rings(cx: int, cy: int, width: int) -> torch.Tensor:
    """Black and white concentric rings (3, 224, 224) in [0, 1]."""
    yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    radius = ((xx - cx) ** 2 + (yy - cy) ** 2).float().sqrt()
    return ((radius // width) % 2).expand(3, SIZE, SIZE)


def _patterns() -> torch.Tensor:
    """Checkerboard, stripes, a red disk on white, rings: (4, 3, 224, 224)."""
    yy, xx = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    disk = ((xx - 112) ** 2 + (yy - 112) ** 2 < 70**2).float()
    return torch.stack(
        [
            (((yy // 28) + (xx // 28)) % 2).float().expand(3, SIZE, SIZE),
            ((xx // 16) % 2).float().expand(3, SIZE, SIZE),
            torch.stack([torch.ones(SIZE, SIZE), 1 - disk, 1 - disk]),
            _rings(112, 112, 12),
        ]
    )


# ---------------------------------------------------------------- weights and shapes


def test_real_weights_load_strictly(weights):
    assert len(weights) == 296
    model = EfficientNetLite0(num_classes=1000)
    assert set(model.state_dict()) == set(weights)
    load_lite0_weights(model, lite0_weights_file())
    torch.testing.assert_close(
        model._blocks[15]._project_conv.weight, weights["_blocks.15._project_conv.weight"]
    )
    encoder = IMAGE_ENCODERS.bind("efficientnet_lite0")()  # default: pretrained
    assert set(encoder.backbone.state_dict()) == {k for k in weights if not k.startswith("_fc.")}
    torch.testing.assert_close(encoder.backbone._conv_head.weight, weights["_conv_head.weight"])


def test_weights_that_do_not_fit_raise_one_line(tmp_path, weights):
    broken = dict(weights)
    broken.pop("_blocks.3._bn1.running_var")
    path = tmp_path / "broken.pth"
    torch.save(broken, path)
    with pytest.raises(ConfigError, match="do not fit EfficientNet-Lite0.*running_var"):
        IMAGE_ENCODERS.bind("efficientnet_lite0", weights_path=str(path))()
    with pytest.raises(ConfigError, match="does not exist"):
        IMAGE_ENCODERS.bind("efficientnet_lite0", weights_path=str(tmp_path / "missing.pth"))()


def test_encoder_output_shape():
    assert IMAGE_ENCODERS.meta("efficientnet_lite0")["input"] == "pixels"
    encoder = IMAGE_ENCODERS.bind("efficientnet_lite0", pretrained=False)().eval()
    assert encoder.output_dim == 1280
    assert encoder.backbone(torch.rand(2, 3, 64, 64)).shape == (2, 1280, 2, 2)
    out = encoder(normalize(torch.rand(2, 3, 64, 64)))
    assert out.shape == (2, 1280) and torch.isfinite(out).all()


@pytest.mark.parametrize("size", [7, 8])
@pytest.mark.parametrize("kernel", [1, 3, 5])
@pytest.mark.parametrize("stride", [1, 2])
def test_same_padding_like_tensorflow(size, kernel, stride):
    # TF SAME: output ceil(size / stride); total padding (out - 1) * stride + k - size, the odd
    # pixel at the bottom / right
    conv = SameConv2d(2, 3, kernel, stride=stride)
    x = torch.randn(1, 2, size, size)
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    pads = [total // 2, total - total // 2] * 2
    want = F.conv2d(F.pad(x, pads), conv.weight, stride=stride)
    got = conv(x)
    assert got.shape[-2:] == (out, out)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the ImageNet classifier


def test_real_weights_recognise_rings_as_a_maze_flipped_or_not(classifier):
    # concentric rings are the textbook "maze" (ImageNet class 646) of CNN visualisations; an
    # off-centre, mirrored copy must give the same answer with high probability
    images = torch.stack([_rings(90, 120, 10), _rings(90, 120, 10).flip(-1)])
    with torch.no_grad():
        probs = classifier.logits(normalize(images)).softmax(1)  # (2, 1000)
    assert probs.argmax(1).tolist() == [646, 646]
    assert (probs[:, 646] > 0.3).all()


def test_real_weights_tell_patterns_apart_random_ones_do_not(classifier):
    torch.manual_seed(0)
    random_init = efficientnet_lite0_classifier(pretrained=False).eval()
    with torch.no_grad():
        real = classifier.logits(normalize(_patterns())).softmax(1)  # (4, 1000)
        rand = random_init.logits(normalize(_patterns())).softmax(1)
    assert len(set(real.argmax(1).tolist())) >= 3  # checkerboard, stripes, disk, rings differ
    assert real.max(1).values.max() > 0.3
    assert rand.max(1).values.max() < 0.01  # near uniform over 1000 classes


# ---------------------------------------------------------------- freezing


def test_frozen_backbone_keeps_batchnorm_statistics():
    torch.manual_seed(1)
    encoder = IMAGE_ENCODERS.bind("efficientnet_lite0", pretrained=False, drop_connect_rate=0.2)()
    images = normalize(torch.rand(2, 3, 32, 32))
    before = {k: v.clone() for k, v in encoder.state_dict().items() if "running" in k}
    encoder.set_backbone_trainable(False)
    encoder.train()
    first, second = encoder(images), encoder(images)
    after = {k: v for k, v in encoder.state_dict().items() if "running" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # no stochastic depth either
    assert not any(p.requires_grad for p in encoder.backbone.parameters())

    encoder.set_backbone_trainable(True)
    encoder.train()
    encoder(images)
    changed = encoder.state_dict()["backbone._bn0.running_mean"]
    assert not torch.equal(changed, before["backbone._bn0.running_mean"])


# ---------------------------------------------------------------- the frozen-feature cache


def _small_images(n: int = 5, size: int = 32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=g, dtype=torch.uint8)


def test_feature_cache_computes_once_in_eval_mode(tmp_path, monkeypatch):
    from icr.data import features as features_module

    torch.manual_seed(2)
    encoder = IMAGE_ENCODERS.bind("efficientnet_lite0", pretrained=False)()
    encoder.train()
    images = _small_images()
    got = features_module.cached_backbone_features(
        encoder, images, normalize, tmp_path, "efficientnet_lite0", batch_size=2
    )
    assert encoder.training  # mode restored
    with torch.no_grad():
        want = encoder.eval()(normalize(images.float() / 255.0))
    encoder.train()
    torch.testing.assert_close(got, want)  # batches of 2 = one batch of 5, eval statistics
    assert len(list(tmp_path.glob("backbone_features_*.npy"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("recomputed despite a cache hit")

    monkeypatch.setattr(features_module, "compute_backbone_features", fail)
    again = features_module.cached_backbone_features(
        encoder, images, normalize, tmp_path, "efficientnet_lite0"
    )
    torch.testing.assert_close(again, got, rtol=0, atol=0)


def test_feature_cache_key_follows_weights_images_and_resolution(tmp_path):
    from icr.data.features import cache_key, feature_cache_path

    torch.manual_seed(3)
    encoder = IMAGE_ENCODERS.bind("efficientnet_lite0", pretrained=False)()
    images = _small_images()
    key = cache_key(encoder, images, normalize, "a")
    assert key == cache_key(encoder, images.clone(), normalize, "a")  # content, not identity
    changed_images = images.clone()
    changed_images[0, 0, 0, 0] ^= 1
    others = [
        cache_key(encoder, changed_images, normalize, "a"),
        cache_key(encoder, _small_images(size=48), normalize, "a"),  # resolution
        cache_key(encoder, images, normalize, "b"),
        cache_key(encoder, images, lambda x: x, "a"),
    ]
    with torch.no_grad():
        encoder.backbone._bn1.running_mean[0] += 1e-3  # statistics are part of the weights
    others.append(cache_key(encoder, images, normalize, "a"))
    assert len({key, *others}) == 1 + len(others)
    assert feature_cache_path(tmp_path, key).parent == tmp_path
    assert feature_cache_path(tmp_path / "lite0.npy", key).name == f"lite0_{key[:20]}.npy"
