"""Contrastive and reconstruction losses: hand-computed cases, plain-loop oracles with gradients,
same-image masking, and every registered loss through forward/backward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from icr.config import LossConfig
from icr.errors import ConfigError
from icr.losses import (
    LOSSES,
    build_loss,
    cosine_reconstruction_loss,
    infonce_loss,
    loss_from_config,
    negative_mask,
    token_nll_loss,
    triplet_all_loss,
    triplet_loss,
    warmup_from_config,
)
from icr.losses.contrastive import split_output

# ---------------------------------------------------------------- plain-loop oracles


def _is_negative(image_ids: list[int], i: int, j: int) -> bool:
    return image_ids[i] != image_ids[j]


def infonce_loop(sims: torch.Tensor, image_ids: list[int], tau: float) -> torch.Tensor:
    batch = sims.shape[0]
    i2t = t2i = 0.0
    for q in range(batch):
        row = [sims[q, q] / tau] + [
            sims[q, j] / tau for j in range(batch) if _is_negative(image_ids, q, j)
        ]
        col = [sims[q, q] / tau] + [
            sims[i, q] / tau for i in range(batch) if _is_negative(image_ids, i, q)
        ]
        i2t = i2t - (row[0] - torch.logsumexp(torch.stack(row), 0))
        t2i = t2i - (col[0] - torch.logsumexp(torch.stack(col), 0))
    return 0.5 * (i2t / batch + t2i / batch)


def triplet_loop(
    sims: torch.Tensor, image_ids: list[int], margin: float, hardest: bool
) -> torch.Tensor:
    batch = sims.shape[0]
    total = sims.new_zeros(())
    for q in range(batch):
        for costs in (
            [
                torch.relu(margin + sims[q, j] - sims[q, q])
                for j in range(batch)
                if _is_negative(image_ids, q, j)
            ],
            [
                torch.relu(margin + sims[i, q] - sims[q, q])
                for i in range(batch)
                if _is_negative(image_ids, i, q)
            ],
        ):
            if costs:
                stacked = torch.stack(costs)
                total = total + (stacked.max() if hardest else stacked.sum())
    return total


def nll_loop(logits: torch.Tensor, tokens: torch.Tensor, pad_index: int) -> torch.Tensor:
    total = logits.new_zeros(())
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            token = int(tokens[b, t])
            if token != pad_index:
                total = total - (logits[b, t, token] - torch.logsumexp(logits[b, t], 0))
    return total / tokens.shape[0]


ORACLES = {
    "infonce": lambda s, ids: infonce_loop(s, ids, tau=0.05),
    "triplet": lambda s, ids: triplet_loop(s, ids, margin=0.2, hardest=True),
    "triplet_all": lambda s, ids: triplet_loop(s, ids, margin=0.2, hardest=False),
}


def _random_sims(batch: int, seed: int, dim: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    captions = F.normalize(torch.randn(batch, dim, generator=g, dtype=torch.float64), dim=1)
    return images @ captions.t()  # (B, B)


# ---------------------------------------------------------------- hand-computed cases


def test_infonce_hand_computed_2x2():
    # tau = 0.1: logits = [[5, 1], [2, 4]].
    # i2t: row 0 -> log(1 + e^(1-5)) = log(1 + e^-4); row 1 -> log(1 + e^(2-4)) = log(1 + e^-2)
    # t2i: col 0 -> log(1 + e^(2-5)) = log(1 + e^-3); col 1 -> log(1 + e^(1-4)) = log(1 + e^-3)
    # loss = 0.5 * (mean(i2t) + mean(t2i)) = 0.0605632
    sims = torch.tensor([[0.5, 0.1], [0.2, 0.4]], dtype=torch.float64)
    i2t = (math.log1p(math.exp(-4)) + math.log1p(math.exp(-2))) / 2
    t2i = math.log1p(math.exp(-3))
    expected = 0.5 * (i2t + t2i)
    assert expected == pytest.approx(0.0605632, abs=1e-7)
    assert infonce_loss(sims, tau=0.1).item() == pytest.approx(expected, rel=1e-12)


SIMS_3X3 = [[0.9, 0.8, 0.1], [0.25, 0.5, 0.6], [0.2, 0.4, 0.7]]
# margin 0.2, hinge [0.2 + s_neg - s_pos]_+ :
# image queries (rows):   row 0: 0.8 -> 0.1, 0.1 -> 0      row 1: 0.25 -> 0, 0.6 -> 0.3
#                         row 2: 0.2 -> 0, 0.4 -> 0
# caption queries (cols): col 0: 0.25 -> 0, 0.2 -> 0       col 1: 0.8 -> 0.5, 0.4 -> 0.1
#                         col 2: 0.1 -> 0, 0.6 -> 0.1
# hardest: (0.1 + 0.3 + 0) + (0 + 0.5 + 0.1) = 1.0;  all: (0.1 + 0.3) + (0.5 + 0.1 + 0.1) = 1.1


def test_triplet_hardest_hand_computed_3x3():
    sims = torch.tensor(SIMS_3X3, dtype=torch.float64)
    assert triplet_loss(sims, margin=0.2).item() == pytest.approx(1.0, abs=1e-12)


def test_triplet_all_hand_computed_3x3():
    sims = torch.tensor(SIMS_3X3, dtype=torch.float64)
    assert triplet_all_loss(sims, margin=0.2).item() == pytest.approx(1.1, abs=1e-12)


def test_triplet_hardest_gradient_hand_computed():
    # Active hardest terms: row 0 via (0, 1), row 1 via (1, 2), col 1 via (0, 1), col 2 via (1, 2).
    # d/ds(0,1) = 1 + 1 = 2; d/ds(1,2) = 2; positives: s00 -1 (row 0), s11 -1 (row 1) -1 (col 1),
    # s22 -1 (col 2).
    sims = torch.tensor(SIMS_3X3, dtype=torch.float64, requires_grad=True)
    triplet_loss(sims).backward()
    expected = torch.tensor([[-1, 2, 0], [0, -2, 2], [0, 0, -1]], dtype=torch.float64)
    torch.testing.assert_close(sims.grad, expected)


# ---------------------------------------------------------------- oracles, gradients, masking


@pytest.mark.parametrize("name", sorted(ORACLES))
@pytest.mark.parametrize("image_ids", [None, [0, 1, 0, 2, 3, 1]])
def test_loss_matches_loop_with_gradients(name, image_ids):
    sims = _random_sims(6, seed=1).requires_grad_()
    ids = list(range(6)) if image_ids is None else image_ids
    id_tensor = None if image_ids is None else torch.tensor(image_ids)
    fast = LOSSES.get(name)(sims, id_tensor)
    (grad_fast,) = torch.autograd.grad(fast, sims)
    slow = ORACLES[name](sims, ids)
    (grad_slow,) = torch.autograd.grad(slow, sims)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(grad_fast, grad_slow)


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_same_image_pairs_are_not_negatives(name):
    # Pairs 0 and 2 are two captions of the same image: masking them must equal removing the
    # entries (0, 2) and (2, 0) from the candidates, here by pushing their similarity to -1e4.
    sims = _random_sims(4, seed=2)
    sims[0, 2] = sims[2, 0] = 0.95  # a strong "negative" that must be ignored
    image_ids = torch.tensor([7, 3, 7, 5])
    removed = sims.clone()
    removed[0, 2] = removed[2, 0] = -1e4
    loss = LOSSES.get(name)
    masked = loss(sims, image_ids)
    torch.testing.assert_close(masked, loss(removed))
    assert not torch.isclose(masked, loss(sims))  # the mask changes something

    sims.requires_grad_()
    (grad,) = torch.autograd.grad(loss(sims, image_ids), sims)
    assert grad[0, 2] == 0 and grad[2, 0] == 0


def test_negative_mask():
    sims = torch.zeros(3, 3)
    expected = torch.tensor([[False, True, False], [True, False, True], [False, True, False]])
    assert torch.equal(negative_mask(sims, torch.tensor([4, 9, 4])), expected)
    assert torch.equal(negative_mask(sims), ~torch.eye(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="square"):
        negative_mask(torch.zeros(2, 3))


def test_query_without_negatives_gives_zero_triplet():
    sims = _random_sims(2, seed=3)
    same = torch.tensor([1, 1])
    assert triplet_loss(sims, same).item() == 0.0
    assert infonce_loss(sims, same).item() == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("name", LOSSES.names())
def test_every_registered_loss_forward_backward_finite(name):
    torch.manual_seed(0)
    images = F.normalize(torch.randn(5, 16), dim=1).requires_grad_()
    captions = F.normalize(torch.randn(5, 16), dim=1).requires_grad_()
    loss, logs = split_output(loss_from_config(LossConfig(name=name))(
        images @ captions.t(), torch.tensor([0, 1, 2, 0, 3])
    ))
    assert all(v.dim() == 0 and not v.requires_grad for v in logs.values())
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.item() > 0
    loss.backward()
    assert torch.isfinite(images.grad).all() and images.grad.abs().sum() > 0
    assert torch.isfinite(captions.grad).all() and captions.grad.abs().sum() > 0


# Losses whose oracle needs more than (sims, image_ids) keep it in their own test file.
OWN_ORACLE_FILES = {"smoothap": "test_smoothap.py", "adopt": "test_adopt.py"}


def test_every_registered_loss_has_an_oracle():
    assert set(LOSSES.names()) == set(ORACLES) | set(OWN_ORACLE_FILES)
    here = Path(__file__).parent
    assert all((here / f).is_file() for f in OWN_ORACLE_FILES.values())


def test_build_loss_binds_options_and_rejects_unknown_ones():
    sims = _random_sims(3, seed=4)
    torch.testing.assert_close(build_loss("infonce", tau=0.1)(sims), infonce_loss(sims, tau=0.1))
    with pytest.raises(ConfigError, match="margin"):
        build_loss("infonce", margin=0.2)
    with pytest.raises(ConfigError, match="unknown contrastive loss .nt_xent.; valid: .*infonce"):
        build_loss("nt_xent")


def test_loss_from_config_ignores_fields_of_other_losses():
    sims = _random_sims(3, seed=5)
    fn = loss_from_config(LossConfig(name="triplet", tau=1.0, margin=0.5))
    torch.testing.assert_close(fn(sims), triplet_loss(sims, margin=0.5))


# ---------------------------------------------------------------- reconstruction losses


def test_cosine_reconstruction_hand_computed():
    # cos([1, 0], [0, 1]) = 0 -> 1;  cos([1, 1], [2, 2]) = 1 -> 0;  cos([3, 4], [4, 3]) = 24/25 -> 0.04
    recon = torch.tensor([[1.0, 0.0], [1.0, 1.0], [3.0, 4.0]], dtype=torch.float64)
    target = torch.tensor([[0.0, 1.0], [2.0, 2.0], [4.0, 3.0]], dtype=torch.float64)
    assert cosine_reconstruction_loss(recon, target).item() == pytest.approx(1.04 / 3, abs=1e-12)


def test_cosine_reconstruction_matches_loop_with_gradients():
    g = torch.Generator().manual_seed(6)
    recon = torch.randn(4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randn(4, 5, generator=g, dtype=torch.float64)
    fast = cosine_reconstruction_loss(recon, target)
    slow = (
        sum(1 - recon[b] @ target[b] / (recon[b].norm() * target[b].norm()) for b in range(4)) / 4
    )
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(
        torch.autograd.grad(fast, recon)[0], torch.autograd.grad(slow, recon)[0]
    )


def test_token_nll_hand_computed_on_tiny_vocab():
    # V = 3, pad = 0. tokens [[1, 2], [2, <pad>]].
    # (0, 0): logits [0, 0, 0]            -> p(1) = 1/3 -> log 3
    # (0, 1): logits [0, 0, log 2]        -> p(2) = 2/4 -> log 2
    # (1, 0): logits [log 2, log 2, 0]    -> p(2) = 1/5 -> log 5
    # (1, 1): padding, ignored whatever its logits.   loss = (log 3 + log 2 + log 5) / B = log(30) / 2
    ln2 = math.log(2)
    logits = torch.tensor(
        [[[0, 0, 0], [0, 0, ln2]], [[ln2, ln2, 0], [50.0, -50.0, 9.0]]], dtype=torch.float64
    )
    tokens = torch.tensor([[1, 2], [2, 0]])
    assert token_nll_loss(logits, tokens, pad_index=0).item() == pytest.approx(
        math.log(30) / 2, rel=1e-12
    )
    # the reference's softmax over the time axis gives a different number
    over_time = (
        -(
            F.log_softmax(logits, dim=1).gather(2, tokens[..., None]).squeeze(-1) * (tokens != 0)
        ).sum()
        / 2
    )
    assert over_time.item() != pytest.approx(math.log(30) / 2, rel=1e-3)


def test_token_nll_matches_loop_with_gradients_and_ignores_padding():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(1, 11, (3, 5), generator=g)
    tokens[0, 3:] = 0
    tokens[2, 1:] = 0
    fast = token_nll_loss(logits, tokens, pad_index=0)
    slow = nll_loop(logits, tokens, pad_index=0)
    torch.testing.assert_close(fast, slow)
    (grad,) = torch.autograd.grad(fast, logits)
    torch.testing.assert_close(grad, torch.autograd.grad(slow, logits)[0])
    assert grad[0, 3:].abs().sum() == 0 and grad[2, 1:].abs().sum() == 0


def test_the_triplet_loss_warms_up_on_all_negatives():
    """VSE-infinity's warm-up: ``loss.warmup_epochs`` epochs of the sum over all negatives, then
    the hardest negative, with the same margin; a loss without a warm-up form refuses it."""
    sims = _random_sims(4, seed=6)
    warmup = warmup_from_config(LossConfig(name="triplet", margin=0.3, warmup_epochs=1))
    torch.testing.assert_close(warmup(sims), triplet_all_loss(sims, margin=0.3))
    assert warmup_from_config(LossConfig(name="triplet", margin=0.3)) is None
    with pytest.raises(ConfigError, match="loss.name=infonce has no warm-up form; only triplet"):
        warmup_from_config(LossConfig(name="infonce", warmup_epochs=1))


def test_warmup_epochs_is_a_key_of_the_triplet_loss_only():
    from icr.config import from_flat, used_keys

    assert "loss.warmup_epochs" in used_keys(from_flat({"loss.name": "triplet"}))
    assert "loss.warmup_epochs" not in used_keys(from_flat({"loss.name": "infonce"}))
