"""Image encoders: a CNN backbone followed by global average pooling, one vector per image.

Builders are registered by name in :data:`IMAGE_ENCODERS` and take plain keyword arguments:

- ``resnet50`` / ``resnet18``: torchvision ResNets without ``avgpool`` and ``fc``; the last feature
  map (2048 / 512 channels, 7x7 at 224 px) is average-pooled. This is the image side of the PCME /
  LTD baseline (docs/reference-code.md section 1).
- ``small_cnn``: four conv blocks with BatchNorm (about 0.4M parameters at the defaults), sized for
  the 64x64 "shapes world" images on CPU.

Encoders of precomputed region features (``regions``, ``region_tokens``, ``vsrn``) live in
:mod:`icr.models.tokens` and :mod:`icr.models.vsrn`; EfficientNet-Lite0 in
:mod:`icr.models.efficientnet`.

Pretrained weights are never downloaded. They come from ``weights_path`` or from the local torch hub
cache (``torch.hub.get_dir()/checkpoints/<torchvision file name>``); when neither exists the builder
raises a one-line :class:`~icr.errors.ConfigError` naming where it looked and the fix.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from icr.config import ImageConfig
from icr.errors import ConfigError
from icr.registry import Registry

logger = logging.getLogger(__name__)

__all__ = ["IMAGE_ENCODERS", "PIXEL_READS", "ImageEncoder", "SmallCNN"]

# What a run of an encoder of pixels reads beyond its builder's options: the trainer freezes its
# backbone (``image.frozen``) and the data pipeline erases patches of its training images
# (``image.random_erasing``). Encoders of precomputed regions have neither, so their runs do not
# record these keys (:func:`icr.config.used_keys`).
PIXEL_READS = ("image.frozen", "image.random_erasing")


class ImageEncoder(nn.Module):
    """A convolutional backbone followed by global average pooling.

    Args:
        backbone: maps images to a feature map with ``output_dim`` channels.
        output_dim: number of channels of the backbone's last feature map.

    Shapes:
        images (B, 3, H, W) -> features (B, output_dim).

    Freezing (the warm-up phase of the LTD recipe): ``set_backbone_trainable(False)`` turns off the
    gradients of every backbone parameter *and* keeps the backbone's BatchNorm layers in eval mode for
    as long as it is frozen, even when ``.train()`` is called on the model that contains it: a frozen
    backbone is then a fixed feature extractor whose running statistics do not drift. The PCME / LTD
    reference only sets ``requires_grad = False``, so its BatchNorm statistics keep updating during
    the warm-up; this is a deliberate difference.
    """

    def __init__(self, backbone: nn.Module, output_dim: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.output_dim = output_dim
        self.backbone_trainable = True

    reads_regions = False  # reads pixels (data.features=pixels)

    def forward(self, images: Tensor) -> Tensor:
        fmap = self.backbone(images)  # (B, C, h, w)
        return self.pool(fmap).flatten(1)  # (B, C)

    def set_backbone_trainable(self, flag: bool) -> None:
        """Freeze (``False``) or unfreeze (``True``) the backbone; see the class docstring."""
        self.backbone_trainable = flag
        for param in self.backbone.parameters():
            param.requires_grad_(flag)
        self.train(self.training)  # re-apply the BatchNorm mode for the new state

    def train(self, mode: bool = True) -> ImageEncoder:
        super().train(mode)
        if not self.backbone_trainable:
            for module in self.backbone.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self


IMAGE_ENCODERS: Registry[Callable[..., nn.Module]] = Registry(
    "image encoder", section=ImageConfig, package="icr.models"
)


# --------------------------------------------------------------------------- weights


def _fix(arch: str) -> str:
    return (
        f"set image.weights_path=/path/to/{arch}.pth (a local state dict) or image.pretrained=false"
    )


def _resolve_weights(arch: str, weights_path: str | None, hub_file_names: Sequence[str]) -> Path:
    """Return a local weights file for ``arch``; never downloads."""
    if weights_path is not None:
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"image.weights_path={weights_path!r} does not exist; {_fix(arch)}")
        return path
    ckpt_dir = Path(torch.hub.get_dir()) / "checkpoints"
    for file_name in hub_file_names:
        if (ckpt_dir / file_name).is_file():
            return ckpt_dir / file_name
    looked = f"{', '.join(hub_file_names)} in {ckpt_dir}" if hub_file_names else "nowhere"
    raise ConfigError(
        f"pretrained {arch} weights not found (image.weights_path is unset; looked for "
        f"{looked}; weights are never downloaded); {_fix(arch)}"
    )


def _load_backbone(backbone: nn.Module, path: Path, arch: str) -> None:
    """Load a state dict into ``backbone``.

    Accepts a torchvision state dict (its ``fc.*`` entries are dropped), a ``{"state_dict": ...}``
    checkpoint, or the state dict of an :class:`ImageEncoder` (``backbone.`` prefix stripped).
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable or not a tensor pickle
        raise ConfigError(f"cannot read {arch} weights {path}: {exc}; {_fix(arch)}") from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"{path} does not hold a state dict; {_fix(arch)}")
    state = {
        key.removeprefix("module.").removeprefix("backbone."): value
        for key, value in state.items()
        if not key.startswith("fc.")
    }
    try:
        backbone.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()
        detail = " ".join(line.strip() for line in first[:2])[:300]
        raise ConfigError(f"weights {path} do not fit {arch}: {detail}; {_fix(arch)}") from exc
    logger.info("loaded %s weights from %s", arch, path)


def maybe_load_weights(
    backbone: nn.Module,
    arch: str,
    pretrained: bool,
    weights_path: str | None,
    hub_file_names: Sequence[str] = (),
) -> None:
    weights_path = weights_path or None  # '' (the config default) means "not given"
    if not pretrained:
        if weights_path is not None:
            logger.warning(
                "image.weights_path=%s is ignored: image.pretrained is false", weights_path
            )
        return
    _load_backbone(backbone, _resolve_weights(arch, weights_path, hub_file_names), arch)


# --------------------------------------------------------------------------- ResNets


def _resnet(arch: str, weights: str, pretrained: bool, weights_path: str | None) -> ImageEncoder:
    # Importing torchvision imports all of it, torch._dynamo included (1.5 to 3.9 CPU seconds a
    # process on 2 cores, benchmarks/process_start.py), which every trial's process and command
    # line paid before.
    import torchvision.models as models  # lazy: only a process that builds a ResNet pays it

    net = getattr(models, arch)(weights=None)
    weights_enum = getattr(models, weights)
    output_dim = net.fc.in_features
    # Keep torchvision's module names so a torchvision state dict loads into the backbone directly.
    children = [(name, m) for name, m in net.named_children() if name not in ("avgpool", "fc")]
    backbone = nn.Sequential(OrderedDict(children))
    hub_file_names = [Path(urlparse(w.url).path).name for w in weights_enum]
    maybe_load_weights(backbone, arch, pretrained, weights_path, hub_file_names)
    return ImageEncoder(backbone, output_dim)


@IMAGE_ENCODERS.register("resnet50", input="pixels", reads=PIXEL_READS)
def resnet50(*, pretrained: bool = False, weights_path: str | None = None) -> ImageEncoder:
    """ResNet-50 without fc, average-pooled: (B, 3, H, W) -> (B, 2048)."""
    return _resnet("resnet50", "ResNet50_Weights", pretrained, weights_path)


@IMAGE_ENCODERS.register("resnet18", input="pixels", reads=PIXEL_READS)
def resnet18(*, pretrained: bool = False, weights_path: str | None = None) -> ImageEncoder:
    """ResNet-18 without fc, average-pooled: (B, 3, H, W) -> (B, 512)."""
    return _resnet("resnet18", "ResNet18_Weights", pretrained, weights_path)


# --------------------------------------------------------------------------- small CNN


def _conv_block(c_in: int, c_out: int, downsample: bool) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),  # BN supplies the bias
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]
    if downsample:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class AddCoords(nn.Module):
    """Append two channels holding each pixel's x and y in [-1, 1] (CoordConv, Liu et al. 2018).

    Global average pooling discards where things are; the coordinate channels let the features
    themselves encode position, which captions of the embedded benchmark talk about.

    Shapes:
        (B, C, H, W) -> (B, C + 2, H, W).
    """

    def forward(self, x: Tensor) -> Tensor:
        b, _, h, w = x.shape
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")  # (H, W) each
        coords = torch.stack([grid_x, grid_y]).expand(b, 2, h, w)  # (B, 2, H, W)
        return torch.cat([x, coords], dim=1)


class SmallCNN(nn.Sequential):
    """Coordinate channels, then four 3x3 conv blocks (Conv, BatchNorm, ReLU), 2x max-pool after
    the first three.

    Channels ``width, 2 width, 4 width, output_dim``; at the defaults (32, 256) about 0.39M
    parameters and about 60M multiply-adds per 64x64 image.

    Shapes:
        images (B, 3, 64, 64) -> feature map (B, output_dim, 8, 8).
    """

    def __init__(self, output_dim: int = 256, width: int = 32) -> None:
        channels = [3 + 2, width, 2 * width, 4 * width, output_dim]
        blocks = [_conv_block(channels[i], channels[i + 1], downsample=i < 3) for i in range(4)]
        super().__init__(AddCoords(), *blocks)


@IMAGE_ENCODERS.register("small_cnn", input="pixels", reads=PIXEL_READS)
def small_cnn(
    *,
    output_dim: int = 256,
    width: int = 32,
    pretrained: bool = False,
    weights_path: str | None = None,
) -> ImageEncoder:
    """A small CNN for 64x64 images on CPU: (B, 3, H, W) -> (B, output_dim).

    There are no published weights; ``pretrained=True`` needs ``weights_path`` (a state dict of this
    encoder or of its backbone, e.g. from an earlier run).
    """
    backbone = SmallCNN(output_dim=output_dim, width=width)
    maybe_load_weights(backbone, "small_cnn", pretrained, weights_path)
    return ImageEncoder(backbone, output_dim)
