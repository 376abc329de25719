"""The retrieval task's data: what its model reads, prepared once and cached (``prepare_data``).

The data layer (:mod:`icr.data.pipeline`, :mod:`icr.data.datasets`) loads splits, images,
vocabularies and caption tables and knows no model. What depends on the model is decided here,
from the registries of :mod:`icr.models` and the relevance of :mod:`icr.metrics`: what the caption
encoder reads (vocabulary ids or its tokenizer's wordpieces), how the image encoder wants its
pixels normalised, and the ROUGE-L relevance of nDCG. :class:`RetrievalInputs` hands the prepared
data to the analyses that declare they need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from icr.config import ExperimentConfig, used_keys
from icr.context import Capability
from icr.data import cxc
from icr.data.captions import CaptionInput, VocabInput, WordpieceInput
from icr.data.datasets import SHAPES_SPLITS, SPLITS, DatasetSource, load_source, shapes_folder
from icr.data.glove import embedding_matrix, load_glove
from icr.data.images import PixelNorm
from icr.data.pipeline import (
    EvalAssets,
    PreparedData,
    cached_table,
    cached_vocabulary,
    data_fingerprint,
    image_inputs,
    imagenet_normalize,
)
from icr.data.relevance import load_relevance
from icr.data.targets import latent_targets
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary
from icr.errors import ConfigError, DataError
from icr.metrics.relevance import cached_relevance
from icr.models.build import caption_input_kind
from icr.models.image import IMAGE_ENCODERS
from icr.models.tokens import load_bert_tokenizer
from icr.workspace import Workspace

__all__ = ["RetrievalInputs", "caption_input", "check_data", "pixel_normalizer", "prepare_data"]


@dataclass(frozen=True)
class RetrievalInputs(Capability):
    """What a retrieval model reads, as prepared: its splits, vocabulary and images (pixels or
    regions, before any cached backbone features)."""

    about: ClassVar[str] = "the retrieval inputs (splits, vocabulary, images)"
    data: PreparedData


def prepare_data(
    config: ExperimentConfig, workspace: Workspace, device: torch.device | None = None
) -> PreparedData:
    """Load or build every asset a retrieval trial of ``config`` needs: the splits (the embedded
    benchmark generated on first use), the images as the image encoder reads them, the vocabulary
    of the training split, the caption tables, the word vectors, the latent targets (LTD), the
    nDCG relevance and the CxC extended positives. Everything expensive is cached under
    ``<workspace>/cache`` keyed by what it was computed from (:mod:`icr.data.pipeline`)."""
    source = load_source(config, workspace)
    splits = source.splits
    cache = workspace.cache
    images = {s: image_inputs(config, source, splits[s], cache) for s in SPLITS}
    vocab = cached_vocabulary(splits["train"], config.text.vocab_min_count, cache)
    captions = caption_input(config, vocab)
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
    return PreparedData(source, splits, images, pixel_normalizer(config), vocab, captions,
                        word_vectors, targets, assets, data_fingerprint(splits), tables,
                        vocab_table)


def check_data(config: ExperimentConfig, workspace: Workspace) -> tuple[str, ...]:
    """Every file a retrieval run of ``config`` reads, checked without preparing it (``--plan``):
    the splits as the dataset's loader reads them (the precomputed arrays' names, shapes and
    dtypes through a memory map, caption, id and image counts that agree, unique ids), the
    region features of each split (their ids cover the split), the image files, the CxC files
    and a relevance matrix given by path. Returns what preparation will print (which files serve
    each split, the test's protocols); a problem raises DataError or ConfigError, one line naming
    the file and the fix. The embedded benchmark not generated yet is not generated here."""
    d = config.data
    if d.dataset == "shapes":
        folder = shapes_folder(preset=d.preset, seed=d.seed, root=d.root, workspace=workspace)
        if not (folder / SHAPES_SPLITS).is_file():
            return (f"data: the embedded benchmark ({d.preset} preset) is generated into "
                    f"{folder} by the first run",)
    source = load_source(config, workspace)
    for name in SPLITS:
        split = source.splits[name]
        if d.features == "regions":
            image_inputs(config, source, split, workspace.cache)  # reads nothing but the ids
        else:
            missing = [i for i in range(split.num_images) if not split.image_path(i).is_file()]
            if missing:
                raise DataError(f"{split.image_path(missing[0])}: image not found ({len(missing):,} "
                                f"of the {split.num_images:,} {name} images missing); give the "
                                "image folder with data.image_root")
    for name in ("val", "test"):
        given = getattr(d, f"cxc_{name}")
        path = Path(given) if given else source.cxc.get(name)
        if path is not None:
            cxc.extended_positives(source.splits[name], path, min_score=d.cxc_min_score)
        if d.relevance not in ("auto", "rouge", "none") and d.relevance not in \
                source.relevance.get(name, {}):
            split = source.splits[name]
            load_relevance(Path(d.relevance), split.num_captions, split.num_images, mmap=True)
    return source.notes


def caption_input(config: ExperimentConfig, vocab: Vocabulary) -> CaptionInput:
    """The caption input of ``text.encoder``: vocabulary ids, or its tokenizer's wordpieces."""
    t = config.text
    if caption_input_kind(config) == "wordpiece":
        return WordpieceInput(load_bert_tokenizer(t.bert_path or None), t.max_len, t.unk_prob,
                              t.delete_prob)
    return VocabInput(vocab, t.max_len, t.unk_prob, t.delete_prob)


def pixel_normalizer(config: ExperimentConfig) -> PixelNorm:
    """How ``image.encoder`` wants its pixels: its registered ``normalize`` of [0, 1] RGB, or the
    ImageNet statistics of torchvision's pretrained backbones."""
    own = IMAGE_ENCODERS.meta(config.image.encoder).get("normalize")
    return own or imagenet_normalize


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
