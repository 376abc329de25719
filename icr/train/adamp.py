"""AdamP (Heo et al., ICLR 2021) without a host synchronisation per parameter.

AdamP is the optimiser of the LTD reference code (via PCME). The authors' package (``adamp``)
decides per parameter, on the host, whether to project the update (``if cosine_sim.max() <
...``): each such test waits for the GPU, twice per weight matrix and step, so the CPU cannot run
ahead of the GPU. This implementation computes the same update with both branches evaluated on
the device and the choice made by ``torch.where``; its state (``step``, ``exp_avg``,
``exp_avg_sq`` per parameter) is laid out as the package's, and ``tests/test_train.py`` holds it
to the package's updates.

The update of a parameter ``p`` with gradient ``g`` (Algorithm 2 of the paper): Adam's
``perturb = m_hat / (sqrt(v_hat) + eps)``; for a weight of two or more dimensions, if
``max |cos(g, p)|`` over its output channels is below ``delta / sqrt(channel size)``, the
channel-wise projection of ``perturb`` off ``p`` and weight decay scaled by ``wd_ratio``;
otherwise the same test and projection over the whole weight as one vector; then
``p <- p (1 - lr wd wd_ratio) - lr / (1 - beta1^t) perturb``.

``capturable=True`` keeps each parameter's step count on its device and accepts a learning rate
given as a device tensor, so a step can be captured as a CUDA graph and replayed with the
schedule's current rate (:mod:`icr.train.graphs`), as torch's ``capturable`` optimisers do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


class AdamP(torch.optim.Optimizer):
    """AdamP with the package's defaults (``delta`` 0.1, ``wd_ratio`` 0.1), sync-free."""

    def __init__(
        self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8, weight_decay: float = 0.0, delta: float = 0.1, wd_ratio: float = 0.1,
        nesterov: bool = False, capturable: bool = False,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, delta=delta,
                        wd_ratio=wd_ratio, nesterov=nesterov, capturable=capturable)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: Tensor, group: dict[str, Any]) -> None:
        grad, state = p.grad, self.state[p]
        beta1, beta2 = group["betas"]
        if not state:
            capturable = group.get("capturable", False)
            state["step"] = torch.zeros((), device=p.device) if capturable else 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1  # in place for a tensor count
        step, lr = state["step"], group["lr"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias2 = 1 - beta2**step
        bias2_sqrt = bias2.sqrt() if isinstance(bias2, Tensor) else math.sqrt(bias2)
        denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(group["eps"])
        if group["nesterov"]:
            perturb = (beta1 * exp_avg + (1 - beta1) * grad) / denom
        else:
            perturb = exp_avg / denom
        wd = 1.0
        if p.dim() > 1:
            perturb, wd = _project(p, grad, perturb, group["delta"], group["wd_ratio"],
                                   group["eps"])
        if group["weight_decay"] > 0:
            p.mul_(1 - lr * group["weight_decay"] * wd)
        scale = lr / (1 - beta1**step)
        if isinstance(scale, Tensor):  # a device count or rate: no host read
            p.sub_(perturb * scale)
        else:
            p.add_(perturb, alpha=-scale)


def _project(p: Tensor, grad: Tensor, perturb: Tensor, delta: float, wd_ratio: float, eps: float
             ) -> tuple[Tensor, Tensor]:
    """The projected ``perturb`` and the weight-decay factor (1 or ``wd_ratio``), chosen on the
    device: the channel-wise projection if it applies, else the layer-wise one, else neither."""
    channels = (p.shape[0], -1)
    channel = _projection(p.reshape(channels), grad.reshape(channels),
                          perturb.reshape(channels), delta, eps)
    layer = _projection(p.reshape(1, -1), grad.reshape(1, -1), perturb.reshape(1, -1), delta,
                        eps)
    (c_applies, c_perturb), (l_applies, l_perturb) = channel, layer
    out = torch.where(c_applies, c_perturb.view_as(p),
                      torch.where(l_applies, l_perturb.view_as(p), perturb))
    wd = torch.where(c_applies | l_applies, wd_ratio, 1.0)
    return out, wd


def _projection(p: Tensor, grad: Tensor, perturb: Tensor, delta: float, eps: float
                ) -> tuple[Tensor, Tensor]:
    """Whether the projection applies in this view, and ``perturb`` projected off each row of
    ``p``. Shapes: ``(rows, n)`` views; returns a 0-d bool and ``(rows, n)``."""
    cosine = F.cosine_similarity(grad, p, dim=1, eps=eps).abs_()  # (rows,)
    applies = cosine.max() < delta / math.sqrt(p.shape[1])
    unit = p / p.norm(dim=1, keepdim=True).add_(eps)  # (rows, n)
    return applies, perturb - unit * (unit * perturb).sum(dim=1, keepdim=True)
