"""The Lagrangian objective and its multiplier: ``min L_con s.t. L_rec <= eta`` (Eq. 8-9 of the
LTD paper), lambda trained by projected SGD ascent."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import Tensor, nn

from icr.errors import ConfigError
from icr.objectives.objective import OBJECTIVES, Objective, ObjectiveOutput

logger = logging.getLogger(__name__)


class LagrangeMultiplier(nn.Module):
    """A scalar multiplier lambda >= 0 trained by projected SGD ascent on its own optimiser.

    Each :meth:`step` takes the constraint violation ``v = L_rec / eta - 1`` as a constant, sets
    ``d/dlambda [lambda * v] = v`` as the gradient and lets ``torch.optim.SGD(maximize=True)`` with
    momentum ``mu`` and dampening ``d`` ascend, then projects lambda into ``[0, max_value]``::

        b_1 = v_1,   b_t = mu * b_{t-1} + (1 - d) * v_t      (torch's momentum buffer)
        lambda_t = clip(lambda_{t-1} + lr * b_t, 0, max_value)

    With the reference's numbers (init 1, max 100, lr 5e-3, mu = d = 0.9) the buffer is an
    exponential moving average of the violation, so lambda moves by about ``5e-3 * v`` per step:
    with eta = 0.05 and L_rec near 0.3 (v = 5) it rises by 0.025 a step and hits 100 after about
    4,000 steps (one COCO epoch at batch 128 is 4,425); once L_rec < eta (v in [-1, 0)) it falls by
    at most 0.005 a step, so from 1 to 0 in a few hundred steps, and stays at 0 while the
    constraint holds.

    Deliberate differences from the reference: it clamps lambda only where it is used, with a
    straight-through gradient, so the raw value winds up far outside [0, 100] and must walk back
    before it acts again; here the parameter itself is projected after every step. The reference
    does not checkpoint lambda; here ``state_dict`` holds the value and, as extra state, the
    optimiser's momentum buffer, so a resumed run continues exactly.

    Args:
        init: initial value, in ``[0, max_value]``.
        max_value: upper bound of the projection.
        lr, momentum, dampening: of the ascent SGD.

    References:
        Eq. 9 and section 4.2 of the LTD paper (Bleeker et al.); Platt & Barr, 1987.
    """

    def __init__(
        self,
        init: float = 1.0,
        max_value: float = 100.0,
        lr: float = 5e-3,
        momentum: float = 0.9,
        dampening: float = 0.9,
    ) -> None:
        super().__init__()
        if not 0.0 <= init <= max_value:
            raise ConfigError(f"lambda init {init} must lie in [0, lambda_max = {max_value}]")
        if lr <= 0:
            raise ConfigError(f"lambda lr must be > 0, got {lr}")
        self.max_value = float(max_value)
        self.value = nn.Parameter(torch.tensor(float(init)))
        self.optimizer = torch.optim.SGD(
            [self.value], lr=lr, momentum=momentum, dampening=dampening, maximize=True
        )

    def forward(self) -> Tensor:
        """Lambda as a constant for the model's loss (no gradient reaches the multiplier)."""
        return self.value.detach()

    def step(self, violation: Tensor) -> None:
        """One projected ascent step on ``lambda * violation``; ``violation`` is a constant.

        A non-finite violation (``L_rec`` not finite) counts as 0, so lambda stays finite; the
        training loss is then not finite either, which stops the run (the training loop checks
        it without a device sync per step, so this step must not sync either).
        """
        violation = violation.detach().to(self.value)  # () constant for lambda
        finite = torch.isfinite(violation)
        self.optimizer.zero_grad(set_to_none=True)
        # d/dlambda of lambda * violation
        self.value.grad = torch.where(finite, violation, torch.zeros_like(violation))
        self.optimizer.step()
        with torch.no_grad():
            self.value.clamp_(0.0, self.max_value)

    def get_extra_state(self) -> dict[str, Any]:
        return copy.deepcopy(self.optimizer.state_dict())

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(copy.deepcopy(state))


class Lagrangian(Objective):
    """``L_lag = L_con + lambda * (L_rec / eta - 1)``, min over the model, max over lambda (Eq. 9).

    Implements the constrained problem ``min L_con s.t. L_rec <= eta`` (Eq. 8). The model sees
    lambda as a constant; :meth:`step` moves lambda with the mean violation of the calls made
    with gradients enabled since the last step (calls under ``torch.no_grad``, e.g. validation,
    do not count), so gradient accumulation over several calls is handled. The logged ``loss``
    includes the ``-lambda`` term, so it can be negative.

    Args:
        eta: the bound on ``L_rec`` (> 0).
        init, max_value, lr, momentum, dampening: of the :class:`LagrangeMultiplier`.

    References:
        Eq. 8-9 and section 3.4.3 of the LTD paper (Bleeker et al.).
    """

    uses_reconstruction = True

    def __init__(
        self,
        eta: float,
        init: float = 1.0,
        max_value: float = 100.0,
        lr: float = 5e-3,
        momentum: float = 0.9,
        dampening: float = 0.9,
    ) -> None:
        if eta <= 0:
            raise ConfigError(f"objective.eta must be > 0, got {eta}")
        self.eta = eta
        self.multiplier = LagrangeMultiplier(init, max_value, lr, momentum, dampening)
        self._violations: list[Tensor] = []

    @property
    def lambda_value(self) -> float:
        return float(self.multiplier.value.detach())

    def metrics(self) -> dict[str, float]:
        return {"lambda": self.lambda_value}

    def __call__(self, l_con: Tensor, l_rec: Tensor | None = None) -> ObjectiveOutput:
        l_rec = self._require_rec(l_rec)
        violation = l_rec / self.eta - 1.0  # ()
        lam = self.multiplier().to(device=l_rec.device, dtype=l_rec.dtype)  # () constant
        loss = l_con + lam * violation
        if torch.is_grad_enabled():
            self._violations.append(violation.detach())
        logs = self._logs(loss, l_con, l_rec)
        logs["lambda"] = lam.clone()  # lambda as this call used it: step() moves the parameter
        return ObjectiveOutput(loss, logs)

    def step(self) -> None:
        if not self._violations:
            logger.debug("Lagrangian.step() without a training call since the last step: no-op")
            return
        violation = torch.stack(self._violations).mean()  # ()
        self._violations = []
        self.multiplier.step(violation)

    def discard_pending(self) -> None:
        self._violations = []

    def to(self, device: torch.device) -> Lagrangian:
        self.multiplier.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"multiplier": self.multiplier.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multiplier.load_state_dict(state["multiplier"])
        self._violations = []


@OBJECTIVES.register("lagrangian")
def _build_lagrangian(
    *, eta: float, lambda_init: float, lambda_max: float, lambda_lr: float,
    lambda_momentum: float, lambda_dampening: float,
) -> Lagrangian:
    return Lagrangian(eta, lambda_init, lambda_max, lambda_lr, lambda_momentum, lambda_dampening)
