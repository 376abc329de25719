"""LTD and ITD decoders: shapes, teacher forcing, conditioning, and fitting tiny problems."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from icr.losses import cosine_reconstruction_loss, token_nll_loss
from icr.models.decoders import InputTargetDecoder, LatentTargetDecoder


def test_ltd_shapes_and_architecture():
    decoder = LatentTargetDecoder(in_dim=12, hidden_dim=20, target_dim=7)
    assert decoder(torch.randn(4, 12)).shape == (4, 7)
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(12, 20), (20, 20), (20, 7)]
    assert sum(isinstance(m, torch.nn.ReLU) for m in decoder.modules()) == 2


def test_ltd_fits_a_fixed_target():
    torch.manual_seed(0)
    decoder = LatentTargetDecoder(in_dim=8, hidden_dim=32, target_dim=6)
    inputs = F.normalize(torch.randn(16, 8), dim=1)  # (B, D) caption embeddings
    targets = torch.randn(16, 6)  # (B, T) latent targets
    optimizer = torch.optim.Adam(decoder.parameters(), lr=1e-2)
    first = cosine_reconstruction_loss(decoder(inputs), targets).item()
    for _ in range(200):
        loss = cosine_reconstruction_loss(decoder(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert first > 0.5 and loss.item() < 0.1 * first


def test_itd_shapes_with_and_without_projection():
    tokens = torch.randint(1, 13, (3, 5))
    same = InputTargetDecoder(vocab_size=13, embed_dim=6, hidden_dim=10)
    assert isinstance(same.init_hidden, torch.nn.Identity)
    assert same(torch.randn(3, 10), tokens).shape == (3, 5, 13)
    projected = InputTargetDecoder(vocab_size=13, embed_dim=6, hidden_dim=10, in_dim=4)
    assert isinstance(projected.init_hidden, torch.nn.Linear)
    assert projected(torch.randn(3, 4), tokens).shape == (3, 5, 13)


def test_itd_is_causal_and_conditioned_on_the_caption_embedding():
    torch.manual_seed(1)
    decoder = InputTargetDecoder(vocab_size=9, embed_dim=4, hidden_dim=8)
    emb = torch.randn(2, 8)
    tokens = torch.randint(1, 9, (2, 6))
    logits = decoder(emb, tokens)
    changed = tokens.clone()
    changed[:, 3] = (tokens[:, 3] % 8) + 1  # a different token at t = 3
    later = decoder(emb, changed)
    # teacher forcing: logits[:, t] predicts tokens[:, t] from tokens[:, :t] only
    torch.testing.assert_close(logits[:, :4], later[:, :4])
    assert not torch.allclose(logits[:, 4:], later[:, 4:])
    assert not torch.allclose(decoder(torch.randn(2, 8), tokens)[:, 0], logits[:, 0])


def test_itd_pad_embedding_is_zero():
    decoder = InputTargetDecoder(vocab_size=9, embed_dim=4, hidden_dim=8, pad_index=0)
    assert decoder.embed.weight[0].abs().sum() == 0


def test_itd_fits_tiny_captions_from_their_embeddings():
    torch.manual_seed(2)
    decoder = InputTargetDecoder(vocab_size=10, embed_dim=8, hidden_dim=16)
    tokens = torch.tensor([[1, 4, 5, 2, 0], [1, 6, 7, 8, 2], [1, 9, 2, 0, 0]])
    emb = F.normalize(torch.randn(3, 16), dim=1)
    optimizer = torch.optim.Adam(decoder.parameters(), lr=2e-2)
    first = token_nll_loss(decoder(emb, tokens), tokens).item()
    for _ in range(100):
        loss = token_nll_loss(decoder(emb, tokens), tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.05 * first
