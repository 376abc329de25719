"""Token-set encoders: shapes and masks, padding never read, the bi-GRU against per-caption runs,
BERT from a tiny local model (no download), freezing hooks, missing paths, every pooling on top."""

from __future__ import annotations

import json

import pytest
import torch
from wordpieces import bert_inputs

from icr.errors import ConfigError
from icr.models.pooling import POOLINGS
from icr.models.tokens import (
    BertTokenEncoder,
    GRUTokenEncoder,
    RegionTokenEncoder,
    load_bert_tokenizer,
    resolve_transformer_dir,
)

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS += ["a", "red", "blue", "square", "circle", "on", "the", "left", "of", "."]
CAPTIONS = ["a red square.", "a blue circle on the left of the red square", "the circle"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory):
    """A 1-layer 16-d BERT and its word-level vocabulary tokenizer, saved as a local folder."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(str(folder))
    config = BertConfig(
        vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(folder))
    return folder


# ---------------------------------------------------------------- regions


def _regions(batch=3, num=5, dim=7):
    regions = torch.randn(batch, num, dim)
    mask = torch.ones(batch, num, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, [0, 2]] = False
    return regions, mask


def test_region_tokens_shapes_and_default_mask():
    encoder = RegionTokenEncoder(7, hidden_dim=12, output_dim=8)
    regions, _ = _regions()
    features, mask = encoder(regions)
    assert features.shape == (3, 5, 8) and encoder.output_dim == 8
    assert mask.dtype == torch.bool and bool(mask.all())
    assert list(encoder.backbone_parameters()) == []


@pytest.mark.parametrize("training", [True, False])
def test_region_padding_is_never_read(training):
    encoder = RegionTokenEncoder(7, hidden_dim=12, output_dim=8).train(training)
    regions, mask = _regions()
    garbage = regions.masked_fill(~mask[:, :, None], float("nan"))
    garbage = torch.cat([garbage, torch.full((3, 2, 7), 1e6)], dim=1)
    garbage_mask = torch.cat([mask, torch.zeros(3, 2, dtype=torch.bool)], dim=1)
    clean, _ = encoder(regions, mask)
    dirty, dirty_mask = encoder(garbage, garbage_mask)
    assert torch.equal(dirty_mask, garbage_mask)
    torch.testing.assert_close(dirty[:, :5][mask], clean[mask])
    assert bool((dirty[~garbage_mask] == 0).all())
    # BatchNorm statistics come from the real regions only
    assert torch.isfinite(encoder.norm.running_mean).all()
    if training:
        real = regions[mask]
        expected = 0.9 * torch.zeros(7) + 0.1 * real.mean(0)  # two updates of momentum 0.1
        torch.testing.assert_close(encoder.norm.running_mean, 0.9 * expected + 0.1 * real.mean(0))


# ---------------------------------------------------------------- bi-GRU


def _captions():
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0], [9, 0, 0, 0]])
    return tokens, torch.tensor([4, 2, 1])


def test_gru_tokens_are_the_averaged_directions_of_each_caption_alone():
    encoder = GRUTokenEncoder(12, embed_dim=5, hidden_dim=6).eval()
    tokens, lengths = _captions()
    features, mask = encoder(tokens, lengths)
    assert features.shape == (3, 4, 6) and encoder.output_dim == 6
    assert torch.equal(mask, torch.arange(4)[None, :] < lengths[:, None])
    with torch.no_grad():
        for b, n in enumerate(lengths.tolist()):
            out, _ = encoder.gru(encoder.embed(tokens[b : b + 1, :n]))  # (1, n, 12), no padding
            expected = (out[0, :, :6] + out[0, :, 6:]) / 2
            torch.testing.assert_close(features[b, :n], expected, atol=1e-6, rtol=1e-5)
            assert bool((features[b, n:] == 0).all())


def test_gru_tokens_ignore_extra_padding():
    encoder = GRUTokenEncoder(12, embed_dim=5, hidden_dim=6).eval()
    tokens, lengths = _captions()
    longer = torch.cat([tokens, torch.randint(1, 12, (3, 3))], dim=1)  # garbage ids, not 0
    longer[1, 2:4] = torch.tensor([5, 5])
    features, _ = encoder(tokens, lengths)
    more, mask = encoder(longer, lengths)
    assert mask.shape == (3, 7)
    torch.testing.assert_close(more[:, :4], features)


def test_gru_unidirectional_and_glove_initialisation_and_freezing():
    vectors = torch.randn(12, 5)
    encoder = GRUTokenEncoder(12, embed_dim=5, hidden_dim=6, pretrained_embeddings=vectors)
    assert torch.equal(encoder.embed.weight.detach(), vectors)
    encoder.set_embeddings_trainable(False)
    assert not encoder.embed.weight.requires_grad
    assert all(p.requires_grad for p in encoder.gru.parameters())
    assert list(encoder.backbone_parameters()) == []
    forward_only = GRUTokenEncoder(12, embed_dim=5, hidden_dim=6, bidirectional=False).eval()
    tokens, lengths = _captions()
    features, _ = forward_only(tokens, lengths)
    out, _ = forward_only.gru(forward_only.embed(tokens[:1]))
    torch.testing.assert_close(features[0], out[0], atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match="word_dim"):
        GRUTokenEncoder(12, embed_dim=4, pretrained_embeddings=vectors)


# ---------------------------------------------------------------- BERT


def test_bert_tokens_from_a_local_folder(tiny_bert):
    tokenizer = load_bert_tokenizer(tiny_bert)
    inputs = bert_inputs(CAPTIONS, tokenizer, max_len=8)
    encoder = BertTokenEncoder(tiny_bert, output_dim=10).eval()
    features, mask = encoder(inputs["input_ids"], inputs["lengths"])
    assert encoder.output_dim == 10 and features.shape == (*inputs["input_ids"].shape, 10)
    assert torch.equal(mask, inputs["attention_mask"])
    # [CLS] + words + [SEP], cut at max_len
    assert inputs["lengths"].tolist() == [6, 8, 4]
    assert inputs["input_ids"][0, 0] == tokenizer.cls_token_id
    assert inputs["input_ids"][0, 5] == tokenizer.sep_token_id


def test_bert_tokens_ignore_extra_padding(tiny_bert):
    tokenizer = load_bert_tokenizer(tiny_bert)
    inputs = bert_inputs(CAPTIONS, tokenizer, max_len=12)
    encoder = BertTokenEncoder(tiny_bert, output_dim=10).eval()
    ids, lengths = inputs["input_ids"], inputs["lengths"]
    longer = torch.cat([ids, torch.randint(5, len(WORDS), (3, 4))], dim=1)
    with torch.no_grad():
        features, mask = encoder(ids, lengths)
        more, _ = encoder(longer, lengths)
    torch.testing.assert_close(more[:, : ids.shape[1]][mask], features[mask], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_bert_reads_its_padding_mask_as_transformers_would_build_it(tiny_bert, implementation):
    """The encoder hands the model a prepared 4-d mask (a 2-d one makes transformers read it on
    the host at every forward): the outputs are those of the 2-d mask, in both attention
    implementations, with padding present."""
    tokenizer = load_bert_tokenizer(tiny_bert)
    inputs = bert_inputs(CAPTIONS, tokenizer, max_len=12)
    encoder = BertTokenEncoder(tiny_bert, output_dim=10).eval()
    encoder.transformer.set_attn_implementation(implementation)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert not mask.all()  # padding present: the comparison bites
    with torch.no_grad():
        features, _ = encoder(ids, inputs["lengths"])
        want = encoder.proj(encoder.transformer(input_ids=ids,
                                                attention_mask=mask.long()).last_hidden_state)
    torch.testing.assert_close(features[mask], want[mask], atol=1e-5, rtol=1e-5)


def test_bert_freezing_and_backbone_parameters(tiny_bert):
    encoder = BertTokenEncoder(tiny_bert, output_dim=10)
    backbone = {id(p) for p in encoder.backbone_parameters()}
    assert backbone == {id(p) for p in encoder.transformer.parameters()}
    assert not backbone & {id(p) for p in encoder.proj.parameters()}
    encoder.set_embeddings_trainable(False)
    encoder.train()
    assert not encoder.transformer.training and encoder.proj.training
    assert not any(p.requires_grad for p in encoder.transformer.parameters())
    ids = torch.tensor([[2, 5, 6, 3]])
    features, _ = encoder(ids, torch.tensor([4]))
    features.sum().backward()
    assert encoder.proj.weight.grad is not None
    encoder.set_embeddings_trainable(True)
    assert encoder.transformer.training
    assert all(p.requires_grad for p in encoder.transformer.parameters())


def test_missing_or_empty_bert_path_names_the_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=r"text\.bert_path=.*nowhere.*does not exist"):
        BertTokenEncoder(missing)
    with pytest.raises(ConfigError, match="holds no config.json"):
        load_bert_tokenizer(tmp_path)


def test_sentence_transformers_folder_resolves_to_its_transformer(tmp_path, tiny_bert):
    sub = tmp_path / "0_Transformer"
    sub.mkdir()
    for file in tiny_bert.iterdir():
        (sub / file.name).write_bytes(file.read_bytes())
    modules = [{"idx": 0, "name": "0", "path": "0_Transformer",
                "type": "sentence_transformers.models.Transformer"}]  # fmt: skip
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert resolve_transformer_dir(tmp_path) == sub
    assert BertTokenEncoder(tmp_path, output_dim=4).output_dim == 4


def test_default_is_the_bundled_minilm_offline():
    encoder = BertTokenEncoder(None, output_dim=8).eval()
    tokenizer = load_bert_tokenizer(None)
    inputs = bert_inputs(["a red square on the left"], tokenizer, max_len=16)
    with torch.no_grad():
        features, mask = encoder(inputs["input_ids"], inputs["lengths"])
    assert encoder.transformer.config.hidden_size == 384
    assert features.shape == (1, 8, 8) and bool(mask.all())


# ---------------------------------------------------------------- every pooling on top


@pytest.mark.parametrize("pooling", POOLINGS.names())
def test_every_pooling_applies_to_every_encoder(pooling, tiny_bert):
    region = RegionTokenEncoder(7, hidden_dim=12, output_dim=8)
    gru = GRUTokenEncoder(12, embed_dim=5, hidden_dim=8)
    bert = BertTokenEncoder(tiny_bert, output_dim=8)
    regions, region_mask = _regions()
    tokens, lengths = _captions()
    ids = bert_inputs(CAPTIONS, load_bert_tokenizer(tiny_bert), max_len=8)
    pool = POOLINGS.bind(pooling)(8)
    pooled = [
        pool(*region(regions, region_mask)),
        pool(*gru(tokens, lengths)),
        pool(*bert(ids["input_ids"], ids["lengths"])),
    ]
    total = sum(p.pow(2).sum() for p in pooled)
    total.backward()
    assert all(p.shape == (3, 8) and torch.isfinite(p).all() for p in pooled)
    for module in (region, gru, bert):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
