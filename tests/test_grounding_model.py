"""The word-region attention model: shapes, padding masks, a per-pair loop oracle, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from icr.errors import ConfigError
from icr.grounding.model import GROUNDING_MODELS, WordRegionAttention, build_grounding_model

WORD_DIM, REGION_DIM, DIM = 5, 7, 4


def _model(seed: int = 0) -> WordRegionAttention:
    torch.manual_seed(seed)
    model = WordRegionAttention(WORD_DIM, REGION_DIM, dim=DIM, word_hidden=6, region_hidden=8)
    with torch.no_grad():  # non-trivial running statistics, so eval mode is not an identity BN
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return model.double()


def _batch(seed: int = 1, n_captions: int = 3, n_images: int = 4, n_words: int = 4, n_regions: int = 5):
    g = torch.Generator().manual_seed(seed)
    words = torch.randn(n_captions, n_words, WORD_DIM, generator=g, dtype=torch.float64)
    regions = torch.randn(n_images, n_regions, REGION_DIM, generator=g, dtype=torch.float64)
    word_lengths = torch.tensor([n_words, 2, 1, 3][:n_captions])
    region_lengths = torch.tensor([n_regions, 3, 1, 4, 2][:n_images])
    word_mask = torch.arange(n_words)[None, :] < word_lengths[:, None]  # (B_c, W)
    region_mask = torch.arange(n_regions)[None, :] < region_lengths[:, None]  # (B_i, R)
    return words, word_mask, regions, region_mask


def _loop(model: WordRegionAttention, words, word_mask, regions, region_mask):
    """Eqs. 6-7 and phi, one (caption, image, word) at a time, each vector through the MLPs alone."""
    model.eval()
    logits = torch.zeros(words.shape[0], regions.shape[0], words.shape[1], dtype=words.dtype)
    attention = torch.zeros(*logits.shape, regions.shape[1], dtype=words.dtype)
    for c in range(words.shape[0]):
        for i in range(regions.shape[0]):
            valid = [r for r in range(regions.shape[1]) if region_mask[i, r]]
            keys = [model.region_key(regions[i, r][None])[0] for r in valid]
            values = [model.region_value(regions[i, r][None])[0] for r in valid]
            for w in range(words.shape[1]):
                if not word_mask[c, w]:
                    continue
                query = model.word_query(words[c, w][None])[0]
                value = model.word_value(words[c, w][None])[0]
                scores = torch.stack([query @ k / math.sqrt(DIM) for k in keys])
                att = torch.softmax(scores, 0)
                attended = sum(a * v for a, v in zip(att, values, strict=True))
                logits[c, i, w] = value @ attended
                for a, r in zip(att, valid, strict=True):
                    attention[c, i, w, r] = a
    return logits, attention


def test_forward_and_paired_shapes():
    model = _model()
    words, word_mask, regions, region_mask = _batch()
    out = model(words, word_mask, regions, region_mask, return_attention=True)
    assert out.logits.shape == (3, 4, 4)
    assert out.attention.shape == (3, 4, 4, 5)
    assert model(words, word_mask, regions, region_mask).attention is None
    paired = model.paired(words, word_mask, regions[:3], region_mask[:3])
    assert paired.logits.shape == (3, 4)
    assert paired.attention.shape == (3, 4, 5)
    with pytest.raises(ValueError, match="one image per caption"):
        model.paired(words, word_mask, regions, region_mask)


def test_forward_matches_per_pair_loop():
    model = _model()
    batch = _batch()
    expected_logits, expected_attention = _loop(model, *batch)
    out = model(*batch, return_attention=True)
    torch.testing.assert_close(out.logits, expected_logits, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.attention, expected_attention, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("training", [False, True])
def test_paired_is_the_diagonal_of_forward(training):
    model = _model().train(training)
    words, word_mask, regions, region_mask = _batch(n_captions=4, n_images=4)
    full = model(words, word_mask, regions, region_mask, return_attention=True)
    paired = model.paired(words, word_mask, regions, region_mask)
    index = torch.arange(4)
    torch.testing.assert_close(paired.logits, full.logits[index, index], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(paired.attention, full.attention[index, index])


def test_padded_regions_get_no_attention_and_valid_attention_sums_to_one():
    model = _model()
    words, word_mask, regions, region_mask = _batch()
    attention = model(words, word_mask, regions, region_mask, return_attention=True).attention
    assert (attention * ~region_mask[None, :, None, :]).abs().max() == 0
    sums = attention.sum(dim=-1)  # (B_c, B_i, W)
    expected = word_mask[:, None, :].expand_as(sums).to(sums.dtype)
    torch.testing.assert_close(sums, expected)


@pytest.mark.parametrize("training", [False, True])
def test_padding_content_does_not_change_valid_outputs(training):
    # In training mode BatchNorm uses batch statistics: padding must stay out of them too.
    model = _model().train(training)
    words, word_mask, regions, region_mask = _batch()
    first = model(words, word_mask, regions, region_mask, return_attention=True)
    noisy_words = words + 100.0 * (~word_mask)[..., None]
    noisy_regions = regions - 50.0 * (~region_mask)[..., None]
    second = model(noisy_words, word_mask, noisy_regions, region_mask, return_attention=True)
    torch.testing.assert_close(first.logits, second.logits)
    torch.testing.assert_close(first.attention, second.attention)
    assert (first.logits * ~word_mask[:, None, :]).abs().max() == 0  # padded words: zero logits


def test_image_without_regions_attends_to_nothing():
    model = _model()
    words, word_mask, regions, region_mask = _batch()
    region_mask[1] = False
    out = model(words, word_mask, regions, region_mask, return_attention=True)
    assert torch.isfinite(out.logits).all()
    assert out.attention[:, 1].abs().max() == 0
    assert out.logits[:, 1].abs().max() == 0


def test_backward_reaches_every_mlp_and_not_padding():
    model = _model().train()
    words, word_mask, regions, region_mask = _batch()
    words.requires_grad_(True)
    regions.requires_grad_(True)
    logits = model(words, word_mask, regions, region_mask).logits
    (logits**2).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    assert words.grad[~word_mask].abs().max() == 0
    assert regions.grad[~region_mask].abs().max() == 0
    assert words.grad[word_mask].abs().sum() > 0


def test_registry_builds_and_rejects_unknown_options():
    assert "word_region" in GROUNDING_MODELS
    model = build_grounding_model("word_region", word_dim=6, region_dim=9, dim=8)
    assert isinstance(model, WordRegionAttention)
    assert model.word_query[0].out_features == 6  # the paper: hidden size = input size
    assert model.region_key[0].out_features == 9
    assert model.region_value[-1].out_features == 8
    with pytest.raises(ConfigError, match="takes no option 'heads'"):
        build_grounding_model("word_region", word_dim=6, region_dim=9, heads=2)
    with pytest.raises(ConfigError, match="unknown grounding model"):
        build_grounding_model("nope", word_dim=6, region_dim=9)
