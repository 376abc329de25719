"""From a config to tensors: the assets a trial needs, prepared once and cached on disk.

:func:`prepare_data` loads the splits (generating the embedded benchmark on first use), builds the
vocabulary from the training split, loads the word vectors, the latent targets (LTD), the nDCG
relevance matrices and the CxC extended positives. Everything expensive is cached under
``<workspace>/cache`` keyed by a fingerprint of its inputs, so the trials of a study (and a second
study) find it ready. :class:`PairDataset` and :func:`collate_pairs` feed training.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import v2

from icr.config import ExperimentConfig
from icr.data import cxc, karpathy, precomp
from icr.data.glove import embedding_matrix, load_glove
from icr.data.targets import latent_targets
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary, augment_caption
from icr.errors import ConfigError, DataError
from icr.io import save_npy_atomic
from icr.metrics.relevance import cached_relevance
from icr.seeding import derive_seed
from icr.workspace import Workspace

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
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
    root: Path
    splits: dict[str, CaptionedImages]
    images: dict[str, torch.Tensor]  # split -> (N, 3, H, W) uint8 pixels or (N, R, D) regions
    vocab: Vocabulary
    word_vectors: torch.Tensor | None  # (V, word_dim)
    targets: np.ndarray | None  # (C_train, D_target) latent targets of the training captions
    eval_assets: dict[str, EvalAssets]
    fingerprint: str  # identifies the data (files + split contents) for tracking


def dataset_root(config: ExperimentConfig, workspace: Workspace) -> Path:
    """The dataset folder; the embedded benchmark is generated there on first use."""
    d = config.data
    if d.dataset == "shapes":
        from icr.data.synthetic import ensure_benchmark

        root = Path(d.root) if d.root else workspace.data / f"shapes-{d.preset}-{d.seed}"
        return ensure_benchmark(root, d.preset, d.seed)
    if d.dataset == "precomp":
        if not d.precomp_dir:
            raise ConfigError("data.dataset=precomp needs data.precomp_dir=<SCAN/BUTD folder>")
        return Path(d.precomp_dir)
    if not d.karpathy_json:
        raise ConfigError("data.dataset=karpathy needs data.karpathy_json=<path to the split JSON>")
    return Path(d.karpathy_json).parent


def load_splits(config: ExperimentConfig, root: Path) -> dict[str, CaptionedImages]:
    d = config.data
    if d.dataset == "precomp":
        return {s: precomp.load_precomp(root, s).images for s in SPLITS}
    if d.dataset == "shapes":
        json_path, image_root = root / "dataset_shapes.json", root / "images"
    else:
        json_path = Path(d.karpathy_json)
        image_root = Path(d.image_root) if d.image_root else json_path.parent / "images"
    return {s: karpathy.load_karpathy(json_path, s, image_root=image_root) for s in SPLITS}


def prepare_data(
    config: ExperimentConfig, workspace: Workspace, device: torch.device | None = None
) -> PreparedData:
    """Load or build every asset a trial of ``config`` needs (cached; see module docstring)."""
    root = dataset_root(config, workspace)
    splits = load_splits(config, root)
    fp = data_fingerprint(splits)
    cache = workspace.cache
    images = {s: image_inputs(config, root, splits[s], cache) for s in SPLITS}
    vocab = cached_vocabulary(splits["train"], config.text.vocab_min_count, cache)
    word_vectors = None
    if config.text.glove != "none":
        path = None if config.text.glove == "glove-6b-50d" else config.text.glove
        vectors = load_glove(path, dim=config.text.word_dim, cache_dir=cache / "glove")
        generator = torch.Generator().manual_seed(config.train.seed)
        word_vectors = embedding_matrix(vocab, vectors, config.text.word_dim, generator)
    targets = None
    if config.decoder.name == "ltd":
        targets = latent_targets(
            list(splits["train"].captions), cache / "targets", model=config.decoder.target_model,
            device=str(device) if device is not None else None,
        )
    assets = {s: eval_assets(config, root, splits[s], cache) for s in ("val", "test")}
    return PreparedData(root, splits, images, vocab, word_vectors, targets, assets, fp)


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
    config: ExperimentConfig, root: Path, split: CaptionedImages, cache: Path
) -> torch.Tensor:
    """What the image encoder reads: decoded pixels, or precomputed region features."""
    if config.data.features == "pixels":
        return cached_images(split, config.data.image_size, cache)
    d = config.data
    folder = Path(d.precomp_dir) if d.precomp_dir else root / "precomp" if d.dataset == "shapes" else None
    if folder is None:
        raise ConfigError("data.features=regions needs data.precomp_dir=<SCAN/BUTD folder>")
    return region_features(precomp.load_precomp(folder, split.split), split, d.image_size)


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
    config: ExperimentConfig, root: Path, split: CaptionedImages, cache: Path
) -> EvalAssets:
    """Relevance (nDCG) and extended positives (CxC) of an evaluation split, when available."""
    d = config.data
    relevance = None
    if d.relevance == "rouge":
        refs = [[] for _ in range(split.num_images)]
        for caption, image in zip(split.captions, split.caption_image, strict=True):
            refs[int(image)].append(caption)
        relevance = cached_relevance(
            list(split.captions), refs, list(map(int, split.caption_image)), cache / "relevance"
        )
    elif d.relevance != "none":
        from icr.data.relevance import load_relevance

        relevance = load_relevance(Path(d.relevance), split.num_captions, split.num_images)
    cxc_path = getattr(d, f"cxc_{split.split}")
    path = Path(cxc_path) if cxc_path else root / "cxc" / f"sits_{split.split}.csv"
    ext_i2t = ext_t2i = None
    if path.exists():
        ext_i2t, ext_t2i = cxc.extended_positives(split, path, min_score=d.cxc_min_score)
    elif cxc_path:
        raise DataError(f"{path}: CxC file not found (data.cxc_{split.split})")
    return EvalAssets(relevance, ext_i2t, ext_t2i)


def image_input(images: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` as the encoder reads them: pixels normalised, region features as is."""
    rows = images[start:stop]
    return normalize_images(rows) if rows.dtype == torch.uint8 else rows


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> normalised float (B, 3, H, W)."""
    x = images.float().div_(255.0)
    mean = x.new_tensor(_MEAN).view(1, 3, 1, 1)
    std = x.new_tensor(_STD).view(1, 3, 1, 1)
    return (x - mean) / std


class PairDataset(Dataset):
    """One item per training caption: its image, augmented token ids, latent target, image index.

    Each caption is used once per epoch (LTD paper, Section 3.1). Augmentation draws from a
    generator seeded by (seed, epoch, caption index), so an epoch is reproducible whatever the
    number of workers and a resumed run sees the same data as an uninterrupted one.
    """

    def __init__(
        self,
        split: CaptionedImages,
        images: torch.Tensor,
        vocab: Vocabulary,
        *,
        max_len: int,
        unk_prob: float,
        delete_prob: float,
        random_erasing: float,
        targets: np.ndarray | None,
        seed: int,
    ) -> None:
        self.split, self.images, self.vocab = split, images, vocab
        self.max_len, self.unk_prob, self.delete_prob = max_len, unk_prob, delete_prob
        self.targets = None if targets is None else torch.from_numpy(np.asarray(targets))
        self.erase = v2.RandomErasing(p=random_erasing) if random_erasing > 0 else None
        self.seed, self.epoch = seed, 0
        self.ids = [vocab.encode(c, add_start_end=False)[: max_len - 2] for c in split.captions]
        self.clean_ids = [self._with_start_end(ids) for ids in self.ids]

    def _with_start_end(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.vocab.start_id, *ids, self.vocab.end_id], dtype=torch.long)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.split.num_captions

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        rng = random.Random(derive_seed(self.seed, self.epoch, index))
        image_index = int(self.split.caption_image[index])
        image = image_input(self.images, image_index, image_index + 1)[0]  # (3, H, W) or (R, D)
        if self.erase is not None and image.dim() == 3:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(rng.getrandbits(62))
                image = self.erase(image)
        ids = augment_caption(self.ids[index], self.vocab.unk_id, rng, self.unk_prob, self.delete_prob)
        item = {
            "image": image,
            "tokens": self._with_start_end(ids),
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


def encode_split_captions(split: CaptionedImages, vocab: Vocabulary, max_len: int) -> list[torch.Tensor]:
    """Token ids of every caption of an evaluation split, without augmentation."""
    return [
        torch.tensor([vocab.start_id, *vocab.encode(c, add_start_end=False)[: max_len - 2], vocab.end_id])
        for c in split.captions
    ]


def describe(data: PreparedData) -> str:
    sizes = {s: (data.splits[s].num_images, data.splits[s].num_captions) for s in SPLITS}
    return json.dumps({"root": str(data.root), "sizes": sizes, "vocab": len(data.vocab)})
