"""Batch samplers: coverage per epoch, whole images per batch, determinism, epoch accounting."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from icr.data.sampler import (
    ImageBatchSampler,
    PairBatchSampler,
    build_batch_sampler,
    steps_per_epoch,
)
from icr.errors import ConfigError


def _caption_image(seed: int = 0) -> np.ndarray:
    """23 images with 1-7 captions each (two images have none), in shuffled caption order."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 8, size=25)
    counts[[4, 17]] = 0
    caption_image = np.repeat(np.arange(25), counts)
    return rng.permutation(caption_image)


CAPTION_IMAGE = _caption_image()
NUM_IMAGES = len(np.unique(CAPTION_IMAGE))  # 23 with captions


def _epoch(sampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


# ---------------------------------------------------------------- image batches


@pytest.mark.parametrize("drop_last", [True, False])
def test_image_batches_hold_whole_images_and_cover_captions(drop_last):
    sampler = ImageBatchSampler(CAPTION_IMAGE, 4, seed=1, drop_last=drop_last)
    batches = _epoch(sampler, 0)
    assert len(batches) == len(sampler) == (5 if drop_last else 6)  # 23 images, 4 per batch
    seen = Counter(c for batch in batches for c in batch)
    assert max(seen.values()) == 1  # no caption twice in an epoch
    for batch in batches:
        images = set(CAPTION_IMAGE[batch].tolist())
        # every caption of every image in the batch is in the batch
        assert sorted(batch) == sorted(
            np.flatnonzero(np.isin(CAPTION_IMAGE, list(images))).tolist()
        )
    images_per_batch = [len(set(CAPTION_IMAGE[b].tolist())) for b in batches]
    assert images_per_batch == ([4] * 5 if drop_last else [4] * 5 + [3])
    if not drop_last:
        assert set(seen) == set(range(len(CAPTION_IMAGE)))


def test_image_batches_every_caption_once_when_batches_divide_the_images():
    caption_image = np.repeat(np.arange(12), [5, 5, 4, 6, 5, 5, 5, 5, 3, 5, 5, 7])
    sampler = ImageBatchSampler(np.random.default_rng(2).permutation(caption_image), 3, seed=0)
    for epoch in range(3):
        flat = [c for batch in _epoch(sampler, epoch) for c in batch]
        assert sorted(flat) == list(range(len(caption_image)))


def test_image_batches_deterministic_and_epochs_differ():
    a = ImageBatchSampler(CAPTION_IMAGE, 4, seed=7)
    b = ImageBatchSampler(torch.from_numpy(CAPTION_IMAGE), 4, seed=7)
    assert _epoch(a, 3) == _epoch(b, 3)
    assert _epoch(a, 3) == _epoch(a, 3)  # re-iterating an epoch repeats it
    assert _epoch(a, 3) != _epoch(a, 4)
    assert _epoch(a, 3) != _epoch(ImageBatchSampler(CAPTION_IMAGE, 4, seed=8), 3)


# ---------------------------------------------------------------- pair batches


def test_pair_batches_cover_every_caption_once_per_epoch():
    sampler = PairBatchSampler(CAPTION_IMAGE, 8, seed=0, drop_last=False)
    for epoch in range(2):
        batches = _epoch(sampler, epoch)
        assert [len(b) for b in batches[:-1]] == [8] * (len(batches) - 1)
        assert sorted(c for b in batches for c in b) == list(range(len(CAPTION_IMAGE)))
    dropped = PairBatchSampler(CAPTION_IMAGE, 8, seed=0)
    assert len(_epoch(dropped, 0)) == len(CAPTION_IMAGE) // 8 == len(dropped)
    assert all(len(b) == 8 for b in _epoch(dropped, 0))


def test_pair_batches_by_images_take_one_caption_per_image():
    sampler = PairBatchSampler(CAPTION_IMAGE, 5, seed=3, epoch_unit="images", drop_last=False)
    picks = []
    for epoch in range(6):
        flat = [c for b in _epoch(sampler, epoch) for c in b]
        assert sorted(CAPTION_IMAGE[flat].tolist()) == sorted(set(CAPTION_IMAGE.tolist()))
        picks.append(sorted(flat))
    assert len({tuple(p) for p in picks}) > 1  # a different caption of some image each epoch


def test_pair_batches_deterministic_and_epochs_differ():
    a, b = PairBatchSampler(CAPTION_IMAGE, 8, seed=5), PairBatchSampler(CAPTION_IMAGE, 8, seed=5)
    assert _epoch(a, 1) == _epoch(b, 1)
    assert _epoch(a, 1) != _epoch(a, 2)


def test_works_as_a_dataloader_batch_sampler():
    dataset = torch.arange(len(CAPTION_IMAGE))
    sampler = ImageBatchSampler(CAPTION_IMAGE, 4, seed=0)
    sampler.set_epoch(2)
    loaded = [batch.tolist() for batch in DataLoader(dataset, batch_sampler=sampler)]
    assert loaded == _epoch(sampler, 2)


# ---------------------------------------------------------------- epoch accounting


@pytest.mark.parametrize("sampler_name", ["pairs", "images"])
@pytest.mark.parametrize("epoch_unit", ["captions", "images"])
@pytest.mark.parametrize("drop_last", [True, False])
def test_steps_per_epoch_matches_the_samplers(sampler_name, epoch_unit, drop_last):
    sampler = build_batch_sampler(
        sampler_name, CAPTION_IMAGE, 4, seed=0, epoch_unit=epoch_unit, drop_last=drop_last
    )
    steps = steps_per_epoch(
        len(CAPTION_IMAGE), NUM_IMAGES, 4, sampler_name, epoch_unit, drop_last=drop_last
    )
    assert steps == len(sampler) == len(_epoch(sampler, 0))


def test_steps_per_epoch_hand_cases():
    # COCO train (Karpathy + restval): 113,287 images, 566,435 captions, batch 128
    assert steps_per_epoch(566_435, 113_287, 128, "pairs", "captions") == 4425
    assert steps_per_epoch(566_435, 113_287, 128, "images", "captions") == 885
    assert steps_per_epoch(566_435, 113_287, 128, "pairs", "images") == 885
    # the paper's budgets: 30 pair epochs and 150 image-batch epochs take the same steps
    assert 30 * 4425 == 150 * 885


def test_bad_choices_raise_config_errors():
    with pytest.raises(ConfigError, match="train.sampler"):
        steps_per_epoch(10, 2, 2, "triplets", "captions")
    with pytest.raises(ConfigError, match="train.epoch_unit"):
        build_batch_sampler("pairs", CAPTION_IMAGE, 4, epoch_unit="steps")
    with pytest.raises(ConfigError, match="train.batch_size=30"):
        ImageBatchSampler(CAPTION_IMAGE, 30)
    with pytest.raises(ValueError, match="integer"):
        PairBatchSampler(np.array([0.5, 1.0]), 1)
