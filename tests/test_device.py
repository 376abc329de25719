"""What a GPU changes, checked on CPU: AMP is a no-op there (bit-identical training), loader options
per device, cuDNN switches only on CUDA; and, where a GPU is present, AMP really runs float16."""

from __future__ import annotations

import pytest
import torch

from icr.config import from_flat
from icr.train.device import (
    MAX_AUTO_WORKERS,
    Precision,
    configure_backends,
    loader_options,
    worker_count,
)
from icr.train.tasks import build_task

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_amp_takes_effect_on_cuda_only():
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
        for step, batch in zip(range(2), task.loader(0), strict=False):
            task.train_step(batch, 0, step)
        states.append(task.model_state())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


def test_loader_options_per_device(monkeypatch):
    assert loader_options(-1, CPU) == {"num_workers": 0, "pin_memory": False}
    assert loader_options(3, CPU) == {"num_workers": 3, "pin_memory": False}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert loader_options(-1, CUDA) == {"num_workers": 2, "pin_memory": True}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert worker_count(-1, CUDA) == MAX_AUTO_WORKERS
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert worker_count(-1, CUDA) == 1 and worker_count(0, CUDA) == 0


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
def test_amp_on_cuda_runs_float16_and_scales_the_loss():
    on = Precision.of(True, CUDA)
    x = torch.randn(4, 8, device="cuda")
    with on.autocast():
        assert (x @ x.t()).dtype == torch.float16
    scaler = on.scaler()
    loss = torch.tensor(1.0, device="cuda")
    assert scaler.is_enabled() and float(scaler.scale(loss)) > 1.0
