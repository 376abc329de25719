"""The dual objective: ``L_dual = L_con + beta * L_rec`` (Eq. 7 of the LTD paper)."""

from __future__ import annotations

from torch import Tensor

from icr.errors import ConfigError
from icr.objectives.objective import OBJECTIVES, Objective, ObjectiveOutput


class Dual(Objective):
    """``L_dual = L_con + beta * L_rec`` (Eq. 7 of the LTD paper; the paper and reference use beta 1).

    Args:
        beta: weight of the reconstruction loss, >= 0.
    """

    uses_reconstruction = True

    def __init__(self, beta: float = 1.0) -> None:
        if beta < 0:
            raise ConfigError(f"objective.beta must be >= 0, got {beta}")
        self.beta = beta

    def __call__(self, l_con: Tensor, l_rec: Tensor | None = None) -> ObjectiveOutput:
        l_rec = self._require_rec(l_rec)
        loss = l_con + self.beta * l_rec
        return ObjectiveOutput(loss, self._logs(loss, l_con, l_rec))


@OBJECTIVES.register("dual")
def _build_dual(*, beta: float) -> Dual:
    return Dual(beta=beta)
