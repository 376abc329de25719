"""The contrastive objective: ``L = L_con`` (Eq. 1 of the LTD paper)."""

from __future__ import annotations

from torch import Tensor

from icr.objectives.objective import OBJECTIVES, Objective, ObjectiveOutput


class Contrastive(Objective):
    """``L = L_con`` (Eq. 1). A given ``L_rec`` is logged but does not enter the loss."""

    def __call__(self, l_con: Tensor, l_rec: Tensor | None = None) -> ObjectiveOutput:
        return ObjectiveOutput(l_con, self._logs(l_con, l_con, l_rec))


@OBJECTIVES.register("contrastive")
def _build_contrastive() -> Contrastive:
    return Contrastive()
