"""Region features made the way BUTD's are: a small detector trained once, its penultimate layer.

BUTD's region features (Anderson et al., CVPR 2018, Sec. 3.1) are the output of a Faster R-CNN
trained on Visual Genome to classify each box's object (1,600 classes) and its attributes (400):
the mean-pooled last block of a ResNet-101 over the box, the layer the classifiers read, so that a
linear layer reads a region's object and attributes from it. SCAN, VSRN, VSE-infinity and the
grounding paper train on those features of COCO and Flickr30K images, which the detector never saw.

The shapes world's detector does the same at its scale:

- **network** (:class:`RegionDetector`): a convolutional backbone over the whole image (96 x 96 to
  a 24 x 24 map, stride 4), each box's RoIAlign of the map (bilinear, ``roi x roi`` cells; He et
  al., ICCV 2017), one fully connected layer with a ReLU: the region's feature (``D``, BUTD's
  pooled 2048-d layer; non-negative, as BUTD's are), read by linear heads that classify the box's
  object (13 shapes, plus *background* for a box that detects no object, as a detector's classifier
  has) and its colour, size and texture; a box of the background (a "stuff" region, as Visual
  Genome's "sky" with its attribute "blue") its colour (the background's hue) and tone. A box sees
  its context through the backbone's receptive field, and its absolute scale through the map's
  fixed resolution, as a detector's RoI does.
- **training** (:func:`train_detector`): scenes of the world's distribution from the detector's
  own seed stream (:data:`DETECTOR_SEED`), never a benchmark's images, with proposals made as the
  benchmark's (:func:`.regions.region_boxes`); cross-entropy of every head (the attributes on the
  boxes that detect an object), Adam with a one-cycle schedule, in one thread; its heads are
  scored on held-out scenes of another stream.

Training runs torch's float kernels, which round differently on another instruction set or torch
release, so the benchmark does not train its detector: each preset's detector (:data:`DETECTORS`)
was trained once and ships with the package in integer form, and the features are computed from
it in exact integer arithmetic (:mod:`.extractor`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from icr.data.synthetic.lexicon import SHAPES
from icr.data.synthetic.regions import STUFF_COVERAGE, object_coverage, region_boxes
from icr.data.synthetic.render import render_scene
from icr.data.synthetic.world import COLOURS, SIZES, TEXTURES, TONES, sample_scene

logger = logging.getLogger(__name__)

DETECTOR_SEED = 20_251_129  # the detector's own scenes and weights: never a benchmark's stream
HEADS = {  # head -> its classes; "shape" has one more, background (a box that detects no object)
    "shape": (*SHAPES, "background"),
    "colour": tuple(COLOURS),  # an object's colour, or a stuff box's background hue
    "size": SIZES,
    "texture": TEXTURES,
    "tone": TONES,  # a stuff box's background tone
}
OBJECT_HEADS = ("shape", "colour", "size", "texture")  # what an object's box is labelled with
COLUMN = {name: k for k, name in enumerate(HEADS)}  # a head's column in the labels
BACKGROUND = len(SHAPES)  # the background class of the shape head
IGNORE = -1  # a label a box does not have (an object's tone, a part's colour): no loss
_CHUNK = 64  # images per forward pass when scoring the heads


@dataclass(frozen=True)
class DetectorSpec:
    """The detector's definition: architecture, training data and schedule.

    Attributes:
        feature_dim: ``D``, the region feature (BUTD: 2048).
        channels: output channels of the backbone's convolutions (3 x 3, each BatchNorm + ReLU).
        strides: their strides (the product is the map's stride; 4 with 96 x 96 images).
        roi: RoIAlign cells per side.
        scenes: training scenes; ``eval_scenes`` more (other streams) score the heads.
        epochs, batch_size, lr: the schedule (Adam, one-cycle to ``lr``).
        seed: the stream of the training scenes, weights and batch order.
    """

    feature_dim: int = 128
    channels: tuple[int, ...] = (32, 48, 48)
    strides: tuple[int, ...] = (2, 2, 1)
    roi: int = 6
    scenes: int = 2000
    eval_scenes: int = 200
    epochs: int = 8
    batch_size: int = 32
    lr: float = 6e-3
    seed: int = DETECTOR_SEED


# Each preset's detector, by name (the shipped weights are ``detectors/<name>.npz``).
DETECTORS = {
    # every preset but tiny and default-2048: sized for 2 CPU cores (trained in about 2 minutes)
    "default": DetectorSpec(),
    # tiny (tests, --smoke): the same network, thin and briefly trained (2 CPU s): its features
    # carry colour, size and the background, little of shape
    "tiny": DetectorSpec(channels=(8, 16, 16), roi=4, scenes=64, eval_scenes=16, epochs=12,
                         batch_size=4, lr=3e-3),
    # the default's, with BUTD's 2048-d features (GPU runs)
    "default-2048": DetectorSpec(feature_dim=2048),
}


# ---------------------------------------------------------------------------------- network


def roi_align(features: torch.Tensor, boxes: torch.Tensor, image_size: int, cells: int
              ) -> torch.Tensor:
    """Bilinear RoIAlign, one sample at each cell's centre (He et al., ICCV 2017, Sec. 3).

    Args:
        features: ``(N, C, h, w)`` map of images ``image_size`` pixels wide.
        boxes: ``(N, R, 4)`` xyxy pixel boxes of each image.
        cells: output cells per side.

    Returns:
        ``(N, R, C, cells, cells)``.
    """
    n, r, _ = boxes.shape
    t = (torch.arange(cells, dtype=features.dtype) + 0.5) / cells  # (cells,)
    x0, y0, x1, y1 = boxes.to(features.dtype).unbind(-1)  # (N, R) each
    xs = (x0[..., None] + (x1 - x0)[..., None] * t) / image_size * 2 - 1  # (N, R, cells)
    ys = (y0[..., None] + (y1 - y0)[..., None] * t) / image_size * 2 - 1
    grid = torch.stack(torch.broadcast_tensors(xs[:, :, None, :], ys[:, :, :, None]), dim=-1)
    grid = grid.reshape(n, r * cells, cells, 2)  # (N, R * cells, cells, 2), (x, y) in [-1, 1]
    pooled = F.grid_sample(features, grid, mode="bilinear", align_corners=False)
    c = features.shape[1]
    return pooled.reshape(n, c, r, cells, cells).transpose(1, 2)  # (N, R, C, cells, cells)


class RegionDetector(nn.Module):
    """Backbone, RoIAlign, one fully connected layer (the feature), linear heads (module doc)."""

    def __init__(self, spec: DetectorSpec, image_size: int = 96) -> None:
        super().__init__()
        if len(spec.channels) != len(spec.strides):
            raise ValueError(f"channels {spec.channels} and strides {spec.strides} differ in length")
        layers: list[nn.Module] = []
        before = 3
        for out, stride in zip(spec.channels, spec.strides, strict=True):
            layers += [nn.Conv2d(before, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out),
                       nn.ReLU(inplace=True)]
            before = out
        self.backbone = nn.Sequential(*layers)
        self.fc = nn.Linear(before * spec.roi * spec.roi, spec.feature_dim)
        self.heads = nn.ModuleDict({name: nn.Linear(spec.feature_dim, len(classes))
                                    for name, classes in HEADS.items()})
        self.image_size, self.cells = image_size, spec.roi

    def features(self, pixels: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """``(N, H, W, 3)`` uint8 images and ``(N, R, 4)`` boxes -> ``(N, R, D)`` features."""
        x = pixels.permute(0, 3, 1, 2).float() / 255.0 - 0.5  # (N, 3, H, W)
        pooled = roi_align(self.backbone(x), boxes, self.image_size, self.cells)  # (N, R, C, s, s)
        return F.relu(self.fc(pooled.flatten(2)))  # (N, R, D)

    def forward(self, pixels: torch.Tensor, boxes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each head's logits, ``(N * R, classes)``."""
        f = self.features(pixels, boxes).flatten(0, 1)  # (N * R, D)
        return {name: head(f) for name, head in self.heads.items()}


# --------------------------------------------------------------------------------- training


@dataclass
class DetectorScenes:
    """Rendered scenes with proposals and their labels (one column per head)."""

    pixels: np.ndarray  # (N, H, W, 3) uint8
    boxes: np.ndarray  # (N, R, 4) float32
    labels: np.ndarray  # (N, R, len(HEADS)) int64; IGNORE where a box has no such label


def detector_scenes(count: int, seed: int, stream: int = 0, image_size: int = 96,
                    regions: int = 36) -> DetectorScenes:
    """``count`` scenes of the world's distribution, scene ``i`` from the streams of
    ``(seed, stream, i)``, with the benchmark's kind of proposals (:func:`.regions.region_boxes`)
    and each box's labels: an object's box its shape and attributes; every other box *background*
    as its shape, and a stuff box (:data:`.regions.STUFF_COVERAGE`) the background's hue as its
    colour and the background's tone."""
    pixels = np.empty((count, image_size, image_size, 3), dtype=np.uint8)
    boxes = np.empty((count, regions, 4), dtype=np.float32)
    labels = np.full((count, regions, len(HEADS)), IGNORE, dtype=np.int64)
    index = {name: {v: i for i, v in enumerate(values)} for name, values in HEADS.items()}
    for i in range(count):
        scene_rng, pixel_rng, box_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence([seed, stream, i]).spawn(3))
        scene = sample_scene(scene_rng, size=image_size)
        rendering = render_scene(scene, pixel_rng)
        boxes[i], owner = region_boxes(list(rendering.boxes), image_size, regions, box_rng)
        pixels[i] = rendering.pixels
        stuff = object_coverage(boxes[i].astype(np.float64), rendering.boxes) < STUFF_COVERAGE
        background = scene.background
        for r, k in enumerate(owner):
            if k >= 0:  # an object's box: its shape and attributes
                truth = {name: scene.objects[k].attribute(name) for name in OBJECT_HEADS}
            elif stuff[r]:  # the background's
                truth = {"shape": "background", "colour": background.hue, "tone": background.tone}
            else:  # a part of an object, or two objects: a box of no class
                truth = {"shape": "background"}
            for name, value in truth.items():
                labels[i, r, COLUMN[name]] = index[name][value]
    return DetectorScenes(pixels, boxes, labels)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch thread (thread-count-independent sums), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _loss(logits: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    """Sum of the heads' cross-entropies; ``labels`` ``(M, len(HEADS))``."""
    return sum(F.cross_entropy(logits[name], labels[:, k], ignore_index=IGNORE)
               for k, name in enumerate(HEADS))


def float_features(detector: RegionDetector, pixels: np.ndarray, boxes: np.ndarray) -> torch.Tensor:
    """The float network's ``(N, R, D)`` features of ``(N, H, W, 3)`` images and ``(N, R, 4)``
    boxes, in chunks (training's arithmetic; the benchmark's come from :mod:`.extractor`)."""
    detector.eval()
    with torch.no_grad():
        return torch.cat([detector.features(torch.from_numpy(pixels[i:i + _CHUNK]),
                                            torch.from_numpy(boxes[i:i + _CHUNK]))
                          for i in range(0, len(pixels), _CHUNK)])


def head_accuracy(heads: nn.ModuleDict, features: torch.Tensor, labels: np.ndarray
                  ) -> dict[str, float]:
    """Accuracy of each head, read from ``(N, R, D)`` features, on the boxes it is trained on
    (``labels`` ``(N, R, len(HEADS))``; ``shape_object``: the shape head on the boxes that detect
    an object, background excluded)."""
    flat = torch.from_numpy(labels).flatten(0, 1)  # (N * R, heads)
    with torch.no_grad():
        logits = {name: head(features.flatten(0, 1)) for name, head in heads.items()}
    out = {}
    for k, name in enumerate(HEADS):
        predicted = logits[name].argmax(1)  # (N * R,)
        valid = flat[:, k] != IGNORE
        out[name] = float((predicted == flat[:, k])[valid].float().mean())
        if name == "shape":
            owned = flat[:, 0] != BACKGROUND
            out["shape_object"] = float((predicted == flat[:, 0])[owned].float().mean())
    return out


def train_detector(spec: DetectorSpec, image_size: int = 96, regions: int = 36
                   ) -> tuple[RegionDetector, dict[str, float]]:
    """Train a :class:`RegionDetector` on its own scenes (module docstring), in one thread, the
    caller's thread count and random state left as they were.

    Returns:
        (the trained network, in eval mode; its heads' accuracies on ``spec.eval_scenes``
        held-out scenes).
    """
    start = time.perf_counter()
    with one_thread(), torch.random.fork_rng(devices=[]):  # the caller's RNG stays as it was
        train = detector_scenes(spec.scenes, spec.seed, 0, image_size, regions)
        held_out = detector_scenes(spec.eval_scenes, spec.seed, 1, image_size, regions)
        torch.manual_seed(spec.seed)  # the initial weights
        detector = RegionDetector(spec, image_size)
        steps = spec.epochs * -(-spec.scenes // spec.batch_size)
        optimiser = torch.optim.Adam(detector.parameters(), lr=spec.lr)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimiser, spec.lr, total_steps=steps,
                                                       pct_start=0.15)
        order = np.random.default_rng(np.random.SeedSequence([spec.seed, 2]))  # batch order
        detector.train()
        for _ in range(spec.epochs):
            batches = order.permutation(spec.scenes)
            for i in range(0, spec.scenes, spec.batch_size):
                at = np.sort(batches[i:i + spec.batch_size])
                logits = detector(torch.from_numpy(train.pixels[at]), torch.from_numpy(train.boxes[at]))
                loss = _loss(logits, torch.from_numpy(train.labels[at]).flatten(0, 1))
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                schedule.step()
        features = float_features(detector, held_out.pixels, held_out.boxes)  # (N, R, D)
        accuracy = head_accuracy(detector.heads, features, held_out.labels)
    logger.info("trained the shapes detector in %.0f s; held-out accuracy %s",
                time.perf_counter() - start, {k: round(v, 3) for k, v in accuracy.items()})
    return detector, accuracy
