"""Ensembles: the averaged similarities against averaging by hand (members of different sizes),
a one-member ensemble is the member, metrics of the averaged matrix, mismatched members raise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from icr.ensemble import average_similarity
from icr.metrics.retrieval import retrieval_metrics

CAPTION_IMAGE = torch.arange(4).repeat_interleave(2)  # 4 images, 2 captions each


def _member(dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    img = F.normalize(torch.randn(4, dim, generator=gen), dim=1)
    cap = F.normalize(img[CAPTION_IMAGE] + torch.randn(8, dim, generator=gen), dim=1)
    return img, cap


def test_average_matches_averaging_by_hand():
    members = [_member(3, 0), _member(5, 1), _member(2, 2)]
    expected = torch.zeros(4, 8)
    for i in range(4):
        for j in range(8):
            expected[i, j] = sum(float(img[i] @ cap[j]) for img, cap in members) / 3
    torch.testing.assert_close(average_similarity(members), expected)


def test_one_member_is_the_member_itself():
    img, cap = _member(6, 0)
    torch.testing.assert_close(average_similarity([(img, cap)]), img @ cap.T)
    assert retrieval_metrics(average_similarity([(img, cap)]), CAPTION_IMAGE) == retrieval_metrics(
        img @ cap.T, CAPTION_IMAGE
    )


def test_members_are_not_modified():
    members = [_member(3, 0), _member(3, 1)]
    copies = [(img.clone(), cap.clone()) for img, cap in members]
    average_similarity(members)
    for (img, cap), (img0, cap0) in zip(members, copies, strict=True):
        assert torch.equal(img, img0) and torch.equal(cap, cap0)


def test_an_ensemble_ranks_the_averaged_similarities():
    # Each member alone gets one image wrong; together they get every one right.
    img = torch.eye(2)
    cap_a = torch.tensor([[1.0, 0.0], [1.0, 0.2]])  # caption 1 closer to image 0
    cap_b = torch.tensor([[0.4, 1.0], [0.0, 1.0]])  # caption 0 closer to image 1
    caption_image = torch.tensor([0, 1])
    for cap in (cap_a, cap_b):
        assert retrieval_metrics(img @ cap.T, caption_image, ks=(1,))["t2i_R_at_1"] == 50.0
    both = retrieval_metrics(average_similarity([(img, cap_a), (img, cap_b)]), caption_image,
                             ks=(1,))
    assert both["t2i_R_at_1"] == both["i2t_R_at_1"] == 100.0


def test_mismatched_members_raise():
    with pytest.raises(ValueError, match="at least one member"):
        average_similarity([])
    img, cap = _member(3, 0)
    with pytest.raises(ValueError, match="member 1 embeds 4 images and 7 captions"):
        average_similarity([(img, cap), (img, cap[:7])])
    with pytest.raises(ValueError, match="member 0: image embeddings are 3-d, captions 2-d"):
        average_similarity([(img, cap[:, :2])])
