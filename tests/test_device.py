"""What a GPU changes, checked on CPU: AMP is a no-op there (bit-identical training), bfloat16
where the GPU supports it and float16 with loss scaling elsewhere, cuDNN switches only on CUDA;
and, where a GPU is present, AMP really runs in reduced precision."""

from __future__ import annotations

import pytest
import torch

from icr.config import from_flat
from icr.train.device import Precision, configure_backends
from icr.train.tasks import build_task

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_amp_takes_effect_on_cuda_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert Precision.of(True, CUDA).enabled and not Precision.of(False, CUDA).enabled
    off = Precision.of(True, CPU)
    assert not off.enabled
    scaler = off.scaler()
    assert not scaler.is_enabled()
    loss = torch.tensor(2.5, requires_grad=True)
    assert scaler.scale(loss) is loss  # disabled: no scaling
    x = torch.randn(3, 4)
    with off.autocast():
        assert (x @ x.t()).dtype == torch.float32


def _config(amp: bool):
    return from_flat({
        "data.preset": "tiny", "data.features": "regions", "image.encoder": "regions",
        "model.embed_dim": 16, "text.hidden_dim": 16, "image.hidden_dim": 16,
        "image.output_dim": 16, "train.batch_size": 16, "train.warmup_epochs": 0,
        "train.finetune_epochs": 1, "train.swa": False, "train.amp": amp, "train.device": "cpu",
    })


def test_amp_on_cpu_trains_bit_identically_to_fp32(workspace):
    states = []
    for amp in (False, True):
        torch.manual_seed(0)
        task = build_task(_config(amp), workspace, CPU)
        assert not task.precision.enabled and not task.scaler.is_enabled()
        task.net.train()
        for step, batch in enumerate(task.batches(0, steps=2)):
            task.train_step(batch, 0, step)
        states.append(task.model_state())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_amp_is_bfloat16_without_a_scaler_where_the_gpu_supports_it(monkeypatch):
    """bfloat16 keeps float32's range: no loss scaling, so no skipped optimiser steps (the
    float16 scaler's first steps skip, and the scheduler then warns it stepped first)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    bf16 = Precision.of(True, CUDA)
    assert bf16.dtype == torch.bfloat16 and not bf16.scales_loss
    assert not bf16.scaler().is_enabled()
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    fp16 = Precision.of(True, CUDA)
    assert fp16.dtype == torch.float16 and fp16.scales_loss
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    forced = Precision.of(True, CUDA, "float16")
    assert forced.dtype == torch.float16 and forced.scales_loss


@pytest.fixture
def _restore_backends(monkeypatch):
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
             torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled())
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[:2]
    torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])


@pytest.mark.usefixtures("_restore_backends")
def test_cudnn_switches_only_on_cuda():
    import os

    before = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
              torch.are_deterministic_algorithms_enabled())
    configure_backends(CPU, deterministic=True)
    assert (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled()) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    configure_backends(CUDA, deterministic=True)
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    configure_backends(CUDA, deterministic=False)
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_amp_on_cuda_runs_in_reduced_precision_and_scales_float16_only():
    on = Precision.of(True, CUDA)
    x = torch.randn(4, 8, device="cuda")
    with on.autocast():
        assert (x @ x.t()).dtype == on.dtype
    fp16 = Precision.of(True, CUDA, "float16")
    loss = torch.tensor(1.0, device="cuda")
    assert fp16.scaler().is_enabled() and float(fp16.scaler().scale(loss)) > 1.0
