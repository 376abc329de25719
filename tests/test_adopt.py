"""AdOpt: K at hand-computed alignment and uniformity, the loss against a plain loop (with
gradients), same-image and positive masking, K within [1, B - 1]."""

from __future__ import annotations

import math

import pytest
import torch

from icr.losses import build_loss
from icr.losses.adopt import ADOPT_POWER, adopt_k_tensor, adopt_loss
from icr.losses.contrastive import LOSSES, split_output

# ---------------------------------------------------------------- plain-loop oracle


def adopt_k(align: float, uniform: float, batch: int) -> int:
    """K from Eq. 6 as the reference code computes it, in Python floats, with the choices
    :func:`icr.losses.adopt.adopt_k_tensor` documents: the oracle of that device version."""
    total = align + uniform
    total = max(total, 0.0) if math.isfinite(total) else 0.0
    angle = min(total**ADOPT_POWER, math.pi / 2)
    k = int(math.cos(angle) * batch) + 1
    return min(max(k, 1), batch - 1)


def adopt_loop(sims: torch.Tensor, image_ids: list[int], margin: float, tau: float):
    """AdOpt from its definition, one query at a time; returns (loss, K)."""
    batch = sims.shape[0]
    s = sims.detach()
    align = sum(float(s[i, i]) for i in range(batch)) / batch
    uniform = (
        sum(
            math.exp(-float(s[i, j])) if i != j else 1.0 for i in range(batch) for j in range(batch)
        )
        / batch**2
    )
    k = int(math.cos(min((align + uniform) ** 1.25, math.pi / 2)) * batch) + 1
    k = min(max(k, 1), batch - 1)
    total = sims.new_zeros(())
    for direction in (sims, sims.t()):
        for q in range(batch):
            negatives = [j for j in range(batch) if image_ids[j] != image_ids[q]]
            hardest = sorted(
                negatives, key=lambda j: float(direction[q, j].detach()), reverse=True
            )[:k]
            logits = [direction[q, q] / tau] + [(direction[q, j] + margin) / tau for j in hardest]
            stacked = torch.stack(logits)
            total = total + torch.logsumexp(stacked, 0) - stacked[0]
    return 0.5 * total / batch, k


def _sims(
    batch: int, diag_boost: float = 0.0, low: float = -1.0, high: float = 1.0
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    sims = low + (high - low) * torch.rand(batch, batch, generator=gen)
    return (sims + diag_boost * torch.eye(batch)).clamp(-1, 1)


# ---------------------------------------------------------------- K


@pytest.mark.parametrize(
    ("align", "uniform", "batch", "expected"),
    [
        (0.0, 0.0, 128, 127),  # cos(0) = 1: int(128) + 1 = 129, clipped to B - 1
        (0.2, 0.8, 10, 6),  # 1^1.25 = 1, cos(1) = 0.5403: int(5.403) + 1
        (1.0, 0.4, 128, 7),  # 1.4^1.25 = 1.5229, cos = 0.0479: int(6.13) + 1
        (0.5, 0.6, 128, 56),  # 1.1^1.25 = 1.1265, cos = 0.4298: int(55.01) + 1
        (1.0, 1.0, 10, 1),  # 2^1.25 = 2.38 > pi/2: a negative cosine in the reference, K = 1
        (1.0, 2.5, 10, 1),  # 3.5^1.25 = 4.79 > 3 pi/2 would give cos > 0 again: clamped, K = 1
        (-0.9, 0.5, 10, 9),  # negative base: clamped to 0, the largest K
        (float("nan"), 0.5, 10, 9),  # diverged similarities: the largest K, no crash
        (0.3, 0.9, 1, 0),  # a batch of one has no negative
    ],
)
def test_adopt_k_by_hand(align, uniform, batch, expected):
    assert adopt_k(align, uniform, batch) == expected


@pytest.mark.parametrize("batch", [1, 2, 3, 128])
def test_adopt_k_on_the_device_equals_the_host_formula(batch):
    """The tensor form (no host read of align and uniform) over the whole range, float32 inputs
    as the loss has them, and the undefined ends (NaN, inf, negative sums)."""
    ends = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for align in torch.cat([torch.linspace(-2.0, 3.0, 71), ends]):
        for uniform in torch.cat([torch.linspace(-1.0, 2.0, 43), ends]):
            expected = adopt_k(float(align), float(uniform), batch)
            assert int(adopt_k_tensor(align, uniform, batch)) == expected, (align, uniform)


@pytest.mark.parametrize("batch", [2, 3, 7, 128])
def test_adopt_k_stays_in_range_and_falls_with_maturity(batch):
    totals = [x / 20 for x in range(-20, 80)]
    ks = [adopt_k(t, 0.0, batch) for t in totals]
    assert all(1 <= k <= batch - 1 for k in ks)
    assert all(a >= b for a, b in zip(ks[:-1], ks[1:], strict=True))  # fewer as batches mature


# ---------------------------------------------------------------- the loss


@pytest.mark.parametrize(
    ("diag_boost", "low", "image_ids", "k"),
    [
        (0.0, -1.0, [0, 1, 2, 3, 4, 5], 2),
        (0.8, -1.0, [0, 1, 2, 3, 4, 5], 1),
        (0.0, 0.0, [0, 1, 2, 3, 4, 5], 3),
        (0.0, 0.0, [0, 0, 0, 0, 1, 2], 3),  # queries 0-3 have two negatives, fewer than K
        (0.5, -1.0, [7, 3, 7, 1, 3, 9], 1),
    ],
)
def test_adopt_matches_loop_with_gradients(diag_boost, low, image_ids, k):
    base = _sims(6, diag_boost, low=low, high=0.8 if low == 0.0 else 1.0)
    sims = base.clone().requires_grad_(True)
    out = adopt_loss(sims, torch.tensor(image_ids), margin=0.2, tau=0.05)
    out.loss.backward()
    ref_sims = base.clone().requires_grad_(True)
    ref, ref_k = adopt_loop(ref_sims, image_ids, margin=0.2, tau=0.05)
    ref.backward()
    assert int(out.logs["K"]) == ref_k == k
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sims.grad, ref_sims.grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(sims.grad).all()


def test_k_is_logged_detached_with_align_and_uniform():
    sims = _sims(8).requires_grad_(True)
    loss, logs = split_output(adopt_loss(sims))
    assert set(logs) == {"K", "align", "uniform"}
    assert all(v.dim() == 0 and not v.requires_grad for v in logs.values())
    assert int(logs["K"]) == adopt_k(float(logs["align"]), float(logs["uniform"]), 8)
    torch.testing.assert_close(logs["align"], sims.detach().diagonal().mean())


def test_same_image_pairs_are_never_negatives():
    sims = _sims(5, diag_boost=0.9)  # K = 1 here: only the hardest negative counts
    sims[0, 1] = sims[1, 0] = 0.99  # the hardest pair, but pairs 0 and 1 share an image
    ids = torch.tensor([4, 4, 5, 6, 7])
    masked = adopt_loss(sims, ids)
    assert int(masked.logs["K"]) == 1
    without_pair = sims.clone()
    without_pair[0, 1] = without_pair[1, 0] = -1.0  # as if it were absent
    assert not torch.isclose(adopt_loss(sims).loss, masked.loss)
    # with the pair masked, its similarity does not matter
    torch.testing.assert_close(adopt_loss(without_pair, ids).loss, masked.loss)


def test_positive_is_never_its_own_negative():
    # Every positive outscores every negative; the reference (diagonal filled with 0) would pick
    # positives as "negatives" whenever the negatives are below 0.
    sims = torch.full((4, 4), -0.5) + 1.4 * torch.eye(4)
    out = adopt_loss(sims, margin=0.2, tau=0.05)
    k = int(out.logs["K"])
    expected = torch.log1p(k * torch.exp(torch.tensor((-0.5 + 0.2 - 0.9) / 0.05)))
    torch.testing.assert_close(out.loss, expected)


def test_batch_of_one_gives_zero_loss():
    out = adopt_loss(torch.tensor([[0.3]], requires_grad=True))
    assert float(out.loss.detach()) == 0.0 and int(out.logs["K"]) == 0


def test_adopt_is_registered_with_its_options():
    assert "adopt" in LOSSES
    assert LOSSES.options("adopt") == ["margin", "tau"]
    sims = _sims(6)
    bound = build_loss("adopt", margin=0.1, tau=0.1)
    torch.testing.assert_close(bound(sims).loss, adopt_loss(sims, margin=0.1, tau=0.1).loss)
