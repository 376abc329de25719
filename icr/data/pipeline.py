"""The data side of preparing a trial: splits, images, vocabularies and caption tables, cached.

A task composes these into what its model reads, adding what depends on the model (the caption
input, the pixel normalisation, the ROUGE-L relevance): for retrieval
:func:`icr.train.retrieval_data.prepare_data`. This module knows no model. Everything expensive is cached under
``<workspace>/cache`` keyed by a fingerprint of its inputs, so the trials of a study (and a second
study) find it ready. Image inputs stay in their files (:class:`~icr.data.images.SplitImages`,
memory-mapped); :mod:`icr.data.batches` makes training batches of them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from icr.config import ExperimentConfig
from icr.data import precomp, remote
from icr.data.captions import CaptionInput, CaptionTable, load_table, save_table
from icr.data.datasets import SPLITS, DatasetSource
from icr.data.images import PixelNorm, SplitImages
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary
from icr.errors import ConfigError, DataError
from icr.io import save_npy_atomic

# ImageNet statistics: what pretrained torchvision backbones expect; harmless from scratch.
_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class EvalAssets:
    """What evaluating one split needs beyond its embeddings."""

    relevance: np.ndarray | None  # (N_cap, N_img) graded relevance for nDCG, or None
    extended_i2t: list[list[int]] | None  # CxC extra positive captions per image
    extended_t2i: list[list[int]] | None  # CxC extra positive images per caption


@dataclass(frozen=True)
class PreparedData:
    source: DatasetSource
    splits: dict[str, CaptionedImages]
    images: dict[str, SplitImages]  # split -> (N, 3, H, W) uint8 pixels or (N, R, D) regions
    pixels: PixelNorm  # how the image encoder wants its pixels normalised
    vocab: Vocabulary  # of the training captions (GRU encoders, the ITD decoder, probes)
    captions: CaptionInput  # what the caption encoder reads (vocab ids or wordpieces)
    word_vectors: torch.Tensor | None  # (V, word_dim)
    targets: np.ndarray | None  # (C_train, D_target) latent targets of the training captions
    eval_assets: dict[str, EvalAssets]
    fingerprint: str  # identifies the data (files + split contents) for tracking
    tables: dict[str, CaptionTable]  # split -> what the caption encoder reads, tokenised once
    vocab_table: CaptionTable  # the training captions' vocabulary ids (the ITD decoder's)

    @property
    def root(self) -> Path:
        return self.source.root


def cached_table(source: CaptionInput, split: CaptionedImages, cache: Path) -> CaptionTable:
    """The split's captions tokenised by ``source``, cached as one memory-mapped file: COCO's
    566,435 training captions take about 20 s to tokenise, once, on the driver."""
    path = cache / "captions" / f"{split.split}-{_split_key(split, source.key())}.npy"
    if not path.exists():
        save_table(path, source.table(split.captions))
    return load_table(path, *source.markers)


def data_fingerprint(splits: dict[str, CaptionedImages]) -> str:
    h = hashlib.sha256()
    for name in SPLITS:
        s = splits[name]
        h.update(name.encode())
        h.update("\n".join(s.image_ids).encode())
        h.update("\n".join(s.captions).encode())
        h.update(np.ascontiguousarray(s.caption_image, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _split_key(split: CaptionedImages, *extra: object) -> str:
    h = hashlib.sha256(repr(extra).encode())
    h.update("\n".join(split.image_ids).encode())
    h.update("\n".join(split.captions).encode())
    return h.hexdigest()[:16]


def image_inputs(
    config: ExperimentConfig, source: DatasetSource, split: CaptionedImages, cache: Path
) -> SplitImages:
    """What the image encoder reads: decoded pixels, or precomputed region features."""
    if config.data.features == "pixels":
        return cached_images(split, config.data.image_size, cache)
    folder = (remote.local_folder(config.data.precomp_dir, cache) if config.data.precomp_dir
              else source.regions_dir)
    if folder is None:
        raise ConfigError("data.features=regions needs data.precomp_dir=<SCAN/BUTD folder>")
    files = (source.region_splits if folder == source.regions_dir
             else precomp.choose_splits(folder, config.data.splits))  # SCAN's dev, testall
    return region_features(precomp.load_precomp(folder, files[split.split]), split,
                           config.data.image_size)


def region_features(regions: precomp.PrecompSplit, split: CaptionedImages, image_size: int
                    ) -> SplitImages:
    """Region features in the split's image order, boxes (when given) appended in [0, 1].

    Nothing is copied: the features stay in their (memory-mapped) file and the split's order is
    a row map, applied when a batch reads its rows. Boxes are small (16 bytes a region) and are
    scaled here.

    Shapes: the images read ``(N, R, D)`` or ``(N, R, D + 4)`` float32.
    """
    row = {image_id: i for i, image_id in enumerate(regions.images.image_ids)}
    ids = split.image_ids
    if split.numeric_ids is not None and not any(i in row for i in ids):
        ids = split.numeric_ids  # SCAN lists COCO's cocoid and Flickr30K's imgid, not file names
    missing = [i for i in ids if i not in row]
    if missing:
        raise DataError(
            f"{len(missing)} {split.split} images (e.g. {missing[0]}) have no row in the region "
            "features' ids file; the ids must be the split's image file names, or the Karpathy "
            "JSON's cocoid (COCO) or imgid numbers"
        )
    order = np.array([row[i] for i in ids], dtype=np.int64)
    rows = None if np.array_equal(order, np.arange(len(regions.features))) else order
    boxes = None
    if regions.boxes is not None:
        boxes = np.asarray(regions.boxes, dtype=np.float32) / image_size  # (N_file, R, 4)
    return SplitImages(regions.features, rows, boxes)


def cached_images(split: CaptionedImages, size: int, cache: Path) -> SplitImages:
    """All images of a split decoded and resized once into a (N, 3, size, size) uint8 file,
    memory-mapped: later trials start at once and share its pages (COCO at 224 px: 17 GB)."""
    path = cache / "images" / f"{split.split}-{size}-{_split_key(split, size)}.npy"
    if not path.exists():
        save_npy_atomic(path, _decode_images(split, size))
    return SplitImages(np.load(path, mmap_mode="r"))


def _decode_images(split: CaptionedImages, size: int) -> np.ndarray:
    array = np.empty((split.num_images, 3, size, size), dtype=np.uint8)
    for i in range(split.num_images):
        file = split.image_path(i)
        try:
            with Image.open(file) as im:
                im = im.convert("RGB")
                if im.size != (size, size):
                    im = im.resize((size, size), Image.BILINEAR)
                array[i] = np.asarray(im).transpose(2, 0, 1)
        except (OSError, ValueError) as e:
            raise DataError(f"{file}: cannot read the image ({e})") from None
    return array


def cached_vocabulary(train: CaptionedImages, min_count: int, cache: Path) -> Vocabulary:
    """The vocabulary of the training captions only (the reference leaked test words)."""
    path = cache / "vocab" / f"vocab-{_split_key(train, min_count)}.json"
    if path.exists():
        return Vocabulary.load(path)
    vocab = Vocabulary.from_train(train, min_count=min_count)
    vocab.save(path)
    return vocab


def imagenet_normalize(x: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] (B, 3, H, W) -> standardised with the ImageNet statistics."""
    mean = x.new_tensor(_MEAN).view(1, 3, 1, 1)
    std = x.new_tensor(_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def encode_split_captions(split: CaptionedImages, captions: CaptionInput) -> list[torch.Tensor]:
    """The clean ids of every caption of a split, as the caption encoder reads them."""
    return [captions.ids(c) for c in split.captions]
