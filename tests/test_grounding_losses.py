"""L_img and L_lang against plain loops (values and gradients) and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from icr.grounding.losses import image_infonce_loss, language_infonce_loss


def image_loop(logits, word_mask, targets, image_ids):
    """Eq. 8 word by word: -log softmax over {own image} + images with another id."""
    per_caption = []
    for c in range(logits.shape[0]):
        terms = []
        for w in range(logits.shape[2]):
            if not word_mask[c, w]:
                continue
            own = int(targets[c])
            candidates = [own] + [
                i for i in range(logits.shape[1]) if image_ids[i] != image_ids[own]
            ]
            scores = torch.stack([logits[c, i, w] for i in candidates])
            terms.append(torch.logsumexp(scores, 0) - logits[c, own, w])
        if terms:
            per_caption.append(torch.stack(terms).mean())
    return torch.stack(per_caption).mean()


def language_loop(logits, valid, candidate_mask):
    terms = []
    for b in range(logits.shape[0]):
        if not valid[b]:
            continue
        scores = torch.stack(
            [logits[b, k] for k in range(logits.shape[1]) if k == 0 or candidate_mask[b, k]]
        )
        terms.append(torch.logsumexp(scores, 0) - logits[b, 0])
    return torch.stack(terms).mean()


def _logits(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)


def test_image_loss_hand_computed():
    # Two captions, two images, one word each: logits of caption 0 = [2, 0], caption 1 = [1, 1].
    # caption 0: log(1 + e^-2); caption 1: log 2.
    logits = torch.tensor([[[2.0], [0.0]], [[1.0], [1.0]]], dtype=torch.float64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    expected = 0.5 * (math.log1p(math.exp(-2)) + math.log(2))
    assert image_infonce_loss(logits, mask).item() == pytest.approx(expected, rel=1e-12)


def test_image_loss_matches_loop_with_gradients():
    n_captions, n_images, n_words = 5, 4, 3
    logits = _logits(0, n_captions, n_images, n_words)
    word_mask = torch.tensor(
        [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool
    )
    targets = torch.tensor([0, 1, 2, 3, 1])
    image_ids = torch.tensor([10, 11, 12, 10])  # images 0 and 3 are copies of one image
    loss = image_infonce_loss(logits, word_mask, targets, image_ids)
    (grad,) = torch.autograd.grad(loss, logits)
    expected = image_loop(logits, word_mask, targets, image_ids)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert grad[2].abs().max() == 0  # the caption without words plays no part
    assert grad[0, 3].abs().max() == 0  # the other copy of caption 0's image is no negative


def test_image_loss_skips_empty_captions_in_the_mean():
    # The reference divides by all captions; here the empty caption does not dilute the mean.
    logits = _logits(1, 2, 2, 2)
    word_mask = torch.tensor([[1, 1], [0, 0]], dtype=torch.bool)
    alone = image_infonce_loss(logits[:1, :, :], word_mask[:1], torch.tensor([0]))
    both = image_infonce_loss(logits, word_mask)
    torch.testing.assert_close(both, alone)


def test_image_loss_defaults_to_the_diagonal_and_handles_no_words():
    logits = _logits(2, 3, 3, 2)
    mask = torch.ones(3, 2, dtype=torch.bool)
    torch.testing.assert_close(
        image_infonce_loss(logits, mask),
        image_infonce_loss(logits, mask, torch.arange(3), torch.arange(3)),
    )
    with pytest.raises(ValueError, match="targets are needed"):
        image_infonce_loss(logits[:, :2], mask)
    empty = image_infonce_loss(logits, torch.zeros(3, 2, dtype=torch.bool))
    assert empty.item() == 0.0
    empty.backward()  # still a graph: a batch without words does not break the training step
    assert logits.grad.abs().max() == 0


def test_language_loss_hand_computed():
    # True noun logit 1, substitutes 0 and 2: log(e^1 + e^0 + e^2) - 1.
    logits = torch.tensor([[1.0, 0.0, 2.0]], dtype=torch.float64)
    expected = math.log(math.e + 1 + math.e**2) - 1
    loss = language_infonce_loss(logits, torch.tensor([True]))
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_language_loss_matches_loop_with_gradients():
    logits = _logits(3, 4, 5)
    valid = torch.tensor([True, False, True, True])
    candidate_mask = torch.tensor(
        [[1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.bool
    )  # row 3: column 0 is taken even when marked absent
    loss = language_infonce_loss(logits, valid, candidate_mask)
    (grad,) = torch.autograd.grad(loss, logits)
    expected = language_loop(logits, valid, candidate_mask)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    assert grad[1].abs().max() == 0
    assert grad[2, 3:].abs().max() == 0


def test_language_loss_without_valid_captions_is_zero_with_a_graph():
    logits = _logits(4, 2, 3)
    loss = language_infonce_loss(logits, torch.tensor([False, False]))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits.grad).all()
