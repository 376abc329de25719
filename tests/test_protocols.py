"""Evaluation protocols: the full set, the k-fold protocol against folds built by hand (captions
shuffled, relevance and CxC positives sliced), embeddings in place of similarities (which
protocols a dataset gets: ``tests/test_published_data.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icr.metrics.protocols import (
    evaluate_protocol,
    evaluate_protocols,
    fold_metrics,
)
from icr.metrics.retrieval import retrieval_metrics

NUM_IMAGES, PER_IMAGE, FOLD = 10, 3, 5


@pytest.fixture
def split():
    """10 images, 3 captions each in shuffled order, embeddings, relevance and CxC positives."""
    gen = torch.Generator().manual_seed(0)
    caption_image = torch.arange(NUM_IMAGES).repeat_interleave(PER_IMAGE)
    caption_image = caption_image[torch.randperm(len(caption_image), generator=gen)]
    img = torch.randn(NUM_IMAGES, 8, generator=gen)
    cap = img[caption_image] + 1.5 * torch.randn(len(caption_image), 8, generator=gen)
    relevance = torch.rand(len(caption_image), NUM_IMAGES, generator=gen).numpy()
    ext_i2t = [[(3 * i + 7) % 30, (5 * i + 1) % 30] for i in range(NUM_IMAGES)]
    ext_t2i = [[(j + 1) % NUM_IMAGES, (j + 6) % NUM_IMAGES] for j in range(len(caption_image))]
    return img, cap, caption_image, relevance, ext_i2t, ext_t2i


def folds_by_hand(img, cap, caption_image, relevance, ext_i2t, ext_t2i):
    """Each fold's inputs, built with plain loops."""
    folds = []
    for start in range(0, NUM_IMAGES, FOLD):
        images = list(range(start, start + FOLD))
        captions = [j for j in range(len(caption_image)) if int(caption_image[j]) in images]
        sims = torch.tensor(
            [[float(img[i] @ cap[j]) for j in captions] for i in images]
        )  # fmt: skip
        folds.append(
            dict(
                sims=sims,
                caption_image=torch.tensor([int(caption_image[j]) - start for j in captions]),
                relevance=np.array([[relevance[j, i] for i in images] for j in captions]),
                extended_i2t=[
                    [captions.index(c) for c in ext_i2t[i] if c in captions] for i in images
                ],
                extended_t2i=[[i - start for i in ext_t2i[j] if i in images] for j in captions],
            )
        )
    return folds


def test_full_protocol_is_retrieval_metrics(split):
    img, cap, caption_image, relevance, *_ = split
    sims = img @ cap.T
    expected = retrieval_metrics(sims, caption_image, relevance=relevance)
    assert evaluate_protocol(sims, caption_image, "full", relevance=relevance) == expected
    from_embeddings = evaluate_protocol((img, cap), caption_image, "full", relevance=relevance)
    assert from_embeddings == pytest.approx(expected)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_folds_match_folds_built_by_hand(split, as_tensor):
    img, cap, caption_image, relevance, ext_i2t, ext_t2i = split
    rel = torch.from_numpy(relevance) if as_tensor else relevance
    extras = dict(relevance=rel, extended_i2t=ext_i2t, extended_t2i=ext_t2i)
    got = fold_metrics(img @ cap.T, caption_image, fold_size=FOLD, **extras)
    hand = folds_by_hand(*split)
    assert len(got) == len(hand) == 2
    for metrics, fold in zip(got, hand, strict=True):
        expected = retrieval_metrics(fold.pop("sims"), fold.pop("caption_image"), **fold)
        assert metrics == pytest.approx(expected)
        assert "t2i_nDCG_at_25" in metrics and "cxc_i2t_R_at_1" in metrics


def test_fold_protocol_averages_the_folds_under_a_prefix(split):
    img, cap, caption_image, relevance, *_ = split
    out = evaluate_protocol(
        (img, cap), caption_image, "coco_5fold_1k", fold_size=FOLD, relevance=relevance
    )
    folds = fold_metrics(img @ cap.T, caption_image, fold_size=FOLD, relevance=relevance)
    assert set(out) == {f"1k_{key}" for key in folds[0]}
    for key in folds[0]:
        assert out[f"1k_{key}"] == pytest.approx((folds[0][key] + folds[1][key]) / 2)


def test_distractors_of_other_folds_do_not_count():
    # Image 0's top caption belongs to image 3, which is in the other fold of 2 images each.
    caption_image = torch.tensor([0, 1, 2, 3])
    sims = torch.eye(4)
    sims[0, 3] = 2.0
    full = evaluate_protocol(sims, caption_image, "full", ks=(1,))
    folds = evaluate_protocol(sims, caption_image, "coco_5fold_1k", fold_size=2, ks=(1,))
    assert full["i2t_R_at_1"] == full["t2i_R_at_1"] == 75.0  # caption 3 ranks image 0 first
    assert folds["1k_i2t_R_at_1"] == folds["1k_t2i_R_at_1"] == 100.0


def test_several_protocols_merge_without_clashes(split):
    img, cap, caption_image, *_ = split
    out = evaluate_protocols((img, cap), caption_image, ["full", "coco_5fold_1k"], fold_size=FOLD)
    assert "rsum" in out and "1k_rsum" in out
    assert len(out) == 2 * len(retrieval_metrics(img @ cap.T, caption_image))


def test_bad_protocol_or_fold_size_raises(split):
    img, cap, caption_image, *_ = split
    with pytest.raises(ValueError, match="valid: full, coco_5fold_1k"):
        evaluate_protocol(img @ cap.T, caption_image, "5k")
    with pytest.raises(ValueError, match="folds of 3"):
        evaluate_protocol(img @ cap.T, caption_image, "coco_5fold_1k", fold_size=3)
