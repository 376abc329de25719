"""What the training steps of an epoch leave for the host, kept on the device until it is read.

On a GPU a training step is queued, not run: reading one of its values (``float(loss)``,
``if not torch.isfinite(loss)``) makes the CPU wait until the GPU has finished everything queued,
so the CPU can no longer prepare the next steps while the GPU computes, and the GPU idles while
the CPU prepares. The steps therefore hand their logged terms to a :class:`StepLog`, which keeps
the epoch's sums, the trajectory rows and the first non-finite loss as device tensors, and reads
them every ``check_every`` steps (so a diverged run stops within that many steps) and at the end
of the epoch. On the CPU reading costs nothing and the same code runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from icr.errors import TrainingError

__all__ = ["CHECK_EVERY", "StepLog"]

CHECK_EVERY = 32  # steps between two reads of the non-finite flag
RowExtra = Callable[[], dict[str, float]]  # computed when the rows are read (e.g. COCOS counts)


class StepLog:
    """One epoch's step terms (module docstring).

    Args:
        epoch: the epoch (0-based), for messages and rows.
        fix: how to make a diverged run learn, for the error message (``lower optim.lr ...``).
        check_every: steps between reads of the non-finite flag.
    """

    def __init__(self, epoch: int, fix: str, check_every: int = CHECK_EVERY) -> None:
        self.epoch, self.fix, self.check_every = epoch, fix, check_every
        self.steps = 0
        self._sums: dict[str, Tensor] = {}
        self._rows: list[tuple[int, dict[str, Tensor], RowExtra | None]] = []
        self._first_bad: Tensor | None = None  # () step index of the first non-finite loss, -1
        self._bad_terms: dict[str, Tensor] = {}  # the terms of that step

    def add(self, loss: Tensor, terms: dict[str, Tensor], *, row_step: int | None = None,
            extra: RowExtra | None = None) -> None:
        """The terms of the next step; a trajectory row when ``row_step`` (the run's global step)
        is given, with ``extra`` values computed when the rows are read."""
        terms = {k: v.detach().float() for k, v in terms.items()}
        for name, value in terms.items():
            self._sums[name] = self._sums[name] + value if name in self._sums else value.clone()
        self._watch(loss.detach(), terms)
        if row_step is not None:
            self._rows.append((row_step, terms, extra))
        self.steps += 1
        if self.steps % self.check_every == 0:
            self.check()

    def _watch(self, loss: Tensor, terms: dict[str, Tensor]) -> None:
        """Remember the first non-finite loss and its terms, on the device."""
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.long, device=loss.device)
            self._bad_terms = {k: torch.zeros_like(v) for k, v in terms.items()}
        new = ~torch.isfinite(loss) & (self._first_bad < 0)  # ()
        self._first_bad = torch.where(new, self.steps, self._first_bad)
        self._bad_terms = {k: torch.where(new, v, self._bad_terms.get(k, v))
                           for k, v in terms.items()}

    def check(self) -> None:
        """Raise :class:`TrainingError` if a step's loss was not finite (a host sync)."""
        if self._first_bad is None or int(self._first_bad) < 0:
            return
        parts = ", ".join(f"{k}={float(v):.4g}" for k, v in self._bad_terms.items())
        raise TrainingError(f"non-finite loss at epoch {self.epoch + 1}, step "
                            f"{int(self._first_bad) + 1} ({parts}); {self.fix}")

    def means(self, exclude: tuple[str, ...] = ()) -> dict[str, float]:
        """The mean of each term over the epoch's steps (after :meth:`check`)."""
        self.check()
        return {f"train_{k}": float(v) / self.steps for k, v in self._sums.items()
                if k not in exclude}

    def rows(self) -> list[dict[str, float]]:
        """The trajectory rows, in step order: ``step``, ``epoch``, the terms, the extras."""
        out = []
        for step, terms, extra in self._rows:
            row = {"step": step, "epoch": self.epoch + 1}
            row |= {k: float(v) for k, v in terms.items()}
            out.append(row | (extra() if extra is not None else {}))
        self._rows = []
        return out
