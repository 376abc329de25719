"""From a config to tensors: the assets a trial needs, prepared once and cached on disk.

:func:`prepare_data` loads the splits (generating the embedded benchmark on first use), builds the
vocabulary from the training split, loads the word vectors, the latent targets (LTD), the nDCG
relevance matrices and the CxC extended positives. Everything expensive is cached under
``<workspace>/cache`` keyed by a fingerprint of its inputs, so the trials of a study (and a second
study) find it ready. Image inputs stay in their files (:class:`~icr.data.images.SplitImages`,
memory-mapped); :mod:`icr.data.batches` makes training batches of them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from icr.config import ExperimentConfig, used_keys
from icr.data import cxc, precomp
from icr.data.captions import (
    CaptionInput,
    CaptionTable,
    VocabInput,
    WordpieceInput,
    load_table,
    save_table,
)
from icr.data.datasets import SPLITS, DatasetSource, load_source
from icr.data.glove import embedding_matrix, load_glove
from icr.data.images import PixelNorm, SplitImages
from icr.data.relevance import load_relevance
from icr.data.targets import latent_targets
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary
from icr.errors import ConfigError, DataError
from icr.io import save_npy_atomic
from icr.metrics.relevance import cached_relevance
from icr.models.build import caption_input_kind
from icr.models.image import IMAGE_ENCODERS
from icr.models.tokens import load_bert_tokenizer
from icr.workspace import Workspace

log = logging.getLogger(__name__)

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


def prepare_data(
    config: ExperimentConfig, workspace: Workspace, device: torch.device | None = None
) -> PreparedData:
    """Load or build every asset a trial of ``config`` needs (cached; see module docstring)."""
    source = load_source(config, workspace)
    splits = source.splits
    cache = workspace.cache
    images = {s: image_inputs(config, source, splits[s], cache) for s in SPLITS}
    vocab = cached_vocabulary(splits["train"], config.text.vocab_min_count, cache)
    captions = caption_input(config, vocab)
    pixels = pixel_normalizer(config)
    word_vectors = None
    if "text.glove" in used_keys(config) and config.text.glove != "none":
        path = None if config.text.glove == "glove-6b-50d" else config.text.glove
        vectors = load_glove(path, dim=config.text.word_dim, cache_dir=cache / "glove")
        generator = torch.Generator().manual_seed(config.train.seed)
        word_vectors = embedding_matrix(vocab, vectors, config.text.word_dim, generator)
    targets = None
    if "decoder.target_model" in used_keys(config):  # a decoder that reconstructs latent targets
        targets = latent_targets(
            list(splits["train"].captions), cache / "targets", model=config.decoder.target_model,
            device=str(device) if device is not None else None,
        )
    assets = {s: eval_assets(config, source, splits[s], cache) for s in ("val", "test")}
    tables = {s: cached_table(captions, splits[s], cache) for s in SPLITS}
    clean = VocabInput(vocab, config.text.max_len, 0.0, 0.0)
    vocab_table = (tables["train"] if clean.key() == captions.key()
                   else cached_table(clean, splits["train"], cache))
    return PreparedData(source, splits, images, pixels, vocab, captions, word_vectors, targets,
                        assets, data_fingerprint(splits), tables, vocab_table)


def cached_table(source: CaptionInput, split: CaptionedImages, cache: Path) -> CaptionTable:
    """The split's captions tokenised by ``source``, cached as one memory-mapped file: COCO's
    566,435 training captions take about 20 s to tokenise, once, on the driver."""
    path = cache / "captions" / f"{split.split}-{_split_key(split, source.key())}.npy"
    if not path.exists():
        save_table(path, source.table(split.captions))
    return load_table(path, *source.markers)


def caption_input(config: ExperimentConfig, vocab: Vocabulary) -> CaptionInput:
    """The caption input of ``text.encoder``: vocabulary ids, or its tokenizer's wordpieces."""
    t = config.text
    if caption_input_kind(config) == "wordpiece":
        return WordpieceInput(load_bert_tokenizer(t.bert_path or None), t.max_len, t.unk_prob,
                              t.delete_prob)
    return VocabInput(vocab, t.max_len, t.unk_prob, t.delete_prob)


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
    folder = Path(config.data.precomp_dir) if config.data.precomp_dir else source.regions_dir
    if folder is None:
        raise ConfigError("data.features=regions needs data.precomp_dir=<SCAN/BUTD folder>")
    return region_features(precomp.load_precomp(folder, split.split), split, config.data.image_size)


def region_features(regions: precomp.PrecompSplit, split: CaptionedImages, image_size: int
                    ) -> SplitImages:
    """Region features in the split's image order, boxes (when given) appended in [0, 1].

    Nothing is copied: the features stay in their (memory-mapped) file and the split's order is
    a row map, applied when a batch reads its rows. Boxes are small (16 bytes a region) and are
    scaled here.

    Shapes: the images read ``(N, R, D)`` or ``(N, R, D + 4)`` float32.
    """
    row = {image_id: i for i, image_id in enumerate(regions.images.image_ids)}
    missing = [i for i in split.image_ids if i not in row]
    if missing:
        raise DataError(
            f"{len(missing)} {split.split} images (e.g. {missing[0]}) have no row in the region "
            "features' ids file; the ids must be the split's image file names"
        )
    order = np.array([row[i] for i in split.image_ids], dtype=np.int64)
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


def eval_assets(
    config: ExperimentConfig, source: DatasetSource, split: CaptionedImages, cache: Path
) -> EvalAssets:
    """Relevance (nDCG) and extended positives (CxC) of an evaluation split, when available."""
    d = config.data
    given = getattr(d, f"cxc_{split.split}")
    cxc_path = Path(given) if given else None
    if cxc_path is not None and not cxc_path.exists():
        raise DataError(f"{cxc_path}: CxC file not found (data.cxc_{split.split})")
    path = cxc_path or source.cxc.get(split.split)
    ext_i2t = ext_t2i = None
    if path is not None:
        ext_i2t, ext_t2i = cxc.extended_positives(split, path, min_score=d.cxc_min_score)
    return EvalAssets(relevance_matrix(d.relevance, source, split, cache), ext_i2t, ext_t2i)


def relevance_matrix(
    choice: str, source: DatasetSource, split: CaptionedImages, cache: Path
) -> np.ndarray | None:
    """The nDCG relevance of a split: ``auto`` (the matrix the dataset ships, its first when it
    ships several, else ROUGE-L), a shipped matrix by name (``semantic``), ``rouge`` (TERN
    protocol, computed here), ``none``, or a path."""
    shipped = source.relevance.get(split.split, {})
    if choice == "auto":
        choice = next(iter(shipped), "rouge")
    if choice == "none":
        return None
    if choice == "rouge":
        refs: list[list[str]] = [[] for _ in range(split.num_images)]
        for caption, image in zip(split.captions, split.caption_image, strict=True):
            refs[int(image)].append(caption)
        return cached_relevance(
            list(split.captions), refs, list(map(int, split.caption_image)), cache / "relevance"
        )
    if choice in shipped:
        path = shipped[choice]
    elif "/" in choice or choice.endswith(".npy"):
        path = Path(choice)
    else:
        raise ConfigError(f"data.relevance={choice}: the dataset ships no {choice!r} matrix; use "
                          "auto, rouge, none or a path to an .npy matrix")

    return load_relevance(path, split.num_captions, split.num_images)


def pixel_normalizer(config: ExperimentConfig) -> PixelNorm:
    """How ``image.encoder`` wants its pixels: its registered ``normalize`` of [0, 1] RGB, or the
    ImageNet statistics of torchvision's pretrained backbones."""
    own = IMAGE_ENCODERS.meta(config.image.encoder).get("normalize")
    return own or imagenet_normalize


def imagenet_normalize(x: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] (B, 3, H, W) -> standardised with the ImageNet statistics."""
    mean = x.new_tensor(_MEAN).view(1, 3, 1, 1)
    std = x.new_tensor(_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def encode_split_captions(split: CaptionedImages, captions: CaptionInput) -> list[torch.Tensor]:
    """The clean ids of every caption of a split, as the caption encoder reads them."""
    return [captions.ids(c) for c in split.captions]
