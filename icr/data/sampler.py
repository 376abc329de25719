"""Batch samplers over a caption-indexed dataset: pair batches and image-level batches.

The training dataset has one item per caption (its image comes with it); a batch sampler yields
lists of caption indices, and ``caption_image`` (C,) is the only ground truth of which captions
belong to which image (never 5 per image, never contiguous).

- ``pairs`` (:class:`PairBatchSampler`): ``batch_size`` image-caption pairs per batch, the loss's
  usual in-batch setting (triplet, NT-Xent / InfoNCE).
- ``images`` (:class:`ImageBatchSampler`): ``batch_size`` *images* per batch, each with all its
  captions, so a batch holds about ``k * batch_size`` pairs (640 for COCO's k = 5 and 128 images).
  This is how the metric-learning paper trains SmoothAP: an image query then has its k positive
  captions in the batch (section 3 of Bleeker & de Rijke, ECIR 2022).

How an epoch is counted (``epoch_unit``) is a choice, and it changes what "N epochs" means when
losses with different samplers are compared:

- ``captions``: an epoch passes over every caption once. Pair batches take ``C // B`` steps; image
  batches take ``I // B`` steps (each caption comes with its image), about k times fewer.
- ``images``: an epoch passes over every image once. Image batches are the same as above; pair
  batches take one caption of each image, drawn at random each epoch, in ``I // B`` steps.

The paper counts epochs in captions for the pair losses (30 epochs, lr x 0.1 at 15) and, for
SmoothAP's image batches, in passes over the images, and compensates by training SmoothAP 5 times
as many epochs (150, lr step at 75), which gives every run the same number of optimiser steps
(``C / 128 * 30 = I / 128 * 150`` for k = 5). To reproduce it with the config (keys proposed to
the lead):

- pair losses: ``train.sampler=pairs``, ``train.epoch_unit=captions``, 30 epochs, lr step at 15;
- SmoothAP: ``train.sampler=images``, ``train.epoch_unit=captions`` (identical to ``images`` for
  image batches), ``train.batch_size=128`` (images), 150 epochs, lr step at 75.

Alternatively ``train.epoch_unit=images`` for every loss gives all runs ``I // B`` steps per epoch
and the same epoch budget, with the pair runs seeing one caption per image per epoch.

Both samplers are deterministic functions of ``(seed, epoch)``: call :meth:`set_epoch` before
iterating, as with ``DistributedSampler``. ``drop_last=True`` (the default, as the trainer uses)
drops the last batch when it holds fewer than ``batch_size`` pairs (pairs) or images (images), so
every step sees a full batch; ``drop_last=False`` yields it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from icr.errors import ConfigError
from icr.seeding import derive_seed

SAMPLERS = ("pairs", "images")
EPOCH_UNITS = ("captions", "images")
_STREAM = 3  # derive_seed stream of batch sampling (1: step RNG, 2: the DataLoader's generator)


def _as_index_array(caption_image: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(caption_image, torch.Tensor):
        caption_image = caption_image.detach().cpu().numpy()
    array = np.asarray(caption_image)
    if array.ndim != 1 or len(array) == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            "caption_image must be a non-empty 1-d integer array (one image per caption)"
        )
    if array.min() < 0:
        raise ValueError("caption_image holds a negative image index")
    return array.astype(np.int64)


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")


def _num_batches(items: int, batch_size: int, drop_last: bool) -> int:
    return items // batch_size if drop_last else math.ceil(items / batch_size)


def steps_per_epoch(
    num_captions: int,
    num_images: int,
    batch_size: int,
    sampler: str = "pairs",
    epoch_unit: str = "captions",
    drop_last: bool = True,
) -> int:
    """Optimiser steps in one epoch, for a sampler and an epoch unit (see the module docstring).

    Args:
        num_captions: C, training captions.
        num_images: I, training images (that have at least one caption).
        batch_size: pairs per batch (``pairs``) or images per batch (``images``).
        sampler: ``pairs`` or ``images``.
        epoch_unit: ``captions`` or ``images``.
        drop_last: whether a last, incomplete batch is dropped.

    Raises:
        ConfigError: an unknown sampler or epoch unit, or a batch size larger than an epoch.
    """
    _check_choice("train.sampler", sampler, SAMPLERS)
    _check_choice("train.epoch_unit", epoch_unit, EPOCH_UNITS)
    if sampler == "pairs" and epoch_unit == "captions":
        items, what = num_captions, "captions"
    else:  # image batches, or one caption per image
        items, what = num_images, "images"
    steps = _num_batches(items, batch_size, drop_last)
    if steps == 0:
        raise ConfigError(
            f"train.batch_size={batch_size} exceeds the {items} training {what} of an epoch; "
            "lower train.batch_size"
        )
    return steps


class PairBatchSampler(Sampler[list[int]]):
    """Batches of ``batch_size`` caption indices (image-caption pairs), shuffled per epoch.

    With ``epoch_unit="captions"`` an epoch is a permutation of all captions; with ``"images"``
    it is one caption per image (drawn uniformly each epoch), in a random image order.

    Args:
        caption_image: index of each caption's image.
        batch_size: pairs per batch.
        seed: run seed; the order is a function of ``(seed, epoch)`` only.
        epoch_unit: ``captions`` or ``images``.
        drop_last: drop the last batch when it is incomplete.

    Shapes:
        caption_image: ``(C,)``.
    """

    def __init__(
        self,
        caption_image: Sequence[int] | np.ndarray | torch.Tensor,
        batch_size: int,
        *,
        seed: int = 0,
        epoch_unit: str = "captions",
        drop_last: bool = True,
    ) -> None:
        _check_choice("train.epoch_unit", epoch_unit, EPOCH_UNITS)
        self.caption_image = _as_index_array(caption_image)
        self.batch_size = batch_size
        self.seed = seed
        self.epoch_unit = epoch_unit
        self.drop_last = drop_last
        self.epoch = 0
        self._groups = _captions_by_image(self.caption_image)
        # a batch larger than an epoch raises a one-line ConfigError here
        steps_per_epoch(
            len(self.caption_image), len(self._groups), batch_size, "pairs", epoch_unit, drop_last
        )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> np.ndarray:
        rng = np.random.default_rng(derive_seed(self.seed, self.epoch, _STREAM))
        if self.epoch_unit == "captions":
            return rng.permutation(len(self.caption_image))
        images = rng.permutation(len(self._groups))
        picks = rng.integers(0, [len(self._groups[i]) for i in images])
        return np.array(
            [self._groups[i][p] for i, p in zip(images, picks, strict=True)], dtype=np.int64
        )

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch as one array: the captions in batch order and each batch's bounds.

        Returns:
            ``(order, bounds)``: ``(n,)`` int64 caption indices, ``(len(self) + 1,)`` int64;
            batch ``b`` is ``order[bounds[b]:bounds[b + 1]]``.
        """
        order = self._order()
        bounds = np.arange(len(self) + 1, dtype=np.int64) * self.batch_size
        if not self.drop_last:
            bounds[-1] = min(bounds[-1], len(order))
        return order[: bounds[-1]], bounds

    def __iter__(self) -> Iterator[list[int]]:
        yield from _batches(*self.plan())

    def __len__(self) -> int:
        items = len(self.caption_image) if self.epoch_unit == "captions" else len(self._groups)
        return _num_batches(items, self.batch_size, self.drop_last)


class ImageBatchSampler(Sampler[list[int]]):
    """Batches of ``images_per_batch`` images, each with all its captions (SmoothAP batches).

    Images are shuffled per epoch; a batch lists the captions of its images, image by image, in
    dataset order within an image. Batches hold ``sum`` of their images' caption counts pairs.

    Args:
        caption_image: index of each caption's image; images without captions are never drawn.
        images_per_batch: images per batch (``train.batch_size`` with ``train.sampler=images``).
        seed: run seed; the order is a function of ``(seed, epoch)`` only.
        drop_last: drop the last batch when it holds fewer than ``images_per_batch`` images.

    Shapes:
        caption_image: ``(C,)``.
    """

    def __init__(
        self,
        caption_image: Sequence[int] | np.ndarray | torch.Tensor,
        images_per_batch: int,
        *,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        self.caption_image = _as_index_array(caption_image)
        self.images_per_batch = images_per_batch
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._groups = _captions_by_image(self.caption_image)
        # a batch larger than an epoch raises a one-line ConfigError here
        n_cap, n_img = len(self.caption_image), len(self._groups)
        steps_per_epoch(n_cap, n_img, images_per_batch, "images", "images", drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        """The epoch as one array (see :meth:`PairBatchSampler.plan`): each batch lists the
        captions of its images, image by image."""
        rng = np.random.default_rng(derive_seed(self.seed, self.epoch, _STREAM))
        images = rng.permutation(len(self._groups))[: len(self) * self.images_per_batch]
        groups = [self._groups[i] for i in images]
        sizes = np.array([len(g) for g in groups], dtype=np.int64)  # captions per image
        ends = np.cumsum(sizes)
        last = np.arange(self.images_per_batch, len(images) + self.images_per_batch,
                         self.images_per_batch).clip(max=len(images)) - 1
        bounds = np.concatenate([[0], ends[last]]).astype(np.int64)
        order = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
        return order.astype(np.int64), bounds

    def __iter__(self) -> Iterator[list[int]]:
        yield from _batches(*self.plan())

    def __len__(self) -> int:
        return _num_batches(len(self._groups), self.images_per_batch, self.drop_last)


def _batches(order: np.ndarray, bounds: np.ndarray) -> Iterator[list[int]]:
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        yield order[start:stop].tolist()


def _captions_by_image(caption_image: np.ndarray) -> list[np.ndarray]:
    """Caption indices of each image that has captions, in dataset order within an image."""
    order = np.argsort(caption_image, kind="stable")  # (C,)
    bounds = np.flatnonzero(np.diff(caption_image[order])) + 1
    return np.split(order, bounds)


def build_batch_sampler(
    sampler: str,
    caption_image: Sequence[int] | np.ndarray | torch.Tensor,
    batch_size: int,
    *,
    seed: int = 0,
    epoch_unit: str = "captions",
    drop_last: bool = True,
) -> PairBatchSampler | ImageBatchSampler:
    """The batch sampler named by ``train.sampler`` (``pairs`` or ``images``).

    ``epoch_unit`` only matters for pair batches (image batches pass over every image, hence
    every caption, once per epoch under both units).
    """
    _check_choice("train.sampler", sampler, SAMPLERS)
    _check_choice("train.epoch_unit", epoch_unit, EPOCH_UNITS)
    if sampler == "pairs":
        return PairBatchSampler(
            caption_image, batch_size, seed=seed, epoch_unit=epoch_unit, drop_last=drop_last
        )
    return ImageBatchSampler(caption_image, batch_size, seed=seed, drop_last=drop_last)
