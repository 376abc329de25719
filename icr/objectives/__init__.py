"""Training objectives of the LTD paper: contrastive (Eq. 1), dual (Eq. 7), Lagrangian (Eq. 8-9).

A training loop uses every objective the same way::

    objective = build_objective(cfg.objective)
    out = objective(l_con, l_rec)      # l_rec is None without a decoder
    out.loss.backward()
    optimizer.step()                   # model parameters: lambda is a constant to them
    objective.step()                   # the multiplier's ascent step; a no-op for the others
    log({k: float(v) for k, v in out.logs.items()})

and checkpoints ``objective.state_dict()`` next to the model and optimiser. One objective per module,
registered by name in :data:`OBJECTIVES` (:mod:`icr.objectives.objective`); importing this package
registers every one.
"""

from icr.objectives.contrastive import Contrastive
from icr.objectives.dual import Dual
from icr.objectives.lagrangian import LagrangeMultiplier, Lagrangian
from icr.objectives.objective import OBJECTIVES, Objective, ObjectiveOutput, build_objective

__all__ = [
    "OBJECTIVES",
    "Contrastive",
    "Dual",
    "LagrangeMultiplier",
    "Lagrangian",
    "Objective",
    "ObjectiveOutput",
    "build_objective",
]
