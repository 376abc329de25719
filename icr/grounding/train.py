"""The grounding task (``task.name=grounding``): word-region attention trained with L_img + L_lang.

The recipe of Gupta et al., "Contrastive Learning for Weakly Supervised Phrase Grounding" (ECCV
2020, Sec. 2.5; docs/reference-code.md section 4): frozen contextual word features of the selected
nouns and adjectives (:mod:`icr.grounding.words`), region features per image
(:mod:`icr.grounding.data`), the compatibility function of :mod:`icr.grounding.model`, and
``img_weight * L_img + lang_weight * L_lang`` (:mod:`icr.grounding.losses`; both weights 1) with Adam
(lr 1e-5) over batches of 50 captions, 10 epochs. ``L_lang`` contrasts each caption's masked noun
with the substitutes of its negative captions (:mod:`icr.grounding.negatives`).

Config keys: ``grounding.*`` (the model, the word features, the negatives, the loss weights);
the optimiser is ``optim.name``, ``optim.lr``, ``optim.weight_decay``, ``optim.grad_clip``; the
batch size ``train.batch_size``; the number of epochs ``train.warmup_epochs +
train.finetune_epochs`` (the grounding recipe has a single phase). The negatives do not depend on
``train.seed`` (their seed is :data:`NEGATIVES_SEED`), so every trial and every seed of a study
shares one cached set.

A batch holds ``batch_size`` captions drawn without replacement; its images are the distinct images
of those captions, so two captions of one image share it and neither is the other's negative (the
reference draws image-caption pairs and can put one image twice in a batch, once as a false
negative). Model selection is on validation pointing accuracy (``selection_metric``), which
:func:`icr.train.fit` applies; the reference's selection script never evaluated a checkpoint.

Evaluation keeps every content word of a caption (no cap of six), so every phrase whose words are
tagged gets a score; training keeps the cap (``max_words``). Boxes are read as info-ground's
evaluation reads them (``grounding.box_convention=infoground``: ``+1``-pixel areas, the top box's
centre strictly inside a ground-truth box), or in continuous coordinates (``continuous``).

Everything data-dependent (word features, negatives, the masked-LM head, candidate features) is
prepared once and cached under ``<workspace>/cache/grounding``, shared by every trial that uses
the same data and options.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from tqdm.auto import tqdm

from icr.config import GroundingConfig, Scalar, used_values
from icr.context import Attention, Capability
from icr.data.datasets import DatasetSource, load_source
from icr.errors import ConfigError, DataError, step_errors
from icr.grounding.data import GroundingSplit, load_grounding
from icr.grounding.losses import image_infonce_loss, language_infonce_loss
from icr.grounding.model import build_grounding_model
from icr.grounding.negatives import (
    CandidateFeatures,
    NegativeCaptions,
    candidate_features,
    negative_captions,
    noun_positions,
)
from icr.grounding.words import WordEncoder, WordFeatures, word_features
from icr.metrics.grounding import DEFAULT_BOX_CONVENTION, check_box_convention
from icr.seeding import derive_seed
from icr.train.device import Precision
from icr.train.recipe import build_optimizer
from icr.train.step_log import StepLog
from icr.train.tasks import TASKS, Prepared
from icr.train.timing import StepTimer

logger = logging.getLogger(__name__)

__all__ = ["GroundingData", "GroundingInputs", "GroundingTask", "prepare_grounding_data"]

SPLITS = ("train", "val", "test")
NEGATIVES_SEED = 0  # which noun is masked and the masked-LM head's training: shared by all runs
# what a step runs is set by these keys (and the optimiser's, optim.*): the model, its losses
STEP_KEYS = ("grounding.model", "grounding.key_dim", "grounding.img_weight", "grounding.lang_weight")


@dataclass(frozen=True)
class GroundingData:
    """Everything a grounding run reads, prepared once.

    Attributes:
        splits: the grounding splits (``train``, ``val``, ``test``).
        words: per split, the features of its selected words.
        negatives: the training captions' negative captions, or ``None`` (no ``L_lang``).
        candidates: the features of their true nouns and substitutes, or ``None``.
        source: the dataset they were read from (its ground truth and images, for analyses), or
            ``None`` for data assembled by hand.
    """

    splits: dict[str, GroundingSplit]
    words: dict[str, WordFeatures]
    negatives: NegativeCaptions | None = None
    candidates: CandidateFeatures | None = None
    source: DatasetSource | None = None


@dataclass(frozen=True)
class GroundingInputs(Capability):
    """What a grounding model reads: its splits, word features and negative captions."""

    about: ClassVar[str] = "the grounding inputs (splits, word features, negative captions)"
    data: GroundingData


def _load_split(source: DatasetSource, split: str, max_regions: int | None,
                max_words: int | None) -> GroundingSplit:
    """A split from the dataset's region features and Flickr30K Entities folder (the embedded
    benchmark ships both: ``precomp/`` and ``entities/``)."""
    if source.entities_dir is None or source.regions_dir is None:
        raise DataError(f"{source.root}: grounding needs a Flickr30K Entities folder and region "
                        "features beside the dataset; use data.dataset=shapes, or give "
                        "data.precomp_dir and data.entities_dir")
    return load_grounding(source.regions_dir, source.entities_dir, split,
                          features_split=source.region_splits.get(split, split),
                          max_regions=max_regions, max_words=max_words)


def prepare_grounding_data(
    source: DatasetSource,
    cache_dir: Path,
    section: GroundingConfig,
    *,
    device: str | None = None,
    show_progress: bool = False,
    encoder: WordEncoder | None = None,
) -> GroundingData:
    """Load the splits and compute (or read from the cache) every derived input.

    ``section`` says which: ``max_words`` content words per training caption (evaluation splits
    keep all), ``max_regions`` regions per image (0: all), the frozen word encoder
    ``word_model`` and its ``word_pooling`` (:func:`~icr.grounding.words.word_features`), the
    negative captions (:func:`~icr.grounding.negatives.negative_captions`, seeded with
    :data:`NEGATIVES_SEED`) and the features of their substitutes. Without ``L_lang``
    (``lang_weight`` 0, or a generator that proposes no substitute) no negatives are kept.

    Args:
        source: a :class:`~icr.data.datasets.DatasetSource` (``root``, ``regions_dir``,
            ``entities_dir``).
        cache_dir: the cache folder of word features, negatives, the masked-LM head, candidates.
        section: the grounding config (``config.grounding``).
        device: where the encoders run.
        show_progress: tqdm bars.
        encoder: an already loaded word encoder (``section.word_model`` is then only its cache
            name).
    """
    g = section
    splits = {s: _load_split(source, s, g.max_regions or None, g.max_words if s == "train" else None)
              for s in SPLITS}
    words = {s: word_features(list(splits[s].captions), splits[s].words, cache_dir,
                              model=g.word_model, pooling=g.word_pooling, device=device,
                              show_progress=show_progress, encoder=encoder) for s in SPLITS}
    if g.lang_weight == 0:  # without L_lang no negatives are made
        return GroundingData(splits, words, source=source)
    captions = list(splits["train"].captions)
    made = negative_captions(g, captions, noun_positions(captions), cache_dir, seed=NEGATIVES_SEED,
                             device=device, show_progress=show_progress, encoder=encoder)
    if not made.has_substitutes:  # the generator proposes none (``none``): L_img only
        return GroundingData(splits, words, source=source)
    candidates = candidate_features(captions, made, cache_dir, model=g.word_model, device=device,
                                    show_progress=show_progress, encoder=encoder)
    return GroundingData(splits, words, made, candidates, source)


def _rows(array: np.ndarray, index: np.ndarray, device: torch.device) -> torch.Tensor:
    """Rows ``index`` of a (memory-mapped) array as a float32 tensor on ``device``."""
    return torch.from_numpy(np.asarray(array[index], dtype=np.float32)).to(device)


def steps_per_epoch(num_captions: int, batch_size: int) -> int:
    """Full batches of ``batch_size`` captions in an epoch over ``num_captions``.

    Raises:
        ConfigError: the batch is larger than the epoch.
    """
    steps = num_captions // batch_size
    if steps == 0:
        raise ConfigError(f"train.batch_size={batch_size} exceeds the {num_captions} training "
                          "captions of an epoch; lower train.batch_size")
    return steps


class GroundingTask:
    """The grounding model, its optimiser and the steps of the recipe (module docstring).

    Args:
        data: the prepared data.
        model: a name of :data:`~icr.grounding.model.GROUNDING_MODELS`.
        dim: size of the queries, keys and values (384).
        optimizer: ``adam`` (the paper), ``adamw`` or ``adamp``.
        lr: the learning rate (1e-5).
        weight_decay: the optimiser's weight decay (0).
        grad_clip: max gradient norm; 0 = no clipping (the paper does not clip).
        batch_size: captions per batch (50).
        epochs: epochs to train (10).
        img_weight, lang_weight: weights of ``L_img`` and ``L_lang`` (1 and 1).
        seed: the run's seed (weights, batch order).
        device: where the model trains.
        amp: mixed precision on CUDA, in ``amp_dtype`` (:class:`icr.train.device.Precision`).
        max_steps_per_epoch: cut epochs short (0: full epochs).
        trajectory_every: a trajectory row every this many steps.
        eval_batch_size: captions per evaluation batch.
        box_convention: how evaluation reads boxes, ``infoground`` (the reference's evaluation)
            or ``continuous`` (:mod:`icr.metrics.grounding`).
        step_keys: the config keys behind the model, the losses and the optimiser, with their
            values, that an error raised inside a step names (:func:`icr.errors.step_errors`;
            the builder gives :data:`STEP_KEYS` and ``optim.*``).
    """

    selection_metric = "pointing"

    def __init__(
        self,
        data: GroundingData,
        *,
        model: str = "word_region",
        dim: int = 384,
        optimizer: str = "adam",
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        grad_clip: float = 0.0,
        batch_size: int = 50,
        epochs: int = 10,
        img_weight: float = 1.0,
        lang_weight: float = 1.0,
        seed: int = 0,
        device: torch.device | str = "cpu",
        amp: bool = True,
        amp_dtype: str = "auto",
        max_steps_per_epoch: int = 0,
        trajectory_every: int = 10,
        eval_batch_size: int = 256,
        box_convention: str = DEFAULT_BOX_CONVENTION,
        step_keys: Mapping[str, Scalar] | None = None,
    ) -> None:
        self.data, self.device = data, torch.device(device)
        self.step_keys = dict(step_keys or {})
        self.epochs, self.batch_size, self.seed = epochs, batch_size, seed
        self.img_weight, self.lang_weight = img_weight, lang_weight
        self.trajectory_every, self.eval_batch_size = trajectory_every, eval_batch_size
        self.box_convention = check_box_convention(box_convention)
        train = data.splits["train"]
        steps = steps_per_epoch(train.num_captions, batch_size)
        self.steps_per_epoch = min(steps, max_steps_per_epoch) if max_steps_per_epoch else steps
        self.use_lang = lang_weight > 0 and data.candidates is not None
        torch.manual_seed(seed)
        self.model = build_grounding_model(
            model, word_dim=data.words["train"].features.shape[-1],
            region_dim=train.region_features.shape[-1], dim=dim).to(self.device)
        self.optimizer = build_optimizer(optimizer, self.model.parameters(), lr, weight_decay,
                                         self.device)
        self.grad_clip = grad_clip
        self.precision = Precision.of(amp, self.device, amp_dtype)
        self.scaler = self.precision.scaler()
        self.global_step = 0
        self._rows: list[dict[str, float]] = []

    # -- training ---------------------------------------------------------------------------

    def _batch(self, split: str, index: np.ndarray) -> dict[str, torch.Tensor]:
        """Words of captions ``index``, the distinct images of those captions, the targets."""
        data, dev = self.data.splits[split], self.device
        features = self.data.words[split]
        images, targets = np.unique(data.caption_image[index], return_inverse=True)
        batch = {
            "words": _rows(features.features, index, dev),  # (B_c, P, D_w)
            "word_mask": torch.from_numpy(features.mask[index]).to(dev),  # (B_c, P)
            "regions": _rows(data.region_features, images, dev),  # (B_i, R, D_r)
            "region_mask": torch.from_numpy(data.region_mask[images]).to(dev),  # (B_i, R)
            "targets": torch.from_numpy(targets.reshape(-1)).to(dev),  # (B_c,)
        }
        if split == "train" and self.use_lang:
            candidates = self.data.candidates
            batch["candidates"] = _rows(candidates.features, index, dev)  # (B_c, 1 + K, D_w)
            batch["candidate_mask"] = torch.from_numpy(candidates.mask[index]).to(dev)
        return batch

    def _losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``L_img`` and, with candidates, ``L_lang`` of a batch."""
        logits = self.model(batch["words"], batch["word_mask"], batch["regions"],
                            batch["region_mask"]).logits  # (B_c, B_i, P)
        out = {"L_img": image_infonce_loss(logits, batch["word_mask"], batch["targets"])}
        if "candidates" in batch:
            own = batch["targets"]
            lang = self.model.paired(batch["candidates"], batch["candidate_mask"],
                                     batch["regions"][own], batch["region_mask"][own])
            out["L_lang"] = language_infonce_loss(
                lang.logits, batch["candidate_mask"][:, 0], batch["candidate_mask"])
        return out

    def train_epoch(self, epoch: int, progress: bool = False, timer: StepTimer | None = None
                    ) -> dict[str, float]:
        """One epoch over the training captions in a seeded order; the mean loss terms. A
        ``timer`` is told each step's end (:mod:`icr.train.timing`)."""
        self.model.train()
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch))
        order = torch.randperm(self.data.splits["train"].num_captions, generator=generator)
        record = StepLog(epoch, "lower optim.lr or check the data")
        steps = range(self.steps_per_epoch)
        bar = tqdm(steps, desc=f"epoch {epoch + 1}/{self.epochs}", disable=not progress,
                   leave=False)
        for step in bar:
            index = np.sort(order[step * self.batch_size:(step + 1) * self.batch_size].numpy())
            with step_errors(epoch=epoch, step=step, keys=self.step_keys):
                terms = self.train_step(self._batch("train", index), epoch, step)
            row = self.global_step if self.global_step % self.trajectory_every == 0 else None
            record.add(terms["loss"], terms, row_step=row)
            if timer is not None:
                timer.step()
        means = record.means()
        self._rows.extend(record.rows())
        return means

    def train_step(self, batch: dict[str, torch.Tensor], epoch: int, step: int
                   ) -> dict[str, torch.Tensor]:
        """One optimiser step; the loss and its terms (0-d tensors: nothing here waits for the
        device, :mod:`icr.train.step_log`)."""
        with self.precision.autocast():
            terms = self._losses(batch)
            loss = self.img_weight * terms["L_img"]
            if "L_lang" in terms:
                loss = loss + self.lang_weight * terms["L_lang"]
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.global_step += 1
        return {"loss": loss.detach(), **{k: v.detach() for k, v in terms.items()}}

    def take_trajectory(self) -> list[dict[str, float]]:
        rows, self._rows = self._rows, []
        return rows

    # -- evaluation -------------------------------------------------------------------------

    @torch.no_grad()
    def attention(self, split: str) -> torch.Tensor:
        """Each word-feature position's attention over its caption's own image: ``(C, P, R)``."""
        self.model.eval()
        data = self.data.splits[split]
        parts = []
        for start in range(0, data.num_captions, self.eval_batch_size):
            index = np.arange(start, min(start + self.eval_batch_size, data.num_captions))
            batch = self._batch(split, index)
            own = batch["targets"]
            out = self.model.paired(batch["words"], batch["word_mask"], batch["regions"][own],
                                    batch["region_mask"][own])
            parts.append(out.attention.float().cpu())  # (B, P, R)
        return torch.cat(parts)

    @torch.no_grad()
    def evaluate(self, split: str) -> dict[str, float]:
        """Recall@k and pointing accuracy of ``split`` (percent), and its mean ``L_img`` over
        batches of ``batch_size`` captions in a fixed random order, as in training (Fig. 4 of the
        paper follows the InfoNCE bound ``log k - L_img`` on held-out data)."""
        data = self.data.splits[split]
        metrics = data.evaluate(self.attention(split), self.data.words[split].piece_word,
                                box_convention=self.box_convention)
        self.model.eval()
        order = np.random.default_rng(0).permutation(data.num_captions)
        batches = [np.sort(order[start:start + self.batch_size]) for start in
                   range(0, data.num_captions - self.batch_size + 1, self.batch_size)]
        if batches:
            losses = [float(self._losses(self._batch(split, b))["L_img"]) for b in batches]
            metrics["L_img"] = float(np.mean(losses))
        return metrics

    # -- state ------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        return {"lr": self.optimizer.param_groups[0]["lr"]}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "global_step": self.global_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.global_step = int(state["global_step"])

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def eval(self) -> None:
        self.model.eval()

    def capabilities(self) -> tuple[Capability, ...]:
        source = self.data.source
        return (GroundingInputs(self.data), Attention(self.attention),
                *(source.capabilities() if source is not None else ()))


def _prepare(config: Any, workspace: Any, device: str | None, progress: bool = False
             ) -> GroundingData:
    return prepare_grounding_data(load_source(config, workspace), workspace.cache / "grounding",
                                  config.grounding, device=device, show_progress=progress)


def prepare_grounding(config: Any, workspace: Any) -> Prepared:
    """Every cached input of a grounding run (word features, negatives, their features), on the
    driver; the fingerprint of the splits' captions and the size of the training split."""
    data = _prepare(config, workspace, None, progress=True)
    digest = hashlib.sha256()
    for split in SPLITS:
        digest.update("\n".join(data.splits[split].captions).encode())
    train = data.splits["train"]
    root = data.source.root if data.source is not None else None
    notes = data.source.notes if data.source is not None else ()
    return Prepared(digest.hexdigest()[:16], train.num_captions, train.num_images, root, notes)


def fits_grounding(config: Any, data: Prepared) -> None:
    """An epoch of ``train.batch_size`` captions has at least one batch."""
    steps_per_epoch(data.train_captions, config.train.batch_size)


def check_grounding_data(config: Any, workspace: Any) -> tuple[str, ...]:
    """Every file a grounding run reads, checked without preparing it (``--plan``): the
    dataset's splits, and per split the Entities sentences, boxes and split list with the region
    features and boxes of its images (words are not tagged here). Returns what preparation
    prints; a problem raises a one-line DataError naming the file."""
    source = load_source(config, workspace)
    for split in SPLITS:
        if source.entities_dir is None or source.regions_dir is None:
            _load_split(source, split, None, None)  # the DataError that names what is missing
        load_grounding(source.regions_dir, source.entities_dir, split,
                       features_split=source.region_splits.get(split, split),
                       max_regions=config.grounding.max_regions or None, select_words=False)
    return source.notes


@TASKS.register("grounding", reads=("grounding.*",), prepare=prepare_grounding,
                fits=fits_grounding, provides=(GroundingInputs, Attention),
                check_data=check_grounding_data)
def grounding(config: Any, workspace: Any, device: torch.device) -> GroundingTask:
    """Weakly supervised phrase grounding (Gupta et al., ECCV 2020); keys in the module docstring."""
    g = config.grounding
    data = _prepare(config, workspace, str(device))
    o, t = config.optim, config.train
    return GroundingTask(
        data, model=g.model, dim=g.key_dim, optimizer=o.name, lr=o.lr,
        weight_decay=o.weight_decay, grad_clip=o.grad_clip, batch_size=t.batch_size,
        epochs=config.epochs, img_weight=g.img_weight, lang_weight=g.lang_weight, seed=t.seed,
        device=device, amp=t.amp, amp_dtype=t.amp_dtype, max_steps_per_epoch=t.max_steps_per_epoch,
        trajectory_every=t.trajectory_every, eval_batch_size=config.eval.batch_size,
        box_convention=g.box_convention,
        step_keys=used_values(config, (*STEP_KEYS, "optim.")))
