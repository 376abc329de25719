"""From a config to tensors: the assets a trial needs, prepared once and cached on disk.

:func:`prepare_data` loads the splits (generating the embedded benchmark on first use), builds the
vocabulary from the training split, loads the word vectors, the latent targets (LTD), the nDCG
relevance matrices and the CxC extended positives. Everything expensive is cached under
``<workspace>/cache`` keyed by a fingerprint of its inputs, so the trials of a study (and a second
study) find it ready. :class:`PairDataset` and :func:`collate_pairs` feed training.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from icr.config import ExperimentConfig, used_keys
from icr.data import cxc, precomp
from icr.data.captions import CaptionInput, VocabInput, WordpieceInput
from icr.data.datasets import SPLITS, DatasetSource, load_source
from icr.data.glove import embedding_matrix, load_glove
from icr.data.targets import latent_targets
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary
from icr.errors import ConfigError, DataError
from icr.io import save_npy_atomic
from icr.metrics.relevance import cached_relevance
from icr.seeding import derive_seed
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
    images: dict[str, torch.Tensor]  # split -> (N, 3, H, W) uint8 pixels or (N, R, D) regions
    pixels: PixelNorm  # how the image encoder wants its pixels normalised
    vocab: Vocabulary  # of the training captions (GRU encoders, the ITD decoder, probes)
    captions: CaptionInput  # what the caption encoder reads (vocab ids or wordpieces)
    word_vectors: torch.Tensor | None  # (V, word_dim)
    targets: np.ndarray | None  # (C_train, D_target) latent targets of the training captions
    eval_assets: dict[str, EvalAssets]
    fingerprint: str  # identifies the data (files + split contents) for tracking

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
    return PreparedData(source, splits, images, pixels, vocab, captions, word_vectors, targets,
                        assets, data_fingerprint(splits))


def caption_input(config: ExperimentConfig, vocab: Vocabulary) -> CaptionInput:
    """The caption input of ``text.encoder``: vocabulary ids, or its tokenizer's wordpieces."""
    from icr.models.build import caption_input_kind

    t = config.text
    if caption_input_kind(config) == "wordpiece":
        from icr.models.tokens import load_bert_tokenizer

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
) -> torch.Tensor:
    """What the image encoder reads: decoded pixels, or precomputed region features."""
    if config.data.features == "pixels":
        return cached_images(split, config.data.image_size, cache)
    folder = Path(config.data.precomp_dir) if config.data.precomp_dir else source.regions_dir
    if folder is None:
        raise ConfigError("data.features=regions needs data.precomp_dir=<SCAN/BUTD folder>")
    return region_features(precomp.load_precomp(folder, split.split), split, config.data.image_size)


def region_features(regions: precomp.PrecompSplit, split: CaptionedImages, image_size: int) -> torch.Tensor:
    """Region features in the split's image order, boxes (when given) appended in [0, 1].

    Shapes: returns (N, R, D) or (N, R, D + 4) float32.
    """
    row = {image_id: i for i, image_id in enumerate(regions.images.image_ids)}
    missing = [i for i in split.image_ids if i not in row]
    if missing:
        raise DataError(
            f"{len(missing)} {split.split} images (e.g. {missing[0]}) have no row in the region "
            "features' ids file; the ids must be the split's image file names"
        )
    order = np.array([row[i] for i in split.image_ids])
    features = np.asarray(regions.features[order], dtype=np.float32)  # (N, R, D)
    if regions.boxes is not None:
        boxes = np.asarray(regions.boxes[order], dtype=np.float32) / image_size  # (N, R, 4)
        features = np.concatenate([features, boxes], axis=-1)  # (N, R, D + 4)
    return torch.from_numpy(features)


def cached_images(split: CaptionedImages, size: int, cache: Path) -> torch.Tensor:
    """All images of a split decoded and resized once, as a (N, 3, size, size) uint8 tensor.

    Holding decoded images in memory suits the embedded benchmark and Flickr30k-sized splits at
    small resolutions; the cache file makes every later trial start in well under a second.
    """
    path = cache / "images" / f"{split.split}-{size}-{_split_key(split, size)}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path))
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
    save_npy_atomic(path, array)
    return torch.from_numpy(array)


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
    from icr.data.relevance import load_relevance

    return load_relevance(path, split.num_captions, split.num_images)


PixelNorm = Callable[[torch.Tensor], torch.Tensor]  # RGB in [0, 1] (B, 3, H, W) -> encoder input


def image_input(
    images: torch.Tensor, start: int, stop: int, normalize: PixelNorm | None = None
) -> torch.Tensor:
    """Rows ``start:stop`` as the encoder reads them: pixels normalised (ImageNet statistics
    unless the encoder registered its own), region features as they are."""
    rows = images[start:stop]
    if rows.dtype != torch.uint8:
        return rows
    return (normalize or imagenet_normalize)(rows.float().div_(255.0))


def pixel_normalizer(config: ExperimentConfig) -> PixelNorm:
    """How ``image.encoder`` wants its pixels: its registered ``normalize`` of [0, 1] RGB, or the
    ImageNet statistics of torchvision's pretrained backbones."""
    from icr.models.image import IMAGE_ENCODERS

    own = IMAGE_ENCODERS.meta(config.image.encoder).get("normalize")
    return own or imagenet_normalize


def imagenet_normalize(x: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] (B, 3, H, W) -> standardised with the ImageNet statistics."""
    mean = x.new_tensor(_MEAN).view(1, 3, 1, 1)
    std = x.new_tensor(_STD).view(1, 3, 1, 1)
    return (x - mean) / std


def random_erase(p: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """torchvision's RandomErasing with probability ``p`` (VSE++'s augmentation). torchvision is
    imported here, where a dataset erases: importing it imports all of it, torch._dynamo included
    (1.5 to 3.9 CPU seconds a process, ``benchmarks/process_start.py``)."""
    from torchvision.transforms import v2

    return v2.RandomErasing(p=p)


class PairDataset(Dataset):
    """One item per training caption: its image, augmented token ids, latent target, image index.

    Each caption is used once per epoch (LTD paper, Section 3.1). Augmentation draws from a
    generator seeded by (seed, epoch, caption index), so an epoch is reproducible whatever the
    number of workers and a resumed run sees the same data as an uninterrupted one. ``tokens`` are
    what the caption encoder reads (:mod:`icr.data.captions`); ``clean_tokens`` the vocabulary ids
    of the caption, which the ITD decoder reconstructs.
    """

    def __init__(
        self,
        split: CaptionedImages,
        images: torch.Tensor,
        captions: CaptionInput,
        vocab: Vocabulary,
        *,
        normalize: PixelNorm | None = None,
        max_len: int,
        random_erasing: float,
        targets: np.ndarray | None,
        seed: int,
    ) -> None:
        self.split, self.images, self.captions = split, images, captions
        self.normalize = normalize
        self.targets = None if targets is None else torch.from_numpy(np.asarray(targets))
        self.erase = random_erase(random_erasing) if random_erasing > 0 else None
        self.seed, self.epoch = seed, 0
        clean = VocabInput(vocab, max_len, 0.0, 0.0)
        self.clean_ids = [clean.ids(c) for c in split.captions]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.split.num_captions

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = random.Random(derive_seed(self.seed, self.epoch, index))
        image_index = int(self.split.caption_image[index])
        image = image_input(self.images, image_index, image_index + 1, self.normalize)[0]  # (3, H, W) or (R, D)
        if self.erase is not None and image.dim() == 3:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rng.getrandbits(62))
                image = self.erase(image)
        item = {
            "image": image,
            "tokens": self.captions.augmented(self.split.captions[index], rng),
            "clean_tokens": self.clean_ids[index],
            "image_index": torch.tensor(image_index),
        }
        if self.targets is not None:
            item["target"] = self.targets[index]
        return item


def pad_sequences(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id sequences with 0: ((B, T) ids, (B,) lengths)."""
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    out = torch.zeros(len(seqs), int(lengths.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, lengths


def collate_pairs(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {
        "images": torch.stack([it["image"] for it in items]),  # (B, 3, H, W)
        "image_index": torch.stack([it["image_index"] for it in items]),  # (B,)
    }
    batch["tokens"], batch["lengths"] = pad_sequences([it["tokens"] for it in items])
    batch["clean_tokens"], batch["clean_lengths"] = pad_sequences([it["clean_tokens"] for it in items])
    if "target" in items[0]:
        batch["targets"] = torch.stack([it["target"] for it in items])  # (B, D_target)
    return batch


def encode_split_captions(split: CaptionedImages, captions: CaptionInput) -> list[torch.Tensor]:
    """The clean ids of every caption of a split, as the caption encoder reads them."""
    return [captions.ids(c) for c in split.captions]
