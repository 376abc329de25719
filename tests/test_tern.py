"""TERN on a tiny config: shapes, gradients, padding never read, the shared layers really shared,
the first N BERT layers, the keys it reads (a tiny BERT built from a config; nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from wordpieces import bert_inputs

from icr.config import from_flat, used_keys
from icr.errors import ConfigError
from icr.models.build import build_dual_encoder
from icr.models.tern import TernCaptionEncoder, TernImageEncoder, TransformerStack
from icr.models.tokens import load_bert_tokenizer

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS += ["a", "red", "blue", "square", "circle", "on", "the", "left", "of", "."]
CAPTIONS = ["a red square.", "a blue circle on the left of the red square", "the circle"]
REGION_DIM, BATCH = 7, 3


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A 2-layer 16-d BERT and its word-level tokenizer, saved as a local folder."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    BertTokenizer(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(str(folder))
    config = BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(str(folder))
    return folder


def _config(tiny_bert, **extra):
    return from_flat({
        "data.features": "regions", "image.encoder": "tern", "text.encoder": "tern",
        "text.bert_path": str(tiny_bert), "image.transformer_dim": 12,
        "image.transformer_layers": 2, "model.shared_dim": 8, "model.shared_layers": 2,
        "model.transformer_heads": 2, "model.transformer_ff_dim": 16, "model.embed_dim": 6,
        **extra,
    })


def _captions(tiny_bert, max_len=12):
    inputs = bert_inputs(CAPTIONS, load_bert_tokenizer(tiny_bert), max_len=max_len)
    return inputs["input_ids"], inputs["lengths"]


def _regions(num=5):
    regions = torch.randn(BATCH, num, REGION_DIM)
    mask = torch.ones(BATCH, num, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, [0, 2]] = False  # real regions need not come first
    return regions, mask


def test_forward_backward_shapes_and_finite_values(tiny_bert):
    model = build_dual_encoder(_config(tiny_bert), 10, None, REGION_DIM).train()
    regions, _ = _regions()
    tokens, lengths = _captions(tiny_bert)
    img, cap = model(regions, tokens, lengths)
    assert img.shape == cap.shape == (BATCH, 6)
    assert torch.isfinite(img).all() and torch.isfinite(cap).all()
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(BATCH))
    (img @ cap.t()).diagonal().sum().backward()
    # BERT's pooler is loaded with the model but never read (the [CLS] token's state is)
    grads = {n: p.grad for n, p in model.named_parameters() if ".pooler." not in n}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), \
        [n for n, g in grads.items() if g is None]
    assert model.image_encoder.output_dim == model.caption_encoder.output_dim == 8


@pytest.mark.parametrize("training", [False, True])
def test_padded_regions_never_change_the_image_output(training):
    encoder = TernImageEncoder(REGION_DIM, region_dim=12, region_layers=2, shared_dim=8,
                               shared_layers=2, heads=2, ff_dim=16, dropout=0.0).train(training)
    regions, mask = _regions()
    garbage = regions.masked_fill(~mask[..., None], float("nan"))
    garbage = torch.cat([garbage, torch.full((BATCH, 3, REGION_DIM), 1e6)], dim=1)
    garbage_mask = torch.cat([mask, torch.zeros(BATCH, 3, dtype=torch.bool)], dim=1)
    clean = encoder(regions, mask)  # (B, 8)
    dirty = encoder(garbage, garbage_mask)
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, atol=1e-5, rtol=1e-5)
    # ... and each image alone, without any padded slot, gives its row (in evaluation mode: in
    # training the input BatchNorm standardises over the batch's real regions)
    for b in range(BATCH if not training else 0):
        alone = encoder(regions[b : b + 1, mask[b]])
        torch.testing.assert_close(alone[0], clean[b], atol=1e-5, rtol=1e-5)
    # a real region does change it (the output is not the CLS vector alone)
    moved = regions.clone()
    moved[0, 0] += 1.0
    assert not torch.allclose(encoder(moved, mask)[0], clean[0])


def test_padded_wordpieces_never_change_the_caption_output(tiny_bert):
    encoder = TernCaptionEncoder(tiny_bert, shared_dim=8, shared_layers=2, heads=2, ff_dim=16,
                                 dropout=0.0).eval()
    tokens, lengths = _captions(tiny_bert)
    longer = torch.cat([tokens, torch.randint(5, len(WORDS), (BATCH, 4))], dim=1)  # not [PAD]
    with torch.no_grad():
        clean = encoder(tokens, lengths)
        dirty = encoder(longer, lengths)
        alone = [encoder(tokens[b : b + 1, : int(n)], lengths[b : b + 1])[0]
                 for b, n in enumerate(lengths)]
    torch.testing.assert_close(dirty, clean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.stack(alone), clean, atol=1e-5, rtol=1e-5)


def test_the_shared_layers_are_one_parameter_set_for_both_streams(tiny_bert):
    model = build_dual_encoder(_config(tiny_bert), 10, None, REGION_DIM).eval()
    shared = model.image_encoder.shared
    assert isinstance(shared, TransformerStack) and model.caption_encoder.shared is shared
    ids = {id(p) for p in shared.parameters()}
    counted = [p for p in model.parameters() if id(p) in ids]
    assert len(counted) == len(ids) > 0  # an optimiser over model.parameters() sees them once
    # both streams' gradients reach the same tensors
    regions, _ = _regions()
    tokens, lengths = _captions(tiny_bert)
    model.encode_images(regions).sum().backward()
    from_images = [p.grad.clone() for p in shared.parameters()]
    model.zero_grad()
    model.encode_captions(tokens, lengths).sum().backward()
    from_captions = [p.grad.clone() for p in shared.parameters()]
    assert any(g.abs().sum() > 0 for g in from_images)
    assert any(g.abs().sum() > 0 for g in from_captions)
    # a change of the shared weights changes both towers' outputs
    with torch.no_grad():
        before = model(regions, tokens, lengths)
        for p in shared.parameters():
            p.add_(0.1)
        after = model(regions, tokens, lengths)
    assert not torch.allclose(before[0], after[0]) and not torch.allclose(before[1], after[1])
    # the tie survives a state-dict round trip
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert model.caption_encoder.shared is model.image_encoder.shared


def test_a_tern_side_alone_keeps_its_own_stack(tiny_bert):
    image_only = build_dual_encoder(_config(tiny_bert, **{"text.encoder": "gru",
                                                          "text.glove": "none"}),
                                    10, None, REGION_DIM)
    assert isinstance(image_only.image_encoder, TernImageEncoder)
    text_only = build_dual_encoder(_config(tiny_bert, **{"image.encoder": "regions"}),
                                   10, None, REGION_DIM)
    assert isinstance(text_only.caption_encoder, TernCaptionEncoder)
    assert text_only.caption_encoder.shared.num_layers == 2


def test_the_first_bert_layers_are_the_pretrained_ones(tiny_bert):
    full = TernCaptionEncoder(tiny_bert, shared_dim=8, heads=2, ff_dim=16)
    first = TernCaptionEncoder(tiny_bert, bert_layers=1, shared_dim=8, heads=2, ff_dim=16)
    layers = first.tokens.transformer.encoder.layer
    assert len(layers) == 1 and len(full.tokens.transformer.encoder.layer) == 2
    for a, b in zip(layers[0].parameters(), full.tokens.transformer.encoder.layer[0].parameters(),
                    strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match=r"text\.bert_layers=3 .* has 2 layers"):
        TernCaptionEncoder(tiny_bert, bert_layers=3, shared_dim=8, heads=2, ff_dim=16)


def test_bert_freezing_and_its_own_learning_rate(tiny_bert):
    encoder = TernCaptionEncoder(tiny_bert, shared_dim=8, heads=2, ff_dim=16,
                                 backbone_lr_factor=0.5)
    bert = {id(p) for p in encoder.tokens.transformer.parameters()}
    assert {id(p) for p in encoder.backbone_parameters()} == bert
    assert encoder.backbone_lr_factor == 0.5
    encoder.set_embeddings_trainable(False)
    assert not any(p.requires_grad for p in encoder.tokens.transformer.parameters())
    assert all(p.requires_grad for p in encoder.shared.parameters())


def test_heads_must_divide_the_width():
    with pytest.raises(ConfigError, match="model.transformer_heads=3"):
        TernImageEncoder(REGION_DIM, region_dim=8, shared_dim=8, heads=3)


def test_tern_keys_are_used_only_by_a_tern_configuration(tiny_bert):
    keys = set(used_keys(_config(tiny_bert)))
    tern_keys = {"image.transformer_layers", "image.transformer_dim", "text.bert_layers",
                 "model.shared_layers", "model.shared_dim", "model.transformer_heads",
                 "model.transformer_ff_dim", "model.transformer_dropout"}
    assert tern_keys <= keys
    other = set(used_keys(from_flat({"data.features": "regions", "image.encoder": "vsrn"})))
    assert not tern_keys & other
