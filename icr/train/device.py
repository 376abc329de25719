"""What running on a GPU changes: mixed precision, the data loaders, cuDNN and determinism.

Every trial trains on one device (Ray gives a trial one GPU and sets ``CUDA_VISIBLE_DEVICES``;
``train.device=auto`` then picks ``cuda``, which is that GPU). On CPU everything here is a no-op,
so the CPU test suite runs the same code paths the GPU does.

- :class:`Precision`: ``train.amp`` on CUDA is float16 autocast around the forward pass and the
  losses, with a ``GradScaler`` scaling the loss before ``backward`` (unscaled once before
  gradient clipping); on CPU both are disabled (``autocast`` is a null context, the scaler passes
  the loss and the optimiser step through).
- :func:`loader_options`: on CUDA the training loader pins its batches in page-locked memory
  (so ``.to(device, non_blocking=True)`` overlaps the copy with compute) and uses worker
  processes; ``data.num_workers=-1`` (auto) means as many workers as the trial's CPU threads (Ray
  sets them to the CPUs reserved per trial), at most 4, on CUDA, and none on CPU, where workers
  would take the cores the training needs.
- :func:`configure_backends`: with ``train.deterministic`` (the default) cuDNN's autotuner is off
  (``cudnn.benchmark`` times candidate kernels on the first batches and may pick different ones
  in two runs, so two runs of one command would differ), cuDNN and cuBLAS use deterministic
  kernels, and PyTorch warns (rather than fails) where an op has no deterministic CUDA kernel
  (e.g. the backward of an embedding lookup, index_add): two runs of one command on one GPU then
  give the same numbers except through such ops. ``train.deterministic=false`` turns the
  autotuner on for speed. CPU kernels are deterministic for a fixed thread count, so CPU runs
  are left as they are.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Precision", "configure_backends", "loader_options", "worker_count"]

MAX_AUTO_WORKERS = 4


@dataclass(frozen=True)
class Precision:
    """Mixed precision of one trial: float16 autocast + loss scaling on CUDA, nothing elsewhere.

    Use :meth:`autocast` around the forward pass and the loss; :meth:`scaler` once per task (its
    state belongs in the checkpoint). Keep similarity matrices fed to a loss in float32
    (``sims.float()``): the loss's exponentials then run in full precision.
    """

    enabled: bool

    @classmethod
    def of(cls, amp: bool, device: torch.device) -> Precision:
        """``train.amp`` takes effect on CUDA only."""
        return cls(amp and device.type == "cuda")

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.float16)

    def scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cuda", enabled=self.enabled)


def worker_count(setting: int, device: torch.device) -> int:
    """DataLoader workers for ``data.num_workers``: itself when >= 0; auto (-1): the trial's CPU
    threads, at most :data:`MAX_AUTO_WORKERS`, on CUDA; 0 on CPU."""
    if setting >= 0:
        return setting
    if device.type != "cuda":
        return 0
    return max(1, min(MAX_AUTO_WORKERS, torch.get_num_threads()))


def loader_options(num_workers: int, device: torch.device) -> dict[str, Any]:
    """Keyword arguments of a training ``DataLoader`` on ``device`` (module docstring)."""
    workers = worker_count(num_workers, device)
    return {"num_workers": workers, "pin_memory": device.type == "cuda"}


def configure_backends(device: torch.device, deterministic: bool) -> None:
    """Set cuDNN / cuBLAS for a trial on ``device`` (module docstring); nothing on CPU.

    These are process-wide switches: one trial per process, set at the start of ``fit``.
    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts (the first matrix product on the
    GPU); an existing value is kept.
    """
    if device.type != "cuda":
        return
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
