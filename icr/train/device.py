"""What running on a GPU changes: mixed precision, cuDNN and determinism.

Every trial trains on one device (Ray gives a trial one GPU and sets ``CUDA_VISIBLE_DEVICES``;
``train.device=auto`` then picks ``cuda``, which is that GPU). On CPU everything here is a no-op,
so the CPU test suite runs the same code paths the GPU does. Where the data sits and how batches
reach the device is :mod:`icr.data.batches`.

- :class:`Precision`: ``train.amp`` on CUDA is autocast around the forward pass and the losses,
  in bfloat16 where the GPU supports it (Ampere and later: float32's range, so no loss scaling
  and no skipped steps) and in float16 with a ``GradScaler`` elsewhere (the loss scaled before
  ``backward``, unscaled once before gradient clipping); ``train.amp_dtype`` forces either. On
  CPU both are disabled (``autocast`` is a null context, the scaler passes the loss and the
  optimiser step through).
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

import torch

__all__ = ["AMP_DTYPES", "Precision", "configure_backends"]

AMP_DTYPES = ("auto", "bfloat16", "float16")


@dataclass(frozen=True)
class Precision:
    """Mixed precision of one trial (module docstring): ``dtype`` ``None`` is full precision.

    Use :meth:`autocast` around the forward pass and the loss; :meth:`scaler` once per task (its
    state belongs in the checkpoint; it is enabled for float16 only). Keep similarity matrices
    fed to a loss in float32 (``sims.float()``): the loss's exponentials then run in full
    precision.
    """

    dtype: torch.dtype | None

    @classmethod
    def of(cls, amp: bool, device: torch.device, dtype: str = "auto") -> Precision:
        """``train.amp`` takes effect on CUDA only; ``auto`` is bfloat16 where supported."""
        if not amp or device.type != "cuda":
            return cls(None)
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return cls(torch.bfloat16 if dtype == "bfloat16" else torch.float16)

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        """The autocast context; ``cache=False`` for a step captured as a CUDA graph (the weight
        casts autocast caches would outlive the capture)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.dtype, cache_enabled=cache)

    @property
    def scales_loss(self) -> bool:
        """float16 overflows without loss scaling; bfloat16 has float32's range."""
        return self.dtype == torch.float16

    def scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cuda", enabled=self.scales_loss)


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
