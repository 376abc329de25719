"""Region features in exact integer arithmetic, from the detector's shipped weights.

Torch's float kernels (oneDNN's convolutions, MKL's matrix products, ATen's vectorised loops) take
other paths on another instruction set, CPU vendor or torch release, and round differently: the
same detector trained with ``ATEN_CPU_CAPABILITY`` set to ``default``, ``avx2`` or ``avx512`` had
three different sets of weights, and the same weights give features that differ in their last
bits. So the benchmark neither trains its detector nor computes a feature in rounded arithmetic:

- **weights**: each preset's detector (:data:`.detector.DETECTORS`) was trained once
  (:func:`.detector.train_detector`) and quantised (:func:`quantize`) as integer-only inference
  does (Jacob et al., CVPR 2018, Sec. 2): BatchNorm folded into its convolution, each output
  channel's weights to int8 with its own scale, biases to integers in the accumulator's units,
  every activation to an integer in ``[0, 2^15)`` with a power-of-two scale per layer, and each
  layer's rescaling to an integer multiplier and a right shift (their Eq. 5-6). The integers ship
  in ``detectors/<name>.npz``; :func:`shipped` checks the file's SHA-256 (:data:`SHA256`) before
  reading it; ``python -m icr.data.synthetic.retrain NAME`` trains and writes one again.
- **arithmetic**: every value the extractor computes is an integer. The convolutions and the
  fully connected layer multiply and add integers in float64 whose every product and partial sum
  stays below 2^53 (checked for any input when the weights load), so they are exact whatever the
  order of the sums, the BLAS, the instruction set or the thread count; a layer's accumulator goes
  to the next layer's units by ``(acc * M + 2^(S-1)) >> S`` in int64 (ReLU first, rounding half
  up, saturating at 2^15 - 1); RoIAlign samples the map at coordinates rounded to 1/256 of a map
  cell, with integer bilinear weights; a feature is the last layer's integer times 2^-k, exact
  in float32.

The only float arithmetic left is numpy's on the box coordinates (additions, multiplications and
rounding, IEEE 754 basic operations that every CPU rounds the same way), so the same pixels and
boxes give the same feature bytes on any machine.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from icr.data.synthetic.detector import DETECTORS, RegionDetector, roi_align
from icr.errors import DataError

logger = logging.getLogger(__name__)

DETECTOR_DIR = Path(__file__).resolve().parent / "detectors"
# SHA-256 of each shipped file: a file that does not match is refused (:func:`shipped`).
SHA256 = {
    "tiny": "a3e19f61edc829a5dfde891e123400e1fef7e9c2665670eb319503977e18dd01",
    "default": "8a44f8b9d4b19b18f369af41c7c75223ee413a5cb6b528ac371531958e63bfa7",
    "default-2048": "8afe005fd6c6dca0df6fa04c24f73b9f7d6f4662175e4b8e671e1f77f9a404f3",
}
WEIGHT_MAX = 127  # weights are int8, symmetric: [-127, 127] times their channel's scale
ACTIVATION_MAX = 2**15 - 1  # activations are integers in [0, ACTIVATION_MAX]
INPUT_MAX = 255  # the input: 2 * pixel - 255, odd integers in [-255, 255] (pixel / 255 - 0.5 = it / 510)
COORDINATE_BITS = 8  # RoIAlign's sample points in 1/256 of a map cell
MULTIPLIER_BITS = 24  # a layer's rescaling multipliers lie below 2^24
EXACT = 2**53  # float64 holds every integer of smaller magnitude exactly
INT64 = 2**63
_CHUNK = 32  # images per pass (memory only: an image's features do not depend on its chunk)


@dataclass(frozen=True)
class IntegerLayer:
    """A convolution (BatchNorm folded in) or the fully connected layer, in integers.

    With ``x`` the input in its integer units, ``acc = weight * x + bias`` (a convolution or a
    matrix product; exact), and the output, in the next layer's units, is
    ``min((relu(acc) * multiplier + 2^(shift - 1)) >> shift, ACTIVATION_MAX)`` per channel.
    """

    weight: np.ndarray  # (O, I, k, k) or (O, I) int8
    bias: np.ndarray  # (O,) int64, in the accumulator's units
    multiplier: np.ndarray  # (O,) int64, below 2^MULTIPLIER_BITS
    shift: int
    stride: int = 1

    def accumulator_bound(self, input_max: int) -> int:
        """The largest ``|acc|`` any input of magnitude at most ``input_max`` can give."""
        rows = np.abs(self.weight.reshape(len(self.weight), -1).astype(np.int64)).sum(1)  # (O,)
        return int((rows * input_max + np.abs(self.bias)).max())

    def check_exact(self, input_max: int, name: str) -> None:
        """Raise unless every accumulator is exact in float64 and its rescaling fits int64."""
        bound = self.accumulator_bound(input_max)
        if bound >= EXACT or bound * int(self.multiplier.max()) + (1 << self.shift) >= INT64 \
                or self.shift < 1:
            raise DataError(f"detector layer {name}: accumulators up to {bound} with multipliers "
                            f"up to {int(self.multiplier.max())} >> {self.shift} are not exact; "
                            "the weights file is damaged or was quantised wrongly")

    def rescale(self, acc: torch.Tensor, channel_dim: int) -> torch.Tensor:
        """ReLU, then the accumulator (int64) in the next layer's units, rounded half up."""
        shape = [1] * acc.dim()
        shape[channel_dim] = -1
        multiplier = torch.from_numpy(self.multiplier).view(shape)
        out = (acc.clamp_min(0) * multiplier + (1 << (self.shift - 1))) >> self.shift
        return out.clamp_max(ACTIVATION_MAX)


def _accumulate(x: torch.Tensor, layer: IntegerLayer) -> torch.Tensor:
    """``weight * x + bias`` of integer tensors, exact (every partial sum below 2^53): int64."""
    weight = torch.from_numpy(layer.weight).to(torch.float64)
    bias = torch.from_numpy(layer.bias)
    if weight.dim() == 4:  # (N, I, H, W) -> (N, O, H', W')
        acc = F.conv2d(x.to(torch.float64), weight, stride=layer.stride, padding=weight.shape[-1] // 2)
        return acc.to(torch.int64) + bias.view(1, -1, 1, 1)
    return (x.to(torch.float64) @ weight.T).to(torch.int64) + bias  # (..., I) -> (..., O)


def sample_points(lo: np.ndarray, hi: np.ndarray, cells: int, map_size: int, image_size: int
                  ) -> np.ndarray:
    """RoIAlign's sample coordinates along one axis, in 1/2^COORDINATE_BITS of a map cell.

    ``lo``, ``hi``: ``(N, R)`` box edges in pixels, inside the image. Cell ``i``'s centre
    ``lo + (hi - lo) (i + 1/2) / cells`` is at map coordinate ``pixel * map_size / image_size -
    1/2`` (map cell ``j`` covers ``[j, j + 1)`` there, its centre at ``j + 1/2``: grid_sample's
    ``align_corners=False``). Returns ``(N, R, cells)`` int64 in ``[-2^(q-1), (map_size - 1/2) 2^q]``.
    """
    t = (np.arange(cells, dtype=np.float64) + 0.5) / cells  # (cells,)
    lo, hi = lo.astype(np.float64)[..., None], hi.astype(np.float64)[..., None]  # (N, R, 1)
    pixel = lo + (hi - lo) * t  # (N, R, cells)
    coordinate = pixel * (map_size / image_size) - 0.5
    fixed = np.floor(coordinate * 2**COORDINATE_BITS + 0.5).astype(np.int64)
    half = 1 << (COORDINATE_BITS - 1)
    return np.clip(fixed, -half, (map_size << COORDINATE_BITS) - half)


def integer_roi_align(fmap: torch.Tensor, boxes: np.ndarray, image_size: int, cells: int
                      ) -> torch.Tensor:
    """Bilinear RoIAlign of an integer map (:func:`.detector.roi_align` in integers).

    Args:
        fmap: ``(N, C, h, w)`` int64, zero outside (as grid_sample's zero padding).
        boxes: ``(N, R, 4)`` xyxy pixel boxes inside the image.

    Returns:
        ``(N, R, C * cells * cells)`` int64: each sample's four neighbours weighted by integers
        summing to 2^(2q), rounded back to the map's units (half up).
    """
    n, c, h, w = fmap.shape
    r = boxes.shape[1]
    q, one = COORDINATE_BITS, 1 << COORDINATE_BITS
    xs = sample_points(boxes[..., 0], boxes[..., 2], cells, w, image_size)  # (N, R, cells)
    ys = sample_points(boxes[..., 1], boxes[..., 3], cells, h, image_size)
    padded = F.pad(fmap, (1, 1, 1, 1)).flatten(2)  # (N, C, (h + 2) * (w + 2))
    width = w + 2
    col, fx = xs >> q, xs & (one - 1)  # floor and fraction; col in [-1, w - 1]
    row, fy = ys >> q, ys & (one - 1)
    index = (row[:, :, :, None] + 1) * width + (col[:, :, None, :] + 1)  # (N, R, cells, cells)
    total = torch.zeros(n, c, r * cells * cells, dtype=torch.int64)
    for dy, wy in ((0, one - fy), (1, fy)):
        for dx, wx in ((0, one - fx), (1, fx)):
            at = torch.from_numpy((index + dy * width + dx).reshape(n, 1, -1))  # (N, 1, P)
            weight = torch.from_numpy((wy[:, :, :, None] * wx[:, :, None, :]).reshape(n, 1, -1))
            total += padded.gather(2, at.expand(n, c, -1)) * weight  # (N, C, P)
    pooled = (total + (1 << (2 * q - 1))) >> (2 * q)  # (N, C, R * cells * cells)
    pooled = pooled.view(n, c, r, cells * cells).transpose(1, 2)  # (N, R, C, cells * cells)
    return pooled.reshape(n, r, c * cells * cells)


@dataclass(frozen=True)
class ExactExtractor:
    """The benchmark's region feature extractor: the detector's backbone, RoIAlign and feature
    layer in integers (module docstring).

    Attributes:
        name: the detector's name (:data:`.detector.DETECTORS`).
        convs, fc: the layers; ``fc`` maps the pooled map to the feature.
        cells: RoIAlign cells per side.
        image_size: the images' side in pixels.
        feature_exponent: ``k``; a feature is its integer times ``2^-k``.
        accuracy: the detector's heads on held-out scenes, reading these features.
        trained_with: where the weights were trained (torch, instruction set).
        digest: SHA-256 of the file the weights were read from (empty if not read from one).
    """

    name: str
    convs: tuple[IntegerLayer, ...]
    fc: IntegerLayer
    cells: int
    image_size: int
    feature_exponent: int
    accuracy: dict[str, float] = field(default_factory=dict)
    trained_with: dict[str, str] = field(default_factory=dict)
    digest: str = ""

    def __post_init__(self) -> None:
        bound = INPUT_MAX
        for i, layer in enumerate(self.convs):
            layer.check_exact(bound, f"conv{i}")
            bound = ACTIVATION_MAX
        self.fc.check_exact(ACTIVATION_MAX, "fc")

    @property
    def feature_dim(self) -> int:
        return len(self.fc.weight)

    def feature_map(self, pixels: np.ndarray) -> torch.Tensor:
        """``(N, H, W, 3)`` uint8 images -> the backbone's ``(N, C, h, w)`` int64 map."""
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).to(torch.int64) * 2 - 255  # (N, 3, H, W)
        for layer in self.convs:
            x = layer.rescale(_accumulate(x, layer), channel_dim=1)  # (N, C, h, w)
        return x

    def integer_features(self, pixels: np.ndarray, boxes: np.ndarray) -> torch.Tensor:
        """``(N, H, W, 3)`` uint8 images and ``(N, R, 4)`` boxes -> ``(N, R, D)`` int64."""
        pooled = integer_roi_align(self.feature_map(pixels), boxes, self.image_size, self.cells)
        return self.fc.rescale(_accumulate(pooled, self.fc), channel_dim=-1)  # (N, R, D)

    def features(self, pixels: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """``(N, H, W, 3)`` uint8 images and their ``(N, R, 4)`` boxes -> ``(N, R, D)`` float32,
        the same bytes on every machine, however the images are split."""
        n, r = boxes.shape[:2]
        out = np.empty((n, r, self.feature_dim), dtype=np.float32)
        scale = 2.0 ** -self.feature_exponent  # a power of two: exact
        for start in range(0, n, _CHUNK):
            part = slice(start, min(start + _CHUNK, n))
            out[part] = (self.integer_features(pixels[part], boxes[part]).to(torch.float32)
                         * scale).numpy()
        return out

    def describe(self) -> dict:
        """What the benchmark's manifest records of it (as read back from JSON; the same on every
        machine)."""
        return json.loads(json.dumps({"name": self.name, "spec": asdict(DETECTORS[self.name]),
                "weights": f"icr/data/synthetic/detectors/{self.name}.npz",
                "weights_sha256": self.digest, "heads_held_out_accuracy": self.accuracy,
                "trained_with": self.trained_with,
                "arithmetic": f"integer: int8 weights, {ACTIVATION_MAX.bit_length()}-bit "
                              f"activations, RoIAlign at 1/{1 << COORDINATE_BITS} of a map cell"}))


# ------------------------------------------------------------------------------ quantisation


def _folded(detector: RegionDetector) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The backbone's (Conv, BatchNorm, ReLU) triples as float64 ``(weight, bias, stride)``, each
    BatchNorm's running statistics folded into its convolution (eval mode)."""
    modules = list(detector.backbone)
    out = []
    with torch.no_grad():
        for conv, norm in zip(modules[0::3], modules[1::3], strict=True):
            scale = norm.weight.double() / torch.sqrt(norm.running_var.double() + norm.eps)  # (O,)
            weight = conv.weight.double() * scale.view(-1, 1, 1, 1)  # (O, I, k, k)
            bias = norm.bias.double() - norm.running_mean.double() * scale  # (O,)
            out.append((weight.numpy(), bias.numpy(), conv.stride[0]))
    return out


def _power_of_two_scale(largest: float) -> float:
    """The smallest power of two ``s`` with ``largest / s <= ACTIVATION_MAX``."""
    return float(2.0 ** np.ceil(np.log2(max(largest, 1e-12) / ACTIVATION_MAX)))


def integer_layer(weight: np.ndarray, bias: np.ndarray, input_scale: float, output_scale: float,
                  stride: int = 1) -> IntegerLayer:
    """Quantise one float layer (``weight`` ``(O, ...)``, ``bias`` ``(O,)``) whose input is an
    integer times ``input_scale`` and whose output is to be one times ``output_scale``."""
    rows = np.abs(weight.reshape(len(weight), -1)).max(1)  # (O,)
    # each channel's weight scale (a channel whose weights are all 0 takes the largest)
    channel = np.where(rows > 0, rows, rows.max() if rows.max() > 0 else 1.0) / WEIGHT_MAX
    expand = (-1,) + (1,) * (weight.ndim - 1)
    q_weight = np.rint(weight / channel.reshape(expand)).astype(np.int8)
    q_bias = np.rint(bias / (input_scale * channel)).astype(np.int64)
    ratio = input_scale * channel / output_scale  # (O,) accumulator units -> output units
    shift = MULTIPLIER_BITS - 1 - int(np.floor(np.log2(ratio.max())))
    multiplier = np.rint(ratio * 2.0**shift).astype(np.int64)
    return IntegerLayer(q_weight, q_bias, multiplier, shift, stride)


def quantize(detector: RegionDetector, pixels: np.ndarray, boxes: np.ndarray, name: str
             ) -> ExactExtractor:
    """The integer extractor of a trained detector; each layer's activation scale is the power
    of two that holds the largest activation of the float network (BatchNorm folded, float64) on
    the calibration ``pixels`` ``(N, H, W, 3)`` and ``boxes`` ``(N, R, 4)``."""
    detector.eval()
    folded = _folded(detector)
    with torch.no_grad():
        x = torch.from_numpy(pixels).permute(0, 3, 1, 2).double() / 255.0 - 0.5  # (N, 3, H, W)
        largest = []
        for weight, bias, stride in folded:
            x = F.relu(F.conv2d(x, torch.from_numpy(weight), torch.from_numpy(bias), stride,
                                padding=weight.shape[-1] // 2))  # (N, C, h, w)
            largest.append(float(x.max()))
        pooled = roi_align(x, torch.from_numpy(boxes).double(), detector.image_size,
                           detector.cells)  # (N, R, C, s, s)
        fc_weight = detector.fc.weight.detach().double().numpy()  # (D, C * s * s)
        fc_bias = detector.fc.bias.detach().double().numpy()
        feature = F.relu(pooled.flatten(2) @ torch.from_numpy(fc_weight).T + torch.from_numpy(fc_bias))
    scale, convs = 1.0 / (2 * INPUT_MAX), []
    for (weight, bias, stride), top in zip(folded, largest, strict=True):
        output = _power_of_two_scale(top)
        convs.append(integer_layer(weight, bias, scale, output, stride))
        scale = output
    output = _power_of_two_scale(float(feature.max()))
    fc = integer_layer(fc_weight, fc_bias, scale, output)
    return ExactExtractor(name, tuple(convs), fc, detector.cells, detector.image_size,
                          int(round(-np.log2(output))))


# ------------------------------------------------------------------------------ shipped files


def _arrays(extractor: ExactExtractor) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for prefix, layer in [*((f"conv{i}", c) for i, c in enumerate(extractor.convs)), ("fc", extractor.fc)]:
        arrays.update({f"{prefix}.weight": layer.weight, f"{prefix}.bias": layer.bias,
                       f"{prefix}.multiplier": layer.multiplier,
                       f"{prefix}.shift": np.array(layer.shift, dtype=np.int64),
                       f"{prefix}.stride": np.array(layer.stride, dtype=np.int64)})
    meta = {"name": extractor.name, "cells": extractor.cells, "image_size": extractor.image_size,
            "feature_exponent": extractor.feature_exponent, "accuracy": extractor.accuracy,
            "trained_with": extractor.trained_with, "convs": len(extractor.convs)}
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    return arrays


def to_bytes(extractor: ExactExtractor) -> bytes:
    """The ``.npz`` file of an extractor: a zip of ``.npy`` arrays (``np.load`` reads it without
    pickle), its members sorted and dated 1980-01-01, so equal weights give equal bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in sorted(_arrays(extractor).items()):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            archive.writestr(info, member.getvalue(), compresslevel=9)
    return buffer.getvalue()


def from_bytes(data: bytes, digest: str = "") -> ExactExtractor:
    """Read :func:`to_bytes`' file back (its integrity is the caller's: :func:`shipped`)."""
    with np.load(io.BytesIO(data), allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(str(arrays["meta"]))

    def layer(prefix: str) -> IntegerLayer:
        return IntegerLayer(arrays[f"{prefix}.weight"], arrays[f"{prefix}.bias"],
                            arrays[f"{prefix}.multiplier"], int(arrays[f"{prefix}.shift"]),
                            int(arrays[f"{prefix}.stride"]))

    return ExactExtractor(meta["name"], tuple(layer(f"conv{i}") for i in range(meta["convs"])),
                          layer("fc"), meta["cells"], meta["image_size"], meta["feature_exponent"],
                          meta["accuracy"], meta["trained_with"], digest)


@functools.lru_cache(maxsize=4)
def shipped(name: str) -> ExactExtractor:
    """The shipped extractor ``name``, its file checked against :data:`SHA256` first.

    Raises:
        DataError: an unknown name, or the file is missing or not the one shipped.
    """
    if name not in SHA256:
        raise DataError(f"no shipped detector {name!r}; valid: {', '.join(SHA256)}")
    path = DETECTOR_DIR / f"{name}.npz"
    retrain = f"`python -m icr.data.synthetic.retrain {name}`"
    if not path.is_file():
        raise DataError(f"{path}: not found; reinstall icr-studies (the file ships with it), or "
                        f"retrain it with {retrain}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256[name]:
        raise DataError(f"{path}: SHA-256 {digest} is not the shipped {SHA256[name] or '(none)'}; "
                        f"reinstall icr-studies, or after retraining it with {retrain} set "
                        f"SHA256[{name!r}] in {Path(__file__).name} to the new file's")
    return from_bytes(data, digest)
