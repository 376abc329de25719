"""The static-shape GRU path against the packed one, and against a GRU run on each sequence alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from icr.models.pooling import GPO
from icr.models.recurrent import StaticShapes, run_gru, use_static_shapes
from icr.models.text import GRUCaptionEncoder
from icr.models.tokens import GRUTokenEncoder

LENGTHS = torch.tensor([5, 1, 3, 5, 2])  # the longest equals T; one sequence of one token


def _inputs(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(len(LENGTHS), 5, 4, generator=generator)  # (B, T, E)
    # garbage in the padding: neither path may read it
    real = torch.arange(5)[None, :] < LENGTHS[:, None]
    return inputs.masked_fill(~real[:, :, None], 1e3)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("static", [True, False])
def test_each_path_gives_the_states_of_a_gru_run_on_each_sequence_alone(bidirectional, static):
    torch.manual_seed(0)
    gru = nn.GRU(4, 3, batch_first=True, bidirectional=bidirectional)
    inputs = _inputs()
    outputs, summary = run_gru(gru, inputs, LENGTHS, static=static)
    dirs = 2 if bidirectional else 1
    assert outputs.shape == (5, 5, dirs * 3) and summary.shape == (dirs, 5, 3)
    for b, n in enumerate(LENGTHS.tolist()):
        alone, h_n = gru(inputs[b : b + 1, :n])  # (1, n, dirs * 3): no padding at all
        torch.testing.assert_close(outputs[b, :n], alone[0], atol=1e-6, rtol=1e-5)
        assert torch.all(outputs[b, n:] == 0)
        torch.testing.assert_close(summary[:, b], h_n[:, 0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_static_path_has_the_packed_path_s_gradients(bidirectional):
    torch.manual_seed(0)
    gru = nn.GRU(4, 3, batch_first=True, bidirectional=bidirectional)
    grads = []
    for static in (False, True):
        inputs = _inputs().requires_grad_(True)
        gru.zero_grad()
        outputs, summary = run_gru(gru, inputs, LENGTHS, static=static)
        (outputs.square().sum() + summary.sin().sum()).backward()
        real = torch.arange(5)[None, :] < LENGTHS[:, None]
        grads.append([inputs.grad * real[:, :, None], *(p.grad for p in gru.parameters())])
    for packed, static in zip(*grads, strict=True):
        torch.testing.assert_close(static, packed, atol=1e-5, rtol=1e-4)


def test_a_bidirectional_gru_of_two_layers_has_no_static_path():
    gru = nn.GRU(4, 3, num_layers=2, batch_first=True, bidirectional=True)
    with pytest.raises(ValueError, match="several layers"):
        run_gru(gru, _inputs(), LENGTHS, static=True)


@pytest.mark.parametrize("build", [
    lambda: GRUCaptionEncoder(20, embed_dim=4, hidden_dim=3),
    lambda: GRUCaptionEncoder(20, embed_dim=4, hidden_dim=3, merge="mean"),
    lambda: GRUTokenEncoder(20, embed_dim=4, hidden_dim=3),
])
def test_caption_encoders_give_the_same_output_on_both_paths(build):
    torch.manual_seed(0)
    encoder = build().eval()
    tokens = torch.randint(1, 20, (len(LENGTHS), 7))
    tokens[torch.arange(7)[None, :] >= LENGTHS[:, None]] = 0  # (B, 7): two padded columns
    packed = encoder(tokens, LENGTHS)
    use_static_shapes(encoder)
    assert isinstance(encoder, StaticShapes) and encoder.static_shapes
    static = encoder(tokens, LENGTHS)
    for a, b in zip(packed if isinstance(packed, tuple) else (packed,),
                    static if isinstance(static, tuple) else (static,), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_gpo_weights_are_the_same_on_both_paths():
    torch.manual_seed(0)
    pool = GPO(8)
    packed = pool.weight_table(6, torch.device("cpu"))
    use_static_shapes(pool)
    torch.testing.assert_close(pool.weight_table(6, torch.device("cpu")), packed,
                               atol=1e-6, rtol=1e-5)
