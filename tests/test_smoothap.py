"""SmoothAP: a plain loop of the paper's equations (values and gradients), exact AP as tau -> 0,
a hand-computed batch, deduplication of image queries, and degenerate inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from icr.losses.contrastive import LOSSES, build_loss
from icr.losses.smoothap import image_caption_matrix, smoothap_loss

# ---------------------------------------------------------------- oracles


def _g(x: torch.Tensor, tau: float) -> torch.Tensor:
    """Eq. 7 with the reference code's clamp, written out."""
    exponent = torch.clamp(-x / tau, min=-50.0, max=50.0)
    return 1.0 / (1.0 + torch.exp(exponent))


def smoothap_loop(matrix: torch.Tensor, caption_image: list[int], tau: float) -> torch.Tensor:
    """Eqs. 5-8 one query, one positive, one candidate at a time; matrix is images x captions."""
    n_img, n_cap = matrix.shape
    i2t = []
    for q in range(n_img):
        positives = [j for j in range(n_cap) if caption_image[j] == q]
        ratios = []
        for i in positives:
            r_all = 1 + sum(_g(matrix[q, j] - matrix[q, i], tau) for j in range(n_cap) if j != i)
            r_pos = 1 + sum(_g(matrix[q, j] - matrix[q, i], tau) for j in positives if j != i)
            ratios.append(r_pos / r_all)
        i2t.append(1 - sum(ratios) / len(positives))
    t2i = []
    for j in range(n_cap):
        p = caption_image[j]
        r_all = 1 + sum(_g(matrix[k, j] - matrix[p, j], tau) for k in range(n_img) if k != p)
        t2i.append(1 - 1 / r_all)
    return 0.5 * (sum(i2t) / n_img + sum(t2i) / n_cap)


def exact_ap_loss(matrix: list[list[float]], caption_image: list[int]) -> float:
    """1 - AP with hard ranks (tie-free scores)."""
    n_img, n_cap = len(matrix), len(caption_image)
    i2t = []
    for q in range(n_img):
        order = sorted(range(n_cap), key=lambda j: -matrix[q][j])
        hits, precisions = 0, []
        for rank, j in enumerate(order, start=1):
            if caption_image[j] == q:
                hits += 1
                precisions.append(hits / rank)
        i2t.append(1 - sum(precisions) / len(precisions))
    t2i = []
    for j in range(n_cap):
        column = [matrix[k][j] for k in range(n_img)]
        rank = 1 + sum(s > column[caption_image[j]] for s in column)
        t2i.append(1 - 1 / rank)
    return 0.5 * (sum(i2t) / n_img + sum(t2i) / n_cap)


# ---------------------------------------------------------------- fixtures


def _image_level_batch(counts: list[int], seed: int, dim: int = 6):
    """Embeddings of len(counts) images and their captions, in shuffled pair order.

    Returns image and caption embeddings (leaf tensors), the caption -> image map and a dataset
    id per image (arbitrary, unsorted values).
    """
    g = torch.Generator().manual_seed(seed)
    caption_image = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts))
    caption_image = caption_image[torch.randperm(len(caption_image), generator=g)]
    images = F.normalize(torch.randn(len(counts), dim, generator=g, dtype=torch.float64), dim=1)
    captions = F.normalize(
        images[caption_image]
        + torch.randn(len(caption_image), dim, generator=g, dtype=torch.float64),
        dim=1,
    )
    dataset_ids = torch.tensor([40, 3, 17, 8, 25, 11, 9, 30])[: len(counts)]  # unsorted, distinct
    return images.requires_grad_(), captions.requires_grad_(), caption_image, dataset_ids


# ---------------------------------------------------------------- oracle comparisons


@pytest.mark.parametrize("tau", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("counts", [[5, 5, 5, 5], [3, 1, 4, 2, 5], [1, 1, 1, 1, 1, 1]])
def test_matches_loop_with_gradients(tau, counts):
    images, captions, caption_image, dataset_ids = _image_level_batch(counts, seed=len(counts))
    pair_ids = dataset_ids[caption_image]  # (B,)
    sims = images[caption_image] @ captions.t()  # (B, B), one row per pair
    fast = smoothap_loss(sims, pair_ids, tau=tau)
    slow = smoothap_loop(images @ captions.t(), caption_image.tolist(), tau)
    torch.testing.assert_close(fast, slow)
    grads_fast = torch.autograd.grad(fast, (images, captions))
    grads_slow = torch.autograd.grad(slow, (images, captions))
    for got, want in zip(grads_fast, grads_slow, strict=True):
        torch.testing.assert_close(got, want)
    assert grads_fast[0].abs().sum() > 0  # the comparison bites


def test_tends_to_exact_ap_as_tau_goes_to_zero():
    # tie-free scores at least 0.01 apart: with tau = 1e-4 every |D / tau| >= 100 hits the clamp
    g = torch.Generator().manual_seed(7)
    caption_image = [0, 2, 1, 0, 0, 2, 1, 1, 2, 0, 3]
    values = (torch.randperm(4 * 11, generator=g).double() / 100).reshape(4, 11)
    matrix = values.tolist()
    pair_sims = values[caption_image]  # (11, 11)
    want = exact_ap_loss(matrix, caption_image)
    got = smoothap_loss(pair_sims, torch.tensor(caption_image), tau=1e-4).item()
    assert got == pytest.approx(want, abs=1e-12)
    assert 0.05 < want < 0.95  # neither perfect nor hopeless: the comparison bites
    assert smoothap_loss(pair_sims, torch.tensor(caption_image), tau=0.05).item() != pytest.approx(
        want, abs=1e-3
    )


def test_hand_computed_batch_deduplicates_image_queries():
    # Image A (id 7) has captions c0, c1; image B (id 3) has c2. Images x captions:
    #   A: 0.9 0.1 0.5    ranking c0, c2, c1: AP_A = (1/1 + 2/3) / 2 = 5/6
    #   B: 0.2 0.3 0.8    ranking c2 first:   AP_B = 1
    # caption queries: c0 ranks A first (1), c1 ranks A second (1/2), c2 ranks B first (1)
    # loss = 0.5 * (mean(1/6, 0) + mean(0, 1/2, 0)) = 0.5 * (1/12 + 1/6) = 1/8
    matrix = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]], dtype=torch.float64)
    pairs = matrix[[0, 0, 1]]  # (3, 3): A's row once per caption of A
    loss = smoothap_loss(pairs, torch.tensor([7, 7, 3]), tau=1e-4)
    assert loss.item() == pytest.approx(1 / 8, abs=1e-12)
    # counting A's duplicated row as two queries would give i2t = (1/6 + 1/6 + 0) / 3 instead
    assert smoothap_loss(pairs, torch.tensor([7, 8, 3]), tau=1e-4).item() != pytest.approx(1 / 8)


def test_duplicated_pairs_equal_the_deduplicated_batch():
    # the same images and captions, in pair form with repeated rows, in another pair order,
    # and with image ids renumbered: one loss
    images, captions, caption_image, dataset_ids = _image_level_batch([2, 4, 1, 3], seed=11)
    matrix = (images @ captions.t()).detach()  # (I, C)
    pair_ids = dataset_ids[caption_image]
    reference = smoothap_loss(matrix[caption_image], pair_ids, tau=0.05)
    perm = torch.randperm(len(caption_image), generator=torch.Generator().manual_seed(1))
    shuffled = matrix[caption_image[perm]][:, perm]  # rows and columns follow the pairs
    torch.testing.assert_close(
        smoothap_loss(shuffled, pair_ids[perm] * 10 + 1, tau=0.05), reference
    )
    # with ids increasing in the image index, the folded rows come back in image order
    folded, image_of = image_caption_matrix(matrix[caption_image], caption_image * 3 + 2)
    torch.testing.assert_close(folded, matrix)
    assert torch.equal(image_of, caption_image)


def test_one_caption_per_image_needs_no_ids():
    g = torch.Generator().manual_seed(3)
    sims = torch.randn(6, 6, generator=g, dtype=torch.float64)
    torch.testing.assert_close(smoothap_loss(sims), smoothap_loss(sims, torch.arange(6) * 3))


# ---------------------------------------------------------------- degenerate inputs, registry


def test_all_equal_similarities_are_finite_and_hand_computed():
    # 2 images x 2 captions, all sims equal: G = 1/2 everywhere.
    # image query: R = 1 + 3/2, R_pos = 1 + 1/2 -> AP = 0.6; caption query: R = 1.5 -> AP = 2/3
    sims = torch.full((4, 4), 0.3, dtype=torch.float64, requires_grad=True)
    loss = smoothap_loss(sims, torch.tensor([0, 0, 1, 1]))
    assert loss.item() == pytest.approx(0.5 * (0.4 + 1 / 3), abs=1e-12)
    (grad,) = torch.autograd.grad(loss, sims)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("scale", [1e-6, 1e6])
def test_extreme_scores_stay_finite(scale):
    g = torch.Generator().manual_seed(4)
    sims = (torch.randn(8, 8, generator=g) * scale).requires_grad_()
    loss = smoothap_loss(sims, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), tau=0.01)
    (grad,) = torch.autograd.grad(loss, sims)
    assert math.isfinite(loss.item()) and torch.isfinite(grad).all()


def test_registered_with_tau_option():
    assert LOSSES.get("smoothap") is smoothap_loss
    sims = torch.randn(4, 4, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(build_loss("smoothap", tau=0.1)(sims), smoothap_loss(sims, tau=0.1))
