"""Every registered component trains where its task was built, without waiting for the device.

A training step and an evaluation run on PyTorch's ``meta`` device, which holds shapes and no
values: an op mixing a meta tensor with a CPU one fails ("Tensor on device cpu is not on the
expected device meta"), as a module left on the CPU fails on a GPU (VSE++'s frozen
EfficientNet-Lite0 did: "Input type (torch.cuda.FloatTensor) and weight type
(torch.FloatTensor) should be the same"); and reading a value on the host (``.item()``,
``bool(t)``, ``.cpu()``, a boolean-mask selection) fails, where on a GPU it would wait for every
kernel queued before it. A step that runs on ``meta`` is one a GPU runs without either.

The caches a task reads (frozen-CNN features, the vocabulary, latent targets) hold values, which
``meta`` cannot compute: a CPU build of the same configuration fills them first.
"""

from __future__ import annotations

import pytest
import torch

from icr.config import from_flat
from icr.data.features import compute_backbone_features
from icr.losses.contrastive import LOSSES
from icr.models.efficientnet import efficientnet_lite0, normalize
from icr.models.image import IMAGE_ENCODERS
from icr.models.pooling import POOLINGS
from icr.models.text import TEXT_ENCODERS
from icr.train.tasks import build_task

META, CPU = torch.device("meta"), torch.device("cpu")
SMALL = {"data.preset": "tiny", "train.batch_size": 8, "eval.batch_size": 16,
         "model.embed_dim": 16, "text.hidden_dim": 16, "image.hidden_dim": 16,
         "image.output_dim": 16, "image.gcn_layers": 1, "decoder.hidden_dim": 16,
         "decoder.word_dim": 8, "image.transformer_dim": 16, "image.transformer_layers": 1,
         "model.shared_dim": 16, "model.shared_layers": 1, "model.transformer_heads": 2,
         "model.transformer_ff_dim": 32, "text.bert_layers": 1, "data.image_size": 32,
         "train.warmup_epochs": 0, "train.finetune_epochs": 1}


def _config(**flat):
    return from_flat({**SMALL, **flat})


def _image(name: str) -> dict:
    """A configuration training image encoder ``name`` with a caption encoder that fits it."""
    out = {"image.encoder": name, "data.features": IMAGE_ENCODERS.meta(name)["input"]}
    if name == "tern":  # tied to TERN's caption encoder
        out["text.encoder"] = "tern"
    if name == "efficientnet_lite0":  # the real ImageNet weights, frozen: VSE++'s cached path
        out |= {"image.pretrained": True, "image.frozen": True, "image.random_erasing": 0.0}
    return out


def _text(name: str) -> dict:
    out = {"text.encoder": name, "data.features": "regions", "image.encoder": "region_tokens"}
    return out | ({"image.encoder": "tern"} if name == "tern" else {})


CASES = {
    **{f"image {n}": _image(n) for n in IMAGE_ENCODERS.names()},
    "image small_cnn, erased": {"image.encoder": "small_cnn", "data.features": "pixels",
                                "image.random_erasing": 1.0},
    "image efficientnet_lite0, fine-tuned": {"image.encoder": "efficientnet_lite0",
                                             "data.features": "pixels"},
    **{f"text {n}": _text(n) for n in TEXT_ENCODERS.names()},
    **{f"pooling {n}": {"data.features": "regions", "image.encoder": "region_tokens",
                        "text.encoder": "gru_tokens", "image.pooling": n, "text.pooling": n}
       for n in POOLINGS.names()},
    **{f"loss {n}": {"data.features": "regions", "image.encoder": "regions", "loss.name": n,
                     **({"train.sampler": "images", "train.batch_size": 4}
                        if n == "smoothap" else {})}
       for n in LOSSES.names()},
    "LTD, lagrangian": {"data.features": "regions", "image.encoder": "regions",
                        "decoder.name": "ltd", "objective.name": "lagrangian"},
    "ITD, dual": {"data.features": "regions", "image.encoder": "regions",
                  "decoder.name": "itd", "objective.name": "dual"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_and_an_evaluation_run_on_the_device_the_task_was_built_for(case, workspace):
    flat = CASES[case]
    torch.manual_seed(0)
    build_task(_config(**flat), workspace, CPU)  # fills the caches with values
    task = build_task(_config(**flat), workspace, META)
    placed = [*task.net.parameters(), *task.net.buffers()]
    assert placed and all(t.device == META for t in placed)
    task.net.train()
    batch = next(task.batches(0))
    out = task.train_step(batch, 0, 0)
    assert out.loss.device == META and all(v.device == META for v in out.terms.values())
    img, cap = task.embed_split("val")
    assert img.device == cap.device == META


def test_a_frozen_cnn_computes_its_features_on_the_device_asked_for():
    """The VSE++ crash: the backbone stayed on the CPU while its images went to the GPU."""
    cnn = efficientnet_lite0()  # on the CPU, as built
    images = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8)
    features = compute_backbone_features(cnn, images, normalize, batch_size=2, device=META)
    assert features.device == META and features.shape == (3, 1280)
