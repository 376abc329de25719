"""Every registered component, built from a config the way a trial builds it, and every registry
finding its components by scanning its package.

Parametrised over the registries, so a new encoder, pooling or decoder is tested for building,
forward, backward and finite values without a new test (each also has its own oracle tests).
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pytest
import torch

from icr.config import from_flat, key_specs, used_keys
from icr.models.build import build_decoder, build_dual_encoder, caption_input_kind
from icr.models.decoders import DECODERS
from icr.models.image import IMAGE_ENCODERS
from icr.models.pooling import POOLINGS
from icr.models.text import TEXT_ENCODERS

# Every registry: those whose names a config key takes, and the COCOS counters (one per loss).
REGISTRIES = sorted({spec.registry for spec in key_specs().values() if spec.registry}
                    | {"icr.analysis.cocos:COCOS_COUNTERS"})

VOCAB, REGION_DIM, BATCH = 30, 12, 4
SMALL = {"model.embed_dim": 16, "text.hidden_dim": 16, "text.word_dim": 8, "image.hidden_dim": 16,
         "image.output_dim": 16, "image.gcn_layers": 1, "text.glove": "none",
         "decoder.hidden_dim": 16, "decoder.word_dim": 8, "image.transformer_dim": 16,
         "image.transformer_layers": 1, "model.shared_dim": 16, "model.shared_layers": 1,
         "model.transformer_heads": 2, "model.transformer_ff_dim": 32}


def _inputs(config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if config.data.features == "regions":
        images = torch.randn(BATCH, 5, REGION_DIM, generator=g)
    else:
        images = torch.randn(BATCH, 3, 32, 32, generator=g)
    lengths = torch.tensor([5, 3, 4, 2])
    tokens = torch.randint(1, VOCAB, (BATCH, 5), generator=g)
    tokens[torch.arange(5)[None, :] >= lengths[:, None]] = 0
    return images, tokens, lengths


def _check(config) -> None:
    regions = config.data.features == "regions"
    torch.manual_seed(0)
    model = build_dual_encoder(config, VOCAB, None, REGION_DIM if regions else None).train()
    img, cap = model(*_inputs(config))
    assert img.shape == cap.shape == (BATCH, 16)
    assert torch.isfinite(img).all() and torch.isfinite(cap).all()
    (img @ cap.t()).diagonal().sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", IMAGE_ENCODERS.names())
def test_every_image_encoder_builds_from_a_config_and_trains(name):
    features = IMAGE_ENCODERS.meta(name)["input"]
    _check(from_flat({**SMALL, "image.encoder": name, "data.features": features,
                      "image.pretrained": name == "efficientnet_lite0"}))


@pytest.mark.parametrize("name", [n for n in TEXT_ENCODERS.names()
                                  if TEXT_ENCODERS.meta(n).get("input", "vocab") == "vocab"])
@pytest.mark.parametrize("pooling", POOLINGS.names())
def test_every_vocabulary_caption_encoder_and_pooling(name, pooling):
    config = from_flat({**SMALL, "text.encoder": name, "text.pooling": pooling,
                        "image.encoder": "region_tokens", "image.pooling": pooling,
                        "data.features": "regions"})
    _check(config)
    assert ("text.pooling" in used_keys(config)) == (name != "gru")  # gru has no token set


@pytest.mark.parametrize("name", [n for n in TEXT_ENCODERS.names()
                                  if TEXT_ENCODERS.meta(n).get("input") == "wordpiece"])
def test_every_wordpiece_encoder_reads_wordpieces_and_trains(name):
    from icr.data.captions import WordpieceInput
    from icr.models.tokens import load_bert_tokenizer

    config = from_flat({**SMALL, "text.encoder": name, "data.features": "regions",
                        "image.encoder": "regions"})
    assert caption_input_kind(config) == "wordpiece"
    ids = WordpieceInput(load_bert_tokenizer(), 12, 0.0, 0.0)
    tokens = [ids.ids(c) for c in ("a red circle", "two blue squares on the left", "a star", "x")]
    padded = torch.nn.utils.rnn.pad_sequence(tokens, batch_first=True)
    lengths = torch.tensor([len(t) for t in tokens])
    model = build_dual_encoder(config, VOCAB, None, REGION_DIM).train()
    cap = model.encode_captions(padded, lengths)
    assert cap.shape == (4, 16) and torch.isfinite(cap).all()
    cap.square().sum().backward()
    # a BERT's pooler is loaded with it but never read: the encoders read its token states
    grads = [p.grad for n, p in model.caption_encoder.named_parameters() if ".pooler." not in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", DECODERS.names())
def test_every_decoder_builds_and_reconstructs(name):
    config = from_flat({**SMALL, "decoder.name": name})
    decoder = build_decoder(config, VOCAB, target_dim=6)
    if name == "none":
        assert decoder is None
        return
    captions = torch.nn.functional.normalize(torch.randn(BATCH, 16), dim=-1).requires_grad_()
    _, tokens, _ = _inputs(config)
    batch = {"targets": torch.randn(BATCH, 6), "clean_tokens": tokens}
    loss = decoder.loss(captions, batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert captions.grad is not None and torch.isfinite(captions.grad).all()


@pytest.mark.parametrize("path", REGISTRIES)
def test_every_registry_discovers_its_package(path):
    """Asking for the names imports every module of the registry's package, and every name is
    registered inside that package: a new component is one new module there, nothing else."""
    from icr.registry import resolve

    registry = resolve(path)
    assert registry.packages, f"{path} scans no package"
    names = registry.names()
    assert names
    for package in registry.packages:
        for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
            if not module.name.startswith("_"):
                assert f"{package}.{module.name}" in sys.modules
    for name in names:
        module = registry.get(name).__module__
        assert module.startswith(tuple(f"{p}." for p in registry.packages)), (name, module)


@pytest.mark.parametrize("path", REGISTRIES)
def test_a_registry_tied_to_a_section_names_a_section_of_the_config(path):
    """A registry takes its section's dataclass (so it never imports the config module) and
    derives its name: the config holds that dataclass under that name."""
    import dataclasses

    from icr.config import ExperimentConfig
    from icr.registry import resolve

    registry = resolve(path)
    if registry.section is None:
        return
    sections = {f.name: f.default_factory() for f in dataclasses.fields(ExperimentConfig)}
    assert type(sections[registry.section]) is registry.section_type


def test_arguments_take_section_options_and_only_the_offered_values_a_builder_names():
    """What a negative generator gets: its options from the config section, and of the offered
    values only those its signature names (a masked LM for one, a seed for another)."""
    from dataclasses import dataclass

    from icr.errors import ConfigError
    from icr.registry import Registry

    @dataclass(frozen=True)
    class ThingConfig:
        size: int = 3
        scale: float = 0.5

    things = Registry("thing", section=ThingConfig)

    @things.register("sized")
    def sized(*, size: int, seed: int = 0) -> tuple[int, int]:
        return size, seed

    @things.register("plain")
    def plain(*, lm: object = None) -> object:
        return lm

    section = ThingConfig(size=7)
    assert things.section_options("sized", section) == {"size": 7}
    assert things.arguments("sized", section, seed=4, lm="x") == {"size": 7, "seed": 4}
    assert things.arguments("plain", section, seed=4, lm="x") == {"lm": "x"}
    assert things.arguments("sized", section, size=9) == {"size": 9}  # offered wins
    assert things.build("sized", section, seed=2) == (7, 2)
    with pytest.raises(ConfigError, match="unknown thing 'other'"):
        things.arguments("other", section)
