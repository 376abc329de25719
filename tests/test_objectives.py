"""Objectives of Eq. 7-9 and the Lagrange multiplier: values, gradient separation, the ascent
update, projection, checkpoint round trips and a 2-D constrained problem with a known KKT point."""

from __future__ import annotations

import io
from itertools import pairwise

import pytest
import torch

from icr.config import ObjectiveConfig
from icr.errors import ConfigError
from icr.objectives import (
    OBJECTIVES,
    Contrastive,
    Dual,
    LagrangeMultiplier,
    Lagrangian,
    build_objective,
)


def _losses(l_con: float = 2.0, l_rec: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(l_con, requires_grad=True),
        torch.tensor(l_rec, requires_grad=True),
    )


def _run(objective: Lagrangian, l_recs: list[float]) -> list[float]:
    """Steps with the given L_rec values; returns lambda after each step."""
    trajectory = []
    for value in l_recs:
        l_con, l_rec = _losses(l_rec=value)
        objective(l_con, l_rec).loss.backward()
        objective.step()
        trajectory.append(objective.lambda_value)
    return trajectory


# ---------------------------------------------------------------- values and logs


def test_contrastive_and_dual_values():
    l_con, l_rec = _losses(2.0, 0.3)
    out = Contrastive()(l_con, l_rec)
    assert out.loss is l_con and float(out.logs["L_rec"]) == pytest.approx(0.3)
    out = Dual(beta=0.5)(l_con, l_rec)
    assert out.loss.item() == pytest.approx(2.0 + 0.5 * 0.3)
    assert set(out.logs) == {"loss", "L_con", "L_rec"}


def test_lagrangian_value_and_gradient_separation():
    # L = 2 + 0.8 * (0.3 / 0.15 - 1) = 2.8; dL/dL_rec = lambda / eta = 0.8 / 0.15
    objective = Lagrangian(eta=0.15, init=0.8)
    l_con, l_rec = _losses(2.0, 0.3)
    out = objective(l_con, l_rec)
    assert out.loss.item() == pytest.approx(2.8)
    assert {k: round(float(v), 6) for k, v in out.logs.items()} == {
        "loss": 2.8,
        "L_con": 2.0,
        "L_rec": 0.3,
        "lambda": 0.8,
    }
    out.loss.backward()
    assert l_rec.grad.item() == pytest.approx(0.8 / 0.15)
    assert objective.multiplier.value.grad is None  # lambda is a constant for the model
    objective.step()
    assert l_rec.grad.item() == pytest.approx(0.8 / 0.15)  # the ascent step leaves the model alone


def test_the_logged_lambda_is_the_one_its_call_used():
    """A step's logged lambda stays what its loss used after step() moves the multiplier
    (the trajectory reads the logs at the epoch's end)."""
    objective = Lagrangian(eta=0.1, init=1.0)
    first = objective(*_losses(1.0, 0.2)).logs["lambda"]  # violation 1: lambda rises
    objective.step()
    second = objective(*_losses(1.0, 0.2)).logs["lambda"]
    assert float(first) == 1.0
    assert float(second) == pytest.approx(objective.lambda_value) and float(second) > 1.0


def test_a_discarded_call_does_not_move_the_multiplier():
    """A step that did not happen (a failed CUDA-graph capture) leaves no violation behind:
    after discard_pending, a step moves lambda by the next call's violation alone."""
    discarded, plain = Lagrangian(eta=0.1, init=1.0), Lagrangian(eta=0.1, init=1.0)
    discarded(*_losses(1.0, 5.0))  # violation 49: never stepped on
    discarded.discard_pending()
    for objective in (discarded, plain):
        objective(*_losses(1.0, 0.2))  # violation 1
        objective.step()
    assert discarded.lambda_value == plain.lambda_value > 1.0


def test_objectives_that_need_a_reconstruction_loss_say_so():
    for objective in (Dual(), Lagrangian(eta=0.1)):
        with pytest.raises(ConfigError, match="decoder.name"):
            objective(torch.tensor(1.0))


def test_invalid_values_raise_config_errors():
    with pytest.raises(ConfigError, match="eta"):
        Lagrangian(eta=0.0)
    with pytest.raises(ConfigError, match="init"):
        LagrangeMultiplier(init=101.0, max_value=100.0)
    with pytest.raises(ConfigError, match="beta"):
        Dual(beta=-1.0)
    with pytest.raises(ConfigError, match="contrastive, dual, lagrangian"):
        OBJECTIVES.get("augmented")


# ---------------------------------------------------------------- the multiplier's update


def test_lambda_update_follows_sgd_ascent_with_momentum_and_dampening():
    # b_1 = v_1; b_t = 0.9 b_{t-1} + 0.1 v_t; lambda_t = lambda_{t-1} + 5e-3 b_t.
    # eta = 0.1, L_rec = 0.3 then 0.2: v = 2 then 1 -> b = 2, 1.9 -> lambda = 1.01, 1.0195
    objective = Lagrangian(eta=0.1, init=1.0)
    assert _run(objective, [0.3, 0.2]) == pytest.approx([1.01, 1.0195], abs=1e-6)


def test_lambda_rises_while_violated_then_falls_to_zero_and_stays():
    objective = Lagrangian(eta=0.1, init=1.0)
    rising = _run(objective, [0.3] * 50)  # v = 2
    assert all(b > a for a, b in pairwise([1.0] + rising))
    assert rising[-1] == pytest.approx(1.0 + 50 * 5e-3 * 2, abs=1e-5)
    falling = _run(objective, [0.05] * 800)  # v = -0.5
    # the momentum buffer still holds +2 and follows b_t = 2.5 * 0.9^t - 0.5, which is positive for
    # t <= 15: lambda peaks 15 steps (index 14) after the switch, then falls
    peak = falling.index(max(falling))
    assert peak == 14
    first_zero = falling.index(0.0)
    assert all(b < a for a, b in pairwise(falling[peak : first_zero + 1]))
    assert all(value == 0.0 for value in falling[first_zero:])  # projected, never negative


def test_lambda_acts_again_soon_after_the_constraint_breaks():
    # A straight-through clamp would let the raw value wind down to about -1.5 here and need
    # ~300 steps to come back; the projected parameter responds within a few steps.
    objective = Lagrangian(eta=0.1, init=0.0)
    _run(objective, [0.0] * 300)  # v = -1
    assert objective.lambda_value == 0.0
    assert _run(objective, [0.2] * 20)[-1] > 0.0  # v = 1


def test_lambda_never_exceeds_max():
    objective = Lagrangian(eta=0.05, init=1.0, max_value=2.0, lr=0.1)
    trajectory = _run(objective, [1.0] * 30)  # v = 19
    assert max(trajectory) == 2.0 and trajectory[-1] == 2.0


def test_a_non_finite_reconstruction_loss_leaves_lambda_finite_and_the_loss_not():
    """No device sync in the step: lambda takes a zero violation, the loss is NaN, and the
    training loop's check of the loss stops the run (tests/test_train.py)."""
    objective = Lagrangian(eta=0.1)
    out = objective(torch.tensor(1.0), torch.tensor(float("nan")))
    objective.step()
    assert not torch.isfinite(out.loss)
    assert objective.lambda_value == 1.0


def test_calls_without_gradients_do_not_move_lambda_and_accumulated_calls_average():
    objective = Lagrangian(eta=0.1, init=1.0)
    with torch.no_grad():
        objective(*_losses(l_rec=5.0))  # validation
    objective.step()
    assert objective.lambda_value == 1.0
    objective(*_losses(l_rec=0.3))  # v = 2
    objective(*_losses(l_rec=0.1))  # v = 0
    objective.step()  # mean violation 1
    assert objective.lambda_value == pytest.approx(1.005)


# ---------------------------------------------------------------- checkpoints


def test_state_dict_round_trip_gives_identical_updates():
    l_recs = [0.3, 0.25, 0.05, 0.4, 0.02, 0.2, 0.01]
    original = Lagrangian(eta=0.1, init=1.0)
    _run(original, [0.3, 0.5, 0.02])
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    expected = _run(original, l_recs)

    buffer.seek(0)
    resumed = Lagrangian(eta=0.1, init=7.0)
    resumed.load_state_dict(torch.load(buffer))
    assert _run(resumed, l_recs) == expected

    # the momentum buffer is part of the state: restoring the value alone gives other updates
    buffer.seek(0)
    saved = torch.load(buffer)
    value_only = Lagrangian(eta=0.1, init=float(saved["multiplier"]["value"]))
    assert _run(value_only, l_recs) != pytest.approx(expected, abs=1e-6)


def test_stateless_objectives_have_empty_state():
    for objective in (Contrastive(), Dual()):
        assert objective.state_dict() == {}
        with pytest.raises(ValueError, match="no state"):
            objective.load_state_dict(Lagrangian(eta=0.1).state_dict())


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("name", OBJECTIVES.names())
def test_every_registered_objective_forward_backward_finite(name):
    objective = build_objective(ObjectiveConfig(name=name))
    weight = torch.tensor([0.5, -1.0], requires_grad=True)
    l_con = (weight**2).sum()
    l_rec = (weight - 1.0).abs().mean()
    out = objective(l_con, l_rec)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    assert {"loss", "L_con", "L_rec"} <= set(out.logs)
    assert all(isinstance(float(v), float) for v in out.logs.values())
    out.loss.backward()
    assert torch.isfinite(weight.grad).all()
    objective.step()
    objective.load_state_dict(objective.state_dict())


def test_builder_maps_config_fields():
    cfg = ObjectiveConfig(
        name="lagrangian",
        eta=0.2,
        lambda_init=3.0,
        lambda_max=50.0,
        lambda_lr=0.01,
        lambda_momentum=0.5,
        lambda_dampening=0.2,
    )
    objective = build_objective(cfg)
    assert objective.eta == 0.2 and objective.lambda_value == 3.0
    assert objective.multiplier.max_value == 50.0
    group = objective.multiplier.optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["dampening"], group["maximize"]) == (
        0.01,
        0.5,
        0.2,
        True,
    )
    assert build_objective(ObjectiveConfig(name="dual", beta=0.3)).beta == 0.3


# ---------------------------------------------------------------- a 2-D constrained problem


@pytest.mark.parametrize("init", [0.0, 1.0])
def test_lagrangian_converges_to_the_kkt_point(init):
    # min ||x - a||^2  s.t.  ||x||^2 <= eta, a = (1.2, 1.6) (||a|| = 2), eta = 0.25 (radius 0.5).
    # The constraint is active: x* = a * 0.5 / 2 = (0.3, 0.4). KKT with multiplier mu on
    # (||x||^2 - eta): 2 (x - a) + 2 mu x = 0 -> x = a / (1 + mu) -> mu = 3. In the Eq. 9 form
    # lambda * (g / eta - 1) the multiplier is lambda = mu * eta = 0.75.
    a = torch.tensor([1.2, 1.6])
    x = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([x], lr=0.05)
    objective = Lagrangian(eta=0.25, init=init)  # the reference's lr, momentum, dampening
    for _ in range(800):
        out = objective(((x - a) ** 2).sum(), (x**2).sum())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        objective.step()
    torch.testing.assert_close(x.detach(), torch.tensor([0.3, 0.4]), atol=1e-3, rtol=0)
    assert objective.lambda_value == pytest.approx(0.75, abs=1e-2)
