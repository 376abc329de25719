"""What an objective is: the base class, its output, the registry and ``build_objective``.

An objective combines ``L_con`` and an optional ``L_rec`` into the training loss; each one lives in
its own module of this package (:mod:`icr.objectives.contrastive`, :mod:`~icr.objectives.dual`,
:mod:`~icr.objectives.lagrangian`) with its ``@OBJECTIVES.register(name)`` builder, which takes the
``objective.*`` fields it uses.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from icr.config import ObjectiveConfig
from icr.errors import ConfigError
from icr.registry import Registry

OBJECTIVES: Registry = Registry("objective", section=ObjectiveConfig,
                                package="icr.objectives")


@dataclass(frozen=True)
class ObjectiveOutput:
    """The loss to back-propagate and detached scalars to log.

    ``logs`` holds 0-d tensors (``float()`` them when logging, so no device sync happens before):
    ``loss``, ``L_con``, ``L_rec`` when a reconstruction loss was given, ``lambda`` (Lagrangian).
    """

    loss: Tensor
    logs: dict[str, Tensor]


class Objective(abc.ABC):
    """Base class: combines ``L_con`` and an optional ``L_rec`` into the training loss."""

    uses_reconstruction: ClassVar[bool] = False

    @abc.abstractmethod
    def __call__(self, l_con: Tensor, l_rec: Tensor | None = None) -> ObjectiveOutput:
        """The training loss from ``L_con`` and, when the objective uses one, ``L_rec``."""

    def step(self) -> None:  # noqa: B027 - most objectives have no parameters of their own
        """Update the objective's own parameters after the model's optimiser step."""

    def discard_pending(self) -> None:  # noqa: B027 - most objectives keep nothing between
        """Forget what the calls since the last :meth:`step` left for it: a step that did not
        happen (a CUDA graph's capture that failed, :mod:`icr.train.graphs`)."""

    def to(self, device: torch.device) -> Objective:
        """Move the objective's own tensors (a multiplier) to the training device."""
        return self

    def metrics(self) -> dict[str, float]:
        """The objective's own state worth recording after an epoch (e.g. the multiplier)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")

    def _logs(self, loss: Tensor, l_con: Tensor, l_rec: Tensor | None) -> dict[str, Tensor]:
        logs = {"loss": loss.detach(), "L_con": l_con.detach()}
        if l_rec is not None:
            logs["L_rec"] = l_rec.detach()
        return logs

    def _require_rec(self, l_rec: Tensor | None) -> Tensor:
        if l_rec is None:
            raise ConfigError(
                f"objective {type(self).__name__.lower()!r} needs a reconstruction loss: "
                "set decoder.name to ltd or itd, or use objective.name=contrastive"
            )
        return l_rec


def build_objective(section: Any) -> Objective:
    """The objective named ``section.name`` built from an ``ObjectiveConfig``-like section.

    Raises:
        ConfigError: unknown name (listing the valid ones) or an invalid value.
    """
    return OBJECTIVES.build(section.name, section)
